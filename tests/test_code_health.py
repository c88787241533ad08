"""Every option works or is gone, and each shared piece exists once -- the training step (engine,
speed/memory benchmark, bigLSTM memory estimate), the key=value option parser, the device choice,
tolerant JSON reads, the data_prep command line."""
import contextlib
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from toy_gan import run_task
from mpt import config as C
from mpt import precision
from mpt.config import Config, SchedCfg
from mpt.errors import UserError
from mpt.task import Task as BaseTask
from mpt.optim import lr_factor
from mpt.ranks import pick_device

torch.set_num_threads(1)


# -- options that work, options that are gone -------------------------------------------------------

def _torch_schedule(name: str, opt, total: int):
    """The same schedule from torch.optim.lr_scheduler, stepped once per epoch: the oracle."""
    S = torch.optim.lr_scheduler
    return {"constant": lambda: S.ConstantLR(opt, factor=1.0, total_iters=0),
            "step": lambda: S.StepLR(opt, step_size=2, gamma=0.5),
            "multistep": lambda: S.MultiStepLR(opt, milestones=[1, 3], gamma=0.1),
            "poly": lambda: S.PolynomialLR(opt, total_iters=total, power=2.0),
            "cosine": lambda: S.CosineAnnealingLR(opt, T_max=total),
            "exponential": lambda: S.ExponentialLR(opt, gamma=0.9)}[name]()


@pytest.mark.parametrize("kw", [dict(name="constant"), dict(name="step", step_epochs=2, gamma=0.5),
                                dict(name="multistep", milestones=[1, 3], gamma=0.1), dict(name="poly", power=2.0),
                                dict(name="cosine"), dict(name="exponential", gamma=0.9)])
