"""The demo, end to end on this machine: `python -m experiments`

1. makes the tiny synthetic ImageNet with the real tools (the official archive format, then the real
   prep) unless data/tiny_imagenet is already prepared;
2. runs the tiny Table 1 grid (experiments/ilsvrc_cnns/grid.yaml, profile tiny) with the local backend;
3. regenerates the paper's tables and figures from runs/ (python -m paper_tables).
"""
from __future__ import annotations

import argparse
import pathlib
import time

from mpt.errors import cli


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments", description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", default="experiments/ilsvrc_cnns/grid.yaml")
    p.add_argument("--profile", default="tiny")
    p.add_argument("--data", default="data/tiny_imagenet", help="where the tiny ImageNet is prepared")
    args = p.parse_args(argv)
    t0 = time.time()
    data = pathlib.Path(args.data)
    if not (data / "prepared.json").exists():
        from data_prep.imagenet import prepare as prep
        from data_prep.imagenet.tiny import generate

        archives = data.parent / "tiny_archives"
        print(f"[demo] writing the tiny ILSVRC2012 archives to {archives} and preparing {data}")
        generate(archives)
        prep.prepare(archives, data)
    from slurm import submit

    print(f"[demo] running {args.grid} (profile {args.profile}) on this machine")
    submit.main([args.grid, "--profile", args.profile, "--backend", "local"])
    from paper_tables.__main__ import main as tables

    print("[demo] regenerating the paper's tables from runs/")
    tables([])
    print(f"[demo] done in {time.time() - t0:.0f} s: see paper_tables/out/index.md and paper_tables/out/report.html")


if __name__ == "__main__":
    main()
