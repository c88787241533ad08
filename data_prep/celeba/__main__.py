"""python -m data_prep.celeba --archives DIR --out DIR [--force]"""
from __future__ import annotations

import argparse
from pathlib import Path

from mpt.errors import cli

from .prepare import ATTR, PARTITION, ZIP, prepare


@cli
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m data_prep.celeba",
        description="Check the official CelebA release and unpack it into the layout torchvision.datasets.CelebA "
                    "reads. Safe to re-run; resumes an interrupted run.")
    p.add_argument("--archives", required=True, type=Path, help=f"folder holding {ZIP}, {PARTITION} [and {ATTR}]")
    p.add_argument("--out", required=True, type=Path, help="output folder (about 1.4 GB for the real set)")
    p.add_argument("--force", action="store_true", help="redo a complete output from scratch")
    a = p.parse_args(argv)
    return prepare(a.archives, a.out, force=a.force)


if __name__ == "__main__":
    main()
