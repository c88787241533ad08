"""Reading the prepared One Billion Word data: token streams by memory map, cut into windows of
`num_steps` tokens so that consecutive batches continue each batch row's own stream (truncated
back-propagation through time with the recurrent state carried across batches).

Index layout -- why item i is window i // S of stream i % S:
the engine's ordered sampler (mpt.data.EpochSampler, shuffle=False) gives rank r the indices
r, r + W, r + 2W, ... (W ranks) and its DataLoader cuts them into consecutive micro-batches of m. With
accumulation k and global batch S = W x k x m, step j's micro-batch a on rank r holds the indices
    r + (j k m + a m + row) W = (r + row W + a m W) + j S,   row = 0 .. m-1,
so i % S = r + row W + a m W is the same for that batch row at every step j and differs between all
rows, ranks and micro-batches, and i // S = j. Item i is therefore window j = i // S of stream
s = i % S: each batch row reads its own stream, window after window, whatever W, k and m are, as long
as S is the global batch of one optimizer step (the training set) or of one evaluation batch, which
the engine makes max(m, 1) per rank, i.e. S = batch_size / accum_steps (the evaluation set).

Every item carries its stream and window, so a task can keep one recurrent state per stream and
reset it where window == 0 (the start of a stream: a new epoch, or a new evaluation).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from data_prep.prepared import check_id_file, read_prepared
from mpt.errors import UserError

from .prepare import BOS, EOS, MARKER, UNK, VOCAB, load_vocab


class Prepared:
    """The output folder of `python -m data_prep.lm1b`: vocabulary, shard files and their counts."""

    def __init__(self, root):
        self.root = Path(root)
        marker = self.root / MARKER
        if not marker.is_file():
            raise UserError(f"no prepared One Billion Word data at {self.root} (no {MARKER}); run "
                            f"python -m data_prep.lm1b --archive <release .tar.gz> --out {self.root} "
                            f"(or python -m data_prep.lm1b.tiny for the tiny one)")
        self.info = read_prepared(self.root, "rerun python -m data_prep.lm1b with --force")
        self.vocab = load_vocab(self.root / VOCAB)
        if len(self.vocab) != self.info["vocab_size"]:
            raise UserError(f"{self.root / VOCAB} has {len(self.vocab)} words, {MARKER} says "
                            f"{self.info['vocab_size']}; rerun python -m data_prep.lm1b with --force")
        self.bos, self.eos, self.unk = self.info["bos"], self.info["eos"], self.info["unk"]
        self._checked: set[Path] = set()
        assert (self.vocab[self.bos], self.vocab[self.eos], self.vocab[self.unk]) == (BOS, EOS, UNK)

    def shards(self, split: str) -> list[tuple[Path, int]]:
        """(path, tokens) of every shard of 'train' or 'heldout', in file order; 'test' = held-out shard 0."""
        if split == "test":
            entries = [s for s in self.info["shards"]["heldout"] if s["file"] == self.info["test"]]
        else:
            entries = self.info["shards"][split]
        out = []
        for s in entries:
            path = self.root / s["file"]
            size = path.stat().st_size if path.is_file() else -1
            if size != 4 * s["tokens"]:
                raise UserError(f"{path} is missing or truncated ({size} bytes, expected {4 * s['tokens']}); "
                                f"rerun python -m data_prep.lm1b with --force")
            if path not in self._checked:  # ids in the vocabulary, bytes as prepared (one read per run)
                check_id_file(path, "<u4", len(self.vocab), "rerun python -m data_prep.lm1b with --force",
                              s.get("sha256"))
                self._checked.add(path)
            out.append((path, s["tokens"]))
        return out

    def unigram_nll(self, split: str = "test") -> float:
        """Mean NLL of `split`'s targets (words and </S>, not <S>) under the training unigram
        distribution (add-one smoothed): the baseline a language model must beat."""
        counts = np.zeros(len(self.vocab), dtype=np.float64)
        for path, n in self.shards("train"):
            counts += np.bincount(np.memmap(path, dtype="<u4", mode="r", shape=(n,)), minlength=len(self.vocab))
        counts += 1.0
        counts[self.bos] = 0.0  # <S> is never a target
        with np.errstate(divide="ignore"):
            logp = np.log(counts / counts.sum())
        total, n_targets = 0.0, 0
        for path, n in self.shards(split):
            ids = np.asarray(np.memmap(path, dtype="<u4", mode="r", shape=(n,)))
            ids = ids[ids != self.bos]
            total -= float(logp[ids].sum())
            n_targets += ids.size
        return total / max(n_targets, 1)


class TokenStream:
    """Shards (uint32 files) concatenated in a chosen order; read(a, b) -> int64 ids of [a, b).
    Memory maps are opened lazily in each process (DataLoader workers) and never pickled."""

    def __init__(self, shards: list[tuple[Path, int]]):
        if not shards:
            raise UserError("a token stream needs at least one shard")
        self.paths = [Path(p) for p, _ in shards]
        self.lengths = np.array([n for _, n in shards], dtype=np.int64)
        self._maps = None
        self.set_order(range(len(self.paths)))

    def set_order(self, order) -> None:
        self.order = np.asarray(list(order), dtype=np.int64)
        self.cum = np.concatenate([[0], np.cumsum(self.lengths[self.order])])

    def __len__(self) -> int:
        return int(self.cum[-1])

    def __getstate__(self):
        return {**self.__dict__, "_maps": None}

    def _map(self, k: int) -> np.ndarray:
        if self._maps is None:
            self._maps = [None] * len(self.paths)
        if self._maps[k] is None:
            self._maps[k] = np.memmap(self.paths[k], dtype="<u4", mode="r", shape=(int(self.lengths[k]),))
        return self._maps[k]

    def read(self, a: int, b: int) -> np.ndarray:
        b = min(b, len(self))
        if a >= b:
            return np.zeros(0, dtype=np.int64)
        pieces = []
        i = int(np.searchsorted(self.cum, a, side="right")) - 1
        while a < b:
            lo = a - int(self.cum[i])
            hi = min(b, int(self.cum[i + 1])) - int(self.cum[i])
            pieces.append(self._map(int(self.order[i]))[lo:hi])
            a += hi - lo
            i += 1
        return np.concatenate(pieces).astype(np.int64)


class StreamWindows(Dataset):
    """Item i = window i // S of stream i % S (module docstring): a dict of
    x, y [T] int64 (inputs and next-token targets), mask [T] bool (targets that count),
    stream, window (0-d int64).

    The token stream is cut into S streams. Training (align=False, pad=False): S equal slices, every
    window full, the tail shorter than a window dropped; with `shuffle_seed`, each epoch first
    permutes the shard order (set_epoch), as the reference code reshuffles its files every pass.
    Evaluation (align=True, pad=True): streams begin at sentence starts, so no sentence loses its left
    context, and the last window of a stream is padded (mask False): every target is scored once.

    Targets equal to <S> (the step from one sentence's </S> to the next <S>, certain by construction)
    are masked out: the perplexity is over words and </S>, the benchmark's definition."""

    def __init__(self, stream: TokenStream, n_streams: int, num_steps: int, bos: int, align: bool = False,
                 pad: bool = False, shuffle_seed: int | None = None):
        if n_streams < 1 or num_steps < 1:
            raise UserError(f"need at least one stream and one step per window (got {n_streams}, {num_steps})")
        self.stream, self.S, self.T, self.bos = stream, n_streams, num_steps, bos
        self.align, self.pad, self.shuffle_seed = align, pad, shuffle_seed
        self.epoch = None
        self.set_epoch(0)
        if pad:
            self.J = int(max(-(-max(stop - start - 1, 0) // self.T) for start, stop in zip(self.starts, self.stops)))
        else:
            self.J = (len(stream) // self.S - 1) // self.T
        if self.J < 1:
            raise UserError(f"{len(stream):,} tokens are too few for {n_streams} streams of {num_steps}-token "
                            f"windows; use a smaller batch or fewer steps")

    def set_epoch(self, epoch: int) -> None:
        if epoch == self.epoch:
            return
        self.epoch = epoch
        if self.shuffle_seed is not None:
            self.stream.set_order(np.random.default_rng([self.shuffle_seed, epoch]).permutation(len(self.stream.paths)))
        L, S = len(self.stream), self.S
        if self.align:
            self.starts = [self._sentence_start(s * L // S) for s in range(S)]
            self.stops = self.starts[1:] + [L]
        else:
            self.starts = [s * (L // S) for s in range(S)]
            self.stops = [st + L // S for st in self.starts]

    def _sentence_start(self, pos: int) -> int:
        """The first <S> at or after pos (the stream's length if none)."""
        L = len(self.stream)
        while pos < L:
            chunk = self.stream.read(pos, pos + 4096)
            hit = np.flatnonzero(chunk == self.bos)
            if hit.size:
                return pos + int(hit[0])
            pos += chunk.size
        return L

    def __len__(self) -> int:
        return self.S * self.J

    def __getitem__(self, i: int) -> dict:
        s, j = i % self.S, i // self.S
        a = self.starts[s] + j * self.T
        tok = self.stream.read(a, min(a + self.T + 1, self.stops[s]))
        n = max(tok.size - 1, 0)
        x = np.zeros(self.T, dtype=np.int64)
        y = np.zeros(self.T, dtype=np.int64)
        mask = np.zeros(self.T, dtype=bool)
        x[:n], y[:n] = tok[:n], tok[1:n + 1]
        mask[:n] = y[:n] != self.bos
        return {"x": torch.from_numpy(x), "y": torch.from_numpy(y), "mask": torch.from_numpy(mask),
                "stream": torch.tensor(s), "window": torch.tensor(j)}
