"""python -m data_prep.librispeech --archives DIR --out DIR [--force]"""
from __future__ import annotations

from ..command import prep_command
from .prepare import OFFICIAL, prepare

main = prep_command(
    "librispeech",
    'Check the official LibriSpeech archives and unpack them into the tree '
    'torchaudio.datasets.LIBRISPEECH reads, with duration-sorted manifests. Safe to re-run; resumes '
    'an interrupted run.', prepare,
    source="--archives",
    source_help=f"folder holding <subset>.tar.gz for any of: {', '.join(OFFICIAL)}",
    out_help='output folder (about 60 GB for all of LibriSpeech)')

if __name__ == "__main__":
    main()
