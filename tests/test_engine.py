"""The one training loop: run directories, resume, divergence, errors, wandb, every model x
precision, learning on tiny data."""
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import models
from conftest import REPO, check_run_dir, run_interrupted, tiny_overrides
from experiments.ilsvrc_cnns import main as ilsvrc
from toy_gan import run_task
from mpt import config as C
from mpt import identity
from mpt import precision, precisions
from mpt.config import Config
from models.imagenet_cnns import INPUT_SIZE
from mpt.memory import SavedTensorBytes
from mpt.task import Task

torch.set_num_threads(2)


def read_lines(d):
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.heavy
# mixed stays in the default tier, on AlexNet (the whole tiny profile, with the dynamic scale's first
# skipped steps, in ~30 s on one core; ResNet-50's FP16 run took ~170 s for half the profile). fp32
# and bf16 are in the slow tier: the default tier trains ResNet-50 in fp32 on real digits
# (test_tiny_real.py) with this test's checks of the run directory.
@pytest.mark.parametrize("model,prec", [pytest.param("resnet50_preact", "fp32", marks=pytest.mark.slow),
                                        ("alexnet", "mixed"),
                                        pytest.param("resnet50_preact", "bf16", marks=pytest.mark.slow)])
def test_tiny_run_beats_chance(tiny_imagenet, tmp_path, model, prec, one_thread):
    s = ilsvrc(tiny_overrides(tiny_imagenet, tmp_path, f"model={model}", f"precision={prec}"))
    assert s["status"] == "completed"
    # Better than guessing: more of the val images right than a guesser (1 in 10 classes) gets with
    # probability 1e-6 (the binomial tail; 160 images: at least 38 right, 23.75%).
    info = json.loads((tiny_imagenet / "prepared.json").read_text())
    n, p = info["val_images"], 1 / info["num_classes"]
    tail = lambda k: sum(math.comb(n, j) * p ** j * (1 - p) ** (n - j) for j in range(k, n + 1))  # noqa: E731
    need = next(k for k in range(n + 1) if tail(k) < 1e-6)
    assert round(s["metrics"]["top1"] * n / 100) >= need, (s["metrics"], need, n)
    if prec == "mixed":
        assert s["skipped_steps"] > 0 and s["final_loss_scale"] < 2.0 ** 16  # dynamic S backed off (3.2)
    check_run_dir(tmp_path, s)


@pytest.mark.heavy
def test_resume_is_bit_identical(tiny_imagenet, tmp_path, monkeypatch):
    args = ["model=resnet50_preact", "train.max_steps=9", "train.num_workers=2", "train.log_every=1"]
    full = ilsvrc(tiny_overrides(tiny_imagenet, tmp_path / "a", *args))
    part = run_interrupted(monkeypatch, ilsvrc, tiny_overrides(tiny_imagenet, tmp_path / "b", *args), at_step=4)
    assert part["status"] == "interrupted" and part["step"] == 5
    resumed = ilsvrc(tiny_overrides(tiny_imagenet, tmp_path / "b", *args))
    assert resumed["status"] == "completed" and resumed["metrics"] == full["metrics"]
    da, db = (tmp_path / x / "ilsvrc_cnns" / full["run_name"] for x in ("a", "b"))
    la = [(x["step"], x.get("loss")) for x in read_lines(da)]
    lb = [(x["step"], x.get("loss")) for x in read_lines(db)]
    assert la == lb
    ca, cb = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (da, db))
    for k in ca["model"]:
        assert torch.equal(ca["model"][k], cb["model"][k]), k
    # a completed run is not run again
    again = ilsvrc(tiny_overrides(tiny_imagenet, tmp_path / "b", *args))
    assert again["status"] == "completed" and again["updated"] == resumed["updated"]


@pytest.mark.heavy
def test_divergence_ends_run_with_status_and_the_result_is_kept(tiny_imagenet, tmp_path):
    # a checkpoint every step and a line every step: the run has checkpoints from before it diverged
    args = tiny_overrides(tiny_imagenet, tmp_path, "model=alexnet", "precision=fp16", "optim.lr=1e6",
                          "train.diverge_after=3", "train.max_steps=40", "train.ckpt_every_steps=1",
                          "train.log_every=1")
    s = ilsvrc(args)
    assert s["status"] == "diverged" and s["step"] < 40
    assert "non-finite" in s["error"]
    # Invoked again, a final result is returned as it is and nothing in its directory is touched: not
    # the NaN history in metrics.jsonl (cut back to the last checkpoint before this fix), not the
    # config.yaml and env.json that name what produced it.
    d = tmp_path / "ilsvrc_cnns" / s["run_name"]
    files = ("metrics.jsonl", "config.yaml", "env.json", "summary.json")

    def snapshot():
        return {f: ((d / f).read_bytes(), (d / f).stat().st_ino, (d / f).stat().st_mtime_ns) for f in files}

    before = snapshot()
    again = ilsvrc(args)
    assert again["status"] == "diverged" and again["step"] == s["step"]
    assert snapshot() == before


