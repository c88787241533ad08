"""The parts of a call, most valuable first (each runs in its own process, with its own time limit: see
runner.run_part; a failure is recorded and the others run):
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

Every measurement is the repository's own code: the speed/memory benchmark's step
(experiments/speed_memory/bench.py, i.e. mpt.step.TrainStep) and the engine's run/resume/DDP paths.
Sizes holds what each part runs at: the paper's on a GPU, tiny ones for the CPU smoke.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from experiments.speed_memory.gpu_check.data import REPO, photo_imagenet, photo_source, tiny_data
from mpt.errors import UserError

# The parts in the order a call runs them, most valuable first
PARTS = ("headline", "e2e", "ssd_e2e", "resume", "ds2_worst", "cifar", "models", "ddp", "watch")
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
CIFAR_PRECISIONS = ("fp32", "fp16", "mixed", "bf16")


def cifar_cell(cell: str) -> tuple[str, list[str]] | None:
    """A cifar cell -- a precision, optionally `+emulated` (its FP16/BF16 dot products computed as the CPU
    runs compute them: mpt.half_math, half_math=emulated) -- as (precision, extra overrides); None if unknown."""
    from mpt.precisions import PRECISIONS

    prec, plus, how = cell.partition("+")
    if prec not in PRECISIONS or (plus and how != "emulated"):
        return None
    return prec, (["half_math=emulated"] if plus else [])


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
    # watch: mpt.doctor.watch on the tiny ResNet-50 as the CPU benchmark runs it (a launch-bound step here), then
    # at ResNet-50's own size at a paper-grid batch per GPU
    watch_rounds: int = 10
    watch_steps: int = 10
    watch_every: int = 10
    watch_sizes: tuple = ((0.0, 0, 0), (1.0, 64, 224))  # (width, batch, crop): watch_overhead.size_overrides


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
              cifar_sizes={"train_per_class": 8, "test_per_class": 4},
              watch_rounds=1, watch_steps=2, watch_every=2, watch_sizes=((0.0, 0, 0),))


# ------------------------------------------------------------------------------------------------
# parts (each runs in its own process: see runner.run_part)


class Ctx:
    def __init__(self, smoke: bool, work: Path, emit, models: tuple = TABLE1 + TABLE3, graphed: tuple = GRAPHED,
                 e2e_workers: tuple = ("auto",), cifar: tuple = CIFAR_PRECISIONS):
        import torch

        self.smoke, self.work, self.emit = smoke, work, emit
        self.models, self.graphed = models, graphed  # the models part's cells (--models, --graphed)
        self.e2e_workers = e2e_workers  # the e2e part's loader workers, a run each (--e2e-workers)
        self.cifar = cifar  # the cifar part's cells, a run each per seed (--cifar)
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
        folder = REPO / "experiments" / exp
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
    from mpt.precisions import HALF_COMPUTE

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
    from mpt.precisions import HALF_COMPUTE

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


def _tiny_overrides(ctx: Ctx, out_dir: Path, device: str, batch: int) -> list[str]:
    """The ILSVRC tiny profile, ResNet-50 in mixed precision with the paper's FP32 master copy (what a
    checkpoint and a DDP broadcast must carry besides the model), on the tiny data. Dynamic loss scaling
    from 2^7, not 2^16: from 2^16 every one of these few steps overflowed and was skipped (measured on the
    CPU), so the checkpoint would hold no optimizer state and no update would have been applied. Learning rate
    0.01, not the profile's 0.1: these runs stop after a few steps, at the top of the warmup, and there the
    evaluation's activations (batch-norm running statistics barely moved) overflowed FP16 on an AMD EPYC (eval loss
    NaN, FP32's 925; finite at 0.01) -- these parts check the engine's mechanics, not the recipe."""
    return ["profile=tiny", f"model={RN}", "precision=mixed", "impl=paper", "scaler.init_scale=128", "optim.lr=0.01",
            f"task.data_root={tiny_data(ctx.work)}", f"out_dir={out_dir}", f"device={device}", f"train.batch_size={batch}",
            f"train.max_steps={ctx.sizes.tiny_steps}", "train.progress=false", "wandb.mode=disabled"]


def part_resume(ctx: Ctx) -> dict:
    """The engine's own resume path on the device: a run stopped after a few steps (as a stop signal
    stops it: checkpoint at the step boundary, status "interrupted"), then the same command again,
    which must load that checkpoint (model, FP32 masters, optimizer, scaler, RNG) and finish."""
    from experiments.ilsvrc_cnns.task import Task
    from mpt import config, identity
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
    out = {"run_dir": str(identity.run_dir(cfg)), "first": _brief(first), "steps_first": first_task.steps}
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
    from mpt import config, identity

    # On CUDA each rank takes cuda:<local rank>; with fewer than 2 GPUs the parent skips this part from the
    # probe's GPU count, without starting it.
    device = "auto" if ctx.device.type == "cuda" else "cpu"
    ov = _tiny_overrides(ctx, ctx.work / "ddp_runs", device, 2 * ctx.sizes.tiny_batch)  # the same batch per rank
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "experiments.ilsvrc_cnns", *ov]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    cfg = config.resolve("ilsvrc_cnns", ov)
    d = identity.run_dir(cfg)
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
    (metrics.jsonl), after the first `skip_windows` (cuDNN's search, the workers' start) their median
    (throughput_steady) and the rate within epochs (throughput_sustained: sustained_rate)."""
    from mpt import config, identity
    from mpt.cli import main

    s = main(experiment, overrides)
    cfg = config.resolve(experiment, overrides)
    lines = [json.loads(x) for x in (identity.run_dir(cfg) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [ln for ln in lines if ln.get("kind") == "train" and ln.get("throughput")]
    windows = [ln["throughput"] for ln in train]
    starts = epoch_starts([0.0] + [ln["epoch"] for ln in train])
    steady = windows[skip_windows:] or windows
    out = _brief(s)
    out.update(windows=[round(w, 1) for w in windows], windows_epoch_start=starts,
               throughput_steady=round(sorted(steady)[len(steady) // 2], 1) if steady else None,
               throughput_sustained=sustained_rate(windows, starts, skip_windows))
    return out


def epoch_starts(ends: list[float]) -> list[bool]:
    """Whether each log window holds an epoch's first step: window i spans (ends[i], ends[i + 1]] in epochs
    (the epoch a log line reports: steps / steps per epoch)."""
    return [math.floor(b - 1e-9) >= a - 1e-9 for a, b in zip(ends, ends[1:])]


def sustained_rate(windows: list[float], starts: list[bool], skip: int) -> float | None:
    """Images/s over the windows after the first `skip` that hold no epoch's first step: their images over
    their time (the windows log equal step counts, so the harmonic mean of their rates). When the loader
    falls behind, the windows swing between the GPU's rate (batches buffered) and the loader's; their median
    then reads high (15 workers decoding on the GPU: a median of 3,368 where 2,305 images/s were sustained).
    The windows that start an epoch (persistent workers refilling their queues) are left out: ILSVRC's ~5,000
    steps an epoch hide what these short runs' 32-step epochs show every sixth or seventh window."""
    keep = [w for i, (w, st) in enumerate(zip(windows, starts)) if i >= skip and not st and w > 0]
    return round(len(keep) / sum(1 / w for w in keep), 1) if keep else None


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
        print(f"e2e decode={decode} workers={workers}: {row['throughput_sustained']} img/s sustained within epochs "
              f"(median window {row['throughput_steady']}), windows {row['windows']} "
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
    generate(arch, photos=str(photo_source()), size=s.ssd_image, trainval=s.ssd_images, test=8)
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


def part_cifar(ctx: Ctx) -> dict:
    """The CIFAR-10 `real` recipe (ResNet-8 on the development subset, 32 epochs) on the GPU's tensor
    cores in fp32, fp16 (S = 1), mixed and bf16, one process per run, the four precisions of a seed
    side by side: top-1 to set beside the CPU emulation's (experiments/ilsvrc_cnns/config.yaml)."""
    from data_prep.imagenet import cifar_dev, prepare
    from mpt import config, identity

    s = ctx.sizes
    src = next((p for p in (REPO / "data/cifar10-dev.tar.gz", REPO.parent / "shared/data/cifar10-dev.tar.gz")
                if p.is_file()), None)
    if src is None:
        return {"status": "skipped", "note": "no cifar10-dev.tar.gz in data/ or ../shared/data/"}
    data = ctx.work / "cifar_dev"
    cifar_dev.generate(ctx.work / "cifar_archives", source=str(src), **s.cifar_sizes)
    prepare.prepare(ctx.work / "cifar_archives", data, workers=4, log=lambda *a: None)
    out = {"rows": [], "epochs": s.cifar_epochs}
    cells = [(seed, cell) for seed in s.cifar_seeds for cell in ctx.cifar]
    for k in range(0, len(cells), s.cifar_at_once):  # a seed's four cells side by side on a GPU
        procs = []
        for seed, cell in cells[k:k + s.cifar_at_once]:
            prec, extra = cifar_cell(cell)
            ov = ["profile=real", "model=resnet8_cifar", f"precision={prec}", *extra, f"seed={seed}", f"task.data_root={data}",
                  f"out_dir={ctx.work / 'cifar_runs'}", f"device={ctx.device}", "wandb.mode=disabled",
                  "train.progress=false", f"train.epochs={s.cifar_epochs}", f"train.eval_every_epochs={s.cifar_epochs}"]
            with open(ctx.work / f"cifar_{cell}_{seed}.log", "w") as log:
                procs.append((seed, cell, ov, time.time(), subprocess.Popen(
                    [sys.executable, "-m", "experiments.ilsvrc_cnns", *ov], stdout=log, stderr=subprocess.STDOUT,
                    cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": str(s.cifar_threads)})))
        for seed, cell, ov, t0, p in procs:
            rc = p.wait()
            summ = identity.run_dir(config.resolve("ilsvrc_cnns", ov)) / "summary.json"
            s_ = json.loads(summ.read_text()) if summ.is_file() else {"status": f"exit {rc}"}
            row = {"precision": cifar_cell(cell)[0], "cell": cell, "seed": seed, **_brief(s_),
                   "seconds": round(time.time() - t0, 1)}
            out["rows"].append(row)
            print(f"cifar {cell} seed {seed}: {row['status']} top1 {(row.get('metrics') or {}).get('top1')} "
                  f"({row['seconds']:.0f} s)", file=sys.stderr, flush=True)
            ctx.emit(out)
    return _failed_runs(out, lambda r: f"{r.get('cell', r['precision'])} seed {r['seed']}")


def part_watch(ctx: Ctx) -> dict:
    """What mpt.doctor.watch(every=10) costs a torch.amp loop (FP16 autocast, a GradScaler) on the GPU: the CPU
    benchmark's measurement (experiments.speed_memory.watch_overhead: watched, plain and control blocks rotated,
    each step paired with the plain one in its place) timed by the wall clock after each step's kernels."""
    import torch

    from experiments.speed_memory import watch_overhead

    s = ctx.sizes
    out = {"rows": [], "every": s.watch_every, "rounds": s.watch_rounds, "steps": s.watch_steps}
    for size in s.watch_sizes:
        t0 = time.time()
        sizes = watch_overhead.size_overrides(*size)
        row = watch_overhead.measure("ilsvrc_cnns", s.watch_every, s.watch_rounds, s.watch_steps,
                                     ctx.work / "watch_data", channels_last=ctx.device.type == "cuda",
                                     device=ctx.device, mixed=True, overrides=sizes)
        row["seconds"] = round(time.time() - t0, 1)
        out["rows"].append(row)
        print(f"watch {' '.join(sizes) or 'tiny profile'}: plain {row['step_ms']:.1f} ms, a sampled step "
              f"{row['sampled_cost_ms']:+.1f} ms, a traced one {row['traced_cost_ms']:+.1f} ms: "
              f"{row['implied_call_pct']:+.1f}% a step at every={s.watch_every} ({row['seconds']:.0f} s)",
              file=sys.stderr, flush=True)
        ctx.emit(out)
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def part_env(ctx: Ctx) -> dict:
    """The device and library versions (the parent process never touches CUDA: every part gets the
    whole GPU)."""
    from experiments.speed_memory import bench

    env = bench.environment(ctx.device)
    env["gpu_count"] = __import__("torch").cuda.device_count() if ctx.device.type == "cuda" else 0
    return {"env": env, "slug": bench.device_slug(env)}


PART_FNS = {"env": part_env, "headline": part_headline, "e2e": part_e2e, "ssd_e2e": part_ssd_e2e, "cifar": part_cifar,
            "models": part_models, "ds2_worst": part_ds2_worst, "resume": part_resume, "ddp": part_ddp,
            "watch": part_watch}


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

