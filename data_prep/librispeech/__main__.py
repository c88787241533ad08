"""python -m data_prep.librispeech --archives DIR --out DIR [--force]"""
from __future__ import annotations

import argparse
from pathlib import Path

from mpt.errors import cli

from .prepare import OFFICIAL, prepare


@cli
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m data_prep.librispeech",
        description="Check the official LibriSpeech archives and unpack them into the tree "
                    "torchaudio.datasets.LIBRISPEECH reads, with duration-sorted manifests. Safe to re-run; "
                    "resumes an interrupted run.")
    p.add_argument("--archives", required=True, type=Path,
                   help=f"folder holding <subset>.tar.gz for any of: {', '.join(OFFICIAL)}")
    p.add_argument("--out", required=True, type=Path, help="output folder (about 60 GB for all of LibriSpeech)")
    p.add_argument("--force", action="store_true", help="redo a complete output from scratch")
    a = p.parse_args(argv)
    return prepare(a.archives, a.out, force=a.force)


if __name__ == "__main__":
    main()
