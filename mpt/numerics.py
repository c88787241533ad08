"""FP16 numerics sampled during training: the measurements behind the paper's Figures 2b and 3 (section 3),
taken on a run's own steps, and their fidelity against FP32.

- `Numerics` / `NumericsObserver`: every N steps (numerics.every) the exponent histograms and FP16 bands of
  the activation and weight gradients per layer, the advised loss scale and section 3.1's swamping (the pure
  measurements are mpt.bands'), as one flat dict (JSON-safe: ints, floats, lists, None, and a string under
  "numerics/error" only if something failed) for metrics.jsonl and wandb.
- `fidelity` / `FidelityObserver` (beyond the paper, numerics.sqnr_every): the SQNR of a precision's
  output and per-parameter gradients against FP32 on the same weights and batch, measured beside
  training without moving it.

Measurements are taken on FP64 copies, on the device where the tensor lives; one host sync per result, none
inside the backward pass.
"""
from __future__ import annotations

import contextlib
import math
import random
import statistics
import threading
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from mpt.bands import HIST_HI, HIST_LO, Tally, advise_loss_scale, hook_targets, swamping_fraction, tensors_in
from mpt.errors import UserError
from mpt.ranks import rng_state, set_rng_state
from mpt.step import Observer


def _layer_of(param_name: str) -> str:
    """Module name owning a parameter: "features.0.weight" -> "features.0"; root -> "root"."""
    return param_name.rpartition(".")[0] or "root"


