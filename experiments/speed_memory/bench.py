"""Measure one training step of one model in one precision: step time, throughput, peak GPU memory,
activation memory and the bytes of weights, gradients and optimizer state (paper section 3:
"roughly halved" memory; FP16 math 2-8x FP32).

The step is the engine's step without the engine around it: the same task loss, optimizer and
precision recipe (mpt.precision), called in the engine's order (autocast forward, backward, step,
update, zero_grad). The engine's own cost is measured separately (engine_overhead.py). Inputs are
synthetic tensors made once on the device, so data loading is out of every figure.

A model is measurable when it has a Workload: which experiment's config (optimizer, loss) it trains
with, what one synthetic batch looks like and what the throughput counts (images, utterances,
tokens). Adding a model family = one entry in WORKLOADS.
"""
from __future__ import annotations

import gc
import math
import os
import re
import shutil
import statistics
import subprocess
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

import models
from mpt import config
from mpt import precision as recipes
from mpt import precisions
from mpt import torch_private as TP
from mpt.optim import build_optimizer
from mpt.step import Observer, TrainStep
from mpt.errors import UserError
from mpt.memory import ActivationMeter
from mpt.rundir import cpu_model, env_info

# The precisions whose speed and memory section 3 speaks of, and the baselines beside them ("tf32" is
# FP32 storage with the TF32 Tensor Core switches on; every other row runs with both switches off).
# Those beyond the paper are left out: fp8 is simulated, so its speed would not be FP8's.
PRECISIONS = tuple(p.name for p in precisions.TABLE if not p.beyond_paper)
DATA_NOTE = ("synthetic data: one random batch made on the device before timing, reused every step "
             "(data loading and host-to-device copies are out of every figure)")


# ------------------------------------------------------------------------------------------------
# workloads: what a model trains on, synthetically


@dataclass(frozen=True)
class Workload:
    experiment: str  # whose config.yaml gives the optimizer and loss (experiments/<name>)
    unit: str  # what throughput counts: images | utterances | tokens
    default_size: int  # input size at which the paper trained the model
    make_task: Callable[[Any], Any]  # cfg -> the experiment's Task(cfg, facts) with the paper data's facts
    make_batch: Callable[[int, int, torch.device, bool, torch.Generator], Any]  # (n, size, device, channels_last, gen)


def _imagenet_task(cfg):
    from experiments.ilsvrc_cnns.task import Task

    return Task(cfg, Task.Facts(num_classes=1000))  # ILSVRC12's; a training run reads its classes.json


def _imagenet_batch(n, size, device, channels_last, gen):
    x = torch.randn(n, 3, size, size, generator=gen).to(device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 1000, (n,), generator=gen).to(device)


def _speech_task(model: str):
    """DeepSpeech 2 (Table 3) as Task.datasets() would set it up from prepared data: the output
    characters (English's alphabet; AISHELL-1's ~4.2K characters, sized as models.deepspeech2 sizes
    the full model); the window (20 ms in the paper profile: 161 frequency bins) comes from the config."""
    def make(cfg):
        from experiments.deepspeech2.task import ENGLISH, Task
        from models.deepspeech2 import MANDARIN_VOCAB

        chars = ENGLISH if model == "english" else "\u4e00" * (MANDARIN_VOCAB - 1)  # only its length is used
        return Task(cfg, Task.Facts(chars=chars))
    return make


