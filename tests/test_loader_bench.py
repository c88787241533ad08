"""The loader benchmark (experiments/speed_memory/loader.py) runs an experiment's configured training
pipeline, resolved as a run resolves it, and ends with the per-core figure; bad input is one line. And
the ImageNet-sized photographs it is measured on (data_prep.imagenet.real_photos --imagenet-sizes)."""
import json
import re

import pytest

from data_prep.imagenet import real_photos
from experiments.speed_memory import loader
from mpt.errors import UserError


@pytest.mark.heavy
def test_loader_benchmark_measures_the_configured_pipeline(tiny_imagenet, tmp_path, capsys):
    r = loader.main(["ilsvrc_cnns", "profile=tiny", f"task.data_root={tiny_imagenet}", "train.batch_size=8",
                     "task.crop=24", "--samples", "16", "--workers", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"\d+\.\d samples/s per core", out[-1]), out[-1]
    assert float(out[-1].split()[0]) == round(r["per_core_samples_per_s"], 1) > 0
    assert [row["workers"] for row in r["rows"]] == [0, 1] and all(row["samples"] >= 16 for row in r["rows"])
    # the collated batch of the configured pipeline: float32 3 x 24 x 24 images (task.crop) and int64 labels
    # uint8 crops (the device normalises them) and an int64 label
    assert {row["bytes_per_sample"] for row in r["rows"]} == {3 * 24 * 24 + 8}
    assert (r["experiment"], r["augment"], r["micro_batch"]) == ("ilsvrc_cnns", "caffe", 8)
    saved = list(tmp_path.glob("cpu-*-loader-ilsvrc_cnns-resnet50_preact-24.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["per_core_samples_per_s"] == r["per_core_samples_per_s"]


@pytest.mark.parametrize("argv, says", [
    (["nope"], "unknown experiment 'nope'"),
    (["ilsvrc_cnns", "task.data_root=/nonexistent/imagenet"], "no prepared ImageNet at /nonexistent/imagenet"),
    (["ilsvrc_cnns", "train.num_workers=lots"], "expects an integer or auto"),
    (["ilsvrc_cnns", "--samples", "0"], "--samples 0"),
])
def test_bad_input_is_one_line(argv, says, tmp_path):
    with pytest.raises(UserError, match=re.escape(says)) as e:
        loader.main([*argv, "--out", str(tmp_path)])
    assert "\n" not in str(e.value)


@pytest.mark.skipif(bool(real_photos.missing()), reason="Debian's mate-backgrounds photographs not installed")
def test_imagenet_sized_photographs(tmp_path):
    from PIL import Image

    from data_prep.imagenet import prepare as prep

    args = ["--train-per-class", "2", "--val-per-class", "1", "--imagenet-sizes"]
    a = real_photos.main(["--out", str(tmp_path / "a"), *args])
    b = real_photos.main(["--out", str(tmp_path / "b"), *args])
    assert all(a[n].read_bytes() == b[n].read_bytes() for n in a)  # deterministic
    prep.prepare(tmp_path / "a", tmp_path / "prepared", workers=1, log=lambda *_: None)
    sizes = [Image.open(p).size for p in sorted((tmp_path / "prepared").glob("*/*/*.JPEG"))]
    assert len(sizes) == 36
    for w, h in sizes:
        assert 330 <= max(w, h) <= 1000 and abs(max(w, h) / min(w, h) - 4 / 3) < 0.01, (w, h)
