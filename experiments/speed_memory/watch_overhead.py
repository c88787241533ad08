"""What mpt.doctor.watch costs a training loop: the tiny-profile ResNet-50 (pre-activation) and bigLSTM, each
trained on one CPU thread by a hand-written FP32 loop over its first batches, with and without
`watch(model, every=k)`, and with none again as the control (the machine's noise floor). One model for all
three, blocks of `steps` steps rotated, paired within each round, median over rounds, as engine_overhead does.
Beside that median, each step is timed on its own (thread CPU time): the cost of a sampled step, of a traced
one and of one between samples is the median, over all such steps, of its time minus that of the plain step
in the same place of the same round's plain block (paired: drift in the machine's speed cancels), and the
overhead these imply at `every` (a sample every `every` steps, a trace every 10 x `every`) -- steadier than the
blocks' median, where a block's one sampled step is lost in the noise of the other nine. The control block,
paired the same way, gives that figure's noise floor. A step between samples adds only its w.step() call, whose
own time is taken too: the overhead implied with it in place of that step's paired cost (~0.03 ms, inside the
pairs' noise of +-0.15 ms) is printed beside.
Prints the figures and writes them, with the command and the CPU, to out= (results/cpu-<cpu>-<date>-watch_overhead
[-tag].json); the tiny data are generated and prepared on first use (under data=, default data/).

    OMP_NUM_THREADS=1 python -m experiments.speed_memory.watch_overhead [every=10] [rounds=7] [steps=10]
        [data=data] [models=ilsvrc_cnns,lm_biglstm] [channels_last=false] [out=experiments/speed_memory/results] [tag=]
        [device=cpu|cuda] [precision=fp32|mixed] [width=] [batch=] [crop=]

channels_last=true: the CNN's weights and batches in NHWC (torch.channels_last), as a GPU recipe trains them (the
bigLSTM has no 4-D tensor: unchanged); the records then read tensors that are not contiguous in torch's default
sense, which a reduction may read at another speed.

Where users train: device=cuda (the wall clock after each step's kernels have run, instead of the thread's CPU
time; written to results/<gpu>-<date>-watch_overhead[-tag].json), precision=mixed (the usual torch.amp loop: FP16
autocast and a GradScaler, which the watch is given), and other sizes of the tiny profile (width=, batch=, crop=:
e.g. width=1 batch=64 crop=224, ResNet-50's own size at a paper-grid batch per GPU). gpu_check's `watch` part
runs both sizes on a GPU.
"""
from __future__ import annotations

import pathlib
import shlex
import statistics
import sys
import time

import torch

from experiments.speed_memory import check_least, check_tag, write_one_thread_result
from mpt.config_parse import parse_options
from mpt.doctor.targets import load
from mpt.doctor.watch import watch
from mpt.errors import UserError, cli
from mpt.ranks import to_device
from mpt.rundir import cpu_model, now

# experiment -> (its tiny dataset, the demo's name for it, extra overrides)
MODELS = {"ilsvrc_cnns": ("imagenet", ["model=resnet50_preact"]), "lm_biglstm": ("lm1b", [])}


def _clock(device: torch.device):
    """The benchmark's clock: this thread's CPU time on a CPU (time waiting for a core left out); on a GPU the
    wall clock after the device has finished what was queued (a step's kernels run after its Python returns)."""
    if device.type == "cpu":
        return time.thread_time

    def synced() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return synced


def _loop(patient, batches, channels_last: bool = False, device=torch.device("cpu"), mixed: bool = False):
    """One plain training step per call over the patient's batches (its optimizer, its loss): FP32, or with
    `mixed` as the usual torch.amp loop writes it (autocast to FP16, a GradScaler). -> model, opt, step,
    scaler (None in FP32)."""
    import copy

    model = copy.deepcopy(patient.model).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = patient.optimizer(model)
    loss_fn = patient.loss_fn()
    scaler = torch.amp.GradScaler(device.type) if mixed else None
    clock = _clock(device)
    state = {"i": 0}

    def step(w=None):
        """One step; with a watch, returns the time of its w.step() call (None without)."""
        b = batches[state["i"] % len(batches)]
        state["i"] += 1
        with torch.autocast(device.type, torch.float16, enabled=mixed):
            out = loss_fn(model, b)
        loss = out[0] if isinstance(out, tuple) else out
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        if w is None:
            return None
        t = clock()
        w.step(loss)
        return clock() - t
    return model, opt, step, scaler


