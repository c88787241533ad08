"""The doctor's one first-inf finder: every operation of a training step, seen by a dispatch mode, with the module
running it (forward and backward) and the range of what it made, kept on the device.

watch() traces some of a user's steps with it (the first record in execution order that holds inf/nan: its run-up
and the operation that made it); the examination's FP16 replay traces its steps with the operations' inputs as well
(`first_overflow`: the first operation whose FP16/BF16 result holds inf/nan though its inputs are finite -- what
module outputs cannot show: a sum of squares inside a norm layer whose output stays finite). Tracing costs about
twice a step's time: a diagnostic, not for training runs.

Module attribution in backward follows torch.utils.module_tracker: a module's backward begins when the gradients
of its outputs are ready and ends when those of its inputs (and weights) are.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from mpt.bands import tensors_in
from mpt.fp8 import min_max
from mpt.torch_private import TorchDispatchMode, grad_accumulator, in_backward, tree_flatten, when_all_grads_ready

OUTSIDE = "(outside the model)"  # the loss and whatever else the step computes from the model's outputs
FP16 = (torch.float16,)  # FP16 compute: the format whose gradients need a loss scale (BF16 does not)
LOW = (torch.float16, torch.bfloat16)  # the formats whose overflow first_overflow looks for

_OPS: dict = {}  # an operation -> its record name ("aten.mul"), "" where it makes no values: found once

# The min and max values are written into buffers of this many pairs (Slots), not kept as 0-dim tensors:
# thousands of those alive until the step ends would be promoted through the Python garbage collector's
# generations and set off its full passes over every object of the process (~0.2 s on the tiny ResNet-50's
# benchmark).
FOLD = 512


def _record_name(func) -> str:
    """The operation's record name, or "" where it computes no new values: a view or detach (the values of its
    input), an allocation (empty memory: whatever bits it holds, possibly nan)."""
    name = func.overloadpacket.__name__
    view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
    return "" if view or "empty" in name or name in ("detach", "lift_fresh", "alias") else str(func.overloadpacket)


class Slots:
    """Where samples and traces write their min and max values: pairs of 0-dim views into buffers of FOLD pairs,
    one list of buffers per (dtype, device), made as first needed and reused by every sample and trace of a watch.
    torch.aminmax(t, out=pair) (fp8.min_max's reads for a tensor not contiguous) writes a record's two values in
    place: no tensor made per value, none stacked (~1.3 us a small record on the CPU, ~600 records a sample);
    gather() copies them out as the sample closes."""

    def __init__(self, fold: int = FOLD):
        self.fold = fold
        self._buffers: list[torch.Tensor] = []  # in the order made: pair s is in buffer s // fold
        self._pairs: dict = {}  # (dtype, device) -> its pairs, each (min view, max view, s)
        self._next: dict = {}  # (dtype, device) -> the index of its next free pair

    def take(self, t: torch.Tensor) -> tuple:
        """A free pair for the min and max of `t` (its dtype, its device): (min view, max view, s)."""
        key = (t.dtype, t.device)
        i = self._next.get(key, 0)
        pairs = self._pairs.get(key)
        if pairs is None or i == len(pairs):
            pairs = self._grow(key)
        self._next[key] = i + 1
        return pairs[i]

    def record(self, t: torch.Tensor) -> int:
        """The min and max of `t` written into a free pair: its index s, for gather(). `t` detached, or read under
        no_grad (aminmax's out= refuses a tensor whose result would need a gradient)."""
        lo, hi, s = self.take(t)
        if t.is_contiguous():  # (the common case, without min_max's own call on each of a sample's records)
            torch.aminmax(t, out=(lo, hi))
        else:
            min_max(t, out=(lo, hi))
        return s

    def _grow(self, key) -> list:
        buf = torch.zeros(2 * self.fold, dtype=key[0], device=key[1])
        v = buf.unbind()  # (~1.6 us a view: made once)
        first = len(self._buffers) * self.fold
        self._buffers.append(buf)
        pairs = self._pairs.setdefault(key, [])
        pairs += [(v[2 * i], v[2 * i + 1], first + i) for i in range(self.fold)]
        return pairs

    def gather(self, slots: list[int]) -> torch.Tensor:
        """The min and max in the pairs `slots`, in turn (1-D; on the device of the first, in the dtype all
        promote to, as torch.stack gives them); every pair is free again."""
        self._next.clear()
        if not slots:
            return torch.zeros(0)
        dev = self._buffers[slots[0] // self.fold].device  # (a model spread over devices: on the first one)
        dtype = functools.reduce(torch.promote_types, {b.dtype for b in self._buffers})
        every = torch.cat([b.to(dev, dtype) for b in self._buffers]).view(-1, 2)
        return every[torch.tensor(slots, device=dev)].reshape(-1)


def flat(obj):
    """The tensors in an operation's arguments or results (tensors, lists/tuples of them, kwargs)."""
    return tensors_in(obj, max_depth=3)


def module_labels(model: nn.Module) -> dict[nn.Module, str]:
    """Each module of `model` as the doctor names it: "name (Class)", "root (Class)" for the model itself."""
    return {m: f"{n or 'root'} ({type(m).__name__})" for n, m in model.named_modules()}


class Trace(TorchDispatchMode):
    """One traced step, as a context around it: for each operation of a training forward (grad mode on) or of
    the backward, the module running it and the min and max of each floating result, kept on the device.
    `inputs` (first_overflow's trace): also the largest |value| among each operation's floating inputs (nan where
    one is not finite), and every operation inside a module's forward, with or without grad mode (a custom
    autograd Function's forward runs without it: mpt.half_math's emulated FP16 arithmetic)."""

    def __init__(self, model: nn.Module, labels: dict[nn.Module, str] | None = None, inputs: bool = False,
                 slots: Slots | None = None):
        super().__init__()
        self.model, self.inputs = model, inputs
        self._labels = labels or module_labels(model)
        self._depth = {m: (n.count(".") + 1 if n else 0) for n, m in model.named_modules()}
        self.names: list[tuple[str, str, str]] = []  # (module, "forward" | "backward", op)
        # The min and max of each result, in turn, on the device: one 1-D tensor, gathered on exit from the
        # slots written as the records are made (`_sid`: each record's pair; `slots`: a watch's, reused).
        self.values: list[torch.Tensor] = []
        self._slots = slots or Slots()
        self._sid: list[int] = []
        self._name_of: dict = {}  # each record name once (the same tuple for every record of it)
        self.low: list[bool] = []  # per record: its result is FP16 or BF16
        self.input_max: list[torch.Tensor] = []  # with `inputs`, per record: its operation's largest |input|
        self.fp16 = False
        self._handles: list = []  # the module hooks and the weights' gradient hooks: removed on exit
        self._active: list[nn.Module] = []  # modules whose forward or backward is running, in entry order
        self._current: str | None = OUTSIDE  # current(), kept until `_active` changes (None: to be found)
        self._reset_queued = False
        self._open = False  # (a hook left on an activation kept past the step does nothing then)
        # Each module's own trainable weights and their gradient accumulators, taken as the trace begins (outside
        # the dispatch mode: taken inside, each would be an operation seen by it) and held to its end.
        self._weights: dict[nn.Module, tuple[list, list]] = {}
        # The graph nodes the backward's module tracking counts with (when_all_grads_ready's `held`), emptied on exit:
        # held by hooks on the step's own tensors, they would keep its whole graph alive after the step.
        self._held: list[list] = []

    def __enter__(self) -> "Trace":
        self._open = True
        # Two hooks on every module (the global ones), a module outside the model passed over, instead of two on
        # each of the model's: placing and removing ~250 handles cost ~1 ms a traced step on a CPU (the tiny
        # ResNet-50). (They run before a module's own hooks: an output that a user's forward hook replaces is not
        # the one seen.)
        for m in self.model.modules():
            self._weights[m] = ([], [])
        self._handles.append(register_module_forward_pre_hook(self._enter))
        self._handles.append(register_module_forward_hook(self._leave))
        # (one walk over the weights, not one m.parameters(recurse=False) per module: ~30 us each)
        modules = dict(self.model.named_modules(remove_duplicate=False))  # (a module shared: each of its names)
        for name, p in self.model.named_parameters(remove_duplicate=False):
            ws, accs = self._weights[modules[name.rpartition(".")[0]]]
            if p.requires_grad and not any(p is w for w in ws):
                ws.append(p)
                accs.append(grad_accumulator(p))
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for h in self._handles:
            h.remove()
        for nodes in self._held:
            nodes.clear()
        self._handles, self._weights, self._held, self._open = [], {}, [], False
        if self._sid:
            self.values = [self._slots.gather(self._sid)]
            self._sid = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # (~900 operations a step pass here: each test is one lookup or call)
        out = func(*args, **(kwargs or {}))
        backward = in_backward()
        grad = backward or torch.is_grad_enabled()
        if not (grad or self.inputs):
            return out  # the optimizer, evaluation: not the step's forward or backward
        op = _OPS.get(func)
        if op is None:
            op = _OPS[func] = _record_name(func)
        if not op:
            return out  # views, allocations
        module = self._current if self._current is not None else self.current()
        if module == OUTSIDE and (not grad or not backward and not any(a.requires_grad for a in flat((args, kwargs)))):
            # (with `inputs`) no-grad operations outside the model's forward; outside the model, the loss's graph
            # only (not a GradScaler's own bookkeeping)
            return out
        big = None
        for t in (out,) if isinstance(out, torch.Tensor) else flat(out):
            if t.is_floating_point() and t.numel():
                dtype = t.dtype
                if dtype in FP16:
                    self.fp16 = True
                # min and max in one pass (inf/nan propagate into them); |value| is taken on the host. On a
                # CPU this is ~20x faster than linalg.vector_norm(t, inf).
                name = (module, "backward" if backward else "forward", op)
                self.names.append(self._name_of.setdefault(name, name))
                self._sid.append(self._slots.record(t.detach()))
                self.low.append(dtype in LOW)
                if self.inputs:
                    big = self._input_max(args, kwargs) if big is None else big
                    self.input_max.append(big)
        return out

    @staticmethod
    def _input_max(args, kwargs) -> torch.Tensor:
        ins = [t.detach().abs().amax().to(torch.float64) for t in flat((args, kwargs))
               if t.is_floating_point() and t.numel()]
        return torch.stack([x.to(ins[0].device) for x in ins]).amax() if ins else torch.zeros((), dtype=torch.float64)

    # -- which module is running ---------------------------------------------------------------------------
    def current(self) -> str:
        # The innermost: the deepest running module (a child and its parent end on the same output tensor,
        # so their backward hooks fire together), the latest entered among equals. Found again only when the
        # running modules change (an operation asks; hundreds run in between).
        if self._current is None:
            self._current = self._labels[max(reversed(self._active), key=self._depth.__getitem__)] \
                if self._active else OUTSIDE
        return self._current

    def _enter(self, mod, args) -> None:
        if mod in self._weights:  # (one of the model's modules)
            self._active.append(mod)
            self._current = None

    def _leave(self, mod, args, out) -> None:
        if mod not in self._weights:
            return
        if mod in self._active:
            self._active.remove(mod)
            self._current = None
        if not torch.is_grad_enabled() or not self._open:
            return
        # Backward: the module's gradients begin when its outputs' are ready, end when its inputs' (and its own
        # parameters') are. (One tensor in, one out, the common case, without flattening.)
        outs = [out] if isinstance(out, torch.Tensor) else [t for t in tree_flatten(out)[0]
                                                             if isinstance(t, torch.Tensor)]
        outs = [t for t in outs if t.requires_grad]
        if not outs:
            return
        self._handles += when_all_grads_ready(outs, lambda: self._backward_enter(mod), held=self._held)
        ins = args if len(args) == 1 and isinstance(args[0], torch.Tensor) else [
            t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        ins = [t for t in ins if t.requires_grad]
        ws, accs = self._weights[mod]
        if ins or ws:  # (a first layer's weights: its input needs no gradient)
            nodes = [t.grad_fn or grad_accumulator(t) for t in ins] + accs
            self._handles += when_all_grads_ready(ins + ws, lambda: self._backward_leave(mod), nodes, self._held)

    def _backward_enter(self, mod) -> None:
        if not self._open:
            return
        if not self._reset_queued:
            # At the end of this backward nothing is running any more (a module whose exit never fired: its
            # inputs and parameters need no gradient); torch.utils.module_tracker resets the same way.
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            self._reset_queued = True
        self._active.append(mod)
        self._current = None

    def _backward_leave(self, mod) -> None:
        if mod in self._active:
            self._active.remove(mod)
            self._current = None

    def _backward_done(self) -> None:
        self._active, self._reset_queued, self._current = [], False, OUTSIDE


def first_overflow(trace: Trace, step: int) -> dict | None:
    """The first operation of a forward pass traced with `inputs` whose FP16/BF16 result holds inf/nan while all
    its floating inputs are finite: {step, module, op, input_max_abs}, or None. Values that only propagate an
    earlier inf/nan are not it (their inputs are not finite). One host transfer."""
    if not trace.values:
        return None
    dev = trace.values[0].device
    mm = torch.cat([v.to(dev, torch.float64) for v in trace.values]).view(-1, 2)
    ins = torch.stack([v.to(dev) for v in trace.input_max])
    finite = torch.isfinite(mm).all(1).to(torch.float64)
    host = torch.cat([finite, ins]).tolist()  # the one host transfer
    n = len(trace.names)
    for i, (module, phase, op) in enumerate(trace.names):
        if trace.low[i] and phase == "forward" and module != OUTSIDE and not host[i] \
                and math.isfinite(host[n + i]):
            return {"step": step, "module": module, "op": op, "input_max_abs": host[n + i]}
    return None
