"""A tiny One Billion Word release, for tests and CPU demos: the official archive's layout and file
names (99 training shards, 50 held-out shards, one sentence per line, tokens separated by spaces)
holding a small, learnable synthetic English.

    python -m data_prep.lm1b.tiny --out DIR [--train-per-shard 40 --heldout-per-shard 40 --seed 0]

writes DIR/1-billion-word-language-modeling-benchmark-r13output.tar.gz, so the tests and the tiny
profile run the real `python -m data_prep.lm1b` path.

The language has structure a small LSTM learns within a few hundred steps but a unigram model cannot
see: subject-verb agreement across an optional adjective ("the old dog sees ..." / "the old dogs
see ..."), determiners that fix the number of their noun, counting sequences ("three four five six ."),
reported speech ("anna said that ..."), questions with fixed answers ("does the cat run ? yes .").
Every shard also holds a few one-off words ("rare017") so that the vocabulary's count threshold and
<UNK> are exercised. The output is byte-for-byte deterministic given the arguments.
"""
from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

import numpy as np

from mpt.errors import UserError
from mpt.rundir import atomic_write_bytes

from ..command import generator_command
from .prepare import ARCHIVE, HELDOUT, HELDOUT_DIR, TOP, TRAIN, TRAIN_DIR

MTIME = 1_325_376_000  # fixed archive times: reproducible bytes
NOUNS = ["cat", "dog", "bird", "horse", "farmer", "child", "teacher", "robot", "fish", "king", "queen", "baker"]
PLURAL = {"child": "children", "fish": "fish"}
ADJECTIVES = ["old", "young", "small", "big", "happy", "quiet", "red", "clever"]
VERBS = ["see", "like", "follow", "help", "find", "watch", "call", "feed", "know", "chase"]
INTRANSITIVE = ["run", "sleep", "sing", "jump", "wait"]
PREPOSITIONS = ["near", "behind", "with", "under"]
NAMES = ["anna", "ben", "carla", "dev", "emma", "felix"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]


def _plural(noun: str) -> str:
    return PLURAL.get(noun, noun + "s")


def _third(verb: str) -> str:
    return verb + ("es" if verb.endswith(("ch", "sh")) else "s")


def _noun_phrase(rng) -> tuple[list[str], bool]:
    """(words, plural?)"""
    noun = NOUNS[rng.integers(len(NOUNS))]
    plural = bool(rng.random() < 0.4)
    det = ["the", "some", "two"][rng.integers(3)] if plural else ["the", "a", "every"][rng.integers(3)]
    words = [det]
    if rng.random() < 0.5:
        words.append(ADJECTIVES[rng.integers(len(ADJECTIVES))])
    words.append(_plural(noun) if plural else noun)
    return words, plural


def _clause(rng) -> list[str]:
    subj, plural = _noun_phrase(rng)
    if rng.random() < 0.3:
        verb = INTRANSITIVE[rng.integers(len(INTRANSITIVE))]
        return subj + [verb if plural else _third(verb)]
    verb = VERBS[rng.integers(len(VERBS))]
    obj, _ = _noun_phrase(rng)
    words = subj + [verb if plural else _third(verb)] + obj
    if rng.random() < 0.3:
        words += [PREPOSITIONS[rng.integers(len(PREPOSITIONS))], "the", NOUNS[rng.integers(len(NOUNS))]]
    return words


def sentence(rng) -> list[str]:
    kind = rng.random()
    if kind < 0.15:  # counting: each word determines the next
        start = int(rng.integers(0, len(NUMBERS) - 3))
        n = int(rng.integers(3, min(8, len(NUMBERS) - start) + 1))
        return NUMBERS[start:start + n] + ["."]
    if kind < 0.3:
        return [NAMES[rng.integers(len(NAMES))], "said", "that"] + _clause(rng) + ["."]
    if kind < 0.4:
        subj, plural = _noun_phrase(rng)
        verb = INTRANSITIVE[rng.integers(len(INTRANSITIVE))]
        return ["do" if plural else "does"] + subj + [verb, "?", "yes" if rng.random() < 0.7 else "no", "."]
    return _clause(rng) + ["."]


def shard_text(rng, sentences: int, shard: int) -> bytes:
    lines = [sentence(rng) for _ in range(sentences)]
    # Two one-off words per shard: seen fewer than 3 times in all of training, so they become <UNK>.
    for k in range(2):
        line = lines[int(rng.integers(len(lines)))]
        line.insert(int(rng.integers(len(line))), f"rare{shard:03d}{k}")
    return "".join(" ".join(w) + "\n" for w in lines).encode()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), MTIME, 0o644
    tar.addfile(info, io.BytesIO(data))


def generate(out: Path, train_per_shard: int = 40, heldout_per_shard: int = 40, seed: int = 0) -> Path:
    """Write OUT/<official archive name>; return its path."""
    if train_per_shard < 1 or heldout_per_shard < 1:
        raise UserError("--train-per-shard and --heldout-per-shard must be at least 1")
    rng = np.random.default_rng(seed)
    train = [shard_text(rng, train_per_shard, i) for i in range(len(TRAIN))]
    heldout = [shard_text(rng, heldout_per_shard, 100 + i) for i in range(len(HELDOUT))]
    return write_release(out, train, heldout, b"Synthetic stand-in for the One Billion Word benchmark "
                                              b"(data_prep.lm1b.tiny); not the benchmark.\n")


def write_release(out: Path, train: list[bytes], heldout: list[bytes], readme: bytes) -> Path:
    """OUT/<official archive name> holding these shard texts (one sentence per line) under the
    release's folder and file names; return its path. Shared by every small stand-in release."""
    if len(train) != len(TRAIN) or len(heldout) != len(HELDOUT):
        raise ValueError(f"a release has {len(TRAIN)} training and {len(HELDOUT)} held-out shards")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            _add(tar, f"{TOP}/README", readme)
            for name, text in zip(TRAIN, train):
                _add(tar, f"{TOP}/{TRAIN_DIR}/{name}", text)
            for name, text in zip(HELDOUT, heldout):
                _add(tar, f"{TOP}/{HELDOUT_DIR}/{name}", text)
    path = out / ARCHIVE
    atomic_write_bytes(path, buf.getvalue())
    return path


main = generator_command(
    "lm1b.tiny", __doc__.split("\n\n")[0], generate, out_help="folder for the archive",
    options=[("--train-per-shard", 40, "sentences in each of the 99 training shards"),
             ("--heldout-per-shard", 40, "sentences in each of the 50 held-out shards")],
    done=lambda a, path, s: (f"wrote a tiny One Billion Word release ({99 * a.train_per_shard} training, "
                             f"{50 * a.heldout_per_shard} held-out sentences) to {path} in {s:.1f} s; next: "
                             f"python -m data_prep.lm1b --archive {path} --out DIR"))


if __name__ == "__main__":
    main()
