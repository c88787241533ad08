"""One phase of the examination: the patient's steps replayed under one precision, with every measurement
the verdict reads; and the measure of how far a replay got ("progress", the package docstring)."""
from __future__ import annotations

import contextlib
import copy
import math

import torch

from mpt import precision as recipes
from mpt.bands import tensors_in
from mpt.config import Config
from mpt.doctor.probes import ValueRanges
from mpt.doctor.targets import STEPS, Patient, call_loss
from mpt.doctor.trace import Slots, Trace, first_overflow
from mpt.errors import UserError
from mpt.memory import ActivationMeter
from mpt.precision import cast_floats
from mpt.numerics import Numerics, NumericsObserver
from mpt.precisions import FORMATS
from mpt.ranks import to_device
from mpt.step import TrainStep


def tail_steps(steps: int) -> range:
    """The steps whose losses measure where training got: the last quarter (at least one)."""
    return range(steps - max(1, steps // 4), steps)


def untrained_losses(patient: Patient, steps: int, device) -> list[float]:
    """The initial model's FP32 losses on the batches of the tail steps: the level "no learning" stays at."""
    model = copy.deepcopy(patient.model).to(device)  # a copy: a forward in train mode moves norm statistics
    out, loss_fn = [], patient.loss_fn()
    torch.manual_seed(patient.seed)
    with torch.no_grad():
        for i in tail_steps(steps):
            loss = call_loss(loss_fn, model, to_device(patient.batches[i % len(patient.batches)], device, False),
                             patient.name)
            out.append(float(loss[0] if isinstance(loss, tuple) else loss))
    return out


# Progress is a ratio of two loss reductions; it means something only when FP32's is clearly above the noise
# of the loss: at least this share of how much FP32's own loss moves over the steps (its largest minus its
# smallest, batch to batch as well as from training). A share of the loss itself would depend on a constant
# added to it; its spread does not. And at least 1000 FP32 roundings of the loss (2^-13 of it): below that the
# two reductions are rounding noise (the one place where the loss's size counts).
JUDGE = 0.01
RESOLUTION = 2.0**-13


def fp32_gain(ref: list[float], untrained: list[float]) -> dict:
    """How far FP32 lowered the tail steps' mean loss from the untrained model's, and whether that is enough to
    judge other replays against (`enough`: gain > 0 and >= JUDGE x the spread of FP32's losses over the steps;
    `needed` is that bound in loss units, at least RESOLUTION x |untrained|). Unchanged by a constant added to
    the loss (short of one 2^13 times the gain)."""
    tail = tail_steps(len(ref))
    start = sum(untrained) / len(untrained)
    gain = start - sum(ref[i] for i in tail) / len(tail)
    finite = [x for x in ref if math.isfinite(x)]
    spread = max(finite) - min(finite) if finite else math.nan
    needed = max(JUDGE * spread, RESOLUTION * abs(start))
    return {"gain": gain, "untrained": start, "spread": spread, "needed": needed, "rel": JUDGE,
            "enough": math.isfinite(gain) and gain > 0 and gain >= needed}


# FP32 itself diverges when its loss rose, from the untrained model's on the same batches, by a quarter of how
# much it moves over the steps or more (and more than the gate's noise bound): a loss that did not fall but
# wanders (noise, a plateau) stays within a share of its own spread; one that climbs makes most of it.
DIVERGE = 0.25


def diverges(judge: dict) -> bool:
    """Did FP32's own loss rise clearly (fp32_gain's dict)? No precision verdict means anything then."""
    rise = -judge["gain"]
    return math.isfinite(rise) and rise > 0 and rise >= max(judge["needed"], DIVERGE * judge["spread"])


def progress(losses: list[float], ref: list[float], untrained: list[float]) -> float | None:
    """How far a run got on the tail steps' batches, as a share of how far FP32 got from the untrained
    model's losses on the same batches: 1 = as FP32, 0 = not at all (None: non-finite, or FP32 did not move
    the loss enough to judge, fp32_gain)."""
    tail = tail_steps(len(ref))
    mine = sum(losses[i] for i in tail) / len(tail)
    judge = fp32_gain(ref, untrained)
    if not math.isfinite(mine) or not judge["enough"]:
        return None
    return (judge["untrained"] - mine) / judge["gain"]


def unjudged(judge: dict, steps: int) -> str:
    """The report's sentence for a replay whose progress cannot be judged (fp32_gain not enough). A higher
    learning rate is suggested only where FP32's loss fell, too little: where it did not fall, a higher one
    is the wrong way."""
    moved = (f"FP32 moved the loss by {judge['gain']:.2g} in {steps} steps (from the untrained "
             f"{judge['untrained']:.3g}; judging needs >= {100 * judge['rel']:g}% of its losses' spread over the "
             f"steps, {judge['needed']:.2g})")
    if judge["gain"] > 0:
        return moved + ": not enough to judge; raise --steps or the learning rate"
    return (moved + ": its loss did not fall, so no replay can be judged against it; check the loss and the "
            "optimizer in FP32 (a learning rate too high makes the loss rise)")


def _mean_loss(loss_fn, model, batch, where: str):
    out = call_loss(loss_fn, model, batch, where)
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


def keep_modules_wide(model: torch.nn.Module, names, wide: str, device, precision: str) -> list:
    """Compute the named modules in `wide` (fp32 | bf16) inside a low-precision recipe: their inputs cast to it
    and autocast off (fp32) or in BF16 (bf16) for their forward -- their backward follows the dtypes autograd
    recorded. Under a simulated format (precision=fp8, fp8_block, mxfp8, nvfp4, ...) a module kept wide is marked
    keep_fp32, which mpt.fp8 leaves unquantised.
    Returns the hook handles."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[wide]
    handles = []
    for name in names:
        try:
            m = model.get_submodule(name)
        except AttributeError:
            raise UserError(f"keep wide: the model has no module {name!r}") from None
        if precision in FORMATS:  # the simulated formats' recipe leaves a keep_fp32 module unquantised
            m.keep_fp32 = True
        ctx = torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if wide == "bf16" else \
            torch.autocast(torch.device(device).type, enabled=False)

        def enter(mod, args, kwargs, ctx=ctx):
            ctx.__enter__()
            return cast_floats(args, dtype), cast_floats(kwargs, dtype)

        def leave(mod, args, out, ctx=ctx):
            ctx.__exit__(None, None, None)  # (a forward hook's return value would replace the output)

        handles += [m.register_forward_pre_hook(enter, with_kwargs=True), m.register_forward_hook(leave)]
    return handles


# ------------------------------------------------------------------------------------------------
# train(): one replay, whole. Every phase (FP32 measured, FP16 at S = 1, the recommended recipe) runs
# through it, so their steps differ only in the recipe: same weights, batches and random stream.


def train(patient: Patient, precision: str, loss_scale: str = "auto", steps: int = STEPS,
          device: torch.device | str = "cpu", numerics: bool = True, half_math: str = "auto",
          watch: bool = False, keep_wide: tuple[str, ...] = (), wide: str = "fp32", meter: bool = False) -> dict:
    """Train a copy of the patient's model for `steps` steps under `precision` (mpt.precision.build: the same
    recipes as every run) and measure: losses, skipped steps, forward value ranges per layer, and with
    `numerics` the gradient histograms and swamping of every step (mpt.numerics.Numerics, as the engine
    samples them) and the initial weights' ranges; with `watch`, the first operation whose FP16/BF16 result is
    inf/nan from finite inputs (mpt.doctor.trace.first_overflow). `keep_wide`: modules (names) computed in `wide`
    (fp32 or bf16) inside the recipe (keep_wide.py). The model's output at the last step's forward is kept
    ("last_output": every replay starts from the same weights and reads the same batches in the same order, so
    outputs compare; and a recipe with delayed scales computes with its amax history by then). `meter`: measure only the
    activation bytes step 1 saves for backward (mpt.memory.ActivationMeter) -- with no observer attached, none
    of the above: their hooks change what autograd saves, and the count with them. Returns a dict of plain
    values."""
    device = torch.device(device)
    observe = not meter
    numerics, watch = numerics and observe, watch and observe
    recipe = recipes.build(Config(precision=precision, loss_scale=loss_scale, half_math=half_math), device)
    model = copy.deepcopy(patient.model).to(device)
    opt = patient.optimizer(model)
    wide_handles = keep_modules_wide(model, keep_wide, wide, device, precision)
    model = recipe.prepare(model, [opt])
    outputs: dict = {}  # the model's output at the last step's forward

    def grab(m, a, out):
        outputs["last"] = torch.cat([t.detach().double().reshape(-1).cpu() for t in tensors_in(out)
                                     if t.is_floating_point()] or [torch.zeros(0)])
    out_hook = model.register_forward_hook(grab) if observe else None
    num = NumericsObserver(Numerics(model, every=1 if numerics else 0))
    forward = ValueRanges()
    weights = ValueRanges()
    if numerics:
        for pname, p in model.named_parameters():
            weights.add(pname.rpartition(".")[0] or "root", p)
    activation_meter = ActivationMeter(model) if meter else None
    first_inf = None  # with `watch`: each step traced until it is found
    loss_fn = patient.loss_fn()
    # The engine's iteration (mpt.step.TrainStep), numerics sampled as a run samples them: the true
    # gradients of every step, then the update's fate (3.1).
    train_step = TrainStep(lambda m, b: _mean_loss(loss_fn, m, b, patient.name), model, {"main": opt},
                           recipe, device=device, observers=(num,), measure_first=False)
    torch.manual_seed(patient.seed)  # the same steps: dropout masks and sampled negatives too
    losses, samples, skipped = [], [], 0
    slots = Slots()  # (where each step's trace writes its min and max values, reused step after step)
    for i in range(steps):
        trace = Trace(model, inputs=True, slots=slots) if watch and first_inf is None else None
        with forward.recording(model) if observe else contextlib.nullcontext(), trace or contextlib.nullcontext():
            logs, _ = train_step([patient.batches[i % len(patient.batches)]],
                                 meter=activation_meter if i == 0 else None)
        if trace is not None:
            first_inf = first_overflow(trace, i)
        losses.append(float(logs["loss"]))
        skipped += not train_step.applied["main"]
        if numerics:
            samples.append(num.stats)
    for h in [*wide_handles, *([out_hook] if out_hook is not None else [])]:
        h.remove()
    return {"precision": precision, "loss_scale": loss_scale, "final_loss_scale": recipe.loss_scale,
            "keep_wide": list(keep_wide), "last_output": outputs.get("last"),
            "half_math": recipe.half_math, "losses": losses, "skipped": skipped,
            "nonfinite_losses": sum(not math.isfinite(v) for v in losses), "forward": forward.summary(),
            "weights": weights.summary(), "numerics": samples,
            "memory": activation_meter.breakdown() if meter else None,
            "first_inf": first_inf,
            "types": {name or "root": type(m).__name__ for name, m in model.named_modules()}}

