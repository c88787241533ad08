"""python -m data_prep.imagenet --archives DIR --out DIR [--force] [--workers N]"""
from __future__ import annotations

import argparse
from pathlib import Path

from mpt.errors import UserError, cli

from .prepare import ARCHIVES, prepare


@cli
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m data_prep.imagenet",
        description="Unpack the official ILSVRC2012 archives into OUT/{train,val}/<wnid>/ "
                    "(torchvision ImageFolder layout), checking the counts. Safe to re-run.")
    p.add_argument("--archives", required=True, type=Path, help=f"folder holding {', '.join(ARCHIVES)}")
    p.add_argument("--out", required=True, type=Path, help="output folder (about 140 GB for the real set)")
    p.add_argument("--force", action="store_true", help="redo a complete output from scratch")
    p.add_argument("--workers", type=int, default=8,
                   help="threads writing train classes in parallel (helps on network file systems)")
    a = p.parse_args(argv)
    if a.workers < 1:
        raise UserError("--workers must be at least 1")
    return prepare(a.archives, a.out, force=a.force, workers=a.workers)


if __name__ == "__main__":
    main()
