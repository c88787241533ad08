"""watch()'s sample at module granularity, the steps it does not trace: hooks take the min and max of each module's
inputs and outputs as the forward pass makes them, and of the gradients of its outputs, inputs and weights as the
backward pass makes them, on the device, in execution order (a traced step records every operation instead:
mpt.doctor.trace)."""
from __future__ import annotations

import functools

import torch

from mpt.doctor.trace import FP16, flat


class ModuleSample:
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
        self.fp16 |= t.dtype in FP16
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
            for t in flat(args):
                self._fwd(label, "input", t)

    def _post(self, label: str, leaf: bool, inplace: bool, mod, args, out) -> None:
        if not torch.is_grad_enabled():
            return
        ins = [] if inplace else list(flat(args))
        if leaf:
            for t in ins:  # a leaf: its inputs are as they came in
                self._fwd(label, "input", t)
        # Hooks on activations go with them (no handle kept: removing ~1000 handles cost more than the hooks).
        for t in flat(out):
            self._fwd(label, "output", t, always=inplace)
            if t.requires_grad:
                t.register_hook(functools.partial(self._bwd, label, "output gradient"))
        for t in ins:  # (an in-place module's input is its output)
            if t.requires_grad and not t.is_leaf:
                t.register_hook(functools.partial(self._bwd, label, "input gradient"))
