"""Task glue for Figure 4: WMT15 English->French sentence pairs in length buckets, the attention
LSTM (models/seq2seq.py), training perplexity per target token, validation perplexity on
newstest2013 and BLEU on newstest2014 (sacrebleu, greedy decoding; beyond the paper).

Batches follow translate.py (TensorFlow's seq2seq tutorial, the paper's model): a pair goes to the
first bucket (source, target) it fits -- (5, 10), (10, 15), (20, 25), (40, 50) subword tokens, the
target counted with its </s> -- and longer pairs are left out of training and of the validation
perplexity; every batch is drawn from one bucket, so it pads little. The source is reversed and
left-padded, the decoder reads <s> + target and predicts target + </s>.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpt.config import infra
from mpt.errors import UserError
from mpt.optim import update_factor
from mpt.task import Task as BaseTask


@dataclass
class TaskCfg:
    data_root: str = infra("data/wmt15")  # output of `python -m data_prep.wmt15`
    # translate.py's _buckets: (source, target) lengths; pairs beyond the last are not trained on.
    buckets: list[list[int]] = field(default_factory=lambda: [[5, 10], [10, 15], [20, 25], [40, 50]])
    dropout: float = 0.0  # translate.py: none
    init_scale: float = 0.1  # uniform(-x, x) for every weight (tensorflow/nmt's init_weight)
    bleu: bool = True  # BLEU on the test set at every evaluation
    bleu_max_sentences: int = 0  # 0 = the whole test set (newstest2014: 3,003)
    decode_batch: int = 64
    decode_extra: int = 10  # greedy decoding stops at 2 x source length + this many tokens
    # translate.py's decay: every plateau_window steps (steps_per_checkpoint 200), lr x plateau_decay
    # (learning_rate_decay_factor 0.99) when that window's mean training loss is above each of the
    # previous three windows'. 0 = off (sched.* alone).
    plateau_decay: float = 0.99
    plateau_window: int = 200


class PlateauLR(torch.optim.lr_scheduler.LambdaLR):
    """cfg.sched's factor times translate.py's plateau multiplier (TaskCfg.plateau_decay). The training
    step (mpt.step.TrainStep) hands every iteration's logs to observe(); their loss, a device tensor, is
    read on the host once per window, summed over ranks so every rank takes the same decision; the
    multiplier applies from the next update. Its state (multiplier, last three window means, the open window) is in the
    checkpoint, so a resumed run decays exactly as an uninterrupted one."""

    def __init__(self, optimizer, factor, decay: float, window: int):
        self.decay, self.window = decay, window
        self.multiplier, self.history, self.sum, self.count = 1.0, [], None, 0
        super().__init__(optimizer, lambda u: factor(u) * self.multiplier)

    def observe(self, logs: dict) -> None:
        loss = logs["loss"].detach().to(torch.float64)
        self.sum, self.count = (loss if self.sum is None else self.sum + loss), self.count + 1
        if self.count < self.window:
            return
        total = self.sum.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()
        mean = float(total) / self.count
        if len(self.history) == 3 and mean > max(self.history):
            self.multiplier *= self.decay
        self.history = (self.history + [mean])[-3:]
        self.sum, self.count = None, 0

    def state_dict(self):
        sd = {k: v for k, v in super().state_dict().items() if k != "lr_lambdas"}
        return {**sd, "plateau": {"multiplier": self.multiplier, "history": list(self.history),
                                  "sum": self.sum, "count": self.count}}

    def load_state_dict(self, state):
        state = dict(state)
        pl = state.pop("plateau")
        super().load_state_dict({**state, "lr_lambdas": [None] * len(self.lr_lambdas)})
        self.multiplier, self.history, self.sum, self.count = pl["multiplier"], list(pl["history"]), pl["sum"], pl["count"]


class Task(BaseTask):
    prepared_data = ("wmt15-fren", "wmt15")  # prepared.json's "dataset", by data_prep.wmt15
    primary_metric = "perplexity"
    higher_is_better = False

    @classmethod
    def check(cls, cfg):
        c = cfg.task
        b = [tuple(x) for x in c.buckets]
        if not b or any(len(x) != 2 or min(x) < 1 for x in b) or b != sorted(b):
            raise UserError(f"task.buckets={c.buckets} must be increasing [source, target] length pairs >= 1")
        if c.plateau_decay > 0 and (not 0 < c.plateau_decay < 1 or c.plateau_window < 1):
            raise UserError(f"task.plateau_decay={c.plateau_decay} must be in (0, 1) (0: off) and "
                            f"task.plateau_window={c.plateau_window} >= 1")

    @dataclass(frozen=True)
    class Facts:
        vocab: dict  # subword vocabulary sizes {"en": n, "fr": n} of the prepared data
        pad: int
        bos: int
        eos: int

    @classmethod
    def read_facts(cls, cfg):
        from data_prep.wmt15.dataset import Prepared

        data = Prepared(cfg.task.data_root)
        sp = data.special
        return cls.Facts(vocab=dict(data.vocab), pad=sp["pad"], bos=sp["bos"], eos=sp["eos"])

    @property
    def buckets(self) -> np.ndarray:
        return np.array([tuple(x) for x in self.cfg.task.buckets])

    # -- data and model -----------------------------------------------------------------------------
    def datasets(self):
        from data_prep.wmt15.dataset import Prepared

        c = self.cfg.task
        data = Prepared(c.data_root)
        train, dev = data.split("train"), data.split("dev")
        for ds, name in ((train, "train"), (dev, "dev")):
            ds.keep(self._bucket(ds) >= 0)
            if len(ds) == 0:
                raise UserError(f"no {name} pair of {c.data_root} fits task.buckets={c.buckets}")
        return train, dev

    def _bucket(self, ds) -> np.ndarray:
        """Index of the first bucket each pair fits (target counted with its </s>), -1 for none."""
        buckets = self.buckets
        s, t = ds.lengths("en")[:, None], ds.lengths("fr")[:, None] + 1
        fits = (s <= buckets[None, :, 0]) & (t <= buckets[None, :, 1])
        return np.where(fits.any(1), fits.argmax(1), -1)

    def build_model(self):
        import models

        cfg, f = self.cfg, self.facts
        return models.build(cfg.model, src_vocab=f.vocab["en"], tgt_vocab=f.vocab["fr"], width=cfg.width,
                            dropout=cfg.task.dropout, pad_id=f.pad, init=cfg.task.init_scale)

    # -- batches ------------------------------------------------------------------------------------
    def train_order(self, train, epoch, g):
        """Each global batch from one bucket (translate.py), batches in random order; the leftovers of
        every bucket make the last, mixed batches. A function of (train, epoch, g) only: resume is exact."""
        B, chunks, rest = self.cfg.train.batch_size, [], []
        bucket = self._bucket(train)
        for k in range(len(self.cfg.task.buckets)):
            idx = np.flatnonzero(bucket == k)
            idx = idx[torch.randperm(len(idx), generator=g).numpy()]
            full = len(idx) // B * B
            chunks += [idx[i:i + B] for i in range(0, full, B)]
            rest.append(idx[full:])
        order = [chunks[i] for i in torch.randperm(len(chunks), generator=g).tolist()] + rest
        return np.concatenate(order).tolist() if order else []

    def collate(self, samples):
        """Source reversed and left-padded (translate.py), decoder input <s> + target, output target + </s>."""
        pad, bos, eos = self.facts.pad, self.facts.bos, self.facts.eos
        B = len(samples)
        S = max(1, max(len(s) for s, _ in samples))
        T = max(len(t) for _, t in samples) + 1
        src = torch.full((B, S), pad, dtype=torch.long)
        tin = torch.full((B, T), pad, dtype=torch.long)
        tout = torch.full((B, T), pad, dtype=torch.long)
        for i, (s, t) in enumerate(samples):
            if len(s):
                src[i, S - len(s):] = s.flip(0)
            tin[i, 0] = bos
            tin[i, 1:len(t) + 1] = t
            tout[i, :len(t)] = t
            tout[i, len(t)] = eos
        # n_tgt: the target tokens that count (each target and its </s>), counted here on the host; a
        # plain int, which the engine leaves on the host (task.loss divides by it without a device read).
        return {"src": src, "src_mask": src != pad, "tgt_in": tin, "tgt_out": tout,
                "n_tgt": sum(len(t) + 1 for _, t in samples)}

    # -- training and evaluation --------------------------------------------------------------------
    def _nll(self, model, batch):
        logits = model(batch["src"], batch["src_mask"], batch["tgt_in"])
        # Softmax and loss in FP32 whatever the model's dtype (paper section 3.3).
        return F.cross_entropy(logits.float().flatten(0, 1), batch["tgt_out"].flatten(), ignore_index=self.facts.pad,
                               reduction="sum")

    def schedules(self, optimizers, steps_per_epoch, total_epochs):
        c = self.cfg.task
        if c.plateau_decay <= 0:
            return super().schedules(optimizers, steps_per_epoch, total_epochs)
        (name, opt), = optimizers.items()
        return {name: PlateauLR(opt, update_factor(self.cfg.sched, steps_per_epoch, total_epochs),
                                c.plateau_decay, c.plateau_window)}

    def loss(self, model, batch):
        n = batch["n_tgt"]  # = (tgt_out != pad).sum(), from collate: int() of the device count would sync
        return self._nll(model, batch) / max(n, 1), n  # mean NLL per target token: exp = perplexity

    def eval_sums(self, model, batch) -> dict:
        """Summed target-subword NLL and the subword count of one validation batch (newstest2013)."""
        return {"nll": self._nll(model, batch).double(), "tokens": (batch["tgt_out"] != self.facts.pad).sum()}

    def eval_metrics(self, sums: dict) -> dict[str, float]:
        nll = sums["nll"] / max(sums["tokens"], 1.0)
        return {"perplexity": math.exp(min(nll, 700.0)), "nll": nll}

    def evaluate(self, ev) -> dict[str, float]:
        """Validation perplexity (the engine's additive sums) and test BLEU (newstest2014)."""
        metrics = super().evaluate(ev)
        if self.cfg.task.bleu:
            metrics["bleu"] = self.bleu(ev)
        return metrics

    def translate(self, model, sources: list[torch.Tensor], device, autocast) -> list[list[int]]:
        """Greedy translations (target ids without </s>) of source id tensors, in their order."""
        c, f = self.cfg.task, self.facts
        max_src = int(self.buckets[-1, 0])
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))  # similar lengths per batch
        out: list[list[int]] = [[] for _ in sources]
        for k in range(0, len(order), c.decode_batch):
            ids = order[k:k + c.decode_batch]
            # Sources beyond the longest bucket are cut to it (the model never saw longer ones).
            batch = self.collate([(sources[i][:max_src], torch.zeros(0, dtype=torch.long)) for i in ids])
            src, mask = batch["src"].to(device), batch["src_mask"].to(device)
            with autocast():
                hyp = model.greedy(src, mask, f.bos, f.eos, 2 * src.shape[1] + c.decode_extra)
            for i, row in zip(ids, hyp.tolist()):
                out[i] = row[:row.index(f.eos)] if f.eos in row else [x for x in row if x != f.pad]
        return out

    def bleu(self, ev) -> float:
        import sacrebleu

        from data_prep.wmt15.dataset import Prepared

        data, most = Prepared(self.cfg.task.data_root), self.cfg.task.bleu_max_sentences
        test = data.split("test")
        refs = data.text("test", "fr")
        n = len(test) if not most else min(len(test), most)
        mine = list(range(ev.rank, n, ev.world))
        hyps = self.translate(ev.model, [test[i][0] for i in mine], ev.device, ev.autocast)
        sp = data.spm("fr")
        pairs = list(zip(mine, (sp.decode(h) for h in hyps)))
        if ev.world > 1:
            gathered = [None] * ev.world
            dist.all_gather_object(gathered, pairs)
            pairs = [p for part in gathered for p in part]
        text = [h for _, h in sorted(pairs)]
        # force: the tiny sets are tokenised text (" ."); WMT references are raw text either way.
        return float(sacrebleu.corpus_bleu(text, [refs[:n]], force=True).score)