class Numerics:
    """Samples the FP16 numerics of training every `every` steps (paper section 3, Figures 2b, 3).

    NumericsObserver drives it in a run: begin(step) before the forward pass, end(...) after the backward and
    swamping(...) around the update.

    `end` must run after backward and before the gradients are unscaled, clipped or stepped on
    (and before a dynamic scaler changes S): it reads `.grad` as the loss-scaled values and
    divides by `loss_scale` to get the true gradients.

    `every=0` turns sampling off and costs nothing: `should_sample` is always False, `begin`
    registers no hooks, `end` returns {}. The engine never crashes because of this class: any
    failure inside it becomes a warning and a "numerics/error" string in the returned dict.

    Activation gradients (the gradients of module outputs, Figure 3) are captured with forward
    hooks that put a tensor hook on each output, not with `register_full_backward_hook`: a full
    backward hook wraps the module's output in a view, and any later in-place op on it -- the
    ReLU(inplace=True) after every convolution in AlexNet/VGG, ResNet's `out += identity` --
    raises in the forward pass, in model code no try/except here can guard. A tensor hook
    registered before an in-place op still receives the gradient of the value before that op.
    Hooked modules: leaf modules (no children) and modules owning parameters directly; not
    nn.Identity, and an output that is the unchanged input of a non-in-place module is skipped
    (it would be counted twice). Each module output is a distinct activation, so a ReLU's output
    gradient and its convolution's are both counted in the overall histogram; a module called
    several times (shared weights, RNN steps) accumulates all its calls.
    """

    def __init__(self, model: nn.Module, every: int = 0, lo: int = HIST_LO, hi: int = HIST_HI, margin: float = 2.0):
        if int(every) != every or every < 0:
            raise UserError(f"numerics.every={every}: use a whole number of steps >= 0 (0 turns numerics off)")
        if int(lo) != lo or int(hi) != hi or lo > hi:
            raise UserError(f"numerics histogram range lo={lo}, hi={hi}: use integers with lo <= hi")
        self.model = model
        self.every = int(every)
        self.lo, self.hi = int(lo), int(hi)
        self.margin = float(margin)
        self._handles: list[Any] = []
        self._act: dict[str, Tally] = {}
        self._fwd: dict[str, Tally] = {}  # the module outputs themselves (FP8's E4M3 range)
        self._active = False
        self._generation = 0  # tensor hooks from an earlier sample find a newer generation and do nothing
        self._divisor = 1.0
        self._step: int | None = None
        self._errors: list[str] = []
        self._lock = threading.Lock()  # autograd may run hooks of different devices on different threads

    # -- sampling control ---------------------------------------------------------------------

    def should_sample(self, step: int) -> bool:
        """True on the steps to measure: every `every`-th step, starting at step 0."""
        return self.every > 0 and step % self.every == 0

    def begin(self, step: int, loss_scale: float | None = None) -> None:
        """Start sampling `step`: hook the modules so that the coming backward pass records the
        activation gradients. Give `loss_scale` (the S this backward uses) if known now; else the
        activation histograms are shifted by log2 S in `end`, exact when S is a power of two (as
        for the paper's constants and torch's dynamic scaler) and within one bin otherwise."""
        if self.every <= 0:
            return
        self._remove_hooks()
        self._act = {}
        self._fwd = {}
        self._errors = []
        self._generation += 1
        self._step = step
        self._divisor = self._scale_or_one(loss_scale) if loss_scale is not None else 1.0
        self._active = True
        try:
            for name, module in hook_targets(self.model):
                self._handles.append(module.register_forward_hook(self._forward_hook(name, module)))
        except Exception as e:  # noqa: BLE001 -- instrumentation must never stop training
            self._note_error("begin", e)
            self._remove_hooks()

    def end(self, named_params: Iterable[tuple[str, nn.Parameter]], loss_scale: float | None) -> dict:
        """Stop sampling; return the flat dict of this step's numerics.

        `named_params`: (name, parameter) pairs such as model.named_parameters(); each `.grad` is
        read as the loss-scaled gradient and divided by `loss_scale` (None means 1) to give the
        true weight gradient. Histograms are of true gradients (|g| / S); bands are of the stored
        values, i.e. the true gradients at scale S -- what FP16 holds at the current loss scale.
        Keys (G is "act" or "weight", L "overall" or a module name from model.named_modules(),
        "root" for the model itself):

            numerics/hist_lo, numerics/hist_hi   exponent of the first / last histogram bin
            numerics/loss_scale                  S
            numerics/G/L/hist                    list of counts, bins hist_lo..hist_hi (end bins
                                                 also hold everything beyond), non-zero finite only
            numerics/G/L/count                   number of values
            numerics/G/L/frac_{zero,underflow,subnormal,normal,overflow}   fractions of count
            numerics/G/L/nonfinite               number of inf/nan values (part of overflow)
            numerics/G/L/max_abs                 largest finite true |gradient|
            numerics/max_abs_act_grad, numerics/max_abs_weight_grad      = G/overall/max_abs
            numerics/advised_loss_scale_act, numerics/advised_loss_scale_weight   the advisor's
                                                 S for each (None if that group holds inf/nan)
            numerics/advised_loss_scale          the smaller of the two (None if either is None)
            numerics/fwd/L/...                   the same keys for the module outputs themselves
                                                 (forward values, no loss scale; beyond the paper:
                                                 FP8's E4M3 range), numerics/max_abs_fwd
            numerics/error                       only if something failed: what

        The act and fwd keys are absent if `begin` was not called for this step. Returns {} when off.
        """
        if self.every <= 0:
            return {}
        try:
            return self._end(named_params, loss_scale)
        except Exception as e:  # noqa: BLE001 -- instrumentation must never stop training
            self._note_error("end", e)
            return {"numerics/error": "; ".join(self._errors)}
        finally:
            self._remove_hooks()
            self._active = False
            self._act = {}
            self._fwd = {}

    def swamping(self, before: Sequence[torch.Tensor], after: Sequence[torch.Tensor],
                 received: Sequence[torch.Tensor] | None = None) -> dict:
        """`swamping_fraction` with keys prefixed "numerics/swamp/" (e.g. numerics/swamp/frac_swamped).
        `before`: the weights snapshotted before the optimizer step; `after`: what the optimizer
        computed for them; `received`: the weights after the step, if they are not `after` itself
        (fp16_pure: the FP16 weights, which may not have received the update). Tensors that are the
        very objects of `after` are ignored as `received` (FP32 masters receive every update: the
        loss is then what an FP16 weight would lose). On failure: {"numerics/swamp/error": ...}."""
        if self.every <= 0:
            return {}
        try:
            if received is not None and all(r is a for r, a in zip(received, after)):
                received = None
            return {f"numerics/swamp/{k}": v for k, v in swamping_fraction(before, after, received).items()}
        except Exception as e:  # noqa: BLE001 -- instrumentation must never stop training
            warnings.warn(f"numerics: swamping measure failed ({type(e).__name__}: {e})", stacklevel=2)
            return {"numerics/swamp/error": f"{type(e).__name__}: {e}"}

    # -- internals ------------------------------------------------------------------------------

    @staticmethod
    def _scale_or_one(loss_scale: Any) -> float:
        s = 1.0 if loss_scale is None else float(loss_scale)
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"loss_scale={s}: need a finite positive number")
        return s

    def _note_error(self, where: str, e: BaseException) -> None:
        msg = f"{where}: {type(e).__name__}: {e}"
        if not self._errors:  # warn once per sample, not once per layer
            warnings.warn(f"numerics: {msg} (training continues without these numbers)", stacklevel=3)
        if len(self._errors) < 5:
            self._errors.append(msg)

    def _remove_hooks(self) -> None:
        for h in self._handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._handles = []

    def _forward_hook(self, name: str, module: nn.Module):
        generation = self._generation
        inplace = bool(getattr(module, "inplace", False))

        def hook(mod, inputs, output):
            if not torch.is_grad_enabled() or generation != self._generation:
                return None
            try:
                ins = None
                for t in tensors_in(output):
                    if not (t.requires_grad and t.is_floating_point()):
                        continue
                    if not inplace:
                        ins = list(tensors_in(inputs)) if ins is None else ins
                        if any(t is x for x in ins):
                            continue  # passed through unchanged: the producer already records it
                    t.register_hook(self._grad_hook(name, generation))
                    with torch.no_grad(), self._lock:  # the activation itself (forward values)
                        group = self._fwd.get(name)
                        if group is None:
                            group = self._fwd[name] = Tally(t.device)
                        group.add(t.detach(), 1.0)
            except Exception as e:  # noqa: BLE001
                self._note_error(f"forward hook {name}", e)
            return None

        return hook

    def _grad_hook(self, name: str, generation: int):
        def hook(grad):
            if generation != self._generation or not self._active:
                return None
            try:
                with torch.no_grad(), self._lock:
                    group = self._act.get(name)
                    if group is None:
                        group = self._act[name] = Tally(grad.device)
                    group.add(grad, self._divisor)
            except Exception as e:  # noqa: BLE001
                self._note_error(f"gradient hook {name}", e)
            return None  # never changes the gradient

        return hook

    def _end(self, named_params, loss_scale) -> dict:
        scale = self._scale_or_one(loss_scale)
        out: dict[str, Any] = {
            "numerics/hist_lo": self.lo,
            "numerics/hist_hi": self.hi,
            "numerics/loss_scale": scale,
        }
        # Weight gradients: per owning module, true values = stored / S (exact: FP64).
        weight: dict[str, Tally] = {}
        with torch.no_grad():
            for pname, p in named_params:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    g = g.coalesce().values()
                layer = _layer_of(pname)
                group = weight.get(layer)
                if group is None:
                    group = weight[layer] = Tally(g.device)
                group.add(g, scale)

        advised: dict[str, float | None] = {}
        groups = [("weight", weight, 1.0)]
        if self._active:
            # Hooks divided by begin's loss scale (or 1); the remaining factor is a shift.
            groups.insert(0, ("act", dict(self._act), scale / self._divisor))
        for kind, layers, residual in groups:
            shift = round(math.log2(residual))
            overall = self._emit(out, kind, layers, shift, residual)
            out[f"numerics/max_abs_{kind}_grad"] = overall
            has_nonfinite = out[f"numerics/{kind}/overall/nonfinite"] > 0
            advised[kind] = None if has_nonfinite else advise_loss_scale(overall, self.margin)
            out[f"numerics/advised_loss_scale_{kind}"] = advised[kind]
        values = list(advised.values())
        out["numerics/advised_loss_scale"] = None if None in values else min(values)
        if self._active and self._fwd:
            # Forward values: where activations lie against E4M3's range; no loss scale.
            out["numerics/max_abs_fwd"] = self._emit(out, "fwd", dict(self._fwd), 0, 1.0)
        if self._errors:
            out["numerics/error"] = "; ".join(self._errors)
        return out

    def _emit(self, out: dict, kind: str, layers: dict[str, Tally], shift: int, residual: float) -> float:
        """Write the keys of one group (act, weight or fwd); returns its overall max |gradient|."""
        rows = {name: g.summary(self.lo, self.hi, shift, residual) for name, g in layers.items()}
        overall = Tally.combined(layers.values()).summary(self.lo, self.hi, shift, residual)
        for name, row in {"overall": overall, **rows}.items():
            out.update({f"numerics/{kind}/{name}/{k}": v for k, v in row.items()})
        return overall["max_abs"]


