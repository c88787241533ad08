"""What a GPU cluster needs of the engine that a one-process CPU run never shows:
resume on another device, one random stream per rank, every rank's state in the checkpoint, a
failure on a rank other than 0, one GPU per rank, persistent DataLoader workers."""
import json
import multiprocessing
import socket

import pytest
import torch

from conftest import REPO, run_gloo_ranks, run_interrupted
from toy_gan import run_task
from mpt import engine
from mpt.errors import UserError
from mpt.ranks import pick_device, rng_state, set_rng_state
from toy_mlp import config
from toy_ranks import RankToy

WORKER = REPO / "tests" / "ddp_rank_worker.py"


def _ranks(out, mode, world=2, timeout=180):
    """Start `world` gloo ranks of ddp_rank_worker.py; returns their (returncode, stderr). The worker
    gets a second free port for the rendezvous of a resumed run."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port2 = str(s.getsockname()[1])
    return run_gloo_ranks(WORKER, str(out), mode, port2, world=world, timeout=timeout, check=False)


# -- item 1: a checkpoint resumes on any device --------------------------------------------------


def test_resume_loads_to_cpu_and_restores_rng_from_cpu_tensors(tmp_path, monkeypatch):
    """On a GPU, torch.load(map_location=<the GPU>) turned the saved RNG states into CUDA tensors and
    torch.set_rng_state raised: every requeued GPU run died in setup. The checkpoint now loads to the
    CPU whatever the run's device, and the RNG states handed to torch are CPU ByteTensors."""
    cfg = config(tmp_path, train={"max_steps": 6})
    part = run_interrupted(monkeypatch, lambda _: run_task(cfg, RankToy), None, at_step=2)
    assert part["status"] == "interrupted"
    loads, states = [], []
    real_load, real_set = torch.load, torch.set_rng_state

    def load(*a, **kw):
        loads.append(kw.get("map_location"))
        return real_load(*a, **kw)

    def set_rng(t):
        states.append((t.device.type, t.dtype))
        return real_set(t)

    monkeypatch.setattr(torch, "load", load)
    monkeypatch.setattr(torch, "set_rng_state", set_rng)
    # The device the run believes it is on must not decide where the checkpoint is mapped.
    s = run_task(cfg, RankToy)
    assert s["status"] == "completed" and s["step"] == 6
    assert loads == ["cpu"]
    assert states and all(st == ("cpu", torch.uint8) for st in states)


def test_set_rng_state_accepts_states_that_arrive_in_another_form():
    """A state that arrives as another dtype or layout (a checkpoint mapped through a device and
    back) is brought to what torch expects; the stream continues exactly."""
    dev = torch.device("cpu")
    st = rng_state(dev)
    want = torch.rand(3)
    odd = {"cpu": st["cpu"].to(torch.int32), "cuda": None}  # same values, wrong dtype for torch
    set_rng_state(odd, dev)
    assert torch.equal(torch.rand(3), want)


# -- item 6: one GPU per rank --------------------------------------------------------------------


