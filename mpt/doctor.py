"""Can my model train in FP16, and how? `python -m mpt.doctor TARGET` measures it on the user's own model.

TARGET is one of:
  module:function    function() returns (model, loss, batches) or (model, loss, batches, optimizer), or a
                     dict with those keys: `loss(model, batch)` gives the mean loss (or (mean loss, items),
                     as Task.loss), `batches` is a list of batches (tensors, or tuples/dicts of tensors),
                     `optimizer(model)` builds the optimizer (default: SGD, lr 0.01, momentum 0.9);
                     mpt/doctor_examples.py has four.
  module:TaskClass   a subclass of mpt.task.Task (its datasets, model, optimizer and loss under the
                     default Config); a function returning a Task instance works too.
  experiment:NAME    one of this repository's experiments, with --profile and key=value overrides as a run
                     takes them (its data must be prepared).

What it does, through the one recipe and step code every run uses (mpt.precision, mpt.step.loss_step):
  1. trains a copy of the model for --steps steps in FP32 with every measurement on (mpt.numerics:
     gradient exponent histograms per layer, section 3.1's swamping, ValueRanges for the forward pass;
     mpt.memory.ActivationMeter for the bytes saved for backward);
  2. replays the same steps from the same weights and random stream in FP16 without loss scaling
     (precision=fp16, S = 1), watching for the first operation that makes inf/nan (FirstOverflow);
  3. decides a verdict from the measurements: fp16 as it is, fp16 + a static S (which), fp16 + dynamic S,
     or bf16 / layers kept in FP32 -- and replays the same steps once more in the recipe it recommends,
     so the verdict says whether that recipe then trains (skipped steps, progress against FP32).
It prints a one-screen report and writes report.md, report.json and histograms.png (--out).

"Progress" is how far a replay got, as a share of how far FP32 got: its mean loss over the last quarter of the
steps against the untrained model's and FP32's on the same batches, (untrained - it) / (untrained - FP32);
100% = learned as FP32 did, 0 = did not learn.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import importlib
import inspect
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from mpt import precision as recipes
from mpt.config import Config
from mpt.errors import UserError, cli
from mpt.memory import ActivationMeter
from mpt.numerics import (FP16_MAX, FP16_ROUNDS_TO_INF, HIST_HI, HIST_LO, FirstOverflow, Numerics,
                          ValueRanges, advise_loss_scale)
from mpt.ranks import pick_device, to_device
from mpt.rundir import atomic_write_bytes, atomic_write_json, atomic_write_text
from mpt.step import loss_step
from mpt.task import Task

STEPS = 20
TOLERANCE = 1e-3  # a share of non-zero values flushed to zero that we call negligible
MARGIN = 2.0  # headroom of the advised static S: S x max|gradient| x MARGIN < 65504 (section 3.2)
MAX_SCALE = 2.0**24  # the largest S advised (advise_loss_scale's cap; the paper's largest was 32K)
SWAMP_MATTERS = 0.01  # FP16 weights losing more than 1% of the updates: the FP32 master copy matters
LOST_OK = 0.01  # when no S fits, a share flushed at the largest safe S that FP16 + dynamic S may still accept
CONFIRM = 0.8  # a replay reaching 80% of FP32's progress over the same steps confirms a recipe
WIDE = 16.0  # a static S is advised when the usable range spans at least this factor; else dynamic
FORM = ("return (model, loss, batches) or (model, loss, batches, optimizer), or a dict with those keys, "
        "where loss(model, batch) gives the mean loss and optimizer(model) builds the optimizer "
        "(see mpt/doctor_examples.py)")


@dataclass
class Patient:
    """The model under examination. Every phase trains its own deep copy of `model` (same weights)."""
    name: str
    model: nn.Module
    loss: Callable  # loss(model, batch) -> mean loss, or (mean loss, items)
    batches: list
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    notes: list[str] = field(default_factory=list)
    seed: int = 0  # every phase starts the random stream here: the replays draw the same dropout masks, samples
    task: Task | None = None  # a Task's loss is called on a fresh copy of it in every phase (state it carries
    #                           across batches, the bigLSTM's recurrent state, must start afresh in each replay)

    def loss_fn(self) -> Callable:
        return copy.deepcopy(self.task).loss if self.task is not None else self.loss


# ------------------------------------------------------------------------------------------------
# the patient from the command line


def default_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def load(target: str, overrides: list[str] = (), profile: str | None = None, steps: int = STEPS) -> Patient:
    """The Patient named by TARGET (module docstring)."""
    if ":" not in target:
        raise UserError(f"{target!r}: write module:function (e.g. mpt.doctor_examples:underflow) or experiment:NAME")
    mod_name, attr = target.split(":", 1)
    if mod_name == "experiment":
        return _from_experiment(attr, list(overrides), profile, steps)
    if overrides or profile:
        raise UserError(f"--profile and key=value overrides are for experiment:NAME targets, not {target!r}")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise UserError(f"cannot import module {mod_name!r} ({type(e).__name__}: {e}); give a module importable "
                        f"from the current directory, e.g. mpt.doctor_examples:underflow") from None
    obj = getattr(mod, attr, None)
    if obj is None:
        public = sorted(k for k, v in vars(mod).items() if callable(v) and not k.startswith("_")
                        and getattr(v, "__module__", None) == mod.__name__)
        raise UserError(f"module {mod_name!r} has no {attr!r}; it defines: {', '.join(public) or 'nothing callable'}")
    if inspect.isclass(obj) and issubclass(obj, Task):
        return _from_task(obj(), Config(), target, steps)
    if not callable(obj):
        raise UserError(f"{target} is a {type(obj).__name__}, not a function; {FORM}")
    got = obj()
    if isinstance(got, Task):
        return _from_task(got, Config(), target, steps)
    return _from_value(got, target)


def _from_value(got: Any, target: str) -> Patient:
    keys = ("model", "loss", "batches", "optimizer")
    if isinstance(got, dict):
        unknown = set(got) - set(keys)
        if unknown or not {"model", "loss", "batches"} <= set(got):
            raise UserError(f"{target} returned a dict with keys {sorted(got)}; {FORM}")
        parts = [got.get(k) for k in keys]
    elif isinstance(got, (tuple, list)) and len(got) in (3, 4):
        parts = list(got) + [None] * (4 - len(got))
    else:
        what = f"a {len(got)}-tuple" if isinstance(got, (tuple, list)) else f"a value of type {type(got).__name__}"
        raise UserError(f"{target} returned {what}; {FORM}")
    model, loss, batches, opt = parts
    if not isinstance(model, nn.Module):
        raise UserError(f"{target}: the model is a {type(model).__name__}, not a torch.nn.Module; {FORM}")
    if not callable(loss):
        raise UserError(f"{target}: the loss is a {type(loss).__name__}, not a function loss(model, batch); {FORM}")
    if opt is not None and not callable(opt):
        raise UserError(f"{target}: the optimizer is a {type(opt).__name__}, not a function optimizer(model); {FORM}")
    try:
        batches = list(batches)
    except TypeError:
        raise UserError(f"{target}: the batches are a {type(batches).__name__}, not a list of batches; "
                        f"{FORM}") from None
    if not batches:
        raise UserError(f"{target}: no batches; give at least one (the doctor cycles through them)")
    note = "optimizer: SGD, lr 0.01, momentum 0.9 (the default; return your own as the 4th item)"
    return Patient(target, model, loss, batches, opt or default_optimizer, [] if opt else [note])


def _from_task(task: Task, cfg, name: str, steps: int) -> Patient:
    """A Task's model, optimizer, loss and first `steps` training batches, as the engine would draw them
    (mpt.data's seeded sampler and dataset, the task's collate and order); one optimizer, constant lr."""
    from torch.utils.data import DataLoader

    from mpt.data import EpochSampler, SeededDataset

    if type(task).train_step is not Task.train_step:
        raise UserError(f"{name}: {type(task).__qualname__} has its own train_step (several losses or optimizers); "
                        f"the doctor runs the default loss step: give module:function returning one model and loss")
    torch.manual_seed(cfg.seed)
    train, _ = task.datasets(cfg)
    model = task.build_model(cfg)
    if isinstance(model, nn.ModuleDict):
        raise UserError(f"{name}: the task builds several models ({', '.join(model)}); the doctor examines one")
    micro = max(1, cfg.train.batch_size // cfg.train.accum_steps)
    if len(train) < micro:
        raise UserError(f"{name}: train.batch_size={micro} is larger than the training set ({len(train)})")
    ds = SeededDataset(train, cfg.seed)
    sampler = EpochSampler(len(train), cfg.seed, task.shuffle_train, batch_size=micro, order=task.train_order,
                           with_epoch=True)
    loader = DataLoader(ds, batch_size=micro, sampler=sampler, drop_last=True, collate_fn=task.collate)
    batches, epoch = [], 0
    while len(batches) < steps:
        sampler.set_epoch(epoch)
        ds.set_epoch(epoch)
        for b in loader:
            batches.append(b)
            if len(batches) == steps:
                break
        epoch += 1

    def optimizer(m):
        opts = dict(task.optimizers(m, cfg))
        if len(opts) != 1:
            raise UserError(f"{name}: the task has {len(opts)} optimizers; the doctor examines one")
        return next(iter(opts.values()))

    notes = [f"batches: the first {steps} training batches of {micro} (train.batch_size / accum_steps)",
             ("optimizer: the task's own optimizers()" if type(task).optimizers is not Task.optimizers
              else f"optimizer: optim.name={cfg.optim.name}, optim.lr={cfg.optim.lr}") + "; no schedule applied"]
    return Patient(name, model, task.loss, batches, optimizer, notes, cfg.seed, task)


def _from_experiment(name: str, overrides: list[str], profile: str | None, steps: int) -> Patient:
    from mpt import config

    args = ([f"profile={profile}"] if profile else []) + overrides
    cfg = config.resolve(name, args)
    mod = config.experiment_module(name)
    label = f"experiment:{name} ({cfg.model}, profile {cfg.profile})"
    return _from_task(mod.Task(), cfg, label, steps)


# ------------------------------------------------------------------------------------------------
# training phases, through the one recipe and step


def _mean_loss(loss_fn, model, batch, where: str):
    out = loss_fn(model, batch)
    loss, items = out if isinstance(out, tuple) and len(out) == 2 else (out, 1)
    if not isinstance(loss, torch.Tensor):
        raise UserError(f"{where}: loss(model, batch) returned a {type(loss).__name__}; "
                        f"return the mean loss as a tensor")
    if loss.numel() != 1:
        raise UserError(f"{where}: loss(model, batch) returned a tensor of shape {tuple(loss.shape)}; "
                        f"return the mean loss (a scalar), e.g. F.mse_loss(...) with reduction='mean'")
    if not loss.requires_grad:
        raise UserError(f"{where}: the loss does not depend on the model's parameters (no gradient); "
                        f"compute it from model(batch)")
    return loss.reshape(()), items


def train(patient: Patient, precision: str, loss_scale: str = "auto", steps: int = STEPS,
          device: torch.device | str = "cpu", numerics: bool = True, half_math: str = "auto",
          watch: bool = False) -> dict:
    """Train a copy of the patient's model for `steps` steps under `precision` (mpt.precision.build: the same
    recipes as every run) and measure: losses, skipped steps, forward value ranges per layer, and with
    `numerics` the gradient histograms and swamping of every step (mpt.numerics.Numerics, as the engine
    samples them) and the initial weights' ranges; with `watch`, the first operation whose FP16/BF16 result is
    inf/nan from finite inputs (mpt.numerics.FirstOverflow). Returns a dict of plain values."""
    device = torch.device(device)
    recipe = recipes.build(Config(precision=precision, loss_scale=loss_scale, half_math=half_math), device)
    model = copy.deepcopy(patient.model).to(device)
    opt = patient.optimizer(model)
    model = recipe.prepare(model, [opt])
    num = Numerics(model, every=1 if numerics else 0)
    forward = ValueRanges()
    weights = ValueRanges()
    if numerics:
        for pname, p in model.named_parameters():
            weights.add(pname.rpartition(".")[0] or "root", p)
    meter = ActivationMeter(model)
    watch = FirstOverflow(model) if watch else None
    loss_fn = patient.loss_fn()
    torch.manual_seed(patient.seed)  # the same steps: dropout masks and sampled negatives too
    losses, samples, skipped = [], [], 0
    for i in range(steps):
        batch = to_device(patient.batches[i % len(patient.batches)], device, False)
        sample: dict = {}

        def step():
            before = None
            if numerics:  # as Run.optimizer_step samples: true gradients, then the update's fate (3.1)
                sample.update(num.end(model.named_parameters(), recipe.loss_scale))
                before = [w.detach().clone() for w in recipe.weights_of(opt)]
            applied = recipe.step(opt)
            if numerics:
                sample.update(num.swamping(before, recipe.params_of(opt), recipe.weights_of(opt)))
            return applied

        num.begin(i)
        with forward.recording(model), (watch.watching(i) if watch else contextlib.nullcontext()):
            loss, _, applied = loss_step(recipe, lambda b: _mean_loss(loss_fn, model, b, patient.name), [batch],
                                         step, meter=meter if i == 0 else None)
        losses.append(float(loss))
        skipped += not applied
        if numerics:
            samples.append(sample)
    return {"precision": precision, "loss_scale": loss_scale, "final_loss_scale": recipe.loss_scale,
            "half_math": recipe.half_math, "losses": losses, "skipped": skipped,
            "nonfinite_losses": sum(not math.isfinite(v) for v in losses), "forward": forward.summary(),
            "weights": weights.summary(), "numerics": samples, "memory": meter.breakdown(),
            "first_inf": watch.first if watch else None,
            "types": {name or "root": type(m).__name__ for name, m in model.named_modules()}}


# ------------------------------------------------------------------------------------------------
# analysis


def _pow2(s: float | None) -> str:
    if s is None:
        return "none"
    k = math.log2(s)
    return f"2^{round(k)}" if k == round(k) else f"{s:g}"


def _flushed_at(hist: list[int], k: int, lo: int = HIST_LO) -> int:
    """Non-zero values of a true-gradient exponent histogram that FP16 stores as zero at S = 2^k: exponent
    at most -26 - k (below 2^-25 / S; a value in [2^-25, 2^-24) x S rounds up to 2^-24, and only 2^-25 itself
    rounds to zero, which this leaves out)."""
    cut = -26 - k - lo
    return sum(hist[: cut + 1]) if cut >= 0 else 0


def _gradients(samples: list[dict]) -> dict:
    """Per (kind, layer) over every sampled step: counts, zeros, FP16 underflow at S = 1 (exact bands:
    the FP32 run's S is 1), non-finite, max |g|, and the summed exponent histogram."""
    acc: dict = {}
    for s in samples:
        for key, v in s.items():
            m = re.match(r"^numerics/(act|weight)/(.+)/count$", key)
            if not m:
                continue
            kind, layer = m.groups()
            p = f"numerics/{kind}/{layer}/"
            a = acc.setdefault((kind, layer), {"count": 0, "zero": 0.0, "underflow": 0.0, "overflow": 0.0,
                                               "max_abs": 0.0, "hist": None})
            a["count"] += v
            for band in ("zero", "underflow", "overflow"):
                a[band] += s[p + f"frac_{band}"] * v
            a["max_abs"] = max(a["max_abs"], s[p + "max_abs"])
            h = s[p + "hist"]
            a["hist"] = h if a["hist"] is None else [x + y for x, y in zip(a["hist"], h)]
    out = {}
    for (kind, layer), a in acc.items():
        nonzero = a["count"] - round(a["zero"])
        out.setdefault(kind, {})[layer] = {
            "count": a["count"], "frac_zero": a["zero"] / a["count"] if a["count"] else 0.0,
            "flushed_s1": a["underflow"] / nonzero if nonzero else 0.0, "overflow_s1": a["overflow"] / a["count"]
            if a["count"] else 0.0, "max_abs": a["max_abs"], "hist": a["hist"], "nonzero": sum(a["hist"] or [])}
    return out


def _smallest_scale(hist: list[int], tol: float) -> float | None:
    """The smallest power of two S <= 2^24 at which at most `tol` of the histogram's values flush to zero."""
    n = sum(hist)
    for k in range(0, 25):
        if n == 0 or _flushed_at(hist, k) <= tol * n:
            return 2.0**k
    return None


def _overflow_at(max_abs: float) -> float | None:
    """The smallest power of two S at which S x max|g| rounds to inf in FP16."""
    if not max_abs > 0:
        return None
    return 2.0 ** math.ceil(math.log2(FP16_ROUNDS_TO_INF / max_abs))


def _tail(steps: int) -> range:
    """The steps whose losses measure where training got: the last quarter (at least one)."""
    return range(steps - max(1, steps // 4), steps)


def untrained_losses(patient: Patient, steps: int, device) -> list[float]:
    """The initial model's FP32 losses on the batches of the tail steps: the level "no learning" stays at."""
    model = copy.deepcopy(patient.model).to(device)  # a copy: a forward in train mode moves norm statistics
    out, loss_fn = [], patient.loss_fn()
    torch.manual_seed(patient.seed)
    with torch.no_grad():
        for i in _tail(steps):
            loss = loss_fn(model, to_device(patient.batches[i % len(patient.batches)], device, False))
            out.append(float(loss[0] if isinstance(loss, tuple) else loss))
    return out


def _progress(losses: list[float], ref: list[float], untrained: list[float]) -> float | None:
    """How far a run got on the tail steps' batches, as a share of how far FP32 got from the untrained
    model's losses on the same batches: 1 = as FP32, 0 = not at all (None: non-finite, or FP32 did not learn)."""
    tail = _tail(len(ref))
    mine = sum(losses[i] for i in tail) / len(tail)
    theirs = sum(ref[i] for i in tail) / len(tail)
    start = sum(untrained) / len(untrained)
    if not math.isfinite(mine) or not start - theirs > 0:
        return None
    return (start - mine) / (start - theirs)


def analyse(fp32: dict, fp16: dict, untrained: list[float], tol: float = TOLERANCE, margin: float = MARGIN) -> dict:
    """The report's findings and verdict from the FP32 run (with numerics) and the FP16 (S = 1) replay."""
    # Forward: values above 65504 are inf in FP16 (the layer needs BF16 or FP32); at or below 2^-25, zero.
    fwd_rows = []
    for layer, r in fp32["forward"].items():
        nonzero = r["count"] * (1 - r["frac_zero"])
        replay = fp16["forward"].get(layer, {})
        fwd_rows.append({"layer": layer, "type": fp32["types"].get(layer, ""), "max_abs": r["max_abs"],
                         "frac_overflow": r["frac_overflow"],
                         "flushed": r["frac_underflow"] * r["count"] / nonzero if nonzero else 0.0,
                         "fp16_nonfinite": replay.get("nonfinite", 0), "count": r["count"]})
    overflow_layers = [f"{r['layer']} ({r['type']})" for r in fwd_rows if r["frac_overflow"] > 0]
    weight_overflow = [layer for layer, r in fp32["weights"].items() if r["frac_overflow"] > 0]
    fp16_inf_layers = [r["layer"] for r in fwd_rows if r["fp16_nonfinite"] > 0]
    first_inf = fp16["first_inf"]  # the operation that made it, from finite inputs

    # Backward: gradients at S = 1, the S range that keeps them, the first layer to overflow as S grows.
    grads = _gradients(fp32["numerics"])
    replay_grads = _gradients(fp16["numerics"])
    kinds = {}
    for kind in ("act", "weight"):
        layers = grads.get(kind, {})
        overall = layers.get("overall")
        if overall is None:
            continue
        rows = [{"layer": layer, **{k: v for k, v in r.items() if k != "hist"},
                 "s_min": _smallest_scale(r["hist"], tol), "s_max": advise_loss_scale(r["max_abs"], 1.0, MAX_SCALE)}
                for layer, r in layers.items() if layer != "overall"]
        rows.sort(key=lambda r: -r["flushed_s1"])
        replay = replay_grads.get(kind, {}).get("overall", {})
        kinds[kind] = {"overall": {k: v for k, v in overall.items() if k != "hist"}, "layers": rows,
                       "hist": overall["hist"], "s_min": _smallest_scale(overall["hist"], tol),
                       "fp16_frac_zero": replay.get("frac_zero")}
    maxima = [(r["max_abs"], kind, r["layer"]) for kind, k in kinds.items() for r in k["layers"]]
    top = max(maxima) if maxima else (0.0, None, None)
    s_low = max((k["s_min"] for k in kinds.values() if k["s_min"] is not None), default=None)
    if any(k["s_min"] is None for k in kinds.values()):
        s_low = None
    s_high = advise_loss_scale(top[0], 1.0, MAX_SCALE) if maxima else MAX_SCALE
    advised = advise_loss_scale(top[0], margin, MAX_SCALE) if maxima else MAX_SCALE
    backward = {
        "kinds": kinds, "s_low": s_low, "s_high": s_high, "advised": advised, "tolerance": tol, "margin": margin,
        "first_overflow": {"kind": top[1], "layer": top[2], "max_abs": top[0], "at_scale": _overflow_at(top[0])},
    }

    # The update (section 3.1): what FP16 weights would lose without the FP32 master copy.
    sw = [s for s in fp32["numerics"] if "numerics/swamp/frac_swamped" in s]
    update = {"frac_swamped_mean": sum(s["numerics/swamp/frac_swamped"] for s in sw) / len(sw) if sw else None,
              "frac_swamped_max": max((s["numerics/swamp/frac_swamped"] for s in sw), default=None),
              "frac_update_underflow_mean": sum(s["numerics/swamp/frac_update_underflow"] for s in sw) / len(sw)
              if sw else None}
    update["master_matters"] = (update["frac_swamped_max"] or 0.0) > SWAMP_MATTERS

    verdict = _verdict(overflow_layers + [f"{w} (weights)" for w in weight_overflow], first_inf, backward, fp16)
    return {"forward": {"rows": fwd_rows, "overflow_layers": overflow_layers, "weight_overflow": weight_overflow,
                        "fp16_inf_layers": fp16_inf_layers, "first_inf": first_inf},
            "backward": backward, "update": update, "verdict": verdict,
            "fp16_progress": _progress(fp16["losses"], fp32["losses"], untrained)}


def _verdict(overflow: list[str], first_inf: dict | None, bw: dict, fp16: dict) -> dict:
    """precision + loss_scale to use, why (the measurement), and the alternatives."""
    s_low, s_high, advised = bw["s_low"], bw["s_high"], bw["advised"]
    kinds = bw["kinds"]
    flushed = {k: v["overall"]["flushed_s1"] for k, v in kinds.items()}
    flushed_txt = ", ".join(f"{100 * v:.2f}% of non-zero {k}-gradient values" for k, v in flushed.items())
    if overflow:
        return {"precision": "bf16", "loss_scale": "auto",
                "why": f"forward overflow: {', '.join(overflow)} reach(es) |x| > 65504 in FP32 training, inf in FP16 "
                       f"(no loss scale changes the forward pass); BF16 has FP32's range",
                "alternatives": [f"keep {', '.join(overflow)} in FP32 (and fp16 elsewhere)",
                                 "rescale the layer (a normalisation before it) so its outputs stay below 65504"],
                "keep_fp32": overflow}
    if s_low is None or s_low > s_high:
        # FP16's range is narrower than the gradients': the best one S can do is the largest that does not
        # overflow, which a dynamic scaler finds. Good enough when it flushes little; else BF16.
        k = round(math.log2(s_high))
        lost = max(_flushed_at(v["hist"], k) / max(1, sum(v["hist"])) for v in kinds.values())
        why = (f"no single loss scale fits: keeping all but {100 * bw['tolerance']:g}% of the gradients needs "
               f"S >= {_pow2(s_low) if s_low else 'more than 2^24'}, but the {bw['first_overflow']['kind']}-gradient "
               f"of {bw['first_overflow']['layer']} overflows above S = {_pow2(s_high)}, where FP16 still flushes "
               f"{_pct(lost)} of a gradient kind's non-zero values")
        if lost <= LOST_OK:
            return {"precision": "mixed", "loss_scale": "dynamic",
                    "why": why + f" (<= {_pct(LOST_OK)}): a dynamic scaler keeps S at that edge",
                    "alternatives": ["bf16 keeps every gradient (FP32's exponent range)"], "keep_fp32": []}
        return {"precision": "bf16", "loss_scale": "auto", "why": why + f" (> {_pct(LOST_OK)}); BF16 keeps them",
                "alternatives": ["mixed loss_scale=dynamic, accepting the flushed share at the edge of overflow"],
                "keep_fp32": []}
    if first_inf:
        # No module output leaves FP16's range in FP32, yet an operation of the FP16 forward made inf/nan from
        # finite inputs: a value computed inside a module (a sum of squares, an exp), as in T5's FP16 layer norm.
        first = first_inf["module"]
        return {"precision": "bf16", "loss_scale": "auto",
                "why": f"in the FP16 replay {first_inf['op']} inside {first} made inf/nan from finite inputs "
                       f"(largest {first_inf['input_max_abs']:.3g}, step {first_inf['step'] + 1}), though no layer's "
                       f"output exceeds 65504 in FP32: a value computed inside it overflows FP16; BF16 has FP32's "
                       f"range",
                "alternatives": [f"keep {first} in FP32 (impl=paper: give its class fp32_compute = True)"],
                "keep_fp32": [first]}
    if s_low == 1 and fp16["nonfinite_losses"] == 0:
        return {"precision": "fp16", "loss_scale": "auto",
                "why": f"at S = 1 FP16 flushes only {flushed_txt} (<= {100 * bw['tolerance']:g}%): no scaling "
                       f"needed (as the paper's Table 1 CNNs)",
                "alternatives": ["mixed loss_scale=dynamic costs nothing and guards against later growth"],
                "keep_fp32": []}
    s = min(max(advised, s_low), s_high)
    fo = bw["first_overflow"]
    # Wide: the scales between S_low and the first overflow (not the cap) span WIDE or more.
    static = (fo["at_scale"] or math.inf) / 2 / s_low >= WIDE
    why = (f"at S = 1 FP16 flushes {flushed_txt}; S >= {_pow2(s_low)} keeps all but {100 * bw['tolerance']:g}%; "
           f"the largest gradient ({fo['max_abs']:.3g}, {fo['kind']}-gradient of {fo['layer']}) overflows at "
           f"S = {_pow2(fo['at_scale'])}; S = {_pow2(s)}: "
           + ("the largest power of two with S x max|g| x 2 < 65504" if s == advised and advised < MAX_SCALE else
              f"the doctor's cap (2^{round(math.log2(MAX_SCALE))})" if s == MAX_SCALE else "the range's edge"))
    if static:
        return {"precision": "mixed", "loss_scale": _num(s), "why": why + " (section 3.2)",
                "alternatives": ["mixed loss_scale=dynamic finds a scale in the same range by itself"], "keep_fp32": []}
    return {"precision": "mixed", "loss_scale": "dynamic",
            "why": why + f"; the range is narrow (x{s_high / s_low:g}): let the scale follow the gradients",
            "alternatives": [f"mixed loss_scale={_num(s)} (static)"], "keep_fp32": []}


def _num(s: float) -> str:
    return str(int(s)) if s == int(s) else repr(s)


def examine(patient: Patient, steps: int = STEPS, device="cpu", tol: float = TOLERANCE, margin: float = MARGIN,
            verify: bool = True) -> dict:
    """The whole examination: FP32 with numerics, the FP16 (S = 1) replay, the analysis and verdict, and a
    replay in the recommended recipe. Returns the report as a dict (report.json)."""
    t0 = time.time()
    device = torch.device(device)
    fp32 = train(patient, "fp32", steps=steps, device=device)
    fp16 = train(patient, "fp16", steps=steps, device=device, watch=True)
    untrained = untrained_losses(patient, steps, device)
    found = analyse(fp32, fp16, untrained, tol, margin)
    v = found["verdict"]
    runs = {"fp32": fp32, "fp16": fp16}
    notes = list(patient.notes)
    if verify and (v["precision"], v["loss_scale"]) != ("fp16", "auto"):
        key = v["precision"] if v["loss_scale"] == "auto" else f"{v['precision']} loss_scale={v['loss_scale']}"
        runs[key] = train(patient, v["precision"], v["loss_scale"], steps=steps, device=device, numerics=False)
    if device.type == "cpu" and any(isinstance(m, nn.RNNBase) for m in patient.model.modules()):
        # Emulated FP16 math runs a recurrent layer whole in FP32 and autograd keeps its FP32 internals; its
        # memory is measured with PyTorch's own FP16 kernels, one step (README, "FP16 math on a CPU").
        for key, r in runs.items():
            if key != "fp32":
                r["memory"] = train(patient, r["precision"], r["loss_scale"], steps=1, device=device,
                                    numerics=False, half_math="native")["memory"]
                r["memory"]["half_math"] = "native"
        notes.append("memory of the recurrent model measured with half_math=native (one step): emulated "
                     "FP16 math keeps a recurrent layer's FP32 internals")
    checks = {}
    for key, r in runs.items():
        tail = [r["losses"][i] for i in _tail(steps)]
        checks[key] = {"first_loss": r["losses"][0], "tail_loss": sum(tail) / len(tail), "skipped": r["skipped"],
                       "nonfinite_losses": r["nonfinite_losses"], "final_loss_scale": r["final_loss_scale"],
                       "progress": _progress(r["losses"], fp32["losses"], untrained), "half_math": r["half_math"],
                       "memory": r["memory"], "losses": r["losses"]}
    # The replay of the recommended recipe (the FP16 one itself when that is the verdict); none with verify=False.
    verified = list(checks)[-1] if verify or v["precision"] == "fp16" else None
    c = checks.get(verified, {"skipped": 0, "nonfinite_losses": 0, "progress": None})
    v["checked"] = verified
    # A static S must never skip; a dynamic scaler skips while it backs off from its initial 2^16 to the
    # measured range (one skip per halving), and no more.
    v["allowed_skips"] = 0
    if v["loss_scale"] == "dynamic":
        v["allowed_skips"] = max(0, math.ceil(math.log2(Config().scaler.init_scale / found["backward"]["s_high"])))
    v["confirmed"] = None if verified is None else (c["skipped"] <= v["allowed_skips"] and c["nonfinite_losses"] == 0
                                                    and c["progress"] is not None and c["progress"] >= CONFIRM)
    p16 = checks["fp16"]["progress"]
    if v["precision"] == "mixed" and p16 is not None and p16 >= CONFIRM and checks["fp16"]["nonfinite_losses"] == 0:
        v["alternatives"].append(f"precision=fp16 (S = 1) also reached {_pct(p16)} of FP32's progress in its replay, "
                                 f"flushed values notwithstanding: over {steps} steps they did not matter")
    return {"patient": patient.name, "device": str(device), "steps": steps, "notes": notes,
            "untrained_tail_loss": sum(untrained) / len(untrained), "fp16_max": FP16_MAX, "hist_lo": HIST_LO,
            "hist_hi": HIST_HI, **found, "runs": checks, "forward_hist": _sum_hists(fp32["forward"]),
            "wall_s": time.time() - t0}


def _sum_hists(summary: dict) -> list[int]:
    total = None
    for r in summary.values():
        total = r["hist"] if total is None else [a + b for a, b in zip(total, r["hist"])]
    return total or []


# ------------------------------------------------------------------------------------------------
# the report


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%" if abs(x) >= 0.001 or x == 0 else f"{100 * x:.2g}%"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _memory_line(runs: dict) -> tuple[str, dict]:
    fp32 = runs["fp32"]["memory"]["activation_only_bytes"]
    lines, saved = [], {}
    for key, r in runs.items():
        m = r["memory"]
        by = ", ".join(f"{d} {_bytes(b)}" for d, b in m["activation_only_bytes_by_dtype"].items())
        frac = 1 - m["activation_only_bytes"] / fp32 if fp32 else 0.0
        saved[key] = frac
        lines.append(f"{key}: {_bytes(m['activation_only_bytes'])} ({by})"
                     + ("" if key == "fp32" else f", {_pct(frac)} less than fp32"))
    return "; ".join(lines), saved


def text_report(rep: dict, max_layers: int = 4) -> list[str]:
    """The one-screen report, as lines (the Markdown file adds tables)."""
    fw, bw, up, v = rep["forward"], rep["backward"], rep["update"], rep["verdict"]
    runs = rep["runs"]
    out = [f"mpt.doctor {rep['patient']}: {rep['steps']} steps on {rep['device']} in FP32, replayed in FP16 at S = 1"]
    out += [f"  note: {n}" for n in rep["notes"]]
    f32, f16 = runs["fp32"], runs["fp16"]
    n_tail = len(_tail(rep["steps"]))
    out.append(f"  mean loss over the last {n_tail} steps' batches: untrained {rep['untrained_tail_loss']:.4g}, "
               f"fp32 {f32['tail_loss']:.4g}, fp16 (S = 1) {f16['tail_loss']:.4g} "
               f"(progress {_pct(f16['progress'])} of fp32's)")
    out.append("Forward pass (FP32 values against FP16's range)")
    rows = sorted(fw["rows"], key=lambda r: -r["max_abs"])
    if rows:
        r = rows[0]
        out.append(f"  largest |activation|: {r['max_abs']:.3g} in {r['layer']} ({r['type']})"
                   + (" -- above 65504: inf in FP16" if r["frac_overflow"] > 0 else " (FP16 max 65504)"))
    for r in [r for r in rows if r["frac_overflow"] > 0][:max_layers]:
        out.append(f"  OVERFLOW {r['layer']} ({r['type']}): {_pct(r['frac_overflow'])} of its outputs above 65504 "
                   f"(max {r['max_abs']:.3g}); fp16 replay: {r['fp16_nonfinite']} inf/nan values")
    fi = fw["first_inf"]
    if fi:
        out.append(f"  fp16 replay: the first inf/nan made from finite values: {fi['op']} in {fi['module']} "
                   f"(step {fi['step'] + 1}, inputs up to {fi['input_max_abs']:.3g})")
    if fw["weight_overflow"]:
        out.append(f"  OVERFLOW weights of {', '.join(fw['weight_overflow'])} above 65504")
    under = sorted((r for r in fw["rows"] if r["flushed"] > 0), key=lambda r: -r["flushed"])
    worst = f"at most {_pct(under[0]['flushed'])} of a layer's non-zero outputs ({under[0]['layer']})" if under else ""
    out.append("  activations flushed to zero in FP16: " + (worst or "none"))
    out.append("Backward pass (gradients at S = 1; section 3.2)")
    for kind, k in bw["kinds"].items():
        o = k["overall"]
        worst = ", ".join(f"{r['layer']} {_pct(r['flushed_s1'])}" for r in k["layers"][:3] if r["flushed_s1"] > 0)
        out.append(f"  {kind}-gradients: {_pct(o['flushed_s1'])} of non-zero values flushed to zero at S = 1"
                   + (f" (worst: {worst})" if worst else "") + f"; max |g| {o['max_abs']:.3g}; "
                   f"keeping all but {_pct(bw['tolerance'])} needs S >= "
                   f"{_pow2(k['s_min']) if k['s_min'] else 'more than 2^24'}")
        if k["fp16_frac_zero"] is not None:
            out.append(f"    fp16 replay: zeros {_pct(o['frac_zero'])} of values in fp32 -> "
                       f"{_pct(k['fp16_frac_zero'])}")
    fo = bw["first_overflow"]
    cap = " (the doctor's cap)" if bw["s_high"] == MAX_SCALE else ""
    out.append(f"  usable S: {_pow2(bw['s_low'])} .. {_pow2(bw['s_high'])}{cap}; first to overflow as S grows: "
               f"{fo['kind']}-gradient of {fo['layer']} (max {fo['max_abs']:.3g}) at S = {_pow2(fo['at_scale'])}")
    out.append("Update (section 3.1: FP16 weights without the FP32 master copy)")
    out.append(f"  an FP16 weight would lose {_pct(up['frac_swamped_mean'])} of the updates "
               f"(max {_pct(up['frac_swamped_max'])} "
               f"in a step); {_pct(up['frac_update_underflow_mean'])} are below 2^-24 outright -> "
               + ("keep the FP32 master copy (mixed / fp16, not fp16_pure)" if up["master_matters"]
                  else "the master copy matters little at this learning rate"))
    mem, _ = _memory_line(runs)
    out.append(f"Memory (activations saved for backward, step 1): {mem}")
    cmd = f"precision={v['precision']}" + ("" if v["loss_scale"] == "auto" else f" loss_scale={v['loss_scale']}")
    out.append(f"Verdict: {cmd}")
    out.append(f"  because {v['why']}")
    if v["checked"] is None:
        out.append("  not checked (--no-verify)")
    else:
        c = runs[v["checked"]]
        allowed = f" (<= {v['allowed_skips']} while the scaler backs off from 2^16)" if v["allowed_skips"] else ""
        out.append(f"  checked: {v['checked']} replay: {c['skipped']} skipped steps{allowed}, {c['nonfinite_losses']} "
                   f"non-finite losses, progress {_pct(c['progress'])} of fp32's -> "
                   + ("confirmed" if v["confirmed"] else "NOT confirmed: look at the report before trusting it"))
    for a in v["alternatives"]:
        out.append(f"  or: {a}")
    return out


def wrap(lines: list[str], width: int = 118) -> list[str]:
    """Long report lines folded for a terminal, continuations indented under their line."""
    import textwrap

    out = []
    for line in lines:
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        out += textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False) or [""]
    return out


def markdown_report(rep: dict) -> str:
    lines = ["# Precision report: " + rep["patient"], "", "```", *wrap(text_report(rep)), "```", ""]
    lines += ["## Forward pass: values per layer (FP32 run)", "",
              "| layer | max abs | share above 65504 | share of non-zero flushed to zero "
              "| inf/nan in the fp16 replay |",
              "|---|---|---|---|---|"]
    for r in rep["forward"]["rows"]:
        lines.append(f"| {r['layer']} | {r['max_abs']:.3g} | {_pct(r['frac_overflow'])} | {_pct(r['flushed'])} | "
                     f"{r['fp16_nonfinite']} |")
    for kind, k in rep["backward"]["kinds"].items():
        lines += ["", f"## Backward pass: {kind}-gradients per layer (FP32 run, true values)", "",
                  "| layer | flushed at S = 1 | max abs | S keeping all but the tolerance "
                  "| largest S without overflow |",
                  "|---|---|---|---|---|"]
        for r in k["layers"]:
            lines.append(f"| {r['layer']} | {_pct(r['flushed_s1'])} | {r['max_abs']:.3g} | {_pow2(r['s_min'])} | "
                         f"{_pow2(r['s_max'])} |")
    lines += ["", "## Replays", "", "| run | first loss | mean loss, last quarter | skipped | non-finite losses "
              "| progress vs fp32 | "
              "activation bytes by dtype |", "|---|---|---|---|---|---|---|"]
    for key, c in rep["runs"].items():
        by = ", ".join(f"{d} {_bytes(b)}" for d, b in c["memory"]["activation_only_bytes_by_dtype"].items())
        lines.append(f"| {key} | {c['first_loss']:.4g} | {c['tail_loss']:.4g} | {c['skipped']} | "
                     f"{c['nonfinite_losses']} | {_pct(c['progress'])} | {by} |")
    lines += ["", "Histograms: histograms.png. Everything measured: report.json."]
    return "\n".join(lines) + "\n"


def figure(rep: dict) -> bytes:
    """Exponent histograms with FP16's bands: forward activations, activation and weight gradients."""
    from matplotlib.figure import Figure

    from mpt.plots import draw_hist, render

    lo = rep["hist_lo"]
    panels = [("forward activations (FP32)", rep["forward_hist"], "tab:gray", ())]
    s = rep["verdict"]["loss_scale"]
    mark = ()
    if s not in ("auto", "dynamic"):
        mark = (-24 - round(math.log2(float(s))),)  # below this, flushed even at the advised S
    for kind, k in rep["backward"]["kinds"].items():
        title = f"{kind}-gradients (FP32, true values)" + (f"; dashed: 2^-24 / S, flushed below it at S = {s}"
                                                              if mark else "")
        panels.append((title, k["hist"], "tab:blue", mark))
    fig = Figure(figsize=(9, 2.8 * len(panels)))
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (title, hist, color, m) in zip(axes, panels):
        counter = collections.Counter({lo + i: c for i, c in enumerate(hist) if c})
        if counter:
            draw_hist(ax, counter, title, color, m)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("exponent of |value| (log2)")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{rep['patient']}: {rep['steps']} steps", fontsize=10)
    fig.tight_layout()
    return render(fig, "png")


def _strict(obj):
    """JSON without NaN/Infinity (which strict parsers refuse): non-finite floats as the strings "nan", "inf"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def write(rep: dict, out: Path) -> list[Path]:
    """report.md, report.json and histograms.png in `out`, each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "report.md", out / "report.json", out / "histograms.png"]
    atomic_write_text(files[0], markdown_report(rep))
    atomic_write_json(files[1], _strict(rep))
    atomic_write_bytes(files[2], figure(rep))
    return files


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m mpt.doctor", description=__doc__.split("\n")[0],
                                epilog="e.g. python -m mpt.doctor mpt.doctor_examples:underflow")
    p.add_argument("target", help="module:function, module:TaskClass or experiment:NAME")
    p.add_argument("overrides", nargs="*", help="key=value config overrides (experiment:NAME only)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"training steps per phase (default {STEPS})")
    p.add_argument("--profile", default=None, help="the experiment's profile (experiment:NAME only), e.g. tiny")
    p.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda, cuda:N")
    p.add_argument("--out", default=None, help="folder for report.md, report.json, histograms.png "
                                               "(default doctor_out/<target>)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help=f"share of non-zero gradient values allowed to flush to zero (default {TOLERANCE})")
    p.add_argument("--no-verify", action="store_true", help="skip the replay in the recommended recipe")
    a = p.parse_intermixed_args(argv)
    if a.steps < 1:
        raise UserError(f"--steps={a.steps}: need at least 1 step")
    if not 0 <= a.tolerance < 1:
        raise UserError(f"--tolerance={a.tolerance}: need a share in [0, 1)")
    device = pick_device(a.device)
    patient = load(a.target, a.overrides, a.profile, a.steps)
    rep = examine(patient, a.steps, device, a.tolerance, verify=not a.no_verify)
    out = Path(a.out) if a.out else Path("doctor_out") / re.sub(r"[^\w.-]+", "_", a.target)
    lines = wrap(text_report(rep))
    files = write(rep, out)
    print("\n".join(lines))
    print(f"wrote {', '.join(str(f) for f in files)} ({rep['wall_s']:.1f} s)")
    return rep


if __name__ == "__main__":
    cli(main)(sys.argv[1:])
