"""Engine overhead: the engine's training iteration (what mpt.engine.Run.loop does each iteration: the
train step through the precision recipe, then the loop's on-device divergence and logging counters) versus a hand-written
torch.amp loop, same model, same device-resident batch, one process, rotating blocks so drift in
machine load hits every loop alike, and a second hand-written loop
as a control that shows the machine's noise floor. `python -m experiments.speed_memory`
runs it as its engine-overhead row; alone:

    python -m experiments.speed_memory.engine_overhead [model=resnet50_preact] [width=0.0625]
        [batch=32] [size=80] [precisions=fp32,mixed] [rounds=7] [steps=10] [device=auto] [clock=wall]

clock=cpu (CPU device, one thread) times each block by this thread's CPU time instead of the wall
clock: on a machine shared with other processes, the time the process waits for a core is then left
out of both loops alike (cache contention is not).

launches=alexnet,googlenet prints, instead, what a step launches: per (precision, impl) cell of
`cells`, the aten ops one training step (bench.py's step: TrainStep through the recipe) dispatches,
counted with torch.profiler, and its median time. A small-batch GPU step is bound by these launches
and the Python between them, not by arithmetic; the counts do not depend on width or input size:

    python -m experiments.speed_memory.engine_overhead launches=alexnet,googlenet
        [cells=fp32,mixed:autocast,fp16_storage:paper] [batch=32] [width=0.0625] [size=80] [steps=10]
        [device=auto] [reference_rounds=0]

reference_rounds=N also builds each cell on the slow paths that give the same bits (the optimizers'
per-parameter loop, FP16 weights cast to FP32 at each use) and times both in N alternating rounds:
the launches saved and their time, measured in one process.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch

from experiments.speed_memory.bench import WORKLOADS, build_cell, sync, time_steps
from mpt import config, precisions
from mpt import engine
from mpt.config_parse import parse_options
from mpt.optim import build_optimizer
from mpt.ranks import pick_device
from mpt.errors import UserError, cli
from mpt.step import TrainStep
from mpt.task import Task

# Precisions the hand-written loop covers: torch.amp's documented recipe, autocast + GradScaler.
HAND_DTYPES = {"fp32": None, "fp16": torch.float16, "mixed": torch.float16, "bf16": torch.bfloat16}


class _EngineTask(Task):
    """The workload's task for engine.Run. Its dataset only gives the engine a length: batches are
    handed to train_step already on the device, so neither loop loads or copies data."""

    def __init__(self, inner, n):
        super().__init__(inner.cfg)
        self.inner, self.n = inner, n
        self.primary_metric, self.higher_is_better = "none", True

    def datasets(self):
        return range(self.n), range(self.n)

    def build_model(self):
        return self.inner.build_model()

    def loss(self, model, batch):
        return self.inner.loss(model, batch)


def measure(model: str, precision: str, *, width: float, batch: int, size: int | None, rounds: int, steps: int,
            device: str = "auto", channels_last: bool = False, clock: str = "wall") -> dict:
    """Median ms/step of the engine, a hand-written loop and a second hand-written loop (the
    control) over `rounds` rotating blocks of `steps` steps."""
    if precision not in HAND_DTYPES:
        raise UserError(f"engine overhead: precision {precision!r} has no hand-written torch.amp loop; "
                        f"choose from: {', '.join(HAND_DTYPES)}")
    if model not in WORKLOADS:
        raise UserError(f"engine overhead: model {model!r} has no workload; choose from: {', '.join(WORKLOADS)}")
    if rounds < 1 or steps < 1:
        raise UserError("engine overhead needs rounds >= 1 and steps >= 1")
    wl = WORKLOADS[model]
    size = size or wl.default_size
    dev = pick_device(device)
    if clock not in ("wall", "cpu"):
        raise UserError(f"clock={clock!r}: choose wall or cpu")
    if clock == "cpu" and (dev.type != "cpu" or torch.get_num_threads() != 1):
        raise UserError("clock=cpu times one CPU thread: use it with device=cpu and OMP_NUM_THREADS=1")
    with tempfile.TemporaryDirectory(prefix="engine_overhead_") as tmp:
        cfg = config.resolve(wl.experiment, [
            f"model={model}", f"precision={precision}", "impl=autocast", f"width={width}",
            f"train.batch_size={batch}", "train.num_workers=0", "train.progress=false", "wandb.mode=disabled",
            f"device={dev}", f"out_dir={tmp}", f"channels_last={str(channels_last).lower()}",
            # The hand loop's constant rate: both models then see the same updates (the engine still
            # steps its schedule every iteration). Each "epoch" here is one batch, so the experiment's
            # own schedule would cut the engine's rate tenfold every 30 steps.
            "sched.name=constant", "sched.warmup_epochs=0"])
        torch.manual_seed(0)
        task = _EngineTask(wl.make_task(cfg), batch)
        run = engine.Run(cfg, task)
        run.setup()  # the engine's settings: cudnn.benchmark on, TF32 off
        xb = wl.make_batch(batch, size, run.device, channels_last, torch.Generator().manual_seed(0))

        hand_step = _hand_loop(task, cfg, precision, run.device, xb, channels_last)
        # A second, identical hand-written loop: the control. Its difference from the first is the
        # noise floor of this machine; an engine overhead below it cannot be resolved.
        control_step = _hand_loop(task, cfg, precision, run.device, xb, channels_last)

        def engine_step():  # what Run.loop does each iteration: the step, its logs into the window
            logs, items = run.train([xb])
            run.window.add(logs, items, run.step)

        def block(fn):
            if clock == "cpu":
                t = time.thread_time()
                for _ in range(steps):
                    fn()
                return (time.thread_time() - t) / steps
            _, wall = time_steps(fn, steps, run.device)
            return wall / steps

        loops = [hand_step, engine_step, control_step]
        # Warm-up: cudnn.benchmark's search, the allocator, the loss-scale back-off, and the engine's
        # one-off activation measurement (its first step only).
        for fn in loops:
            block(fn)
        times: dict = {fn: [] for fn in loops}
        for r in range(rounds):  # rotate the order so drift in machine load hits every loop alike
            for fn in loops[r % 3:] + loops[:r % 3]:
                times[fn].append(block(fn))
        run.record.wandb.finish(0)
        run = None  # frees the run (not `del`: the closures above read this name)
        sync(dev)
    hand, eng, ctl = times[hand_step], times[engine_step], times[control_step]
    # Paired within each round (adjacent blocks), then the median over rounds: robust to load that
    # drifts between rounds and to a round hit by a burst.
    per_round = [b / a for a, b in zip(hand, eng)]
    ctl_round = [b / a for a, b in zip(hand, ctl)]
    return {"model": model, "precision": precision, "impl": "autocast", "batch": batch, "size": size, "width": width,
            "rounds": rounds, "steps": steps, "device": str(dev), "clock": clock, "hand_ms": 1e3 * statistics.median(hand),
            "engine_ms": 1e3 * statistics.median(eng), "control_ms": 1e3 * statistics.median(ctl),
            "overhead_pct": 100 * (statistics.median(per_round) - 1),
            "control_pct": 100 * (statistics.median(ctl_round) - 1),
            "ratio_min": min(per_round), "ratio_max": max(per_round)}


def _hand_loop(task, cfg, precision, device, xb, channels_last):
    """torch.amp's documented recipe written out (autocast + GradScaler), with the engine's optimizer.
    Nothing in it reads a device value: a per-step loss.item() would stall a GPU's queue every step,
    and the engine reads its losses only at log steps."""
    torch.manual_seed(0)
    ref = task.build_model().to(device)
    if channels_last:
        ref = ref.to(memory_format=torch.channels_last)
    opt = build_optimizer(cfg.optim, ref.parameters())
    dtype = HAND_DTYPES[precision]
    sc = cfg.scaler
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "mixed", init_scale=sc.init_scale,
                                  growth_factor=sc.growth_factor, backoff_factor=sc.backoff_factor,
                                  growth_interval=sc.growth_interval)

    def hand_step():
        with torch.autocast(device.type, dtype=dtype or torch.float16, enabled=dtype is not None):
            loss, _ = task.loss(ref, xb)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return hand_step


# ------------------------------------------------------------------------------------------------
# launches per step

# aten ops that launch no kernel on a GPU: views, metadata, allocations.
_NO_KERNEL = frozenset("aten::" + n for n in (
    "empty", "empty_strided", "empty_like", "view", "_reshape_alias", "reshape", "as_strided", "detach", "t",
    "transpose", "permute", "expand", "narrow", "slice", "select", "squeeze", "unsqueeze", "flatten", "alias",
    "lift_fresh", "resolve_conj", "resolve_neg", "_unsafe_view", "split", "split_with_sizes", "chunk",
    "unbind", "result_type", "contiguous", "view_as", "expand_as"))


def _phase(e) -> str:
    """Where a profiler event ran: inside optimizer.step, in autograd's backward, or elsewhere
    (forward, the loss, the recipe's unscale/check/copies)."""
    while e is not None:
        if e.name.startswith("Optimizer.step"):
            return "optimizer"
        if e.name.startswith("autograd::engine::evaluate_function"):
            return "backward"
        e = e.cpu_parent
    return "forward_recipe"


def count_launches(events, device: torch.device) -> dict:
    """Per-profile counts: `aten_all` every aten op; `aten_top` the aten ops called from Python or by
    autograd's backward nodes (no aten op above them: one dispatch each); `launches` those of them that
    are not views or allocations -- what a GPU runs as one kernel or a few (a foreach op: one
    multi-tensor kernel per chunk of tensors), split by phase. A GPU run also counts its CUDA kernels,
    copies and fills."""
    from torch.autograd import DeviceType

    def top(e):
        q = e.cpu_parent
        while q is not None:
            if q.name.startswith("aten::"):
                return False
            q = q.cpu_parent
        return True

    aten = [e for e in events if e.name.startswith("aten::")]
    tops = [e for e in aten if top(e)]
    work = [e for e in tops if e.name not in _NO_KERNEL]
    out = {"aten_all": len(aten), "aten_top": len(tops), "launches": len(work)}
    for ph in ("forward_recipe", "backward", "optimizer"):
        out[f"launches_{ph}"] = sum(1 for e in work if _phase(e) == ph)
    if device.type == "cuda":
        out["cuda_kernels"] = sum(1 for e in events if e.device_type == DeviceType.CUDA)
    return out


def _slow_paths(opt, recipe) -> None:
    """The reference a step's launches are compared to: the optimizer's per-parameter loop (what torch
    runs on a CPU unless foreach is asked for) and, in the paper recipes, every FP16 weight cast to
    FP32 at each use (half_math.FP32Copies(keep=False)). The same bits, more launches."""
    for g in opt.param_groups:
        g["foreach"] = False
    if hasattr(recipe, "fp32_copies"):
        recipe.fp32_copies.keep = False


def launches(model: str, precision: str, impl: str | None, *, width: float, batch: int, size: int, steps: int,
             device: str = "auto", rounds: int = 0) -> dict:
    """Aten ops (and, on a GPU, CUDA kernels) per training step of one cell, from a profile of `steps`
    steps after 3 warm-up steps, and the median step time of `steps` unprofiled steps (on a CPU, this
    thread's CPU time: run with OMP_NUM_THREADS=1). rounds > 0: the same for the reference (_slow_paths,
    keys ref_*), both timed in `rounds` alternating blocks of `steps` steps; `speedup` is the median
    over rounds of reference time / time."""
    from torch.profiler import ProfilerActivity, profile

    dev = pick_device(device)
    wl = WORKLOADS[model]
    o = {"width": width, "batch": batch, "channels_last": False, "cudnn_benchmark": True, "fused": False,
         "half_math": "auto"}
    variants = {"": build_cell(wl, model, precision, impl, size, o, dev)}
    if rounds:
        variants["ref_"] = build_cell(wl, model, precision, impl, size, o, dev)
        _slow_paths(variants["ref_"][2], variants["ref_"][3])
    out = {"model": model, "precision": precision, "impl": impl, "batch": batch, "width": width, "size": size,
           "device": str(dev), "half_math": variants[""][3].half_math}
    runs = {}
    for key, (task, net, opt, recipe, xb) in variants.items():
        step = TrainStep(task.loss, net, {"main": opt}, recipe, device=dev, measure_first=False)
        runs[key] = lambda step=step, xb=xb: step([xb])
        for _ in range(3):  # cudnn.benchmark's search, lazy state (momentum buffers, master gradients)
            runs[key]()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        sync(dev)
        with profile(activities=acts) as prof:
            for _ in range(steps):
                runs[key]()
            sync(dev)
        out.update({key + k: v / steps for k, v in count_launches(prof.events(), dev).items()})

    def block(fn) -> list[float]:
        if dev.type == "cpu":  # this thread's CPU time: waiting for a core shared with other jobs is left out
            times = []
            for _ in range(steps):
                t = time.thread_time()
                fn()
                times.append(1e3 * (time.thread_time() - t))
            return times
        return time_steps(fn, steps, dev)[0]

    times = {key: [] for key in runs}
    per_round = []
    for r in range(max(rounds, 1)):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]  # alternate which goes first
        got = {key: statistics.median(block(runs[key])) for key in order}
        for key, t in got.items():
            times[key].append(t)
        if rounds:
            per_round.append(got["ref_"] / got[""])
    for key, ts in times.items():
        out[key + "step_ms"] = statistics.median(ts)
    if rounds:
        out["speedup"] = statistics.median(per_round)
        out["speedup_min"], out["speedup_max"] = min(per_round), max(per_round)
    return out


