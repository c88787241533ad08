"""python -m data_prep.lm1b --archive PATH --out DIR [--vocab FILE] [--force] [--workers N]"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..command import prep_command
from .prepare import ARCHIVE, MIN_COUNT, URL, prepare


def _own_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab", type=Path, default=None,
                   help="use this vocabulary file (one word per line, optionally 'word count') instead of "
                        f"counting the training shards (words seen >= {MIN_COUNT} times)")
    p.add_argument("--min-count", type=int, default=MIN_COUNT, help=argparse.SUPPRESS)


main = prep_command(
    "lm1b", "Turn the One Billion Word benchmark release into a vocabulary and uint32 token-id shards "
    "(read by memory map), checking what it read. Safe to re-run.", prepare,
    source="--archive", source_help=f"the downloaded {ARCHIVE} ({URL}) or the folder it unpacks to",
    out_help="output folder (about 3.5 GB for the real set)",
    workers_help="processes counting and encoding shards in parallel", extra=_own_options)

if __name__ == "__main__":
    main()