def size_overrides(width: float = 0.0, batch: int = 0, crop: int = 0) -> tuple[str, ...]:
    """The tiny profile's config overrides for other sizes of it (0: the profile's own), e.g. (1.0, 64, 224):
    ResNet-50's own size at a paper-grid batch per GPU. The crop comes with ILSVRC's resize of crop x 8/7."""
    out = []
    if width:
        out.append(f"width={width}")
    if batch:
        out.append(f"train.batch_size={batch}")
    if crop:
        out += [f"task.crop={crop}", f"task.resize={crop * 8 // 7}"]
    return tuple(out)


def measure(name: str, every: int, rounds: int, steps: int, data: pathlib.Path, channels_last: bool = False,
            device=torch.device("cpu"), mixed: bool = False, overrides: tuple = ()) -> dict:
    from experiments.__main__ import prepare_tiny

    ds, extra = MODELS[name]
    root = prepare_tiny(ds, data / f"tiny_{ds}")
    patient = load(f"experiment:{name}", [f"task.data_root={root}", *extra, *overrides], "tiny", steps=max(steps, 20))
    torch.manual_seed(0)
    # One model, optimizer and batch cycle for all three: blocks differ only in whether a watch is on (the
    # same objects in memory; separate copies ran up to 2x apart here, plain against plain).
    # (on the device, NHWC as the engine lays a batch out: mpt.ranks.to_device)
    batches = [to_device(b, device, channels_last) for b in patient.batches]
    model, opt, step, scaler = _loop(patient, batches, channels_last, device, mixed)

    # One watch for the whole measurement, on during the watched blocks: its step count runs on across them,
    # so the first step of each block of `every` steps is sampled and one in trace_every is traced, as in a
    # long run.
    w = watch(model, every=every, optimizer=opt, scaler=scaler, log=lambda line: None)
    # On a CPU, this thread's CPU time: on a machine shared with other processes, the time spent waiting for a
    # core is left out of every loop alike (engine_overhead's clock=cpu). On a GPU, the wall clock, synchronised.
    clock = _clock(device)

    def block(watched: bool):
        t = clock()
        each = []  # (what the step is, its time, that of its w.step() call)
        if watched:
            w.__enter__()
        for _ in range(steps):
            # What this step is, known before it runs (the watch starts a step's sample at the step before)
            kind = "plain" if not watched else w.recording or "between"
            s = clock()
            call = step(w if watched else None)
            each.append((kind, clock() - s, call))
        if watched:
            w.__exit__(None, None, None)
        return (clock() - t) / steps, each

    loops = [False, True, False]  # plain, watched, the control (plain again)
    for watched in loops:  # warm-up
        block(watched)
    times: dict = {i: [] for i in range(3)}
    paired: dict = {"between": [], "sampled": [], "traced": [], "control": []}  # a step's time minus the plain one's
    calls = []  # the thread time of w.step() on the steps between samples
    plain_steps = []
    for r in range(rounds):  # rotate the order so drift in machine load hits every loop alike
        each = {}
        for i in [(r + j) % 3 for j in range(3)]:
            times[i].append((got := block(loops[i]))[0])
            each[i] = got[1]
        plain_steps += [t for _, t, _ in each[0]]
        calls += [call for kind, _, call in each[1] if kind == "between"]
        for (kind, t, _), (_, p, _), (_, c, _) in zip(each[1], each[0], each[2]):
            paired[kind].append(t - p)
            paired["control"].append(c - p)
    plain_t, watched_t, ctl_t = times[0], times[1], times[2]
    step_t = statistics.median(plain_steps)
    cost = {k: statistics.median(v) if v else float("nan") for k, v in paired.items()}
    trace_every = w.trace_every
    rare = cost["sampled"] * (1 / every - 1 / trace_every) + cost["traced"] / trace_every
    implied = cost["between"] * (1 - 1 / every) + rare
    # A step between samples does no more than the plain one but the w.step() call (and the optimizer's step hook,
    # one Python call): its paired median is that call's ~0.02-0.05 ms lost in the pairs' noise (the control's
    # paired median moves by +-0.15 ms), so the call's own time gives the same figure without that noise.
    call = statistics.median(calls) if calls else float("nan")
    return {"model": patient.name, "every": every, "rounds": rounds, "steps": steps, "channels_last": channels_last,
            "precision": "mixed" if mixed else "fp32", "overrides": list(overrides),
            "plain_ms": 1e3 * statistics.median(plain_t), "watched_ms": 1e3 * statistics.median(watched_t),
            "overhead_pct": 100 * (statistics.median(b / a for a, b in zip(plain_t, watched_t)) - 1),
            "control_pct": 100 * (statistics.median(b / a for a, b in zip(plain_t, ctl_t)) - 1),
            # All watched steps over all plain ones: the rare traced steps (every 10 x every) counted in.
            "overhead_mean_pct": 100 * (sum(watched_t) / sum(plain_t) - 1),
            "watched_steps": w.step_count, "samples": w.samples, "traced": w.traced,
            # Steps timed one by one: the median plain step, what each kind of watched step adds to it, and the
            # overhead those imply at `every`.
            "step_ms": 1e3 * step_t, "n": {k: len(v) for k, v in paired.items()},
            **{f"{k}_cost_ms": 1e3 * cost[k] for k in ("between", "sampled", "traced")},
            "implied_pct": 100 * implied / step_t, "control_step_ms": 1e3 * cost["control"],
            "between_call_ms": 1e3 * call, "implied_call_pct": 100 * (call * (1 - 1 / every) + rare) / step_t}


