"""train.cuda_graphs: a micro-batch's forward and backward captured once as a CUDA graph and replayed.

At the paper grid's batch of 32 per GPU a step is launch-bound: the GPU waits on Python and on the
launch of each of the model's kernels (experiments/speed_memory/README.md). A replayed graph launches
all of them in one call.

The region is what TrainStep.forward_backward runs for one micro-batch: the task's loss under the
recipe's autocast, then recipe.backward(loss / k) -- from the batch on the device to the gradients in
p.grad. Outside it, eager as ever: the copy of the batch into the graph's input tensors, the update
with its overflow check (the step's one host sync), the loss-scale update, zero_grad. The engine and
the speed benchmark share it through TrainStep; there is one training loop.

Exact: a replay launches the kernels the capture recorded, with the arguments and pointers they had,
so it computes what the eager region computes on the same inputs, bit for bit wherever the eager
kernels are deterministic. What that takes, and how it is kept:
  - fixed shapes: the batch's shapes, strides and dtypes are part of the graph's key; a batch that
    differs (a short last batch) runs eagerly.
  - the host values the region reads are the graph's constants: the recipe's graph_key() (impl=paper's
    loss scale S is a Python number in the backward's multiply) and model.training are in the key; a
    new value captures again (dynamic S changes on an overflow and every growth_interval steps).
  - no side effects of capturing: the warm-up passes (run for real, on a side stream, as CUDA graphs
    require) update BatchNorm's statistics and draw dropout masks; the model's buffers and the random
    state are put back before the first replay, so training continues as if they never ran. Replays
    draw dropout masks from the same Philox stream at the same offsets as the eager passes.
  - gradients: captured with every p.grad None, so the backward writes them into graph-owned tensors;
    after each replay p.grad points at those again (zero_grad frees p.grad after every iteration).
  - autocast's weight-cast cache off inside the region: a cast cached outside the capture would be
    read by every replay and never refreshed. A CNN's weights are each cast once per forward anyway.
  - the first call runs eagerly (it measures activation memory and fills lazy state: cuDNN's algorithm
    search, the FP32 weight copies of fp16_storage, the loss scaler's device tensors).

Refused (one line, mpt.errors.UserError, refusal() below): a CPU device, DDP, several micro-batches per
iteration, observers that hook the forward or backward (numerics sampling), recipes that keep host
state per forward (fp8), tasks that do not declare a static step (Task.graphable).

GraphRunner takes the graph as a backend: CudaGraph on a GPU, EagerGraph in the CPU tests, which runs
the region where a capture would record it and again at each replay, so everything but the CUDA calls
runs the same code path on a CPU.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from mpt.errors import UserError

KEY = "train.cuda_graphs=true"


def refusal(*, device, world: int = 1, accum: int = 1, recipe=None, observers=(), task=None,
            fake: bool = False) -> str | None:
    """Why the region cannot be captured exactly here, as one line naming the fix; None when it can."""
    device = torch.device(device)
    if device.type != "cuda" and not fake:
        return f"{KEY} captures CUDA kernels; this run is on {device.type}: set train.cuda_graphs=false"
    if world > 1:
        return (f"{KEY} runs on one process: DDP's all-reduce hooks fire inside the backward the graph would "
                f"capture; set train.cuda_graphs=false for {world} ranks")
    if accum > 1:
        return (f"{KEY} captures one micro-batch per iteration (the backward writes fresh gradients); "
                f"train.accum_steps={accum}: set train.accum_steps=1 or train.cuda_graphs=false")
    if recipe is not None and not getattr(recipe, "graphable", True):
        return (f"{KEY}: precision={recipe.name} keeps host-side state per forward (scales, amax records) "
                f"that a replay would not update; set train.cuda_graphs=false")
    for o in observers:
        if not getattr(o, "graph_safe", False):
            return (f"{KEY}: observer {type(o).__name__} hooks the forward/backward a replay would skip "
                    f"(numerics.every / numerics.sqnr_every); turn it off or set train.cuda_graphs=false")
    if task is not None:
        name = type(task).__qualname__
        if not getattr(task, "graphable", False):
            return (f"{KEY}: task {name} does not declare a static step (Task.graphable: fixed shapes, no host "
                    f"syncs, no data-dependent control flow); set train.cuda_graphs=false")
        if task.own_step:
            return (f"{KEY}: task {name} writes its own train_step; only the default body's forward/backward "
                    f"is captured. Set train.cuda_graphs=false")
    return None


def check(**kw) -> None:
    why = refusal(**kw)
    if why:
        raise UserError(why)


def autocast_cache_off(device_type: str):
    """Inside the recipe's autocast: the same autocast with its weight-cast cache off (see the module
    docstring); nothing where autocast is off."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False)
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------
# backends: what captures and replays


