"""Speed and memory of every registered model in every precision (paper section 3: memory "roughly
halved", FP16 math 2-8x FP32), measured ahead of the published figures. Benchmarks that write
results files; never timed tests.

    python -m experiments.speed_memory [models=all] [precisions=fp32,tf32,fp16,mixed,bf16,fp16_pure]
        [impls=autocast,paper] [batch=256] [size=auto] [width=1.0] [steps=20] [warmup=5] [device=auto]
        [channels_last=false] [compile=false] [fused=false] [cudnn_benchmark=true] [kernels=true]
        [overhead=resnet50_preact] [overhead_rounds=5] [out=experiments/speed_memory/results] [tag=]
        [half_math=auto|emulated|native|both] [cuda_graphs=false]

Programmatic: `experiments.speed_memory.main(["models=alexnet", ...]) -> dict` (the JSON written).
See README.md for what is measured and how, and the results schema.
"""
from __future__ import annotations

import re
import shlex
import sys

DEFAULTS = {
    "models": "all", "precisions": "fp32,tf32,fp16,mixed,bf16,fp16_pure", "impls": "autocast,paper",
    "batch": 256, "size": "auto", "width": 1.0, "steps": 20, "warmup": 5, "device": "auto",
    "channels_last": False, "compile": False, "fused": False, "cudnn_benchmark": True, "kernels": True,
    "overhead": "resnet50_preact", "overhead_rounds": 5, "out": "experiments/speed_memory/results", "tag": "",
    # FP16/BF16 dot products on a CPU (mpt.half_math.HalfMath): auto | emulated | native | both (every
    # half-precision cell twice, emulated and native, in one run: their ratios to the same FP32 row)
    "half_math": "auto",
    # train.cuda_graphs: the timed steps replay each micro-batch's forward/backward from a CUDA graph
    # (mpt.graphs); the memory step stays eager. A GPU mode: rows on a CPU are skipped with a note.
    "cuda_graphs": False,
}


def _check(o: dict) -> None:
    from mpt.errors import UserError

    if o["batch"] < 1:
        raise UserError(f"batch={o['batch']} must be >= 1")
    if o["steps"] < 0 or o["warmup"] < 0 or o["overhead_rounds"] < 1:
        raise UserError("steps and warmup must be >= 0 (steps=0: memory only) and overhead_rounds >= 1")
    if o["width"] <= 0:
        raise UserError(f"width={o['width']} must be > 0 (1.0 = the paper's network)")
    if o["size"] != "auto":
        try:
            ok = int(o["size"]) >= 32
        except ValueError:
            ok = False
        if not ok:
            raise UserError(f"size={o['size']!r}: give an input size (>= 32: pixels, or spectrogram frames "
                            f"for the speech models) or auto (each model's own)")
    if o["half_math"] not in ("auto", "emulated", "native", "both"):
        raise UserError(f"half_math={o['half_math']!r}: choose one of auto, emulated, native, both")
    if o["cuda_graphs"] and o["compile"]:
        raise UserError("cuda_graphs=true and compile=true: torch.compile has its own CUDA graphs "
                        "(mode=reduce-overhead); choose one")
    check_tag(o["tag"])


def check_least(o: dict, least: dict[str, int]) -> None:
    """Each option named in `least` at least that (counts of steps, rounds...), or a one-line error before anything
    is measured."""
    from mpt.errors import UserError

    for k, n in least.items():
        if o[k] < n:
            raise UserError(f"{k}={o[k]}: give {n} or more")


def check_tag(tag: str, flag: str = "tag=") -> str:
    """A results file's tag as given (it ends the file's name), or a one-line error, said before anything is
    measured: letters, digits, '.', '-' and '_' only -- no folder, no path out of the results folder. (Every
    benchmark of this package names its results so.)"""
    from mpt.errors import UserError

    if tag and not re.fullmatch(r"[\w.-]+", tag):
        raise UserError(f"{flag}{tag!r}: use letters, digits, '.', '-' and '_' only (it becomes part of a file name)")
    return tag


def write_one_thread_result(out: str, bench: str, tag: str, result: dict, machine: str | None = None) -> None:
    """A one-thread CPU benchmark's figures (`result`, holding its "date" and "cpu") to
    <out>/cpu-<cpu>-<date>-<bench>[-<tag>].json, atomically; the path printed. `machine`: a GPU's name, for a
    run on it (<out>/<gpu>-<date>-...)."""
    import json
    import pathlib

    from experiments.speed_memory.loader import slug  # results named as the loader benchmark names them
    from mpt.rundir import atomic_write_text

    who = slug(machine) if machine else f"cpu-{slug(result['cpu'])}"
    path = pathlib.Path(out) / (f"{who}-{result['date'][:10]}-{bench}" + (f"-{tag}" if tag else "") + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(result, indent=1) + "\n")
    print(f"written: {path}")


