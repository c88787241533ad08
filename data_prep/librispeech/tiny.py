"""A tiny LibriSpeech release for tests and CPU demos: the official archive format
(train-clean-100.tar.gz, dev-clean.tar.gz; LibriSpeech/<subset>/<spk>/<chapter>/ FLACs and
.trans.txt) holding real synthesized speech from espeak-ng.

    python -m data_prep.librispeech.tiny --out DIR [--train 480 --dev 60 --text words|python-docs --seed 0]

Each speaker is an espeak-ng voice (an English accent + a voice variant); every utterance draws its
own rate and pitch, gain, silence and room noise. Dev speakers use voices not heard in training (as
LibriSpeech's dev speakers are not training speakers). --text words: sentences of 3-6 words from a
40-word vocabulary (learnable in minutes on a CPU); --text python-docs: real English from Python's
bundled documentation (pydoc_data; thousands of words, utterances of 4-8 words), to check the recipe is not tuned to
the small vocabulary. Deterministic given the arguments and the espeak-ng version.
"""
from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np

from data_prep.archives import add_member, tar_gz_writer
from data_prep.command import generator_command
from data_prep.speech import encode, espeak
from mpt.errors import UserError
from mpt.rundir import atomic_write_bytes

from .prepare import ROOT

WORDS = ("the a one two three four five six seven eight nine ten red blue green black white big small old new "
         "cat dog bird fish horse tree house car boat road river sees likes finds takes runs near over under "
         "and").split()
ACCENTS = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-029")
TRAIN_VARIANTS = ("m1", "m2", "m3", "m4", "m6", "f1", "f2", "f3", "f5", "klatt")
DEV_VARIANTS = ("m5", "m7", "f4", "klatt2")


def word_sentences(rng: np.random.Generator, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 7)))) for _ in range(n)]


def doc_sentences(rng: np.random.Generator, n: int) -> list[str]:
    """Real English from Python's documentation: its sentences without punctuation (which is not
    spoken) and without digits, cut into utterances of 4-8 words."""
    from data_prep.lm1b.real_text import sentences

    out = set()
    for s in sentences():
        words = [t for t in s.split() if t not in ".,;:!?()\""]
        if not all(re.fullmatch(r"[a-z]+(?:'[a-z]+)?", w) for w in words):
            continue
        for i in range(0, len(words) - 3, 8):
            out.add(" ".join(words[i:i + 8]))
    out = sorted(out)
    if len(out) < n:
        raise UserError(f"Python's documentation gives only {len(out)} utterances; ask for fewer")
    return [out[i] for i in rng.permutation(len(out))[:n]]


def write_subset(path: Path, subset: str, sentences: list[str], variants, rng, first_speaker: int,
                 per_chapter: int = 20) -> None:
    """One <subset>.tar.gz: speakers of `per_chapter`-utterance chapters, one chapter each."""
    buf = io.BytesIO()
    with tar_gz_writer(buf) as tf:
        add_member(tf, f"{ROOT}/README.TXT", b"Tiny synthetic LibriSpeech (espeak-ng voices); not the corpus.\n")
        for c, start in enumerate(range(0, len(sentences), per_chapter)):
            spk, ch = str(first_speaker + c), str(100 + c)
            accent, variant = ACCENTS[c % len(ACCENTS)], variants[(c * 3) % len(variants)]
            folder = f"{ROOT}/{subset}/{spk}/{ch}"
            lines = []
            for u, text in enumerate(sentences[start:start + per_chapter]):
                uid = f"{spk}-{ch}-{u:04d}"
                x = espeak(text, f"{accent}+{variant}", int(rng.integers(130, 211)), int(rng.integers(25, 76)), rng)
                add_member(tf, f"{folder}/{uid}.flac", encode(x, "FLAC"))
                lines.append(f"{uid} {text.upper()}\n")
            add_member(tf, f"{folder}/{spk}-{ch}.trans.txt", "".join(lines).encode())
    atomic_write_bytes(path, buf.getvalue())


def generate(out: Path, train: int = 480, dev: int = 60, text: str = "words", seed: int = 0) -> Path:
    out = Path(out)
    rng = np.random.default_rng(seed)
    if text not in ("words", "python-docs"):
        raise UserError(f"--text {text!r}: choose words or python-docs")
    sents = word_sentences(rng, train + dev) if text == "words" else doc_sentences(rng, train + dev)
    write_subset(out / "train-clean-100.tar.gz", "train-clean-100", sents[:train], TRAIN_VARIANTS, rng, 1000)
    write_subset(out / "dev-clean.tar.gz", "dev-clean", sents[train:], DEV_VARIANTS, rng, 5000)
    return out


main = generator_command(
    "librispeech.tiny", __doc__.split("\n\n")[0], generate, out_help="folder for the archives",
    options=[("--train", 480), ("--dev", 60),
             ("--text", "words", "words (small vocabulary) or python-docs (real English)")],
    done=lambda a, path, s: f"wrote {path}/train-clean-100.tar.gz and dev-clean.tar.gz")


if __name__ == "__main__":
    main()
