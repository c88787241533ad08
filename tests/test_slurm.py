"""slurm/ without a cluster: grid expansion, profiles, bad input, dry runs, the local backend and
its concurrency cap, and slurm.status read from run directories. The real-cluster tests are in
tests/test_slurm_cluster.py."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mpt.errors import UserError
from slurm import clusters, grid as G, local, state, status, submit

REPO = Path(__file__).resolve().parents[1]
GRID = REPO / "experiments" / "ilsvrc_cnns" / "grid.yaml"
_AXES = __import__("yaml").safe_load(GRID.read_text())["axes"]
_TINY_AXES = {**_AXES, **__import__("yaml").safe_load(GRID.read_text())["profiles"]["tiny"].get("axes", {})}
N_MODELS, N_PREC = len(_AXES["model"]), len(_AXES["precision"])
GRID32 = REPO / "experiments" / "ilsvrc_cnns" / "grid_batch32.yaml"
# the paper profile: the four batch-256 nets (GoogLeNet and BN-Inception run one GPU each: grid_batch32.yaml)
_PAPER_AXES = {**_AXES, **__import__("yaml").safe_load(GRID.read_text())["profiles"]["paper"].get("axes", {})}
N_PAPER = len(_PAPER_AXES["model"]) * N_PREC * len(_AXES["seed"])
# the tiny profile: its own precisions (+ the fp16_pure ablation) and seeds
N_TINY_PREC = len(_TINY_AXES["precision"]) * len(_TINY_AXES["seed"])
N_TINY = len(_TINY_AXES["model"]) * N_TINY_PREC


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def tiny_set(root, out):
    return [f"task.data_root={root}", f"out_dir={out}"]


# ------------------------------------------------------------------------------------------------
# grids


def test_tiny_grid_cells_have_content_ids_and_run_dirs(tmp_path):
    g = G.load(GRID, "tiny", tiny_set("/nonexistent", tmp_path))
    assert g.experiment == "ilsvrc_cnns" and g.resources.gpus == 0
    assert len(g.cells) == N_TINY
    assert len({c.cell_id for c in g.cells}) == N_TINY
    for c in g.cells:
        assert "profile=tiny" in c.overrides
        assert c.run_dir.parent == tmp_path / "ilsvrc_cnns"
        assert c.run_name.endswith(c.cell_id[:10])
    # Infrastructure keys (data path, out_dir) do not change a cell's id.
    g2 = G.load(GRID, "tiny", tiny_set("/elsewhere", tmp_path / "other"))
    assert [c.cell_id for c in g2.cells] == [c.cell_id for c in g.cells]


def test_a_precision_group_expands_to_the_rows_of_the_table(tmp_path, monkeypatch):
    """`precision: [block_scaled]` in a grid runs every block-scaled row of mpt/precisions.py -- one added
    to the table joins the grid without an edit -- with the same cells (and run ids) as the names written out."""
    from mpt import precisions

    grid = REPO / "experiments" / "ilsvrc_cnns" / "grid_formats.yaml"
    assert "[block_scaled]" in grid.read_text()
    by_group = G.load(grid, "tiny", tiny_set("/nonexistent", tmp_path))
    assert [c.axes["precision"] for c in by_group.cells][::len(by_group.cells) // len(precisions.BLOCK_SCALED)] == \
        list(precisions.BLOCK_SCALED)
    spelt = write(tmp_path / "spelt.yaml", grid.read_text().replace(
        "[block_scaled]", "[" + ", ".join(precisions.BLOCK_SCALED) + ", block_scaled]"))  # a member twice: once
    assert [c.cell_id for c in G.load(spelt, "tiny", tiny_set("/nonexistent", tmp_path)).cells] == \
        [c.cell_id for c in by_group.cells]
    monkeypatch.setitem(precisions.GROUPS, "block_scaled", ("mxfp8",))  # the group is read from the table
    assert {c.axes["precision"] for c in G.load(grid, "tiny", tiny_set("/nonexistent", tmp_path)).cells} == {"mxfp8"}


def test_relative_out_dir_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    g = G.load(GRID, "tiny", ["out_dir=runs"])
    assert all(c.run_dir.is_absolute() and str(c.run_dir).startswith(str(tmp_path)) for c in g.cells)
    assert all(f"out_dir={tmp_path / 'runs'}" in c.overrides for c in g.cells)


def test_only_filters_cells():
    assert len(G.load(GRID, "tiny", only=["model=alexnet"]).cells) == N_TINY_PREC
    cells = G.load(GRID, "tiny", only=["model=alexnet", "model=resnet50_preact", "precision=fp32"]).cells
    assert sorted(c.axes["model"] for c in cells) == ["alexnet"] * 3 + ["resnet50_preact"] * 3  # 3 seeds
    from mpt import config as C

    batch = C.resolve("ilsvrc_cnns", ["profile=tiny"]).train.batch_size
    assert len(G.load(GRID, "tiny", only=[f"train.batch_size={batch}"]).cells) == N_TINY  # any config key
    with pytest.raises(UserError, match="unknown config key 'nosuch'"):
        G.load(GRID, "tiny", only=["nosuch=1"])
    with pytest.raises(UserError, match="matches no cell"):
        G.load(GRID, "tiny", only=["seed=12345"])


def test_paper_profile_uses_gpus_and_estimates(tmp_path):
    g = G.load(GRID, "paper")
    assert len(g.cells) == N_PAPER and g.resources.gpus == 8 and g.resources.world == 8
    assert g.resources.hours_for("vgg16") == 60
    g32 = G.load(GRID32, "paper")  # the batch-32 nets: one GPU per run
    assert g32.resources.gpus == 1 and len(g32.cells) == 2 * N_PREC
    # Together the two grids hold every Table 1 model, each once.
    m32 = __import__("yaml").safe_load(GRID32.read_text())["axes"]["model"]
    assert sorted(_PAPER_AXES["model"] + m32) == sorted(_AXES["model"]) and len(_AXES["model"]) == 6


@pytest.mark.parametrize("text, match", [
    ("experiment: ilsvrc_cnns\naxes: {model: [alexnet]}\nprofiles: {tiny: {}}\nbogus: 1\n", "unknown key.*bogus"),
    ("axes: {model: [alexnet]}\nprofiles: {tiny: {}}\n", "missing 'experiment"),
    ("experiment: nosuch\naxes: {model: [alexnet]}\nprofiles: {tiny: {}}\n", "unknown experiment 'nosuch'"),
    ("experiment: ilsvrc_cnns\naxes: {model: alexnet}\nprofiles: {tiny: {}}\n", "non-empty list"),
    ("experiment: ilsvrc_cnns\naxes: {model: [alexnet]}\nprofiles: {tiny: {gpu: 1}}\n", "unknown key.*gpu"),
    ("experiment: ilsvrc_cnns\naxes: {model: [alexnet]}\nprofiles: {tiny: {resources: {cores: 2}}}\n",
     "unknown key.*cores"),
    ("experiment: ilsvrc_cnns\naxes: {model: [alexnet], nosuch.key: [1]}\nprofiles: {tiny: {}}\n",
     "cell model=alexnet nosuch.key=1: unknown config key 'nosuch.key'"),
    ("experiment: ilsvrc_cnns\naxes: {model: [alexnet], task.data_root: [a, b]}\nprofiles: {tiny: {}}\n",
     "same run"),
    ("experiment: ilsvrc_cnns\naxes: {model: [alexnet]}\nprofiles: {tiny: {resources: {gpus: 2, tasks: 3}}}\n",
     "one task per GPU"),
    ("experiment: [unclosed\n", "not valid YAML"),
    # A key given twice kept the last (PyYAML): the first axis's cells were silently dropped.
    ("experiment: ilsvrc_cnns\naxes:\n  model: [alexnet]\n  model: [vgg16]\nprofiles: {tiny: {}}\n",
     "not valid YAML: duplicate key 'model' \\(first at line 3\\) at line 4, column 3"),
    ("experiment: ilsvrc_cnns\naxes: {model: [alexnet]}\nprofiles: {tiny: {}, tiny: {axes: {seed: [1]}}}\n",
     "duplicate key 'tiny'"),
    ("experiment: ilsvrc_cnns/../dcgan\naxes: {model: [alexnet]}\nprofiles: {tiny: {}}\n",
     "experiment: 'ilsvrc_cnns/../dcgan' is not the name of a folder in experiments/"),
    (b"\xb4\x00\xff binary", "is not UTF-8 text"),
])
def test_bad_grid_files_are_one_line_errors(tmp_path, text, match):
    path = tmp_path / "grid.yaml"
    path.write_bytes(text) if isinstance(text, bytes) else write(path, text)
    with pytest.raises(UserError, match=match) as e:
        G.load(path, "tiny")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text,match", [
    ("variants: {precision: fp32}\n", "non-empty list of mappings"),
    ("variants: [{precision: [fp32, bf16]}]\n", "each variant maps config keys to scalars"),
    ("variants: [{model: vgg16}]\n", "model is an axis and a variant key"),
    ("variants: [{precision: fp32}, {precision: fp32}]\n", "same run"),
    ("variants: [{precision: nvfp4, fmt.w.granularity: nosuch}]\n", "cell precision=nvfp4 fmt.w.granularity=nosuch"),
])
def test_bad_variants_are_one_line_errors(tmp_path, text, match):
    path = write(tmp_path / "grid.yaml", "experiment: ilsvrc_cnns\naxes: {model: [alexnet]}\nprofiles: {tiny: {}}\n"
                 + text)
    with pytest.raises(UserError, match=match) as e:
        G.load(path, "tiny")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("experiment,profile", [("lm_biglstm", "tiny"), ("wmt_translation", "tiny"),
                                                ("ilsvrc_cnns", "real")])
def test_a_switch_grid_flips_one_key_of_a_preset_per_variant(tmp_path, experiment, profile):
    """grid_switches.yaml: its variants crossed with the seeds, each variant's seeds together, every cell a
    run of its own; a switched cell's recipe differs from the preset's in what its variant names alone."""
    import dataclasses

    from mpt import precisions

    path = REPO / "experiments" / experiment / "grid_switches.yaml"
    variants = __import__("yaml").safe_load(path.read_text())["variants"]
    g = G.load(path, profile, [f"task.data_root={tmp_path}", f"out_dir={tmp_path}"])
    assert len(g.cells) == len(variants) * 3 == len({c.cell_id for c in g.cells})
    assert [c.axes["seed"] for c in g.cells[:3]] == ["0", "1", "2"]
    preset = precisions.format_recipe(next(c for c in g.cells if c.axes["precision"] == "nvfp4").cfg)
    for c in g.cells:
        assert c.cfg.numerics.sqnr_every > 0
        if c.axes["precision"] != "nvfp4" or len(c.axes) == 3:
            continue
        changed = {f.name for f in dataclasses.fields(preset)
                   if getattr(precisions.format_recipe(c.cfg), f.name) != getattr(preset, f.name)}
        assert changed == {k.split(".")[1] for k in c.axes if k.startswith("fmt.")}


def test_every_config_yaml_refuses_a_repeated_key_but_keeps_merge_keys():
    """mpt.config_parse.safe_load reads experiments' config.yaml, overrides, grids and cluster profiles."""
    import yaml

    from mpt import config_parse

    with pytest.raises(yaml.YAMLError, match="duplicate key 'lr'"):
        config_parse.safe_load("optim:\n  lr: 0.1\n  lr: 0.2\n")
    base = "base: &b {lr: 0.1, wd: 0}\nrun:\n  <<: *b\n  lr: 0.2\n"
    assert config_parse.safe_load(base)["run"] == {"lr": 0.2, "wd": 0}
    assert config_parse.parse_overrides(["task.buckets=[[1, 2]]"]) == [("task.buckets", [[1, 2]])]


