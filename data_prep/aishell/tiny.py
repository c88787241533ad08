"""A tiny AISHELL-1 release for tests and CPU demos: the official format (data_aishell.tgz holding
data_aishell/wav/<speaker>.tar.gz of 16 kHz WAVs and data_aishell/transcript/aishell_transcript_v0.8.txt
with space-separated words) holding real synthesized Mandarin from espeak-ng (`-v cmn`).

    python -m data_prep.aishell.tiny --out DIR [--train 480 --dev 240 --test 20 --seed 0]

Sentences are 4-9 characters, grouped into words of 1-3 characters like the release's segmentation,
from a vocabulary of 59 characters that espeak-ng pronounces differently from one another (its
Debian Mandarin dictionary reads many characters through their pinyin, and several share one
reading: 的/地/得, 他/她, 是/事/市 -- one of each is kept), the k-th of them drawn with weight 1/k
(Zipf's law, as the characters of real text fall: a few are frequent, most rare). Each speaker is a
voice variant; every utterance draws its own rate (180-300 words a minute: ~1.9 s for 6.5 characters)
and pitch, gain, silence and room noise; dev and test speakers use voices not heard in training. One
training WAV has no transcript line, as in the real release. Deterministic given the arguments and the
espeak-ng version.

240 dev utterances (~1,570 characters): on 60 (401 characters) the tiny profile's CER moved by ~2 points from
one sample of dev sentences to another, most of the spread between its seeds
(experiments/deepspeech2/README.md, "The blank's prior").
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from data_prep.archives import add_member, tar_gz_writer
from data_prep.command import generator_command
from data_prep.speech import encode, espeak
from mpt.rundir import atomic_write_bytes

from .prepare import ARCHIVE, ROOT, TRANSCRIPT

CHARS = ("我是中上说为时生之而于成只无手用长二五场水吃"  # espeak-ng's own Mandarin readings
         "你他不了在人有这大来国们和出年要下去家学小心天好都没看开三一七八北海山车书")
TRAIN_VARIANTS = ("m1", "m2", "m3", "m4", "m6", "f1", "f2", "f3", "f5", "klatt")
HELDOUT_VARIANTS = ("m5", "m7", "f4", "klatt2")


def sentences(rng: np.random.Generator, n: int) -> list[list[str]]:
    """n sentences as lists of words (1-3 characters each), 4-9 characters in all, the k-th character of
    CHARS drawn with weight 1/k. (Drawn uniformly, every tiny-profile seed sat on CTC's all-blank plateau
    for half its run and left it at its own step: experiments/deepspeech2/README.md, "The tiny Mandarin
    release".)"""
    weights = 1.0 / np.arange(1, len(CHARS) + 1)
    weights /= weights.sum()
    out = []
    for _ in range(n):
        chars = list(rng.choice(list(CHARS), size=int(rng.integers(4, 10)), p=weights))
        words = []
        while chars:
            k = min(len(chars), int(rng.integers(1, 4)))
            words.append("".join(chars[:k]))
            chars = chars[k:]
        out.append(words)
    return out


def _speaker(split: str, spk: str, utts: list[tuple[str, list[str]]], variant: str, rng) -> bytes:
    buf = io.BytesIO()
    with tar_gz_writer(buf) as tf:
        for uid, words in utts:
            x = espeak("".join(words), f"cmn+{variant}", int(rng.integers(180, 301)), int(rng.integers(25, 76)), rng)
            add_member(tf, f"{split}/{spk}/{uid}.wav", encode(x, "WAV"))
    return buf.getvalue()


def generate(out: Path, train: int = 480, dev: int = 240, test: int = 20, seed: int = 0,
             per_speaker: int = 20) -> Path:
    out = Path(out)
    rng = np.random.default_rng(seed)
    sents = iter(sentences(rng, train + dev + test + 1))
    lines, speakers, s = [], [], 2
    # train gets one WAV more than it has transcript lines, as in the real release
    for split, n, variants in (("train", train + 1, TRAIN_VARIANTS), ("dev", dev, HELDOUT_VARIANTS),
                               ("test", test, HELDOUT_VARIANTS)):
        for start in range(0, n, per_speaker):
            spk = f"S{s:04d}"
            utts = [(f"BAC009{spk}W{j + 1:04d}", next(sents)) for j in range(start, min(n, start + per_speaker))]
            speakers.append((spk, _speaker(split, spk, utts, variants[(s * 3) % len(variants)], rng)))
            lines += [f"{uid} {' '.join(w)}\n" for uid, w in utts]
            s += 1
        if split == "train":
            lines.pop()
    buf = io.BytesIO()
    with tar_gz_writer(buf) as tf:
        for spk, data in speakers:
            add_member(tf, f"{ROOT}/wav/{spk}.tar.gz", data)
        add_member(tf, TRANSCRIPT, "".join(sorted(lines)).encode())
    atomic_write_bytes(out / ARCHIVE, buf.getvalue())
    return out / ARCHIVE


main = generator_command(
    "aishell.tiny", __doc__.split("\n\n")[0], generate, out_help="folder for data_aishell.tgz",
    options=[("--train", 480), ("--dev", 240), ("--test", 20)])


if __name__ == "__main__":
    main()