def main(overrides: list[str]) -> dict:
    # torch here, not at the top: the package's gpu_check parent process imports none (its parts do)
    import torch

    from experiments.speed_memory import bench, engine_overhead, report
    from mpt.config_parse import parse_options
    from mpt.ranks import pick_device
    from mpt.rundir import now

    o = parse_options(list(overrides), DEFAULTS, "experiments.speed_memory")
    _check(o)
    names, skipped_models = bench.resolve_models(o["models"])
    precisions = bench.resolve_list(o["precisions"], bench.PRECISIONS, "precisions")
    impls = bench.resolve_list(o["impls"], ("autocast", "paper"), "impls")
    if "fp32" not in precisions:  # every ratio is to FP32 of the same run
        precisions.insert(0, "fp32")
        print("note: fp32 added to precisions: ratios are computed against FP32 of the same run", file=sys.stderr)
    device = pick_device(o["device"])
    if o["overhead"] not in ("none", *bench.WORKLOADS):
        from mpt.errors import UserError

        raise UserError(f"overhead={o['overhead']!r}: name a model ({', '.join(bench.WORKLOADS)}) or none")

    env = bench.environment(device)
    date = now()
    name = f"{bench.device_slug(env)}-{date[:10]}" + (f"-{o['tag']}" if o["tag"] else "")
    result = {
        "schema": report.SCHEMA, "command": "python -m experiments.speed_memory " + shlex.join(overrides),
        "date": date, "env": env, "options": {**o, "device": str(device)}, "data": bench.DATA_NOTE,
        "paper_models": [m for m in bench.PAPER_MODELS if m in names], "skipped_models": skipped_models,
        "rows": [], "engine_overhead": [], "goals": [], "anchors": report.ANCHORS,
    }

    def save():
        return report.write(report.refresh(result), o["out"], name)

    print(f"speed/memory on {env['device_name']}: {len(names)} models x {len(bench.cells(precisions, impls))} "
          f"precision/impl cells, batch {o['batch']}; {bench.DATA_NOTE}", file=sys.stderr)
    with bench.restored_backend_flags():
        for m in names:
            for prec, impl in bench.cells(precisions, impls):
                for hm in bench.half_maths(prec, o["half_math"]):
                    row = bench.measure(m, prec, impl, {**o, "half_math": hm}, device)
                    result["rows"].append(row)
                    print(_line(row), file=sys.stderr)
                    save()  # after every row: an interrupted run keeps what it measured
        ov = o["overhead"]
        if ov != "none" and o["steps"] > 0:
            size = None if o["size"] == "auto" else int(o["size"])
            for prec in [p for p in ("fp32", "mixed") if p in precisions]:
                try:
                    r = engine_overhead.measure(ov, prec, width=o["width"], batch=o["batch"], size=size,
                                                rounds=o["overhead_rounds"], steps=max(o["steps"] // 2, 1),
                                                device=str(device), channels_last=o["channels_last"])
                except torch.cuda.OutOfMemoryError as e:
                    r = {"model": ov, "precision": prec, "batch": o["batch"], "width": o["width"],
                         "overhead_pct": None, "note": f"oom: {str(e).splitlines()[0][:200]}"}
                result["engine_overhead"].append(r)
                print(f"engine overhead {ov} {prec}: " + (f"{r['overhead_pct']:+.1f}%" if r["overhead_pct"] is not None
                                                          else r["note"]), file=sys.stderr)
    env["load_avg_1min_end"] = bench._load_avg()
    path = save()
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return result


def _line(r: dict) -> str:
    head = f"{r['model']:16s} {r['precision']:12s} {r['impl'] or '-':8s} {r.get('half_math') or '-':8s}"
    if r["status"] != "ok":
        return f"{head} {r['status']}: {r['note']}"
    t = r.get("step_ms")
    tm = f"{t['median']:9.1f} ms/step [{t['p10']:.1f}-{t['p90']:.1f}] {r['throughput']:9.1f} {r['unit']}/s" if t \
        else "not timed"
    peak = f" peak {r['peak_gpu_mem_bytes'] / 2**20:,.0f} MiB" if r.get("peak_gpu_mem_bytes") else ""
    return f"{head} {tm}{peak} act {r['activation_bytes'] / 2**20:,.1f} MiB (only {r['activation_only_bytes'] / 2**20:,.1f})"
