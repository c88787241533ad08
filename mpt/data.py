"""Deterministic, resumable data order.

`EpochSampler` draws each epoch's permutation from (seed, epoch) alone and can start mid-epoch, so
a resumed run sees exactly the samples an uninterrupted run would. `SeededDataset` seeds the
augmentation of each sample from (seed, epoch, index), so random crops and flips do not depend on
which worker loads the sample or on what ran before -- resume is bit-identical.

The epoch travels with each index (`with_epoch=True`: the sampler yields (epoch, index) pairs), not
through an attribute set in the main process: persistent DataLoader workers hold their own copy of the
dataset, made once, and would never see a `set_epoch` called after they started."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset, Sampler


def mix_seeds(*xs: int) -> int:
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (int(x) + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2))) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF


class EpochSampler(Sampler[int]):
    """Shuffled (or ordered) indices for one rank; the rank's share of a seeded global permutation.
    Drops the tail so every rank gets the same number of samples (DDP)."""

    def __init__(self, n: int, seed: int, shuffle: bool = True, rank: int = 0, world: int = 1, batch_size: int = 1,
                 drop_last: bool = True, order=None, with_epoch: bool = False):
        self.n, self.seed, self.shuffle, self.rank, self.world = n, seed, shuffle, rank, world
        self.with_epoch = with_epoch  # yield (epoch, index): for a SeededDataset in persistent workers
        # order(epoch, generator) -> a permutation of range(n) or None (Task.train_order): a task's
        # own epoch order, e.g. SortaGrad. Seeded from (seed, epoch) like the default shuffle.
        self.order = order
        per = n // world
        # Training drops the tail so every rank runs the same number of steps; evaluation
        # (drop_last=False) gives rank r every index r, r + world, ... so no sample is missed.
        self.drop_last = drop_last
        self.per_rank = (per // batch_size) * batch_size if drop_last else len(range(rank, n, world))
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self):
        g = torch.Generator().manual_seed(mix_seeds(self.seed, self.epoch))
        # None from order(): the default (Task.train_order's), which leaves g untouched
        given = self.order(self.epoch, g) if self.order is not None else None
        if given is not None:
            perm = torch.as_tensor(list(given), dtype=torch.int64)
            if perm.numel() != self.n or not torch.equal(perm.sort().values, torch.arange(self.n)):
                raise ValueError(f"train_order(epoch={self.epoch}) must return a permutation of range({self.n})")
        elif self.shuffle:
            perm = torch.randperm(self.n, generator=g)
        else:
            perm = torch.arange(self.n)
        mine = perm[self.rank::self.world][: self.per_rank][self.start:].tolist()
        if self.with_epoch:
            return iter([(self.epoch, i) for i in mine])
        return iter(mine)

    def __len__(self):
        return self.per_rank - self.start


class SeededDataset(Dataset):
    def __init__(self, base: Dataset, seed: int):
        self.base, self.seed, self.epoch = base, seed, 0

    def set_epoch(self, epoch: int) -> None:
        """This process's copy (the main process, or one worker's): the seed of each sample's
        augmentation, and the base dataset's own layout for the epoch where it has one (a language
        model's token streams with the shard order reshuffled every pass)."""
        self.epoch = epoch
        getattr(self.base, "set_epoch", lambda e: None)(epoch)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        if isinstance(i, tuple):  # (epoch, index) from EpochSampler(with_epoch=True)
            epoch, i = i
            if epoch != self.epoch:
                self.set_epoch(epoch)
        # The CPU generator alone, which the augmentations draw from and fork_rng(devices=[]) restores:
        # torch.manual_seed also seeds every accelerator backend, which costs ~100 us a sample where none
        # is initialised (each queues a lazy call that captures a stack trace) -- a sixth of the real
        # profile's data time -- and would leave a CUDA generator reseeded by the last sample.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(mix_seeds(self.seed, self.epoch, i))
            return self.base[i]