def test_unknown_profile_and_missing_grid(tmp_path):
    with pytest.raises(UserError, match="unknown profile 'huge'; choose one of: tiny, paper"):
        G.load(GRID, "huge")
    with pytest.raises(UserError, match="not found"):
        G.load(tmp_path / "nope.yaml", "tiny")


# ------------------------------------------------------------------------------------------------
# cluster profiles


def test_cluster_profiles_in_repo_load():
    for p in (REPO / "slurm" / "clusters").glob("*.yaml"):
        c = clusters.load(p.stem)
        assert c.time_min >= 1 and c.max_array_size >= 1


@pytest.mark.parametrize("text, match", [
    ("partition: a\ngpus_per_nod: 4\n", "unknown key.*gpus_per_nod"),
    ("time_min: soon\n", "time_min must be an integer"),
    ("mem_gb_per_task: 0\n", "mem_gb_per_task must be a positive"),
    ("setup: module load x\n", "setup must be a list"),
    ("gpu_flag: gpus\n", "gpu_flag must be gpus-per-node .* or gres .*, got 'gpus'"),
    ("kill_on_bad_exit: 1\n", "kill_on_bad_exit must be true or false"),
])
def test_bad_cluster_profiles(tmp_path, text, match):
    with pytest.raises(UserError, match=match):
        clusters.load(str(write(tmp_path / "c.yaml", text)))
    with pytest.raises(UserError, match="not found.*local"):
        clusters.load("no_such_cluster")