def _speech_batch(vocab: int):
    """`size` spectrogram frames (10 ms each) per utterance, all of one length, and random targets of
    size/8 characters (read speech runs at ~15 characters per second; CTC needs at most size/2, the
    frames left after the stride-2 convolution)."""
    def make(n, frames, device, channels_last, gen):
        from models.deepspeech2 import N_FREQ

        k = max(1, frames // 8)
        return {"x": torch.randn(n, N_FREQ, frames, generator=gen).to(device),
                "lengths": torch.full((n,), frames, device=device),
                "targets": torch.randint(1, vocab, (n * k,), generator=gen).to(device),
                "target_lengths": torch.full((n,), k, device=device), "texts": [""] * n}
    return make


def _workloads() -> dict[str, Workload]:
    from models.deepspeech2 import ENGLISH_VOCAB, MANDARIN_VOCAB
    from models.imagenet_cnns import INPUT_SIZE

    w = {name: Workload("ilsvrc_cnns", "images", size, _imagenet_task, _imagenet_batch)
         for name, size in INPUT_SIZE.items()}
    # Speech: `size` is frames; 1,000 = 10 s of audio, about the mean LibriSpeech training utterance (12 s).
    for name, vocab in (("english", ENGLISH_VOCAB), ("mandarin", MANDARIN_VOCAB)):
        w[name] = Workload("deepspeech2", "utterances", 1000, _speech_task(name), _speech_batch(vocab))
    return w


WORKLOADS = _workloads()
# The paper's models that have a benchmark workload (Tables 1 and 3; the other tables' models join
# here when they are added to WORKLOADS).
PAPER_MODELS = ("alexnet", "vgg16", "googlenet", "inception_v2", "inception_v3", "resnet50_preact",
                "english", "mandarin")


def resolve_models(spec: str) -> tuple[list[str], dict[str, str]]:
    """models=all|a,b -> (names to measure, {registry name without a workload: why skipped})."""
    registry = models.names()
    no_workload = {n: "no speed/memory workload (add one to experiments/speed_memory/bench.py WORKLOADS)"
                   for n in registry if n not in WORKLOADS}
    if spec.strip() == "all":
        return [n for n in registry if n in WORKLOADS], no_workload
    chosen = [m.strip() for m in spec.split(",") if m.strip()]
    for m in chosen:
        if m not in registry:
            raise UserError(f"unknown model {m!r}; choose from: {', '.join(registry)} (or models=all)")
        if m not in WORKLOADS:
            raise UserError(f"model {m!r} has no speed/memory workload yet; add one to "
                            f"experiments/speed_memory/bench.py WORKLOADS")
    if not chosen:
        raise UserError("models= is empty; name at least one model or use models=all")
    return chosen, {}


def resolve_list(spec: str, valid: tuple[str, ...], key: str) -> list[str]:
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise UserError(f"{key}= is empty; choose from: {', '.join(valid)}")
    for s in items:
        if s not in valid:
            raise UserError(f"unknown {key[:-1]} {s!r} in {key}=; choose from: {', '.join(valid)}")
    return list(dict.fromkeys(items))


def cells(names: list[str], impls: list[str]) -> list[tuple[str, str | None]]:
    """(precision, impl) pairs to measure: each impl that runs the precision (precisions.Precision.impls).
    FP32 and TF32 have no impl (one FP32 recipe); fp16_pure and fp16_storage have no FP32 weights for
    autocast to cast from, so they are measured once, the paper's way."""
    out = []
    for p in names:
        runs = precisions.BY_NAME[p].impls
        if len(runs) < 2:
            out.append((p, runs[0] if runs else None))
        else:
            out += [(p, i) for i in impls]
    return out


# ------------------------------------------------------------------------------------------------
# memory accounting


def storage_bytes(tensors, exclude: set[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind `tensors` (views and aliases counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st.data_ptr() not in exclude:
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def state_bytes(model: torch.nn.Module, recipe: recipes.Recipe, optimizer: torch.optim.Optimizer) -> dict:
    """Weights, FP32 master copies, gradients and optimizer state, measured after an optimizer
    step and before zero_grad (when model and master gradients both exist: paper impl, 3.1)."""
    params = list(model.parameters())
    pkeys = {p.untyped_storage().data_ptr() for p in params}
    masters = recipe.master_params()
    opt_state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "param_bytes": storage_bytes(params),
        "buffer_bytes": storage_bytes(model.buffers()),
        "master_bytes": storage_bytes(masters, exclude=pkeys),  # 0 where the parameters are the master
        "grad_bytes": storage_bytes([p.grad for p in params] + [m.grad for m in masters]),
        "optimizer_state_bytes": storage_bytes(opt_state),
    }


# ------------------------------------------------------------------------------------------------
# timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def time_steps(fn: Callable[[], Any], steps: int, device: torch.device) -> tuple[list[float], float]:
    """Per-step times (ms) and the wall time (s) of `steps` calls. On a GPU each step is bracketed
    by CUDA events on the stream (no extra synchronisation between steps), and the whole block by
    synchronize() so the wall time covers every kernel."""
    if device.type == "cuda":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        sync(device)
        t0 = time.perf_counter()
        for a, b in ev:
            a.record()
            fn()
            b.record()
        sync(device)
        wall = time.perf_counter() - t0
        return [a.elapsed_time(b) for a, b in ev], wall
    times = []
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t))
    return times, time.perf_counter() - t0


def step_stats(times_ms: list[float]) -> dict:
    return {"median": statistics.median(times_ms), "p10": percentile(times_ms, 0.1),
            "p90": percentile(times_ms, 0.9), "min": min(times_ms), "max": max(times_ms), "n": len(times_ms)}


# Kernel names of convolutions and matrix products (cuDNN, cuBLAS, CUTLASS); the rest (element-wise,
# normalisation, reductions, copies) is mostly memory-bandwidth bound.
_MATMUL_KERNEL = re.compile(r"gemm|conv|xmma|cutlass|wgrad|dgrad|fprop|nvjet|hmma|s16816|s1688|implicit|winograd|fft", re.I)


def busy_union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def kernel_profile(fn: Callable[[], Any], steps: int, device: torch.device) -> dict:
    """What limits a GPU step, from the CUDA kernel timeline of `steps` profiled steps:
    gpu_busy = time with a kernel running / span of the timeline (below ~0.85 the GPU waits on the
    host: Python, kernel launches, synchronisations); matmul_conv = share of kernel time in
    convolution/matmul kernels (the rest is mostly memory-bandwidth bound). Approximate: the
    profiler itself slows launches a little."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    # On the CPU (tests only: a CPU-only build has no CUDA activity) CPU ops stand in for kernels.
    activity, kind = ((ProfilerActivity.CUDA, DeviceType.CUDA) if device.type == "cuda"
                      else (ProfilerActivity.CPU, DeviceType.CPU))
    sync(device)
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    kern = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == kind and e.time_range.end > e.time_range.start]
    return summarize_kernels(kern)


def summarize_kernels(kern: list[tuple[str, float, float]]) -> dict:
    if not kern:
        return {"gpu_busy_fraction": None, "matmul_conv_kernel_fraction": None}
    span = max(e for _, _, e in kern) - min(s for _, s, _ in kern)
    total = sum(e - s for _, s, e in kern)
    mm = sum(e - s for n, s, e in kern if _MATMUL_KERNEL.search(n))
    by_name: dict[str, float] = {}
    for n, s, e in kern:
        by_name[n] = by_name.get(n, 0.0) + (e - s)
    # The kernels that take the time, by name: which algorithms cuDNN/cuBLAS chose (a TF32 or an FP32
    # convolution, an NHWC or an NCHW one, layout transposes).
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return {"gpu_busy_fraction": busy_union([(s, e) for _, s, e in kern]) / span if span > 0 else None,
            "matmul_conv_kernel_fraction": mm / total if total > 0 else None,
            "top_kernels": [{"name": n[:160], "share": round(t / total, 4)} for n, t in top] if total > 0 else []}


def limit_text(row: dict, device: torch.device) -> str:
    if device.type != "cuda":
        return "CPU run (times say nothing about GPUs)"
    busy, mm = row.get("gpu_busy_fraction"), row.get("matmul_conv_kernel_fraction")
    if busy is None:
        return "not profiled"
    if busy < 0.85:
        return f"host-bound: GPU idle {1 - busy:.0%} of the step (Python, kernel launches, synchronisations)"
    if mm is not None and mm < 0.5:
        return (f"GPU-bound, mostly memory-bandwidth-bound kernels (element-wise/normalisation "
                f"{1 - mm:.0%} of kernel time)")
    return f"GPU-bound, mostly compute (conv/matmul {mm:.0%} of kernel time)"


# ------------------------------------------------------------------------------------------------
# one measurement


def make_optimizer(ocfg, params: list, fused: bool) -> torch.optim.Optimizer:
    opt = build_optimizer(ocfg, params)
    if fused:
        try:  # the engine's optimizer with its own settings, as the single fused kernel
            opt = type(opt)(params, **{**opt.defaults, "fused": True, "foreach": None})
        except (RuntimeError, TypeError, ValueError) as e:
            raise UserError(f"fused=true: {type(opt).__name__} has no fused implementation here ({e}); "
                            f"use fused=false") from None
    return opt


def half_maths(precision: str, setting: str) -> list[str]:
    """The half_math settings a cell is measured with: both -> emulated and native for every cell whose
    math is FP16/BF16 (fp16_storage is FP32 math by definition, tf32/fp32 have none)."""
    if setting != "both":
        return [setting]
    return ["emulated", "native"] if precisions.BY_NAME[precision].half_compute else ["auto"]


def config_for(wl: Workload, model: str, precision: str, impl: str | None, o: dict, device) -> config.Config:
    row = precisions.BY_NAME[precision]
    return config.resolve(wl.experiment, [
        f"model={model}", f"precision={row.run_as}",
        f"half_math={o.get('half_math', 'auto')}",
        f"impl={impl or 'autocast'}", f"tf32={'true' if row.tf32 else 'false'}",
        f"width={o['width']}", f"train.batch_size={o['batch']}", f"channels_last={str(o['channels_last']).lower()}",
        f"device={device}", "wandb.mode=disabled", f"fmt.compile={'true' if o.get('fmt_compile') else 'false'}"])


def skip_reason(precision: str, device: torch.device) -> str | None:
    row = precisions.BY_NAME[precision]
    if row.tf32:
        if device.type != "cuda":
            return "TF32 is a GPU mode (Ampere or newer); no GPU here"
        if torch.cuda.get_device_capability(device)[0] < 8:
            return f"TF32 needs Ampere or newer; {torch.cuda.get_device_name(device)} has none"
    if row.storage == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return f"BF16 needs Ampere or newer; {torch.cuda.get_device_name(device)} has none"
    return None


def measure(model_name: str, precision: str, impl: str | None, o: dict, device: torch.device) -> dict:
    """One row: every figure of one (model, precision, impl) at the options `o`."""
    wl = WORKLOADS[model_name]
    size = wl.default_size if o["size"] == "auto" else int(o["size"])
    row = {"model": model_name, "precision": precision, "impl": impl, "status": "ok", "note": None,
           "batch": o["batch"], "size": size, "width": o["width"], "unit": wl.unit,
           "channels_last": bool(o["channels_last"]), "cuda_graphs": bool(o.get("cuda_graphs"))}
    reason = skip_reason(precision, device)
    if reason is None and row["cuda_graphs"] and device.type != "cuda":
        reason = "CUDA graphs are a GPU mode (train.cuda_graphs); no GPU here"
    if reason:
        row.update(status="skipped", note=reason)
        return row
    try:
        row.update(_measure(wl, model_name, precision, impl, size, o, device))
    except _Refused as e:
        row.update(status="skipped", note=str(e))
    except torch.cuda.OutOfMemoryError as e:
        row.update(status="oom", note=str(e).splitlines()[0][:300])
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 -- one failing cell must not lose the others' figures
        # The traceback too: a failure on a GPU session nobody watched must be diagnosable from the file.
        row.update(status="failed", note=failure_note(e), traceback=traceback.format_exc())
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if o.get("compile"):
        TP.reset_compiled()
    return row


def failure_note(e: BaseException) -> str:
    """A failed cell's note: the error's type and the first line of its message (at most 300 characters)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


class _Refused(Exception):
    """A cell this option cannot run (cuda_graphs=true for a task without a static step): a skipped row."""


class _StateProbe(Observer):
    """The bytes of weights, gradients and optimizer state between the optimizer step and zero_grad,
    when `on`."""

    def __init__(self, net, recipe):
        self.net, self.recipe, self.on, self.state = net, recipe, False, None

    def after_update(self, step, name, opt, applied):
        self.state = state_bytes(self.net, self.recipe, opt) if self.on else None


def build_cell(wl: Workload, model_name, precision, impl, size, o, device):
    """One cell's training pieces, as the engine builds them: (task, model prepared by the recipe,
    optimizer, recipe, one synthetic batch on the device). Sets the engine's math flags."""
    cfg = config_for(wl, model_name, precision, impl, o, device)
    # The engine's settings (mpt/engine.py setup): TF32 only where asked; cudnn.benchmark picks the
    # fastest convolution algorithms for these shapes during the warm-up.
    recipes.set_backend_flags(cfg.tf32)
    torch.backends.cudnn.benchmark = o["cudnn_benchmark"]
    torch.manual_seed(0)
    task = wl.make_task(cfg)
    net = task.build_model().to(device)
    if o["channels_last"]:
        net = net.to(memory_format=torch.channels_last)
    opt = make_optimizer(cfg.optim, list(net.parameters()), o["fused"])
    recipe = recipes.build(cfg, device)
    net = recipe.prepare(net, [opt])
    batch = wl.make_batch(o["batch"], size, device, o["channels_last"], torch.Generator().manual_seed(0))
    return task, net, opt, recipe, batch


def graphs_exactness(model_name: str, precision: str, impl: str | None, o: dict, device: torch.device,
                     steps: int = 6, backend=None) -> dict:
    """Whether `steps` iterations replayed from CUDA graphs (train.cuda_graphs) give eager's losses and
    weights bit for bit: the same cell built three times from the same seed, trained on the same
    synthetic batch under the same random state -- eager twice, then graphed. The two eager runs are the
    baseline: where they differ already (cuDNN's nondeterministic kernels), a graphed difference says
    nothing about the graphs. backend: mpt.graphs.EagerGraph on a CPU (tests)."""
    wl = WORKLOADS[model_name]
    size = wl.default_size if o["size"] == "auto" else int(o["size"])
    runs = []
    for graphed in (False, False, True):
        task, net, opt, recipe, batch = build_cell(wl, model_name, precision, impl, size, o, device)
        step = TrainStep(task.loss, net, {"main": opt}, recipe, device=device,
                         channels_last=o["channels_last"], cuda_graphs=graphed, graph_backend=backend if graphed else None)
        torch.manual_seed(1)  # dropout's stream, the same for all three
        losses = [step([batch])[0]["loss"] for _ in range(steps)]
        runs.append((torch.stack(losses).cpu(), [p.detach().clone() for p in net.parameters()], step))
    (le, pe, _), (le2, pe2, _), (lg, pg, sg) = runs

    def max_diff(a, b):
        return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))

    diff, base = max_diff(pe, pg), max_diff(pe, pe2)
    return {"model": model_name, "precision": precision, "impl": impl, "steps": steps, "batch": o["batch"],
            "channels_last": bool(o["channels_last"]), "losses_equal": bool(torch.equal(le, lg)),
            "weights_equal": diff == 0.0, "max_weight_diff": diff,
            "eager_repeat_losses_equal": bool(torch.equal(le, le2)), "eager_repeat_max_weight_diff": base,
            "replays": sg.graphs.replays, "captures": sg.graphs.captures}


