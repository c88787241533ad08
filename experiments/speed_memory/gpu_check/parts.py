"""The first GPU call in one command: what a GPU tells us that the CPU cannot, in one call of at
most 6 minutes on one H100 or H200 (a time-limited GPU job: the machine's start and a rerun must fit beside it),
into one results file.

    python -m experiments.gpu_check [--out DIR] [--parts a,b] [--budget 360]
    python -m experiments.gpu_check --cpu-smoke [--out DIR]      # the same steps, tiny, on the CPU

--out defaults to $OUT when that variable is set (a remote runner that returns only that folder), else
experiments/speed_memory/results.

Parts, most valuable first (each in its own process, with its own time limit; a failure is recorded
and the others run):
  headline   ResNet-50 (pre-activation) at batch 256: strict FP32, TF32, mixed (autocast), mixed
             (impl=paper), channels_last then NCHW: images/s, step time, peak memory, GPU-busy
             fraction, the speed_memory goals
  e2e        ResNet-50 mixed (autocast, NHWC) trained by the engine from JPEG files it writes first
             (mate-backgrounds photographs at ImageNet's sizes), the machine's cores as loader workers,
             JPEGs decoded on the CPU and on the GPU: images/s and ratio_to_synthetic (the headline's)
  ssd_e2e    SSD300 mixed trained end to end from VOC-format JPEG files (images/s at batch 32)
  resume     a tiny run on the GPU stopped after a few steps (checkpoint), restarted: the engine's
             resume must load its checkpoint there and finish
  ds2_worst  DeepSpeech 2 at its worst paper batch: the longest utterances, paper batch per GPU: does it fit?
  cifar      the CIFAR-10 real recipe (ResNet-8, ../shared/data's development subset, 32 epochs) on the
             tensor cores in fp32, fp16, mixed and bf16 over 3 seeds: top-1 beside the CPU emulation's
  models     every Table 1 and Table 3 model (6 ILSVRC CNNs, DeepSpeech 2 English and Mandarin) for a
             few steps in fp32, mixed and fp16_storage at the paper grid's batch per GPU, as time allows;
             AlexNet and GoogLeNet also with CUDA graphs (train.cuda_graphs: fp32, mixed autocast,
             fp16_storage paper) beside their eager rows, 20 timed steps each
  ddp        a 2-rank DDP run (torchrun) when two GPUs are visible; skipped at no cost otherwise (the
             CPU smoke runs it with 2 gloo ranks, so the path is exercised)

Writes <out>/<device>-<date>-gpu_check.json (cpu-<date>-gpu_check-smoke.json for --cpu-smoke), atomically,
while every part runs (its finished rows every few seconds) and after it: a part killed at its limit,
a SIGINT/SIGTERM, even a SIGKILL of the whole call keeps what was finished. Prints a summary table.
Exit status 1 if any part failed, 2 on bad command-line input, 130 when interrupted.
Imports nothing beyond torch, torchvision, numpy and yaml (a GPU image may lack wandb, submitit, soundfile).
Every measurement is the repository's own code: the speed/memory benchmark's step
(experiments/speed_memory/bench.py, i.e. mpt.step.TrainStep) and the engine's run/resume/DDP paths.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from mpt.errors import UserError, cli, one_line

SCHEMA = "gpu_check/1"
PARTS = ("headline", "e2e", "ssd_e2e", "resume", "ds2_worst", "cifar", "models", "ddp")
RESULTS_DIR = "experiments/speed_memory/results"
# The whole call's default limit, the environment probe included: 6 minutes. A 15-minute GPU job
# spends 1-2 on the machine's start; 6 here leaves room for a second call that reruns what failed.
DEFAULT_CALL_S = 360
PROBE_S = 60  # importing torch and reading the device: ~10-20 s with CUDA's first initialisation
# Each part's limit on one H100/H200, in seconds (its process is killed past it; what it finished is
# kept). Measured on an H200 (results/nvidia-h200-2026-11-27-gpu_check-call*.json): headline 124 s (8
# rows; the first 65 s, cuDNN's search for FP32 NHWC algorithms), resume 24 s, ds2_worst 101 s (English
# 68 s, Mandarin 22 s; 80 s cut it), 13 of the 24 models cells in 96 s. An H100 has the same SMs at lower
# memory bandwidth: ~10-20% more. models gets what is left of the call (its first cells); ddp needs 2 GPUs.
# 2026-11-28 (results/nvidia-h200-2026-11-28-gpu_check-call*.json): the headline's first 5 rows took 127 s
# and 150 s cut its last 3; e2e 59 s (its photographs written in ~10 s), ssd_e2e 63 s, cifar 147 s (12 runs,
# four at a time). A first call of the default parts gets through headline, e2e and ssd_e2e in ~330 s; a
# second call runs --parts resume,ds2_worst,cifar,models.
GPU_BUDGET_S = {"headline": 200, "e2e": 120, "ssd_e2e": 100, "resume": 45, "ds2_worst": 120, "cifar": 180,
                "models": 120, "ddp": 60}
# The CPU smoke's limits: generous (a loaded 2-core machine), they only catch a hang.
SMOKE_BUDGET_S = {"headline": 120, "e2e": 150, "ssd_e2e": 150, "cifar": 240, "models": 180, "ds2_worst": 120,
                  "resume": 120, "ddp": 180}
SMOKE_CALL_S = PROBE_S + sum(SMOKE_BUDGET_S.values())
RN = "resnet50_preact"
TABLE1 = ("alexnet", "vgg16", "googlenet", "inception_v2", "inception_v3", RN)
TABLE3 = ("english", "mandarin")
# The models part's launch-bound models at the paper grid's 32 per GPU, measured again with CUDA graphs
GRAPHED = ("alexnet", "googlenet")
# DeepSpeech 2's worst batch: the longest training utterances. English: LibriSpeech cuts its training
# audio into segments of at most 35 s (Panayotov et al. 2015, section 3); Mandarin: AISHELL-1's files
# run from about 1 to 14 s (LDC2018S14 catalogue entry), 15 s taken to be safe. 100 spectrogram
# frames a second (10 ms hop, experiments/deepspeech2/task.py), so 3,500 and 1,500 frames.
DS2_LONGEST_S = {"english": 35.0, "mandarin": 15.0}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each part runs at: the paper's sizes on a GPU, tiny ones for the CPU smoke."""
    headline_width: float = 1.0
    headline_batch: int = 256
    headline_size: str = "auto"  # ResNet-50's own 224 px
    headline_steps: int = 20
    headline_warmup: int = 5
    kernels: bool = True  # the CUDA kernel-timeline profile (GPU-busy fraction)
    width: float = 1.0  # models and ds2_worst
    batch: int | None = None  # None: the paper grid's batch per GPU
    image_size: str = "auto"  # each CNN's own (224; Inception v3 299; AlexNet 227)
    speech_frames: int = 1000  # 10 s, about LibriSpeech's mean training utterance (bench.py)
    steps: int = 3
    warmup: int = 2  # >= 2 for the CUDA-graph rows: the first warm-up step runs eagerly, the second captures
    graphed_steps: int = 20  # the GRAPHED models' rows, eager and graphed: ~10-50 ms steps, a steadier median
    worst_frames_scale: float = 1.0  # x DS2_LONGEST_S x 100 frames/s
    worst_steps: int = 1  # the question is whether it fits: one timed step (a 35 s batch may take seconds)
    worst_warmup: int = 1
    tiny_batch: int = 16  # resume and ddp: the ILSVRC tiny profile on generated tiny data
    tiny_steps: int = 6
    stop_after: int = 3
    e2e_train_per_class: int = 700  # x 12 photographs: 8,400 training images, 32 batches of 256 an epoch
    e2e_val_per_class: int = 10
    e2e_crop: int = 224
    e2e_resize: int = 256
    e2e_steps: int = 80
    e2e_log_every: int = 5
    e2e_skip_windows: int = 4  # the first 20 steps: cuDNN's search, the workers' first batches
    ssd_image: int = 500  # VOC's images are ~500x375
    ssd_images: int = 960  # <= 1,000: data_prep.voc holds a larger VOC2007 list to the official count
    ssd_batch: int = 32  # the paper grid's per GPU (SSD's Caffe solver)
    ssd_steps: int = 60
    cifar_seeds: tuple = (0, 1, 2)
    cifar_epochs: int = 32  # the real profile's
    cifar_at_once: int = 4  # runs sharing the device (launch-bound: ~45 s a run on an H200, four at a time)
    cifar_threads: int = 2
    cifar_sizes: dict = dataclasses.field(default_factory=lambda: {"train_per_class": 500, "test_per_class": 200})


