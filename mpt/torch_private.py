"""Every private PyTorch name the project relies on, in one place: a torch upgrade that moves one
breaks here (and in tests/test_torch_private.py, which checks each against the public behaviour it
stands for), not somewhere in the precision recipes. Checked with torch 2.14."""
from __future__ import annotations

import collections
import contextlib
import functools

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (re-exported)
from torch.utils._pytree import tree_flatten  # noqa: F401  (re-exported)

# TorchDispatchMode: a context whose __torch_dispatch__ sees every aten op run inside it, with its
# arguments and results -- how the doctor traces each op (mpt/doctor/trace.py).
# tree_flatten(x)[0]: the leaves of nested lists, tuples and dicts, in order (an op's args and results).

# The base of every layer that keeps running statistics (BatchNorm1d/2d/3d, SyncBatchNorm, the
# InstanceNorms): the norm layers impl=paper keeps in FP32 (section 3.3). No public name covers them all.
NormBase = nn.modules.batchnorm._NormBase
# ntuple(n)(x): x repeated n times, or x itself where it is already a sequence -- how a convolution
# reads its stride, padding and dilation arguments; the emulated FP16 convolution reads them the same way.
ntuple = nn.modules.utils._ntuple


def scaler_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """GradScaler's found-inf flags (one per device, 0. or 1.) for `optimizer`, valid after
    scaler.unscale_(optimizer) and before scaler.update(). GradScaler reads them itself in step();
    it has no public accessor."""
    return list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())


def unscale_and_check_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """grads *= inv_scale in place, and found_inf (a one-element float tensor on the grads' device)
    set to 1 if any value is inf or nan: the fused kernel GradScaler.unscale_ runs, without a sync."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for every i (casting dtypes as copy_ does), in as few kernels as torch can."""
    torch._foreach_copy_(dst, src)


def version(t: torch.Tensor) -> int:
    """The version counter of t's storage view: autograd's count of the in-place writes into t (copy_,
    add_, the foreach ops; not writes through t.data), which it compares to refuse a tensor saved for
    backward and modified since. Tensor._version has no public name."""
    return t._version


def shutdown_loader_workers(loader: torch.utils.data.DataLoader) -> None:
    """Stop a DataLoader's persistent worker processes now. They otherwise live until the loader is
    garbage-collected -- and forked workers hold every file descriptor of their parent, the run
    directory's flock included, so a run that returned would still look busy to the next start."""
    it = getattr(loader, "_iterator", None)
    if it is not None:
        it._shutdown_workers()
        loader._iterator = None


def reset_compiled() -> None:
    """Forget every graph torch.compile has made (and its recompilation counts): the speed benchmark
    compiles one model after another, each measured from a clean cache."""
    torch._dynamo.reset()


_FORWARD_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                       "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")


@contextlib.contextmanager
def forward_hooks_suspended(model: nn.Module):
    """Within this context no forward hook registered on `model` or its modules before it was entered
    runs; hooks registered inside run, and the others come back on exit. mpt.fp8's probe forward reads
    the model's dataflow without recording into other observers (mpt.numerics). No public API turns a
    module's hooks off."""
    saved = [(m, {k: getattr(m, k) for k in _FORWARD_HOOK_DICTS}) for m in model.modules()]
    for m, dicts in saved:
        for k, d in dicts.items():
            setattr(m, k, type(d)())
    try:
        yield
    finally:
        for m, dicts in saved:
            for k, d in dicts.items():
                setattr(m, k, d)


def in_backward() -> bool:
    """Whether the calling code runs inside autograd's backward pass (an op dispatched by the engine
    while it evaluates a graph), not in a forward or outside autograd."""
    return torch._C._current_graph_task_id() != -1


def add_grad_hook(t: torch.Tensor, fn) -> None:
    """t.register_hook(fn) -- fn(gradient) as the gradient of t is computed, after the hooks placed before it --
    without the RemovableHandle, for a tensor that takes its hooks away when it goes (an activation: a sample
    places hundreds). What register_hook does, under fn as the key (never one of register_hook's integer ids).
    Tensor._backward_hooks and Node._register_hook_dict have no public name."""
    if type(t) is not torch.Tensor:  # (a subclass may handle register_hook itself)
        t.register_hook(fn)
        return
    hooks = t._backward_hooks
    if hooks is None:
        t._backward_hooks = hooks = collections.OrderedDict()  # (an OrderedDict: a RemovableHandle refers to it)
        if t.grad_fn is not None:
            t.grad_fn._register_hook_dict(t)
    hooks[fn] = fn


def when_all_grads_ready(tensors: list[torch.Tensor], fn, nodes: list | None = None, held: list | None = None) -> list:
    """fn() once the gradients of all of `tensors` that this backward computes are ready: what
    torch.autograd.graph.register_multi_grad_hook(tensors, ..., mode="all") does -- the count of gradients to
    wait for asked of the engine as the first arrives -- without its closure, lock and buffer of gradients per
    tensor and handle per hook (a traced step places ~400). `nodes`: each tensor's grad_fn or, for a leaf, its
    gradient accumulator (grad_accumulator), where the caller has them. Returns the leaf tensors' hook handles
    (weights outlive the step: remove them); the others go with their tensors. `held`: the list of nodes the hooks
    count with is appended to it -- empty it once the backward is over: a hook holding the graph's nodes, on a
    tensor whose node holds the hook, is a cycle through C++ that Python's collector does not see, so the graph
    (nodes, hooks, what they hold) would outlive the step. The engine's graph-task id and its will-execute query
    have no public name."""
    if len(tensors) == 1:  # (a hook that fires: its node runs -- the one gradient to wait for)
        t = tensors[0]
        if t.is_leaf:
            return [t.register_hook(lambda grad: fn())]
        add_grad_hook(t, lambda grad: fn())
        return []
    nodes = nodes or [t.grad_fn or grad_accumulator(t) for t in tensors]
    if held is not None:
        held.append(nodes)
    # graph task -> the gradients still to come. Unlike register_multi_grad_hook, which holds each gradient until
    # the last one arrives, none is held: a weight's gradient held as it arrives is copied into .grad rather than
    # taken (an operation the step does not do unwatched, and one a trace would record).
    left: dict[int, int] = {}

    def hook(grad) -> None:
        task = torch._C._current_graph_task_id()
        n = left.get(task)
        if n is None:
            n = sum(map(torch._C._will_engine_execute_node, nodes))
        if n > 1:
            left[task] = n - 1
        else:
            left.pop(task, None)
            fn()

    handles = []
    for t in tensors:  # (one hook per tensor placed, as register_multi_grad_hook places them: a tensor given twice
        if t.is_leaf:  # counts twice)
            handles.append(t.register_hook(hook))
        else:
            add_grad_hook(t, functools.partial(hook))
    return handles


def grad_accumulator(t: torch.Tensor):
    """The autograd node that accumulates a leaf tensor's gradient (register_multi_grad_hook's own way; it
    lives while something holds it: the graph of a forward that uses the tensor, or the caller)."""
    return torch.autograd.graph._get_grad_fn_or_grad_acc(t)


def scaler_scale_tensor(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The scaler's current scale as the tensor it keeps on the device (None before its first
    scale()): read without a host sync. get_scale() returns a float, which syncs."""
    return scaler._scale