@pytest.mark.heavy
def test_wandb_offline_run_readable_by_wandb(tiny_imagenet, tmp_path):
    s = ilsvrc(tiny_overrides(tiny_imagenet, tmp_path, "model=alexnet", "train.max_steps=4",
                              "wandb.mode=offline"))
    d = tmp_path / "ilsvrc_cnns" / s["run_name"] / "wandb"
    wandb_bin = REPO / ".venv" / "bin" / "wandb"
    exe = str(wandb_bin) if wandb_bin.exists() else "wandb"
    out = subprocess.run([exe, "leet", "inspect", "--summary", "--json", str(d)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    w = json.loads(out.stdout)
    assert w["state"] == "finished" and w["config"]["model"] == "alexnet"
    assert w["summary"]["final/top1"] == pytest.approx(s["metrics"]["top1"])
    assert w["summary"]["skipped_steps"] == 0 and "loss" in w["summary"]
    assert w["run_id"] == identity.cell_id(C.resolve("ilsvrc_cnns", tiny_overrides(tiny_imagenet, tmp_path)
                                              + ["model=alexnet", "train.max_steps=4"]))[:32]


@pytest.mark.heavy
@pytest.mark.parametrize("argv,msg", [
    (["foo=1"], "unknown config key 'foo'"),
    (["optim.lr=fast"], "expects a number"),
    (["precision=fp4"], "unknown precision 'fp4'"),
    (["model=lenet"], "unknown model 'lenet'"),
    (["profile=tiny", "task.data_root=/nonexistent/imagenet"], "no prepared ImageNet at /nonexistent/imagenet"),
])
def test_user_errors_are_one_line(argv, msg, tmp_path):
    p = subprocess.run([sys.executable, "-m", "experiments.ilsvrc_cnns", *argv, f"out_dir={tmp_path}",
                        "wandb.mode=disabled"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and msg in lines[0], p.stderr


@pytest.mark.heavy
def test_corrupt_image_is_one_line_error(tiny_imagenet, tmp_path):
    import shutil

    root = tmp_path / "imagenet"
    shutil.copytree(tiny_imagenet, root)
    victim = sorted((root / "train").rglob("*.JPEG"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    p = subprocess.run([sys.executable, "-m", "experiments.ilsvrc_cnns",
                        *tiny_overrides(root, tmp_path, "model=alexnet", "train.num_workers=1")],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and "it/s" not in ln]
    assert p.returncode == 2 and len(lines) == 1 and victim.name in lines[0], p.stderr


def test_activation_bytes_exact():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 2, bias=False))
    meter = SavedTensorBytes(m)
    with meter.measure():
        m(torch.randn(3, 4)).sum().backward()
    # Linear 1 saves its input (3x4), ReLU its output (3x8), which Linear 2 saves again (same
    # storage, counted once); the weights are parameters, not activations.
    assert meter.bytes == 3 * 4 * 4 + 3 * 8 * 4


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(INPUT_SIZE))
def test_every_model_every_precision_forward_backward(name):
    x, y = torch.randn(2, 3, 80, 80), torch.tensor([0, 1])
    for prec in precisions.PRECISIONS:
        for impl in precisions.IMPLS:
            if prec in ("fp16_pure", "fp16_storage") and impl == "autocast":
                continue  # the same recipe as impl=paper
            torch.manual_seed(0)
            m = models.build(name, num_classes=4, width=1 / 32)
            opt = torch.optim.SGD(m.parameters(), lr=0.01)
            r = precision.build(Config(precision=prec, impl=impl, loss_scale="1" if prec == "mixed" else "auto"), "cpu")
            r.prepare(m, [opt])
            with r.autocast():
                out = m(x)
                out = out[0] if isinstance(out, tuple) else out
                loss = nn.functional.cross_entropy(out.float(), y)
            r.backward(loss)
            assert r.step(opt), (name, prec, impl)
            r.update()
            assert torch.isfinite(loss), (name, prec, impl)
            assert all(torch.isfinite(p).all() for p in r.master_params()), (name, prec, impl)


# ------------------------------------------------------------------------------------------------
# several models and optimizers: tests/toy_gan.py, the seam DCGAN uses


@pytest.mark.parametrize("impl", ["autocast", "paper"])
def test_one_scaler_two_optimizers_skip_only_the_overflowing_one(impl):
    """torch.amp's rules in both impls: each optimizer unscaled and inf-checked on its own, an overflow
    skips only that optimizer, the scale backs off once per iteration."""
    torch.manual_seed(0)
    m = nn.ModuleDict({"generator": nn.Linear(4, 4), "discriminator": nn.Linear(4, 1)})
    opt_d = torch.optim.SGD(m["discriminator"].parameters(), lr=0.1)
    opt_g = torch.optim.SGD(m["generator"].parameters(), lr=0.1)
    r = precision.build(Config(precision="mixed", impl=impl), "cpu")
    r.prepare(m, [opt_d, opt_g])
    s0, x = r.loss_scale, torch.randn(8, 4)
    d0, g0 = ([p.detach().float().clone() for p in m[k].parameters()] for k in ("discriminator", "generator"))
    with r.autocast():
        loss_d = m["discriminator"](x).float().mean()
    r.backward(loss_d * float("inf"))
    assert r.step(opt_d) is False
    with r.autocast():
        loss_g = m["discriminator"](m["generator"](x)).float().mean()
    r.backward(loss_g)
    assert r.step(opt_g) is True
    r.update()
    assert r.loss_scale == s0 * 0.5 and r.skipped_steps == 1
    assert all(torch.equal(a, p.detach().float()) for a, p in zip(d0, m["discriminator"].parameters()))
    assert not any(torch.equal(a, p.detach().float()) for a, p in zip(g0, m["generator"].parameters()))


def test_two_optimizer_run_counts_skips_per_optimizer_and_writes_images(tmp_path):
    from toy_gan import ToyGan, config

    from mpt.config import NumericsCfg

    s = run_task(config(tmp_path, precision="mixed", numerics=NumericsCfg(every=2),
                        train={"max_steps": 4, "eval_every_epochs": 0.25}), ToyGan, inf_at=1)
    assert s["status"] == "completed" and s["skipped_per_optimizer"] == {"discriminator": 1, "generator": 0}
    d = tmp_path / "toy_gan" / s["run_name"]
    lines = read_lines(d)
    train = [x for x in lines if x["kind"] == "train"]
    assert [x["skipped/discriminator"] for x in train] == [0, 1, 1, 1]
    assert train[1]["loss_scale"] == train[0]["loss_scale"] / 2 == train[3]["loss_scale"]
    assert {"loss_D", "loss_G", "lr/generator"} <= set(train[0])
    assert sorted(p.name for p in d.glob("samples_*.png")) == [f"samples_{i:07d}.png" for i in (1, 2, 3, 4)]
    numerics = [x for x in lines if x["kind"] == "numerics"]  # sampled per optimizer: every model covered
    assert [x["step"] for x in numerics] == [1, 3]
    for name in ("discriminator", "generator"):
        assert f"numerics/{name}/weight/overall/max_abs" in numerics[0], name
    assert numerics[0]["numerics/discriminator/skipped"] is False  # the overflow (iteration 1) was not sampled


def _gan_uninterrupted_and_resumed(tmp_path, monkeypatch, at_step: int, **train):
    """The toy GAN run through (tmp_path/a) and stopped after step at_step + 1, then resumed (tmp_path/b):
    both completed with the same final metrics. -> their run directories."""
    from toy_gan import ToyGan, config

    cfg = lambda d: config(d, train=train) if train else config(d)  # noqa: E731
    full = run_task(cfg(tmp_path / "a"), ToyGan)
    part = run_interrupted(monkeypatch, lambda _: run_task(cfg(tmp_path / "b"), ToyGan), None, at_step=at_step)
    assert part["status"] == "interrupted" and part["step"] == at_step + 1
    resumed = run_task(cfg(tmp_path / "b"), ToyGan)
    assert resumed["status"] == "completed" and resumed["metrics"] == full["metrics"]
    return tuple(tmp_path / x / "toy_gan" / full["run_name"] for x in ("a", "b"))


def test_two_optimizer_resume_is_bit_identical(tmp_path, monkeypatch):
    da, db = _gan_uninterrupted_and_resumed(tmp_path, monkeypatch, at_step=4)
    keys = ("step", "loss", "loss_D", "loss_G", "gap")
    assert [[x.get(k) for k in keys] for x in read_lines(da)] == [[x.get(k) for k in keys] for x in read_lines(db)]
    ca, cb = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (da, db))
    assert set(ca["optimizers"]) == {"discriminator", "generator"} == set(ca["scheds"])
    for k in ca["model"]:
        assert torch.equal(ca["model"][k], cb["model"][k]), k
    for name in ca["optimizers"]:
        for pid, st in ca["optimizers"][name]["state"].items():
            for key, v in st.items():
                assert torch.equal(v, cb["optimizers"][name]["state"][pid][key]), (name, key)


def test_resume_inside_a_log_window_logs_the_same_lines(tmp_path, monkeypatch):
    """Stopped at step 7 with a line every 5 steps: the step-10 line is the mean of steps 6-10, as in
    the uninterrupted run (it averaged only steps 8-10 when the window's sums were not checkpointed)."""
    da, db = _gan_uninterrupted_and_resumed(tmp_path, monkeypatch, at_step=6, log_every=5)
    clock = ("time", "throughput")  # of the process, not of the training
    la, lb = ([{k: v for k, v in x.items() if k not in clock} for x in read_lines(d) if x["kind"] == "train"]
              for d in (da, db))
    assert [x["step"] for x in la] == [5, 10, 12]
    assert la == lb


@pytest.mark.heavy
def test_ddp_ranks_agree_a_run_is_complete(tmp_path):
    """2 gloo ranks: the second start of a completed run returns on every rank (rank 0
    alone returned and the other rank waited forever in evaluation's all-reduce)."""
    import os
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(str(s.getsockname()[1]))
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": ports[0]}
        procs.append(subprocess.Popen([sys.executable, str(REPO / "tests" / "ddp_toy_worker.py"), str(tmp_path),
                                       ports[1]],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        try:
            _, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank hung")
        assert p.returncode == 0, err[-2000:]
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r == {"first": "completed", "second": "completed", "step": 4}


# the data seam (collate + train_order): what detection, speech and translation batches need
class _VarLenTask(Task):
    """Sequences of 1..6 values; the target is the sign of their sum. Padded by the task's collate;
    the first epoch goes shortest-first (SortaGrad's rule), later epochs shuffled."""
    primary_metric = "acc"
    higher_is_better = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.seen = []  # (epoch, lengths of the batch) as the loss sees them

    def datasets(self):
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(int(torch.randint(1, 7, (), generator=g)), generator=g) for _ in range(48)]
        self.lengths = [len(x) for x in xs]
        return xs, xs[:16]

    def collate(self, samples):
        lengths = torch.tensor([len(s) for s in samples])
        x = torch.zeros(len(samples), int(lengths.max()))
        for i, s in enumerate(samples):
            x[i, : len(s)] = s
        return {"x": x, "lengths": lengths}

    def train_order(self, train, epoch, g):
        if epoch == 0:
            return sorted(range(len(train)), key=lambda i: (len(train[i]), i))
        return torch.randperm(len(train), generator=g).tolist()

    def build_model(self):
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        return nn.Linear(1, 1)

    def loss(self, model, batch):
        self.seen.append(batch["lengths"].tolist())
        pooled = batch["x"].sum(1, keepdim=True) / batch["lengths"].unsqueeze(1)
        y = (batch["x"].sum(1) > 0).float()
        return nn.functional.binary_cross_entropy_with_logits(model(pooled).squeeze(1).float(), y), len(y)

    def eval_sums(self, model, batch):
        pooled = batch["x"].sum(1, keepdim=True) / batch["lengths"].unsqueeze(1)
        ok = ((model(pooled).squeeze(1) > 0) == (batch["x"].sum(1) > 0)).sum()
        return {"ok": float(ok), "n": float(len(batch["lengths"]))}

    def eval_metrics(self, s):
        return {"acc": 100 * s["ok"] / s["n"]}


def test_task_collate_and_train_order(tmp_path):
    from mpt.engine import run
    from toy_gan import config
    cfg = config(tmp_path, train=dict(batch_size=8, max_steps=12))  # 6 steps per epoch: 2 epochs
    task = _VarLenTask(cfg)
    s = run(cfg, task)
    assert s["status"] == "completed" and "acc" in s["metrics"]
    first = [n for b in task.seen[:6] for n in b]
    assert first == sorted(task.lengths)  # epoch 0 shortest-first, padded per batch by collate
    second = [n for b in task.seen[6:12] for n in b]
    assert second != sorted(task.lengths) and sorted(second) == sorted(task.lengths)


def test_train_order_must_be_a_permutation():
    from mpt.data import EpochSampler
    s = EpochSampler(5, 0, order=lambda e, g: [0, 1, 2, 3, 3])
    with pytest.raises(ValueError, match="permutation"):
        list(s)