def test_nodes_tasks_and_sbatch_parameters():
    assert G.nodes_and_tasks(G.Resources(gpus=8), 8) == (1, 8)
    assert G.nodes_and_tasks(G.Resources(gpus=16), 8) == (2, 8)
    assert G.nodes_and_tasks(G.Resources(gpus=2), 8) == (1, 2)
    assert G.nodes_and_tasks(G.Resources(gpus=0, tasks=2), 0) == (1, 2)
    with pytest.raises(UserError, match="whole nodes"):
        G.nodes_and_tasks(G.Resources(gpus=12), 8)
    with pytest.raises(UserError, match="gpus_per_node: 0"):
        G.nodes_and_tasks(G.Resources(gpus=1), 0)
    c = clusters.load("example_gpu")
    p = clusters.sbatch_parameters(c, job_name="x", nodes=2, tasks_per_node=8, gpus=16, chdir="/repo")
    assert p["gpus_per_node"] == 8 and p["ntasks_per_node"] == 8 and p["nodes"] == 2
    assert p["mem"] == f"{60 * 1024 * 8}MB" and p["signal_delay_s"] == 300
    assert p["additional_parameters"]["requeue"] is True
    # The sbatch script submitit would write: one task per GPU, USR2 before the limit, requeueable.
    from submitit.slurm.slurm import _make_sbatch_string

    text = _make_sbatch_string(command="run", folder="/tmp/x", **p)
    for line in ("--gpus-per-node=8", "--ntasks-per-node=8", "--signal=USR2@300", "--requeue", "--partition=gpu",
                 "--time=1440", "--chdir=/repo"):
        assert line in text, line
    assert "--gres" not in text


def _srun_line(text: str) -> list[str]:
    (line,) = [x for x in text.splitlines() if x.startswith("srun ")]
    return line.split()


def test_srun_gets_cpus_per_task_and_kill_on_bad_exit(tmp_path):
    """srun of SLURM 22.05-23.02 does not inherit --cpus-per-task from sbatch: the job's srun line
    carries it, and --kill-on-bad-exit=1 (one failed rank ends the others) unless the profile says no."""
    from submitit.slurm.slurm import _make_sbatch_string

    c = clusters.load("example_gpu")
    assert c.kill_on_bad_exit is True and c.gpu_flag == "gpus-per-node"
    for gpus, per_node in ((16, 8), (0, 2)):  # a GPU run and a CPU run
        p = clusters.sbatch_parameters(c, job_name="x", nodes=1, tasks_per_node=per_node, gpus=gpus, chdir="/repo")
        text = _make_sbatch_string(command="run", folder="/tmp/x", **p)
        assert "#SBATCH --cpus-per-task=10" in text
        assert {"--cpus-per-task=10", "--kill-on-bad-exit=1"} <= set(_srun_line(text)), text
    off = clusters.load(str(write(tmp_path / "c.yaml", "cpus_per_task: 3\nkill_on_bad_exit: false\n")))
    p = clusters.sbatch_parameters(off, job_name="x", nodes=1, tasks_per_node=1, gpus=0, chdir="/repo")
    assert {"--cpus-per-task=3", "--kill-on-bad-exit=0"} <= set(_srun_line(_make_sbatch_string(command="run", folder="/x", **p)))
    # What submit passes is accepted by submitit's executor as it is.
    import submitit

    submitit.SlurmExecutor(folder=tmp_path).update_parameters(**p)


def test_gpu_flag_gres_asks_for_gpus_with_gres(tmp_path):
    from submitit.slurm.slurm import _make_sbatch_string

    c = clusters.load(str(write(tmp_path / "c.yaml", "partition: gpu\ngpus_per_node: 4\ngpu_flag: gres\n")))
    p = clusters.sbatch_parameters(c, job_name="x", nodes=2, tasks_per_node=4, gpus=8, chdir="/repo")
    text = _make_sbatch_string(command="run", folder="/tmp/x", **p)
    assert "#SBATCH --gres=gpu:4" in text and "--gpus-per-node" not in text
    assert "#SBATCH --ntasks-per-node=4" in text and "#SBATCH --nodes=2" in text
    # A CPU run asks for no GPUs either way.
    p = clusters.sbatch_parameters(c, job_name="x", nodes=1, tasks_per_node=2, gpus=0, chdir="/repo")
    assert "gres" not in p and "gpus_per_node" not in p


# ------------------------------------------------------------------------------------------------
# the submit command without a cluster


def test_backend_is_required(capsys):
    with pytest.raises(SystemExit):
        submit.main([str(GRID), "--profile", "tiny"])
    assert "--backend" in capsys.readouterr().err


def test_dry_run_prints_cells_batch_split_and_gpu_hours(tmp_path, capsys):
    submit.main([str(GRID), "--profile", "paper", "--backend", "slurm", "--cluster", "example_gpu", "--dry-run",
                 "--set", f"out_dir={tmp_path}", "--only", "model=resnet50_preact"])
    out = capsys.readouterr().out
    assert f"{N_PREC} cell(s), {N_PREC} to submit" in out
    assert "resnet50_preact-fp32" in out and "resnet50_preact-mixed" in out
    assert "batch 256 = 8 x 32" in out
    assert f"{30 * N_PREC} run-hours x 8 GPUs = {240 * N_PREC} GPU-hours" in out  # N runs x 30 h x 8 GPUs
    assert "time limit 1440 min" in out
    assert not (tmp_path / "ilsvrc_cnns" / state.MANIFEST).exists()  # nothing submitted


