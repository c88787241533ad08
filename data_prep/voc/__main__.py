"""python -m data_prep.voc --archives DIR --out DIR [--force]"""
from __future__ import annotations

import argparse
from pathlib import Path

from mpt.errors import cli

from .prepare import ARCHIVES, prepare


@cli
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m data_prep.voc",
        description="Check the official PASCAL VOC archives and unpack their detection parts into the "
                    "VOCdevkit tree torchvision.datasets.VOCDetection reads. Safe to re-run; resumes.")
    p.add_argument("--archives", required=True, type=Path, help=f"folder holding {', '.join(ARCHIVES)} "
                   "(the 2012 one optional)")
    p.add_argument("--out", required=True, type=Path, help="output folder (about 2.8 GB for VOC07 + VOC12)")
    p.add_argument("--force", action="store_true", help="redo a complete output")
    a = p.parse_args(argv)
    return prepare(a.archives, a.out, force=a.force)


if __name__ == "__main__":
    main()
