"""The demo (`python -m experiments`), cut down to one Table 1 model and a few small steps per run: every part
of it runs through the real data generators, data_prep and the local launcher, and the report it ends with
holds every table and every figure of the paper. The run here takes one seed of each cell (`--seeds 1`); that
the demo itself runs three seeds of every table cell is checked on its plan."""
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import REPO

# Every test here runs real training, subprocesses or a cluster: left out of the fast tier.
pytestmark = pytest.mark.heavy

CHROMIUM = pathlib.Path("/usr/bin/chromium")
FIGURES = ("figure2a", "figure2b", "figure3", "figure4", "figure5", "figure6", "loss_scale")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo")
    runs, out = tmp / "runs", tmp / "out"
    cmd = [sys.executable, "-m", "experiments", "--models", "resnet50_preact", "--data-dir", str(tmp / "data"),
           "--runs", str(runs), "--tables-out", str(out), "--seeds", "1",
           # 3 steps at batch 8: what the tables and figures need is runs, not learning. No wandb: its
           # offline service costs each of the 52 runs ~1.5 s of CPU, and the tables read runs/ alone
           # (test_engine checks an offline wandb record of a tiny run).
           "--set", "train.max_steps=3", "train.batch_size=8", "train.eval_max_batches=1", "numerics.every=2",
           "wandb.mode=disabled"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return runs, out, r.stdout


def _row(table: str, label: str) -> str:
    return next(ln for ln in table.splitlines() if ln.startswith(f"| {label}"))


def test_demo_plans_three_seeds_for_every_table_cell():
    """What `python -m experiments` runs without --seeds: three seeds of every cell of Tables 1-3 and of
    Figure 4's grids (mean ± std); the figures' single-seed cells (Figure 2a's fp16_pure, Figure 5, Figure 6)."""
    import collections

    import experiments.__main__ as demo_main
    from slurm.grid import load

    seeds = {}
    for grid, _, only in demo_main.plan(demo_main.DEMO_MODELS, False):
        g = load(REPO / "experiments" / grid, "tiny", only=[o.removeprefix("--only=") for o in only])
        per_cell = collections.defaultdict(set)
        for c in g.cells:
            per_cell[tuple(sorted((k, str(v)) for k, v in c.axes.items() if k != "seed"))].add(c.axes["seed"])
        seeds[grid + " " + " ".join(only)] = {len(v) for v in per_cell.values()}
    one = ("precision=fp16_pure", "lm_biglstm/", "dcgan/")
    for key, counts in seeds.items():
        assert counts == ({1} if any(o in key for o in one) else {3}), (key, counts)
    assert sum(1 for k in seeds if "ilsvrc_cnns/" in k or "voc_detection/" in k) == 3


def test_demo_seeds_keeps_the_first_seeds_of_each_cell():
    import experiments.__main__ as demo_main

    assert demo_main.first_seeds("ilsvrc_cnns/grid.yaml", 2, []) == ["--only=seed=0", "--only=seed=1"]
    assert demo_main.first_seeds("lm_biglstm/grid.yaml", 1, ["--only=seed=0"]) == []  # the plan's own choice
    r = subprocess.run([sys.executable, "-m", "experiments", "--seeds", "0"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--seeds 0" in r.stderr, r.stderr


def test_a_tiny_release_prepared_by_other_code_is_written_again(tmp_path, monkeypatch, capsys):
    """The demo's preparation uses a tiny release its own code prepared, and writes again one that other code
    did (a changed generator; a folder with no record of its code): the new folders replace the old ones,
    nothing of the old release is left, and the same code gives the same data."""
    import json

    from experiments import __main__ as demo
    from mpt.prepared import data_fingerprint

    data, record = tmp_path / "tiny_wmt15", tmp_path / "tiny_wmt15.release.json"
    assert demo.prepare_tiny("wmt15", data) == data
    marker = data / "prepared.json"
    first, fingerprint = marker.stat().st_mtime_ns, data_fingerprint(data)
    assert demo.prepare_tiny("wmt15", data) == data and marker.stat().st_mtime_ns == first  # used as it is
    assert "not prepared by this version" not in capsys.readouterr().out
    (data / "stale.txt").write_text("a file of the old release")
    monkeypatch.setattr(demo, "release_code", lambda pkg: "0123456789abcdef")  # the generator changed
    demo.prepare_tiny("wmt15", data)
    assert "was not prepared by this version of the tiny wmt15 release's code" in capsys.readouterr().out
    assert not (data / "stale.txt").exists() and marker.stat().st_mtime_ns != first
    assert json.loads(record.read_text()) == {"release": "wmt15", "code": "0123456789abcdef"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [data.name, record.name, "tiny_wmt15_archives"]
    assert data_fingerprint(data) == fingerprint
    record.unlink()  # prepared before the demo recorded its code: written again too
    demo.prepare_tiny("wmt15", data)
    assert "not prepared by this version" in capsys.readouterr().out and record.is_file()
    monkeypatch.undo()
    assert demo.release_code("wmt15") == demo.release_code("wmt15") != demo.release_code("aishell")


def test_demo_fills_every_table(demo):
    runs, out, stdout = demo
    assert "[demo] done" in stdout
    t1 = (out / "table1_tiny.md").read_text()
    # fp32, fp16 (S = 1), mixed (dynamic), fp16_pure: four cells, one seed each here
    assert len(re.findall(r"\(n=1\)", _row(t1, "ResNet-50"))) == 4
    t2 = (out / "table2_tiny.md").read_text()
    for label in ("Faster R-CNN", "Multibox SSD"):  # FP32, MP without and with loss scaling (S = 8)
        row = _row(t2, label)
        assert len(re.findall(r"\(n=1\)", row)) == 3, row
        assert "S=8" in t2
    t3 = (out / "table3_tiny.md").read_text()
    # FP32, MP (fp16_storage) and Figure 2a's fp16_pure (no master copy)
    assert len(re.findall(r"\(n=1\)", _row(t3, "English"))) == 3
    for t in (t1, t2, t3):
        assert "TINY PROFILE" in t
    lm = sorted(p.name.split("-")[1] for p in (runs / "lm_biglstm").glob("biglstm-*"))
    assert lm == ["fp16", "fp32", "mixed"]


def test_demo_draws_every_figure_from_its_papers_experiment(demo):
    _, out, _ = demo
    for fig in FIGURES:
        png = out / f"{fig}_tiny.png"
        assert png.is_file() and png.stat().st_size > 5_000, fig
    # each figure from the workload the paper drew it from, not a fallback
    want = {"figure2a": "deepspeech2/english", "figure2b": "deepspeech2", "figure3": "ssd300_vgg16",
            "figure4": "wmt_translation", "figure5": "lm_biglstm", "figure6": "dcgan"}
    for fig, source in want.items():
        assert source in (out / f"{fig}_tiny.md").read_text(), fig


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (/usr/bin/chromium)")
def test_demo_report_opens_with_the_tiny_results(demo, tmp_path):
    _, out, _ = demo
    page = (out / "report.html").resolve()
    html = page.read_text()
    assert html.index('id="profile-tiny"') < html.index('id="profile-paper"')
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000"]
    dom = subprocess.run(cmd + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert 'data-images-ok="true"' in dom
    for t in ("Table 1:", "Table 2:", "Table 3:", *(f"Figure {n}:" for n in ("2a", "2b", 3, 4, 5, 6)), "(n=1)"):
        assert t in dom, t
    shot = tmp_path / "demo.png"
    subprocess.run(cmd + [f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 10_000
