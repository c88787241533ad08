"""The demo, end to end on this machine: `python -m experiments` (its time on 2 idle cores: README)

Every table and figure of the paper at CPU scale, from the real tools and the tiny data generators:
1. writes each tiny release in its official archive format (ILSVRC2012, PASCAL VOC, LibriSpeech,
   WMT15, 1B Word, CelebA) and prepares it with the real data_prep code (skipped where this code prepared
   it already; written again where other code did: prepare_tiny);
2. runs the tiny profile of every experiment's grid through the local launcher, as one pool of
   processes (longest runs first), three seeds wherever a table shows mean +- std:
   - Table 1: ResNet-50 (--models for others) in fp32, fp16 (the paper's MP, S = 1), mixed (dynamic S) and fp16_pure (no
     FP32 master copy), FP16 numerics sampled;
   - Table 2 and Figure 3: SSD and Faster R-CNN in fp32, fp16 (S = 1) and mixed with S = 8; SSD's
     activation-gradient histograms;
   - Table 3 and Figures 2a/2b: DeepSpeech 2 (English) in fp32 and fp16_storage (Table 3's MP: FP16
     storage, FP32 math), and fp16_pure on seed 0 (Figure 2a: the same without the FP32 master copy);
     weight-gradient histograms;
   - Figure 4: the translation LSTM in fp32, fp16 (S = 1) and mixed (dynamic S);
   - Figure 5: the bigLSTM without loss scaling (S = 1) and with the paper's S = 128, seed 0;
   - Figure 6: DCGAN in fp32 and mixed;
3. regenerates the paper's tables and figures from runs/ (python -m paper_tables).
`--full` runs every model, precision and seed of every tiny grid instead (Mandarin too; much longer).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import time

from mpt.errors import UserError, cli

# The Table 1 model of the default demo: the paper's PyTorch model. With AlexNet too the demo took
# 13.6 min on 2 cores under a load of ~3 (815 s, 64 runs); --models or --full for the others.
DEMO_MODELS = ("resnet50_preact",)
ALL_MODELS = ("alexnet", "vgg16", "googlenet", "inception_v2", "inception_v3", "resnet50_preact")

# name -> (data_prep package, extra prepare() keywords); data goes to <data-dir>/tiny_<name> and its
# archives to <data-dir>/tiny_<name>_archives, where each grid's tiny profile looks by default.
DATASETS = {"imagenet": ("imagenet", {"workers": 2}), "voc": ("voc", {}), "librispeech": ("librispeech", {}),
            "aishell": ("aishell", {}), "wmt15": ("wmt15", {"vocab": 200}), "lm1b": ("lm1b", {"workers": 2}),
            "celeba": ("celeba", {})}


def release_code(pkg: str) -> str:
    """A digest of the code that writes and prepares a tiny release: its data_prep package and data_prep's
    shared modules (the archive writers, espeak-ng's speech). Another digest: another release."""
    import data_prep
    from mpt.rundir import files_digest

    root = pathlib.Path(data_prep.__file__).parent
    return files_digest(root, sorted([*root.glob("*.py"), *(root / pkg).glob("*.py")]))


def prepare_tiny(name: str, data: pathlib.Path) -> pathlib.Path:
    """The tiny release of `name`, written in its official format and prepared by the real code. Prepared
    already by this code (`<data>.release.json` holds its digest): used as it is. Prepared by other code (a
    changed generator, or no record of one), it is written again: into new folders beside the old ones,
    each replacing its old one once complete -- so a changed generator never leaves an older release in use,
    and an interrupted rewrite leaves the prepared data of the old release whole (its record still the old
    code's: written again next time)."""
    import importlib
    import json
    import shutil

    from mpt.rundir import atomic_write_json

    pkg, kw = DATASETS[name]
    stamp = data.parent / f"{data.name}.release.json"
    code = release_code(pkg)
    if (data / "prepared.json").exists():
        try:
            if json.loads(stamp.read_text()).get("code") == code:
                return data
        except (OSError, ValueError, AttributeError):
            pass
        print(f"[demo] {data} was not prepared by this version of the tiny {name} release's code: writing it again")
    generate = importlib.import_module(f"data_prep.{pkg}.tiny").generate
    prepare = importlib.import_module(f"data_prep.{pkg}.prepare").prepare
    archives = data.parent / (data.name + "_archives")
    new_data, new_archives = (p.with_name(f".{p.name}.new") for p in (data, archives))
    for p in (new_data, new_archives):  # (an interrupted rewrite's)
        shutil.rmtree(p, ignore_errors=True)
    print(f"[demo] writing the tiny {name} release to {archives} and preparing {data}")

    def replace(new: pathlib.Path, old: pathlib.Path) -> None:
        shutil.rmtree(old, ignore_errors=True)
        new.rename(old)

    written = generate(new_archives)
    replace(new_archives, archives)  # (first: prepared.json records the archives it read, by path)
    # lm1b's generator returns its one archive file, which its prepare() takes; the others a folder.
    prepare(archives / written.name if name == "lm1b" else archives, new_data, log=lambda *a: None, **kw)
    replace(new_data, data)
    atomic_write_json(stamp, {"release": name, "code": code})
    return data


def plan(models, full: bool) -> list[tuple[str, str, list[str]]]:
    """(grid file, dataset, submit arguments) for every grid the demo runs."""
    one = lambda **kv: [f"--only={k}={v}" for k, vs in kv.items() for v in ([vs] if isinstance(vs, str) else vs)]  # noqa: E731
    if full:
        return [("ilsvrc_cnns/grid.yaml", "imagenet", []),
                ("voc_detection/grid.yaml", "voc", []), ("voc_detection/grid_scaled.yaml", "voc", []),
                ("deepspeech2/grid.yaml", "librispeech", one(model="english")),
                ("deepspeech2/grid.yaml", "aishell", one(model="mandarin")),
                ("wmt_translation/grid.yaml", "wmt15", []), ("wmt_translation/grid_scaled.yaml", "wmt15", []),
                ("lm_biglstm/grid.yaml", "lm1b", []), ("lm_biglstm/grid_scaled.yaml", "lm1b", []),
                ("dcgan/grid.yaml", "celeba", [])]
    return [("ilsvrc_cnns/grid.yaml", "imagenet", one(model=list(models))),
            ("voc_detection/grid.yaml", "voc", []), ("voc_detection/grid_scaled.yaml", "voc", []),
            # Table 3's two columns over three seeds (its MP is fp16_storage, section 4.3); Figure 2a sets
            # fp16_storage beside fp16_pure (the master copy the one difference), the latter on seed 0
            ("deepspeech2/grid.yaml", "librispeech", one(model="english", precision=["fp32", "fp16_storage"])),
            ("deepspeech2/grid.yaml", "librispeech", one(model="english", precision=["fp16_pure"], seed="0")),
            ("wmt_translation/grid.yaml", "wmt15", []), ("wmt_translation/grid_scaled.yaml", "wmt15", []),
            # Figure 5: S = 1 against the paper's S = 128 (section 4.5). At this scale the two agree: the
            # paper saw S = 1 fall behind only after ~300K iterations (experiments/lm_biglstm/README.md).
            ("lm_biglstm/grid.yaml", "lm1b", one(precision=["fp32", "fp16"], seed="0")),
            ("lm_biglstm/grid_scaled.yaml", "lm1b", one(loss_scale="128", seed="0")),
            # Figure 6: FP32 beside MP without loss scaling (the paper's pair, 4.6), mixed as an extra panel
            ("dcgan/grid.yaml", "celeba", one(precision=["fp32", "fp16", "mixed"]))]


def first_seeds(grid: str, n: int, only: list[str]) -> list[str]:
    """--only filters keeping the first n seeds of the grid's tiny profile, where the plan does not pick
    seeds itself."""
    if any(o.startswith("--only=seed=") for o in only):
        return []
    from slurm.grid import load

    seeds = load(pathlib.Path("experiments") / grid, "tiny").axes.get("seed", [])
    return [f"--only=seed={s}" for s in seeds[:n]]


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default="data", help="where the tiny releases are written and prepared "
                   "(<data-dir>/tiny_<name>; default: data)")
    p.add_argument("--models", nargs="+", default=list(DEMO_MODELS), choices=ALL_MODELS,
                   help=f"Table 1 models (default: {' '.join(DEMO_MODELS)})")
    p.add_argument("--full", action="store_true", help="every model, precision and seed of every tiny grid")
    p.add_argument("--seeds", type=int, metavar="N", help="only the first N seeds of every cell (default: all, "
                   "3 for the tables' cells): 1 is a quicker look whose tables have no ± std")
    p.add_argument("--jobs", type=int, help="runs at once (default: one per core)")
    p.add_argument("--runs", default="runs", help="where the runs go (every cell's out_dir; default: runs)")
    p.add_argument("--tables-out", default="paper_tables/out", help="where tables, figures, report.html go")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE", dest="extra",
                   help="extra config overrides for every run (e.g. train.max_steps=4 for a smoke test)")
    args = p.parse_args(argv)
    if args.seeds is not None and args.seeds < 1:
        raise UserError(f"--seeds {args.seeds}: give 1 or more (the first N seeds of every cell)")
    t0 = time.time()
    grids = plan(args.models, args.full)
    if args.seeds is not None:
        grids = [(g, d, only + first_seeds(g, args.seeds, only)) for g, d, only in grids]
    names = list(dict.fromkeys(d for _, d, _ in grids))
    # The releases are independent: two at a time (the speech one, espeak-ng utterance by utterance, is
    # half of the ~24 s). Spawned, not forked: the launcher's forkserver must start after, preloaded. A
    # spawned process does not import a package's __main__, so prepare_tiny goes by its module's own name.
    import concurrent.futures
    import importlib
    import multiprocessing

    prepare = importlib.import_module("experiments.__main__").prepare_tiny
    with concurrent.futures.ProcessPoolExecutor(min(len(names), args.jobs or os.cpu_count() or 1),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {name: pool.submit(prepare, name, pathlib.Path(args.data_dir) / f"tiny_{name}") for name in names}
        data = {name: f.result() for name, f in futures.items()}
    print(f"[demo] data ready in {time.time() - t0:.0f} s")
    from slurm import local, submit

    subs = [submit.prepare([f"experiments/{grid}", "--profile", "tiny", "--backend", "local",
                            "--set", f"out_dir={args.runs}", f"task.data_root={data[d]}", *args.extra, *only])
            for grid, d, only in grids]
    t1 = time.time()
    failed = None
    try:
        local.run_locally(subs, args.jobs)
    except SystemExit as e:  # some cells failed: the tables still show the others, and mark those
        failed = e
    print(f"[demo] {sum(len(s.todo) for s in subs)} runs in {time.time() - t1:.0f} s")
    from paper_tables.__main__ import main as tables

    print("[demo] regenerating the paper's tables and figures from runs/")
    tables(["--runs", args.runs, "--out", args.tables_out])
    if failed is not None:
        raise failed
    print(f"[demo] done in {time.time() - t0:.0f} s: see {args.tables_out}/index.md and {args.tables_out}/report.html")


if __name__ == "__main__":
    main()
