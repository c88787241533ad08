"""The speed/memory benchmark measures what it says (CPU; no test needs or times a GPU):
exact activation bytes on a model with known activation sizes, ratios from the same run, and the
command end to end on two tiny models."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from conftest import REPO
from experiments.speed_memory import bench, report
from experiments.speed_memory import main as speed_memory
from mpt.config import Config
from mpt.errors import cli

torch.set_num_threads(2)
B = 4  # batch of the known-size model


class KnownTask:
    """Linear(16, 32) - ReLU - Linear(32, 8), loss = mean of the FP32 output. Saved for backward:
    the first linear's input (its weight gradient needs it), the ReLU output (ReLU's and the second
    linear's input: one storage), and under autocast the FP16 cast of the second linear's weight
    (the first one's is not saved: its input needs no gradient). mean and the FP32 cast save nothing."""

    def __init__(self, cfg):
        self.cfg = cfg

    def build_model(self):
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))

    def loss(self, model, x):
        return model(x).float().mean(), x.shape[0]


KNOWN = bench.Workload("none", "items", 16, KnownTask,
                       lambda n, size, device, cl, gen: torch.randn(n, size, generator=gen).to(device))


@pytest.fixture
def known(monkeypatch):
    monkeypatch.setitem(bench.WORKLOADS, "known", KNOWN)
    monkeypatch.setattr(bench, "config_for", lambda wl, m, p, impl, o, dev: Config(
        model=m, precision="fp32" if p == "tf32" else p, impl=impl or "autocast"))


def opts(**kw):
    from experiments.speed_memory import DEFAULTS

    return {**DEFAULTS, "batch": B, "size": "16", "steps": 1, "warmup": 1, **kw}


@pytest.mark.parametrize("prec,impl,act16,act32,casts", [
    ("fp32", None, 0, B * 16 * 4 + B * 32 * 4, 0),
    # + 4: GradScaler multiplies the loss by its scale, a 0-dim FP32 tensor, which the product saves
    ("mixed", "autocast", B * 16 * 2 + B * 32 * 2, 4, 8 * 32 * 2),
    ("mixed", "paper", B * 16 * 2 + B * 32 * 2, 0, 0),  # FP16 weights are the parameters: not counted
    ("bf16", "autocast", B * 16 * 2 + B * 32 * 2, 0, 8 * 32 * 2),
])
def test_activation_bytes_are_exact(known, prec, impl, act16, act32, casts):
    r = bench.measure("known", prec, impl, opts(), torch.device("cpu"))
    assert r["status"] == "ok", r["note"]
    assert r["activation_bytes"] == act16 + act32 + casts
    assert r["saved_weight_cast_bytes"] == casts
    assert r["activation_only_bytes"] == act16 + act32
    low = "bfloat16" if prec == "bf16" else "float16"
    assert r["activation_only_bytes_by_dtype"] == {k: v for k, v in ((low, act16), ("float32", act32)) if v}
    n_params = 16 * 32 + 32 + 32 * 8 + 8
    assert r["optimizer_state_bytes"] == 4 * n_params  # SGD momentum: one FP32 buffer per master weight
    if impl == "paper":
        assert r["param_bytes"] == 2 * n_params and r["master_bytes"] == 4 * n_params
        assert r["grad_bytes"] == 2 * n_params + 4 * n_params  # FP16 model + FP32 master gradients
    else:
        assert r["param_bytes"] == 4 * n_params and r["master_bytes"] == 0 and r["grad_bytes"] == 4 * n_params


def test_buffers_saved_by_batch_norm_are_not_activations():
    net = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4))
    meter = bench.ActivationMeter(net)
    with meter.measure():
        net(torch.randn(2, 3, 8, 8)).sum().backward()
    b = meter.breakdown()
    assert b["saved_buffer_bytes"] == 2 * 4 * 4  # running mean and variance, FP32
    assert b["activation_bytes"] == b["saved_buffer_bytes"] + b["activation_only_bytes"]
    assert b["activation_only_bytes"] >= 2 * 3 * 8 * 8 * 4 + 2 * 4 * 6 * 6 * 4  # conv input, BN input


