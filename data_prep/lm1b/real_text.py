"""A small *real-English* One Billion Word release, for checking the tiny LM recipe on real text.

    python -m data_prep.lm1b.real_text --out DIR [--seed 0]

The synthetic release (data_prep.lm1b.tiny) is a grammar a tiny LSTM learns by design; a recipe
tuned to it alone says little about real text. This writes the prose of the documentation that
ships with every Python (pydoc_data.topics: the language reference, ~60K words, no download) in the
release's exact layout (99 training shards, 50 held-out shards, one sentence per line, lower-cased
words and punctuation separated by spaces, sentences shuffled across shards as in the benchmark),
so `python -m data_prep.lm1b` prepares it like the real benchmark. Code blocks (indented lines) are
left out. The test shard (heldout-00000) holds 8% of the sentences; the other held-out shards a few
each. Byte-for-byte deterministic given --seed and the Python version.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np


from ..command import generator_command
from .prepare import HELDOUT, TRAIN
from .tiny import write_release

_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?|[0-9]+|[.,;:!?()\"]")


def sentences() -> list[str]:
    """The documentation's prose as tokenised sentences (4 to 40 tokens)."""
    import pydoc_data.topics

    out = []
    for key in sorted(pydoc_data.topics.topics):
        prose = [ln for ln in pydoc_data.topics.topics[key].splitlines()
                 if ln.strip() and not ln.startswith((" ", "\t")) and not set(ln.strip()) <= set("*=-~^")]
        for sent in re.split(r"(?<=[.!?])\s+", " ".join(prose)):
            toks = _WORD.findall(sent.lower())
            if 4 <= len(toks) <= 40:
                out.append(" ".join(toks))
    return out


def generate(out: Path, seed: int = 0) -> Path:
    sents = sentences()
    order = np.random.default_rng(seed).permutation(len(sents))
    sents = [sents[i] for i in order]
    n_test = int(0.08 * len(sents))
    n_rest = 2 * (len(HELDOUT) - 1)  # two sentences in each other held-out shard
    test, rest, train = sents[:n_test], sents[n_test:n_test + n_rest], sents[n_test + n_rest:]

    def text(lines):
        return "".join(s + "\n" for s in lines).encode()

    heldout = [text(test)] + [text(rest[2 * i:2 * i + 2]) for i in range(len(HELDOUT) - 1)]
    shards = [text(train[i::len(TRAIN)]) for i in range(len(TRAIN))]
    return write_release(out, shards, heldout, b"Real-English stand-in for the One Billion Word benchmark "
                                               b"(data_prep.lm1b.real_text: Python's bundled documentation); "
                                               b"not the benchmark.\n")


main = generator_command("lm1b.real_text", __doc__.split("\n\n")[0], generate,
                         out_help="folder for the archive")


if __name__ == "__main__":
    main()
