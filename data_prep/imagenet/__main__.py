"""python -m data_prep.imagenet --archives DIR --out DIR [--force] [--workers N]"""
from __future__ import annotations

from ..command import prep_command
from .prepare import ARCHIVES, prepare

main = prep_command(
    "imagenet", "Unpack the official ILSVRC2012 archives into OUT/{train,val}/<wnid>/ (torchvision "
    "ImageFolder layout), checking the counts. Safe to re-run.", prepare,
    source="--archives", source_help=f"folder holding {', '.join(ARCHIVES)}",
    out_help="output folder (about 140 GB for the real set)",
    workers_help="threads writing train classes in parallel (helps on network file systems)")

if __name__ == "__main__":
    main()
