"""train.cuda_graphs (mpt.graphs) on the CPU: everything but the CUDA calls. The graph is
mpt.graphs.EagerGraph, which runs the captured region where a capture records it and again at each
replay; the runner around it (eager first call, warm-up, key, static inputs and gradients, the state put
back after capturing) is the code a GPU runs. A GPU session measures the real graphs
(experiments/speed_memory/README.md)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mpt import graphs, precision
from mpt.config import Config
from mpt.errors import UserError
from mpt.step import Observer, TrainStep

torch.set_num_threads(1)


def cfg_of(prec="fp32", impl="autocast", loss_scale="auto", **scaler):
    c = Config(precision=prec, impl=impl, loss_scale=str(loss_scale))
    for k, v in scaler.items():
        setattr(c.scaler, k, v)
    return c


def net(seed=0):
    """Conv, BatchNorm (running statistics: state a warm-up pass would move) and dropout (random
    draws a warm-up pass would consume)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Dropout(0.5), nn.Linear(8, 5))


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).float(), y), y.shape[0]


def batches(n_steps, n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 3, 10, 10, generator=g), torch.randint(0, 5, (n,), generator=g)) for _ in range(n_steps)]


def train(prec, impl, steps, graphed, loss_scale="auto", data=None, **scaler):
    """Losses, final weights and buffers, skip count and graph counts of `steps` iterations."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    recipe = precision.build(cfg_of(prec, impl, loss_scale, **scaler), "cpu")
    model = recipe.prepare(model, [opt])
    step = TrainStep(loss_fn, model, {"main": opt}, recipe, cuda_graphs=graphed,
                     graph_backend=graphs.EagerGraph if graphed else None)
    torch.manual_seed(123)  # dropout's stream, the same for both runs
    losses = []
    for b in (data or batches(steps)):
        logs, _ = step([b])
        losses.append(logs["loss"].item())
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()},
            "skipped": recipe.skipped_steps, "step": step, "recipe": recipe}


CELLS = [("fp32", "autocast", "auto"), ("mixed", "autocast", "dynamic"), ("mixed", "paper", "dynamic"),
         ("fp16_storage", "paper", "auto"), ("fp16_pure", "paper", "dynamic")]


@pytest.mark.parametrize("prec,impl,scale", CELLS)
def test_graphed_training_is_eager_training_bit_for_bit(prec, impl, scale):
    """The runner's capture (warm-up passes, BatchNorm statistics and dropout's random state put back,
    gradients reattached after each replay) changes no number of the training."""
    eager = train(prec, impl, 5, False, scale)
    graphed = train(prec, impl, 5, True, scale)
    assert graphed["losses"] == eager["losses"]
    for k, v in eager["state"].items():
        assert torch.equal(graphed["state"][k], v), k
    runner = graphed["step"].graphs
    assert runner.eager_calls == 1 and runner.replays == 4  # the first iteration eager, then replays


def test_a_new_loss_scale_captures_again_and_matches_eager():
    """impl=paper's S is a Python number inside the captured backward: a back-off after an overflow
    must capture again, or the replays would keep the old S. Growth every 2 steps here moves S often."""
    kw = dict(init_scale=2.0 ** 40, growth_interval=2)  # 2^40 overflows FP16 gradients: back-offs first
    eager = train("mixed", "paper", 8, False, "dynamic", **kw)
    graphed = train("mixed", "paper", 8, True, "dynamic", **kw)
    assert eager["skipped"] > 0
    assert graphed["losses"] == eager["losses"] and graphed["skipped"] == eager["skipped"]
    assert graphed["recipe"].loss_scale == eager["recipe"].loss_scale
    scales_seen = graphed["step"].graphs.captures
    assert scales_seen > 1


def test_a_batch_of_another_shape_runs_eagerly():
    data = batches(3) + batches(1, n=4, seed=7) + batches(2, seed=9)
    eager = train("fp32", "autocast", 0, False, data=data)
    graphed = train("fp32", "autocast", 0, True, data=data)
    assert graphed["losses"] == eager["losses"]
    runner = graphed["step"].graphs
    assert runner.eager_calls == 2 and runner.captures == 1 and runner.replays == 4


def test_gradients_after_a_replay_are_the_graphs_tensors():
    """The optimizer reads p.grad: after a replay it is the tensor the capture's backward wrote."""
    out = train("fp32", "autocast", 3, True)
    runner = out["step"].graphs
    assert runner.grads and all(g.shape == p.shape for p, g in runner.grads)


def test_autocast_cache_is_off_inside_the_region_only():
    seen = []

    def probe(model, batch):
        seen.append(torch.is_autocast_cache_enabled())
        return loss_fn(model, batch)

    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recipe = precision.build(cfg_of("bf16", "autocast"), "cpu")
    model = recipe.prepare(model, [opt])
    eager = TrainStep(probe, model, {"main": opt}, recipe)
    eager([batches(1)[0]])
    graphed = TrainStep(probe, model, {"main": opt}, recipe, cuda_graphs=True, graph_backend=graphs.EagerGraph)
    for _ in range(2):  # the first iteration eager (measured), the second captures and replays
        graphed([batches(1)[0]])
    # eager, eager; 2 warm-up passes, the capture, the stand-in's replay
    assert seen == [True, True, False, False, False, False]


