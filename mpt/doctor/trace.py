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

import math

import torch
import torch.nn as nn
from mpt.bands import tensors_in
from mpt.torch_private import TorchDispatchMode, grad_accumulator, in_backward, tree_flatten, when_all_grads_ready

OUTSIDE = "(outside the model)"  # the loss and whatever else the step computes from the model's outputs
FP16 = (torch.float16,)  # FP16 compute: the format whose gradients need a loss scale (BF16 does not)
LOW = (torch.float16, torch.bfloat16)  # the formats whose overflow first_overflow looks for

_MAKES_VALUES: dict = {}
_OP_NAMES: dict = {}  # an operation -> its record name ("aten.mul"), made once

# A step's min and max values are stacked into one tensor this many records at a time: thousands of 0-dim
# tensors alive until the step ends would be promoted through the Python garbage collector's generations and
# set off its full passes over every object of the process (~0.2 s on the tiny ResNet-50's benchmark).
FOLD = 512


def _makes_values(func) -> bool:
    """Does the operation compute new values? Not a view or detach (the values of its input), nor an
    allocation (empty memory: whatever bits it holds, possibly nan)."""
    got = _MAKES_VALUES.get(func)
    if got is None:
        name = func.overloadpacket.__name__
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        got = _MAKES_VALUES[func] = not (view or "empty" in name or name in ("detach", "lift_fresh", "alias"))
    return got


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

    def __init__(self, model: nn.Module, labels: dict[nn.Module, str] | None = None, inputs: bool = False):
        super().__init__()
        self.model, self.inputs = model, inputs
        self._labels = labels or module_labels(model)
        self._depth = {m: (n.count(".") + 1 if n else 0) for n, m in model.named_modules()}
        self.names: list[tuple[str, str, str]] = []  # (module, "forward" | "backward", op)
        # The min and max of each result, in turn, on the device: 1-D tensors of FOLD records each (exit folds
        # the rest), from a list of 0-dim ones as they are made.
        self.values: list[torch.Tensor] = []
        self._pending: list[torch.Tensor] = []
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

    def __enter__(self) -> "Trace":
        self._open = True
        for m in self.model.modules():
            self._handles.append(m.register_forward_pre_hook(self._enter))
            self._handles.append(m.register_forward_hook(self._leave))
            self._weights[m] = ([], [])
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
        self._handles, self._weights, self._open = [], {}, False
        self._fold()

    def _fold(self) -> None:
        if self._pending:
            dev = self._pending[0].device  # (a model spread over devices: on the first one)
            self.values.append(torch.stack([v if v.device == dev else v.to(dev) for v in self._pending]))
            self._pending = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        backward = in_backward()
        grad = backward or torch.is_grad_enabled()
        if not (grad or self.inputs) or not _makes_values(func):
            return out  # the optimizer, evaluation: not the step's forward or backward; views, allocations
        module = self.current()
        if not grad and module == OUTSIDE:
            return out  # (with `inputs`) no-grad operations outside the model's forward
        if module == OUTSIDE and not backward and not any(a.requires_grad for a in flat((args, kwargs))):
            return out  # outside the model, the loss's graph only (not a GradScaler's own bookkeeping)
        big = None
        op = _OP_NAMES.get(func)
        if op is None:
            op = _OP_NAMES[func] = str(func.overloadpacket)
        for t in (out,) if isinstance(out, torch.Tensor) else flat(out):
            if t.is_floating_point() and t.numel():
                self.fp16 |= t.dtype in FP16
                # min and max in one pass (inf/nan propagate into them); |value| is taken on the host. On a
                # CPU this is ~20x faster than linalg.vector_norm(t, inf).
                name = (module, "backward" if backward else "forward", op)
                self.names.append(self._name_of.setdefault(name, name))
                pending = self._pending
                pending += torch.aminmax(t.detach())
                if len(pending) >= 2 * FOLD:
                    self._fold()
                self.low.append(t.dtype in LOW)
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
        self._active.append(mod)
        self._current = None

    def _leave(self, mod, args, out) -> None:
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
        self._handles += when_all_grads_ready(outs, lambda: self._backward_enter(mod))
        ins = args if len(args) == 1 and isinstance(args[0], torch.Tensor) else [
            t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        ins = [t for t in ins if t.requires_grad]
        ws, accs = self._weights.get(mod) or ([p for p in mod.parameters(recurse=False) if p.requires_grad], None)
        if ins or ws:  # (a first layer's weights: its input needs no gradient)
            nodes = None if accs is None else [t.grad_fn or grad_accumulator(t) for t in ins] + accs
            self._handles += when_all_grads_ready(ins + ws, lambda: self._backward_leave(mod), nodes)

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
