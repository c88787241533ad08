"""Every private PyTorch name the project relies on, in one place: a torch upgrade that moves one
breaks here (and in tests/test_torch_private.py, which checks each against the public behaviour it
stands for), not somewhere in the precision recipes. Checked with torch 2.14."""
from __future__ import annotations

import contextlib

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


def scaler_scale_tensor(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The scaler's current scale as the tensor it keeps on the device (None before its first
    scale()): read without a host sync. get_scale() returns a float, which syncs."""
    return scaler._scale