class CudaGraph:
    """torch.cuda.CUDAGraph: warm-up on a side stream, capture, replay."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.graph: torch.cuda.CUDAGraph | None = None

    def warmup(self, fn: Callable, n: int) -> None:
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(n):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(s)

    def capture(self, fn: Callable):
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the DataLoader's pin-memory thread keeps calling CUDA while the capture runs;
        # the default (global) mode would fail its calls.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            return fn()

    def replay(self) -> None:
        self.graph.replay()

    def rng_state(self):
        return torch.cuda.get_rng_state(self.device)

    def set_rng_state(self, state) -> None:
        torch.cuda.set_rng_state(state, self.device)


class EagerGraph:
    """A stand-in for CudaGraph on the CPU (tests): capture runs the region once, as a capture would
    record it; replay runs it again and writes its results into the tensors the capture returned, as
    a graph's kernels write into the memory they were captured with."""

    def __init__(self, device="cpu"):
        self.fn: Callable | None = None
        self.out = None

    def warmup(self, fn: Callable, n: int) -> None:
        for _ in range(n):
            fn()

    def capture(self, fn: Callable):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        new = self.fn()
        with torch.no_grad():
            for static, fresh in zip(pytree.tree_leaves(self.out), pytree.tree_leaves(new)):
                if isinstance(static, torch.Tensor):
                    static.copy_(fresh)

    def rng_state(self):
        return torch.get_rng_state()

    def set_rng_state(self, state) -> None:
        torch.set_rng_state(state)


# ------------------------------------------------------------------------------------------------
# the runner


def signature(batch):
    """What a graph is specialised to in a batch: its structure, each tensor's shape, strides, dtype
    and device, every other leaf's value; None where a leaf cannot be compared (run eagerly)."""
    leaves, spec = pytree.tree_flatten(batch)
    sig = []
    for v in leaves:
        if isinstance(v, torch.Tensor):
            sig.append((tuple(v.shape), v.stride(), v.dtype, v.device))
        elif isinstance(v, (int, float, str, bool, type(None))):
            sig.append(v)
        else:
            return None
    return spec, tuple(sig)


class GraphRunner:
    """The region region(batch) -> (loss, items) of one TrainStep, eager at the first call, then
    captured and replayed while its key holds (see the module docstring)."""

    def __init__(self, model: nn.Module, recipe, backend: Callable = CudaGraph, device="cuda", warmup: int = 2):
        self.model, self.recipe = model, recipe
        self.new_backend, self.device, self.warmup = backend, torch.device(device), warmup
        self.graph = None
        self.key = None
        self.static_batch = None
        self.loss: torch.Tensor | None = None
        self.items = None
        self.grads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its gradient in the graph)
        self.captures = 0  # graphs captured (a new key captures again)
        self.replays = 0
        self.eager_calls = 0

    def reset(self) -> None:
        """Forget the graph (a checkpoint was loaded: weights written outside the recipe's step)."""
        self.graph = self.key = self.static_batch = self.loss = None
        self.grads = []

    def __call__(self, region: Callable, batch) -> tuple[torch.Tensor, object]:
        sig = signature(batch)
        if sig is None or self.eager_calls == 0 or (self.key is not None and sig != self.key[0]):
            # a batch of other shapes (a short last batch) than the graph's: eager, the graph kept
            self.eager_calls += 1
            return region(batch)
        key = (sig, self.model.training, self.recipe.graph_key())
        if key != self.key:
            self._capture(region, batch, key)
        with torch.no_grad():
            for static, new in zip(pytree.tree_leaves(self.static_batch), pytree.tree_leaves(batch)):
                if isinstance(static, torch.Tensor):
                    static.copy_(new)
        self.graph.replay()
        for p, g in self.grads:
            p.grad = g
        self.replays += 1
        return self.loss, self.items

    def _capture(self, region: Callable, batch, key) -> None:
        self.reset()
        params = list(self.model.parameters())
        if any(p.grad is not None for p in params):
            raise RuntimeError("cuda_graphs: gradients must be freed (zero_grad) before the capture")
        self.static_batch = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, batch)
        buffers = list(self.model.buffers())
        with torch.no_grad():
            saved = [b.clone() for b in buffers]
        backend = self.new_backend(self.device)
        rng = backend.rng_state()

        def run():
            loss, items = region(self.static_batch)
            return loss, items, [p.grad for p in params]

        def warm():
            run()
            self.recipe.zero_grad()

        backend.warmup(warm, self.warmup)
        loss, items, grads = backend.capture(run)
        # What warm-up and capture changed, put back: the first replay starts where eager would.
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                b.copy_(s)
        backend.set_rng_state(rng)
        self.graph, self.key, self.loss, self.items = backend, key, loss, items
        self.grads = [(p, g) for p, g in zip(params, grads) if g is not None]
        for p, _ in self.grads:
            p.grad = None  # the replay below gives them back
        self.captures += 1