def test_dry_run_prints_batch_norm_batch_per_gpu(tmp_path, capsys):
    """BN-Inception's reference normalises over 32 images. Its paper grid runs one GPU
    at batch 32 (grid_batch32.yaml: 8 GPUs would get 4 images each); spread over 8 GPUs its
    recipe synchronises BN and the dry run says so. Nets without BN print no BN batch."""
    submit.main([str(GRID), "--profile", "paper", "--backend", "slurm", "--cluster", "example_gpu", "--dry-run",
                 "--set", f"out_dir={tmp_path}", "--only", "precision=fp32", "model=resnet50_preact", "model=alexnet"])
    lines = {ln.split()[0].split("-")[0]: ln for ln in capsys.readouterr().out.splitlines() if "-fp32-s" in ln}
    assert "batch 256 = 8 x 32, BN batch 32 per GPU" in lines["resnet50_preact"]
    assert "BN batch" not in lines["alexnet"]
    submit.main([str(GRID32), "--profile", "paper", "--backend", "slurm", "--cluster", "example_gpu", "--dry-run",
                 "--set", f"out_dir={tmp_path}", "--only", "precision=fp32", "model=inception_v2"])
    out = capsys.readouterr().out
    assert "batch 32 = 1 x 32" in out and "synced" not in out, out  # one GPU: the BN batch is the batch


