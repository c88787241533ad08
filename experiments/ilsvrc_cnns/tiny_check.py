"""The tiny profile over seeds, on one or more prepared datasets: a mean +- std top-1 table.

    python -m experiments.ilsvrc_cnns.tiny_check --data data/digits --data data/tiny_imagenet \\
        [--seeds 0 1 2] [--models alexnet vgg16 ...] [--precisions fp32 fp16 mixed] \\
        [--out /tmp/tiny_check] [--threads N] [key=value ...]

Each cell is one ordinary run (mpt.cli.main("ilsvrc_cnns", ["profile=tiny", ...])) writing its
run directory under --out; a completed cell is reused, not retrained. Extra key=value overrides go
to every run (for trying a recipe change before writing it into config.yaml). Prints, per dataset, top-1
mean +- std (n) per model x precision, the runs that did not complete, and the mean wall time per run.

The real-data check: on scikit-learn's digits (python -m data_prep.imagenet.digits) every
model of Table 1 reaches >= 90% top-1 in fp32, fp16 and mixed; the synthetic set
(python -m data_prep.imagenet.tiny) is learned too. Both prepared with python -m data_prep.imagenet.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

MODELS = ["alexnet", "vgg16", "googlenet", "inception_v2", "inception_v3", "resnet50_preact"]
PRECISIONS = ["fp32", "fp16", "mixed"]


def run_cell(data: Path, model: str, precision: str, seed: int, out: Path, extra=(), profile: str = "tiny") -> dict:
    """One tiny-profile run through the normal entry point; returns its summary.json content
    (status, metrics.top1, wall_time_s, skipped_steps, ...)."""
    from mpt.cli import main
    from mpt.errors import UserError

    overrides = [f"profile={profile}", f"model={model}", f"precision={precision}", f"seed={seed}",
                 f"task.data_root={data}", f"out_dir={out}", "wandb.mode=disabled",
                 "train.progress=false", *extra]
    start, cpu = time.time(), time.process_time()
    try:
        s = main("ilsvrc_cnns", overrides)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 -- a failed run is a cell of the table, not the end of the check
        s = {"status": "failed", "metrics": {}, "error": f"{type(e).__name__}: {e}"}
    s.setdefault("wall_time_s", None)
    s["check_seconds"] = time.time() - start
    # CPU seconds of this process for the run (data loading included with train.num_workers=0): its cost on
    # one core, unlike the wall time, whatever else shares the core
    s["cpu_seconds"] = time.process_time() - cpu
    return s


def fmt(values: list[float]) -> str:
    if not values:
        return "--"
    m = statistics.mean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{m:.1f} +- {sd:.1f} ({len(values)})"


def table(results: dict, models, precisions) -> str:
    lines = ["| model | " + " | ".join(precisions) + " | s/run (" + "/".join(precisions) + ") |",
             "|---|" + "---|" * (len(precisions) + 1)]
    for m in models:
        cells, secs = [], []
        for p in precisions:
            runs = results.get((m, p), [])
            top1 = [r["metrics"]["top1"] for r in runs if r.get("status") == "completed"]
            bad = [r["status"] for r in runs if r.get("status") != "completed"]
            cells.append(fmt(top1) + (f" [{', '.join(bad)}]" if bad else ""))
            w = [r["wall_time_s"] for r in runs if r.get("wall_time_s")]
            secs.append(f"{statistics.mean(w):.1f}" if w else "--")
        lines.append(f"| {m} | " + " | ".join(cells) + " | " + "/".join(secs) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.ilsvrc_cnns.tiny_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--data", action="append", required=True, type=Path,
                   help="a prepared dataset (output of python -m data_prep.imagenet); repeatable")
    p.add_argument("--profile", default="tiny", help="the CPU profile of config.yaml (real: resnet8_cifar on photographs)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--precisions", nargs="+", default=PRECISIONS)
    p.add_argument("--out", type=Path, default=Path("runs/tiny_check"))
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    p.add_argument("--json", type=Path, help="also write every cell's summary here")
    a, extra = p.parse_known_args(argv)
    # key=value overrides written after a list option (--precisions fp32 optim.lr=0.1) land in that list
    for name in ("models", "precisions"):
        vals = getattr(a, name)
        extra += [v for v in vals if "=" in v]
        setattr(a, name, [v for v in vals if "=" not in v])
    bad = [x for x in extra if "=" not in x]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    if a.threads < 0:
        from mpt.errors import UserError

        raise UserError(f"--threads {a.threads}: give 1 or more (0: torch's default)")
    if a.threads:
        import torch
        torch.set_num_threads(a.threads)
    report = {}
    for data in a.data:
        results: dict = {}
        for m in a.models:
            for prec in a.precisions:
                for seed in a.seeds:
                    s = run_cell(data, m, prec, seed, a.out, extra, a.profile)
                    results.setdefault((m, prec), []).append(s)
                    print(f"{data.name} {m} {prec} s{seed}: {s['status']} top1="
                          f"{s['metrics'].get('top1', float('nan')):.1f} skipped={s.get('skipped_steps')} "
                          f"{s.get('wall_time_s') or 0:.1f} s wall, {s['cpu_seconds']:.1f} s CPU", flush=True)
        report[str(data)] = results
        print(f"\n{data}: profile {a.profile}, top-1 %, mean +- std (n seeds){' ' + ' '.join(extra) if extra else ''}")
        print(table(results, a.models, a.precisions), flush=True)
    if a.json:
        a.json.write_text(json.dumps({d: {f"{m}/{p}": v for (m, p), v in r.items()}
                                      for d, r in report.items()}, indent=1, default=str))
    return report


if __name__ == "__main__":
    from mpt.errors import cli

    cli(main)()