@pytest.mark.parametrize("name,visible,local_rank,want", [
    ("auto", 0, 0, "cpu"),
    ("auto", 1, 3, "cuda:0"),  # the cluster binds one GPU per task: every rank sees its own cuda:0
    ("auto", 4, 2, "cuda:2"),
    ("cuda", 4, 3, "cuda:3"),  # a bare "cuda" under DDP: this rank's GPU, not GPU 0 for all
    ("cuda", 1, 5, "cuda:0"),
    ("cuda:1", 4, 3, "cuda:1"),
])
def test_pick_device_gives_each_rank_its_gpu(monkeypatch, name, visible, local_rank, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert pick_device(name, local_rank) == torch.device(want)


@pytest.mark.parametrize("name,visible,local_rank", [("auto", 2, 3), ("cuda:4", 4, 0), ("cuda", 0, 0)])
def test_pick_device_refuses_in_one_line(monkeypatch, name, visible, local_rank):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    with pytest.raises(UserError) as e:
        pick_device(name, local_rank)
    assert "\n" not in str(e.value)


# -- item 6: persistent workers ------------------------------------------------------------------


class _EpochProbe(RankToy):
    """Records every batch the loss sees: its inputs and the per-sample random augmentation."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.seen = []

    def datasets(self):
        train, val = super().datasets()
        return _Augmented(train), val

    def loss(self, model, batch):
        x, y, aug = batch
        self.seen.append(torch.cat([x[:, 0], aug]))
        return super().loss(model, (x, y))


class _Augmented(torch.utils.data.Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x, y, torch.rand(())  # the augmentation's draw: seeded per (seed, epoch, index)


@pytest.mark.heavy
def test_persistent_workers_see_every_epoch_and_leave_with_the_run(tmp_path):
    """Persistent workers keep their own copy of the dataset from the first epoch on: the epoch must
    reach them with each index. Three epochs with 2 persistent workers see exactly the batches (and
    augmentation draws) of the same run without workers; when the run returns no worker is left
    (they inherited the run directory's lock), so the run can start again at once."""
    seen = {}
    for w in (0, 2):
        cfg = config(tmp_path / f"w{w}", train={"max_steps": 12, "num_workers": w})
        task = _EpochProbe(cfg)
        s = engine.run(cfg, task)
        assert s["status"] == "completed"
        seen[w] = torch.stack(task.seen)
    assert seen[0].shape[0] == 12  # 4 steps an epoch: three epochs
    assert torch.equal(seen[0], seen[2])
    assert not torch.equal(seen[0][0:4, 16:], seen[0][4:8, 16:])  # each epoch draws anew
    assert multiprocessing.active_children() == []
    again = run_task(config(tmp_path / "w2", train={"max_steps": 12, "num_workers": 2}), _EpochProbe)
    assert again["status"] == "completed"


# -- item 3: one random stream per rank, every rank's state checkpointed -------------------------


@pytest.fixture(scope="module")
def two_rank_full(tmp_path_factory):
    """The uninterrupted 2-rank run (6 steps), shared by the draw and resume tests."""
    out = tmp_path_factory.mktemp("ranks")
    for code, err in _ranks(out, "full"):
        assert code == 0, err[-2000:]
    return out


@pytest.mark.heavy
def test_ranks_draw_their_own_masks_and_negatives(two_rank_full, tmp_path):
    """All ranks seeded alike drew the same dropout masks and the same sampled-softmax negatives on
    every GPU (the bigLSTM's 8,192 negatives N times over). The model still starts identical."""
    r0, r1 = (torch.load(two_rank_full / f"full.rank{r}.pt", weights_only=True) for r in (0, 1))
    assert not torch.equal(r0["first"][0], r1["first"][0])  # dropout masks
    assert not torch.equal(r0["first"][1], r1["first"][1])  # negatives
    for k in r0["model"]:  # DDP keeps the replicas equal
        assert torch.equal(r0["model"][k], r1["model"][k]), k
    # Rank 0 keeps the seed's own stream: a one-process run draws what it drew before.
    cfg = config(tmp_path / "one", train={"max_steps": 1, "batch_size": 8})
    one = RankToy(cfg)
    s = engine.run(cfg, one)
    assert s["status"] == "completed"
    assert torch.equal(one.first[1], r0["first"][1])


@pytest.mark.heavy
def test_two_rank_resume_equals_the_uninterrupted_run(two_rank_full):
    """Stopped after step 3 and started again, a 2-rank run ends where the uninterrupted one does, on
    every rank: rank 1's random stream and task state come back too, not rank 0's copies."""
    tmp_path = two_rank_full
    for code, err in _ranks(tmp_path, "resumed"):
        assert code == 0, err[-2000:]
    for r in (0, 1):
        a, b = (torch.load(tmp_path / f"{m}.rank{r}.pt", weights_only=True) for m in ("full", "resumed"))
        assert torch.equal(a["acc"], b["acc"]), r
        for k in a["model"]:
            assert torch.equal(a["model"][k], b["model"][k]), (r, k)
    ranks = torch.load(next((tmp_path / "resumed").rglob("checkpoint.pt")), weights_only=True)["ranks"]
    assert len(ranks) == 2 and not torch.equal(ranks[0]["task"]["acc"], ranks[1]["task"]["acc"])


# -- item 4: a failure on a rank other than 0 -----------------------------------------------------


@pytest.mark.heavy
def test_a_failure_on_rank_1_is_recorded_and_ends_the_run(tmp_path):
    """Rank 1 raises in its second step. Rank 0, waiting in the all-reduce, fails too (within the
    process group's timeout, not never), and summary.json says failed and names rank 1's cause;
    rank 1's own record and traceback are in the run directory."""
    res = _ranks(tmp_path, "fail", timeout=150)
    assert all(code != 0 for code, _ in res), [c for c, _ in res]
    d = next((tmp_path / "fail").rglob("summary.json")).parent
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "failed"
    assert "rank 1" in s["error"] and "injected failure on rank 1" in s["error"], s["error"]
    assert "injected failure" in s["rank_errors"]["1"]
    rec = json.loads((d / "failure.rank1.json").read_text())
    assert rec["rank"] == 1 and rec["world"] == 2
    assert "RuntimeError: injected failure" in (d / "error.rank1.txt").read_text()


def test_status_names_a_failed_rank_when_rank_0_could_not(tmp_path):
    """Rank 0 killed while it waited for the failed rank (NCCL's timeout, srun --kill-on-bad-exit):
    summary.json still says running. slurm.status reads rank 1's record: failed, with its cause, once
    the job is gone; while the job still runs, the cause is shown beside "running". A record from an
    earlier attempt is history."""
    from mpt.rundir import atomic_write_json
    from slurm import state

    run = tmp_path / "cell"
    run.mkdir()
    atomic_write_json(run / "summary.json", {"status": "running", "step": 7})
    dead = f"local:{socket.gethostname()}:999999999"
    job = {"job_id": dead, "state": "running", "attempts": [{"start": "2026-11-25T10:00:00+00:00"}]}
    atomic_write_json(run / "job.json", job)
    atomic_write_json(run / "failure.rank1.json", {"rank": 1, "world": 2, "host": "node7", "step": 7,
                                                   "error": "CUDA out of memory", "time": "2026-11-25T10:05:00+00:00"})
    st = state.cell_state(run, "", None, None)
    assert st.state == "failed" and st.error.startswith("rank 1 failed on node7 at step 7: CUDA out of memory")
    running = {**job, "job_id": "123"}
    atomic_write_json(run / "job.json", running)
    st = state.cell_state(run, "", {"job_id": "123"}, {"123": "RUNNING"})
    assert st.state == "running" and "CUDA out of memory" in st.error
    job["attempts"].append({"start": "2026-11-25T11:00:00+00:00"})  # a later attempt
    atomic_write_json(run / "job.json", job)
    st = state.cell_state(run, "", None, None)
    assert "rank 1" not in (st.error or "")
