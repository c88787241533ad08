"""The demo (`python -m experiments`), cut down to one Table 1 model and a few small steps per run: every part
of it runs through the real data generators, data_prep and the local launcher, and the report it ends with
holds every table (three seeds per cell where the paper's table has a column) and every figure of the paper."""
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
           "--runs", str(runs), "--tables-out", str(out),
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


def test_demo_fills_every_table_with_three_seeds(demo):
    runs, out, stdout = demo
    assert "[demo] done" in stdout
    t1 = (out / "table1_tiny.md").read_text()
    # fp32, fp16 (S = 1), mixed (dynamic), fp16_pure: four cells of three seeds each
    assert len(re.findall(r"\(n=3\)", _row(t1, "ResNet-50"))) == 4
    t2 = (out / "table2_tiny.md").read_text()
    for label in ("Faster R-CNN", "Multibox SSD"):  # FP32, MP without and with loss scaling (S = 8)
        row = _row(t2, label)
        assert len(re.findall(r"\(n=3\)", row)) == 3, row
        assert "S=8" in t2
    t3 = (out / "table3_tiny.md").read_text()
    assert len(re.findall(r"\(n=3\)", _row(t3, "English"))) == 2  # FP32 and MP; Figure 2a's cells n=1
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
    for t in ("Table 1:", "Table 2:", "Table 3:", *(f"Figure {n}:" for n in ("2a", "2b", 3, 4, 5, 6)), "(n=3)"):
        assert t in dom, t
    shot = tmp_path / "demo.png"
    subprocess.run(cmd + [f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 10_000