def test_every_schedule_agrees_with_torchs_at_every_epoch(kw):
    """At whole epochs each schedule's factor is what torch's own scheduler gives after that many epochs."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    ref = _torch_schedule(kw["name"], opt, 10)
    for epoch in range(11):
        assert lr_factor(SchedCfg(**kw), float(epoch), 10.0) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9,
                                                                              abs=1e-12), (kw, epoch)
        opt.step()
        ref.step()


def test_between_epochs_and_under_warmup():
    """Between whole epochs the factor moves smoothly (exponential: 0.9 ** 2.5 at 2.5), and warm-up
    multiplies every schedule by epoch / warmup_epochs until warm."""
    f = lambda **kw: lr_factor(SchedCfg(**kw), 2.5, 10.0)  # noqa: E731
    assert min(lr_factor(SchedCfg(name="exponential", gamma=0.9), e, 10.0) for e in (2.0, 3.0)) < \
        f(name="exponential", gamma=0.9) < lr_factor(SchedCfg(name="exponential", gamma=0.9), 2.0, 10.0)
    cold = lr_factor(SchedCfg(name="exponential", gamma=0.9, warmup_epochs=2), 1.0, 10.0)
    assert cold == pytest.approx(0.5 * lr_factor(SchedCfg(name="exponential", gamma=0.9), 1.0, 10.0))
    assert lr_factor(SchedCfg(name="cosine", warmup_epochs=2), 3.0, 10.0) == \
        lr_factor(SchedCfg(name="cosine"), 3.0, 10.0)  # warm: no effect


def test_unknown_schedule_and_removed_keys_are_one_line_errors():
    with pytest.raises(UserError, match="exponential"):
        lr_factor(SchedCfg(name="linear"), 0.0, 1.0)
    with pytest.raises(UserError, match="unknown config key 'sched.min_lr' \\(command line\\)"):
        C.set_key(Config(), "sched.min_lr", 0.001, where="command line")


class _SumOfSquares(nn.Module):
    """A model's own layer that must reduce in FP32 (like Caffe's LRN): it opts in by marker."""
    fp32_compute = True

    def forward(self, x):
        self.seen = x.dtype
        return x * x.pow(2).sum(1, keepdim=True)


class _Plain(_SumOfSquares):
    fp32_compute = False


@pytest.mark.parametrize("layer,inside", [(_SumOfSquares, torch.float32), (_Plain, torch.float16),
                                          (lambda: nn.LocalResponseNorm(3), None)])
def test_paper_impl_computes_marked_layers_in_fp32(layer, inside):
    lay = layer()
    net = nn.Sequential(nn.Linear(5, 5), lay, nn.Linear(5, 2))  # on (N, C, L): LRN wants 3-D
    r = precision.build(Config(precision="mixed", impl="paper", loss_scale="8"), "cpu")
    r.prepare(net, [torch.optim.SGD(net.parameters(), lr=0.1)])
    seen, lrn_in = [], []
    net[2].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))  # what the next layer reads
    if inside is None:  # torch's LRN: watch its input (after the recipe's cast)
        lay.register_forward_pre_hook(lambda m, a: lrn_in.append(a[0].dtype))
    out = net(torch.randn(3, 4, 5))
    assert out.dtype == torch.float32 and seen == [torch.float16]  # back to FP16 after the layer
    assert (lrn_in[0] if inside is None else lay.seen) == (torch.float32 if inside is None else inside)


def test_a_skipped_step_names_the_parameter_whose_gradient_overflowed():
    """Of two parameters, only b's gradient is infinite: the skipped step names b, not the first
    parameter of the model."""
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))

        def forward(self, x):
            return self.a * x[0] + self.b * x[1]

    net = Two()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    r = precision.build(Config(precision="mixed", impl="paper", loss_scale="8"), "cpu")
    r.prepare(net, [opt])
    r.backward(net(torch.tensor([1.0, math.inf])).sum())
    assert r.step(opt) is False and r.last_overflow == "b" and r.skipped_steps == 1


# -- one training step --------------------------------------------------------------------------------

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
    from mpt.step import Observer, TrainStep, loss_body

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
    step = TrainStep(loss_body(lambda m, b: (m(b).mean(), len(b))), net, {"main": opt}, r, world=2,
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
    trained = torch.load(C.run_dir(cfg) / "checkpoint.pt", weights_only=True)["model"]
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


# -- one option parser, one device choice, one tolerant JSON read, one data_prep command ---------------

def test_parse_options_types_like_the_defaults(capsys):
    d = {"n": 3, "w": 0.5, "flag": False, "name": "auto"}
    assert C.parse_options(["n=4", "w=1e-3", "flag=true", "name=224"], d, "x") == \
        {"n": 4, "w": 0.001, "flag": True, "name": "224"}
    for argv, msg in [(["m=1"], "unknown key 'm'; valid keys: n, w, flag, name"),
                      (["n=many"], "option 'n' expects an integer"), (["w=inf"], "finite"),
                      (["flag=maybe"], "option 'flag' expects true/false"), (["n"], "bad argument 'n'")]:
        with pytest.raises(UserError, match=msg.replace("(", r"\(")):
            C.parse_options(argv, d, "x")
    with pytest.raises(SystemExit):
        C.parse_options(["--help"], d, "prog")
    assert "n=3" in capsys.readouterr().out


def test_pick_device():
    assert pick_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert pick_device("auto", local_rank=1) == torch.device("cpu")
        with pytest.raises(UserError, match="no CUDA GPU is visible"):
            pick_device("cuda:0")
    with pytest.raises(UserError, match="not a torch device"):
        pick_device("gpu0")
    with pytest.raises(UserError, match="only cpu and cuda"):
        pick_device("meta")


def test_read_json_default_only_when_asked(tmp_path):
    from mpt.rundir import read_json
    from slurm.job import read_job_file

    (tmp_path / "half.json").write_text('{"a": ')
    assert read_json(tmp_path / "half.json", default=None) is None and read_job_file(tmp_path) is None
    with pytest.raises(ValueError):
        read_json(tmp_path / "half.json")
    (tmp_path / "job.json").write_text('{"attempts": []}')
    assert read_job_file(tmp_path) == {"attempts": []}


def test_data_prep_commands_share_one_command_line(tmp_path, capsys):
    from data_prep.common import prep_command

    got = {}
    main = prep_command("x", "test", lambda src, out, **kw: got.update(src=src, out=out, **kw) or got,
                        source="--archive", source_help="", out_help="", workers_help="w",
                        extra=lambda p: p.add_argument("--vocab"))
    main(["--archive", "a", "--out", "o", "--vocab", "v", "--workers", "3"])
    assert got == {"src": tmp_path.__class__("a"), "out": tmp_path.__class__("o"), "force": False, "workers": 3,
                   "vocab": "v"}
    with pytest.raises(SystemExit) as e:
        main(["--archive", "a", "--out", "o", "--workers", "0"])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == "error: --workers must be at least 1"


def test_generators_share_one_command_line(capsys):
    from data_prep.common import generator_command
    from mpt.errors import UserError

    calls = []

    def generate(out, n, text, seed):
        if n < 0:
            raise UserError("--n must be at least 0")
        calls.append((out, n, text, seed))
        return {"a": out / "a.tar", "b": out / "b.tar"}

    main = generator_command("x.tiny", "test", generate, options=[("--n", 3), ("--text", "w", "what to say")])
    paths = main(["--out", "o", "--seed", "2", "--text", "z"])  # generate(out, *options in order, seed)
    assert calls == [(Path("o"), 3, "z", 2)] and paths["a"] == Path("o/a.tar")
    assert capsys.readouterr().out == "wrote o/a.tar, o/b.tar\n"  # a dict's values, joined
    main = generator_command("x.tiny", "test", lambda out, seed: out, done=lambda a, r, s: f"made {r} ({a.seed})")
    main(["--out", "o"])
    assert capsys.readouterr().out == "made o (0)\n"
    with pytest.raises(SystemExit) as e:  # a UserError is one line
        generator_command("x.tiny", "test", generate, options=[("--n", 3), ("--text", "w")])(["--out", "o", "--n", "-1"])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == "error: --n must be at least 0"


def test_already_prepared_skips_only_a_complete_output(tmp_path):
    from data_prep.common import MARKER, already_prepared
    from mpt.errors import UserError

    logs = []
    assert already_prepared(tmp_path, False, logs.append) is None and not logs  # no marker: work to do
    (tmp_path / MARKER).write_text('{"n": 7}')
    assert already_prepared(tmp_path, True, logs.append) is None and not logs  # --force
    assert already_prepared(tmp_path, False, logs.append) == {"n": 7}
    assert logs == [f"{tmp_path} is already prepared ({MARKER}); pass --force to redo it"]
    assert already_prepared(tmp_path, False, logs.append, describe=lambda i: f"{i['n']} items") == {"n": 7}
    assert logs[-1] == f"{tmp_path} is already prepared (7 items); pass --force to redo it"

    def changed(info):
        raise UserError("changed")

    with pytest.raises(UserError, match="changed"):
        already_prepared(tmp_path, False, logs.append, check=changed)
    assert len(logs) == 2  # a failed check says nothing more


# -- the tiny_check command: user mistakes are one line, overrides go to every run --------------------

@pytest.mark.parametrize("argv,msg", [
    (["--models", "lenet"], "unknown model 'lenet'"),
    # a key=value after a list option is an override of every run, not a precision named 'foo=1'
    (["--precisions", "fp32", "foo=1"], "unknown config key 'foo'"),
    (["--threads", "-1"], "--threads -1: give 1 or more"),  # was torch's traceback
])
def test_tiny_check_errors_are_one_line(tmp_path, capsys, argv, msg):
    from experiments.ilsvrc_cnns.tiny_check import main
    from mpt.errors import cli

    with pytest.raises(SystemExit) as e:
        cli(main)(["--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"), "--seeds", "0",
                   "--models", "alexnet", *argv])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(err) == 1 and msg in err[0], err


def test_a_workload_can_register_its_own_schedule(monkeypatch):
    from mpt.optim import SCHEDULES, schedule

    monkeypatch.setitem(SCHEDULES, "halving", None)  # restored after the test
    schedule("halving")(lambda s, epoch, total: 0.5 ** int(epoch))
    assert lr_factor(SchedCfg(name="halving"), 2.5, 4.0) == 0.25
    assert lr_factor(SchedCfg(name="halving", warmup_epochs=1.0), 0.5, 4.0) == 0.5  # warm-up on top
