"""python -m data_prep.wmt15 --archives DIR --out DIR [--corpora a,b] [--vocab N] [--force]"""
from __future__ import annotations

import argparse
from pathlib import Path

from mpt.errors import UserError, cli

from .prepare import CORPORA, SPM_SENTENCES, URL, VOCAB, prepare


@cli
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m data_prep.wmt15",
        description="Turn the WMT15 English-French downloads into SentencePiece id files, checking what it read "
                    "(members, truncation, aligned line counts). Safe to re-run; resumes an interrupted run.")
    p.add_argument("--archives", required=True, type=Path,
                   help=f"folder holding the downloads from {URL} (training archives, dev.tgz, test-full.tgz)")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--corpora", default="", help=f"comma-separated subset of {', '.join(CORPORA)} "
                                                 "(default: every one whose archive is in --archives)")
    p.add_argument("--vocab", type=int, default=VOCAB, help="subword vocabulary per language")
    p.add_argument("--spm-sentences", type=int, default=SPM_SENTENCES,
                   help="sentences per language sampled to train each subword model")
    p.add_argument("--force", action="store_true", help="redo a complete output from scratch")
    a = p.parse_args(argv)
    if a.spm_sentences < 1:
        raise UserError("--spm-sentences must be at least 1")
    corpora = [c.strip() for c in a.corpora.split(",") if c.strip()] or None
    return prepare(a.archives, a.out, corpora=corpora, vocab=a.vocab, spm_sentences=a.spm_sentences, force=a.force)


if __name__ == "__main__":
    main()
