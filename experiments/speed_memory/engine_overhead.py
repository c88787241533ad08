"""Engine overhead: the engine's training iteration (mpt.engine.Run.iterate: the train step through
the precision recipe, then the loop's on-device divergence and logging counters) versus a hand-written torch.amp loop, same model, same device-resident batch, one process,
rotating blocks so drift in machine load hits every loop alike, and a second hand-written loop
as a control that shows the machine's noise floor. `python -m experiments.speed_memory`
runs it as its engine-overhead row; alone:

    python -m experiments.speed_memory.engine_overhead [model=resnet50_preact] [width=0.0625]
        [batch=32] [size=80] [precisions=fp32,mixed] [rounds=7] [steps=10] [device=auto] [clock=wall]

clock=cpu (CPU device, one thread) times each block by this thread's CPU time instead of the wall
clock: on a machine shared with other processes, the time the process waits for a core is then left
out of both loops alike (cache contention is not).
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch

from experiments.speed_memory.bench import WORKLOADS, sync, time_steps
from mpt import config
from mpt import engine
from mpt.config import parse_options
from mpt.optim import build_optimizer
from mpt.ranks import pick_device
from mpt.errors import UserError, cli
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

        def engine_step():
            run.iterate([xb])

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
        del run
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


DEFAULTS = {"model": "resnet50_preact", "width": 0.0625, "batch": 32, "size": 80, "precisions": "fp32,mixed",
            "rounds": 7, "steps": 10, "device": "auto", "channels_last": False, "clock": "wall"}


@cli
def main(argv=None):
    o = parse_options(sys.argv[1:] if argv is None else argv, DEFAULTS, "experiments.speed_memory.engine_overhead")
    torch.manual_seed(0)
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
