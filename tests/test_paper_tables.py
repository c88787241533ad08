"""paper_tables on constructed results: statistics, the difference column, every status marker,
tiny/paper separation, LaTeX shape, CSV round trip, bad input, wandb mapping, figures, and the HTML
report rendered in headless Chromium."""
from __future__ import annotations

import json
import math
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from paper_tables import __main__ as cli_main
from paper_tables import report, results, specs, tables

CHROMIUM = pathlib.Path("/usr/bin/chromium")
ENV = {"git_commit": "0123456789abcdef", "git_dirty": True, "python": "3.11.9", "torch": "2.14.1",
       "torchvision": "0.29.1", "cuda": "12.8", "device_name": "NVIDIA H100 80GB HBM3",
       "tf32_matmul": False, "tf32_cudnn": False, "hostname": "node1", "world_size": 1,
       "date": "2025-01-01T00:00:00+00:00"}


def write_run(root, experiment, model, precision, seed, *, status="completed", metrics=None,
              profile="paper", loss_scale="auto", tf32=False, impl="autocast", updated=None,
              step=500, total_steps=500, train=None, numerics=(), samples=False, env=ENV, name=None):
    """One run directory in the contract's layout (contracts: "Run directory")."""
    digest = abs(hash((profile, loss_scale, tf32, impl, updated))) % 10**10
    d = pathlib.Path(root) / experiment / (name or f"{model}-{precision}-s{seed}-{digest:010d}")
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"experiment": experiment, "model": model, "precision": precision, "seed": seed,
           "profile": profile, "loss_scale": loss_scale, "tf32": tf32, "impl": impl, "out_dir": str(root)}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "env.json").write_text(json.dumps(env))
    summary = {"status": status, "experiment": experiment, "model": model, "precision": precision,
               "impl": impl, "loss_scale": loss_scale, "seed": seed, "profile": profile,
               "cell_id": "abc", "run_name": d.name, "metrics": metrics or {}, "step": step,
               "total_steps": total_steps, "skipped_steps": 3, "throughput": 1.0,
               "peak_gpu_mem_bytes": None, "activation_bytes": 0, "wall_time_s": 1.0, "error": None,
               "env": env, "updated": updated or "2025-01-01T00:00:00+00:00"}
    (d / "summary.json").write_text(json.dumps(summary))
    lines = []
    for i, (loss, scale) in enumerate(train or []):
        lines.append({"kind": "train", "step": i * 10, "epoch": i / 10, "loss": loss, "lr": 0.1,
                      "loss_scale": scale, "skipped_steps": 0, "throughput": 1.0, "time": i})
    lines += [{"kind": "numerics", "step": 100 * i, **n} for i, n in enumerate(numerics)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if samples:
        import matplotlib.image

        rng = np.random.default_rng(seed)
        for k in (100, 2000):  # natural sort must pick 2000, not 100
            matplotlib.image.imsave(d / f"samples_{k}.png", rng.random((16, 16, 3)))
    return d


def build(root):
    runs, problems = results.collect_dir(root)
    return runs, problems, report.build(runs, problems, "test")


def table_of(rep, table_id, profile="paper"):
    sec = next(s for s in rep.sections if s.profile == profile)
    return next(t for t in sec.tables if t.spec.id == table_id)


def cell(t, model, col_prefix):
    cid = next(c.id for c in t.columns if c.id.startswith(col_prefix))
    return t.cells[(model, cid)]


# ----------------------------------------------------------------------------- statistics
def test_mean_std_n_and_difference(tmp_path):
    for seed, v in ((1, 56.0), (2, 57.0), (3, 58.0)):
        write_run(tmp_path, "ilsvrc_cnns", "alexnet", "fp32", seed, metrics={"top1": v, "top5": 80.0})
    write_run(tmp_path, "deepspeech2", "ds2_english", "fp32", 1, metrics={"cer": 2.5})  # alias of english
    _, problems, rep = build(tmp_path)
    assert problems == []
    c = cell(table_of(rep, "table1"), "alexnet", "fp32")
    assert (c.n, c.mean, c.std) == (3, 57.0, 1.0)
    assert c.diff == pytest.approx(57.0 - 56.77)
    assert c.ours_text() == "57.00 ± 1.00 (n=3)" and c.paper_text() == "56.77" and c.diff_text() == "+0.23"
    # Lower-is-better metric: the difference is still ours - paper, its sign not flipped.
    c3 = cell(table_of(rep, "table3"), "english", "fp32")
    assert (c3.n, c3.std, c3.ours_text(), c3.diff_text()) == (1, None, "2.50 (n=1)", "+0.30")
    # A paper column with no run is a placeholder that says missing but keeps the paper's number;
    # Table 1's MP is the paper's: FP16 with an FP32 master copy and S = 1 (section 4.1).
    mp = cell(table_of(rep, "table1"), "alexnet", "fp16_S1")
    assert (mp.ours_text(), mp.paper_text(), mp.diff_text()) == ("not run", "56.93", "—")


def test_table1_mp_column_is_the_papers_run_without_loss_scaling(tmp_path):
    """Table 1's one MP column is FP16 with S = 1 (4.1: these CNNs needed no scaling): a dynamic-S or
    S = 8 mixed run is an extra column beside it, without the paper's number, never averaged into it."""
    write_run(tmp_path, "ilsvrc_cnns", "alexnet", "fp16", 1, metrics={"top1": 56.0})
    write_run(tmp_path, "ilsvrc_cnns", "alexnet", "mixed", 1, metrics={"top1": 50.0})
    write_run(tmp_path, "ilsvrc_cnns", "alexnet", "mixed", 2, loss_scale=8, metrics={"top1": 40.0})
    _, problems, rep = build(tmp_path)
    assert problems == []
    t = table_of(rep, "table1")
    mp = next(c for c in t.columns if c.paper_key == "mp")
    assert t.cells[("alexnet", mp.id)].values == [56.0]
    extra = [c for c in t.columns if c.paper_key is None and c.variant[0] == "mixed"]
    assert len(extra) == 2 and all(t.cells[("alexnet", c.id)].paper is None for c in extra)
    assert sorted(t.cells[("alexnet", c.id)].mean for c in extra) == [40.0, 50.0]


def test_table3_mp_column_is_fp16_storage(tmp_path):
    """The paper ran DeepSpeech 2 as "FP16 storage, FP32 math" (4.3): Table 3's MP column is filled by
    fp16_storage runs only; fp16 (S = 1) and mixed are extra columns without the paper's number. Table 1's
    MP column stays fp16 (4.1)."""
    for seed, (a, b, c, d) in enumerate(((2.5, 2.1, 2.3, 2.4), (2.7, 2.3, 2.5, 2.2)), start=1):
        write_run(tmp_path, "deepspeech2", "english", "fp32", seed, impl="paper", metrics={"cer": a})
        write_run(tmp_path, "deepspeech2", "english", "fp16_storage", seed, impl="paper", metrics={"cer": b})
        write_run(tmp_path, "deepspeech2", "english", "fp16", seed, impl="paper", metrics={"cer": c})
        write_run(tmp_path, "deepspeech2", "english", "mixed", seed, impl="paper", metrics={"cer": d})
    write_run(tmp_path, "ilsvrc_cnns", "alexnet", "fp16", 1, metrics={"top1": 56.0})
    _, problems, rep = build(tmp_path)
    assert problems == []
    t = table_of(rep, "table3")
    by_key = {c.paper_key: c for c in t.columns if c.paper_key}
    assert by_key["mp"].variant[0] == "fp16_storage" and not by_key["mp"].placeholder
    mp = t.cells[("english", by_key["mp"].id)]
    assert (mp.n, mp.mean, mp.paper) == (2, pytest.approx(2.2), 1.99)
    extra = {c.variant[0]: c for c in t.columns if c.paper_key is None}
    assert set(extra) == {"fp16", "mixed"}
    assert extra["fp16"].label.startswith("FP16 math, no loss scaling")
    assert t.cells[("english", extra["fp16"].id)].paper is None
    assert t.cells[("english", extra["fp16"].id)].mean == pytest.approx(2.4)
    assert "Mixed precision (fp16_storage)" in tables.to_markdown(t)
    assert cell(table_of(rep, "table1"), "alexnet", "fp16_S1").mean == 56.0  # Table 1's MP: still fp16
    # no fp16_storage run: the MP column is a placeholder that says what would fill it
    shutil.rmtree(tmp_path)
    write_run(tmp_path, "deepspeech2", "english", "fp16", 1, impl="paper", metrics={"cer": 2.0})
    t = table_of(build(tmp_path)[2], "table3")
    mp = next(c for c in t.columns if c.paper_key == "mp")
    assert mp.placeholder and mp.variant[0] == "fp16_storage"


def test_every_status_marker(tmp_path):
    w = lambda *a, **k: write_run(tmp_path, *a, **k)  # noqa: E731
    # Table 2, Faster R-CNN: mixed seeds -> "(n=2; 1 diverged)"
    w("voc_detection", "faster_rcnn_vgg16", "mixed", 1, loss_scale=8, metrics={"mAP": 69.0})
    w("voc_detection", "faster_rcnn_vgg16", "mixed", 2, loss_scale=8, metrics={"mAP": 69.2})
    w("voc_detection", "faster_rcnn_vgg16", "mixed", 3, loss_scale=8, status="diverged")
    w("voc_detection", "faster_rcnn_vgg16", "fp32", 1, status="running", step=120, total_steps=500)
    w("voc_detection", "faster_rcnn_vgg16", "fp16", 1, status="failed")
    # SSD without loss scaling diverges in the paper and here.
    w("voc_detection", "ssd300_vgg16", "fp16", 1, status="diverged")
    w("voc_detection", "ssd300_vgg16", "fp16", 2, status="diverged")
    w("voc_detection", "ssd300_vgg16", "fp32", 1, status="interrupted", step=40, total_steps=100)
    w("voc_detection", "ssd300_vgg16", "mixed", 1, loss_scale=8, metrics={"loss": 1.0})  # no mAP
    w("voc_detection", "ssd300_vgg16", "bf16", 1, metrics={"mAP": 77.0})
    w("voc_detection", "ssd300_vgg16", "fp32", 2, tf32=True, metrics={"mAP": 76.5})
    _, problems, rep = build(tmp_path)
    t = table_of(rep, "table2")
    frcnn = cell(t, "faster_rcnn_vgg16", "mixed_S8")
    assert re.fullmatch(r"69\.1 ± 0\.1 \(n=2; 1 diverged\)", frcnn.ours_text())
    assert frcnn.status == "partial" and frcnn.diff_text() == "-0.6"
    assert cell(t, "faster_rcnn_vgg16", "fp32").ours_text() == "running (120/500)"
    assert cell(t, "faster_rcnn_vgg16", "fp16").ours_text() == "failed"
    ssd16 = cell(t, "ssd300_vgg16", "fp16")
    assert (ssd16.ours_text(), ssd16.paper_text(), ssd16.diff_text()) == ("diverged (2 seeds)", "diverges",
                                                                         "both diverge")
    assert cell(t, "ssd300_vgg16", "fp32").ours_text() == "interrupted (40/100)"
    assert cell(t, "ssd300_vgg16", "mixed_S8").ours_text() == "completed without metric"
    assert any("metrics.mAP is absent" in p.what for p in problems)
    # Precisions the paper did not run get their own columns, with no paper number.
    labels = [c.label for c in t.columns]
    assert "BF16 (bf16)" in labels and "TF32 baseline (fp32+TF32)" in labels
    bf = cell(t, "ssd300_vgg16", "bf16")
    assert (bf.ours_text(), bf.paper_text(), bf.diff_text()) == ("77.0 (n=1)", "—", "—")
    md = tables.to_markdown(t)
    for marker in ("not run", "running (120/500)", "failed", "diverged (2 seeds)", "both diverge",
                   "interrupted (40/100)", "(n=2; 1 diverged)", "completed without metric"):
        assert marker in md, marker
    # The cells not run say which grid fills them
    assert "`python -m slurm.submit experiments/voc_detection/grid.yaml --profile paper --backend slurm" in md
    assert "1 run: NVIDIA H100 80GB HBM3" not in md and "runs: NVIDIA H100 80GB HBM3; torch 2.14.1" in md
    assert "TF32 matmul off, cuDNN off; git 0123456789 (dirty)" in md


def test_tiny_and_paper_never_mixed(tmp_path):
    write_run(tmp_path, "ilsvrc_cnns", "alexnet", "fp32", 1, metrics={"top1": 55.5})
    write_run(tmp_path, "ilsvrc_cnns", "alexnet", "fp32", 1, profile="tiny", metrics={"top1": 3.25})
    write_run(tmp_path, "ilsvrc_cnns", "alexnet", "fp32", 2, profile="tiny", metrics={"top1": 4.75})
    out = tmp_path / "out"
    assert cli_main.main(["--runs", str(tmp_path), "--out", str(out)]) == 0
    paper_md, tiny_md = (out / "table1.md").read_text(), (out / "table1_tiny.md").read_text()
    assert "55.50 (n=1)" in paper_md and "4.00" not in paper_md and "TINY" not in paper_md
    assert specs.TINY_LABEL in tiny_md and "4.00 ± 1.06 (n=2)" in tiny_md and "55.50" not in tiny_md
    assert "n/c" in tiny_md  # no difference against the paper for smoke data (and no non-FP32 cell here)
    assert specs.TINY_LABEL in (out / "table1_tiny.tex").read_text()
    rows = tables.read_csv((out / "table1_tiny.csv").read_text())
    assert {r["profile"] for r in rows} == {"tiny"}
    assert not (out / "table2_tiny.md").exists() or "not run" in (out / "table2_tiny.md").read_text()
    assert "`python -m experiments --full` runs every tiny grid" in tiny_md  # the rows the demo leaves out
    html = (out / "report.html").read_text()
    assert html.count(specs.TINY_LABEL) >= 1


def test_two_datasets_of_one_profile_never_averaged(tmp_path):
    """The tiny profile on the synthetic set and on a real set: two sections, the report opens with
    a profile that has results (no paper-profile run here)."""
    for seed, (fp, root, top1) in enumerate([("aaaa", "data/tiny_imagenet", 80.0), ("bbbb", "data/digits", 95.0)]):
        d = write_run(tmp_path, "ilsvrc_cnns", "alexnet", "fp32", seed, profile="tiny", metrics={"top1": top1},
                      name=f"alexnet-fp32-s{seed}-{fp}")
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        cfg.update(data_fingerprint=fp, task={"data_root": root})
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    runs, problems, rep = build(tmp_path)
    assert [s.profile for s in rep.sections] == ["tiny-digits", "tiny-tiny_imagenet", "paper"]
    assert cell(table_of(rep, "table1", "tiny-digits"), "alexnet", "fp32").values == [95.0]
    assert cell(table_of(rep, "table1", "tiny-tiny_imagenet"), "alexnet", "fp32").values == [80.0]
    assert specs.profile_label("tiny-digits") == specs.TINY_LABEL
    # The paper-profile table has the tiny tables' columns (here: only fp32 ran, in any profile).
    assert [c.id for c in table_of(rep, "table1", "paper").columns] == \
        [c.id for c in table_of(rep, "table1", "tiny-digits").columns]


def test_report_opens_with_the_profile_holding_most_runs(tmp_path):
    """The demo's tiny runs beside tiny_check's on the digits: Table 1's tiny runs split by dataset and
    the plain `tiny` keeps only the LM's run. The report must not open with that near-empty section."""
    for seed, (fp, root) in enumerate([("aaaa", "data/tiny_imagenet"), ("bbbb", "data/digits"),
                                       ("bbbb", "data/digits"), ("bbbb", "data/digits")]):
        d = write_run(tmp_path, "ilsvrc_cnns", "alexnet", "fp32", seed, profile="tiny", metrics={"top1": 90.0},
                      name=f"alexnet-fp32-s{seed}-{fp}")
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        cfg.update(data_fingerprint=fp, task={"data_root": root})
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    write_run(tmp_path, "lm_biglstm", "biglstm", "fp32", 0, profile="tiny", metrics={"ppl": 50.0})
    _, _, rep = build(tmp_path)
    assert [s.profile for s in rep.sections] == ["tiny-digits", "tiny", "tiny-tiny_imagenet", "paper"]


def test_tiny_cells_compared_with_fp32_within_seed_noise(tmp_path):
    for seed, (a, b, c) in enumerate([(80.0, 81.0, 60.0), (82.0, 80.0, 61.0), (81.0, 82.5, 59.0)]):
        write_run(tmp_path, "ilsvrc_cnns", "alexnet", "fp32", seed, profile="tiny", metrics={"top1": a})
        write_run(tmp_path, "ilsvrc_cnns", "alexnet", "fp16", seed, profile="tiny", metrics={"top1": b})
        write_run(tmp_path, "ilsvrc_cnns", "alexnet", "mixed", seed, profile="tiny", metrics={"top1": c})
    _, _, rep = build(tmp_path)
    t = table_of(rep, "table1", "tiny")
    assert cell(t, "alexnet", "fp16").diff_text() == "+0.17 vs FP32 (within seed noise)"
    assert cell(t, "alexnet", "mixed").diff_text() == "-21.00 vs FP32 (DIFFERS: > 2 SE)"
    md = tables.to_markdown(t)
    assert "within seed noise" in md and "DIFFERS" in md and "ours − this row's FP32" in md


# ----------------------------------------------------------------------------- formats
def _tex_shape_ok(tex: str, ncols: int):
    assert tex.isascii()
    begins, ends = re.findall(r"\\begin\{(\w+)\}", tex), re.findall(r"\\end\{(\w+)\}", tex)
    assert begins == ["table", "tabular"] and ends == ["tabular", "table"]
    depth = 0
    for ch in re.sub(r"\\[{}]", "", tex):  # escaped braces do not count
        depth += {"{": 1, "}": -1}.get(ch, 0)
        assert depth >= 0
    assert depth == 0
    body = tex.split("\\midrule", 1)[1].split("\\bottomrule", 1)[0]
    for row in filter(None, (r.strip() for r in body.split("\\\\"))):
        assert len(re.split(r"(?<!\\)&", row)) == 1 + 3 * ncols, row
    # Outside comments and \label (where "_" is legal), every _ % # is escaped.
    body = re.sub(r"\\label\{[^}]*\}", "", tex.split("\n", 2)[2])
    assert re.search(r"(?<!\\)[_%#]", body) is None
    for k in ("\\toprule", "\\midrule", "\\bottomrule", "\\cmidrule"):
        assert k in tex


def test_latex_shape_and_csv_round_trip(tmp_path):
    write_run(tmp_path, "voc_detection", "ssd300_vgg16", "mixed", 1, loss_scale=8, metrics={"mAP": 77.123456789})
    write_run(tmp_path, "voc_detection", "ssd300_vgg16", "mixed", 2, loss_scale=8, metrics={"mAP": 76.9})
    write_run(tmp_path, "voc_detection", "my_net_50%", "fp32", 1, metrics={"mAP": 1 / 3})  # not in the paper
    write_run(tmp_path, "voc_detection", "ssd300_vgg16", "fp16", 1, status="diverged")
    _, _, rep = build(tmp_path)
    t = table_of(rep, "table2")
    tex = tables.to_latex(t)
    _tex_shape_ok(tex, len(t.columns))
    assert r"my\_net\_50\%" in tex and r"$\pm$" in tex and r"\multicolumn{3}{c}" in tex
    recs = t.records()
    back = tables.read_csv(tables.to_csv(t))
    assert back == recs  # floats via repr: bit-exact
    row = next(r for r in back if r["model"] == "ssd300_vgg16")
    assert row["cells"]["fp16_S1"]["paper"] == "diverges"
    assert row["cells"]["mixed_S8"]["n"] == 2
    assert row["cells"]["mixed_S8"]["ours_mean"] == pytest.approx((77.123456789 + 76.9) / 2)
    # Tiny labels reach LaTeX too, still balanced.
    write_run(tmp_path, "voc_detection", "ssd300_vgg16", "fp32", 1, profile="tiny", metrics={"mAP": 2.0})
    _, _, rep = build(tmp_path)
    tt = table_of(rep, "table2", "tiny")
    _tex_shape_ok(tables.to_latex(tt), len(tt.columns))


# ----------------------------------------------------------------------------- bad input
def test_bad_input_is_listed_and_skipped(tmp_path, capsys):
    root = tmp_path / "runs"
    w = lambda *a, **k: write_run(root, *a, **k)  # noqa: E731
    (w("ilsvrc_cnns", "alexnet", "fp32", 9, name="corrupt") / "summary.json").write_text('{"status": "compl')
    (w("ilsvrc_cnns", "alexnet", "fp32", 8, name="notdict") / "summary.json").write_text("[1, 2]")
    partial = w("ilsvrc_cnns", "alexnet", "fp32", 7, name="partial")
    s = json.loads((partial / "summary.json").read_text())
    del s["precision"]
    (partial / "summary.json").write_text(json.dumps(s))
    (partial / "config.yaml").write_text("experiment: ilsvrc_cnns\n")  # no precision there either
    noprofile = w("ilsvrc_cnns", "alexnet", "fp32", 6, name="noprofile")
    s = json.loads((noprofile / "summary.json").read_text())
    del s["profile"]
    (noprofile / "summary.json").write_text(json.dumps(s))
    (noprofile / "config.yaml").write_text("{}\n")
    w("cifar_toy", "resnet", "fp32", 1, metrics={"top1": 1.0})
    (w("ilsvrc_cnns", "alexnet", "fp32", 5, name="nosummary") / "summary.json").unlink()
    w("ilsvrc_cnns", "alexnet", "fp32", 4, name="badstatus", status="exploded")
    (w("ilsvrc_cnns", "vgg16", "fp32", 1, name="badcfg", metrics={"top1": 65.0}) / "config.yaml").write_text(
        "a: [unclosed\n")
    # Two completed runs of the same cell and seed: the newer one wins.
    w("ilsvrc_cnns", "alexnet", "mixed", 1, name="old", metrics={"top1": 10.0}, updated="2025-01-01T00:00:00Z")
    w("ilsvrc_cnns", "alexnet", "mixed", 1, name="new", metrics={"top1": 20.0}, updated="2025-02-01T00:00:00Z")
    w("ilsvrc_cnns", "alexnet", "mixed", 1, name="stale", status="running", updated="2025-03-01T00:00:00Z")
    # metrics.jsonl with garbage lines, and a half-written last line.
    junk = w("ilsvrc_cnns", "googlenet", "mixed", 1, metrics={"top1": 68.0}, train=[(2.0, 65536.0), (1.0, 32768.0)])
    with open(junk / "metrics.jsonl", "a") as f:
        f.write("not json\n[1,2]\n{\"kind\": \"train\", \"st")
    # A numerics line whose histogram does not fit its bounds.
    w("ilsvrc_cnns", "googlenet", "fp32", 1, metrics={"top1": 68.1},
      numerics=[{"numerics/weight/overall/hist": [1, 2, 3], "numerics/hist_lo": -30, "numerics/hist_hi": 0}])
    out = tmp_path / "out"
    assert cli_main.main(["--runs", str(root), "--out", str(out)]) == 0
    runs, problems = results.collect_dir(root)
    text = "\n".join(map(str, problems))
    assert "corrupt summary.json" in text and "not a JSON object" in text
    assert "partial summary: missing precision" in text and "partial summary: missing profile" in text
    assert "unknown experiment 'cifar_toy'" in text and "no summary.json" in text
    assert "unknown status 'exploded'" in text and "config.yaml unreadable" in text
    assert "a second completed run of the same cell and seed; kept the newer runs/ilsvrc_cnns/new" in text
    assert "running run of a cell and seed that has a completed run" in text
    _, _, rep = build(root)
    assert cell(table_of(rep, "table1"), "alexnet", "mixed").ours_text() == "20.00 (n=1)"
    assert cell(table_of(rep, "table1"), "vgg16", "fp32").n == 1  # config unreadable, summary enough
    md = (out / "table1.md").read_text()
    assert "runs/ilsvrc_cnns/corrupt" in md and "runs/ilsvrc_cnns/old" in md
    index = (out / "index.md").read_text()
    assert "unreadable line(s) skipped" in index and "do not fit exponents" in index
    assert "cifar_toy" in index
    assert "Traceback" not in capsys.readouterr().err


def test_user_errors_are_one_line(tmp_path, capsys):
    from conftest import mount_tmpfs

    read_only = tmp_path / "ro"
    mounted = mount_tmpfs(read_only, "ro,size=16k")
    try:
        _user_errors_are_one_line(tmp_path, capsys, read_only if mounted else None)
    finally:
        if mounted:
            subprocess.run(["umount", str(read_only)], capture_output=True)


def _user_errors_are_one_line(tmp_path, capsys, read_only):
    """... and a --out that cannot be written (under a file, on a read-only disk where one can be
    mounted) names the folder and the fix instead of a traceback."""
    for argv in (["--runs", str(tmp_path / "nope")], ["--wandb", "no-slash"],
                 ["--runs", str(tmp_path), "--out", str(tmp_path / "f")],
                 ["--runs", str(tmp_path), "--out", str(tmp_path / "f" / "sub")],
                 *([["--runs", str(tmp_path), "--out", str(read_only / "out")]] if read_only else [])):
        (tmp_path / "f").write_text("")
        with pytest.raises(SystemExit) as e:
            cli_main.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert (err.startswith("error: --") or "choose a writable folder" in err) and "\n" not in err, err


# ----------------------------------------------------------------------------- wandb
class FakeRun:
    def __init__(self, rid, config, summary, state="finished", history=()):
        self.id, self.name, self.url = rid, f"run-{rid}", f"https://wandb.ai/ent/proj/runs/{rid}"
        self.config, self.summary, self.state, self._history = config, summary, state, history
        self.created_at = "2025-01-01T00:00:00Z"
        self.metadata = {"gpu": "NVIDIA A100-SXM4-80GB", "python": "3.11.9"}

    def scan_history(self):
        return iter(self._history)


def test_wandb_mapping_with_mocked_api(tmp_path, monkeypatch):
    import wandb

    cfg = lambda **k: {"experiment": "ilsvrc_cnns", "model": "alexnet", "profile": "paper",  # noqa: E731
                       "impl": "autocast", "loss_scale": "dynamic", "tf32": False, **k}
    # As mpt.engine logs to wandb: train keys unprefixed, numerics histograms as wandb Histograms,
    # both merged into one row when logged at the same step.
    hist = [{"_step": i, "step": i, "loss": 3.0 - i / 10, "loss_scale": 2.0 ** (16 - i), "lr": 0.1}
            for i in range(12)]
    counts = _hist_line("weight", -20)["numerics/weight/overall/hist"]
    hist[0].update({"numerics/hist_lo": -40, "numerics/hist_hi": 16, "eval/top1": 12.0,
                    "numerics/weight/overall/hist": {"_type": "histogram", "values": counts,
                                                    "bins": list(range(-40, 18))}})
    fake_runs = [
        FakeRun("a", cfg(precision="fp32", seed=1), {"final/top1": 56.0, "env": ENV}, history=hist),
        FakeRun("b", cfg(precision="fp32", seed=2), {"final/top1": 57.0, "_step": 10}),
        FakeRun("c", cfg(precision="mixed", seed=1), {"_step": 5, "total_steps": 50}, state="running",
                history=hist),
        FakeRun("d", cfg(precision="mixed", seed=2), {"status": "diverged"}, state="finished"),
        FakeRun("e", cfg(precision="fp16_pure", seed=1), {"final/top1": 1.0}, state="crashed", history=hist),
        FakeRun("f", {"experiment": "nope"}, {}),
    ]

    class FakeApi:
        def __init__(self, *a, **k):
            pass

        def runs(self, path):
            assert path == "ent/proj"
            return fake_runs

    monkeypatch.setattr(wandb, "Api", FakeApi)
    runs, problems = results.collect_wandb("ent/proj")
    assert {r.name: r.status for r in runs} == {"run-a": "completed", "run-b": "completed",
                                               "run-c": "running", "run-d": "diverged", "run-e": "failed"}
    assert len(problems) == 1 and "partial summary" in problems[0].what
    rep = report.build(runs, problems, "wandb")
    t = table_of(rep, "table1")
    assert cell(t, "alexnet", "fp32").ours_text() == "56.50 ± 0.71 (n=2)"
    assert cell(t, "alexnet", "mixed").ours_text() == "running (5/50); diverged"
    assert any("NVIDIA A100-SXM4-80GB" in e for e in t.env)  # from wandb metadata when no env
    fig = next(f for f in rep.sections[0].figures if f.spec.id == "figure2a")
    assert fig.missing is None and fig.png.startswith(b"\x89PNG")
    ls = next(f for f in rep.sections[0].figures if f.spec.id == "loss_scale")
    assert ls.missing is None
    f2b = next(f for f in rep.sections[0].figures if f.spec.id == "figure2b")
    assert f2b.missing is None and "ilsvrc_cnns/alexnet, FP32" in " ".join(f2b.notes)
    lines = runs[0].lines(problems)
    assert len(lines.train_loss) == 12 and lines.eval[0]["top1"] == 12.0 and len(lines.numerics) == 1

    def boom(*a, **k):
        raise ConnectionError("no network\nsecond line")

    monkeypatch.setattr(wandb, "Api", boom)
    with pytest.raises(results.UserError, match=r"could not list runs \(ConnectionError: no network\)"):
        results.collect_wandb("ent/proj")


# ----------------------------------------------------------------------------- figures + report
def _hist_line(group, center, scale=1.0, bands=None):
    """A numerics line shaped like mpt.numerics.Numerics.end's (true gradients, bins lo..hi)."""
    lo, hi = -40, 16
    e = np.arange(lo, hi + 1)
    counts = np.round(1000 * np.exp(-0.5 * ((e - center) / 4.0) ** 2)).astype(int).tolist()
    n = sum(counts) / 0.33
    return {"numerics/hist_lo": lo, "numerics/hist_hi": hi, "numerics/loss_scale": scale,
            f"numerics/{group}/overall/hist": counts, f"numerics/{group}/overall/count": n,
            f"numerics/{group}/overall/frac_zero": 0.67, f"numerics/{group}/conv1/hist": counts,
            **{f"numerics/{group}/overall/frac_{k}": v for k, v in (bands or {}).items()}}


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """Every figure's runs (paper profile) and one output folder, shared by the tests below."""
    root = tmp_path_factory.mktemp("full") / "runs"
    curve = lambda a, scale=1.0: [(a + 3 * math.exp(-i / 8), scale) for i in range(40)]  # noqa: E731
    for prec, a in (("fp32", 0.5), ("fp16_storage", 0.52), ("fp16_pure", 1.5)):
        write_run(root, "deepspeech2", "mandarin", prec, 1, metrics={"cer": 15.0 + a}, train=curve(a),
                  numerics=[_hist_line("weight", -20), _hist_line("weight", -19)] if prec == "fp32" else ())
    write_run(root, "voc_detection", "ssd300_vgg16", "fp32", 1, metrics={"mAP": 76.0},
              numerics=[_hist_line("act", -28)])
    write_run(root, "voc_detection", "ssd300_vgg16", "mixed", 1, loss_scale=8, metrics={"mAP": 76.5},
              numerics=[_hist_line("act", -28, 8.0, {"underflow": 0.033, "overflow": 0.0}),
                        _hist_line("weight", -20, 8.0)])
    for prec, scale in (("fp32", "dynamic"), ("fp16", 1), ("mixed", 8)):
        write_run(root, "wmt_translation", "lstm3", prec, 1, train=curve(1.0), loss_scale=scale)
    write_run(root, "lm_biglstm", "biglstm", "fp32", 1, train=curve(3.5))
    write_run(root, "lm_biglstm", "biglstm", "fp16", 1, train=curve(3.5)[:20] + [(float("nan"), 1.0)],
              status="diverged")
    write_run(root, "lm_biglstm", "biglstm", "mixed", 1, loss_scale=128, train=curve(3.5, 128.0))
    write_run(root, "dcgan", "dcgan128", "fp32", 1, samples=True)
    write_run(root, "dcgan", "dcgan128", "fp16", 1, samples=True)
    mixed = write_run(root, "dcgan", "dcgan128", "mixed", 1, samples=True,
                      train=[(1.0, 2.0 ** (16 - (i % 5))) for i in range(30)])
    (mixed / "samples_99999.png").write_bytes(b"\x89PNG half-written")  # falls back to an older one
    # wandb's offline folder inside a run directory holds a config.yaml of its own: not a run.
    (mixed / "wandb" / "offline-run-1" / "files").mkdir(parents=True)
    (mixed / "wandb" / "offline-run-1" / "files" / "config.yaml").write_text("a: 1\n")
    out = root.parent / "out"
    assert cli_main.main(["--runs", str(root), "--out", str(out)]) == 0
    return root, out


def test_figures_drawn_from_metrics(full):
    root, out = full
    for stem in ("figure2a", "figure2b", "figure3", "figure4", "figure5", "figure6", "loss_scale"):
        assert (out / f"{stem}.png").read_bytes().startswith(b"\x89PNG"), stem
        assert b"<svg" in (out / f"{stem}.svg").read_bytes()[:2000], stem
    index = (out / "index.md").read_text()
    assert "missing" not in index.split("## Skipped")[0].lower()
    f2b = (out / "figure2b.md").read_text()
    assert "deepspeech2/mandarin, FP32" in f2b and "2 histogram snapshot(s) summed" in f2b
    assert "below 2^-24" in f2b and "zeros 67.0% of all values" in f2b
    f3 = (out / "figure3.md").read_text()
    assert "voc_detection/ssd300_vgg16, FP32" in f3
    # The exact band fractions of the stored values (0.033 of all, 0.33 non-zero) beat the histogram.
    assert ("With loss scaling (stored at S = 8: voc_detection/ssd300_vgg16, MP, S=8 (s1)): "
            "10.00% round to 0 in FP16, 0.00% overflow FP16") in f3
    f5 = (out / "figure5.md").read_text()
    assert "MP, S=128" in f5 and "not run yet" not in f5 and "diverged" in f5
    f6 = (out / "figure6.md").read_text()
    assert "samples_2000.png" in f6 and "samples_100.png" not in f6
    # Figure 6's panels: FP32 beside MP without loss scaling (the paper's pair), then mixed, marked extra
    panels = [ln for ln in f6.splitlines() if "samples_2000.png (status" in ln]
    assert len(panels) == 3, f6
    assert panels[0].lstrip("- ").startswith("FP32:") and "MP, no loss scaling (S=1):" in panels[1]
    assert "extra, not in the paper's figure: MP, dynamic S:" in panels[2]
    skipped = index.split("## Skipped")[1]
    assert "samples_99999.png unreadable" in skipped and "wandb" not in skipped
    f2a = (out / "figure2a.md").read_text()
    assert "FP16 weights, no master copy from" in f2a and "deepspeech2/mandarin" in f2a
    # the master copy is the one difference: FP16 storage and FP32 math with it, FP16 weights without it
    assert "FP16 storage, FP32 math from" in f2a and "MP, dynamic S" not in f2a


def test_figure6_names_its_missing_no_scaling_panel(tmp_path):
    """Without an fp16 run, Figure 6 still draws FP32 and the extra mixed panel, and says the paper's
    MP-without-loss-scaling panel is not run yet."""
    write_run(tmp_path / "runs", "dcgan", "dcgan128", "fp32", 1, samples=True)
    write_run(tmp_path / "runs", "dcgan", "dcgan128", "mixed", 1, samples=True)
    assert cli_main.main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    f6 = (tmp_path / "out" / "figure6.md").read_text()
    assert "not run yet (no samples_*.png): MP, no loss scaling (S=1)" in f6
    assert "extra, not in the paper's figure: MP, dynamic S:" in f6 and (tmp_path / "out" / "figure6.png").is_file()


def test_figure3_without_a_loss_scaled_run_shifts_by_the_papers_s(tmp_path):
    write_run(tmp_path, "voc_detection", "ssd300_vgg16", "fp32", 1, numerics=[_hist_line("act", -28)])
    runs, problems = results.collect_dir(tmp_path)
    from paper_tables import figures

    f = figures.build_figure(next(s for s in specs.FIGURES if s.id == "figure3"), runs, "paper", problems)
    assert f.missing is None and f.png.startswith(b"\x89PNG")
    text = " ".join(f.notes)
    assert "stored at S = 8 (the paper's; no loss-scaled run with histograms): shifted by log2(S) = 3" in text
    assert "zeros 67.0% of all values" in text and problems == []


def test_missing_figures_listed_not_drawn(tmp_path, capsys):
    write_run(tmp_path / "runs", "lm_biglstm", "biglstm", "fp32", 1, train=[(5.0, 1.0), (4.0, 1.0)])
    out = tmp_path / "out"
    assert cli_main.main(["--runs", str(tmp_path / "runs"), "--out", str(out)]) == 0
    # The closing screen lists what these runs filled, each on a line; the rest in one line, never as "missing"
    said = capsys.readouterr().out
    assert "figure5.{png,svg}" in said and ": missing" not in said and "table1.{md" not in said
    assert re.search(r"no runs here for \d+ table\(s\) \(table1, table2, table3.*figure2b", said), said
    index = (out / "index.md").read_text()
    for stem in ("figure2b", "figure3", "figure4", "figure6", "loss_scale"):
        assert not (out / f"{stem}.png").exists()
        assert re.search(rf"Figure {stem[6:]}.*\*\*not drawn\*\*" if stem.startswith("figure") else
                         r"Loss-scale.*\*\*not drawn\*\*", index), stem
    # Figure 5 drawn, with the runs still to do named.
    assert (out / "figure5.png").exists()
    f5 = (out / "figure5.md").read_text()
    assert "not run yet: MP, no loss scaling (S=1)" in f5 and "not run yet: MP, S=128" in f5
    # A figure drawn before and missing now is removed, not left looking current.
    shutil.rmtree(tmp_path / "runs" / "lm_biglstm")
    assert cli_main.main(["--runs", str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert not (out / "figure5.png").exists() and (out / "table1.md").exists()


@pytest.mark.heavy
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (/usr/bin/chromium): "
                    "apt-get install -y chromium")
def test_report_renders_in_headless_chromium(full, tmp_path):
    _, out = full
    page = (out / "report.html").resolve()
    text = page.read_text()
    assert "src=\"http" not in text and "<link" not in text  # self-contained
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000",
           "--dump-dom", page.as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    assert 'data-images-ok="true"' in dom, "an embedded image did not decode"
    assert 'data-images="8"' in dom  # the paper's 7 figures and the FP8 ranges (from SSD's act gradients)
    assert dom.count('<table class="results">') == 7  # Tables 1-3, the final_{lm,nmt,gan}, beyond the paper
    for t in ("Table 1:", "Table 2:", "Table 3:", "Figure 2a:", "Figure 6:", "Loss-scale"):
        assert t in dom
    shot = tmp_path / "shot.png"
    subprocess.run(cmd[:-2] + [f"--screenshot={shot}", "--window-size=1200,900", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 10_000


def test_python_m_entry_point(tmp_path):
    r = subprocess.run([sys.executable, "-m", "paper_tables", "--runs", str(tmp_path / "absent")],
                       capture_output=True, text=True, cwd=pathlib.Path(__file__).resolve().parents[1])
    assert r.returncode == 2 and r.stderr.startswith("error: --runs") and "Traceback" not in r.stderr


@pytest.mark.parametrize("metrics", [{"top1": 1e300}, {"top1": -50.0}, {"top1": 70.0, "top5": 101.0}])
def test_an_impossible_metric_is_listed_and_never_averaged(tmp_path, metrics):
    """top1 = 1e300 or -50 was averaged into Table 1 without a word: a metric outside its possible range
    (specs.METRIC_RANGES) skips the run and names the value."""
    write_run(tmp_path, "ilsvrc_cnns", "alexnet", "fp32", 1, metrics={"top1": 56.0})
    write_run(tmp_path, "ilsvrc_cnns", "alexnet", "fp32", 2, metrics=metrics)
    write_run(tmp_path, "lm_biglstm", "biglstm", "fp32", 1, metrics={"ppl": 0.5})
    _, problems, rep = build(tmp_path)
    c = cell(table_of(rep, "table1"), "alexnet", "fp32")
    assert (c.n, c.mean) == (1, 56.0)
    text = "\n".join(map(str, problems))
    bad = next(k for k, v in metrics.items() if not 0 <= v <= 100)
    assert f"impossible metrics: {bad} = {metrics[bad]!r} (a percentage: 0 to 100)" in text
    assert "ppl = 0.5 (a perplexity: 1 to inf)" in text
