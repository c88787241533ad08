"""Watch a real training loop: a few lines in the user's own loop, where the replays of `python -m mpt.doctor`
cannot go (their own data pipeline, schedule, checkpointing)::

    with mpt.doctor.watch(model, every=10, optimizer=opt, scaler=scaler, scheduler=sched) as w:
        for i, batch in enumerate(loader):
            with torch.autocast("cuda", torch.float16):
                loss = loss_fn(model, batch)
            scaler.scale(loss).backward()
            scaler.step(opt); scaler.update(); sched.step(); opt.zero_grad()
            w.step(loss)                      # after the optimizer step: ends this step
            if i % 1000 == 0:
                ckpt = {...}; w.check_checkpoint(ckpt); torch.save(ckpt, path)
    print("\\n".join(w.report()))

Every `every`-th step is sampled at module granularity: hooks take the min and max of each module's inputs and
outputs as the forward pass makes them, and of the gradients of its outputs, inputs and weights as the backward
pass makes them, on the device, in execution order; at w.step() the sample is stacked and read in one host
transfer. Every `trace_every`-th step (from step 0), and on the steps after a non-finite value, every operation
of forward and backward is recorded instead, seen by a dispatch mode (about twice a step's time, paid only then).
The steps between cost a finiteness flag on the loss, kept on the device and read with the next sample.
From the samples:
  - the run-up of each module's largest |value| (forward; gradients as the loop holds them, x S);
  - the first non-finite value: the first record in execution order that holds inf/nan -- everything recorded
    before it was finite, so its module made it (an output, a module's own gradients) or the code between
    modules did (an input; the gradient arriving at an output: the parent's own code, the loss) -- not a module
    that passed it on. The operation that made it is then traced on the next steps; a trace also names a value
    that overflows inside a module whose output stays finite (a sum of squares in a norm), which no
    module-level record shows. Weights already non-finite cannot be traced (a GradScaler keeps them finite by
    skipping the update);
  - a non-finite loss or a skipped update between samples makes the next steps traced until it is seen;
  - setup mistakes (one line each, said once): FP16 compute without loss scaling (no GradScaler, a disabled
    one, or its scale at 1), the scheduler stepped on a step the scaler skipped, a checkpoint without the
    scaler's state (check_checkpoint).
    A scale that fell from above 1 to 1 or below is no setup mistake but gradients overflowing at every scale
    the GradScaler tried: "k of n steps skipped; S fell from 2^16 to 2^-4".
Module attribution of traced operations in backward follows torch.utils.module_tracker: a module's backward
begins when the gradients of its outputs are ready and ends when those of its inputs (and weights) are.
"""
from __future__ import annotations

import collections
import functools
import math
import sys
from typing import Callable

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook

from mpt.errors import UserError
from mpt.numerics import hook_targets, tensors_in
from mpt.torch_private import TorchDispatchMode, in_backward, scaler_scale_tensor, tree_flatten

OUTSIDE = "(outside the model)"  # the loss and whatever else the step computes from the model's outputs
RUN_UP = 8  # samples of each module's largest |value| kept
SETUP = ("fp16_unscaled", "schedule", "checkpoint", "order")  # findings that are mistakes in the loop's setup
_LOW = (torch.float16,)  # FP16 compute: the format whose gradients need a loss scale (BF16 does not)


_MAKES_VALUES: dict = {}


def _makes_values(func) -> bool:
    """Does the operation compute new values? Not a view or detach (the values of its input), nor an
    allocation (empty memory: whatever bits it holds, possibly nan)."""
    got = _MAKES_VALUES.get(func)
    if got is None:
        name = func.overloadpacket.__name__
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        got = _MAKES_VALUES[func] = not (view or "empty" in name or name in ("detach", "lift_fresh", "alias"))
    return got


