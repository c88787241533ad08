"""watch()'s sample at module granularity, the steps it does not trace: hooks take the min and max of each module's
inputs and outputs as the forward pass makes them, and of the gradients of its outputs, inputs and weights as the
backward pass makes them, on the device, in execution order (a traced step records every operation instead:
mpt.doctor.trace)."""
from __future__ import annotations

import functools
import weakref
from typing import Callable

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from mpt.doctor.trace import FP16, flat


# A sample's min and max values are stacked into one tensor this many at a time: thousands of 0-dim tensors
# alive until the step ends would set off the Python garbage collector's passes over every object.
FOLD = 512


@functools.lru_cache(maxsize=None)
def _record_names(label: str) -> dict[str, tuple[str, str, str]]:
    """A module's record names, made once (not a tuple per record per sample)."""
    return {what: (label, phase, what) for phase, whats in (("forward", ("input", "output")), ("backward", (
        "output gradient", "input gradient", "weight gradient"))) for what in whats}


class ModuleSample:
    """One sampled step at module granularity: the min and max of each module's inputs and outputs (forward)
    and of the gradients of its outputs, inputs and weights (backward), on the device, in execution order.
    `plan`: (module, its label, leaf?, in place?, its own trainable weights) for each hooked module; `on_start`:
    called as the step's forward begins (the first module called), before anything is recorded."""

    def __init__(self, plan: list, on_start: Callable[[], None] | None = None):
        self.names: list[tuple[str, str, str]] = []  # (module, "forward" | "backward", what)
        # The min and max of each record, in turn, on the device: 1-D tensors of FOLD records each (close()
        # folds the rest), from a list of 0-dim ones as they are made.
        self.values: list[torch.Tensor] = []
        self._pending: list[torch.Tensor] = []
        self.grads: list[int | None] = []  # per backward record, its gradient's group (one tensor, several records)
        self.fp16 = False
        # (id, version) -> a weak reference to the value recorded in this forward pass: not holding it, the
        # sample keeps no tensor past the step's own use of it (held, they raised its memory peak: new pages,
        # page faults); a dead reference's id may be a new tensor's.
        self._seen: dict = {}
        # (id, version) -> (weak reference, the records of its gradient): one hook on each gradient, however
        # many modules record it (the output of one is the input of the next)
        self._hooked: dict = {}
        self._last: tuple | None = None  # (gradient, its min and max, its group): one gradient, several records
        self._handles = []
        self._open = True
        # Two hooks on every module (the global ones) instead of one or two on each of the plan's: each sample
        # places them and takes them away again. A module outside the plan is passed over. (They run before a
        # module's own forward hooks: one of the user's that replaces an output is not seen.)
        self._plan = {m: (_record_names(label), leaf, inplace) for m, label, leaf, inplace, _ in plan}
        self._handles.append(register_module_forward_pre_hook(self._pre))
        self._handles.append(register_module_forward_hook(self._post))
        # The weights' hooks (and on_start's work) wait for the step's forward: a sample begun as a loop ends
        # costs two hooks.
        self._weights = [(_record_names(label)["weight gradient"], p) for _, label, _, _, ws in plan for p in ws]
        self._on_start = on_start
        self._started = False

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._fold()
        self._handles, self._seen, self._hooked, self._last, self._open = [], {}, {}, None, False

    def _fold(self) -> None:
        if self._pending:
            dev = self._pending[0].device  # (a model spread over devices: on the first one)
            self.values.append(torch.stack([v if v.device == dev else v.to(dev) for v in self._pending]))
            self._pending = []

    # The hooks below run ~500 times a sample: each record is a few list appends, its name made beforehand
    # (_record_names), with no call per record beyond the min and max themselves.
    def _fwd(self, name: tuple, t: torch.Tensor, always: bool = False) -> None:
        """Record a forward value's min and max, each value once (a module's input is its producer's output)."""
        if not t.is_floating_point() or not t.numel():
            return
        key = (id(t), t._version)  # the version: an in-place change is a new value
        if not always:
            ref = self._seen.get(key)
            if ref is not None and ref() is t:
                return
        self._seen[key] = weakref.ref(t)
        if t.dtype in FP16:
            self.fp16 = True
        self.grads.append(None)
        self.names.append(name)
        pending = self._pending
        pending += torch.aminmax(t.detach())
        if len(pending) >= 2 * FOLD:
            self._fold()

    def _hook(self, name: tuple, t: torch.Tensor) -> None:
        """Record the gradient of `t` as `name` when backward makes it. The hooks of one tensor fire together, in
        the order they were placed: one hook recording them in that order does what one hook each did."""
        key = (id(t), t._version)  # (a hook goes to the tensor's current grad_fn: an in-place change moves it)
        got = self._hooked.get(key)
        if got is not None and got[0]() is t:
            got[1].append(name)
            return
        records = [name]
        t.register_hook(functools.partial(self._bwd, records))
        self._hooked[key] = (weakref.ref(t), records)

    def _bwd(self, records: list | tuple, g: torch.Tensor) -> None:
        """Record a gradient's min and max under each of its records (one group: measured once). The hooks of one
        tensor fire together, and a gradient passed on unchanged (a sum's) reaches the next hook as the same
        tensor: measured once, one group with the records before it."""
        if not self._open or not g.is_floating_point() or not g.numel():
            return  # (a hook on an activation kept past its step: no handle is kept to remove it)
        last = self._last
        if last is not None and last[0] is g:
            mm, group = last[1], last[2]
        else:
            mm, group = tuple(torch.aminmax(g.detach())), len(self.names) + 1
            self._last = (g, mm, group)  # held, so that no other tensor takes its id meanwhile
        n = len(records)
        self.names += records
        self.grads += [group] * n
        pending = self._pending
        pending += mm * n
        if len(pending) >= 2 * FOLD:
            self._fold()

    def _start(self) -> None:
        self._started = True
        if self._on_start is not None:
            self._on_start()
        for name, p in self._weights:
            self._handles.append(p.register_hook(functools.partial(self._bwd, (name,))))

    def _pre(self, mod, args) -> None:
        if not self._started:
            self._start()
        got = self._plan.get(mod)
        if got is not None and not got[1] and torch.is_grad_enabled():
            name = got[0]["input"]
            for t in flat(args):
                self._fwd(name, t)

    def _post(self, mod, args, out) -> None:
        got = self._plan.get(mod)
        if got is None or not torch.is_grad_enabled():
            return
        names, leaf, inplace = got
        # (one tensor in, one out, the common case, without walking the arguments)
        ins = () if inplace else args if len(args) == 1 and isinstance(args[0], torch.Tensor) else tuple(flat(args))
        if leaf:
            name = names["input"]
            for t in ins:  # a leaf: its inputs are as they came in
                self._fwd(name, t)
        # Hooks on activations go with them (no handle kept: removing ~1000 handles cost more than the hooks).
        name, grad = names["output"], names["output gradient"]
        for t in (out,) if isinstance(out, torch.Tensor) else flat(out):
            self._fwd(name, t, inplace)
            if t.requires_grad:
                self._hook(grad, t)
        grad = names["input gradient"]
        for t in ins:  # (an in-place module's input is its output)
            if t.requires_grad and not t.is_leaf:
                self._hook(grad, t)
