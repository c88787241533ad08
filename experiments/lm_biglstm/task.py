"""Task glue for Figure 5: token-stream windows of the One Billion Word benchmark, the bigLSTM with
its recurrent state carried across batches (truncated back-propagation through time), the sampled
softmax in training and test perplexity with the full softmax.

Training loss, as the reference code defines it (rafaljozefowicz/lm and NVIDIA's okuchaiev/f-lm,
language_model.py): the per-token NLL of the sampled softmax, multiplied by num_steps before the
backward pass (the sum over the window's 20 steps, averaged over the batch), with the embedding
gradient further multiplied by the per-GPU batch, only the LSTM gradients clipped by their global
norm, and Adagrad starting from an accumulator of 1. We reproduce each piece:
- x num_steps: _ScaleGrad multiplies the gradient, not the value, so the engine still logs the mean
  NLL per token and exp(loss) is the training perplexity of Figure 5. The FP16 gradients see the same
  magnitudes as in the reference (this matters for where they underflow without loss scaling).
- x per-GPU batch on the embedding gradient: for Adagrad, multiplying a gradient by c is the same as
  dividing the initial accumulator by c^2 (update = lr g / sqrt(a/c^2 + sum g^2)), so the embedding
  group starts from initial_accumulator_value / emb_grad_scale^2 and its gradients are untouched.
- LSTM-only clipping: the LSTM param group carries its own clip_grad_norm (mpt.optim.clip_groups, registered by optimizers()).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mpt.config import infra
from mpt.errors import UserError
from mpt.task import Task as BaseTask
from mpt.optim import clip_groups


@dataclass
class TaskCfg:
    data_root: str = infra("data/lm1b")  # output of `python -m data_prep.lm1b`
    num_steps: int = 20  # truncated back-propagation window (Jozefowicz et al.: 20)
    num_sampled: int = 8192  # negatives of the sampled softmax; 0 = full softmax in training too
    num_layers: int = 2
    dropout: float = 0.1  # keep_prob 0.9 on the embeddings and after every LSTM layer
    forget_bias: float = 1.0
    loss_sum_over_steps: bool = True  # gradient of the window's summed NLL (reference: loss x num_steps)
    emb_grad_scale: float = 256.0  # reference multiplies embedding gradients by the per-GPU batch (1024 / 4)
    lstm_clip_norm: float = 1.0  # global norm of the LSTM gradients only (f-lm BIGLSTM: max_grad_norm=1)
    # The softmax layer in FP32 whatever the precision, as f-lm (models/lm.py); True: stored and
    # multiplied in the model's dtype (FP16 under impl=paper), logits still reduced in FP32.
    softmax_fp16: bool = False


class _ScaleGrad(torch.autograd.Function):
    """Identity in value, gradient multiplied by `scale`."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class Task(BaseTask):
    prepared_data = ("lm1b (One Billion Word benchmark, r13output)", "lm1b")  # prepared.json's "dataset", by data_prep.lm1b
    primary_metric = "ppl"
    higher_is_better = False
    data_files = ("vocab.txt",)  # the vocabulary beside the marker: part of the run identity
    # Windows must come in order: batch row r continues stream r (data_prep/lm1b/dataset.py).
    shuffle_train = False

    @dataclass(frozen=True)
    class Facts:
        vocab_size: int  # 793,471 for 1B Word; the prepared data's vocab.txt

    @classmethod
    def read_facts(cls, cfg):
        from data_prep.lm1b.dataset import Prepared

        return cls.Facts(vocab_size=len(Prepared(cfg.task.data_root).vocab))

    def __init__(self, cfg, facts=None):
        super().__init__(cfg, facts)
        # Recurrent state per stream, FP32, one table per kind ("train" / "eval") and layer:
        # [(h [S, P], c [S, H]), ...]. Train state survives checkpoints; eval state restarts with each
        # evaluation (window 0 resets a stream's state).
        self._tables: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._loaded: list | None = None
        # One stream per row of a global batch: S = batch_size for training, batch_size / accum_steps for
        # evaluation (the engine evaluates in micro-batches); see dataset.py for why this continues streams.
        t = cfg.train
        self.streams = {"train": t.batch_size, "eval": t.batch_size // t.accum_steps}

    # -- data and model -----------------------------------------------------------------------------
    @classmethod
    def check(cls, cfg):
        if cfg.task.emb_grad_scale <= 0:
            raise UserError(f"task.emb_grad_scale={cfg.task.emb_grad_scale} must be positive")

    def datasets(self):
        from data_prep.lm1b.dataset import Prepared, StreamWindows, TokenStream

        c = self.cfg.task
        data = Prepared(c.data_root)
        train = StreamWindows(TokenStream(data.shards("train")), self.streams["train"], c.num_steps, data.bos,
                              shuffle_seed=self.cfg.seed)
        test = StreamWindows(TokenStream(data.shards("test")), self.streams["eval"], c.num_steps, data.bos,
                             align=True, pad=True)
        return train, test

    def build_model(self):
        import models

        c, vocab_size = self.cfg.task, self.facts.vocab_size
        if c.num_sampled >= vocab_size:
            raise UserError(f"task.num_sampled={c.num_sampled} must be below the vocabulary size "
                            f"({vocab_size:,}); use task.num_sampled=0 for the full softmax")
        return models.build(self.cfg.model, vocab_size=vocab_size, width=self.cfg.width, num_sampled=c.num_sampled,
                            num_layers=c.num_layers, dropout=c.dropout, forget_bias=c.forget_bias,
                            softmax_fp16=c.softmax_fp16)

    def optimizers(self, model):
        # Adagrad over param_groups(), the LSTM's group clipped on its own (f-lm: clip_lstm_grads)
        opts = super().optimizers(model)
        opts["main"].register_step_pre_hook(clip_groups)
        return opts

    def param_groups(self, model):
        cfg = self.cfg
        c = cfg.task
        groups = [
            {"params": [model.embedding.weight],
             "initial_accumulator_value": cfg.optim.initial_accumulator_value / c.emb_grad_scale ** 2},
            {"params": list(model.lstm.parameters()), "clip_grad_norm": c.lstm_clip_norm},
            {"params": list(model.softmax.parameters())},
        ]
        assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
        return groups

    # -- recurrent state ----------------------------------------------------------------------------
    def _table(self, kind: str, model, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        tab = self._tables.get(kind)
        if tab is None or tab[0][0].device != torch.device(device):
            if kind == "train" and self._loaded is not None:
                tab = [(h.to(device), c.to(device)) for h, c in self._loaded]
                self._loaded = None
            else:  # the model's own zero state (one (h, c) per layer, FP32) for every stream
                tab = getattr(model, "module", model).zero_state(self.streams[kind], device)
            self._tables[kind] = tab
        return tab

    def _state(self, kind: str, model, batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        stream, fresh = batch["stream"], (batch["window"] == 0)[:, None]
        return [(torch.where(fresh, 0.0, h[stream]), torch.where(fresh, 0.0, c[stream]))
                for h, c in self._table(kind, model, stream.device)]

    @torch.no_grad()
    def _keep(self, kind: str, model, batch, new) -> None:
        # Detached: back-propagation is truncated at the window boundary, the state itself carries on.
        for (h, c), (hn, cn) in zip(self._table(kind, model, batch["stream"].device), new):
            h[batch["stream"]] = hn.detach().float()
            c[batch["stream"]] = cn.detach().float()

    def state_dict(self) -> dict:
        tab = self._tables.get("train")
        return {"train": None if tab is None else [[h.cpu(), c.cpu()] for h, c in tab]}

    def load_state_dict(self, sd: dict) -> None:
        # The state as state_dict() gave it: none yet (before the first batch) drops any table since made.
        self._loaded = None if sd.get("train") is None else [(h, c) for h, c in sd["train"]]
        self._tables.pop("train", None)

    # -- training and evaluation --------------------------------------------------------------------
    def loss(self, model, batch):
        mask = batch["mask"]
        nll, new = model(batch["x"], batch["y"], mask, self._state("train", model, batch))
        self._keep("train", model, batch, new)
        # The mean over the targets that count, divided on the device: int(mask.sum()) would be a host
        # read (a GPU sync) every step.
        loss = nll.sum() / mask.sum().clamp(min=1)
        if self.cfg.task.loss_sum_over_steps:
            loss = _ScaleGrad.apply(loss, float(self.cfg.task.num_steps))
        # Items for the logged throughput, from the shape (no device read): token positions, B x
        # num_steps, i.e. the counted targets plus the </S> -> <S> steps (about 1 in 27 in 1B Word; the
        # training windows have no padding). Every position runs through the LSTMs and the softmax.
        return loss, mask.numel()

    def eval_sums(self, model, batch):
        mask = batch["mask"]
        nll, new = model(batch["x"], batch["y"], mask, self._state("eval", model, batch))
        self._keep("eval", model, batch, new)
        return {"nll": float(nll.sum()), "n": int(mask.sum())}

    def eval_metrics(self, s):
        nll = s.get("nll", float("nan")) / max(s.get("n", 0), 1)
        return {"ppl": math.exp(min(nll, 700.0)), "nll": nll}
