"""A small *real* translation task in the WMT15 archive formats, for checking the tiny recipe beyond
the synthetic grammar: English -> English phonemes.

    python -m data_prep.wmt15.real_g2p --out DIR [--seed 0]

Source: real English prose, the documentation that ships with every Python (pydoc_data.topics, as
data_prep.lm1b.real_text extracts it), cut at punctuation into clauses of 3 to 6 words.
Target: what espeak-ng's English rules and pronunciation dictionary say (`espeak-ng -q -x`, its
phoneme mnemonics with stress marks), e.g. "the value of x is returned" -> "D@ v'alju: 0v 'Eks Iz
rI2t'3:nd". Grapheme-to-phoneme conversion is a real sequence transduction with reordering-free but
context-dependent output (English spelling), long-tailed vocabulary and words unseen in training at
test time. It is not French; it is a real, offline-makeable second "language". The pairs are written
like data_prep.wmt15.tiny (Europarl + News Commentary archives, dev.tgz, SGML test-full.tgz), so
`python -m data_prep.wmt15` prepares them like the real WMT15 release. Needs the espeak-ng program
(setup.sh installs it); deterministic given --seed, the Python version and espeak-ng's version.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np

from mpt.errors import UserError

from ..command import generator_command
from .tiny import write_release


def clauses(min_words: int = 3, max_words: int = 6) -> list[str]:
    """The documentation's prose as clauses: word tokens between punctuation, in chunks of at most
    max_words, unique, in a fixed order."""
    from data_prep.lm1b.real_text import sentences

    out, seen = [], set()
    for sent in sentences():
        run: list[str] = []
        for tok in sent.split() + ["."]:
            if tok[0].isalnum():
                run.append(tok)
                continue
            for i in range(0, len(run), max_words):
                chunk = run[i:i + max_words]
                text = " ".join(chunk)
                if len(chunk) >= min_words and text not in seen:
                    seen.add(text)
                    out.append(text)
            run = []
    return out


def phonemes(lines: list[str], batch: int = 200) -> list[str]:
    """espeak-ng's phoneme transcription of each line: one process per batch of lines (one output
    line per input line), a process per line where a batch's output does not line up."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise UserError("espeak-ng is not installed; run setup.sh as root (apt-get install espeak-ng)")

    def run(text: str) -> list[str]:
        r = subprocess.run([exe, "-q", "-x"], input=text, capture_output=True, text=True, check=True)
        return [" ".join(x.split()) for x in r.stdout.split("\n") if x.strip()]

    out = []
    for k in range(0, len(lines), batch):
        part = lines[k:k + batch]
        got = run("\n".join(part) + "\n")
        if len(got) != len(part):
            got = [" ".join(run(s + "\n")) for s in part]
        out += got
    return out


def generate(out: Path, seed: int = 0, dev: int = 200, test: int = 300) -> Path:
    src = clauses()
    tgt = phonemes(src)
    pairs = [(s, t) for s, t in zip(src, tgt) if t]
    order = np.random.default_rng(seed).permutation(len(pairs))
    pairs = [pairs[i] for i in order]
    te, dv, tr = pairs[:test], pairs[test:test + dev], pairs[test + dev:]
    half = len(tr) * 2 // 3
    return write_release(out, {"europarl": tr[:half], "news_commentary": tr[half:]}, dv, te,
                         b"Real-data stand-in for WMT15 (data_prep.wmt15.real_g2p): English clauses from Python's "
                         b"bundled documentation -> espeak-ng phoneme transcriptions; not WMT15.\n")


main = generator_command("wmt15.real_g2p", __doc__.split("\n\n")[0], generate,
                         out_help="folder for the archives")


if __name__ == "__main__":
    main()