class _Ops(TorchDispatchMode):
    """One sampled step: for each operation of a training forward (grad mode on) or of the backward, the
    module running it and the largest |value| of its floating results, kept on the device."""

    def __init__(self, current: Callable[[], str]):
        super().__init__()
        self.current = current
        self.names: list[tuple[str, str, str]] = []  # (module, "forward" | "backward", op)
        self.values: list[torch.Tensor] = []  # min and max of each result, in turn (0-dim, on the device)
        self.fp16 = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        backward = in_backward()
        if not (backward or torch.is_grad_enabled()) or not _makes_values(func):
            return out  # the optimizer, evaluation: not the step's forward or backward; views, allocations
        module = self.current()
        if module == OUTSIDE and not backward and not any(a.requires_grad for a in _flat((args, kwargs))):
            return out  # outside the model, the loss's graph only (not a GradScaler's own bookkeeping)
        for t in _flat(out):
            if t.is_floating_point() and t.numel():
                self.fp16 |= t.dtype in _LOW
                # min and max in one pass (inf/nan propagate into them); |value| is taken on the host. On a
                # CPU this is ~20x faster than linalg.vector_norm(t, inf).
                self.names.append((module, "backward" if backward else "forward", str(func.overloadpacket)))
                self.values += torch.aminmax(t.detach())
        return out


def _flat(obj):
    """The tensors in an operation's arguments or results (tensors, lists/tuples of them, kwargs)."""
    return tensors_in(obj, max_depth=3)


class _Modules:
    """One sampled step at module granularity: the min and max of each module's inputs and outputs (forward)
    and of the gradients of its outputs, inputs and weights (backward), on the device, in execution order.
    `plan`: (module, its label, leaf?, in place?, its own trainable weights) for each hooked module."""

    def __init__(self, plan: list):
        self.names: list[tuple[str, str, str]] = []  # (module, "forward" | "backward", what)
        self.values: list[torch.Tensor] = []  # min and max of each record, in turn (0-dim, on the device)
        self.grads: list[int | None] = []  # per backward record, its gradient's group (one tensor, several records)
        self.fp16 = False
        self._seen: dict = {}  # (id, version) -> tensor: a value already recorded in this forward pass
        self._last: tuple | None = None  # (gradient, its min and max, its group): one gradient, several records
        self._handles = []
        self._open = True
        for m, label, leaf, inplace, weights in plan:
            if not leaf:  # its inputs recorded before its children's records
                self._handles.append(m.register_forward_pre_hook(functools.partial(self._pre, label)))
            self._handles.append(m.register_forward_hook(functools.partial(self._post, label, leaf, inplace)))
            for p in weights:
                self._handles.append(p.register_hook(functools.partial(self._bwd, label, "weight gradient")))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._seen, self._last, self._open = [], {}, None, False

    def _fwd(self, label: str, what: str, t: torch.Tensor, always: bool = False) -> None:
        """Record a forward value's min and max, each value once (a module's input is its producer's output)."""
        if not (t.is_floating_point() and t.numel()):
            return
        key = (id(t), t._version)  # the version: an in-place change is a new value
        if key in self._seen and not always:
            return
        self._seen[key] = t  # held for the pass (most are saved for backward anyway): ids stay unique
        self.fp16 |= t.dtype in _LOW
        self.names.append((label, "forward", what))
        self.grads.append(None)
        self.values += torch.aminmax(t.detach())

    def _bwd(self, label: str, what: str, g: torch.Tensor) -> None:
        """Record a gradient's min and max; the hooks of one tensor fire together: measured once, one group."""
        if not self._open or not g.is_floating_point() or not g.numel():
            return  # (a hook on an activation kept past its step: no handle is kept to remove it)
        self.names.append((label, "backward", what))
        last = self._last
        if last is not None and last[0] is g:
            self.grads.append(last[2])
            self.values += last[1]
            return
        mm = torch.aminmax(g.detach())
        self.values += mm
        self.grads.append(len(self.names))
        self._last = (g, mm, len(self.names))  # held, so that no other tensor takes its id meanwhile

    def _pre(self, label: str, mod, args) -> None:
        if torch.is_grad_enabled():
            for t in _flat(args):
                self._fwd(label, "input", t)

    def _post(self, label: str, leaf: bool, inplace: bool, mod, args, out) -> None:
        if not torch.is_grad_enabled():
            return
        ins = [] if inplace else list(_flat(args))
        if leaf:
            for t in ins:  # a leaf: its inputs are as they came in
                self._fwd(label, "input", t)
        # Hooks on activations go with them (no handle kept: removing ~1000 handles cost more than the hooks).
        for t in _flat(out):
            self._fwd(label, "output", t, always=inplace)
            if t.requires_grad:
                t.register_hook(functools.partial(self._bwd, label, "output gradient"))
        for t in ins:  # (an in-place module's input is its output)
            if t.requires_grad and not t.is_leaf:
                t.register_hook(functools.partial(self._bwd, label, "input gradient"))


