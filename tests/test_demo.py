"""The demo (`python -m experiments`), cut down to one model and a few small steps per run: every part of it
runs through the real launcher, and the report it ends with holds the tiny tables with three seeds per
cell and the figures the demo promises (Table 1, Figures 2a, 2b, 3, 5, the loss-scale trajectories)."""
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import REPO

# Every test here runs real training, subprocesses or a cluster: left out of the fast tier.
pytestmark = pytest.mark.heavy

CHROMIUM = pathlib.Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def demo(tiny_imagenet, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo")
    runs, out = tmp / "runs", tmp / "out"
    cmd = [sys.executable, "-m", "experiments", "--models", "resnet50_preact", "--data", str(tiny_imagenet),
           "--lm-data", str(tmp / "tiny_lm1b"), "--runs", str(runs), "--tables-out", str(out),
           # 4 steps at batch 16 (FP16 is slow on a CPU): what the tables and figures need is runs
           "--set", "train.max_steps=4", "train.batch_size=16", "train.eval_max_batches=1", "numerics.every=2"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return runs, out, r.stdout


def test_demo_fills_the_tiny_tables_with_three_seeds(demo):
    runs, out, stdout = demo
    assert "[demo] done" in stdout
    table = (out / "table1_tiny.md").read_text()
    row = next(ln for ln in table.splitlines() if ln.startswith("| ResNet-50"))
    # fp32, fp16 (S = 1), mixed (dynamic), fp16_pure: four cells of three seeds each
    assert len(re.findall(r"\(n=3\)", row)) == 4, row
    assert "TINY PROFILE" in table
    lm = sorted(p.name for p in (runs / "lm_biglstm").glob("biglstm-*"))
    assert [n.split("-")[1] for n in lm] == ["fp16", "fp32", "mixed"]


def test_demo_draws_the_papers_figures(demo):
    _, out, _ = demo
    for fig in ("figure2a", "figure2b", "figure3", "figure5", "loss_scale"):
        png = out / f"{fig}_tiny.png"
        assert png.is_file() and png.stat().st_size > 5_000, fig


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
    for t in ("Table 1:", "Figure 2a:", "Figure 2b:", "Figure 3:", "Figure 5:", "(n=3)"):
        assert t in dom, t
    shot = tmp_path / "demo.png"
    subprocess.run(cmd + [f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 10_000
