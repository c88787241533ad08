"""The one training step (mpt.step.TrainStep) and its callers: the order of an iteration and what
observers see; the engine, the speed/memory benchmark and the bigLSTM memory estimate train like a
hand-written loop."""
import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from toy_gan import run_task
from mpt import identity
from mpt import precision
from mpt.config import Config
from mpt.task import Task as BaseTask

torch.set_num_threads(1)


class _Recorder(precision.FP32):
    def __init__(self):
        super().__init__("cpu")
        self.calls = []

    def autocast(self):
        self.calls.append("autocast")
        return super().autocast()

    def backward(self, loss):
        self.calls.append(("backward", round(loss.item(), 6)))
        super().backward(loss)

    def step(self, optimizer, clip_grad_norm=0.0):
        self.calls.append("step")
        return super().step(optimizer, clip_grad_norm)

    def update(self):
        self.calls.append("update")

    def zero_grad(self):
        self.calls.append("zero_grad")
        super().zero_grad()


def test_the_iteration_order_mean_loss_and_what_observers_see():
    """TrainStep's order: forward/backward of each micro-batch (DDP's all-reduce held back but on the
    last), the update, one scale update, zero_grad; an observer reads the gradients between the update
    and zero_grad; the mean loss over micro-batches and the gradient of that mean."""
    from mpt.memory import SavedTensorBytes
    from mpt.step import Observer, TrainStep

    synced = []

    class Net(nn.Linear):
        def no_sync(self):  # DDP's: record which micro-batches hold back the all-reduce
            synced.append(len(r.calls))
            return contextlib.nullcontext()

    net = Net(3, 1, bias=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    r = _Recorder()
    r.prepare(net, [opt])
    micro = [torch.full((2, 3), float(i + 1)) for i in range(3)]
    meter = SavedTensorBytes(net)

    class Seen(Observer):
        def before_update(self, step, name, o):
            r.calls.append("before " + name)

        def after_update(self, step, name, o, applied):
            r.calls.append(f"after {name} {applied}")
            self.grad = net.weight.grad.clone()

    seen = Seen()
    step = TrainStep(lambda m, b: (m(b).mean(), len(b)), net, {"main": opt}, r, world=2,
                     observers=(seen,), measure_first=False)
    with torch.no_grad():
        net.weight.fill_(1.0)
    logs, n = step(micro, meter=meter)
    assert logs["loss"].dtype == torch.float64 and logs["loss"].item() == pytest.approx((3 + 6 + 9) / 3) and n == 6
    assert r.calls == ["autocast", ("backward", 1.0), "autocast", ("backward", 2.0), "autocast",
                       ("backward", 3.0), "before main", "step", "after main True", "update", "zero_grad"]
    assert synced == [0, 2]  # micro-batches 0 and 1 hold back the all-reduce; the last does not
    assert meter.bytes == 2 * 3 * 4  # micro-batch 0's input, FP32
    assert torch.allclose(seen.grad, torch.full((1, 3), 2.0))  # mean over micro-batches of d(mean)/dw
    assert net.weight.grad is None and step.iteration == 1 and step.applied == {"main": True}


def test_engine_benchmark_and_memory_estimate_train_like_a_plain_loop(monkeypatch, tmp_path):
    """The one training step, by what each caller of it does: the engine's run trains a model to the
    weights a hand-written torch loop reaches; the benchmark's step and the bigLSTM memory estimate
    read gradients and optimizer state between the update and zero_grad, and measure the bytes that
    autograd saves for one hand-written forward and backward."""
    from experiments.lm_biglstm import memory
    from experiments.speed_memory import DEFAULTS, bench
    from models.lm import BigLSTM
    from mpt.memory import SavedTensorBytes
    from toy_gan import config

    # The engine: 3 steps on 16 equal rows (every batch is the same, whatever the order), against
    # SGD with the default optimizer settings by hand.
    x = torch.tensor([[1.0, -2.0]]).repeat(16, 1)

    class Task(BaseTask):
        primary_metric, higher_is_better = "loss", False

        def datasets(self):
            return torch.utils.data.TensorDataset(x), torch.utils.data.TensorDataset(x[:4])

        def build_model(self):
            return nn.Linear(2, 1)

        def loss(self, model, batch):
            return model(batch[0]).pow(2).mean(), len(batch[0])

        def eval_sums(self, model, batch):
            return {"l": float(model(batch[0]).pow(2).sum()), "n": len(batch[0])}

        def eval_metrics(self, s):
            return {"loss": s["l"] / s["n"]}

    cfg = config(tmp_path, train=dict(batch_size=4, max_steps=3))
    s = run_task(cfg, Task)
    torch.manual_seed(cfg.seed)  # the engine builds the model under the run's seed
    ref = nn.Linear(2, 1)
    opt = torch.optim.SGD(ref.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    for _ in range(3):
        ref(x[:4]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    trained = torch.load(identity.run_dir(cfg) / "checkpoint.pt", weights_only=True)["model"]
    assert s["status"] == "completed" and s["step"] == 3
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(trained[k], v, rtol=1e-6, atol=1e-7)

    # The benchmark's step on a known model: FP32 weights, gradients and SGD momentum of its 10
    # parameters (4 bytes each), the input it saves for backward (2 x 4 FP32 values), 2 items.
    known = bench.Workload("none", "items", 4, lambda cfg: SimpleNamespace(
        build_model=lambda: nn.Linear(4, 2), loss=lambda m, x: (m(x).float().mean(), len(x))),
        lambda n, size, device, cl, gen: torch.randn(n, size, generator=gen))
    monkeypatch.setitem(bench.WORKLOADS, "known", known)
    monkeypatch.setattr(bench, "config_for", lambda *a: Config(model="known"))  # default optimizer: SGD, momentum
    row = bench.measure("known", "fp32", None, {**DEFAULTS, "batch": 2, "size": "4", "steps": 1, "warmup": 1},
                        torch.device("cpu"))
    assert row["status"] == "ok" and row["items_per_step"] == 2, row
    assert row["param_bytes"] == row["grad_bytes"] == row["optimizer_state_bytes"] == 10 * 4, row
    assert row["activation_only_bytes"] == 2 * 4 * 4, row

    # The memory estimate: FP32 weights and gradients and Adagrad's FP32 accumulator, 4 bytes per
    # parameter; the activation bytes of one forward and backward of the same model and batch by hand.
    shape = memory.SHAPES[0]
    est = memory.measure("fp32", "autocast", "auto", shape)
    assert (est["weights"], est["grads"], est["master"], est["optimizer"]) == (4, 4, 0, 4), est
    B, T, V, E, H, P, K, L = shape
    torch.manual_seed(0)
    model = BigLSTM(V, E, H, P, L, num_sampled=K, dropout=0.1)
    mask = torch.ones(B, T, dtype=torch.bool)
    meter = SavedTensorBytes(model)
    with meter.measure():  # the reference's loss: summed NLL per sequence (experiments/lm_biglstm/task.py)
        nll, _ = model(torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T)), mask)
        (nll.sum() / mask.sum() * T).backward()
    assert est["activations"] == meter.bytes > 0
