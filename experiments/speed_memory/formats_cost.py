"""What the simulated low-precision formats cost: one training step of a model in each format beside FP32
of the same run (the engine's step on a synthetic batch, as bench.measure builds it), and their ratios.

The formats beyond the paper (mpt/formats.py) are simulated by quantise-dequantise in FP32 around FP32
kernels, so this is the price of the simulation, not the speed of FP8 or FP4 hardware: the goal is that
the simulation stays cheap enough to train with -- at most 2x FP32's step time for the FP8 family
(fp8, fp8_rowwise, fp8_rowwise_gw_hp, fp8_block, mxfp8) and 3x for NVFP4 (stochastic rounding and the Hadamard transform on top).

    python -m experiments.speed_memory.formats_cost [models=resnet50_preact] [width=0.25] [batch=16]
        [size=96] [steps=2] [warmup=2] [rounds=12] [device=auto] [out=experiments/speed_memory/results] [tag=]
        [fmt_compile=eager]

Every cell (a model in a format) is built once and warmed up; then each round runs `steps` steps of every cell in
turn, the order reversed every other round, each step timed by this thread's CPU time on a CPU (a step waiting for a
core another process holds is not counted; on a GPU, the wall time around a synchronised step). A format's ratio is
the median over rounds of its round's median step over FP32's of the same round: on a shared machine whose speed
drifts by tens of percent within minutes, a format is compared with FP32 measured seconds apart, not minutes.

fmt_compile: eager (the eager quantisers) | compiled (fmt.compile=true: mpt.fused's compiled chains) | both (each format
eager and compiled in the same rounds, the compiled rows named <format>+compile). The compilation itself is timed
apart (`compile_s`: the first warm-up step of each compiled format, the kernels shared between formats), not in the
step times.
"""
from __future__ import annotations

import json
import pathlib
import shlex
import statistics
import sys
import time

from mpt import precisions
from mpt.errors import UserError

FORMATS = ("fp32", *precisions.FORMATS)
GOALS = {n: precisions.BY_NAME[n].cost_goal for n in precisions.FORMATS}  # x FP32's step time; None: no goal
DEFAULTS = {"models": "resnet50_preact", "width": 0.25, "batch": 16, "size": 96, "steps": 2, "warmup": 2,
            "rounds": 12, "device": "auto", "out": "experiments/speed_memory/results", "tag": "", "fmt_compile": "eager"}
COMPILED = "+compile"  # the suffix of a format's compiled row (fmt_compile=both)