GPU = Sizes()
# 1/32 width, a few images of 80 px (Inception v3's smallest workable input at this width), 64
# spectrogram frames (the worst case at 1/25 of its length), one timed step: every code path of the GPU
# run on a CPU core. FP16 recurrent layers are slow on a CPU (the DS2 cells dominate the smoke's time).
SMOKE = Sizes(headline_width=0.03125, headline_batch=4, headline_size="64", headline_steps=2, headline_warmup=1,
              kernels=False, width=0.03125, batch=2, image_size="80", speech_frames=64, steps=1, warmup=1, graphed_steps=1,
              worst_frames_scale=0.04, worst_steps=1, worst_warmup=1, tiny_batch=8, tiny_steps=4, stop_after=2,
              e2e_train_per_class=2, e2e_val_per_class=1, e2e_crop=64, e2e_resize=72, e2e_steps=4, e2e_log_every=1,
              e2e_skip_windows=1, ssd_image=96, ssd_images=8, ssd_batch=2, ssd_steps=2, cifar_seeds=(0,), cifar_epochs=1,
              cifar_at_once=1, cifar_threads=1,
              cifar_sizes={"train_per_class": 8, "test_per_class": 4})


# ------------------------------------------------------------------------------------------------
# parts (each runs in its own process: see run_part)


class Ctx:
    def __init__(self, smoke: bool, work: Path, emit, models: tuple = TABLE1 + TABLE3, graphed: tuple = GRAPHED,
                 e2e_workers: tuple = ("auto",)):
        import torch

        self.smoke, self.work, self.emit = smoke, work, emit
        self.models, self.graphed = models, graphed  # the models part's cells (--models, --graphed)
        self.e2e_workers = e2e_workers  # the e2e part's loader workers, a run each (--e2e-workers)
        self.sizes = SMOKE if smoke else GPU
        self.device = torch.device("cpu") if smoke else torch.device("cuda", 0)
        if not smoke and not torch.cuda.is_available():
            raise UserError("no CUDA GPU is visible to this process; run on a GPU machine or use --cpu-smoke")


def _bench_options(ctx: Ctx, **kw) -> dict:
    """The speed/memory benchmark's options (experiments.speed_memory.DEFAULTS) for one part."""
    from experiments.speed_memory import DEFAULTS

    return {**DEFAULTS, "device": str(ctx.device), "overhead": "none", **kw}


def _measure(model: str, precision: str, impl: str | None, o: dict, ctx: Ctx) -> dict:
    from experiments.speed_memory import bench

    t0 = time.time()
    with bench.restored_backend_flags():
        row = bench.measure(model, precision, impl, o, ctx.device)
    row["seconds"] = round(time.time() - t0, 1)
    print(f"{model:16s} {precision:12s} {impl or '-':8s} {'NHWC' if o['channels_last'] else 'NCHW'} {row['status']:7s} "
          f"{_ms(row):>10s} {_mib(row):>12s}"
          f"  ({row['seconds']:.0f} s){'  ' + row['note'] if row.get('note') else ''}", file=sys.stderr, flush=True)
    return row


def part_headline(ctx: Ctx) -> dict:
    """ResNet-50 at batch 256 in strict FP32, TF32 and mixed (both impls): the speed/memory headline."""
    from experiments.speed_memory import bench, report

    s = ctx.sizes
    o = _bench_options(ctx, models=RN, batch=s.headline_batch, size=s.headline_size, width=s.headline_width,
                       steps=s.headline_steps, warmup=s.headline_warmup, kernels=s.kernels)
    out = {"options": o, "rows": [], "gpu_busy_fraction_is": (
        "over 3 extra profiled steps (torch.profiler, CUDA activity): time with at least one kernel running / "
        "span from the first kernel's start to the last kernel's end; below ~0.85 the GPU waits on the host")}
    # channels_last first: NHWC is what the tensor cores' convolutions read (the CNNs' default on CUDA),
    # so the best figures come first; NCHW after, the layout the paper's frameworks used.
    env = bench.environment(ctx.device)
    out["goals"] = []
    for cl in (True, False):
        for prec, impl in (("fp32", None), ("tf32", None), ("mixed", "autocast"), ("mixed", "paper")):
            out["rows"].append(_measure(RN, prec, impl, {**o, "channels_last": cl}, ctx))
            report.add_ratios(out["rows"])
            ctx.emit(out)
        rows = [r for r in out["rows"] if r["channels_last"] == cl]
        res = {"rows": rows, "env": env, "options": o, "paper_models": [RN], "engine_overhead": []}
        fmt = "channels_last" if cl else "nchw"
        out["goals"] += [{**g, "id": f"{g['id']}_{fmt}"} for g in report.goals(res) if g["id"].startswith("resnet50_")]
        ctx.emit(out)
    bad = [r for r in out["rows"] if r["status"] not in ("ok", "skipped")]
    if bad:
        out["status"] = "failed"
        out["error"] = "; ".join(f"{_cell(r)}: {r['status']} {r.get('note') or ''}".strip() for r in bad)
    return out


def paper_batches() -> dict[str, dict]:
    """Each paper model's batch per GPU and mixed-precision impl, from its experiment's paper grids
    (slurm/grid.py: the resolved config's global batch / the profile's GPUs). An experiment may split its
    models over several grid files (ILSVRC: grid.yaml on 8 GPUs, grid_batch32.yaml on one); grid.yaml
    comes first, the others fill in the models it lacks."""
    from slurm import grid

    out = {}
    for exp in ("ilsvrc_cnns", "deepspeech2"):
        folder = Path(__file__).parent / exp
        files = [folder / "grid.yaml"] + sorted(p for p in folder.glob("grid*.yaml") if p.name != "grid.yaml")
        for path in files:
            if "paper" not in (grid.load_spec(path).get("profiles") or {}):
                continue
            g = grid.load(path, "paper")
            for c in sorted(g.cells, key=lambda c: c.cfg.precision != "mixed"):  # the mixed cell's impl first
                if c.cfg.model in out:
                    continue
                b = c.cfg.train.batch_size
                out[c.cfg.model] = {"global_batch": b, "gpus": g.resources.world, "per_gpu": b // g.resources.world,
                                    "mixed_impl": c.cfg.impl, "experiment": exp, "grid": path.name}
    missing = [m for m in TABLE1 + TABLE3 if m not in out]
    if missing:
        raise UserError(f"no paper grid of experiments/{{ilsvrc_cnns,deepspeech2}} runs {', '.join(missing)}")
    return out


def part_models(ctx: Ctx) -> dict:
    """Every Table 1 and Table 3 model, a few steps in fp32, mixed (the impl its paper grid runs) and
    fp16_storage (the paper's speech recipe) at the paper grid's batch per GPU. The launch-bound ones
    (GRAPHED) again with their forward/backward replayed from CUDA graphs (cuda_graphs=true,
    mpt.graphs), beside their eager rows; on a CPU those rows are skipped with a note."""
    from experiments.speed_memory import report
    from mpt.precision import HALF_COMPUTE

    s = ctx.sizes
    pb = paper_batches()
    out = {"paper_batch": pb, "rows": []}
    for m in ctx.models:
        b = s.batch or pb[m]["per_gpu"]
        size = str(s.speech_frames) if m in TABLE3 else s.image_size
        o = _bench_options(ctx, models=m, batch=b, size=size, width=s.width, warmup=s.warmup, kernels=False,
                           steps=s.graphed_steps if m in ctx.graphed else s.steps)
        cells = [(p, i, False) for p, i in (("fp32", None), ("mixed", pb[m]["mixed_impl"]), ("fp16_storage", "paper"))]
        if m in ctx.graphed:
            cells += [(p, i, True) for p, i in (("fp32", None), ("mixed", "autocast"), ("fp16_storage", "paper"))]
        for prec, impl, graphed in cells:
            # The layout a run of this cell gets by default (channels_last=auto, precision.channels_last_pays)
            cl = m in TABLE1 and ctx.device.type == "cuda" and prec in HALF_COMPUTE
            out["rows"].append(_measure(m, prec, impl, {**o, "channels_last": cl, "cuda_graphs": graphed}, ctx))
            report.add_ratios(out["rows"])
            ctx.emit(out)
        if m in ctx.graphed and ctx.device.type == "cuda":
            out.setdefault("graphs_exact", []).extend(_graphs_exact(m, o, ctx))
            ctx.emit(out)
    bad = [r for r in out["rows"] if r["status"] not in ("ok", "skipped")]
    if bad:
        out["status"] = "failed"
        out["error"] = f"{len(bad)} of {len(out['rows'])} cells not ok: " + "; ".join(
            f"{_cell(r)} {r['status']}" for r in bad)
    return out


