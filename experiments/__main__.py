"""The demo, end to end on this machine: `python -m experiments` (about 10 minutes on 2 cores)

Shows the paper's claims at CPU scale, from the real tools and the tiny data generators:
1. makes the tiny synthetic ImageNet and 1B Word releases in their official archive formats and
   prepares them with the real data_prep code (skipped when already prepared);
2. Table 1 (tiny): the ILSVRC grid (experiments/ilsvrc_cnns/grid.yaml, profile tiny) for a few
   models: fp32, fp16 (the paper's MP, S = 1), mixed (dynamic S) and fp16_pure (no FP32 master copy:
   Figure 2a's ablation), three seeds each, with FP16 numerics sampled (Figures 2b and 3) and the
   loss-scale trajectories of the mixed runs;
3. Figure 5 (tiny): the bigLSTM without loss scaling (S = 1) and with the paper's S = 128, seed 0;
4. regenerates the paper's tables and figures from runs/ (python -m paper_tables).
`--full` runs every Table 1 model and every LM cell and seed instead (much longer).
"""
from __future__ import annotations

import argparse
import pathlib
import time

from mpt.errors import cli

# The Table 1 models of the default demo: the paper's PyTorch model and a plain (no batch-norm) Caffe
# net, the cheapest of each kind on a CPU (FP16 runs ~3x slower than FP32 there); with BN-Inception
# the demo took 18 min on 2 busy cores. --models or --full for the others.
DEMO_MODELS = ("resnet50_preact", "alexnet")
ALL_MODELS = ("alexnet", "vgg16", "googlenet", "inception_v2", "inception_v3", "resnet50_preact")


def _imagenet(data: pathlib.Path) -> None:
    if (data / "prepared.json").exists():
        return
    from data_prep.imagenet import prepare as prep
    from data_prep.imagenet.tiny import generate

    archives = data.parent / (data.name + "_archives")
    print(f"[demo] writing the tiny ILSVRC2012 archives to {archives} and preparing {data}")
    generate(archives)
    prep.prepare(archives, data, workers=2)


def _lm1b(data: pathlib.Path) -> None:
    if (data / "prepared.json").exists():
        return
    from data_prep.lm1b import prepare as prep
    from data_prep.lm1b.tiny import generate

    archives = data.parent / (data.name + "_archive")
    print(f"[demo] writing the tiny 1B Word release to {archives} and preparing {data}")
    info = prep.prepare(generate(archives), data, workers=2, log=lambda *a: None)
    print(f"[demo] prepared {data}: {info['vocab_size']} words, {info['totals']['train_tokens']:,} training tokens")


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/tiny_imagenet", help="where the tiny ImageNet is prepared")
    p.add_argument("--lm-data", default="data/tiny_lm1b", help="where the tiny 1B Word is prepared")
    p.add_argument("--models", nargs="+", default=list(DEMO_MODELS), choices=ALL_MODELS,
                   help=f"Table 1 models (default: {' '.join(DEMO_MODELS)})")
    p.add_argument("--full", action="store_true", help="every Table 1 model, every LM cell and seed")
    p.add_argument("--jobs", type=int, help="runs at once (default: one per core)")
    p.add_argument("--runs", default="runs", help="where the runs go (every cell's out_dir; default: runs)")
    p.add_argument("--tables-out", default="paper_tables/out", help="where tables, figures, report.html go")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE", dest="extra",
                   help="extra config overrides for every run (e.g. train.max_steps=4 for a smoke test)")
    args = p.parse_args(argv)
    t0 = time.time()
    data, lm_data = pathlib.Path(args.data), pathlib.Path(args.lm_data)
    _imagenet(data)
    _lm1b(lm_data)
    from slurm import submit

    local = ["--profile", "tiny", "--backend", "local", "--set", f"out_dir={args.runs}", *args.extra]
    local += ["--jobs", str(args.jobs)] if args.jobs else []
    models = ALL_MODELS if args.full else args.models
    print(f"[demo] Table 1 and Figures 2a/2b/3 (tiny): {', '.join(models)} x fp32/fp16/mixed/fp16_pure x 3 seeds")
    submit.main(["experiments/ilsvrc_cnns/grid.yaml", *local, "--set", f"task.data_root={data}",
                 *[f"--only=model={m}" for m in models]])
    # Figure 5: S = 1 against the paper's S = 128 (section 4.5). At this scale the two agree: the
    # paper saw S = 1 fall behind only after ~300K iterations (experiments/lm_biglstm/README.md).
    lm_only = [] if args.full else ["--only=seed=0"]
    print("[demo] Figure 5 (tiny): bigLSTM " + ("every cell" if args.full else "fp32, fp16 (S = 1) and mixed S = 128, seed 0"))
    submit.main(["experiments/lm_biglstm/grid.yaml", *local, "--set", f"task.data_root={lm_data}", *lm_only,
                 *([] if args.full else ["--only=precision=fp32", "--only=precision=fp16"])])
    submit.main(["experiments/lm_biglstm/grid_scaled.yaml", *local, "--set", f"task.data_root={lm_data}", *lm_only,
                 *([] if args.full else ["--only=loss_scale=128"])])
    from paper_tables.__main__ import main as tables

    print("[demo] regenerating the paper's tables and figures from runs/")
    tables(["--runs", args.runs, "--out", args.tables_out])
    print(f"[demo] done in {time.time() - t0:.0f} s: see {args.tables_out}/index.md and {args.tables_out}/report.html")


if __name__ == "__main__":
    main()