@pytest.mark.heavy
def test_slurm_backend_without_sbatch_is_one_line_error(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no sbatch, srun, git ...
    r = subprocess.run([sys.executable, "-m", "slurm.submit", str(GRID), "--profile", "tiny", "--backend", "slurm",
                        "--cluster", "local", "--set", f"out_dir={tmp_path}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "sbatch" in err[0], r.stderr


@pytest.mark.parametrize("argv, match", [
    (["--backend", "slurm"], "needs --cluster"),
    (["--backend", "local", "--cluster", "local"], "--cluster is for --backend slurm"),
    (["--backend", "slurm", "--cluster", "nope"], "cluster profile 'nope' not found"),
    (["--backend", "local", "--jobs", "0"], "at least one"),
])
def test_submit_argument_errors(tmp_path, argv, match):
    with pytest.raises(UserError, match=match):
        submit.main([str(GRID), "--profile", "tiny", "--set", f"out_dir={tmp_path}", "task.data_root=/none", *argv])


def test_sbatch_message_is_one_line():
    from submitit.core.utils import FailedJobError

    e = FailedJobError("sbatch: error: invalid partition specified: nope\n"
                       "sbatch: error: Batch job submission failed: Invalid partition name specified")
    assert submit.sbatch_message(e) == ("invalid partition specified: nope; "
                                         "Batch job submission failed: Invalid partition name specified")


# ------------------------------------------------------------------------------------------------
# local backend


def test_local_backend_never_exceeds_its_cap(tmp_path):
    script = ("import sys, time, pathlib; d = pathlib.Path(sys.argv[1]); t0 = time.time(); time.sleep(1.5); "
              "d.write_text(f'{t0} {time.time()}')")
    tasks = [local.LocalTask(f"t{i}", [sys.executable, "-c", script, str(tmp_path / f"t{i}")]) for i in range(6)]
    started = []
    results = local.run_local(tasks, cap=3, started=lambda t, pid: started.append(t.name), say=lambda *a: None)
    assert results == {f"t{i}": 0 for i in range(6)} and len(started) == 6
    spans = [tuple(map(float, (tmp_path / f"t{i}").read_text().split())) for i in range(6)]
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    now = peak = 0
    for _, d in events:
        now += d
        peak = max(peak, now)
    assert peak == 3  # the cap is reached and never passed


def test_local_backend_says_k_of_n_with_each_result_and_the_time_left(tmp_path):
    """As each cell ends: [k/N] name: status and primary metric from its summary.json (or its exit code),
    its time, the time elapsed and -- until the last -- an estimate of the time left."""
    script = ("import sys, json, pathlib; d = pathlib.Path(sys.argv[1]); d.mkdir(); (d / 'summary.json').write_text("
              "json.dumps({'status': 'completed', 'primary_metric': 'top1', 'metrics': {'top1': float(sys.argv[2])}})); "
              "sys.exit(int(sys.argv[3]))")
    tasks = [local.LocalTask(f"t{i}", [sys.executable, "-c", script, str(tmp_path / f"t{i}"), str(10 * i), str(int(i == 2))],
                              run_dir=tmp_path / f"t{i}") for i in range(3)]
    lines = []
    results = local.run_local(tasks, cap=1, say=lines.append)
    assert results == {"t0": 0, "t1": 0, "t2": 1}
    assert [ln.split(":")[0].strip() for ln in lines] == ["[1/3] t0", "[2/3] t1", "[3/3] t2"], lines
    assert "completed, top1 10 (" in lines[1] and "elapsed, ~" in lines[1] and "left)" in lines[1]
    assert "exit 1 (completed, top1 20)" in lines[2] and "left" not in lines[2]


def test_grid_manifest_and_local_logs_are_not_appended_through_a_symlink(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    (tmp_path / "exp").mkdir()
    state.manifest_path(tmp_path / "exp").symlink_to(target)
    with pytest.raises(UserError, match="submissions.jsonl is a symbolic link"):
        state.append_manifest(tmp_path / "exp", {"cells": []})
    (tmp_path / "cell.log").symlink_to(target)
    for task in (local.LocalTask("t", [sys.executable, "-c", "print('hello')"], log=tmp_path / "cell.log"),
                 _probe(tmp_path, "cell", "0", preload=("torch",))):  # fresh and forked
        with pytest.raises(UserError, match="cell.log is a symbolic link"):
            local.run_local([task], cap=1, say=lambda *a: None)
    assert target.read_text() == "keep me\n"


@pytest.mark.parametrize("flag", ["--threads", "--jobs"])
def test_zero_threads_or_jobs_is_one_line(flag, capsys):
    """--threads 0 ran each cell with the grid's threads without a word; --threads -1 set OMP_NUM_THREADS=-1."""
    for n in ("0", "-1"):
        with pytest.raises(UserError, match=rf"{flag} {n}: give at least one"):
            submit.prepare([str(GRID), "--profile", "tiny", "--backend", "local", flag, n, "--dry-run"])


def test_default_cap_from_cores_and_threads():
    n = os.cpu_count()
    assert local.default_cap(1, 1, 0) == n
    assert local.default_cap(n, 1, 0) == 1
    assert local.default_cap(4 * n, 2, 0) == 1


@pytest.mark.heavy
def test_local_backend_runs_cells_skips_completed_and_isolates_a_failure(tiny_imagenet, tmp_path, capsys):
    """Two real tiny cells, one that fails when it runs (a batch larger than the training set, which only
    the data can tell): it fails alone with its error, the other completes; submitting again skips the
    completed cell and retries the failed one."""
    grid = write(tmp_path / "grid.yaml", """\
        experiment: ilsvrc_cnns
        axes: {model: [alexnet], precision: [fp32], train.batch_size: [16, 100000]}
        overrides: [wandb.mode=disabled, train.progress=false, train.epochs=1]
        profiles: {tiny: {resources: {threads: 1}}}
    """)
    sets = [f"task.data_root={tiny_imagenet}", f"out_dir={tmp_path / 'runs'}"]
    argv = [str(grid), "--profile", "tiny", "--set", *sets]
    with pytest.raises(SystemExit) as e:
        submit.main([*argv, "--backend", "local", "--jobs", "2"])
    assert e.value.code == 1
    g, rows, _ = status.collect(grid, "tiny", sets)
    by = {str(c.axes["train.batch_size"]): st for c, st in rows}
    assert by["16"].state == "completed" and by["16"].latest.startswith("top1=")
    assert by["100000"].state == "failed" and "larger than the training set" in by["100000"].error
    assert by["16"].job_id.startswith("local:")
    job = json.loads((g.cells[0].run_dir / "job.json").read_text())
    assert job["state"] == "completed" and job["attempts"][0]["outcome"] == "completed"
    assert job["overrides"] == g.cells[0].overrides  # the run folder says which cell it is
    capsys.readouterr()
    status.main(argv)
    out = capsys.readouterr().out
    assert "1 completed, 1 failed" in out and "100000" in out
    manifest = (tmp_path / "runs" / "ilsvrc_cnns" / state.MANIFEST).read_text().splitlines()
    assert len(manifest) == 1 and len(json.loads(manifest[0])["cells"]) == 2
    submit.main([*argv, "--backend", "local", "--dry-run"])
    out = capsys.readouterr().out
    assert "1 to submit, skipped: 1 completed" in out and "submit (failed: resumes)" in out


# ------------------------------------------------------------------------------------------------
# status from run directories alone


def _fake_run(run_dir: Path, summary=None, job=None):
    run_dir.mkdir(parents=True)
    if summary:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    if job:
        (run_dir / "job.json").write_text(json.dumps(job))


def test_status_reads_states_from_run_dirs(tmp_path):
    g = G.load(GRID, "tiny", [f"out_dir={tmp_path}"])
    c = {(x.axes["model"], x.axes["precision"]): x for x in g.cells}
    _fake_run(c["alexnet", "fp32"].run_dir,
              {"status": "completed", "step": 60, "total_steps": 60, "metrics": {"top1": 42.0}, "primary_metric": "top1"},
              {"job_id": "7_0", "state": "completed", "attempts": [{}, {}]})
    _fake_run(c["alexnet", "mixed"].run_dir, {"status": "failed", "error": "UserError: no data"},
              {"job_id": "7_1", "state": "failed", "error": "UserError: no data", "attempts": [{}]})
    _fake_run(c["resnet50_preact", "fp32"].run_dir, {"status": "diverged", "step": 9, "total_steps": 60},
              {"job_id": "7_2", "state": "diverged", "attempts": [{}]})
    exp = tmp_path / "ilsvrc_cnns"
    jobs = [("alexnet", "fp32"), ("alexnet", "mixed"), ("resnet50_preact", "fp32"), ("resnet50_preact", "mixed")]
    state.append_manifest(exp, {"backend": "slurm", "cells": [
        {"cell_id": c[k].cell_id, "job_id": f"7_{i}"} for i, k in enumerate(jobs)]})
    latest = state.latest_jobs([exp])
    # Without a queue to ask (no SLURM here): the files decide.
    got = {k: state.cell_state(x.run_dir, x.cell_id, latest.get(x.cell_id), None) for k, x in c.items()}
    assert got["alexnet", "fp32"].state == "completed" and got["alexnet", "fp32"].latest == "top1=42"
    assert got["alexnet", "fp32"].attempts == 2
    assert got["alexnet", "mixed"].state == "failed" and got["alexnet", "mixed"].error == "UserError: no data"
    assert got["resnet50_preact", "fp32"].state == "diverged"
    assert got["resnet50_preact", "mixed"].state == "pending"  # submitted, no run directory yet
    # With a queue: a job that left it without writing anything failed; one still there is pending.
    q = {"7_3": "PENDING"}
    assert state.cell_state(c["resnet50_preact", "mixed"].run_dir, "", latest.get(
        c["resnet50_preact", "mixed"].cell_id), q).state == "pending"
    gone = state.cell_state(c["resnet50_preact", "mixed"].run_dir, "", latest.get(
        c["resnet50_preact", "mixed"].cell_id), {})
    assert gone.state == "failed" and "before the run started" in gone.error
    # A local run whose process is gone while job.json still says running was killed.
    run = tmp_path / "x" / "killed"
    _fake_run(run, {"status": "running", "step": 5}, {"job_id": f"local:{os.uname().nodename}:999999999",
                                                       "state": "running", "attempts": [{}]})
    assert state.cell_state(run, "", None, None).state == "failed"


def test_status_of_nothing_submitted(tmp_path, capsys):
    status.main([str(GRID), "--profile", "tiny", "--set", f"out_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert f"{N_TINY} cell(s): {N_TINY} not submitted" in out
    status.main([str(GRID), "--profile", "tiny", "--set", f"out_dir={tmp_path}", "--json"])
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(rows) == N_TINY and all(r["state"] == "not submitted" for r in rows)


def test_job_wrapper_maps_slurm_ranks(monkeypatch):
    from slurm import job

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")  # recorded, so the values set below are removed after the test
        monkeypatch.delenv(k)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SLURM_JOB_ID", "12345")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08]")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "12000")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "4")
    assert job._slurm_ranks() == "12000_4"
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("3", "8", "1")
    assert os.environ["MASTER_ADDR"] == "gpu07"
    assert os.environ["MASTER_PORT"] == str(job.master_port("12345"))
    from mpt.ranks import distributed_env

    assert distributed_env() == (3, 8, 1)


@pytest.mark.heavy
def test_local_process_stops_at_a_step_boundary_on_sigterm(tiny_imagenet, tmp_path):
    """The local backend's stop path: SIGTERM -> checkpoint -> status interrupted -> resume."""
    g = G.load(GRID, "tiny", [f"task.data_root={tiny_imagenet}", f"out_dir={tmp_path}", "train.max_steps=2000"],
               only=["model=alexnet", "precision=fp32"])
    c = g.cells[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "slurm.job", "--experiment", c.experiment, "--run-dir", str(c.run_dir),
                          "--", *c.overrides], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    metrics = c.run_dir / "metrics.jsonl"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            time.sleep(0.2)
        p.terminate()
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 3, err
    st = state.cell_state(c.run_dir, c.cell_id, None, None)
    assert st.state == "interrupted" and 0 < st.step < 2000
    job = json.loads((c.run_dir / "job.json").read_text())
    assert job["attempts"][-1]["signals"] == ["SIGTERM"] and job["attempts"][-1]["step"] == st.step
    assert (c.run_dir / "checkpoint.pt").exists()


# The run's teardown (after the summary said how it ended) held open until the test kills the process.
SLOW_TEARDOWN = """
import pathlib, time
import mpt.torch_private
def _stuck(loader):
    pathlib.Path({flag!r}).touch()
    time.sleep(600)
mpt.torch_private.shutdown_loader_workers = _stuck
from slurm.job import main
main({argv!r})
"""


@pytest.mark.heavy
def test_a_kill_during_the_teardown_leaves_the_attempt_recorded(tiny_imagenet, tmp_path):
    """summary.json said "completed" seconds before job.json's attempt did (after wandb's finish and the
    loader workers' teardown): a kill in between left the attempt "running" for good. The attempt is now
    recorded with the summary, before the teardown."""
    g = G.load(GRID, "tiny", [f"task.data_root={tiny_imagenet}", f"out_dir={tmp_path}", "train.max_steps=2"],
               only=["model=alexnet", "precision=fp32"])
    c = g.cells[0]
    flag = tmp_path / "tearing_down"
    argv = ["--experiment", c.experiment, "--run-dir", str(c.run_dir), "--", *c.overrides]
    p = subprocess.Popen([sys.executable, "-c", SLOW_TEARDOWN.format(flag=str(flag), argv=argv)], cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not flag.exists() and p.poll() is None:
            time.sleep(0.1)
        assert flag.exists(), p.communicate()[1][-2000:]
        p.kill()  # SIGKILL: nothing of the process runs after it
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert json.loads((c.run_dir / "summary.json").read_text())["status"] == "completed"
    job = json.loads((c.run_dir / "job.json").read_text())
    assert job["state"] == "completed" and job["attempts"][-1]["outcome"] == "completed", job
    assert job["attempts"][-1]["step"] == 2 and job["attempts"][-1]["end"] is not None
    assert state.cell_state(c.run_dir, c.cell_id, None, None).state == "completed"


def test_profile_is_chosen_by_its_flag_not_an_override(capsys):
    """`--set profile=paper` under `--profile tiny` was accepted and ran the paper's
    cells under the tiny profile's name."""
    from slurm import submit

    args = ["experiments/ilsvrc_cnns/grid.yaml", "--profile", "tiny", "--backend", "local", "--dry-run"]
    with pytest.raises(SystemExit) as e:
        submit.cli(submit.main)(args + ["--set", "profile=paper"])
    assert e.value.code == 2
    assert "choose the profile with --profile" in capsys.readouterr().err


# Threads for the probe cells: not this process's (which the forkserver inherits and torch caps at the cores).
PROBE_THREADS = 2 if os.environ.get("OMP_NUM_THREADS") == "1" else 1


def _probe(tmp_path, name, code, *extra, preload=()):
    return local.LocalTask(name, [sys.executable, "-m", "local_cell_probe", str(tmp_path / f"{name}.json"), code, *extra],
                            env={"PROBE_VAR": name, "OMP_NUM_THREADS": str(PROBE_THREADS), "PYTHONPATH": str(REPO / "tests")},
                            log=tmp_path / f"{name}.log", preload=preload)


@pytest.mark.heavy
def test_a_cell_forked_from_the_preloaded_server_runs_as_a_fresh_process_would(tmp_path):
    """run_locally's cells start as forks of a process that imported torch once (preload): each is still
    `python -m MODULE ARGS` in its own session, with its environment, thread count, log and exit code."""
    tasks = [_probe(tmp_path, f"{kind}{code}", code, preload=pre)
             for kind, pre in (("fresh", ()), ("forked", ("torch",))) for code in ("0", "2", "raise")]
    pids = {}
    results = local.run_local(tasks, cap=2, started=lambda t, pid: pids.setdefault(t.name, pid), say=lambda *a: None)
    assert results == {"fresh0": 0, "fresh2": 2, "freshraise": 1, "forked0": 0, "forked2": 2, "forkedraise": 1}
    for kind in ("fresh", "forked"):
        for code in ("0", "2", "raise"):
            name = f"{kind}{code}"
            info = json.loads((tmp_path / f"{name}.json").read_text())
            assert info["preloaded"] == (kind == "forked"), info
            assert info["pid"] == pids[name] and info["own_session"] and info["name"] == "__main__"
            assert info["argv"] == [str(tmp_path / f"{name}.json"), code] and info["probe_var"] == name
            assert info["cwd"] == str(REPO) and info["threads"] == PROBE_THREADS
            # what `ps` shows: the cell's own command line, not the forkserver's `python -c from multiprocessing...`
            assert info["cmdline"] == [sys.executable, "-m", "local_cell_probe", *info["argv"]], info["cmdline"]
            log = (tmp_path / f"{name}.log").read_text()
            assert f"probe says hello from {info['pid']}" in log
            assert ("RuntimeError: probe failed" in log) == (code == "raise"), log
    # numpy's and python's global RNGs are each cell's own, not copies of the forkserver's state
    draws = [json.loads((tmp_path / f"{t.name}.json").read_text()) for t in tasks]
    assert len({d["np_rand"] for d in draws}) == len({d["py_rand"] for d in draws}) == len(tasks), draws


@pytest.mark.heavy
def test_a_stop_signal_reaches_a_forked_cell(tmp_path):
    """SIGTERM to the launcher: it forwards SIGTERM to the running forked cell and starts no more."""
    import threading

    tasks = [_probe(tmp_path, "waits", "0", "wait", preload=("torch",)), _probe(tmp_path, "never", "0", preload=("torch",))]
    report = tmp_path / "waits.json"

    def stop_when_started():
        deadline = time.time() + 120
        while not report.exists() and time.time() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_started, daemon=True).start()
    with pytest.raises(UserError, match="stopped by signal: 1 cell"):
        local.run_local(tasks, cap=1, say=lambda *a: None)
    assert (tmp_path / "waits.json.sigterm").exists() and not (tmp_path / "never.json").exists()


@pytest.mark.heavy
def test_a_failed_preloaded_start_falls_back_to_fresh_processes(tmp_path, monkeypatch):
    """A forkserver that dies (a preloaded module failing at import kills it) must not stop the grid: the
    cells start as fresh processes, with one line saying so."""
    def dead_server(*a, **k):
        raise EOFError("unexpected EOF")

    monkeypatch.setattr(local, "Forked", dead_server)
    lines = []
    results = local.run_local([_probe(tmp_path, f"p{i}", "0", preload=("torch",)) for i in range(2)], cap=1,
                               say=lines.append)
    assert results == {"p0": 0, "p1": 0}
    assert lines[0].startswith("the preloaded start failed (EOFError: unexpected EOF)") and len(lines) == 3, lines
    assert not json.loads((tmp_path / "p1.json").read_text())["preloaded"]
    assert "[1/2] p0: done (" in lines[1]


def _launcher(tmp_path, cap, *cells):
    """The local launcher on probe cells (tests/local_launcher_run.py), in a process group of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    return subprocess.Popen([sys.executable, "-m", "local_launcher_run", str(tmp_path), str(cap), *cells], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _report(path, launcher, timeout=120):
    """A probe cell's report once it has written it (it is running then)."""
    deadline = time.time() + timeout
    while not path.exists():
        if launcher.poll() is not None or time.time() > deadline:
            launcher.kill()
            pytest.fail(f"no {path.name}: launcher said {launcher.communicate()[0]}")
        time.sleep(0.05)
    return json.loads(path.read_text())


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.heavy
@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_a_stop_signal_to_the_launchers_process_group_stops_every_forked_cell(tmp_path, sig):
    """A closed terminal (SIGHUP) or `kill -- -PGID` reaches the launcher and the forkserver, which is in
    its group. The forkserver died of it, the launcher took that for its cells' end ("exit 255"), never sent
    them the stop and exited, and the cells trained on unattended. Now each cell checkpoints and stops
    (SIGTERM from the launcher) and is reported with its own exit code; no cell is started after."""
    launcher = _launcher(tmp_path, 2, "a:0:wait", "b:0:wait", "c:0")
    a, b = _report(tmp_path / "a.json", launcher), _report(tmp_path / "b.json", launcher)
    os.killpg(launcher.pid, sig)
    out = launcher.communicate(timeout=120)[0]
    assert launcher.returncode == 2 and "stopped by signal: 2 cell(s) ended, 1 not started" in out, out
    assert "] a: exit 3 (" in out and "] b: exit 3 (" in out and "exit 255" not in out, out
    assert (tmp_path / "a.json.sigterm").exists() and (tmp_path / "b.json.sigterm").exists()
    assert not (tmp_path / "c.json").exists() and not _alive(a["pid"]) and not _alive(b["pid"])
    assert a["preloaded"] and a["ppid"] != launcher.pid  # forked by the server, not started by the launcher


@pytest.mark.heavy
def test_a_killed_forkserver_loses_no_running_cell(tmp_path):
    """kill -9 of the forkserver mid-grid under one job at a time: the running cell was reported "exit 255"
    and its slot freed (two cells at once), and the launcher's later SIGTERM never reached it. It is
    tracked by its own pid now: the slot stays taken, the stop reaches it, its own code (3) is reported."""
    launcher = _launcher(tmp_path, 1, "a:0:wait", "b:0")
    a = _report(tmp_path / "a.json", launcher)
    os.kill(a["ppid"], signal.SIGKILL)  # the forkserver: the cell's parent
    time.sleep(3)
    assert launcher.poll() is None and _alive(a["pid"]) and not (tmp_path / "b.json").exists()
    os.kill(launcher.pid, signal.SIGTERM)  # the launcher alone, as `kill PID`
    out = launcher.communicate(timeout=120)[0]
    assert launcher.returncode == 2 and "stopped by signal: 1 cell(s) ended, 1 not started" in out, out
    assert "[1/2] a: exit 3 (" in out and "exit 255" not in out, out
    assert (tmp_path / "a.json.sigterm").exists() and not _alive(a["pid"])


@pytest.mark.heavy
def test_the_grid_goes_on_after_its_forkserver_is_killed(tmp_path):
    """A cell whose forkserver was killed ends with its own code (the file it leaves as it exits); the next
    cell starts after it, from a new forkserver, preloaded again."""
    launcher = _launcher(tmp_path, 1, "a:4:sleep=2", "b:0")
    a = _report(tmp_path / "a.json", launcher)
    os.kill(a["ppid"], signal.SIGKILL)
    out = launcher.communicate(timeout=180)[0]
    assert launcher.returncode == 0 and json.loads(out.splitlines()[-1]) == {"a": 4, "b": 0}, out
    assert out.index("[1/2] a: exit 4 (") < out.index("started b"), out
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["preloaded"] and b["ppid"] != a["ppid"]


TIMEOUT = 20.0


@pytest.mark.heavy
def test_cell_timeout_stops_a_cell_and_kills_a_hung_one(tmp_path, monkeypatch):
    """--cell-timeout: past it a cell gets SIGTERM, as on a stop signal (it checkpoints and exits 3, said
    in its line); one that still runs KILL_AFTER_S later (here a leaked non-daemon thread keeps it alive
    after its SIGTERM) is killed. Fresh and forked alike."""
    monkeypatch.setattr(local, "KILL_AFTER_S", 4.0)
    tasks = [_probe(tmp_path, f"{mode}{kind}", "0", mode, preload=pre) for mode in ("wait", "thread")
             for kind, pre in (("fresh", ()), ("forked", ("torch",)))]
    for t in tasks:
        # Well past the probe's start, so its SIGTERM handler is in place by then: a fresh interpreter
        # importing torch on a loaded 2-core machine took over 6 s (and died of the SIGTERM, -15).
        t.timeout = TIMEOUT
    lines = []
    results = local.run_local(tasks, cap=4, say=lines.append)
    assert results == {"waitfresh": 3, "waitforked": 3, "threadfresh": -9, "threadforked": -9}, lines
    for t in tasks:
        assert (tmp_path / f"{t.name}.json.sigterm").exists()
        assert any(ln.startswith(f"  {t.name}: past --cell-timeout {TIMEOUT:g} s") for ln in lines), lines
        stopped = f"] {t.name}: exit {results[t.name]}, stopped at its --cell-timeout {TIMEOUT:g} s ("
        assert any(stopped in ln for ln in lines), lines
        assert any(ln.startswith(f"  {t.name}: still running 4 s after") for ln in lines) == (t.name.startswith("thread"))


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_cell_timeout_must_be_positive(value):
    with pytest.raises(UserError, match=rf"--cell-timeout {value}: give a positive number of seconds"):
        submit.prepare([str(GRID), "--profile", "tiny", "--backend", "local", "--cell-timeout", value, "--dry-run"])


def test_dry_run_says_whether_each_cell_is_fed(tmp_path, capsys, monkeypatch):
    """The loader's rate (cores per GPU less one x the committed per-core figure of the experiment and
    augmentation: the newest day's, the slowest CPU of that day) against the GPU's step rate from a
    gpu_check result for the cluster's GPU."""
    from slurm import feed

    results = tmp_path / "results"
    results.mkdir()
    def loader(cpu, date, rate):
        (results / f"cpu-{cpu}-loader-ilsvrc_cnns.json").write_text(json.dumps({
            "schema": "speed_memory_loader/1", "date": date, "experiment": "ilsvrc_cnns",
            "augment": "torchvision", "per_core_samples_per_s": rate}))
    loader("test", "2026-01-01", 100.0)
    loader("fast", "2026-01-01T18:00:00+00:00", 300.0)  # a faster CPU later that day: not used
    loader("old", "2025-01-01", 10.0)  # an older pipeline: not used
    row = lambda prec, impl, ms, cl: {"model": "resnet50_preact", "precision": prec, "impl": impl,  # noqa: E731
                                      "status": "ok", "batch": 256, "channels_last": cl, "step_ms": {"median": ms}}
    (results / "test-gpu-gpu_check.json").write_text(json.dumps({
        "schema": "gpu_check/1", "date": "2026-01-01", "env": {"gpu": {"name": "Test GPU X"}},
        "parts": {"headline": {"result": {"rows": [
            row("fp32", None, 1000.0, False),         # 256 images/s: 4 cores x 100 feed it
            row("mixed", "autocast", 100.0, True),    # 2,560 images/s: 400 is ~16% of it
            row("mixed", "autocast", 50.0, False)]}}}}))  # NCHW: not the layout a mixed CNN gets on CUDA
    monkeypatch.setattr(feed, "RESULTS", results)
    cluster = write(tmp_path / "c.yaml", """\
        partition: gpu
        gpus_per_node: 8
        cpus_per_task: 5
        gpu: Test GPU X
        """)
    argv = [str(GRID), "--profile", "paper", "--backend", "slurm", "--cluster", str(cluster), "--dry-run",
            "--set", f"out_dir={tmp_path}", "--only", "model=resnet50_preact", "model=alexnet"]
    submit.main(argv)
    lines = {ln.split()[0].rsplit("-", 2)[0]: ln for ln in capsys.readouterr().out.splitlines() if "-s0-" in ln}
    assert lines["resnet50_preact-fp32"].endswith("data: fed")
    assert lines["resnet50_preact-mixed"].endswith("data: data-bound, ~16%")
    assert lines["resnet50_preact-fp16"].endswith("data: unknown")  # no GPU figure for fp16
    assert lines["alexnet-fp32"].endswith("data: unknown")  # no loader figure for augment=caffe
    submit.main([*argv, "--set", "train.num_workers=1"])  # the cell's own worker count caps the cores
    out = capsys.readouterr().out
    assert "resnet50_preact-fp32" in out and "data: data-bound, ~39%" in out  # 100 / 256
    write(cluster, "partition: gpu\ngpus_per_node: 8\ncpus_per_task: 5\n")  # no gpu named: unknown
    submit.main(argv)
    out = capsys.readouterr().out
    assert "data: fed" not in out and "the cluster profile names no gpu" in out


def test_cluster_gpu_must_be_a_name(tmp_path):
    bad = write(tmp_path / "c.yaml", "partition: gpu\ngpus_per_node: 8\ngpu: 100\n")
    with pytest.raises(UserError, match="gpu must be the GPU's name as torch reports it"):
        clusters.load(str(bad))
