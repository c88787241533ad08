"""Faults of the last reliability audit's smaller kind: a prepared.json missing its keys, and a loader that
runs out of file descriptors, are one-line errors naming the file or the limit and the fix."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpt.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def test_a_prepared_json_missing_its_keys_is_one_line(tmp_path):
    from data_prep.prepared import read_prepared

    (tmp_path / "prepared.json").write_text(json.dumps({"dataset": "ILSVRC2012"}))
    info = read_prepared(tmp_path, "rerun the prep with --force")
    assert info["dataset"] == "ILSVRC2012"
    with pytest.raises(UserError, match=r"prepared.json has no 'train_images' entry.*--force") as e:
        info["train_images"]
    assert "\n" not in str(e.value)
    (tmp_path / "prepared.json").write_text("[1, 2")
    with pytest.raises(UserError, match="cannot read .*prepared.json"):
        read_prepared(tmp_path, "rerun")


def test_the_imagenet_folder_with_an_edited_marker_is_one_line(tmp_path):
    from data_prep.imagenet import prepare
    from data_prep.imagenet.dataset import ImageNetFolder
    from data_prep.imagenet.tiny import generate

    generate(tmp_path / "arch", classes=2, train_per_class=2, val_per_class=1, size=16)
    out = tmp_path / "prep"
    prepare.prepare(tmp_path / "arch", out, workers=1, log=lambda *a: None)
    info = json.loads((out / "prepared.json").read_text())
    del info["train_images"]
    (out / "prepared.json").write_text(json.dumps(info))
    with pytest.raises(UserError, match="has no 'train_images' entry.*--force") as e:
        ImageNetFolder(out, "train")
    assert "\n" not in str(e.value)


CHILD = r"""
import os, resource, sys, warnings, torch
from torch.utils.data import DataLoader, Dataset
from mpt.engine import open_files_limit
from mpt.config import Config
from mpt.errors import cli

class Few(Dataset):
    def __len__(self): return 64
    def __getitem__(self, i): return torch.zeros(8)

@cli
def main(argv=None):
    warnings.simplefilter("ignore")  # DataLoader's "more workers than cores" advice
    n = len(os.listdir("/proc/self/fd"))  # a limit just above what is open: the workers' pipes exceed it
    resource.setrlimit(resource.RLIMIT_NOFILE, (n + 6, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    with open_files_limit(Config()):
        for b in DataLoader(Few(), batch_size=4, num_workers=8):
            pass
    return 0

sys.exit(main())
"""


@pytest.mark.heavy
def test_a_loader_out_of_file_descriptors_is_one_line():
    r = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "ran out of file descriptors" in r.stderr and "ulimit -n" in r.stderr and "train.num_workers" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
