"""`python -m mpt.doctor TARGET [key=value ...] [--steps N] ...`: the command line (what it does: the package
docstring)."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import mpt.doctor
from mpt.doctor.examination import examine
from mpt.doctor.keep_wide import FORMAT_OF as KEEP_WIDE
from mpt.doctor.report import text_report, wrap, write
from mpt.doctor.targets import STEPS, load
from mpt.doctor.verdict import TOLERANCE
from mpt.errors import UserError, cli
from mpt.ranks import pick_device


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m mpt.doctor", description=mpt.doctor.__doc__.split("\n")[0],
                                epilog="e.g. python -m mpt.doctor mpt.doctor.examples:underflow")
    p.add_argument("target", help="module:function, module:TaskClass or experiment:NAME")
    p.add_argument("overrides", nargs="*", help="key=value config overrides (experiment:NAME only)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"training steps per phase (default {STEPS})")
    p.add_argument("--profile", default=None, help="the experiment's profile (experiment:NAME only), e.g. tiny")
    p.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda, cuda:N")
    p.add_argument("--out", default=None, help="folder for report.md, report.json, histograms.png "
                                               "(default doctor_out/<target>)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help=f"share of non-zero gradient values allowed to flush to zero (default {TOLERANCE})")
    p.add_argument("--no-verify", action="store_true", help="skip the replay in the recommended recipe")
    p.add_argument("--keep-wide", nargs="?", const="fp16", default=None, metavar="PRECISION",
                   help=f"find the smallest set of modules to keep wide for PRECISION to train ({', '.join(KEEP_WIDE)}; "
                        "default fp16), each set checked by a replay")
    p.add_argument("--wide", default="fp32", choices=("fp32", "bf16"), help="what kept modules compute in")
    p.add_argument("--formats", action="store_true", help="also find the narrowest simulated format (fp8, "
                   "fp8_block, mxfp8, nvfp4, ...) that trains as FP32 does, with the modules it keeps wide, each "
                   "answer a replay")
    a = p.parse_intermixed_args(argv)
    if a.steps < 1:
        raise UserError(f"--steps={a.steps}: need at least 1 step")
    if not 0 <= a.tolerance < 1:
        raise UserError(f"--tolerance={a.tolerance}: need a share in [0, 1)")
    device = pick_device(a.device)
    patient = load(a.target, a.overrides, a.profile, a.steps)
    if a.keep_wide and a.keep_wide not in KEEP_WIDE:
        raise UserError(f"--keep-wide {a.keep_wide}: choose one of {', '.join(KEEP_WIDE)}")
    rep = examine(patient, a.steps, device, a.tolerance, verify=not a.no_verify, keep_wide=a.keep_wide, wide=a.wide,
                  narrowest=a.formats)
    out = Path(a.out) if a.out else Path("doctor_out") / re.sub(r"[^\w.-]+", "_", a.target)
    lines = wrap(text_report(rep))
    files = write(rep, out)
    print("\n".join(lines))
    print(f"wrote {', '.join(str(f) for f in files)} ({rep['wall_s']:.1f} s)")
    return rep


if __name__ == "__main__":
    cli(main)(sys.argv[1:])