class NumericsObserver(Observer):
    """Numerics sampling as an observer of the training step (mpt.step.Observer's hooks): on a sampled
    iteration, for each optimizer update, the true gradients its backward produced (taken before
    unscaling, divided by that backward's S) and, around the update, what the optimizer intended
    against what the weights received (3.1); whether the update was skipped and, if so, the first
    parameter holding a non-finite gradient. With several optimizers (a GAN's phases) each update's
    keys are named numerics/<optimizer>/... and hooks restart for the next phase's backward.
    `stats` holds the current iteration's sample ({} when it is not sampled)."""

    def __init__(self, numerics: Numerics):
        self.numerics = numerics
        self.stats: dict = {}
        self._sample = False
        self._pending: dict = {}
        self._before: list = []

    def begin(self, step, micro_batches) -> None:
        self.stats = {}
        self._sample = self.numerics.should_sample(step.iteration)
        if self._sample:
            self.numerics.begin(step.iteration)

    def before_update(self, step, name: str, opt) -> None:
        if not self._sample:
            return
        model = step.model
        # The gradients of the model this optimizer trains (a GAN: its entry of the ModuleDict).
        named = list(model.named_parameters()) if len(step.optimizers) == 1 or not isinstance(model, nn.ModuleDict) \
            or name not in model else list(model[name].named_parameters(prefix=name))
        self._pending = self.numerics.end(named, step.recipe.loss_scale)
        # The trained weights (FP32 masters; fp16_pure's FP16 weights) before the update (3.1).
        self._before = [w.detach().clone() for w in step.recipe.weights_of(opt)]

    def after_update(self, step, name: str, opt, applied: bool) -> None:
        if not self._sample:
            return
        stats, self._pending = self._pending, {}
        # The update the optimizer intended (params_of) against what the weights received.
        stats.update(self.numerics.swamping(self._before, step.recipe.params_of(opt), step.recipe.weights_of(opt)))
        self._before = []
        stats["numerics/skipped"] = not applied
        if not applied:
            stats["numerics/overflow_param"] = step.recipe.last_overflow
        if len(step.optimizers) == 1:
            self.stats.update(stats)
        else:
            self.stats.update({k.replace("numerics/", f"numerics/{name}/", 1): v for k, v in stats.items()})
            self.numerics.begin(step.iteration)  # the next phase's backward

    def end(self, step) -> None:
        if self._sample and len(step.optimizers) > 1:
            self.numerics.end([], None)  # drop the hooks of a phase that never stepped