def _graphs_exact(m: str, o: dict, ctx: Ctx) -> list[dict]:
    """CUDA graphs against eager, bit for bit (bench.graphs_exactness), in each graphed cell's layout."""
    from experiments.speed_memory import bench
    from mpt.precision import HALF_COMPUTE

    rows = []
    for prec, impl in (("fp32", None), ("mixed", "autocast"), ("fp16_storage", "paper")):
        try:
            with bench.restored_backend_flags():
                rows.append(bench.graphs_exactness(m, prec, impl, {**o, "channels_last": prec in HALF_COMPUTE}, ctx.device))
        except Exception as e:  # noqa: BLE001 -- recorded, the speed rows stand
            rows.append({"model": m, "precision": prec, "impl": impl, "error": f"{type(e).__name__}: {str(e)[:300]}",
                         "traceback": traceback.format_exc()})
        print(f"graphs exact {m} {prec}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def part_ds2_worst(ctx: Ctx) -> dict:
    """DeepSpeech 2 at the paper batch per GPU with every utterance as long as the longest of its
    training set: the batch that sets the memory a run needs. A cell that runs out of memory is an
    answer ("does not fit"), not a failure of this check."""
    import torch

    s = ctx.sizes
    pb = paper_batches()
    total = torch.cuda.get_device_properties(ctx.device).total_memory if ctx.device.type == "cuda" else None
    out = {"longest_s": DS2_LONGEST_S, "device_memory_bytes": total, "rows": []}
    for m in TABLE3:
        frames = max(32, round(DS2_LONGEST_S[m] * 100 * s.worst_frames_scale)) + 1  # + the frame at t = 0
        o = _bench_options(ctx, models=m, batch=s.batch or pb[m]["per_gpu"], size=str(frames), width=s.width,
                           steps=s.worst_steps, warmup=s.worst_warmup, kernels=False)
        for prec, impl in (("fp32", None), ("mixed", pb[m]["mixed_impl"]), ("fp16_storage", "paper")):
            r = _measure(m, prec, impl, o, ctx)
            r["fits"] = {"ok": True, "oom": False}.get(r["status"])
            if total and r.get("peak_gpu_reserved_bytes"):
                r["reserved_of_device"] = r["peak_gpu_reserved_bytes"] / total
            out["rows"].append(r)
            ctx.emit(out)
    out["fits"] = all(r["fits"] for r in out["rows"])
    bad = [r for r in out["rows"] if r["fits"] is None]
    if bad:
        out["status"] = "failed"
        out["error"] = "; ".join(f"{_cell(r)}: {r['status']} {r.get('note') or ''}".strip() for r in bad)
    return out


def tiny_data(work: Path) -> Path:
    """A tiny ILSVRC (4 classes, 64 training images) through the real generator and the real prep,
    made once per gpu_check invocation and shared by the parts that train."""
    from data_prep.imagenet import prepare
    from data_prep.imagenet.tiny import generate

    out = work / "tiny_imagenet"
    if not (out / "prepared.json").exists():
        arch = work / "tiny_archives"
        generate(arch, classes=4, train_per_class=16, val_per_class=4, size=40)
        prepare.prepare(arch, out, workers=1, log=lambda *a: None)
    return out


def _tiny_overrides(ctx: Ctx, out_dir: Path, device: str, batch: int) -> list[str]:
    """The ILSVRC tiny profile, ResNet-50 in mixed precision with the paper's FP32 master copy (what a
    checkpoint and a DDP broadcast must carry besides the model), on the tiny data. Dynamic loss scaling
    from 2^7, not 2^16: from 2^16 every one of these few steps overflowed and was skipped (measured on the
    CPU), so the checkpoint would hold no optimizer state and no update would have been applied."""
    return ["profile=tiny", f"model={RN}", "precision=mixed", "impl=paper", "scaler.init_scale=128",
            f"task.data_root={tiny_data(ctx.work)}", f"out_dir={out_dir}", f"device={device}", f"train.batch_size={batch}",
            f"train.max_steps={ctx.sizes.tiny_steps}", "train.progress=false", "wandb.mode=disabled"]


def part_resume(ctx: Ctx) -> dict:
    """The engine's own resume path on the device: a run stopped after a few steps (as a stop signal
    stops it: checkpoint at the step boundary, status "interrupted"), then the same command again,
    which must load that checkpoint (model, FP32 masters, optimizer, scaler, RNG) and finish."""
    from experiments.ilsvrc_cnns.task import Task
    from mpt import config
    from mpt import engine

    s = ctx.sizes

    class Counting(Task):
        """The ILSVRC task, counting its training steps; asks the loop to stop after `stop_at`."""

        def __init__(self, cfg, stop_at: int | None):
            super().__init__(cfg)
            self.stop_at, self.steps, self.model = stop_at, 0, None

        def build_model(self):
            self.model = super().build_model()
            return self.model

        def loss(self, model, batch):
            self.steps += 1
            if self.steps == self.stop_at:
                engine.STOP.request("gpu_check: stop after a few steps")
            return super().loss(model, batch)

    cfg = config.resolve("ilsvrc_cnns", _tiny_overrides(ctx, ctx.work / "resume_runs", str(ctx.device), s.tiny_batch))
    first_task = Counting(cfg, s.stop_after)
    try:
        first = engine.run(cfg, first_task)
    finally:
        engine.STOP.clear()
    out = {"run_dir": str(config.run_dir(cfg)), "first": _brief(first), "steps_first": first_task.steps}
    ctx.emit(out)
    if first["status"] != "interrupted" or first["step"] != s.stop_after:
        raise RuntimeError(f"the first run should stop at step {s.stop_after} with a checkpoint; it ended "
                           f"{first['status']} at step {first['step']} ({first.get('error')})")
    if first["skipped_steps"] >= first["step"]:
        raise RuntimeError(f"every step before the checkpoint overflowed ({first['skipped_steps']} skipped): "
                           f"it holds no optimizer state to resume")
    second_task = Counting(cfg, None)
    second = engine.run(cfg, second_task)
    dev = next(second_task.model.parameters()).device if second_task.model is not None else None
    out.update(second=_brief(second), steps_second=second_task.steps, model_device=str(dev))
    ctx.emit(out)
    if second["status"] != "completed" or second["step"] != s.tiny_steps:
        raise RuntimeError(f"the resumed run ended {second['status']} at step {second['step']} of {s.tiny_steps} "
                           f"({second.get('error')})")
    if second_task.steps != s.tiny_steps - s.stop_after:
        raise RuntimeError(f"the second run trained {second_task.steps} steps, not the {s.tiny_steps - s.stop_after} "
                           f"left after its checkpoint: it did not resume")
    if dev is None or dev.type != ctx.device.type:
        raise RuntimeError(f"the resumed model is on {dev}, not {ctx.device}")
    return out


def part_ddp(ctx: Ctx) -> dict:
    """Two DDP ranks through torchrun running the experiment command itself (the engine's DDP path:
    NCCL on GPUs, gloo for the CPU smoke), a few steps of the tiny profile in mixed precision."""
    from mpt import config

    # On CUDA each rank takes cuda:<local rank>; with fewer than 2 GPUs the parent skips this part from the
    # probe's GPU count, without starting it.
    device = "auto" if ctx.device.type == "cuda" else "cpu"
    ov = _tiny_overrides(ctx, ctx.work / "ddp_runs", device, 2 * ctx.sizes.tiny_batch)  # the same batch per rank
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "experiments.ilsvrc_cnns", *ov]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    cfg = config.resolve("ilsvrc_cnns", ov)
    d = config.run_dir(cfg)
    summ = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else None
    env = json.loads((d / "env.json").read_text()) if (d / "env.json").exists() else {}
    out = {"command": " ".join(cmd[1:]), "returncode": r.returncode, "summary": _brief(summ) if summ else None,
           "world_size": env.get("world_size"), "device_name": env.get("device_name")}
    if summ and summ["status"] == "completed" and summ["skipped_steps"] >= summ["step"]:
        out.update(status="failed", error=f"every step overflowed ({summ['skipped_steps']} skipped): no update was applied")
    if r.returncode != 0 or not summ or summ["status"] != "completed" or env.get("world_size") != 2:
        tail = (r.stdout + r.stderr).strip().splitlines()[-40:]
        out.update(status="failed", traceback="\n".join(tail),
                   error=f"torchrun exit {r.returncode}, run "
                         + (f"{summ['status']} at step {summ['step']}: {summ.get('error')}" if summ else "left no summary"))
    return out


