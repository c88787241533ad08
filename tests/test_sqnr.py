"""numerics.sqnr_every: the SQNR of a run's output and per-parameter gradients against FP32, logged by the
engine without moving the training by a bit (mpt.numerics.FidelityObserver)."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import toy_gan
import toy_mlp
from mpt import config as C
from mpt import identity
from mpt import engine
from mpt.errors import UserError
from mpt.task import Task

torch.set_num_threads(1)


class Carried(Task):
    """A regression MLP with what a forward can disturb: batch-norm statistics, dropout (the global
    random stream), and a state the task carries from batch to batch, updated in place (the bigLSTM's
    recurrent state, in miniature)."""

    primary_metric = "mse"
    higher_is_better = False

    def __init__(self, cfg, facts=None):
        super().__init__(cfg, facts)
        self.carry = torch.zeros(16)

    def datasets(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(96, 16, generator=g)
        y = torch.tanh(x @ torch.randn(16, 4, generator=g))
        return TensorDataset(x, y), TensorDataset(x[:32], y[:32])

    def build_model(self):
        torch.manual_seed(self.cfg.seed)
        return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 64),
                             nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def loss(self, model, batch):
        x, y = batch
        out = model(x + self.carry)
        with torch.no_grad():
            self.carry.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return F.mse_loss(out.float(), y), x.shape[0]

    def state_dict(self):
        return {"carry": self.carry}

    def load_state_dict(self, sd):
        self.carry = sd["carry"].clone()

    def evaluate(self, ev):
        x, y = ev.val_dataset.tensors
        with ev.autocast():
            return {"mse": F.mse_loss(ev.model(x).float(), y).item()}


class MeasuredGan(toy_gan.ToyGan):
    def measured_loss(self, model, batch):
        (real,) = batch
        G, D = model["generator"], model["discriminator"]
        fake = G(torch.randn(real.shape[0], 2))
        return {"discriminator": F.softplus(-D(real).float()).mean() + F.softplus(D(fake.detach()).float()).mean(),
                "generator": F.softplus(-D(fake).float()).mean()}


def _lines(d):
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]


def _run(task_cls, cfg):
    s = engine.run(cfg, task_cls(cfg))
    assert s["status"] == "completed", s
    return s, identity.run_dir(cfg)


def _same(a, b, where="") -> None:
    """Equal, bit for bit, through dicts, lists and tensors (NaNs equal to NaNs)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                     and torch.equal(a.nan_to_num(), b.nan_to_num())), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), (where, a, b)


def _trajectory(d) -> tuple:
    """What a run did, without clocks: its train and eval lines and its checkpoint."""
    keep = [{k: v for k, v in ln.items() if k not in ("time", "throughput")} for ln in _lines(d) if ln["kind"] != "numerics"]
    ck = torch.load(d / "checkpoint.pt", weights_only=False)
    ck.pop("wall", None)
    ck.pop("cell_id"), ck.pop("checksum")  # the run's identity (the key is part of it), and a hash with it
    return keep, ck


@pytest.mark.parametrize("task_cls,prec,kw", [
    (Carried, "fp8", {}),  # delayed scaling: amax histories, BF16 ends found by a probe at the first call
    (Carried, "nvfp4", {}),  # stochastic rounding's generator, the Hadamard transform
    (Carried, "mixed", {}),  # dynamic loss scaling, FP16 emulated under autocast
    (MeasuredGan, "mxfp8", {}),  # two optimizers, each parameter's gradient from its own loss
])
def test_sqnr_logging_leaves_the_run_bit_identical(tmp_path, task_cls, prec, kw):
    """Every step measured, against none: the same losses, evaluations, weights, optimizer and scaler
    state, FP8 histories and scales, generators, random streams and task state, bit for bit."""
    mk = toy_gan.config if task_cls is MeasuredGan else toy_mlp.config
    steps = {"max_steps": 8, "batch_size": 16}
    off = mk(tmp_path / "off", precision=prec, train=dict(steps))
    on = mk(tmp_path / "on", precision=prec, train=dict(steps))
    on.numerics.sqnr_every = 1
    _, d_off = _run(task_cls, off)
    _, d_on = _run(task_cls, on)
    a, b = _trajectory(d_off), _trajectory(d_on)
    if task_cls is MeasuredGan:
        # The first step's activation bytes (mpt.memory) count each saved storage once by its address: the
        # discriminator phase's graph is freed before the generator phase saves its own, and whether an
        # address comes back depends on the allocator's state (two unmeasured runs in one process differ
        # too). A memory statistic, not training state: left out here, compared for one-phase tasks.
        a[1].pop("act_bytes"), b[1].pop("act_bytes")
    _same(a, b)
    sq = [ln for ln in _lines(d_on) if ln["kind"] == "numerics"]
    assert len(sq) == 8 and not any("numerics/sqnr/error" in ln for ln in sq)
    assert not any(ln["kind"] == "numerics" for ln in _lines(d_off))