# -- Fidelity against FP32: how far a precision moves a model's output and gradients ---------------------------

# The line torchao draws: its MX linear-layer tests hold an E4M3 layer's output to >= 20 dB SQNR against
# high precision (FP4 elements: >= 11 dB). The summary counts the parameter gradients below it.
SQNR_LINE_DB = 20.0


def sqnr_db(ref: torch.Tensor | None, test: torch.Tensor | None) -> float:
    """Signal to quantisation-noise ratio of `test` against `ref` in dB, 10 log10(|ref|^2 / |ref - test|^2)
    summed in FP64: inf where they are identical, -inf where `test` is missing, of another shape or not
    finite (an overflow is infinite noise)."""
    if ref is None or test is None or ref.shape != test.shape or not bool(torch.isfinite(test).all()):
        return -math.inf
    noise = (ref.double() - test.double()).pow(2).sum()
    return math.inf if noise == 0 else float(10 * torch.log10(ref.double().pow(2).sum() / noise))


@contextlib.contextmanager
def _outputs_recorded(model: nn.Module, into: dict[str, list[torch.Tensor]]):
    """Every floating tensor each top-level model returns (each entry of an nn.ModuleDict is a model),
    flattened in call order into into[name] ("" for a single model)."""
    tops = list(model.items()) if isinstance(model, nn.ModuleDict) else [("", model)]
    handles = []

    def hook(name):
        def record(mod, args, out):
            into.setdefault(name, []).extend(t.detach().float().reshape(-1) for t in tensors_in(out)
                                             if t.is_floating_point())
        return record

    try:
        for name, top in tops:
            handles.append(top.register_forward_hook(hook(name)))
        yield
    finally:
        for h in handles:
            h.remove()


