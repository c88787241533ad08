"""`python -m experiments.gpu_check` (the first GPU hour in one command) cannot rot: its --cpu-smoke runs
every part at tiny size on the CPU, end to end, through the same code; a part that fails or hangs is
recorded and the others run; bad input is one line."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from experiments import gpu_check


@pytest.mark.parametrize("argv, says", [
    (["--parts", "headline,foo"], "--parts foo: choose from"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--budget", "0"], "--budget 0: give a positive number"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and err.count("\n") == 1


@pytest.mark.heavy
def test_cpu_smoke_runs_every_part(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "experiments.gpu_check", "--cpu-smoke", "--out", str(tmp_path)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    files = list(tmp_path.glob("cpu-*-gpu_check-smoke.json"))
    assert len(files) == 1, files
    res = json.loads(files[0].read_text())
    assert res["schema"] == gpu_check.SCHEMA and res["mode"] == "cpu-smoke" and res["exit_code"] == 0
    parts = res["parts"]
    assert list(parts) == list(gpu_check.PARTS)
    assert {p: v["status"] for p, v in parts.items()} == {p: "ok" for p in gpu_check.PARTS}, \
        {p: v["error"] for p, v in parts.items()}

    head = parts["headline"]["result"]["rows"]
    assert [(x["precision"], x["impl"], x["status"]) for x in head] == [
        ("fp32", None, "ok"), ("tf32", None, "skipped"), ("mixed", "autocast", "ok"), ("mixed", "paper", "ok")]
    assert all(x["throughput"] > 0 for x in head if x["status"] == "ok")
    assert {g["id"] for g in parts["headline"]["result"]["goals"]} >= {"resnet50_mixed_throughput",
                                                                       "resnet50_speedup_vs_fp32"}

    models = parts["models"]["result"]["rows"]
    assert {(x["model"], x["precision"]) for x in models} == {
        (m, p) for m in gpu_check.TABLE1 + gpu_check.TABLE3 for p in ("fp32", "mixed", "fp16_storage")}
    assert all(x["status"] == "ok" and x["step_ms"]["median"] > 0 for x in models)
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

    ddp = parts["ddp"]["result"]
    assert ddp["world_size"] == 2 and ddp["summary"]["status"] == "completed"
    assert ddp["summary"]["skipped_steps"] < ddp["summary"]["step"]
    assert "every part ok" in r.stdout and "headline" in r.stdout


@pytest.mark.heavy
def test_a_part_past_its_budget_is_killed_and_recorded(tmp_path):
    env_before = dict(os.environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:  # the models part takes ~10 s here idle (each cell is written to the state file as it ends)
        rec = gpu_check.run_part("models", True, tmp_path, timeout=3)
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    assert rec["status"] == "failed" and rec["error"].startswith("timeout: killed after its 3 s budget")
    assert rec["seconds"] < 20
    assert all(x["status"] == "ok" for x in rec["result"].get("rows", []))  # cells measured before the kill


@pytest.mark.heavy
def test_a_spent_budget_fails_the_command_with_a_results_file(tmp_path, capsys):
    assert gpu_check.main(["--cpu-smoke", "--out", str(tmp_path), "--parts", "resume", "--budget", "1"]) == 1
    res = json.loads(next(tmp_path.glob("*-gpu_check-smoke.json")).read_text())
    assert res["parts"]["resume"]["status"] == "failed" and "budget was spent" in res["parts"]["resume"]["error"]
    assert res["exit_code"] == 1 and "FAILED: resume" in capsys.readouterr().out