def main(overrides: list[str]) -> dict:
    from experiments.speed_memory import DEFAULTS as BENCH, bench
    from experiments.speed_memory import check_least, check_tag
    from mpt.config_parse import parse_options
    from mpt.ranks import pick_device
    from mpt.rundir import atomic_write_text, now

    o = parse_options(list(overrides), DEFAULTS, "experiments.speed_memory.formats_cost")
    names, _ = bench.resolve_models(o["models"])
    device = pick_device(o["device"])
    opts = {**BENCH, **o, "kernels": False, "channels_last": False, "compile": False, "half_math": "auto"}
    env = bench.environment(device)
    if o["fmt_compile"] not in ("eager", "compiled", "both"):
        raise UserError(f"fmt_compile={o['fmt_compile']} is not one of eager, compiled, both")
    check_least(o, {"steps": 1, "rounds": 1, "warmup": 0})
    check_tag(o["tag"])
    extra = [f + COMPILED for f in FORMATS[1:]] if o["fmt_compile"] == "both" else []
    on = {f: o["fmt_compile"] == "compiled" and f != "fp32" for f in FORMATS} | {f: True for f in extra}
    order = [*FORMATS, *extra]
    compile_s, rows, every = {}, [], []
    for model in names:
        cells = {prec: _Cell(model, prec.removesuffix(COMPILED), on[prec], o, opts, device) for prec in order}
        for prec, cell in cells.items():
            t0 = time.perf_counter()
            cell.warm(o["warmup"])
            if cell.compiled and cell.status == "ok":
                compile_s[cell.fmt] = round(time.perf_counter() - t0, 1)
            print(f"{model} {prec}: {cell.status}, built and warmed up in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                  flush=True)
        live = [p for p in order if cells[p].status == "ok"]
        for k in range(o["rounds"]):
            got = {prec: [cells[prec].step() for _ in range(o["steps"])] for prec in (live if k % 2 == 0 else live[::-1])}
            every += [{"model": model, "precision": p, "round": k, "step_ms": t} for p, t in got.items()]
            print(f"{model} round {k}: " + ", ".join(f"{p} {statistics.median(got[p]):.0f}" for p in live) + " ms",
                  file=sys.stderr, flush=True)
        for prec in order:
            cell = cells[prec]
            mine = [t for e in every if e["model"] == model and e["precision"] == prec for t in e["step_ms"]]
            rows.append({"model": model, "precision": prec, "fmt_compile": cell.compiled, "status": cell.status,
                         "note": cell.note, "batch": o["batch"], "size": o["size"], "width": o["width"],
                         "step_ms": bench.step_stats(mine) if mine else None})
        del cells
    ratios = []
    for model in names:
        base = _round_medians(every, model, "fp32")
        for r in rows:
            fmt = r["precision"].removesuffix(COMPILED)
            mine = _round_medians(every, model, r["precision"])
            if r["model"] == model and fmt in GOALS and base and mine:
                # paired by round: the median of (this format's round median / FP32's round median)
                x, goal = statistics.median(mine[k] / base[k] for k in mine if k in base), GOALS[fmt]
                ratios.append({"model": model, "precision": r["precision"], "ratio": x, "goal": goal,
                               "meets_goal": None if goal is None else x <= goal})
    result = {"command": "python -m experiments.speed_memory.formats_cost " + shlex.join(overrides),
              "date": now(), "env": env, "options": {**o, "device": str(device)}, "data": bench.DATA_NOTE,
              "rows": rows, "ratios": ratios, "compile_s": compile_s, "every_round": every}
    name = f"{bench.device_slug(env)}-{result['date'][:10]}-formats" + (f"-{o['tag']}" if o["tag"] else "")
    out = pathlib.Path(o["out"])
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"{name}.json", json.dumps(result, indent=1, default=str))
    machine = env["gpu"]["name"] if env.get("gpu") else f"{env['cpu']}, {env['threads']} thread" + "s" * (env["threads"] != 1)
    lines = [f"# Simulated formats: step time vs FP32 ({machine})", "",
             f"`{result['command']}`; {bench.DATA_NOTE}.", "",
             "| model | format | step ms (median) | x FP32 (median over rounds) | goal | meets |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        q = next((x for x in ratios if x["model"] == r["model"] and x["precision"] == r["precision"]), None)
        lines.append(f"| {r['model']} | {r['precision']} | {_median(r)} | "
                     + (f"{q['ratio']:.2f} | " + (f"{q['goal']:g}x | {'yes' if q['meets_goal'] else 'NO'} |"
                                                   if q["goal"] is not None else "none set | - |") if q
                        else "1.00 | | |"))
    if compile_s:
        lines += ["", "fmt.compile's compilation and the warm-up steps, per format, before the rounds (s): "
                  + ", ".join(f"{k} {v}" for k, v in compile_s.items())]
    atomic_write_text(out / f"{name}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def _round_medians(every: list[dict], model: str, prec: str) -> dict[int, float]:
    """A cell's median step (ms) in each round: {round: median}."""
    return {e["round"]: statistics.median(e["step_ms"]) for e in every
            if e["model"] == model and e["precision"] == prec and e["step_ms"]}


class _Cell:
    """One model in one format, built once as bench.measure builds it (bench.build_cell; the engine's TrainStep),
    stepped in turn with the others. `status`: ok, skipped (bench.skip_reason) or failed (the error in `note`)."""

    def __init__(self, model: str, fmt: str, compiled: bool, o: dict, opts: dict, device):
        from experiments.speed_memory import bench
        from mpt.step import TrainStep

        self.fmt, self.compiled, self.device, self.note, self.status = fmt, compiled, device, None, "ok"
        reason = bench.skip_reason(fmt, device)
        if reason:
            self.status, self.note = "skipped", reason
            return
        wl = bench.WORKLOADS[model]
        size = wl.default_size if o["size"] == "auto" else int(o["size"])
        try:
            task, net, opt, recipe, batch = bench.build_cell(wl, model, fmt, None, size, {**opts, "fmt_compile": compiled},
                                                             device)
            self._step = TrainStep(task.loss, net, {"main": opt}, recipe, device=device, channels_last=False,
                                   measure_first=False)
            self._batch = batch
        except Exception as e:  # noqa: BLE001 -- one failing cell must not lose the others' figures
            self.status, self.note = "failed", bench.failure_note(e)

    def warm(self, n: int) -> None:
        """`n` steps before the rounds, at least one: a compiled format's compilation happens in its first."""
        from experiments.speed_memory import bench

        for _ in range(max(n, 1) if self.status == "ok" else 0):
            try:
                self.step()
            except Exception as e:  # noqa: BLE001
                self.status, self.note = "failed", bench.failure_note(e)

    def step(self) -> float:
        """One training step; its time in ms (this thread's CPU time on a CPU)."""
        from experiments.speed_memory import bench
        from mpt import fused

        fused.enable(self.compiled)  # (a process-wide switch: each cell's own, set before its step)
        if self.device.type == "cuda":
            bench.sync(self.device)
            t = time.perf_counter()
            self._step([self._batch])
            bench.sync(self.device)
            return 1e3 * (time.perf_counter() - t)
        t = time.thread_time()
        self._step([self._batch])
        return 1e3 * (time.thread_time() - t)


def _median(row: dict):
    s = row.get("step_ms")
    return round(s["median"], 2) if isinstance(s, dict) and s.get("median") is not None else None


if __name__ == "__main__":
    from mpt.errors import cli

    cli(main)(sys.argv[1:])