def test_sqnr_values_rank_the_precisions(tmp_path):
    """FP32 against FP32 is exact (inf dB); a precision's output and every parameter's gradient are
    logged, with the summary; fewer bits, lower SQNR: NVFP4 below MXFP8 below BF16 autocast."""
    got = {}
    for prec in ("fp32", "bf16", "mxfp8", "nvfp4"):
        cfg = toy_mlp.config(tmp_path, precision=prec, train={"max_steps": 4})
        cfg.numerics.sqnr_every = 2
        _, d = _run(Carried, cfg)
        sq = [ln for ln in _lines(d) if ln["kind"] == "numerics"]
        assert [ln["step"] for ln in sq] == [1, 3]  # iterations 0 and 2, logged after them
        got[prec] = sq[0]
    names = [n for n, _ in Carried(toy_mlp.config(tmp_path)).build_model().named_parameters()]
    for prec, ln in got.items():
        assert {f"numerics/sqnr/grad/{n}" for n in names} <= set(ln) and "numerics/sqnr/output" in ln, prec
        assert ln["numerics/sqnr/grad_count"] == len(names)
    assert all(v == math.inf for k, v in got["fp32"].items() if k.startswith("numerics/sqnr/") and "count" not in k
               and "below" not in k)
    assert got["fp32"]["numerics/sqnr/grad_below_20db"] == 0
    med = {p: got[p]["numerics/sqnr/grad_median"] for p in got}
    out = {p: got[p]["numerics/sqnr/output"] for p in got}
    assert math.isfinite(med["bf16"]) and med["nvfp4"] < med["mxfp8"] < med["bf16"], med
    assert out["nvfp4"] < out["mxfp8"] < out["bf16"], out
    assert got["nvfp4"]["numerics/sqnr/grad_min"] <= med["nvfp4"]
    below = got["nvfp4"]["numerics/sqnr/grad_below_20db"]
    assert below == sum(got["nvfp4"][f"numerics/sqnr/grad/{n}"] < 20 for n in names)


def test_gan_gradients_come_from_each_optimizers_loss(tmp_path):
    """With several optimizers each parameter's SQNR is of the gradient its own optimizer's loss gives,
    and each model's output is compared on its own."""
    cfg = toy_gan.config(tmp_path, precision="nvfp4", train={"max_steps": 1})
    cfg.numerics.sqnr_every = 1
    _, d = _run(MeasuredGan, cfg)
    (ln,) = [x for x in _lines(d) if x["kind"] == "numerics"]
    assert {"numerics/sqnr/output/generator", "numerics/sqnr/output/discriminator"} <= set(ln)
    assert ln["numerics/sqnr/grad_count"] == 8  # 4 linear layers, weight and bias
    assert all(math.isfinite(ln[f"numerics/sqnr/grad/{m}.{i}.weight"]) for m, i in
               (("generator", 0), ("generator", 2), ("discriminator", 0), ("discriminator", 3)))


def test_sqnr_key_keeps_run_ids_and_refuses_narrow_weights(tmp_path):
    """Off (the default), the key leaves a run's id as it was before the key existed; on, it is another
    run. A precision that stores the weights in FP16/BF16 has no FP32 weights to compare against."""
    cfg = toy_mlp.config(tmp_path, precision="fp8")
    ident = identity.strip_infra(cfg)
    assert "sqnr_every" not in ident["numerics"]
    before = identity.cell_id(cfg)
    cfg.numerics.sqnr_every = 5
    assert identity.cell_id(cfg) != before
    C.validate(cfg)
    for prec, impl in (("fp16_pure", "paper"), ("bf16_pure", "paper"), ("mixed", "paper")):
        bad = toy_mlp.config(tmp_path, precision=prec, impl=impl)
        bad.numerics.sqnr_every = 1
        with pytest.raises(UserError, match="numerics.sqnr_every .* impl=autocast"):
            C.validate(bad)
    bad = toy_mlp.config(tmp_path)
    bad.numerics.sqnr_every = -1
    with pytest.raises(UserError, match="numerics.sqnr_every"):
        C.validate(bad)
