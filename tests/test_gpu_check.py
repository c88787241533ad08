"""`python -m experiments.speed_memory.gpu_check` (a short GPU job in one call) cannot rot: its --cpu-smoke runs
every part at tiny size on the CPU, end to end, through the same code; a part that fails or hangs is
recorded and the others run; bad input is one line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from experiments.speed_memory.gpu_check import runner
from experiments.speed_memory.gpu_check.cli import main
from experiments.speed_memory.gpu_check.parts import CIFAR_PRECISIONS, GRAPHED, PARTS, TABLE1, TABLE3
from experiments.speed_memory.gpu_check.parts import epoch_starts, sustained_rate
from experiments.speed_memory.gpu_check.report import SCHEMA, merge

MODULE = "experiments.speed_memory.gpu_check"  # python -m MODULE: the README's command


@pytest.mark.parametrize("argv, says", [
    (["--parts", "headline,foo"], "--parts foo: choose from"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--budget", "0"], "--budget 0: give a positive number"),
    (["--limit", "headline=abc"], "--limit headline=abc: write part=seconds"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and err.count("\n") == 1


BLOCKED = ("wandb", "submitit", "soundfile")  # not in the GPU machines' image


def _blocking_env(tmp_path, **extra) -> dict:
    """An environment in which importing wandb, submitit or soundfile fails, as on a GPU image without them."""
    site = tmp_path / "block_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {BLOCKED!r}:\n"
        "            raise ImportError('blocked for the test: ' + name)\n"
        "sys.meta_path.insert(0, _Block())\n")
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(site), **extra}


def test_the_import_block_blocks(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import wandb"], env=_blocking_env(tmp_path), capture_output=True,
                       text=True, cwd=REPO)
    assert r.returncode != 0 and "blocked for the test: wandb" in r.stderr


@pytest.mark.heavy
def test_cpu_smoke_runs_every_part(tmp_path):
    """With OUT set and wandb/submitit/soundfile unimportable (a GPU machine's image): every part ok,
    every file under $OUT (at most 8: what such a runner brings back), within the call's budget."""
    out = tmp_path / "out"
    out.mkdir()
    results = REPO / runner.RESULTS_DIR
    before = sorted(results.iterdir()) if results.exists() else []
    r = subprocess.run([sys.executable, "-m", MODULE, "--cpu-smoke"], cwd=REPO,
                       env=_blocking_env(tmp_path, OUT=str(out)), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "blocked for the test" not in r.stdout + r.stderr
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and [p.name for p in files if p.name.endswith("gpu_check-smoke.json")], files
    assert (sorted(results.iterdir()) if results.exists() else []) == before  # nothing in the repository
    res = json.loads(next(out.glob("cpu-*-gpu_check-smoke.json")).read_text())
    assert res["schema"] == SCHEMA and res["mode"] == "cpu-smoke" and res["exit_code"] == 0
    assert res["wall_s"] <= res["budget_s"] == runner.SMOKE_CALL_S
    parts = res["parts"]
    assert list(parts) == list(PARTS)
    # cifar reads the development subset from data/ or ../shared/data and is skipped where neither has it
    has_cifar = any(p.is_file() for p in (REPO / "data/cifar10-dev.tar.gz", REPO.parent / "shared/data/cifar10-dev.tar.gz"))
    assert {p: v["status"] for p, v in parts.items()} == {p: "ok" if p != "cifar" or has_cifar else "skipped"
                                                          for p in PARTS}, {p: v["error"] for p, v in parts.items()}

    head = parts["headline"]["result"]["rows"]
    # channels_last (the CNNs' layout on CUDA) first, then NCHW; each with the four precisions
    assert [(x["channels_last"], x["precision"], x["impl"], x["status"]) for x in head] == [
        (cl, p, i, st) for cl in (True, False) for p, i, st in
        (("fp32", None, "ok"), ("tf32", None, "skipped"), ("mixed", "autocast", "ok"), ("mixed", "paper", "ok"))]
    assert all(x["throughput"] > 0 for x in head if x["status"] == "ok")
    assert {g["id"] for g in parts["headline"]["result"]["goals"]} >= {
        f"resnet50_{g}_{fmt}" for g in ("mixed_throughput", "speedup_vs_fp32") for fmt in ("channels_last", "nchw")}

    models = parts["models"]["result"]["rows"]
    assert {(x["model"], x["precision"]) for x in models} == {
        (m, p) for m in TABLE1 + TABLE3 for p in ("fp32", "mixed", "fp16_storage")}
    assert all(x["status"] == "ok" and x["step_ms"]["median"] > 0 for x in models if not x["cuda_graphs"])
    # CUDA-graph rows beside the eager ones: a GPU mode, skipped here with a note
    graphed = [(x["model"], x["precision"], x["impl"]) for x in models if x["cuda_graphs"]]
    assert graphed == [(m, p, i) for m in GRAPHED
                       for p, i in (("fp32", None), ("mixed", "autocast"), ("fp16_storage", "paper"))]
    assert all(x["status"] == "skipped" and "GPU mode" in x["note"] for x in models if x["cuda_graphs"])
    # The paper grids' batch per GPU (what the GPU run uses): global batch over 8 GPUs.
    pb = parts["models"]["result"]["paper_batch"]
    assert pb["resnet50_preact"]["per_gpu"] == 32 and pb["english"]["per_gpu"] == 64
    assert {x["impl"] for x in models if x["model"] == "english" and x["precision"] == "mixed"} == {"paper"}

    worst = parts["ds2_worst"]["result"]
    assert worst["fits"] is True and {x["model"] for x in worst["rows"]} == {"english", "mandarin"}
    assert max(x["size"] for x in worst["rows"] if x["model"] == "english") > 100  # 35 s at 1/25 of its length

    resume = parts["resume"]["result"]
    assert resume["first"]["status"] == "interrupted" and resume["second"]["status"] == "completed"
    assert resume["steps_first"] + resume["steps_second"] == resume["second"]["total_steps"]
    assert resume["first"]["skipped_steps"] < resume["first"]["step"]  # the checkpoint holds applied updates

    # End to end from JPEG files through the engine, both decode paths; each beside the headline's row
    e2e = parts["e2e"]["result"]
    assert [(x["decode"], x["status"]) for x in e2e["rows"]] == [("cpu", "completed"), ("gpu", "completed")]
    assert all(x["throughput_steady"] > 0 and x["ratio_to_synthetic"] > 0 for x in e2e["rows"])
    assert e2e["num_workers"] >= 1 and e2e["data"]["train_images"] == 24
    assert parts["ssd_e2e"]["result"]["row"]["status"] == "completed"
    cifar = parts["cifar"]["result"]
    if has_cifar:
        assert sorted(x["precision"] for x in cifar["rows"]) == sorted(CIFAR_PRECISIONS)
        assert all(x["status"] == "completed" for x in cifar["rows"])

    ddp = parts["ddp"]["result"]
    assert ddp["world_size"] == 2 and ddp["summary"]["status"] == "completed"
    assert ddp["summary"]["skipped_steps"] < ddp["summary"]["step"]
    # the watch on a torch.amp loop, in the CPU benchmark's rotation: one sampled step a watched block of 2
    (watch,) = parts["watch"]["result"]["rows"]
    assert watch["precision"] == "mixed" and watch["n"]["sampled"] == 1 and watch["step_ms"] > 0
    assert "every part ok" in r.stdout and "headline" in r.stdout


@pytest.mark.heavy
def test_a_part_past_its_budget_is_killed_and_recorded(tmp_path):
    env_before = dict(os.environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:  # the models part takes ~10 s here idle (each cell is written to the state file as it ends)
        rec = runner.run_part("models", True, tmp_path, timeout=3)
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    assert rec["status"] == "failed" and rec["error"].startswith("timeout: killed after its 3 s budget")
    assert rec["seconds"] < 20
    assert "(most recent call first)" in rec["traceback"]  # where it was when killed: its threads' stacks
    # The cells finished before the kill: measured, or skipped for what they need (the CUDA-graph cells on a CPU;
    # a faster CPU reaches them within the budget).
    assert all(x["status"] in ("ok", "skipped") for x in rec["result"].get("rows", []))


@pytest.mark.heavy
def test_a_spent_budget_fails_the_command_with_a_results_file(tmp_path, capsys):
    assert main(["--cpu-smoke", "--out", str(tmp_path), "--parts", "resume", "--budget", "1"]) == 1
    res = json.loads(next(tmp_path.glob("*-gpu_check-smoke.json")).read_text())
    assert res["parts"]["resume"]["status"] == "failed" and "budget was spent" in res["parts"]["resume"]["error"]
    assert res["exit_code"] == 1 and "FAILED: resume" in capsys.readouterr().out


@pytest.mark.heavy
def test_an_interrupted_call_keeps_the_finished_rows(tmp_path):
    """SIGTERM (a runner's stop) in the middle of a part: the part's process is killed, the rows it
    finished are in the results file, marked interrupted, and the call exits 130 with its summary."""
    import signal
    import time

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", MODULE, "--cpu-smoke", "--parts", "models,resume",
                             "--_save_every", "0.3"], cwd=REPO, env=_blocking_env(tmp_path, OUT=str(out)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rows, t0 = [], time.time()
    try:
        while time.time() - t0 < 300 and proc.poll() is None:
            time.sleep(0.2)
            f = next(out.glob("*-gpu_check-smoke.json"), None)
            try:
                rows = json.loads(f.read_text())["parts"]["models"]["result"]["rows"] if f else []
            except (KeyError, ValueError):
                rows = []
            if len(rows) >= 2:
                break
        assert proc.poll() is None and len(rows) >= 2, "the models part ended before two of its rows were saved"
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    res = json.loads(next(out.glob("*-gpu_check-smoke.json")).read_text())
    models = res["parts"]["models"]
    assert models["status"] == "interrupted" and len(models["result"]["rows"]) >= len(rows)
    assert all(r["status"] == ("skipped" if r["cuda_graphs"] else "ok") for r in models["result"]["rows"])
    assert res["parts"]["resume"]["status"] == "failed" and "interrupted" in res["parts"]["resume"]["error"]
    assert res["exit_code"] == 130 and "interrupted" in stderr


@pytest.mark.heavy
def test_a_killed_calls_work_folder_is_removed_by_the_next_call(tmp_path):
    """kill -9 of a call (a GPU job's time limit) left its temp work folder -- tiny data, runs -- for good; the
    next call removes the folders of calls that are gone (their flock is free), never a live one's."""
    import signal
    import time

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    live = tmp / ("gpu_check_" + "live")
    live.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY);"
                               " fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(120)", str(live)],
                              stdout=subprocess.PIPE, text=True)
    env = _blocking_env(tmp_path, TMPDIR=str(tmp), OUT=str(tmp_path / "out"))
    proc = subprocess.Popen([sys.executable, "-m", MODULE, "--cpu-smoke", "--parts", "models"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.time()
        while time.time() - t0 < 120 and not [d for d in tmp.glob("gpu_check_*") if d != live]:
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        left = [d for d in tmp.glob("gpu_check_*") if d != live]
        assert len(left) == 1, left  # what a killed call leaves
        _kill_processes_naming(left[0])  # its part runs on in its own session: it must not write there again
        r = subprocess.run([sys.executable, "-m", MODULE, "--cpu-smoke", "--parts", "resume",
                            "--budget", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 1, r.stderr[-2000:]  # the budget is spent after the probe: a quick call
        assert sorted(tmp.glob("gpu_check_*")) == [live]
    finally:
        for p in (proc, holder):
            if p.poll() is None:
                p.kill()
                p.wait()
        for d in tmp.glob("gpu_check_*"):
            _kill_processes_naming(d)
    assert live.is_dir()


def _kill_processes_naming(path) -> None:
    """SIGKILL the processes whose command line names `path` (a killed call's part, by its --_work)."""
    import signal

    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(path).encode() in cmd.read_bytes():
                os.kill(int(cmd.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def test_ddp_on_one_gpu_costs_nothing(tmp_path, monkeypatch):
    """On a GPU call the probe's GPU count decides ddp: with one GPU no process is started."""
    started = []
    monkeypatch.setattr(runner, "run_part", lambda part, *a, **k: started.append(part) or {
        "status": "ok", "seconds": 0.1, "budget_s": 60, "error": None, "traceback": None, "note": None,
        "result": {"env": {"device_name": "GPU", "gpu_count": 1}, "slug": "gpu"}})
    assert main(["--out", str(tmp_path), "--parts", "ddp"]) == 0
    assert started == ["env"]
    res = json.loads(next(tmp_path.glob("gpu-*-gpu_check.json")).read_text())
    assert res["parts"]["ddp"]["status"] == "skipped" and res["parts"]["ddp"]["seconds"] == 0.0


def test_out_defaults_to_the_out_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "remote_out"))
    monkeypatch.setattr(runner, "run_part", lambda part, *a, **k: {
        "status": "ok", "seconds": 0.1, "budget_s": 60, "error": None, "traceback": None, "note": None,
        "result": {"env": {"device_name": "GPU", "gpu_count": 1}, "slug": "gpu"}})
    assert main(["--parts", "ddp"]) == 0
    assert [p.name.endswith("-gpu_check.json") for p in (tmp_path / "remote_out").iterdir()] == [True]


def test_a_call_runs_its_parts_in_order_each_within_its_limit(tmp_path, monkeypatch):
    """A GPU call without --parts runs every part, the most valuable first (the synthetic headline, then
    training from JPEG files), each under its own limit (--limit sets one) and never past what is left
    of the call's --budget; ddp on one GPU is skipped without a process."""
    started = []

    def run_part(part, cpu_smoke, work, limit, **kw):
        started.append((part, limit))
        result = {"env": {"device_name": "GPU", "gpu_count": 1}, "slug": "gpu"} if part == "env" else {}
        return {"status": "ok", "seconds": 0.1, "budget_s": round(limit), "error": None, "traceback": None, "note": None,
                "result": result}

    monkeypatch.setattr(runner, "run_part", run_part)
    assert main(["--out", str(tmp_path), "--budget", "150", "--limit", "headline=240,e2e=30"]) == 0
    assert [p for p, _ in started][:4] == ["env", "headline", "e2e", "ssd_e2e"]
    assert [p for p, _ in started[1:]] == [p for p in PARTS if p != "ddp"]
    for part, limit in started[1:]:
        own = {"headline": 240, "e2e": 30}.get(part, runner.GPU_BUDGET_S[part])
        assert min(own, 150) - 10 < limit <= min(own, 150), (part, limit)  # the call's 150 s caps headline
    res = json.loads(next(tmp_path.glob("gpu-*-gpu_check.json")).read_text())
    assert res["budget_s"] == 150 and res["part_budgets_s"]["e2e"] == 30 and res["parts"]["ddp"]["status"] == "skipped"


def test_report_merges_a_machines_calls(tmp_path):
    """--report on the committed H200 calls: each part from the call where it ended ok (the headline and
    ds2_worst from the rerun, resume from the first), the cut models part with the rows it finished."""
    import shutil

    src = REPO / runner.RESULTS_DIR
    calls = [shutil.copy(src / f"nvidia-h200-2026-11-27-gpu_check-call{i}.json", tmp_path) for i in (1, 2)]
    res = merge([json.loads(open(c).read()) for c in calls])
    assert {p: (r["call"], r["status"]) for p, r in res["parts"].items()} == {
        "headline": (2, "ok"), "resume": (1, "ok"), "ds2_worst": (2, "ok"), "models": (1, "failed"),
        "ddp": (1, "skipped")}
    assert main(["--report", *map(str, calls)]) == 0
    md = (tmp_path / "nvidia-h200-2026-11-27-gpu_check.md").read_text()
    assert "| mixed (paper) | NHWC | 6,018 |" in md and "Not reached in its time limit: resnet50_preact" in md
    other = json.loads(open(calls[0]).read())
    other["env"]["device_name"] = "NVIDIA H100 80GB HBM3"
    (tmp_path / "h100.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit) as e:
        main(["--report", str(calls[1]), str(tmp_path / "h100.json")])
    assert e.value.code == 2
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit) as e:
        main(["--report", str(bad)])
    assert e.value.code == 2


def test_report_adds_up_the_e2e_rows_of_calls_with_other_worker_counts(tmp_path):
    """Calls that each ran the e2e part with other worker counts (--e2e-workers 7, then 3) report every
    (decode, workers) row, each with its ratio to the headline of the call that measured one."""
    import shutil

    src = REPO / runner.RESULTS_DIR
    calls = [shutil.copy(src / f"nvidia-h200-2026-11-29-gpu_check-{c}.json", tmp_path)
             for c in ("call2", "call1-w7", "call1-w3")]
    res = merge([json.loads(open(c).read()) for c in calls])
    rows = res["parts"]["e2e"]["result"]["rows"]
    assert [(r["decode"], r["num_workers"], r["call"]) for r in rows] == [
        ("cpu", 7, 2), ("gpu", 7, 2), ("cpu", 3, 3), ("gpu", 3, 3)]
    synthetic = next(r["throughput"] for r in res["parts"]["headline"]["result"]["rows"]
                     if r["precision"] == "mixed" and r["impl"] == "autocast" and r["channels_last"])
    assert all(r["ratio_to_synthetic"] == round(r["throughput_sustained"] / synthetic, 3) for r in rows)
    # these files predate the recorded rate: computed from their windows (32-step epochs, 5-step windows)
    w7 = rows[0]
    assert w7["throughput_sustained"] == sustained_rate(w7["windows"], [i in (0, 6, 12) for i in range(16)], 4)
    assert main(["--report", *map(str, calls)]) == 0
    md = (tmp_path / "nvidia-h200-2026-11-29-gpu_check.md").read_text()
    assert md.count("| cpu | ") == 2 and md.count("| gpu | ") == 2 and "SSD300 mixed, batch 32" in md


def test_the_sustained_rate_is_images_over_time_within_epochs():
    """A loader that falls behind makes the windows swing: their median reads high; the sustained rate is
    the windows' images over their time (equal step counts: the harmonic mean), less the epoch starts."""
    # 10-step epochs, 5-step windows: windows 0, 2 and 4 hold an epoch's first step (steps 1, 11, 21)
    starts = epoch_starts([i * 5 / 10 for i in range(7)])
    assert starts == [True, False, True, False, True, False]
    windows = [50.0, 300.0, 20.0, 100.0, 20.0, 300.0]
    assert sustained_rate(windows, starts, 0) == 180.0  # 3 windows / (1/300 + 1/100 + 1/300) s per image
    assert sustained_rate(windows, starts, 2) == 150.0 and sustained_rate(windows, [True] * 6, 0) is None
    # the e2e runs: 32-step epochs, 5-step windows: windows 6 and 12 start epochs 2 and 3
    assert [i for i, st in enumerate(epoch_starts([i * 5 / 32 for i in range(17)])) if st] == [0, 6, 12]