# -- refusals -----------------------------------------------------------------------------------


def _step(**kw):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recipe = kw.pop("recipe", None) or precision.build(cfg_of(), "cpu")
    recipe.prepare(model, [opt])
    return TrainStep(loss_fn, model, {"main": opt}, recipe, cuda_graphs=True, **kw)


def test_refused_on_a_cpu_device():
    with pytest.raises(UserError, match="train.cuda_graphs=true captures CUDA kernels; this run is on cpu"):
        _step()


def test_refused_with_ddp_and_with_sampling_observers():
    with pytest.raises(UserError, match="DDP"):
        graphs.check(device="cuda", world=2)

    class Sampler(Observer):
        pass

    class Safe(Observer):
        graph_safe = True

    with pytest.raises(UserError, match="observer Sampler"):
        _step(graph_backend=graphs.EagerGraph, observers=(Sampler(),))
    _step(graph_backend=graphs.EagerGraph, observers=(Safe(),))


def test_refused_with_several_micro_batches():
    step = _step(graph_backend=graphs.EagerGraph)
    with pytest.raises(UserError, match="train.accum_steps=2"):
        step(batches(2))


def test_refused_for_fp8():
    recipe = precision.build(Config(precision="fp8"), "cpu")
    with pytest.raises(UserError, match="precision=fp8 keeps host-side state"):
        _step(graph_backend=graphs.EagerGraph, recipe=recipe)


def test_refused_for_tasks_without_a_static_step():
    from experiments.ilsvrc_cnns.task import Task as Ilsvrc
    from mpt.task import Task

    class Dynamic(Task):
        def loss(self, model, batch):
            return model(batch).mean(), len(batch)

    class OwnBody(Task):
        graphable = True

        def train_step(self, ctx, micro_batches):
            return ctx.loss_step(self.loss, micro_batches)

    assert graphs.refusal(device="cuda", task=Ilsvrc.__new__(Ilsvrc)) is None
    assert "does not declare a static step" in graphs.refusal(device="cuda", task=Dynamic.__new__(Dynamic))
    assert "writes its own train_step" in graphs.refusal(device="cuda", task=OwnBody.__new__(OwnBody))


def test_config_refusals_and_identity():
    from mpt import config as C
    from mpt import identity

    over = ["model=alexnet", "profile=tiny", "train.cuda_graphs=true"]
    with pytest.raises(UserError, match="train.accum_steps"):
        C.resolve("ilsvrc_cnns", [*over, "train.accum_steps=2", "train.batch_size=8"])
    with pytest.raises(UserError, match="numerics"):
        C.resolve("ilsvrc_cnns", [*over, "numerics.every=5"])
    # A speed setting: the same run with and without graphs
    on = C.resolve("ilsvrc_cnns", over)
    off = C.resolve("ilsvrc_cnns", over[:2])
    assert on.train.cuda_graphs and identity.cell_id(on) == identity.cell_id(off)


@pytest.mark.parametrize("model", ["alexnet", "googlenet"])
def test_the_benchmarks_cells_through_the_runner(model):
    """The GPU rows' cells (speed_memory bench.build_cell: the ILSVRC task's loss, GoogLeNet's auxiliary
    heads, AlexNet's LRN and dropout, fp16_storage's FP32 math and weight copies), tiny, with the stand-in
    graph: the same losses and weights as eager."""
    from experiments.speed_memory import DEFAULTS, bench

    o = {**DEFAULTS, "width": 0.03125, "batch": 2, "channels_last": False}
    wl = bench.WORKLOADS[model]
    for prec, impl in (("fp32", None), ("mixed", "autocast"), ("fp16_storage", "paper")):
        runs = []
        for backend in (None, graphs.EagerGraph):
            with bench.restored_backend_flags():
                task, net, opt, recipe, batch = bench.build_cell(wl, model, prec, impl, 80, o, torch.device("cpu"))
            assert graphs.refusal(device="cuda", recipe=recipe, task=task) is None
            step = TrainStep(task.loss, net, {"main": opt}, recipe, cuda_graphs=backend is not None,
                             graph_backend=backend)
            torch.manual_seed(5)
            losses = [step([batch])[0]["loss"].item() for _ in range(4)]
            runs.append((losses, [p.detach().clone() for p in net.parameters()], step))
        (le, pe, _), (lg, pg, sg) = runs
        assert lg == le, (prec, impl)
        assert all(torch.equal(a, b) for a, b in zip(pe, pg)), (prec, impl)
        assert sg.graphs.replays == 3


def test_the_gpu_calls_exactness_check_on_the_cpu():
    """bench.graphs_exactness (gpu_check's models part on a GPU), with the stand-in graph."""
    from experiments.speed_memory import DEFAULTS, bench

    o = {**DEFAULTS, "width": 0.03125, "batch": 2, "size": "80", "channels_last": False}
    with bench.restored_backend_flags():
        r = bench.graphs_exactness("alexnet", "mixed", "autocast", o, torch.device("cpu"), steps=3,
                                   backend=graphs.EagerGraph)
    assert r["losses_equal"] and r["weights_equal"] and r["replays"] == 2 and r["captures"] == 1
    assert r["eager_repeat_losses_equal"] and r["eager_repeat_max_weight_diff"] == 0.0
