"""python -m data_prep.aishell --archives DIR --out DIR [--force]"""
from __future__ import annotations

from ..command import prep_command
from .prepare import ARCHIVE, prepare

main = prep_command(
    "aishell",
    'Check the official AISHELL-1 release (data_aishell.tgz) and unpack it into the layout Kaldi and '
    'ESPnet recipes read, with duration-sorted manifests. Safe to re-run; resumes an interrupted run.', prepare,
    source="--archives",
    source_help=f"folder holding {ARCHIVE}",
    out_help='output folder (about 20 GB)')

if __name__ == "__main__":
    main()
