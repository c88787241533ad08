"""The command line of `python -m experiments.speed_memory.gpu_check` (the package's docstring says what
a call runs): options checked into one-line errors, then a call, a part's child process, --report or
--source-digest."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.speed_memory import gpu_check
from experiments.speed_memory.gpu_check.parts import CIFAR_PRECISIONS, GRAPHED, PARTS, TABLE1, TABLE3, cifar_cell
from experiments.speed_memory.gpu_check.report import write_report
from experiments.speed_memory.gpu_check.runner import (COMMAND, DEFAULT_CALL_S, RESULTS_DIR, SMOKE_CALL_S, child_main,
                                                       run_call, source_digest)
from mpt.errors import UserError, cli


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # bad input is one line and exit 2 (mpt.errors.cli), not argparse's usage block
        raise UserError(f"{message} ({COMMAND} --help)")


def _parse(argv):
    p = _Parser(prog=COMMAND, description=gpu_check.__doc__.split("\n\n")[0])
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
    p.add_argument("--cifar", default=",".join(CIFAR_PRECISIONS), help="the cifar part's cells, a run of each per "
                   "seed: precisions, each optionally +emulated (its FP16/BF16 dot products by mpt.half_math's "
                   "FP32 arithmetic rounded once, the CPU runs' arithmetic, on the GPU; e.g. fp32,fp16,fp16+emulated)")
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
    a.cifar = tuple(x.strip() for x in a.cifar.split(",") if x.strip())
    bad = [x for x in a.cifar if cifar_cell(x) is None]
    if bad or not a.cifar:
        raise UserError(f"--cifar {','.join(bad) or '(empty)'}: give precisions of mpt.precisions, each optionally "
                        f"+emulated, e.g. fp32,fp16,fp16+emulated")
    a.selection = ["--models", ",".join(a.models), "--graphed", ",".join(a.graphed) or "none",
                   "--e2e-workers", ",".join(a.e2e_workers), "--cifar", ",".join(a.cifar)]
    if a.budget is not None and a.budget <= 0:
        raise UserError(f"--budget {a.budget:g}: give a positive number of seconds")
    return a


@cli
def main(argv=None) -> int:
    a = _parse(sys.argv[1:] if argv is None else argv)
    if a._part:  # a child: one part
        return child_main(a._part, Path(a._state), a.cpu_smoke, Path(a._work),
                          {"models": a.models, "graphed": a.graphed, "e2e_workers": a.e2e_workers,
                           "cifar": a.cifar})
    if a.report:
        return write_report([Path(x) for x in a.report])
    if a.source_digest:
        print(source_digest())
        return 0
    return run_call(a, argv)