def _cells(spec: str) -> list[tuple[str, str | None]]:
    out = []
    for c in [c.strip() for c in spec.split(",") if c.strip()]:
        prec, _, impl = c.partition(":")
        if prec not in precisions.BY_NAME:
            raise UserError(f"cells: unknown precision {prec!r} in {c!r}; choose from: {', '.join(precisions.BY_NAME)}")
        if impl not in ("", "autocast", "paper"):
            raise UserError(f"cells: impl {impl!r} in {c!r}: write precision or precision:autocast|paper")
        out.append((prec, impl or None))
    if not out:
        raise UserError("cells= is empty: name at least one precision[:impl], e.g. cells=fp32,mixed:autocast")
    return out


def print_launches(o: dict) -> None:
    names = [m.strip() for m in o["launches"].split(",") if m.strip()]
    for m in names:
        if m not in WORKLOADS:
            raise UserError(f"launches: model {m!r} has no workload; choose from: {', '.join(WORKLOADS)}")
    cells = _cells(o["cells"])
    ref = o["reference_rounds"]
    print(f"launches per training step: batch {o['batch']}, width {o['width']}, {o['size']}px, profile of "
          f"{o['steps']} steps, torch {torch.__version__}, {torch.get_num_threads()} threads"
          + (f"; against the reference (per-parameter optimizer loop, weights cast at each use), "
             f"{ref} alternating rounds of {o['steps']} steps" if ref else ""))
    cols = ["model", "precision", "impl", "aten ops (all)", "aten ops (top level)", "launch-like",
            "fwd+recipe / bwd / optimizer", "CUDA kernels", "ms/step"]
    if ref:
        cols[3:] = ["aten ops (top level), reference -> now", "launch-like, reference -> now",
                    "fwd+recipe / bwd / optimizer, reference -> now", "CUDA kernels, reference -> now",
                    "ms/step, reference -> now", "speedup (rounds' range)"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for m in names:
        for prec, impl in cells:
            r = launches(m, prec, impl, width=o["width"], batch=o["batch"], size=o["size"], steps=o["steps"],
                         device=o["device"], rounds=ref)

            def f(k, p=""):
                return f"{r[p + k]:.0f}" if p + k in r else "-"

            def phases(p=""):
                return " / ".join(f(f"launches_{ph}", p) for ph in ("forward_recipe", "backward", "optimizer"))

            head = f"| {m} | {prec} | {impl or '-'} | "
            if ref:
                print(head + f"{f('aten_top', 'ref_')} -> {f('aten_top')} | {f('launches', 'ref_')} -> {f('launches')} | "
                      f"{phases('ref_')} -> {phases()} | {f('cuda_kernels', 'ref_')} -> {f('cuda_kernels')} | "
                      f"{r['ref_step_ms']:.2f} -> {r['step_ms']:.2f} | {r['speedup']:.2f}x "
                      f"({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) |", flush=True)
            else:
                print(head + f"{f('aten_all')} | {f('aten_top')} | {f('launches')} | {phases()} | {f('cuda_kernels')} | "
                      f"{r['step_ms']:.2f} |", flush=True)


DEFAULTS = {"model": "resnet50_preact", "width": 0.0625, "batch": 32, "size": 80, "precisions": "fp32,mixed",
            "rounds": 7, "steps": 10, "device": "auto", "channels_last": False, "clock": "wall",
            "launches": "", "cells": "fp32,mixed:autocast,fp16_storage:paper", "reference_rounds": 0}


@cli
def main(argv=None):
    o = parse_options(sys.argv[1:] if argv is None else argv, DEFAULTS, "experiments.speed_memory.engine_overhead")
    torch.manual_seed(0)
    if o["launches"]:
        print_launches(o)
        return
    print(f"engine vs hand-written torch.amp loop: {o['model']} width {o['width']}, batch {o['batch']}, "
          f"{o['size']}px, {o['rounds']} rotating rounds of {o['steps']} steps, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {o['clock']} clock")
    for prec in [p.strip() for p in o["precisions"].split(",") if p.strip()]:
        r = measure(o["model"], prec, width=o["width"], batch=o["batch"], size=o["size"], rounds=o["rounds"],
                    steps=o["steps"], device=o["device"], channels_last=o["channels_last"], clock=o["clock"])
        print(f"{prec:6s} {r['device']:6s} hand {r['hand_ms']:8.2f} ms/step   engine {r['engine_ms']:8.2f} ms/step   "
              f"overhead {r['overhead_pct']:+5.1f}%   (per-round ratio {r['ratio_min']:.3f}..{r['ratio_max']:.3f}; "
              f"control hand vs hand {r['control_pct']:+5.1f}%)")


if __name__ == "__main__":
    main()