def test_ratios_come_from_rows_of_the_same_run():
    def row(model, prec, impl, ms, act):
        return {"model": model, "precision": prec, "impl": impl, "status": "ok", "step_ms": {"median": ms},
                "throughput": 100 / ms, "activation_bytes": act, "activation_only_bytes": act,
                "peak_gpu_mem_bytes": None, "param_bytes": 4, "master_bytes": 0, "grad_bytes": 4,
                "optimizer_state_bytes": 4}
    rows = [row("a", "fp32", None, 10.0, 100), row("a", "mixed", "autocast", 4.0, 52),
            row("b", "fp32", None, 20.0, 300), row("b", "tf32", None, 8.0, 300), row("b", "mixed", "paper", 5.0, 150)]
    report.add_ratios(rows)
    assert rows[1]["ratios"]["vs_fp32"]["speedup"] == 2.5 and rows[1]["ratios"]["vs_fp32"]["activation"] == 0.52
    assert rows[1]["ratios"]["vs_tf32"] is None
    assert rows[4]["ratios"]["vs_fp32"]["activation_only"] == 0.5 and rows[4]["ratios"]["vs_tf32"]["speedup"] == 1.6
    assert rows[4]["ratios"]["vs_fp32"]["peak_gpu_mem"] is None


def test_kernel_timeline_summary():
    kern = [("sm90_xmma_fprop_implicit_gemm", 0.0, 6.0), ("elementwise_kernel", 5.0, 7.0),
            ("cudnn::bn_fw_tr_1C11_kernel", 8.0, 10.0)]
    s = bench.summarize_kernels(kern)
    assert s["gpu_busy_fraction"] == pytest.approx(9 / 10)
    assert s["matmul_conv_kernel_fraction"] == pytest.approx(6 / 10)
    m = nn.Linear(8, 8)  # the profiler plumbing, with CPU ops standing in for kernels
    s = bench.kernel_profile(lambda: m(torch.randn(4, 8)).sum().backward(), 2, torch.device("cpu"))
    assert 0 < s["gpu_busy_fraction"] <= 1 and 0 <= s["matmul_conv_kernel_fraction"] <= 1
    cuda = torch.device("cuda")
    assert bench.limit_text({"gpu_busy_fraction": 0.5, "matmul_conv_kernel_fraction": 0.9}, cuda).startswith("host-bound")
    assert "memory-bandwidth" in bench.limit_text({"gpu_busy_fraction": 0.95, "matmul_conv_kernel_fraction": 0.3}, cuda)


