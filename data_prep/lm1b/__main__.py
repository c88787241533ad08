"""python -m data_prep.lm1b --archive PATH --out DIR [--vocab FILE] [--force] [--workers N]"""
from __future__ import annotations

import argparse
from pathlib import Path

from mpt.errors import UserError, cli

from .prepare import ARCHIVE, MIN_COUNT, URL, prepare


@cli
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m data_prep.lm1b",
        description="Turn the One Billion Word benchmark release into a vocabulary and uint32 token-id shards "
                    "(read by memory map), checking what it read. Safe to re-run.")
    p.add_argument("--archive", required=True, type=Path,
                   help=f"the downloaded {ARCHIVE} ({URL}) or the folder it unpacks to")
    p.add_argument("--out", required=True, type=Path, help="output folder (about 3.5 GB for the real set)")
    p.add_argument("--vocab", type=Path, default=None,
                   help="use this vocabulary file (one word per line, optionally 'word count') instead of "
                        f"counting the training shards (words seen >= {MIN_COUNT} times)")
    p.add_argument("--min-count", type=int, default=MIN_COUNT, help=argparse.SUPPRESS)
    p.add_argument("--force", action="store_true", help="redo a complete output from scratch")
    p.add_argument("--workers", type=int, default=8, help="processes counting and encoding shards in parallel")
    a = p.parse_args(argv)
    if a.workers < 1:
        raise UserError("--workers must be at least 1")
    return prepare(a.archive, a.out, vocab=a.vocab, force=a.force, workers=a.workers, min_count=a.min_count)


if __name__ == "__main__":
    main()
