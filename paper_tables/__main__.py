"""python -m paper_tables [--runs DIR] [--wandb ENTITY/PROJECT] [--out DIR]

Collects results (run directories by default, or a wandb project), writes Tables 1-3 as Markdown,
LaTeX and CSV, Figures 2-6 and the loss-scale trajectories as PNG and SVG, out/index.md and one
self-contained out/report.html. Results it did not expect are listed, never fatal."""
from __future__ import annotations

import argparse
import pathlib
import sys

from mpt.errors import UserError, cli
from mpt.rundir import storage_error
from paper_tables import report, results


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m paper_tables", description=__doc__.split("\n\n")[1])
    p.add_argument("--runs", default="runs", help="folder of run directories (default: runs)")
    p.add_argument("--wandb", metavar="ENTITY/PROJECT", help="read runs from this wandb project instead")
    p.add_argument("--out", default="paper_tables/out", help="output folder (default: paper_tables/out)")
    return p.parse_args(argv)


@cli
def main(argv=None) -> int:
    args = parse_args(argv)
    out = pathlib.Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory; pass a folder")
    if args.wandb:
        runs, problems = results.collect_wandb(args.wandb)
        source = f"wandb project {args.wandb}"
    else:
        runs, problems = results.collect_dir(args.runs)
        source = f"run directories under {args.runs}"
    rep = report.build(runs, problems, source)
    try:
        report.write(rep, out)
    except OSError as e:  # a read-only, full or unwritable --out: one line naming it (README "Bad input")
        raise storage_error(e, out) or e from None
    # What these runs filled, one line each; the rest in one line (index.md lists each with why and how).
    empty_tables, empty_figures = [], []
    for sec in rep.sections:
        for t in sec.tables:
            done = sum(c.n > 0 for c in t.cells.values())
            if not t.n_runs:
                empty_tables.append(t.stem)
                continue
            print(f"{out / t.stem}.{{md,tex,csv}}: {done}/{len(t.cells)} cells with results, {t.n_runs} run(s)"
                  + (f"; the {len(t.cells) - done} others not run here (the table says how to fill them)"
                     if done < len(t.cells) else ""))
        for f in sec.figures:
            if f.missing:
                empty_figures.append(f.stem)
            else:
                print(f"{out / f.stem}.{{png,svg}}")
    if empty_tables or empty_figures:
        print(f"no runs here for {len(empty_tables)} table(s) ({', '.join(empty_tables) or '-'}) and "
              f"{len(empty_figures)} figure(s) ({', '.join(empty_figures) or '-'}): written as placeholders; "
              f"index.md says why and which grid fills each")
    print(f"{out / 'index.md'}, {out / 'report.html'}; {len(rep.problems)} skipped or questionable result(s)"
          + (" (listed in index.md)" if rep.problems else ""))
    for p in rep.problems:
        print(f"  {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