def fidelity(model: nn.Module, run, context, loss_scale: float = 1.0, params: dict | None = None,
             keep=contextlib.nullcontext) -> dict[str, float]:
    """How far a precision moves a model: `run(model)` once in FP32 and once inside `context` (a recipe's
    autocast()), on the same weights, batch and random draws; the SQNR in dB of what the model returns
    ("output"; "output/<name>" for each model of an nn.ModuleDict) and of each parameter's gradient
    ("grad/<parameter name>").

    `run(model)` returns a tensor whose sum is back-propagated (a loss, or an output), or {group: such a
    tensor}, each group's gradient taken for params[group] ((name, parameter) pairs: a GAN's
    discriminator loss for the discriminator's parameters); a single tensor's for every parameter.
    `loss_scale`: the low-precision pass back-propagates the loss x S and divides the gradients by S, as
    training does (section 3.2); the FP32 pass runs at S = 1.

    It leaves no trace on training: gradients are returned by torch.autograd.grad (no .grad is
    written), buffers (batch-norm statistics) and the torch and Python random streams are put back after
    each pass (each pass starts from the same streams: the same dropout masks); `keep()` is a context
    around each pass that puts back whatever else a pass changes (a recipe's recorded amaxes and
    stochastic-rounding generators, Recipe.untouched; a task's recurrent state), so that both passes
    start from the state training is in."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    bufs = [b.detach().clone() for b in model.buffers()]
    rng, py_rng = rng_state(device), random.getstate()

    def put_back():  # the random streams and buffers training left: before each pass, and at the end
        set_rng_state(rng, device)
        random.setstate(py_rng)
        with torch.no_grad():
            for b, v in zip(model.buffers(), bufs):
                b.copy_(v)

    outs: list[dict] = []
    grads: list[dict] = []
    try:
        for ctx, scale in ((contextlib.nullcontext(), 1.0), (context, float(loss_scale))):
            put_back()
            recorded: dict[str, list[torch.Tensor]] = {}
            got: dict[str, torch.Tensor] = {}
            with keep(), _outputs_recorded(model, recorded):
                with ctx:
                    out = run(model)
                losses = out if isinstance(out, dict) else {None: out}
                groups = params if isinstance(out, dict) else {None: list(model.named_parameters())}
                todo = [(k, loss) for k, loss in losses.items() if loss.requires_grad]
                for i, (k, loss) in enumerate(todo):
                    named = [(n, p) for n, p in groups[k] if p.requires_grad]
                    gs = torch.autograd.grad(loss.float().sum() * scale, [p for _, p in named],
                                             retain_graph=i < len(todo) - 1, allow_unused=True)
                    got.update({n: g.float() / scale for (n, _), g in zip(named, gs) if g is not None})
                del out, losses, todo
            outs.append({k: torch.cat(v) if v else torch.zeros(0) for k, v in recorded.items()})
            grads.append(got)
    finally:
        put_back()
    res = {}
    for k, ref in outs[0].items():
        res[f"output/{k}" if k else "output"] = sqnr_db(ref, outs[1].get(k))
    res.update({f"grad/{n}": sqnr_db(g, grads[1][n]) for n, g in grads[0].items() if n in grads[1]})
    return res


def sqnr_summary(res: dict[str, float]) -> dict[str, float | int]:
    """min and median of the parameter-gradient SQNRs of fidelity()'s result (NaNs left out), how many
    there are and how many lie below torchao's 20 dB."""
    vals = [v for k, v in res.items() if k.startswith("grad/") and not math.isnan(v)]
    return {"grad_min": min(vals, default=math.nan), "grad_median": statistics.median(vals) if vals else math.nan,
            "grad_count": len(vals), "grad_below_20db": sum(v < SQNR_LINE_DB for v in vals)}


