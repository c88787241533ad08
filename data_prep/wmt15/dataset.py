"""Reading a prepared WMT15 folder (data_prep/wmt15/prepare.py): sentence pairs of subword ids."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from data_prep.prepared import check_id_file, read_prepared
from mpt.errors import UserError
from mpt.rundir import sampled_digest

from .prepare import MARKER, SRC, TGT


class Prepared:
    def __init__(self, root):
        self.root = Path(root)
        if not (self.root / MARKER).is_file():
            raise UserError(f"{self.root} is not a prepared WMT15 folder (no {MARKER}); run "
                            f"`python -m data_prep.wmt15 --archives DIR --out {self.root}` "
                            f"(or data_prep.wmt15.tiny for the CPU set)")
        self.info = read_prepared(self.root, f"rerun python -m data_prep.wmt15 --archives DIR --out {self.root} --force")
        self.vocab = self.info["vocab"]  # {"en": n, "fr": n}
        self.special = self.info["special_ids"]
        for lang, digest in self.info.get("spm_digest", {}).items():  # the subword models BLEU decodes with
            path = self.root / f"spm.{lang}.model"
            if not path.is_file() or sampled_digest(path) != digest:
                raise UserError(f"{path} is missing or changed since it was prepared ({MARKER} records digest "
                                f"{digest}); prepare the folder again (python -m data_prep.wmt15 ... --force)")

    def split(self, name: str) -> "Pairs":
        return Pairs(self.root, name, self.info["dtype"], self.vocab)

    def spm(self, lang: str):
        import sentencepiece as spm

        return spm.SentencePieceProcessor(model_file=str(self.root / f"spm.{lang}.model"))

    def text(self, split: str, lang: str) -> list[str]:
        return (self.root / f"{split}.{lang}.txt").read_text(encoding="utf-8").split("\n")[:-1]


class Pairs(torch.utils.data.Dataset):
    """Pair i = (source ids, target ids) as int64 tensors, read from memory-mapped id files."""

    def __init__(self, root: Path, split: str, dtype: str, vocab: dict[str, int] | None = None):
        """`vocab` ({lang: size}): every id is checked to be below it, and the offsets to cut the ids
        in order (a file edited after its prep is one line here, not a traceback in training)."""
        self.bins, self.offs = {}, {}
        fix = "prepare the folder again (python -m data_prep.wmt15 ... --force)"
        for lang in (SRC, TGT):
            try:
                self.offs[lang] = np.fromfile(root / f"{split}.{lang}.idx", dtype=np.int64)
                b = root / f"{split}.{lang}.bin"
                if vocab is not None:
                    check_id_file(b, dtype, vocab[lang], fix)
                self.bins[lang] = (np.memmap(b, dtype=dtype, mode="r") if b.stat().st_size
                                   else np.zeros(0, dtype=dtype))
            except OSError as e:
                raise UserError(f"{root}: {split}.{lang} unreadable ({e}); prepare the folder again") from None
            o = self.offs[lang]
            if o.size < 1 or o[0] != 0 or o[-1] != len(self.bins[lang]) or (np.diff(o) < 0).any():
                raise UserError(f"{root / f'{split}.{lang}.idx'} does not cut {split}.{lang}.bin into sentences "
                                f"(offsets not increasing from 0 to its {len(self.bins[lang]):,} ids); {fix}")
        if len(self.offs[SRC]) != len(self.offs[TGT]):
            raise UserError(f"{root}: {split} has {len(self.offs[SRC]) - 1} {SRC} and {len(self.offs[TGT]) - 1} "
                            f"{TGT} sentences; prepare the folder again")
        self.index = np.arange(len(self.offs[SRC]) - 1)

    def lengths(self, lang: str) -> np.ndarray:
        o = self.offs[lang]
        return (o[1:] - o[:-1])[self.index]

    def keep(self, mask: np.ndarray) -> None:
        """Keep only the pairs where mask is true (length filtering)."""
        self.index = self.index[mask]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        j = int(self.index[i])
        out = []
        for lang in (SRC, TGT):
            o = self.offs[lang]
            out.append(torch.from_numpy(np.asarray(self.bins[lang][o[j]:o[j + 1]], dtype=np.int64)))
        return out[0], out[1]
