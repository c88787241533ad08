"""python -m data_prep.wmt15 --archives DIR --out DIR [--corpora a,b] [--vocab N] [--force]"""
from __future__ import annotations

import argparse

from mpt.errors import UserError

from ..command import prep_command
from .prepare import CORPORA, SPM_SENTENCES, URL, VOCAB, prepare


def _own_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpora", default="", help=f"comma-separated subset of {', '.join(CORPORA)} "
                                                 "(default: every one whose archive is in --archives)")
    p.add_argument("--vocab", type=int, default=VOCAB, help="subword vocabulary per language")
    p.add_argument("--spm-sentences", type=int, default=SPM_SENTENCES,
                   help="sentences per language, evenly spread over the training text, that train each subword model")


def _prepare(archives, out, corpora: str, spm_sentences: int, **kw) -> dict:
    if spm_sentences < 1:
        raise UserError("--spm-sentences must be at least 1")
    return prepare(archives, out, corpora=[c.strip() for c in corpora.split(",") if c.strip()] or None,
                   spm_sentences=spm_sentences, **kw)


main = prep_command(
    "wmt15", "Turn the WMT15 English-French downloads into SentencePiece id files, checking what it read "
    "(members, truncation, aligned line counts). Safe to re-run; resumes an interrupted run.", _prepare,
    source="--archives",
    source_help=f"folder holding the downloads from {URL} (training archives, dev.tgz, test-full.tgz)",
    out_help="output folder", extra=_own_options)

if __name__ == "__main__":
    main()