# ------------------------------------------------------------------------------------------------
# end to end: training from JPEG files through the repository's own loaders


PHOTO_DIRS = ("data/mate-backgrounds", "/usr/share/backgrounds/mate/nature")  # repo copy first (a GPU image lacks the package)


def _photo_source() -> Path:
    from data_prep.imagenet.real_photos import missing

    root = Path(__file__).resolve().parents[1]
    for d in PHOTO_DIRS:
        p = root / d
        if not missing(p):
            return p
    raise UserError(f"the end-to-end parts cut real photographs from Debian's mate-backgrounds: none of "
                    f"{', '.join(PHOTO_DIRS)} holds its 12 nature photographs (apt-get install mate-backgrounds, "
                    f"or copy /usr/share/backgrounds/mate/nature to {PHOTO_DIRS[0]} before the call)")


def _photo_jpegs(job) -> list[bytes]:
    """One worker's share of ImageNet-sized photographs: (photo path, count, seed) -> JPEG bytes (quality
    90), a quarter at 1000x750 and the rest at 500x375 (ILSVRC's typical sizes), each a random 4:3 cut of
    the photograph (40-100% of its height), portrait for one in five."""
    import io as _io

    import numpy as np
    from PIL import Image

    path, n, seed = job
    rng = np.random.default_rng(seed)
    out = []
    with Image.open(path) as src:
        src = src.convert("RGB")
        W, H = src.size
        for _ in range(n):
            w, h = (1000, 750) if rng.random() < 0.25 else (500, 375)
            if rng.random() < 0.2:
                w, h = h, w
            ch = int(rng.uniform(0.4, 1.0) * min(H, W * h / w))
            cw = int(ch * w / h)
            x, y = int(rng.integers(0, W - cw + 1)), int(rng.integers(0, H - ch + 1))
            buf = _io.BytesIO()
            src.crop((x, y, x + cw, y + ch)).resize((w, h), Image.BILINEAR).save(buf, "JPEG", quality=90)
            out.append(buf.getvalue())
    return out