class Watch:
    """The watch on a user's loop (module docstring). `log` gets each finding's line once (default: stderr)."""

    def __init__(self, model: nn.Module, every: int = 10, optimizer: torch.optim.Optimizer | None = None,
                 scaler=None, scheduler=None, log: Callable[[str], None] | None = None, trace_every: int | None = None):
        if not isinstance(model, nn.Module):
            raise UserError(f"watch(model=...): got a {type(model).__name__}; give the torch.nn.Module you train")
        if int(every) != every or every < 1:
            raise UserError(f"watch(every={every}): sample every k >= 1 steps (10 costs a few % of step time)")
        if trace_every is not None and (int(trace_every) != trace_every or trace_every < 1):
            raise UserError(f"watch(trace_every={trace_every}): trace every k >= 1 steps (default 10 x every)")
        if scaler is not None and not hasattr(scaler, "is_enabled"):
            raise UserError(f"watch(scaler=...): got a {type(scaler).__name__}; give the torch.amp.GradScaler")
        self.model, self.every = model, int(every)
        # Every operation traced (about twice a step's time) this often, from step 0: what overflows inside a
        # module whose output stays finite shows only there.
        self.trace_every = int(trace_every or 10 * self.every)
        self.optimizer, self.scaler, self.scheduler = optimizer, scaler, scheduler
        self.log = log or (lambda line: print(f"mpt.doctor.watch: {line}", file=sys.stderr))
        self.step_count = 0  # steps ended by step()
        self.first: dict | None = None  # the first non-finite value: step, module, phase, op
        self.findings: dict[str, str] = {}  # kind -> its line (each kind once)
        self.run_up: dict[str, collections.deque] = {}  # module -> (step, fwd max, bwd max) of recent samples
        # The run-up as it stood at the first non-finite value: the samples after it (chased, traced, all
        # nan once the weights are) would push the ones that lead to it out of `run_up`.
        self.run_up_to_first: dict[str, list] = {}
        self.samples = 0  # sampled steps, traced ones included
        self.traced = 0
        self._names = {m: f"{n or 'root'} ({type(m).__name__})" for n, m in model.named_modules()}
        self._depth = {m: (n.count(".") + 1 if n else 0) for n, m in model.named_modules()}
        self._rec: _Ops | _Modules | None = None  # this step's sample, when it is one
        # Leaf modules and those owning weights (mpt.numerics.hook_targets): a container's input and output
        # are its first and last child's.
        self._plan = [(m, self._names[m], next(m.children(), None) is None, bool(getattr(m, "inplace", False)),
                       [p for p in m.parameters(recurse=False) if p.requires_grad]) for _, m in hook_targets(model)]
        self._params = [(self._names[_owner(model, n)], p) for n, p in model.named_parameters() if p.numel()]
        self._parent = {self._names[m]: self._names[model.get_submodule(n.rpartition(".")[0])]
                        for n, m in model.named_modules() if n}
        self._handles: list = []
        self._active: list[nn.Module] = []  # modules whose forward or backward is running, in entry order
        self._reset_queued = False
        self._bad: torch.Tensor | None = None  # a non-finite loss since the last sample (device)
        self._chase = 0  # steps left to sample one after another, chasing a non-finite value seen between samples
        self._chase_from = 0  # the first step that could have made it
        self._opt_steps = 0
        self._opt_steps_before = 0
        self._sched_before = None
        self._handles_opt = None
        self.skipped = 0  # updates the GradScaler skipped (counted where the optimizer is given)
        self._scale0: float | None = None  # the GradScaler's scale as the loop began

    # -- the user's calls ----------------------------------------------------------------------------------
    def __enter__(self) -> "Watch":
        if self.optimizer is not None:
            self._handles_opt = self.optimizer.register_step_post_hook(self._count_step)
        self._opt_steps_before = self._opt_steps
        self._sched_before = self._sched_epoch()
        if self.scaler is not None and self.scaler.is_enabled():
            self._scale0 = float(self.scaler.get_scale())  # (one host read, once)
        self._begin()
        return self

    def __exit__(self, *exc) -> None:
        self._stop()
        self._rec = None
        if self._handles_opt is not None:
            self._handles_opt.remove()
            self._handles_opt = None

    def step(self, loss: torch.Tensor | None = None) -> None:
        """End the step (call it last in the iteration, after the optimizer's and the scheduler's step): read
        the sample if this step was one, check the setup, and start the next step's sample when it is due.
        `loss`: the step's loss, watched for inf/nan between samples (on the device: no host read)."""
        if loss is not None and isinstance(loss, torch.Tensor):
            flag = ~torch.isfinite(loss.detach()).all()
            self._bad = flag if self._bad is None else self._bad | flag
        stepped = self._opt_steps != self._opt_steps_before
        self.skipped += self.optimizer is not None and self.scaler is not None and self.scaler.is_enabled() \
            and not stepped
        self._check_schedule(stepped)
        if self._rec is not None:
            self._read()
        elif self.optimizer is not None and self.scaler is not None and not stepped and self.first is None \
                and self._opt_steps > 0:
            self._start_chase(self.step_count)  # the scaler skipped an update between samples: find what overflowed
        if self.optimizer is not None and self.step_count == 0 and not stepped and \
                (self.scaler is None or not self.scaler.is_enabled()):  # (a scaler may skip step 0: not told apart)
            self._find("order", "the optimizer given to watch() did not step before w.step() in the first step: "
                                "call w.step() last in the iteration, and give watch() the optimizer the loop steps")
        self._opt_steps_before = self._opt_steps
        self.step_count += 1
        self._begin()

    def check_checkpoint(self, checkpoint: dict) -> bool:
        """Does the dict the loop saves hold the GradScaler's state? Without it a resumed run restarts S at
        init_scale and skips steps while it backs off again (dynamic) or loses the scale it found. Returns
        True when it is there (or there is no enabled scaler)."""
        if not isinstance(checkpoint, dict):
            raise UserError(f"check_checkpoint: got a {type(checkpoint).__name__}; give the dict passed to "
                            f"torch.save")
        if self.scaler is None or not self.scaler.is_enabled():
            return True
        keys = set(self.scaler.state_dict())
        if _holds(checkpoint, keys):
            return True
        self._find("checkpoint", f"the checkpoint dict (keys {', '.join(map(str, list(checkpoint)[:6]))}) has no "
                                 f"GradScaler state: a resumed run restarts the loss scale at its initial value; save "
                                 f"scaler.state_dict() in it and call scaler.load_state_dict() on resume")
        return False

    def report(self) -> list[str]:
        """The findings, the first non-finite value with its module's run-up, and the modules with the largest
        values, as lines."""
        out = [f"watched {self.step_count} steps, {self.samples} sampled (every {self.every}), {self.traced} of them "
               f"traced; largest |value| per module, gradients as the loop holds them (x the loss scale)"]
        if self.scaler is not None and self.scaler.is_enabled() and self.step_count:
            now = float(self.scaler.get_scale())
            if now <= 1.0 and self._fell(now):  # the counts as the loop ended (and a fall after the last sample)
                self.findings["scale_fell"] = self._fell(now, self.step_count)
        out += [f"{'SETUP' if kind in SETUP else 'NOTE'}: {line}" for kind, line in self.findings.items()]
        run_up = self.run_up
        if self.first:
            out.append(f"FIRST NON-FINITE: {_event(self.first)}")
            run_up = self.run_up_to_first  # the samples before it: what led there
            out.append(f"  its run-up: {self._run_up_line(self.first['module'], run_up)}")
        top = sorted(run_up, key=lambda m: -max((max(f, b) for _, f, b in run_up[m]), default=0.0))[:3]
        for m in top:
            out.append(f"  largest |value| in {m}: {self._run_up_line(m, run_up)}")
        return out

    def _fell(self, scale: float, steps: int | None = None) -> str | None:
        """The line for a GradScaler scale that fell from above 1 to `scale` <= 1 (None: it did not fall): the
        gradients overflowed at every scale it tried -- not a scale set to 1 by mistake."""
        if self._scale0 is None or self._scale0 <= 1.0 or scale >= self._scale0:
            return None
        skipped = f"{self.skipped} of {steps} steps skipped; " if self.optimizer is not None and steps else ""
        return (f"{skipped}S fell from {_pow2(self._scale0)} to {_pow2(scale)}: the gradients overflow FP16 (inf/nan) "
                f"at every scale the GradScaler tried -- find what makes them (the first non-finite value), or "
                f"use BF16")

    # -- sampling ------------------------------------------------------------------------------------------
    def _begin(self) -> None:
        trace = self._chase or self.step_count % self.trace_every == 0
        if not (trace or self.step_count % self.every == 0):
            return
        # The weights as the step starts: a value made non-finite by an earlier, unsampled step is not
        # blamed on the first operation that reads it.
        # (their min and max: no copy of the weights is made)
        self._weights = [(label, torch.aminmax(p.detach())) for label, p in self._params]
        if not trace:
            self._rec = _Modules(self._plan)
            return
        # Tracing: every operation, attributed to the innermost running module (forward and backward).
        self._active = []
        self._rec = _Ops(self._current)
        for m in self.model.modules():
            self._handles.append(m.register_forward_pre_hook(self._enter))
            self._handles.append(m.register_forward_hook(self._leave))
        self._rec.__enter__()

    def _stop(self) -> None:
        if isinstance(self._rec, _Ops):
            self._rec.__exit__(None, None, None)
        elif self._rec is not None:
            self._rec.close()
        for h in self._handles:
            h.remove()
        self._handles = []

    def _read(self) -> None:
        rec = self._rec
        self._stop()
        self._rec = None
        self.samples += 1
        traced = isinstance(rec, _Ops)
        self.traced += traced
        extra = [self._bad if self._bad is not None else torch.zeros((), dtype=torch.bool)]
        if self.scaler is not None and self.scaler.is_enabled():
            scale = scaler_scale_tensor(self.scaler)
            extra.append(scale if scale is not None else torch.ones(()))
        # max |x| of each record from its min and max, on the device (nan wins), then one host transfer.
        dev = (rec.values or [pair[0] for _, pair in self._weights] or [torch.zeros(())])[0].device
        f32 = torch.float32
        mm = torch.stack([v if v.dtype == f32 and v.device == dev else v.to(dev, f32) for v in rec.values]
                         ).view(-1, 2) if rec.values else None
        wm = torch.stack([v.to(dev, f32) for _, pair in self._weights for v in pair]).view(-1, 2) \
            if self._weights else None
        parts = [torch.maximum(-wm[:, 0], wm[:, 1]) if wm is not None else None,
                 torch.maximum(-mm[:, 0], mm[:, 1]) if mm is not None else None,
                 torch.stack([t.to(dev, torch.float32) for t in extra])]
        flat = torch.cat([x for x in parts if x is not None]).tolist()  # the one host transfer
        nw, no = len(self._weights), len(rec.names)
        weights, values, tail = flat[:nw], flat[nw:nw + no], flat[nw + no:]
        step = self.step_count
        self._bad, bad_loss = None, bool(tail[0])
        per: dict[str, list[float]] = {}
        for (module, phase, what), v in zip(rec.names, values):
            if module != OUTSIDE and what != "input":
                fb = per.setdefault(module, [0.0, 0.0])
                i = phase == "backward"
                fb[i] = v if math.isnan(v) else fb[i] if math.isnan(fb[i]) else max(fb[i], v)  # nan, inf win
        for module, (f, b) in per.items():
            self.run_up.setdefault(module, collections.deque(maxlen=RUN_UP)).append((step, f, b))
        bad_w = next((name for (name, _), v in zip(self._weights, weights) if not math.isfinite(v)), None)
        i = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
        bad = None if i is None else (rec.names[self._first_of(rec, i)], values[i])
        if self.first is None:
            if bad_w is not None:
                self._event({"step": step, "module": bad_w, "phase": "before the step", "what": "its weights",
                             "value": "non-finite"})
            elif bad is not None:
                (module, phase, what), v = bad
                e = {"step": step, "value": "nan" if math.isnan(v) else "inf"}
                self._event({**e, "module": module, "phase": phase, "op": what} if traced else
                            {**e, "what": what, **self._producer(module, phase, what)})
            elif traced and self._chase:
                self._countdown(step, f"at step {self._chase_from}" if self._chase_from == step - self.every else
                                f"between steps {self._chase_from} and {step - self.every}")
            elif bad_loss and not self._chase:
                self._start_chase(step - self.every + 1)  # a non-finite loss since the last sample
        elif traced and self._chase:  # naming the operation behind a value first seen at module level
            if bad_w is not None:
                self._chase = 0
                self._find("untraced", f"the operation behind step {self.first['step']}'s non-finite value cannot "
                                       f"be traced: the update made the weights non-finite (a GradScaler skips it)")
            elif bad is not None:
                (module, phase, op), v = bad
                self._event({"step": step, "value": "nan" if math.isnan(v) else "inf", "module": module,
                             "phase": phase, "op": op})
            else:
                self._countdown(step, f"at step {self.first['step']}")
        if rec.fp16:
            scale = tail[1] if len(tail) > 1 else None
            if self.scaler is None or not self.scaler.is_enabled():
                what = "no GradScaler given to watch()" if self.scaler is None else "the GradScaler is disabled"
                self._find("fp16_unscaled", f"FP16 compute with {what}: gradients below 2^-24 flush to zero "
                                            f"(section 3.2); use torch.amp.GradScaler() (enabled) or BF16")
            elif scale is not None and scale <= 1.0 and self._fell(scale):
                self._find("scale_fell", self._fell(scale, step + 1))
            elif scale is not None and scale <= 1.0:
                self._find("fp16_unscaled", f"FP16 compute with the GradScaler's scale at {scale:g} (step {step}): "
                                            f"it does not scale the gradients; create it with the default "
                                            f"init_scale (2^16) and let it move, or use BF16")

    @staticmethod
    def _first_of(rec, i: int) -> int:
        """The record that names the producer among those of one gradient tensor: a tensor that is one module's
        input and another's output gets both records at once, the output's first; its maker is the module whose
        input gradient it is (the deepest such)."""
        gid = getattr(rec, "grads", None) and rec.grads[i]
        if gid is None:
            return i
        same = [i]
        while same[-1] + 1 < len(rec.grads) and rec.grads[same[-1] + 1] == gid:  # its hooks fire together
            same.append(same[-1] + 1)
        made = [j for j in same if rec.names[j][2] == "input gradient"]
        return max(made, key=lambda j: rec.names[j][0].count(".")) if made else i

    def _producer(self, module: str, phase: str, what: str) -> dict:
        """Who made the first non-finite record of a module-level sample: the module itself (its output, its own
        gradients), or the operations between modules (an input: its parent's own code or the batch; the
        gradient arriving at an output: the parent's own code or the loss)."""
        if what in ("output", "input gradient", "weight gradient"):
            return {"module": module, "phase": phase}
        parent = self._parent.get(module)
        return {"module": parent or OUTSIDE, "phase": phase, "between": module}

    def _countdown(self, step: int, when: str) -> None:
        self._chase -= 1
        if not self._chase:
            self._find("one_off", f"a non-finite value {when}, not made again in the {self.every} steps after it, "
                                  f"all traced: a one-off (a batch? the loss?)")

    def _start_chase(self, since: int) -> None:
        self._chase, self._chase_from = self.every, max(0, since)

    def _event(self, e: dict) -> None:
        if "op" in e and self.first is not None:  # the trace of a value first seen at module level
            self.first["traced"] = e
            self._chase = 0
            self.log(f"traced: {_traced(e)}")
            return
        self.first = e
        self.run_up_to_first = {m: [r for r in rows if r[0] < e["step"]] for m, rows in self.run_up.items()}
        if e["phase"] == "backward" and self.scaler is not None and self.scaler.is_enabled():
            e["note"] = "the GradScaler skips such a step and lowers S: expected while it finds its scale"
        self.log(f"first non-finite value: {_event(e)}")
        # Name the operation: trace the next steps (a module whose output stays finite hides it at module level).
        self._chase = self.every if e["phase"] != "before the step" and "op" not in e else 0

    def _run_up_line(self, module: str, run_up: dict) -> str:
        rows = list(run_up.get(module, ()))[-4:]
        if rows or not self.first:
            return ", ".join(f"step {s} fwd {f:.3g} bwd {b:.3g}" for s, f, b in rows) or "not sampled"
        return f"not sampled before step {self.first['step']}"

    # -- which module is running ---------------------------------------------------------------------------
    def _current(self) -> str:
        # The innermost: the deepest running module (a child and its parent end on the same output tensor,
        # so their backward hooks fire together), the latest entered among equals.
        if not self._active:
            return OUTSIDE
        return self._names[max(reversed(self._active), key=self._depth.__getitem__)]

    def _enter(self, mod, args) -> None:
        self._active.append(mod)

    def _leave(self, mod, args, out) -> None:
        if mod in self._active:
            self._active.remove(mod)
        if not torch.is_grad_enabled():
            return
        # Backward: the module's gradients begin when its outputs' are ready, end when its inputs' (and its own
        # parameters') are.
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        ins = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        ins += [p for p in mod.parameters(recurse=False) if p.requires_grad]  # a first layer's: its input has none
        if outs:
            self._handles.append(register_multi_grad_hook(outs, lambda grads: self._backward_enter(mod)))
        if ins and outs:
            self._handles.append(register_multi_grad_hook(ins, lambda grads: mod in self._active
                                                          and self._active.remove(mod)))

    def _backward_enter(self, mod) -> None:
        if not self._reset_queued:
            # At the end of this backward nothing is running any more (a module whose exit never fired: its
            # inputs and parameters need no gradient); torch.utils.module_tracker resets the same way.
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            self._reset_queued = True
        self._active.append(mod)

    def _backward_done(self) -> None:
        self._active, self._reset_queued = [], False

    # -- setup checks --------------------------------------------------------------------------------------
    def _count_step(self, opt, args, kwargs) -> None:
        self._opt_steps += 1

    def _sched_epoch(self):
        return getattr(self.scheduler, "last_epoch", None)

    def _check_schedule(self, stepped: bool) -> None:
        now = self._sched_epoch()
        if self.optimizer is not None and self.scheduler is not None and now != self._sched_before and not stepped:
            self._find("schedule", f"step {self.step_count}: the scheduler stepped though the optimizer did not (the "
                                   f"GradScaler skipped the update for inf/nan): the schedule runs ahead of the "
                                   f"updates; step it only when the update was applied (scaler.get_scale() did not "
                                   f"drop in scaler.update())")
        self._sched_before = now

    def _find(self, kind: str, line: str) -> None:
        if kind not in self.findings:
            self.findings[kind] = line
            self.log(line)


