"""watch()'s sample at module granularity, the steps it does not trace: hooks take the min and max of each module's
inputs and outputs as the forward pass makes them, and of the gradients of its outputs and inputs as the
backward pass makes them, on the device, in execution order; the weights' gradients are read as each backward
ends, each record placed where its module's backward began (a traced step records every operation instead:
mpt.doctor.trace)."""
from __future__ import annotations

import functools
import weakref
from typing import Callable

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from mpt.doctor.trace import FOLD, FP16, Slots, flat
from mpt.torch_private import add_grad_hook


@functools.lru_cache(maxsize=None)
def _record_names(label: str) -> dict[str, tuple[str, str, str]]:
    """A module's record names, made once (not a tuple per record per sample)."""
    return {what: (label, phase, what) for phase, whats in (("forward", ("input", "output")), ("backward", (
        "output gradient", "input gradient", "weight gradient"))) for what in whats}


class ModuleSample:
    """One sampled step at module granularity: the min and max of each module's inputs and outputs (forward)
    and of the gradients of its outputs, inputs and weights (backward), on the device, in execution order.
    `plan`: (module, its label, leaf?, in place?, its own trainable weights) for each hooked module; `on_start`:
    called as the step's forward begins (the first module called), before anything is recorded; `slots`: where
    the values are written (a watch's, reused sample after sample; default: the sample's own)."""

    def __init__(self, plan: list, on_start: Callable[[], None] | None = None, slots: Slots | None = None):
        self.names: list[tuple[str, str, str]] = []  # (module, "forward" | "backward", what)
        # The min and max of each record, in turn, on the device: one 1-D tensor, gathered by close() from the
        # slots written as the records are made (`_sid`: each record's pair).
        self.values: list[torch.Tensor] = []
        self._slots = slots or Slots(FOLD)
        self._sid: list[int] = []
        self.grads: list[int | None] = []  # per backward record, its gradient's group (one tensor, several records)
        self.fp16 = False
        # (id, version) -> a weak reference to the value recorded in this forward pass: not holding it, the
        # sample keeps no tensor past the step's own use of it (held, they raised its memory peak: new pages,
        # page faults); a dead reference's id may be a new tensor's.
        self._seen: dict = {}
        # (id, version) -> (weak reference, the records of its gradient): one hook on each gradient, however
        # many modules record it (the output of one is the input of the next)
        self._hooked: dict = {}
        self._last: tuple | None = None  # (gradient, its pair, its group): one gradient, several records
        self._handles = []
        self._open = True
        # Two hooks on every module (the global ones) instead of one or two on each of the plan's: each sample
        # places them and takes them away again. A module outside the plan is passed over. (They run before a
        # module's own forward hooks: one of the user's that replaces an output is not seen.)
        self._plan = {m: (_record_names(label), leaf, inplace) for m, label, leaf, inplace, _ in plan}
        self._handles.append(register_module_forward_pre_hook(self._pre))
        self._handles.append(register_module_forward_hook(self._post))
        # The weights' gradients: read from .grad as each backward ends (one engine callback), not by a hook on
        # each weight placed and removed every sample (153 on the tiny ResNet-50: a quarter of a sample's cost).
        # Each record is placed right after its module's output-gradient records, where the module's backward
        # begins and where a hook on the weight fired (the engine runs a weight's gradient accumulation as soon
        # as the node making it has run), so "the first non-finite record" is the same one. With several
        # backward passes in a step (micro-batches) .grad holds their sum: the gradients as the loop holds them.
        self._weights = [(_record_names(label)["weight gradient"], label, p) for _, label, _, _, ws in plan
                         for p in ws]
        self._wnames: list[tuple] = []  # the weight-gradient records read so far, in turn
        self._wsid: list[int] = []  # their pairs
        # per weight record: the index in `names` it follows (its module's output-gradient group's last record, else
        # the last record made by then; -1 where there was none)
        self._wafter: list[int] = []
        self._queued = False  # this backward's weight-gradient read is queued
        self._bstart = 0  # the first record of this backward
        # (on_start's work waits for the step's forward: a sample begun as a loop ends costs two hooks)
        self._on_start = on_start
        self._started = False

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._seen, self._hooked, self._last, self._open = [], {}, {}, None, False
        order = self._merge_weights() if self._wnames else None
        if self._sid or self._wsid:
            sid = self._sid + self._wsid
            self.values = [self._slots.gather(sid if order is None else [sid[j] for j in order])]
        self._sid, self._wsid = [], []

    def _read_weights(self) -> None:
        """As a backward ends: each weight's gradient as .grad holds it, placed after its module's output-gradient
        records of this backward (the group they share with the next module's input gradient included)."""
        self._queued = False
        after: dict[str, int] = {}  # module label -> the last record of its (first) output gradient's group
        names, grads = self.names, self.grads
        n = len(names)
        for i in range(self._bstart, n):
            name = names[i]
            if name[2] == "output gradient" and name[0] not in after:
                j, group = i, grads[i]
                while j + 1 < n and grads[j + 1] == group:
                    j += 1
                after[name[0]] = j
        record = self._slots.record
        for name, label, p in self._weights:
            g = p.grad
            if g is None or not g.is_floating_point() or not g.numel() or g.is_sparse:
                continue
            self._wnames.append(name)
            self._wsid.append(record(g.detach() if g.requires_grad else g))
            self._wafter.append(after.get(label, n - 1))

    def _merge_weights(self) -> list[int]:
        """The weight-gradient records into execution order: names and groups (each its own, numbered by its first
        record + 1, as every group is). Returns the order: index n + k is the k-th weight record."""
        n, after = len(self.names), self._wafter
        # Index n + k: the k-th weight record, right after record after[k] (-1: before all), in turn among those
        # after the same record: the records up to it, then it.
        order: list[int] = []
        done = 0  # the records placed so far
        for k in sorted(range(len(after)), key=after.__getitem__):
            if after[k] + 1 > done:
                order += range(done, after[k] + 1)
                done = after[k] + 1
            order.append(n + k)
        order += range(done, n)
        names = self.names + self._wnames
        old = self.grads + [-1 - k for k in range(len(self._wnames))]  # (a weight record: a group of its own)
        renum: dict[int, int] = {}
        self.names = [names[j] for j in order]
        self.grads = [None if old[j] is None else renum.setdefault(old[j], new_i + 1) for new_i, j in enumerate(order)]
        self._wnames, self._wafter = [], []
        return order

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
        self._sid.append(self._slots.record(t.detach()))

    def _hook(self, name: tuple, t: torch.Tensor) -> None:
        """Record the gradient of `t` as `name` when backward makes it. The hooks of one tensor fire together, in
        the order they were placed: one hook recording them in that order does what one hook each did."""
        key = (id(t), t._version)  # (a hook goes to the tensor's current grad_fn: an in-place change moves it)
        got = self._hooked.get(key)
        if got is not None and got[0]() is t:
            got[1].append(name)
            return
        records = [name]
        add_grad_hook(t, functools.partial(self._bwd, records))  # (register_hook without its handle)
        self._hooked[key] = (weakref.ref(t), records)

    def _bwd(self, records: list | tuple, g: torch.Tensor) -> None:
        """Record a gradient's min and max under each of its records (one group: measured once). The hooks of one
        tensor fire together, and a gradient passed on unchanged (a sum's) reaches the next hook as the same
        tensor: measured once, one group with the records before it."""
        if not self._open or not g.is_floating_point() or not g.numel():
            return  # (a hook on an activation kept past its step: no handle is kept to remove it)
        if not self._queued and self._weights:  # this backward's first gradient: read the weights' as it ends
            self._queued = True
            self._bstart = len(self.names)
            torch.autograd.Variable._execution_engine.queue_callback(self._read_weights)
        last = self._last
        if last is not None and last[0] is g:
            s, group = last[1], last[2]
        else:
            s = self._slots.record(g.detach() if g.requires_grad else g)
            group = len(self.names) + 1
            self._last = (g, s, group)  # held, so that no other tensor takes its id meanwhile
        n = len(records)
        self.names += records
        self.grads += [group] * n
        self._sid += [s] * n

    def _start(self) -> None:
        self._started = True
        if self._on_start is not None:
            self._on_start()

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