def photo_imagenet(work: Path, train_per_class: int, val_per_class: int, workers: int) -> tuple[Path, float]:
    """An ILSVRC2012 of real photographs at ImageNet's sizes (class k: mate-backgrounds photograph k),
    written as the official archives and prepared by data_prep.imagenet, with `workers` processes; made
    once per call. -> (prepared folder, seconds)."""
    import multiprocessing as mp

    import numpy as np

    from data_prep.imagenet import prepare
    from data_prep.imagenet.real_photos import NAMES
    from data_prep.imagenet.tiny import wnid, write_archives

    out = work / "photo_imagenet"
    if (out / "prepared.json").exists():
        return out, 0.0
    t0 = time.time()
    src = _photo_source()
    k = len(NAMES)
    per = train_per_class + val_per_class
    chunks = max(1, min(per, -(-per * k // (4 * workers))))  # ~4 jobs a worker
    jobs = [(str(src / f"{NAMES[c]}.jpg"), len(part), 1000 * c + j)
            for c in range(k) for j, part in enumerate(np.array_split(np.arange(per), chunks)) if len(part)]
    with mp.get_context("spawn").Pool(workers) as pool:
        done = pool.map(_photo_jpegs, jobs)
    per_class = [[] for _ in range(k)]
    for (path, _, seed), imgs in zip(jobs, done):
        per_class[seed // 1000].extend(imgs)
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(k), val_per_class)[rng.permutation(k * val_per_class)]
    val = {c: iter(per_class[c][train_per_class:]) for c in range(k)}
    arch = work / "photo_archives"
    write_archives(arch, [wnid(c) for c in range(k)], list(range(1, k + 1)), [f"photograph {n}" for n in NAMES],
                   [per_class[c][:train_per_class] for c in range(k)], [train_per_class] * k, labels,
                   (next(val[int(c)]) for c in labels), source="experiments.gpu_check")
    prepare.prepare(arch, out, workers=workers, log=lambda *a: None)
    shutil.rmtree(arch, ignore_errors=True)
    return out, round(time.time() - t0, 1)


def _failed_runs(out: dict, name) -> dict:
    """The part failed when any of its runs (out["rows"]) did not complete: each named by name(row)."""
    bad = [r for r in out["rows"] if r["status"] != "completed"]
    if bad:
        out["status"] = "failed"
        out["error"] = "; ".join(f"{name(r)}: {r['status']} {r.get('error') or ''}".rstrip() for r in bad)
    return out


def _timed_run_keys(ctx: Ctx, folder: str) -> list[str]:
    """The overrides every end-to-end run shares: log windows to time, no evaluation or checkpoint to
    speak of, no tracking, its own folder of the call's work, this device."""
    return [f"train.log_every={ctx.sizes.e2e_log_every}", "train.eval_every_epochs=1000", "train.eval_max_batches=1",
            "train.ckpt_every_minutes=0", "train.progress=false", "wandb.mode=disabled",
            f"out_dir={ctx.work / folder}", f"device={ctx.device}"]


def _engine_run(experiment: str, overrides: list[str], skip_windows: int) -> dict:
    """One ordinary run (mpt.cli.main) -> its brief summary plus the throughput of each log window
    (metrics.jsonl) and their median after the first `skip_windows` (cuDNN's search, the workers' start)."""
    from mpt import config
    from mpt.cli import main

    s = main(experiment, overrides)
    cfg = config.resolve(experiment, overrides)
    lines = [json.loads(x) for x in (config.run_dir(cfg) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    windows = [ln["throughput"] for ln in lines if ln.get("kind") == "train" and ln.get("throughput")]
    steady = windows[skip_windows:] or windows
    out = _brief(s)
    out.update(windows=[round(w, 1) for w in windows],
               throughput_steady=round(sorted(steady)[len(steady) // 2], 1) if steady else None)
    return out


def part_e2e(ctx: Ctx) -> dict:
    """ResNet-50 in mixed precision (autocast, channels_last: the headline's best row) trained from JPEG
    files through the repository's own loader and the engine: ImageNet-sized real photographs written on
    this machine, the machine's cores as loader workers, with the JPEGs decoded on the CPU (workers) and
    on the GPU (nvJPEG). Its images/s against the headline's synthetic ones: ratio_to_synthetic (the parent
    fills it in from the same call's headline)."""
    from mpt.ranks import loader_workers, usable_cpus

    s = ctx.sizes
    cores = usable_cpus()
    # auto: the paper profiles' train.num_workers=auto, the cores less one
    counts = [max(1, loader_workers("auto")) if w == "auto" else int(w) for w in ctx.e2e_workers]
    data, wrote_s = photo_imagenet(ctx.work, s.e2e_train_per_class, s.e2e_val_per_class, cores)
    out = {"cores": cores, "num_workers": counts[0], "data": {"train_images": 12 * s.e2e_train_per_class,
           "sizes": "3/4 at 500x375, 1/4 at 1000x750 (1 in 5 portrait), JPEG quality 90", "write_s": wrote_s,
           "source": "Debian mate-backgrounds nature photographs"}, "rows": []}
    ctx.emit(out)
    for workers, decode in [(w, d) for w in counts for d in ("cpu", "gpu")]:
        t0 = time.time()
        ov = [f"model={RN}", "precision=mixed", "impl=autocast", "channels_last=true", f"width={s.headline_width}",
              f"task.data_root={data}", "task.augment=torchvision", f"task.decode={decode}",
              f"task.crop={s.e2e_crop}", f"task.resize={s.e2e_resize}",
              f"train.batch_size={s.headline_batch}", f"train.max_steps={s.e2e_steps}", f"train.num_workers={workers}",
              *_timed_run_keys(ctx, f"e2e_runs_w{workers}")]  # a folder each: the run id leaves workers out
        row = {"model": RN, "precision": "mixed", "impl": "autocast", "channels_last": True, "decode": decode,
               "num_workers": workers, "batch": s.headline_batch, **_engine_run("ilsvrc_cnns", ov, s.e2e_skip_windows)}
        row["seconds"] = round(time.time() - t0, 1)
        print(f"e2e decode={decode} workers={workers}: {row['throughput_steady']} img/s steady, windows {row['windows']} "
              f"({row['seconds']:.0f} s)", file=sys.stderr, flush=True)
        out["rows"].append(row)
        ctx.emit(out)
    return _failed_runs(out, lambda r: f"decode={r['decode']} workers={r['num_workers']}")


def part_ssd_e2e(ctx: Ctx) -> dict:
    """SSD300 in mixed precision trained end to end from VOC-format JPEG files of real photographs at
    VOC's sizes (data_prep.voc.real_photos) with SSD's augmentation in the machine's cores."""
    from data_prep.voc import prepare as voc_prepare
    from data_prep.voc.real_photos import generate
    from mpt.ranks import loader_workers, usable_cpus

    s = ctx.sizes
    cores = usable_cpus()
    workers = max(1, loader_workers("auto"))
    t0 = time.time()
    arch, data = ctx.work / "voc_archives", ctx.work / "voc"
    generate(arch, photos=str(_photo_source()), size=s.ssd_image, trainval=s.ssd_images, test=8)
    voc_prepare.prepare(arch, data, log=lambda *a: None)
    out = {"cores": cores, "num_workers": workers, "data": {"images": s.ssd_images, "size": s.ssd_image,
           "write_s": round(time.time() - t0, 1), "source": "data_prep.voc.real_photos (mate-backgrounds)"}}
    ctx.emit(out)
    ov = ["model=ssd300_vgg16", "precision=mixed", "impl=autocast", "channels_last=true", f"width={s.width}",
          f"task.data_root={data}", "task.train_sets=[2007_trainval]", "task.backbone=scratch",
          f"train.batch_size={s.ssd_batch}", f"train.max_steps={s.ssd_steps}", f"train.num_workers={workers}",
          *_timed_run_keys(ctx, "ssd_runs")]
    t0 = time.time()
    out["row"] = {"model": "ssd300_vgg16", "precision": "mixed", "batch": s.ssd_batch,
                  **_engine_run("voc_detection", ov, s.e2e_skip_windows), "seconds": 0.0}
    out["row"]["seconds"] = round(time.time() - t0, 1)
    if out["row"]["status"] != "completed":
        out["status"], out["error"] = "failed", f"{out['row']['status']} {out['row']['error']}"
    return out


CIFAR_PRECISIONS = ("fp32", "fp16", "mixed", "bf16")


def part_cifar(ctx: Ctx) -> dict:
    """The CIFAR-10 `real` recipe (ResNet-8 on the development subset, 32 epochs) on the GPU's tensor
    cores in fp32, fp16 (S = 1), mixed and bf16, one process per run, the four precisions of a seed
    side by side: top-1 to set beside the CPU emulation's (experiments/ilsvrc_cnns/config.yaml)."""
    from data_prep.imagenet import cifar_dev, prepare
    from mpt import config

    s = ctx.sizes
    root = Path(__file__).resolve().parents[1]
    src = next((p for p in (root / "data/cifar10-dev.tar.gz", root.parent / "shared/data/cifar10-dev.tar.gz")
                if p.is_file()), None)
    if src is None:
        return {"status": "skipped", "note": "no cifar10-dev.tar.gz in data/ or ../shared/data/"}
    data = ctx.work / "cifar_dev"
    cifar_dev.generate(ctx.work / "cifar_archives", source=str(src), **s.cifar_sizes)
    prepare.prepare(ctx.work / "cifar_archives", data, workers=4, log=lambda *a: None)
    out = {"rows": [], "epochs": s.cifar_epochs}
    cells = [(seed, prec) for seed in s.cifar_seeds for prec in CIFAR_PRECISIONS]
    for k in range(0, len(cells), s.cifar_at_once):  # a seed's four precisions side by side on a GPU
        procs = []
        for seed, prec in cells[k:k + s.cifar_at_once]:
            ov = ["profile=real", "model=resnet8_cifar", f"precision={prec}", f"seed={seed}", f"task.data_root={data}",
                  f"out_dir={ctx.work / 'cifar_runs'}", f"device={ctx.device}", "wandb.mode=disabled",
                  "train.progress=false", f"train.epochs={s.cifar_epochs}", f"train.eval_every_epochs={s.cifar_epochs}"]
            with open(ctx.work / f"cifar_{prec}_{seed}.log", "w") as log:
                procs.append((seed, prec, ov, time.time(), subprocess.Popen(
                    [sys.executable, "-m", "experiments.ilsvrc_cnns", *ov], stdout=log, stderr=subprocess.STDOUT,
                    cwd=root, env={**os.environ, "OMP_NUM_THREADS": str(s.cifar_threads)})))
        for seed, prec, ov, t0, p in procs:
            rc = p.wait()
            summ = config.run_dir(config.resolve("ilsvrc_cnns", ov)) / "summary.json"
            s_ = json.loads(summ.read_text()) if summ.is_file() else {"status": f"exit {rc}"}
            row = {"precision": prec, "seed": seed, **_brief(s_), "seconds": round(time.time() - t0, 1)}
            out["rows"].append(row)
            print(f"cifar {prec} seed {seed}: {row['status']} top1 {(row.get('metrics') or {}).get('top1')} "
                  f"({row['seconds']:.0f} s)", file=sys.stderr, flush=True)
            ctx.emit(out)
    return _failed_runs(out, lambda r: f"{r['precision']} seed {r['seed']}")


def part_env(ctx: Ctx) -> dict:
    """The device and library versions (the parent process never touches CUDA: every part gets the
    whole GPU)."""
    from experiments.speed_memory import bench

    env = bench.environment(ctx.device)
    env["gpu_count"] = __import__("torch").cuda.device_count() if ctx.device.type == "cuda" else 0
    return {"env": env, "slug": bench.device_slug(env)}


PART_FNS = {"env": part_env, "headline": part_headline, "e2e": part_e2e, "ssd_e2e": part_ssd_e2e, "cifar": part_cifar,
            "models": part_models, "ds2_worst": part_ds2_worst, "resume": part_resume, "ddp": part_ddp}


def source_digest(root: Path | None = None) -> str:
    """sha256 of the repository's Python sources (path and bytes, sorted): names the code that ran where
    the copy on a remote machine carries no usable git state. `--source-digest` prints it here, to
    compare with a results file's."""
    import hashlib

    root = root or Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for d in ("mpt", "experiments", "models", "data_prep", "slurm", "paper_tables"):
        for f in sorted((root / d).rglob("*.py")):
            if "__pycache__" not in f.parts:
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _brief(s: dict) -> dict:
    return {k: s.get(k) for k in ("status", "step", "total_steps", "skipped_steps", "final_loss_scale", "metrics",
                                  "throughput", "peak_gpu_mem_bytes", "wall_time_s", "error")}


def _cell(r: dict) -> str:
    return f"{r['model']} {r['precision']}" + (f" ({r['impl']})" if r.get("impl") else "") \
        + (" graphs" if r.get("cuda_graphs") else "")


def _ms(r: dict) -> str:
    t = r.get("step_ms")
    return f"{t['median']:.1f} ms" if t else "-"


def _mib(r: dict) -> str:
    b = r.get("peak_gpu_mem_bytes")
    return f"{b / 2**20:,.0f} MiB" if b else "-"


def child_main(part: str, state: Path, smoke: bool, work: Path, selection: dict) -> int:
    """Run one part in this process; its result (partial ones as it goes) lands in `state`."""
    from mpt.rundir import atomic_write_json

    def emit(result: dict, **kw) -> None:
        atomic_write_json(state, {"result": result, **kw})

    partial: dict = {}

    def emit_partial(r: dict) -> None:
        partial.clear()
        partial.update(r)
        emit(r)

    try:
        ctx = Ctx(smoke, work, emit_partial, **selection)
        r = PART_FNS[part](ctx)
        emit(r, status=r.pop("status", "ok"), error=r.pop("error", None), traceback=r.pop("traceback", None),
             note=r.pop("note", None))
        return 0
    except BaseException as e:  # noqa: BLE001 -- the parent records it; the other parts still run
        emit(dict(partial), status="failed", error=one_line(e), traceback=traceback.format_exc())
        return 1


# ------------------------------------------------------------------------------------------------
# the parent: one process per part, time limits, the results file, the summary


def _read_part(state: Path, seconds: float, timeout: float) -> dict:
    """What the part's process has written so far, as one record of the results file."""
    try:
        got = json.loads(state.read_text())
    except (OSError, ValueError):
        got = {}
    return {"status": got.get("status", "running"), "seconds": round(seconds, 1), "budget_s": round(timeout),
            "error": got.get("error"), "traceback": got.get("traceback"), "note": got.get("note"),
            "result": got.get("result") or {}}


def run_part(part: str, smoke: bool, work: Path, timeout: float, save=lambda rec: None, every: float = 5.0,
             selection: list[str] = ()) -> dict:
    """The part in a child process (a CUDA error or a leak cannot reach the next part; a hang is
    killed at `timeout`); its output is echoed live, indented. Every `every` seconds what it has
    finished goes to save(record), so a kill of the whole call loses at most those seconds. selection:
    the call's --models/--graphed/--e2e-workers arguments, passed on to the part's process."""
    state = work / f"{part}.state.json"
    state.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "experiments.gpu_check", "--_part", part, "--_state", str(state),
           "--_work", str(work), *selection] + (["--cpu-smoke"] if smoke else [])
    env = dict(os.environ)
    if smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the smoke is a CPU run even on a GPU machine
        # One thread: on a shared CPU, OpenMP threads spin-waiting for busy cores made a step 100x
        # slower (speed_memory README).
        env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.time()
    tail: collections.deque = collections.deque(maxlen=60)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[1], start_new_session=True)

    def pump():
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            print(f"    {line}", end="", file=sys.stderr, flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out, rc = False, None
    try:
        while rc is None:
            left = timeout - (time.time() - t0)
            if left <= 0:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)  # the part's whole process group (torchrun's ranks too)
                rc = proc.wait()
                break
            try:
                rc = proc.wait(timeout=min(every, left))
            except subprocess.TimeoutExpired:
                save(_read_part(state, time.time() - t0, timeout))
    except BaseException as e:  # noqa: BLE001 -- SIGINT / SIGTERM of the call: stop the part, keep what it finished
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rec = _read_part(state, time.time() - t0, timeout)
        rec.update(status="interrupted", error=f"interrupted ({one_line(e) or type(e).__name__}) while running: "
                                               f"its finished rows are kept")
        raise Interrupted(rec) from None
    reader.join(timeout=5)
    rec = _read_part(state, time.time() - t0, timeout)
    if rec["status"] == "running":
        rec["status"] = "failed"
    if timed_out:
        rec.update(status="failed", error=f"timeout: killed after its {timeout:.0f} s budget (what it measured "
                                          f"until then is kept)", traceback="\n".join(tail))
    elif rc != 0 and rec["error"] is None:
        rec.update(status="failed", error=f"the part's process exited with {rc} and left no result",
                   traceback="\n".join(tail))
    return rec


class Interrupted(Exception):
    """The call was stopped (SIGINT, SIGTERM) while a part ran; carries that part's record."""

    def __init__(self, record: dict):
        super().__init__("interrupted")
        self.record = record


def _sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


WORK_PREFIX = "gpu_check_"  # the call's temp work folder: <tmp>/gpu_check_XXXXXXXX (tiny data, runs, states)


def new_work_folder() -> tuple[Path, int]:
    """A fresh temp work folder and the descriptor that holds an flock on it while this call lives; first,
    the folders of calls that are gone are removed. A call killed by SIGKILL (a GPU job's time limit, an OOM kill)
    runs no cleanup and left its folder -- tiny data and runs -- in the temp folder for good; the kernel
    drops a dead call's lock, so a folder whose lock can be taken is a leftover."""
    import fcntl

    for old in Path(tempfile.gettempdir()).glob(f"{WORK_PREFIX}*"):
        try:
            if old.is_symlink() or not old.is_dir() or old.stat().st_uid != os.getuid():
                continue
            fd = os.open(old, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass  # a live call's
        finally:
            os.close(fd)
    work = Path(tempfile.mkdtemp(prefix=WORK_PREFIX))
    fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return work, fd


def remove_work_folder(work: Path, fd: int) -> None:
    """The call's own work folder, removed with further stop signals ignored: a second SIGTERM in the
    middle of the removal left the rest of it behind."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        shutil.rmtree(work, ignore_errors=True)
        os.close(fd)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def add_e2e_ratios(res: dict) -> None:
    """ratio_to_synthetic of each end-to-end row: its images/s over the same call's headline row of the
    same model, precision and layout (synthetic tensors already on the GPU)."""
    rows = res["parts"].get("headline", {}).get("result", {}).get("rows", [])
    for r in res["parts"].get("e2e", {}).get("result", {}).get("rows", []):
        h = next((x for x in rows if x["precision"] == r["precision"] and x.get("impl") == r["impl"]
                  and x.get("channels_last") == r["channels_last"] and x.get("throughput")), None)
        if h and r.get("throughput_steady"):
            r["ratio_to_synthetic"] = round(r["throughput_steady"] / h["throughput"], 3)


def summary_text(res: dict) -> str:
    """The human table: every part's status and time, then its figures."""
    P = res["parts"]
    lines = [f"gpu_check on {res['env'].get('device_name', '?')} ({res['mode']}), {res['date']}", "",
             f"{'part':10s} {'status':8s} {'seconds':>8s} {'budget':>7s}  error / note"]
    for name, p in P.items():
        lines.append(f"{name:10s} {p['status']:8s} {p['seconds']:8.1f} {p['budget_s']:7d}  "
                     + (p.get("error") or p.get("note") or ""))
    lines.append(f"{'total':10s} {'':8s} {res['wall_s']:8.1f} {res['budget_s']:7d}")
    h = P.get("headline", {}).get("result", {})
    if h.get("rows"):
        lines += ["", f"headline: {RN}, batch {h['options']['batch']}, width {h['options']['width']}, "
                      f"size {h['rows'][0]['size']}",
                  f"  {'precision':20s} {'layout':6s} {'status':8s} {'img/s':>9s} {'ms/step':>9s} {'peak MiB':>9s}"
                  f" {'GPU busy':>8s} {'speed-up':>8s} {'mem/FP32':>8s}"]
        for r in h["rows"]:
            f = (r.get("ratios") or {}).get("vs_fp32") or {}
            busy = r.get("gpu_busy_fraction")
            prec = r["precision"] + (f" ({r['impl']})" if r.get("impl") else "")
            lines.append(f"  {prec:20s} {'NHWC' if r.get('channels_last') else 'NCHW':6s} {r['status']:8s} "
                         f"{_num(r.get('throughput'), '{:9.0f}')} "
                         f"{_num((r.get('step_ms') or {}).get('median'), '{:9.1f}')} "
                         f"{_num((r.get('peak_gpu_mem_bytes') or 0) / 2**20 or None, '{:9,.0f}')} "
                         f"{_num(busy, '{:8.2f}')} {_num(f.get('speedup'), '{:7.2f}x')} "
                         f"{_num(f.get('peak_gpu_mem'), '{:8.2f}')}")
        lines.append(f"  GPU busy: {h['gpu_busy_fraction_is']}")
        for g in h.get("goals", []):
            lines.append(f"  goal {g['id']}: {g['target']} -> {g['measured']} [{g['status']}]")
    worst = ", ".join(f"{m} {s:g} s" for m, s in DS2_LONGEST_S.items())
    for name, title in (("models", "models, paper batch per GPU (size: pixels, or spectrogram frames)"),
                        ("ds2_worst", f"DeepSpeech 2, worst paper batch: paper batch per GPU, longest utterances "
                                      f"({worst}; size in 10 ms frames)")):
        m = P.get(name, {}).get("result", {})
        if m.get("rows"):
            lines += ["", title, f"  {'model':16s} {'precision':26s} {'batch':>5s} {'size':>5s} {'status':7s} "
                             f"{'ms/step':>9s} {'peak MiB':>9s}"
                             + ("  fits (reserved / device)" if name == "ds2_worst" else "")]
            for r in m["rows"]:
                label = f"{r['precision']} {r.get('impl') or ''}".strip() + (" graphs" if r.get("cuda_graphs") else "")
                lines.append(f"  {r['model']:16s} {label:26s} "
                             f"{r['batch']:5d} {r['size']:5d} {r['status']:7s} "
                             f"{_num((r.get('step_ms') or {}).get('median'), '{:9.1f}')} "
                             f"{_num((r.get('peak_gpu_mem_bytes') or 0) / 2**20 or None, '{:9,.0f}')}"
                             + (f"  {r.get('fits')}" + (f" ({r['reserved_of_device']:.0%})" if r.get("reserved_of_device")
                                                         else "") if name == "ds2_worst" else ""))
    e = P.get("e2e", {}).get("result", {})
    if e.get("rows"):
        lines += ["", f"end to end: {RN} mixed (autocast, NHWC) from JPEG files, loader workers of {e['cores']} "
                      f"cores; {e['data']['train_images']:,} photographs ({e['data']['sizes']})",
                  f"  {'decode':6s} {'workers':>7s} {'status':10s} {'img/s':>9s} {'x synthetic':>11s}  per-window img/s"]
        for r in e["rows"]:
            lines.append(f"  {r['decode']:6s} {r.get('num_workers', e['num_workers']):7d} {r['status'] or '-':10s} "
                         f"{_num(r.get('throughput_steady'), '{:9.0f}')} "
                         f"{_num(r.get('ratio_to_synthetic'), '{:10.2f}x')}  {r.get('windows')}")
    r = P.get("ssd_e2e", {}).get("result", {}).get("row")
    if r:
        lines += ["", f"end to end: SSD300 mixed, batch {r['batch']}: {r['status']}, "
                      f"{_num(r.get('throughput_steady'), '{:.0f}')} img/s (windows {r.get('windows')})"]
    c = P.get("cifar", {}).get("result", {})
    if c.get("rows"):
        lines += ["", f"CIFAR-10 real recipe on the GPU ({c['epochs']} epochs), top-1 % per seed:"]
        for prec in CIFAR_PRECISIONS:
            got = [f"{(r.get('metrics') or {}).get('top1', float('nan')):.1f}" for r in c["rows"] if r["precision"] == prec]
            lines.append(f"  {prec:6s} {', '.join(got)}")
    for name in ("resume", "ddp"):
        r = P.get(name, {}).get("result", {})
        if name == "resume" and r.get("second"):
            lines += ["", f"resume: stopped at step {r['first']['step']} ({r['first']['status']}), restarted: "
                          f"{r['second']['status']} at step {r['second']['step']}, {r['steps_second']} steps trained "
                          f"after the checkpoint, model on {r['model_device']}"]
        if name == "ddp" and r.get("summary"):
            lines += ["", f"ddp: world size {r['world_size']}: {r['summary']['status']} at step {r['summary']['step']}"]
    return "\n".join(lines)


def merge(results: list[dict]) -> dict:
    """Several calls of one machine (a first call and the rerun of what it cut) as one result: each
    part from the last call where it ended ok, else from the one that finished the most rows."""
    def rank(i_rec):
        i, rec = i_rec
        return (rec["status"] in ("ok", "skipped"), len((rec.get("result") or {}).get("rows") or []), i)

    out = {"env": results[-1]["env"], "date": results[-1]["date"], "mode": results[-1]["mode"], "parts": {},
           "calls": [{"command": r["command"], "date": r["date"], "wall_s": r["wall_s"]} for r in results]}
    for p in PARTS:
        recs = [(i, r["parts"][p]) for i, r in enumerate(results) if p in r["parts"]]
        if recs:
            i, rec = max(recs, key=rank)
            out["parts"][p] = {**rec, "call": i + 1}
    return out


def markdown(res: dict) -> str:
    """The tables the README quotes, from one or more results files (merge)."""
    env, P = res["env"], res["parts"]
    g = env.get("gpu") or {}
    lines = [f"# gpu_check on {env.get('device_name')}", "",
             f"torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, driver {env.get('driver')}, "
             f"{g.get('sm_count', '?')} SMs, {(g.get('total_memory_bytes') or 0) / 2**30:.0f} GiB. Calls:", ""]
    lines += [f"{i}. `{c['command']}` ({c['date']}, {c['wall_s']} s)" for i, c in enumerate(res["calls"], 1)]
    lines += ["", "| part | status | from call | seconds | limit |", "|---|---|---|---|---|"]
    lines += [f"| {p} | {r['status']} | {r['call']} | {r['seconds']} | {r['budget_s']} |" for p, r in P.items()]
    h = (P.get("headline") or {}).get("result") or {}
    if h.get("rows"):
        lines += ["", f"## ResNet-50 (pre-activation), batch {h['options']['batch']}, 224 px, synthetic data", "",
                  "| precision | layout | images/s | ms/step (median) | peak MiB | GPU busy "
                  "| vs strict FP32 (same layout) | memory / FP32 |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in h["rows"]:
            f = (r.get("ratios") or {}).get("vs_fp32") or {}
            lines.append(f"| {r['precision']}{' (' + r['impl'] + ')' if r.get('impl') else ''} | "
                         f"{'NHWC' if r.get('channels_last') else 'NCHW'} | {_md(r.get('throughput'), '{:,.0f}')} | "
                         f"{_md((r.get('step_ms') or {}).get('median'), '{:.1f}')} | "
                         f"{_md((r.get('peak_gpu_mem_bytes') or 0) / 2**20 or None, '{:,.0f}')} | "
                         f"{_md(r.get('gpu_busy_fraction'), '{:.2f}')} | {_md(f.get('speedup'), '{:.2f}x')} | "
                         f"{_md(f.get('peak_gpu_mem'), '{:.2f}')} |")
        lines += ["", "| goal | target | measured | status |", "|---|---|---|---|"]
        lines += [f"| {x['id']} | {x['target']} | {x['measured']} | {x['status']} |" for x in h.get("goals", [])]
    for name, title in (("ds2_worst", "DeepSpeech 2 at its worst paper batch (longest utterances: English 35 s, "
                                      "Mandarin 15 s)"),
                        ("models", "Every Table 1 and Table 3 model at the paper grid's batch per GPU")):
        m = (P.get(name) or {}).get("result") or {}
        if not m.get("rows"):
            continue
        lines += ["", f"## {title}", "", "| model | precision | layout | batch | size | status | ms/step | peak MiB |"
                  + (" reserved / device |" if name == "ds2_worst" else ""),
                  "|---|---|---|---|---|---|---|---|" + ("---|" if name == "ds2_worst" else "")]
        for r in m["rows"]:
            lines.append(f"| {r['model']} | {r['precision']}{' (' + r['impl'] + ')' if r.get('impl') else ''}"
                         f"{', CUDA graphs' if r.get('cuda_graphs') else ''} | "
                         f"{'NHWC' if r.get('channels_last') else 'NCHW'} | {r['batch']} | {r['size']} | {r['status']} | "
                         f"{_md((r.get('step_ms') or {}).get('median'), '{:.1f}')} | "
                         f"{_md((r.get('peak_gpu_mem_bytes') or 0) / 2**20 or None, '{:,.0f}')} |"
                         + (f" {_md(r.get('reserved_of_device'), '{:.0%}')} |" if name == "ds2_worst" else ""))
        if name == "models" and P[name]["status"] != "ok":
            done = {r["model"] for r in m["rows"]}
            lines.append(f"\nNot reached in its time limit: {', '.join(x for x in TABLE1 + TABLE3 if x not in done) or '-'}.")
    r = (P.get("resume") or {}).get("result") or {}
    if r.get("second"):
        lines += ["", f"Resume on the device: stopped at step {r['first']['step']} ({r['first']['status']}), restarted: "
                      f"{r['second']['status']} at step {r['second']['step']}, {r['steps_second']} steps trained after "
                      f"the checkpoint, model on {r['model_device']}."]
    if P.get("ddp", {}).get("note"):
        lines += ["", f"DDP: {P['ddp']['status']}: {P['ddp']['note']}."]
    return "\n".join(lines) + "\n"


def _md(v, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def _num(v, fmt: str) -> str:
    if v is None:
        return f"{'-':>{len(fmt.format(0.0))}s}"
    return fmt.format(v)


def write_report(paths: list[Path]) -> int:
    from mpt.rundir import atomic_write_text

    results = []
    for p in paths:
        try:
            r = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"--report {p}: not a readable results file ({one_line(e)})") from None
        if r.get("schema") != SCHEMA:
            raise UserError(f"--report {p}: schema {r.get('schema')!r}, not {SCHEMA} (a gpu_check results file)")
        results.append(r)
    md = markdown(merge(results))
    stem = paths[0].name.removesuffix(".json")
    stem = stem[: stem.index("-gpu_check") + len("-gpu_check")] if "-gpu_check" in stem else stem
    dest = paths[0].with_name(stem + ".md")
    atomic_write_text(dest, md)
    print(md + f"\nwrote {dest}")
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # bad input is one line and exit 2 (mpt.errors.cli), not argparse's usage block
        raise UserError(f"{message} (python -m experiments.gpu_check --help)")


def _parse(argv):
    p = _Parser(prog="python -m experiments.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="the same steps at tiny size on the CPU")
    p.add_argument("--report", nargs="+", metavar="JSON", help="no run: merge these results files (one machine's "
                   "calls, in order) into Markdown tables, written beside the first as <...>-gpu_check.md")
    p.add_argument("--out", default=None,
                   help=f"folder of the results file (default: $OUT when set, else {RESULTS_DIR})")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of: {','.join(PARTS)}")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the whole call, the environment probe included (default {DEFAULT_CALL_S} "
                        f"on a GPU; the CPU smoke: {SMOKE_CALL_S})")
    p.add_argument("--limit", default="", help="part=seconds,... : other limits for some parts (a rerun of what "
                   "a first call cut, e.g. --parts headline --limit headline=240)")
    p.add_argument("--models", default=",".join(TABLE1 + TABLE3),
                   help="the models part's models (comma-separated; default: every Table 1 and Table 3 model)")
    p.add_argument("--graphed", default=",".join(GRAPHED), help="which of them are measured again with CUDA "
                   f"graphs (comma-separated Table 1 models, or none; default: {','.join(GRAPHED)})")
    p.add_argument("--e2e-workers", default="auto", help="the e2e part's loader workers, a run of each decode "
                   "per value (comma-separated counts, or auto: the cores less one; e.g. 15,7,3 for what a node "
                   "with fewer cores per GPU would feed)")
    p.add_argument("--source-digest", action="store_true", help="print the digest of this tree's Python "
                   "sources (as a results file records it) and exit")
    p.add_argument("--_save_every", type=float, default=5.0, help=argparse.SUPPRESS)  # tests: sooner
    p.add_argument("--_part", help=argparse.SUPPRESS)
    p.add_argument("--_state", help=argparse.SUPPRESS)
    p.add_argument("--_work", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.parts = [x.strip() for x in a.parts.split(",") if x.strip()]
    unknown = [x for x in a.parts if x not in PARTS]
    if unknown or not a.parts:
        raise UserError(f"--parts {','.join(unknown) or '(empty)'}: choose from {','.join(PARTS)}")
    a.limits = {}
    for item in filter(None, (x.strip() for x in a.limit.split(","))):
        k, _, v = item.partition("=")
        try:
            a.limits[k.strip()] = float(v)
        except ValueError:
            a.limits[k.strip()] = -1.0
        if k.strip() not in PARTS or a.limits[k.strip()] <= 0:
            raise UserError(f"--limit {item}: write part=seconds with a part of {','.join(PARTS)}, e.g. headline=240")
    a.models = tuple(x.strip() for x in a.models.split(",") if x.strip())
    bad = [x for x in a.models if x not in TABLE1 + TABLE3]
    if bad or not a.models:
        raise UserError(f"--models {','.join(bad) or '(empty)'}: choose from {','.join(TABLE1 + TABLE3)}")
    a.graphed = () if a.graphed.strip() == "none" else tuple(x.strip() for x in a.graphed.split(",") if x.strip())
    bad = [x for x in a.graphed if x not in TABLE1]
    if bad:
        raise UserError(f"--graphed {','.join(bad)}: choose Table 1 models from {','.join(TABLE1)}, or none")
    a.e2e_workers = tuple(x.strip() for x in a.e2e_workers.split(",") if x.strip())
    if not a.e2e_workers or not all(x == "auto" or (x.isdigit() and int(x) >= 1) for x in a.e2e_workers):
        raise UserError(f"--e2e-workers {','.join(a.e2e_workers) or '(empty)'}: give counts >= 1 or auto, e.g. 15,7,3")
    a.selection = ["--models", ",".join(a.models), "--graphed", ",".join(a.graphed) or "none",
                   "--e2e-workers", ",".join(a.e2e_workers)]
    if a.budget is not None and a.budget <= 0:
        raise UserError(f"--budget {a.budget:g}: give a positive number of seconds")
    return a


@cli
def main(argv=None) -> int:
    a = _parse(sys.argv[1:] if argv is None else argv)
    if a._part:  # a child: one part
        return child_main(a._part, Path(a._state), a.cpu_smoke, Path(a._work),
                          {"models": a.models, "graphed": a.graphed, "e2e_workers": a.e2e_workers})
    if a.report:
        return write_report([Path(x) for x in a.report])
    if a.source_digest:
        print(source_digest())
        return 0
    from mpt.rundir import atomic_write_json, now

    out = Path(a.out or os.environ.get("OUT") or RESULTS_DIR)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create it ({e.strerror})") from None
    budgets = {**(SMOKE_BUDGET_S if a.cpu_smoke else GPU_BUDGET_S), **a.limits}
    total = a.budget or (SMOKE_CALL_S if a.cpu_smoke else DEFAULT_CALL_S)
    signal.signal(signal.SIGTERM, _sigterm)  # a runner's stop: the same as Ctrl-C, finished rows kept
    work, work_fd = new_work_folder()
    t0 = time.time()  # the whole call's budget, the probe included
    res, path, failed, current = None, None, [], None
    try:
        probe = run_part("env", a.cpu_smoke, work, PROBE_S)  # counted in the budget, but never cut by it
        if probe["status"] != "ok":
            if "no CUDA GPU" in (probe["error"] or ""):
                raise UserError(probe["error"].split(": ", 1)[-1])
            raise UserError(f"could not read the device: {probe['error']}")
        env, slug = probe["result"]["env"], probe["result"]["slug"]
        date = now()
        path = out / f"{slug}-{date[:10]}-gpu_check{'-smoke' if a.cpu_smoke else ''}.json"
        res = {"schema": SCHEMA, "command": "python -m experiments.gpu_check " + " ".join(argv or sys.argv[1:]),
               "mode": "cpu-smoke" if a.cpu_smoke else "gpu", "date": date, "env": env,
               "source_digest": source_digest(),
               "sizes": dataclasses.asdict(SMOKE if a.cpu_smoke else GPU), "budget_s": round(total),
               "part_budgets_s": {p: budgets[p] for p in a.parts}, "models": list(a.models), "graphed": list(a.graphed),
               "e2e_workers": list(a.e2e_workers), "parts": {}, "wall_s": None, "exit_code": None}
        print(f"gpu_check on {env['device_name']}: parts {', '.join(a.parts)}; budget {total:.0f} s; -> {path}",
              file=sys.stderr, flush=True)

        def save(p=None, rec=None):
            if p is not None:
                res["parts"][p] = rec
            add_e2e_ratios(res)
            res["wall_s"] = round(time.time() - t0, 1)
            atomic_write_json(path, res)

        for p in a.parts:
            left = total - (time.time() - t0)
            if p == "ddp" and not a.cpu_smoke and probe["result"]["env"].get("gpu_count", 0) < 2:
                # Decided from the probe: no process, no CUDA initialisation, no time spent.
                n = probe["result"]["env"].get("gpu_count", 0)
                save(p, {"status": "skipped", "seconds": 0.0, "budget_s": 0, "result": {}, "traceback": None,
                         "error": None, "note": f"{n} GPU visible; a DDP step needs 2 (run on a 2-GPU machine)"})
            elif left < 5:
                save(p, {"status": "failed", "seconds": 0.0, "budget_s": 0, "result": {}, "traceback": None,
                         "note": None, "error": "not run: the call's time budget was spent"})
            else:
                print(f"== {p} (limit {min(budgets[p], left):.0f} s)", file=sys.stderr, flush=True)
                current = p
                save(p, run_part(p, a.cpu_smoke, work, min(budgets[p], left), save=lambda rec, p=p: save(p, rec),
                                 every=a._save_every, selection=a.selection))
                print(f"== {p}: {res['parts'][p]['status']} in {res['parts'][p]['seconds']:.1f} s"
                      + (f": {res['parts'][p]['error']}" if res["parts"][p]["error"] else ""), file=sys.stderr, flush=True)
        failed = [p for p, r in res["parts"].items() if r["status"] == "failed"]
        res["exit_code"] = 1 if failed else 0
        save()
    except (Interrupted, KeyboardInterrupt) as e:
        if res is None:
            raise UserError("interrupted before the device was read: nothing measured") from None
        if isinstance(e, Interrupted):
            res["parts"][current] = e.record
        for p in a.parts:
            res["parts"].setdefault(p, {"status": "failed", "seconds": 0.0, "budget_s": 0, "result": {},
                                        "traceback": None, "note": None, "error": "not run: the call was interrupted"})
        res["exit_code"] = 130
        save()
        print(summary_text(res))
        print(f"\ninterrupted; wrote what was finished to {path}", file=sys.stderr)
        return 130
    finally:
        remove_work_folder(work, work_fd)
    print(summary_text(res))
    print(f"\nwrote {path} ({res['wall_s']:.0f} s)" + (f"; FAILED: {', '.join(failed)}" if failed else "; every part ok"))
    return res["exit_code"]


if __name__ == "__main__":
    raise SystemExit(main())
