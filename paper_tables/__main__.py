"""python -m paper_tables [--runs DIR] [--wandb ENTITY/PROJECT] [--out DIR]
python -m paper_tables export --runs DIR --out experiments/<name>/results/<file>.jsonl [--experiment NAME] [--machine TEXT]
python -m paper_tables readme [--check] [FILE.md ...]

Collects results (run directories by default, or a wandb project), writes Tables 1-3 as Markdown,
LaTeX and CSV, Figures 2-6 and the loss-scale trajectories as PNG and SVG, out/index.md and one
self-contained out/report.html. Results it did not expect are listed, never fatal.
`export` writes run directories as a committed results file (one JSON line per run); `readme` rewrites
the README tables generated from those files (paper_tables/committed.py)."""
from __future__ import annotations

import argparse
import pathlib
import sys

from mpt.errors import UserError, cli
from mpt.rundir import storage_error
from paper_tables import committed, report, results


def export_main(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m paper_tables export",
                                description="Run directories -> a committed results file, one JSON line per run.")
    p.add_argument("--runs", required=True, help="folder of run directories (<experiment>/<run>/summary.json)")
    p.add_argument("--out", required=True, help="the results file, e.g. experiments/<name>/results/demo.jsonl")
    p.add_argument("--experiment", help="only this experiment's runs")
    p.add_argument("--machine", help="what ran them, e.g. the CPU's name (default: env.json's device_name)")
    args = p.parse_args(argv)
    if not pathlib.Path(args.runs).is_dir():
        raise UserError(f"--runs {args.runs}: no such directory; pass the folder that holds <experiment>/<run>/summary.json")
    lines = committed.export(args.runs, args.out, experiment=args.experiment, machine=args.machine)
    print(f"{args.out}: {len(lines)} run(s); `python -m paper_tables readme` regenerates the README tables from it")
    return 0


def readme_main(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m paper_tables readme",
                                description="Rewrite the README tables generated from committed results files.")
    p.add_argument("files", nargs="*", help="Markdown files (default: every README and docs/*.md with a block)")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    args = p.parse_args(argv)
    paths = [pathlib.Path(f) for f in args.files] or committed.doc_files()
    missing = [str(f) for f in paths if not f.is_file()]
    if missing:
        raise UserError(f"{', '.join(missing)}: no such file; pass Markdown files holding a paper_tables block")
    if args.check:
        old = committed.stale(paths)
        for f in old:
            print(f"{f}: stale; run `python -m paper_tables readme`")
        return 1 if old else 0
    for f in committed.rewrite(paths):
        print(f"{f}: rewritten")
    print(f"{len(paths)} file(s) with paper_tables blocks checked")
    return 0


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m paper_tables", description=__doc__.split("\n\n")[1])
    p.add_argument("--runs", default="runs", help="folder of run directories (default: runs)")
    p.add_argument("--wandb", metavar="ENTITY/PROJECT", help="read runs from this wandb project instead")
    p.add_argument("--out", default="paper_tables/out", help="output folder (default: paper_tables/out)")
    return p.parse_args(argv)


@cli
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "export":
        return export_main(argv[1:])
    if argv and argv[0] == "readme":
        return readme_main(argv[1:])
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