@pytest.mark.parametrize("argv,msg", [
    (["foo=1"], "unknown key 'foo'"),
    (["models=resnet51"], "unknown model 'resnet51'"),
    (["precisions=fp32,fp8"], "unknown precision 'fp8'"),
    (["impls=apex"], "unknown impl 'apex'"),
    (["batch=many"], "option 'batch' expects an integer"),
    (["overhead=vgg19"], "overhead='vgg19'"),
])
def test_bad_input_is_one_line(capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        cli(speed_memory)(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and msg in err, err


@pytest.mark.parametrize("module,argv,msg", [
    ("watch_overhead", ["models="], "models= is empty"),
    ("watch_overhead", ["rounds=0"], "rounds=0: give 1 or more"),
    ("watch_overhead", ["steps=0"], "steps=0: give 1 or more"),
    ("watch_overhead", ["tag=../elsewhere"], "tag='../elsewhere': use letters"),
    ("watch_overhead", ["precision=bf16"], "precision=bf16: choose fp32 or mixed"),
    ("watch_overhead", ["device=tpu"], "device=tpu: choose cpu or cuda"),
    ("watch_overhead", ["batch=-1"], "batch=-1: give 0 or more"),
    ("formats_cost", ["rounds=0"], "rounds=0: give 1 or more"),
    ("formats_cost", ["warmup=-1"], "warmup=-1: give 0 or more"),
    ("formats_cost", ["tag=a/b"], "tag='a/b': use letters"),
    ("loader", ["ilsvrc_cnns", "--tag", "a b"], "--tag 'a b': use letters"),
    ("cpu_gru", ["shapes=84x141x8"], "shapes=84x141x8: give mandarin, english or INPUTSxUNITSxBATCHxSTEPS"),
    ("cpu_gru", ["shapes=0x1x1x1"], "shapes=0x1x1x1: give"),
    ("cpu_gru", ["shapes="], "shapes= is empty"),
    ("cpu_gru", ["reps=0"], "reps=0: give 1 or more"),
])
def test_benchmarks_refuse_bad_options_before_measuring(capsys, tmp_path, module, argv, msg):
    """Each a one-line error before anything is measured or written (rounds=0 was a StatisticsError traceback
    after the whole run; models= wrote an empty results file; a tag with a '/' a file outside the results)."""
    import importlib

    mod = importlib.import_module(f"experiments.speed_memory.{module}")
    out = ["--out", str(tmp_path)] if module == "loader" else [f"out={tmp_path}"]
    with pytest.raises(SystemExit) as e:
        cli(mod.main)(argv + out)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and msg in err, err
    assert not list(tmp_path.iterdir())


def test_cpu_gru_benchmark_prints_both_and_writes_them(capsys, tmp_path, one_thread):
    """One GRU layer by torch.gru and by mpt.cpu_gru: both timed, their results checked equal, the file written."""
    import json

    from experiments.speed_memory import cpu_gru as bench_gru

    rows = bench_gru.main(["shapes=mandarin,6x5x2x4", "rounds=1", "reps=1", f"out={tmp_path}", "tag=t"])
    assert [r["shape"] for r in rows] == ["mandarin", "6x5x2x4"] and all(r["same_result"] for r in rows)
    assert all(r["torch_gru_ms"] > 0 and r["cpu_gru_ms"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "mandarin (84 inputs, 141 units, batch 8, 125 steps): torch.gru" in out and "(the forward alone" in out
    (f,) = tmp_path.iterdir()
    assert f.name.endswith("-cpu_gru-t.json") and json.loads(f.read_text())["shapes"][1]["units"] == 5


def _lrn_input_numel(model: str, width: float, batch: int, size: int) -> int:
    """Elements entering the model's LRN layers in one forward pass (0 for nets without LRN)."""
    import models
    from models.imagenet_cnns import LRN

    net, seen = models.build(model, width=width), []
    for mod in net.modules():
        if isinstance(mod, LRN):
            mod.register_forward_pre_hook(lambda mod, args: seen.append(args[0].numel()))
    with torch.no_grad():
        net(torch.randn(batch, 3, size, size))
    return sum(seen)


@pytest.mark.heavy
def test_command_on_cpu_two_tiny_models(tmp_path):
    out = tmp_path / "results"
    argv = ["models=alexnet,resnet50_preact", "precisions=fp32,tf32,mixed", "impls=autocast,paper",
            "width=0.03125", "batch=4", "size=80", "steps=2", "warmup=1", "overhead=resnet50_preact",
            "overhead_rounds=1", f"out={out}", "tag=test"]
    # One thread: on a shared CPU, OpenMP threads that spin-wait for busy cores slow a step 100-fold.
    p = subprocess.run([sys.executable, "-m", "experiments.speed_memory", *argv], cwd=REPO, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    (path,) = out.glob("cpu-*-test.json")
    res = json.loads(path.read_text())
    md = (out / path.name.replace(".json", ".md")).read_text()
    assert md.count("| resnet50_preact | mixed |") == 3  # 2 impls + engine overhead
    assert res["schema"] == report.SCHEMA and res["env"]["torch"] == torch.__version__ and res["env"]["date"]
    assert "synthetic" in res["data"] and res["options"]["channels_last"] is False
    rows = {(r["model"], r["precision"], r["impl"]): r for r in res["rows"]}
    assert len(rows) == 2 * 4
    for m in ("alexnet", "resnet50_preact"):
        assert rows[(m, "tf32", None)]["status"] == "skipped"  # no GPU: no TF32
        base = rows[(m, "fp32", None)]
        extra = 4 * _lrn_input_numel(m, width=0.03125, batch=4, size=80)
        for impl in ("autocast", "paper"):
            r = rows[(m, "mixed", impl)]
            assert r["status"] == "ok" and r["peak_gpu_mem_bytes"] is None and r["step_ms"]["n"] == 2
            assert r["ratios"]["vs_tf32"] is None  # no TF32 row to compare with on a CPU
            # The same activations as in FP32, each now stored in FP16 (half the bytes) or kept in FP32
            # (the loss, FP32 layers); autocast also saves GradScaler's 4-byte scale; max-pool indices
            # stay int64. Exact, so a tensor saved twice or in the wrong dtype shows.
            d, d32 = r["activation_only_bytes_by_dtype"], base["activation_only_bytes_by_dtype"]
            assert set(d32) == {"float32", "int64"} and d["int64"] == d32["int64"]
            # AlexNet's LRN computes in FP32 (section 3: a sum of squares) on an FP32 copy of its FP16
            # input, which is saved beside the FP16 ReLU output that FP32 training saves only once.
            assert 2 * d["float16"] + d["float32"] == d32["float32"] + (4 if impl == "autocast" else 0) + extra
            if not extra:  # (AlexNet's LRN layers keep their internals in FP32, a third of its bytes)
                assert d["float16"] > 10 * d["float32"]  # almost every activation is FP16
            assert r["optimizer_state_bytes"] == base["param_bytes"]  # SGD momentum of every FP32 weight
        # FP32 masters of the FP16 parameters only: the norm layers' FP32 parameters are their own master.
        paper, auto = rows[(m, "mixed", "paper")], rows[(m, "mixed", "autocast")]
        assert 0 < paper["master_bytes"] == 2 * (base["param_bytes"] - paper["param_bytes"]) <= base["param_bytes"]
        assert paper["grad_bytes"] == paper["param_bytes"] + paper["master_bytes"]  # FP16 model + FP32 master
        assert auto["activation_only_bytes_by_dtype"]["float16"] == paper["activation_only_bytes_by_dtype"]["float16"]
        assert auto["saved_weight_cast_bytes"] > 0 and paper["saved_weight_cast_bytes"] == 0
    eo = res["engine_overhead"]
    assert [r["precision"] for r in eo] == ["fp32", "mixed"]
    for r in eo:  # one round of each timed loop: its spread over rounds is none
        assert r["rounds"] == 1 and r["ratio_min"] == r["ratio_max"]
        assert min(r["hand_ms"], r["engine_ms"], r["control_ms"]) > 0
    g = {x["id"]: x for x in res["goals"]}
    assert g["resnet50_mixed_throughput"]["status"] == report.NO_GPU
    # The activation goal judges the paper-impl rows of both models against its own stated target.
    act = g["activation_ratio_paper"]
    target = float(act["target"].removeprefix("<="))
    paper_ratio = {m: rows[(m, "mixed", "paper")]["activation_only_bytes"]
                   / rows[(m, "fp32", None)]["activation_only_bytes"] for m in ("alexnet", "resnet50_preact")}
    assert act["status"] == ("met" if all(v <= target for v in paper_ratio.values()) else "missed"), (act, paper_ratio)
    assert all(m in act["measured"] for m in paper_ratio)
    assert all(f"resnet50_preact {p}" in g["engine_overhead"]["measured"] for p in ("fp32", "mixed"))


@pytest.mark.heavy
def test_engine_overhead_on_one_threads_cpu_clock():
    """clock=cpu: blocks timed by this thread's CPU time (a shared machine's waits left out); the
    engine's iteration and both hand-written loops run, the figures are the rounds' medians."""
    from experiments.speed_memory import engine_overhead
    from mpt.errors import UserError

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = engine_overhead.measure("resnet50_preact", "fp32", width=0.03125, batch=2, size=32, rounds=1, steps=2,
                                    device="cpu", clock="cpu")
        assert r["clock"] == "cpu" and min(r["hand_ms"], r["engine_ms"], r["control_ms"]) > 0
        assert r["overhead_pct"] == pytest.approx(100 * (r["engine_ms"] / r["hand_ms"] - 1))
        with pytest.raises(UserError, match="clock='gpu'"):
            engine_overhead.measure("resnet50_preact", "fp32", width=0.03125, batch=2, size=32, rounds=1, steps=1,
                                    device="cpu", clock="gpu")
        torch.set_num_threads(2)
        with pytest.raises(UserError, match="OMP_NUM_THREADS=1"):
            engine_overhead.measure("resnet50_preact", "fp32", width=0.03125, batch=2, size=32, rounds=1, steps=1,
                                    device="cpu", clock="cpu")
    finally:
        torch.set_num_threads(threads)


def test_launch_counts_of_a_step(capsys, one_thread):
    """launches=: a step's aten ops per cell. The optimizer steps all of AlexNet's 16 parameters in a
    few foreach ops; fp16_storage's FP32 math on FP16 weights adds casts to the forward and backward,
    but no longer one per weight and use (half_math.FP32Copies)."""
    from experiments.speed_memory import engine_overhead

    kw = dict(width=0.03125, batch=2, size=64, steps=1, device="cpu")
    fp32 = engine_overhead.launches("alexnet", "fp32", None, **kw)
    half = engine_overhead.launches("alexnet", "fp16_storage", "paper", rounds=1, **kw)
    for r, p in ((fp32, ""), (half, ""), (half, "ref_")):
        assert r[p + "aten_all"] >= r[p + "aten_top"] >= r[p + "launches"] > 0 and r[p + "step_ms"] > 0
        assert r[p + "launches"] == sum(r[f"{p}launches_{ph}"] for ph in ("forward_recipe", "backward", "optimizer"))
    assert 1 <= fp32["launches_optimizer"] <= 6 and 1 <= half["launches_optimizer"] <= 6
    # the reference: SGD's loop runs 4 ops per parameter, the weights are cast at each use
    assert half["ref_launches_optimizer"] == 4 * 16 and "speedup" in half
    assert half["ref_launches_forward_recipe"] - half["launches_forward_recipe"] >= 8
    # Per weight-bearing layer (8): its input up and its output down in the forward; the incoming gradient
    # up, the saved input up, its gradients down in the backward. Besides: the model's input and output
    # and the two LRNs cast (6 forward, ~4 backward), the gradient copy, the write-back and the copies'
    # refresh (3). Its weight and bias are no longer cast at each use: that made 40 and 51.
    assert half["launches_forward_recipe"] - fp32["launches_forward_recipe"] <= 2 * 8 + 6 + 3
    assert half["launches_backward"] - fp32["launches_backward"] <= 5 * 8 + 4
    engine_overhead.main(["launches=alexnet", "cells=fp32", "batch=2", "width=0.03125", "size=64", "steps=1"])
    out = capsys.readouterr().out
    assert "| alexnet | fp32 | - |" in out
    for argv, msg in ((["launches=alexnet", "cells=fp32:fast"], "error: cells: impl 'fast' in 'fp32:fast'"),
                      (["launches=alexnet", "cells=fp64"], "error: cells: unknown precision 'fp64'"),
                      (["launches=lenet"], "error: launches: model 'lenet' has no workload")):
        with pytest.raises(SystemExit):
            engine_overhead.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(msg)


@pytest.mark.parametrize("model", ["english", "mandarin"])
def test_speech_workloads_measure_a_ctc_step(model, one_thread):
    """Table 3's models have rows: one DeepSpeech 2 training step on synthetic spectrograms,
    counted in utterances; FP16 storage (impl=paper) saves each activation of FP32 training once, in
    FP16 (half its bytes) or kept in FP32 (the log-softmax and CTC, section 3.3), so fewer bytes.
    half_math=native: emulated FP16 math runs each GRU whole in FP32 and autograd saves its FP32
    internals (mpt.half_math.HalfMath), which is not what FP16 storage on a GPU saves."""
    o = opts(batch=2, size="32", width=0.03, steps=1, warmup=1, half_math="native")
    rows = {p: bench.measure(model, p, None if p == "fp32" else "paper", o, torch.device("cpu"))
            for p in ("fp32", "mixed")}
    for r in rows.values():
        assert r["status"] == "ok" and r["unit"] == "utterances" and r["items_per_step"] == 2, r
        assert r["optimizer_state_bytes"] > 0 and r["step_ms"]["n"] == 1
    d, d32 = rows["mixed"]["activation_only_bytes_by_dtype"], rows["fp32"]["activation_only_bytes_by_dtype"]
    assert set(d32) == {"float32", "int64"} and d["int64"] == d32["int64"]  # the CTC lengths
    assert 2 * d["float16"] + d["float32"] == d32["float32"] and d["float16"] > 0, (d, d32)


def test_formats_cost_measures_every_format_against_fp32(tmp_path):
    """The simulated formats' cost run: one row per format of the precision table, each ratio to FP32 of the
    same run with the goal its row sets -- a row without one is still reported, never dropped -- and the
    table written."""
    import dataclasses

    from experiments.speed_memory import formats_cost
    from mpt import precisions

    nogoal = dataclasses.replace(precisions.BY_NAME["mxfp8"], cost_goal=None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(formats_cost.GOALS, "mxfp8", nogoal.cost_goal)
        r = formats_cost.main(["models=resnet50_preact", "width=0.03125", "batch=2", "size=32", "steps=1",
                               "warmup=0", "rounds=1", "device=cpu", f"out={tmp_path}", "tag=t"])
    assert [row["precision"] for row in r["rows"]] == ["fp32", *precisions.FORMATS]
    assert all(row["status"] == "ok" for row in r["rows"])
    goals = {q["precision"]: q["goal"] for q in r["ratios"]}
    assert goals == {n: (None if n == "mxfp8" else precisions.BY_NAME[n].cost_goal) for n in precisions.FORMATS}
    assert goals["fp8"] == 2.0 and goals["nvfp4"] == 3.0  # the budget: FP8 family 2x, NVFP4 3x
    assert next(q for q in r["ratios"] if q["precision"] == "mxfp8")["meets_goal"] is None
    assert "none set" in next(tmp_path.glob("*-formats-t.md")).read_text()
    assert all(q["ratio"] > 0 for q in r["ratios"])
    assert len(list(tmp_path.glob("*-formats-t.md"))) == 1


def test_watch_overhead_channels_last_trains_nhwc(one_thread):
    """watch_overhead channels_last=true: the model and every 4-D tensor of the batches in NHWC (the engine's
    mpt.ranks.to_device, as measure() calls it), the rest as they are, and the plain step trains there (what the
    records are timed on)."""
    import types

    from experiments.speed_memory import watch_overhead as wo

    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 0, 1])
    got = [wo.to_device(b, torch.device("cpu"), True) for b in [(x, y), {"x": x, "n": 3}]]
    assert got[0][0].is_contiguous(memory_format=torch.channels_last) and not got[0][0].is_contiguous()
    assert got[0][1] is y and got[1]["n"] == 3 and torch.equal(got[1]["x"], x)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    patient = types.SimpleNamespace(model=net, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                                    loss_fn=lambda: lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
    model, opt, step, scaler = wo._loop(patient, got[:1], channels_last=True)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last) and scaler is None
    before = model[0].weight.detach().clone()
    step()
    assert not torch.equal(model[0].weight, before)  # a step trained
    assert net[0].weight.is_contiguous()  # the patient's own model untouched (a copy is trained)
    # mixed: the loop a torch.amp user writes -- FP16 autocast, the GradScaler stepping the optimizer
    model, opt, step, scaler = wo._loop(patient, got[:1], mixed=True)
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    before = model[0].weight.detach().clone()
    step()
    assert seen == [torch.float16] and scaler.get_scale() == 2.0 ** 16 and not torch.equal(model[0].weight, before)