def _pow2(s: float) -> str:
    k = math.log2(s) if s > 0 else math.nan
    return f"2^{round(k)}" if k == round(k) else f"{s:g}"


def _event(e: dict) -> str:
    if e["phase"] == "before the step":
        return (f"the weights of {e['module']} were already non-finite as step {e['step']} began (made in a step "
                f"between samples: lower every=, or use a GradScaler, which keeps them finite)")
    note = f" ({e['note']})" if e.get("note") else ""
    if "op" in e:
        return _traced(e) + note
    where = (f"in {e['module']}'s own operations between its modules, reaching {e['between']}'s {e['what']}"
             if "between" in e else f"in {e['module']} (its {e['what']})")
    return f"{e['value']} made {where}, {e['phase']}, step {e['step']}{note}" + (
        f"; traced: {_traced(e['traced'])}" if e.get("traced") else "")


def _traced(e: dict) -> str:
    return f"{e['value']} made by {e['op']} in {e['module']}, {e['phase']}, step {e['step']}"


def _owner(model: nn.Module, pname: str) -> nn.Module:
    return model.get_submodule(pname.rpartition(".")[0])


def _holds(obj, keys: set, depth: int = 0) -> bool:
    """Somewhere in the (nested) checkpoint, a dict with every key of the scaler's state."""
    if isinstance(obj, dict):
        if keys <= set(obj):
            return True
        return depth < 4 and any(_holds(v, keys, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)) and depth < 4:
        return any(_holds(v, keys, depth + 1) for v in obj)
    return False


def watch(model: nn.Module, every: int = 10, optimizer=None, scaler=None, scheduler=None, log=None,
          trace_every: int | None = None) -> Watch:
    """`with mpt.doctor.watch(model, every=10, optimizer=opt, scaler=scaler, scheduler=sched) as w:` ... w.step()
    in the loop (module docstring)."""
    return Watch(model, every, optimizer, scaler, scheduler, log, trace_every)
