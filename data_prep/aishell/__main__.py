"""python -m data_prep.aishell --archives DIR --out DIR [--force]"""
from __future__ import annotations

import argparse
from pathlib import Path

from mpt.errors import cli

from .prepare import ARCHIVE, prepare


@cli
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m data_prep.aishell",
        description="Check the official AISHELL-1 release (data_aishell.tgz) and unpack it into the "
                    "layout Kaldi and ESPnet recipes read, with duration-sorted manifests. Safe to re-run; "
                    "resumes an interrupted run.")
    p.add_argument("--archives", required=True, type=Path,
                   help=f"folder holding {ARCHIVE}")
    p.add_argument("--out", required=True, type=Path, help="output folder (about 20 GB)")
    p.add_argument("--force", action="store_true", help="redo a complete output from scratch")
    a = p.parse_args(argv)
    return prepare(a.archives, a.out, force=a.force)


if __name__ == "__main__":
    main()