def _measure(wl: Workload, model_name, precision, impl, size, o, device) -> dict:
    task, net, opt, recipe, batch = build_cell(wl, model_name, precision, impl, size, o, device)
    graphed = bool(o.get("cuda_graphs"))
    if graphed:
        from mpt import graphs

        why = graphs.refusal(device=device, recipe=recipe, task=task)
        if why:
            raise _Refused(why)
    half_math = recipe.half_math  # what computed the FP16/BF16 dot products (emulated | native | device | none)
    run = torch.compile(net) if o["compile"] else net
    probe = _StateProbe(net, recipe)
    # The engine's iteration (mpt.step.TrainStep) on the timed model, and on the eager one for memory
    # (torch.compile saves other tensors): one optimizer, no schedule, no clipping.
    kw = dict(device=device, channels_last=o["channels_last"], measure_first=False)
    # cuda_graphs: the timed step's first warm-up iteration runs eagerly, the second captures (mpt.graphs)
    timed = TrainStep(task.loss, net, {"main": opt}, recipe, ddp=run, cuda_graphs=graphed, **kw)
    eager = TrainStep(task.loss, net, {"main": opt}, recipe, observers=(probe,), **kw)
    items = 0

    def train_step(step: TrainStep, meter: ActivationMeter | None = None) -> tuple[bool, dict | None]:
        """One iteration. With a meter: activation memory as the engine measures it, and the bytes of
        weights, gradients and optimizer state between the optimizer step and zero_grad."""
        nonlocal items
        probe.on = meter is not None
        _, items = step([batch], meter=meter)
        return step.applied["main"], probe.state

    out = dict(step_ms=None, throughput=None, peak_gpu_mem_bytes=None, peak_gpu_reserved_bytes=None,
               gpu_busy_fraction=None, matmul_conv_kernel_fraction=None)
    for _ in range(o["warmup"]):  # cudnn.benchmark's search, torch.compile, allocator, loss-scale back-off
        train_step(timed)
    skipped0 = recipe.skipped_steps
    if o["steps"] > 0:
        if device.type == "cuda":
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
        times, wall = time_steps(lambda: train_step(timed), o["steps"], device)
        out["step_ms"] = step_stats(times)
        out["throughput"] = items * o["steps"] / wall
        if device.type == "cuda":
            out["peak_gpu_mem_bytes"] = torch.cuda.max_memory_allocated(device)
            out["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    # Overflow skips inside the timed steps (a skipped step has no optimizer update: a little faster).
    out["skipped_steps_timed"] = recipe.skipped_steps - skipped0
    if device.type == "cuda" and o["kernels"] and o["steps"] > 0:
        try:
            out.update(kernel_profile(lambda: train_step(timed), 3, device))
        except Exception as e:  # noqa: BLE001 -- a profiler failure (e.g. no CUPTI) loses only this diagnosis
            out["note"] = f"kernel profile failed: {type(e).__name__}: {str(e)[:200]}"

    # Memory, in eager mode (torch.compile saves other tensors): one measured step, repeated until
    # an update is applied, since optimizer state only exists after one (the dynamic loss scale
    # starts at 2^16 and may skip the first steps, section 3.2).
    meter = ActivationMeter(net)
    applied, state = train_step(eager, meter)
    out.update(meter.breakdown())
    for _ in range(50):
        if applied:
            break
        applied, state = train_step(eager, ActivationMeter(net))
    out.update(state)
    if not applied:
        out["optimizer_state_bytes"] = None
        out["note"] = "every measured step overflowed: optimizer-state bytes are missing"
    out["items_per_step"] = items
    out["half_math"] = half_math
    out["loss_scale"] = recipe.loss_scale
    out["limit"] = limit_text(out, device)
    return out


# ------------------------------------------------------------------------------------------------
# environment


def _driver_version() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def _load_avg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def environment(device: torch.device) -> dict:
    e = env_info(device)
    # TF32 is set per row (on only for precision=tf32), not once per run.
    e["tf32_matmul"] = e["tf32_cudnn"] = "per row: on only where precision=tf32"
    e["fp16_reduced_precision_reduction"] = e["bf16_reduced_precision_reduction"] = "per row: off (FP32 sums)"
    e["threads"] = torch.get_num_threads()
    # Other processes on the machine slow CPU-side work (and a GPU step's launches): recorded at the
    # start and, by the command, at the end of the run.
    e["load_avg_1min_start"] = _load_avg()
    e["cpu"] = cpu_model()
    e["driver"] = None
    e["gpu"] = None
    if device.type == "cuda":
        e["cuda"] = torch.version.cuda
        e["driver"] = _driver_version()
        p = torch.cuda.get_device_properties(device)
        e["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "sm_count": p.multi_processor_count,
                    "total_memory_bytes": p.total_memory}
    return e


def device_slug(env: dict) -> str:
    """The results files' device part: the GPU's name as the loader benchmark slugs a CPU's, or "cpu"."""
    from experiments.speed_memory.loader import slug

    return slug(env["gpu"]["name"]) if env.get("gpu") else "cpu"


# The benchmark sets the math flags per row; this leaves them as they were (the one list: mpt.precision).
restored_backend_flags = recipes.restored_backend_flags