class FidelityObserver(Observer):
    """numerics.sqnr_every=N as an observer of the training step (mpt.step.Observer's hooks): every N
    iterations, before the first forward, fidelity() on the iteration's first micro-batch -- the task's
    measured_loss in FP32 and in the run's precision on the weights about to be trained -- logged as
    numerics/sqnr/output (numerics/sqnr/output/<model> for each model of a GAN), numerics/sqnr/grad/<name>
    per parameter, and the summary over parameters (sqnr_summary: numerics/sqnr/grad_min, grad_median,
    grad_count, grad_below_20db). The measurement leaves the training as it was, bit for bit
    (fidelity's guarantees, the recipe's untouched() and the task's own state put back). It runs before
    numerics sampling's hooks are on, so numerics.every's histograms do not count its passes; any
    failure becomes numerics/sqnr/error, never a stopped run. `stats` holds the current iteration's
    sample ({} when it is not sampled)."""

    def __init__(self, task, every: int):
        self.task, self.every = task, int(every)
        self.stats: dict = {}

    def begin(self, step, micro_batches) -> None:
        self.stats = {}
        if not (self.every > 0 and step.iteration % self.every == 0 and micro_batches):
            return
        model, recipe, batch = step.model, step.recipe, micro_batches[0]
        ids = {name: {id(p) for g in opt.param_groups for p in g["params"]} for name, opt in step.optimizers.items()}
        params = {name: [(n, p) for n, p in model.named_parameters() if id(p) in own] for name, own in ids.items()}
        try:
            res = fidelity(model, lambda m: self.task.measured_loss(m, batch), recipe.autocast(),
                           loss_scale=recipe.loss_scale, params=params, keep=lambda: self._kept(recipe))
        except Exception as e:  # noqa: BLE001 -- instrumentation must never stop training
            warnings.warn(f"numerics: SQNR measurement failed ({type(e).__name__}: {e})", stacklevel=2)
            self.stats = {"numerics/sqnr/error": f"{type(e).__name__}: {e}"}
            return
        res.update(sqnr_summary(res))
        self.stats = {f"numerics/sqnr/{k}": v for k, v in res.items()}

    @contextlib.contextmanager
    def _kept(self, recipe):
        """The recipe's and the task's state as they were before the measurement (the task's is its
        checkpoint state, which resumes a run bit-identically: the bigLSTM's recurrent state)."""
        import copy

        task_state = copy.deepcopy(self.task.state_dict())
        try:
            with recipe.untouched():
                yield
        finally:
            if task_state is not None:
                self.task.load_state_dict(task_state)
