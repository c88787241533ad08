"""Shared fixtures: the tiny synthetic ImageNet, made by the real generator and the real prep."""
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.pop("WANDB_API_KEY", None)  # tests never go online

# pytest.ini's addopts start pytest-xdist workers (--numprocesses=auto --dist=loadgroup); what an ini
# cannot say is below: how many workers "auto" is, and that `-p no:xdist` still runs.
# At most this many xdist workers by default (one per usable core below that): every worker builds
# its own session fixtures and imports torch, and the heavy tests start processes of their own.
MAX_WORKERS = 4
# One worker of several (pytest-xdist sets these before the worker imports this file).
SHARED_CORES = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1
if SHARED_CORES:
    # One torch thread per process, here and in every process a test starts (training runs, the demo,
    # SLURM jobs): OpenMP threads that spin-wait for a core another worker holds slow a step ~50-fold.
    os.environ["OMP_NUM_THREADS"] = "1"


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown to pytest under -p no:xdist
def pytest_xdist_auto_num_workers(config):
    """`--numprocesses=auto`: the cores this process may use (taskset, a SLURM allocation; xdist's own
    count is the machine's), at most MAX_WORKERS; on one core none, the tests run in this process (one
    worker would only add its start-up). An explicit `-n N` is taken as given; so is
    PYTEST_XDIST_AUTO_NUM_WORKERS. xdist itself turns auto into 0 under --pdb."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    n = min(len(os.sched_getaffinity(0)), MAX_WORKERS)
    return n if n > 1 else 0


def pytest_addoption(parser, pluginmanager):
    """With xdist switched off (`-p no:xdist`) or not installed, the xdist options in pytest.ini's addopts
    would be unknown arguments: accept them, unused, so the run goes on in this one process."""
    if not pluginmanager.hasplugin("xdist"):
        for opt in ("--numprocesses", "--dist"):
            parser.addoption(opt, help=f"pytest-xdist's {opt}: ignored, xdist is not active")


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """xdist groups: a test that uses a module- or class-scoped fixture, or a session-scoped one defined
    in a test module (the real SLURM cluster), runs on the worker of its module's other such tests, so
    the fixture is built once (and one cluster runs); a module can also name a group itself
    (`pytest.mark.xdist_group`). Other tests spread over the workers one by one."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        defs = getattr(item, "_fixtureinfo", None)
        scopes = {d.scope for ds in (defs.name2fixturedefs.values() if defs else ()) for d in ds
                  if d.scope in ("class", "module", "package") or
                  (d.scope == "session" and Path(d.baseid or ".").name.startswith("test_"))}
        if scopes:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__ if item.module else item.nodeid))


def pytest_collection_finish(session):
    """Test modules set torch's thread count when imported (the last one imported wins); a worker that
    shares the cores with others runs on one thread (see SHARED_CORES)."""
    if SHARED_CORES:
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_imagenet(tmp_path_factory) -> Path:
    from data_prep.imagenet import prepare as prep
    from data_prep.imagenet.tiny import generate

    arch = tmp_path_factory.mktemp("tiny_archives")
    generate(arch)  # the demo's default: 10 classes, 64 train / 16 val each, 96 px
    out = tmp_path_factory.mktemp("tiny_prepared") / "imagenet"
    prep.prepare(arch, out, workers=2, log=lambda *a: None)
    return out


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: the small networks of the experiment tests run ~50x faster
    on one thread than on two when another process holds a core (OpenMP threads spin-wait on each
    other). A test module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def mount_tmpfs(where, opts: str) -> bool:
    """A small tmpfs at `where` (root with mount rights only): a real full or read-only disk; the
    caller unmounts it. False (and `where` an empty folder) where it cannot be mounted."""
    import subprocess

    where.mkdir()
    return os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                                                capture_output=True).returncode == 0


def tiny_overrides(root, out_dir, *extra):
    """The overrides of a tiny-profile run of any experiment on the prepared data at `root`: it writes
    under out_dir and logs nothing online; `extra` key=value pairs come last (they win)."""
    return ["profile=tiny", f"task.data_root={root}", f"out_dir={out_dir}", "wandb.mode=disabled",
            "train.progress=false", *extra]


def check_run_dir(out_dir: Path, summary: dict) -> None:
    """What a completed ILSVRC tiny run leaves behind: its files, env.json (TF32 off, this torch), the
    measured activation bytes and throughput, and train + eval lines in metrics.jsonl."""
    import json

    import torch

    d = out_dir / "ilsvrc_cnns" / summary["run_name"]
    for f in ("config.yaml", "env.json", "metrics.jsonl", "summary.json", "checkpoint.pt"):
        assert (d / f).exists(), f
    env = json.loads((d / "env.json").read_text())
    assert env["tf32_matmul"] is False and env["torch"] == torch.__version__
    assert summary["activation_bytes"] > 0 and summary["throughput"] > 0
    assert {json.loads(x)["kind"] for x in (d / "metrics.jsonl").read_text().splitlines()} == {"train", "eval"}


def run_interrupted(monkeypatch, main, overrides, at_step: int) -> dict:
    """Run `main(overrides)` with the engine asked to stop (as a SLURM signal would) while step
    `at_step` trains: the run checkpoints after that step and returns status "interrupted"."""
    from mpt import engine

    monkeypatch.setattr(engine.Run, "extra_observers", (StopAt(at_step),))
    try:
        return main(overrides)
    finally:
        engine.STOP.clear()


class StopAt:
    """An observer of the iteration (mpt.step.Observer) that asks the engine to stop, as a SLURM signal
    would, as iteration `at` begins."""
    graph_safe = True  # it hooks no forward or backward

    def __init__(self, at: int):
        self.at = at

    def begin(self, step, micro_batches):
        if step.iteration == self.at:
            from mpt import engine

            engine.STOP.request("test")

    def before_update(self, *a): ...

    def after_update(self, *a): ...

    def end(self, step): ...


def run_gloo_ranks(script: Path, *args: str, world: int = 2, timeout: float = 180,
                   check: bool = True) -> list[tuple[int, str]]:
    """Run `script` once per rank as a torchrun-style process group on this machine (gloo, CPU);
    fails the test with the rank's stderr if one fails (check=False: returns every rank's
    (exit code, stderr) instead), and kills them all if one hangs."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    res = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank hung")
        if check:
            assert p.returncode == 0, err[-2000:]
        res.append((p.returncode, err))
    return res


def model_from_checkpoint(experiment: str, args):
    """A finished run rebuilt outside the engine, to recompute its metrics independently: (cfg, task,
    validation set, model with the checkpoint's weights, in eval mode)."""
    import importlib

    import torch

    from mpt import config, identity

    cfg = config.resolve(experiment, args)
    task = importlib.import_module(f"experiments.{experiment}.task").Task(cfg)
    _, val = task.datasets()
    model = task.build_model()
    model.load_state_dict(torch.load(identity.run_dir(cfg) / "checkpoint.pt", weights_only=True)["model"])
    return cfg, task, val, model.eval()