def main(argv=None) -> list[dict]:
    o = parse_options(argv or [], {"every": 10, "rounds": 7, "steps": 10, "data": "data",
                                   "models": ",".join(MODELS), "channels_last": False,
                                   "out": "experiments/speed_memory/results", "tag": "", "device": "cpu",
                                   "precision": "fp32", "width": 0.0, "batch": 0, "crop": 0},
                      "experiments.speed_memory.watch_overhead")
    names = [m for m in o["models"].split(",") if m]
    if not names:
        raise UserError(f"models= is empty: name at least one of {', '.join(MODELS)}")
    for m in names:
        if m not in MODELS:
            raise UserError(f"models={m}: choose from {', '.join(MODELS)}")
    check_least(o, {"every": 1, "rounds": 1, "steps": 1, "width": 0, "batch": 0, "crop": 0})
    check_tag(o["tag"])
    if o["precision"] not in ("fp32", "mixed"):
        raise UserError(f"precision={o['precision']}: choose fp32 or mixed (autocast to FP16 with a GradScaler)")
    if o["device"] not in ("cpu", "cuda"):
        raise UserError(f"device={o['device']}: choose cpu or cuda")
    if o["device"] == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda: no CUDA GPU is visible to this process; run on a GPU machine or use device=cpu")
    device = torch.device(o["device"])
    mixed = o["precision"] == "mixed"
    overrides = size_overrides(o["width"], o["batch"], o["crop"])
    cpu = cpu_model()
    nhwc = o["channels_last"]
    if device.type == "cpu" and torch.get_num_threads() != 1:
        raise UserError("the blocks are timed by this thread's CPU time: run with OMP_NUM_THREADS=1")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    print(f"watch overhead on {gpu or cpu}, {'FP16 autocast + GradScaler' if mixed else 'FP32'}, " +
          ("timed by the wall clock, synchronised" if gpu else "one thread, timed by the thread's CPU time"))
    out = []
    for m in names:
        r = measure(m, int(o["every"]), int(o["rounds"]), int(o["steps"]), pathlib.Path(o["data"]), nhwc, device,
                    mixed, overrides)
        out.append(r)
        print(f"{r['model']}{' (channels-last)' if nhwc else ''}: plain {r['plain_ms']:.1f} ms/step, "
              f"watched (every={r['every']}) {r['watched_ms']:.1f} "
              f"ms/step: overhead {r['overhead_pct']:+.1f}% (median of rounds; {r['overhead_mean_pct']:+.1f}% over all "
              f"steps; control loop {r['control_pct']:+.1f}%; "
              f"{r['rounds']} rounds of {r['steps']} steps; of {r['watched_steps']} watched steps {r['samples']} "
              f"sampled, {r['traced']} of them traced)", flush=True)
        n = r["n"]
        print(f"  step by step, paired with the plain block's: plain {r['step_ms']:.1f} ms (median of {n['control']}); "
              f"a sampled step adds "
              f"{r['sampled_cost_ms']:+.1f} ms ({n['sampled']} steps), a traced one {r['traced_cost_ms']:+.1f} ms "
              f"({n['traced']}), one between samples {r['between_cost_ms']:+.2f} ms ({n['between']}; its w.step() call "
              f"{r['between_call_ms']:.3f} ms): {r['implied_pct']:+.1f}% a step at every={r['every']} (a trace every "
              f"{10 * r['every']} steps; a control step {r['control_step_ms']:+.2f} ms); "
              f"{r['implied_call_pct']:+.1f}% counting a step between samples as its w.step() call",
              flush=True)
    result = {"command": ("" if gpu else "OMP_NUM_THREADS=1 ") + "python -m experiments.speed_memory.watch_overhead "
                         + shlex.join(argv or []), "date": now(), "cpu": cpu, "threads": torch.get_num_threads(),
              "device": gpu or "cpu", "clock": "wall, synchronised" if gpu else "thread CPU time", "models": out}
    write_one_thread_result(o["out"], "watch_overhead", o["tag"], result, machine=gpu)
    return out


if __name__ == "__main__":
    cli(main)(sys.argv[1:])
