"""What the simulated low-precision formats cost: one training step of a model in each format beside FP32
of the same run (bench.measure: the engine's step on a synthetic batch), and their ratios.

The formats beyond the paper (mpt/formats.py) are simulated by quantise-dequantise in FP32 around FP32
kernels, so this is the price of the simulation, not the speed of FP8 or FP4 hardware: the goal is that
the simulation stays cheap enough to train with -- at most 2x FP32's step time for the FP8 family
(fp8, fp8_rowwise, fp8_rowwise_gw_hp, fp8_block, mxfp8) and 3x for NVFP4 (stochastic rounding and the Hadamard transform on top).

    python -m experiments.speed_memory.formats_cost [models=resnet50_preact] [width=0.25] [batch=16]
        [size=96] [steps=10] [warmup=2] [rounds=2] [device=auto] [out=experiments/speed_memory/results] [tag=]
        [fmt_compile=eager]

fmt_compile: eager (the eager quantisers) | compiled (fmt.compile=true: mpt.fused's compiled chains) | both (each format
eager and compiled in the same rounds, the compiled rows named <format>+compile). The compilation itself is timed
apart (`compile_s`: one untimed step per format before the rounds, the kernels shared between formats), not in the
step times.
"""
from __future__ import annotations

import json
import pathlib
import shlex
import sys
import time

from mpt import precisions
from mpt.errors import UserError

FORMATS = ("fp32", *precisions.FORMATS)
GOALS = {n: precisions.BY_NAME[n].cost_goal for n in precisions.FORMATS}  # x FP32's step time; None: no goal
DEFAULTS = {"models": "resnet50_preact", "width": 0.25, "batch": 16, "size": 96, "steps": 10, "warmup": 2,
            "rounds": 2, "device": "auto", "out": "experiments/speed_memory/results", "tag": "", "fmt_compile": "eager"}
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
    compiled = [f + COMPILED for f in FORMATS[1:]] if o["fmt_compile"] == "both" else []
    cells = {f: o["fmt_compile"] == "compiled" and f != "fp32" for f in FORMATS} | {f: True for f in compiled}
    order = [*FORMATS, *compiled]
    compile_s = {}
    for model in names:  # the compilation, once, apart from the rounds
        for prec, on in cells.items():
            if on:
                fmt, t0 = prec.removesuffix(COMPILED), time.perf_counter()
                bench.measure(model, fmt, None, {**opts, "fmt_compile": True, "steps": 0, "warmup": 1}, device)
                compile_s[fmt] = round(time.perf_counter() - t0, 1)
                print(f"{model} {prec}: compiled and one step in {compile_s[fmt]} s", file=sys.stderr, flush=True)
    # Rounds, the order reversed every other one: on a shared machine the load drifts, and each format's
    # fastest round (its least disturbed) is the one compared.
    every, rows = [], []
    for model in names:
        for k in range(o["rounds"]):
            for prec in (order if k % 2 == 0 else order[::-1]):
                row = bench.measure(model, prec.removesuffix(COMPILED), None, {**opts, "fmt_compile": cells[prec]}, device)
                row = {**row, "precision": prec, "fmt_compile": cells[prec]}
                every.append({**row, "round": k})
                print(f"{model} {prec} round {k}: {row['status']} {_median(row)} ms/step", file=sys.stderr, flush=True)
        for prec in order:
            mine = [r for r in every if r["model"] == model and r["precision"] == prec]
            rows.append(min(mine, key=lambda r: _median(r) or float("inf")))
    ratios = []
    for model in names:
        base = _median(next(r for r in rows if r["model"] == model and r["precision"] == "fp32"))
        for r in rows:
            fmt = r["precision"].removesuffix(COMPILED)
            if r["model"] == model and fmt in GOALS and base and _median(r):
                x, goal = _median(r) / base, GOALS[fmt]  # every format, a goal or none
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
             "| model | format | step ms (median, fastest round) | x FP32 | goal | meets |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        q = next((x for x in ratios if x["model"] == r["model"] and x["precision"] == r["precision"]), None)
        lines.append(f"| {r['model']} | {r['precision']} | {_median(r)} | "
                     + (f"{q['ratio']:.2f} | " + (f"{q['goal']:g}x | {'yes' if q['meets_goal'] else 'NO'} |"
                                                   if q["goal"] is not None else "none set | - |") if q
                        else "1.00 | | |"))
    if compile_s:
        lines += ["", "fmt.compile's compilation and one untimed step, per format, before the rounds (s): "
                  + ", ".join(f"{k} {v}" for k, v in compile_s.items())]
    atomic_write_text(out / f"{name}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def _median(row: dict):
    s = row.get("step_ms")
    return round(s["median"], 2) if isinstance(s, dict) and s.get("median") is not None else None


if __name__ == "__main__":
    from mpt.errors import cli

    cli(main)(sys.argv[1:])
