"""The precision recipes do what section 3 of the paper says (CPU)."""
import copy

import pytest
import torch
import torch.nn as nn

from toy_gan import run_task
from mpt import precision, precisions
from mpt.config import Config
from mpt.errors import UserError
from mpt.half_math import FP32Copies

torch.set_num_threads(1)
ALL = [(p, i) for p in precisions.PRECISIONS for i in precisions.IMPLS]


def cfg_of(prec="fp32", impl="autocast", loss_scale="auto", half_math="auto", **scaler):
    c = Config(precision=prec, impl=impl, loss_scale=str(loss_scale), half_math=half_math)
    for k, v in scaler.items():
        setattr(c.scaler, k, v)
    return c


def recipe_for(model, opt, prec, impl, loss_scale="auto", half_math="auto", **scaler):
    r = precision.build(cfg_of(prec, impl, loss_scale, half_math, **scaler), "cpu")
    r.prepare(model, [opt])
    return r


def tiny_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, 3))


def data(seed=1, n=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def step(r, model, opt, x, y, clip=0.0):
    with r.autocast():
        loss = nn.functional.cross_entropy(model(x).float(), y)
    r.backward(loss)
    applied = r.step(opt, clip)
    r.update()
    r.zero_grad()
    return loss.item(), applied


def test_fp32_bit_identical_to_hand_written_loop():
    x, y = data()
    a, b = tiny_net(), tiny_net()
    oa = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    ob = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    r = recipe_for(a, oa, "fp32", "paper")
    for _ in range(5):
        step(r, a, oa, x, y, clip=1.0)
        loss = nn.functional.cross_entropy(b(x).float(), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(b.parameters()), 1.0, foreach=True)
        ob.step()
        ob.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("prec,impl", ALL)
def test_zero_grad_frees_every_model_gradient(prec, impl):
    """zero_grad lists the model's parameters once (Recipe._free_model_grads, instead of walking the
    module tree every step): every parameter's gradient, one held by no optimizer included, must
    still be freed after each step, the first and the later ones."""
    model = tiny_net()
    head = list(model[-1].parameters())
    opt = torch.optim.SGD([p for p in model.parameters() if all(p is not h for h in head)], lr=0.1)
    r = recipe_for(model, opt, prec, impl)
    x, y = data()
    for _ in range(2):
        with r.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        r.backward(loss)
        assert all(p.grad is not None for p in model.parameters())
        r.step(opt, 0.0)
        r.update()
        r.zero_grad()
        assert all(p.grad is None for p in model.parameters()), (prec, impl)


def _big_weight_step(prec, impl, scale="auto"):
    """A weight 4096x its update (section 3.1: updates 2048x smaller are lost in FP16)."""
    m = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        m.weight.fill_(4096.0)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    r = recipe_for(m, opt, prec, impl, scale)
    with r.autocast():
        loss = m(torch.ones(1, 1)).float().sum()  # d loss / d w = 1 -> update -1
    r.backward(loss)
    r.step(opt)
    r.update()
    return r.weights_of(opt)[0].item()  # the master, or fp16_pure's FP16 weight


@pytest.mark.parametrize("impl", precisions.IMPLS)
def test_update_swamped_without_master_copy_kept_with_it(impl):
    assert _big_weight_step("fp16_pure", impl) == 4096.0  # 4095 rounds back to 4096 in FP16
    assert _big_weight_step("fp16", impl) == 4095.0  # the FP32 master keeps it
    assert _big_weight_step("mixed", impl, 8) == 4095.0


@pytest.mark.parametrize("impl", precisions.IMPLS)
def test_tiny_gradient_flushed_at_s1_survives_with_scaling(impl):
    def grad(prec, scale):
        m = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            m.weight.fill_(1.0)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        r = recipe_for(m, opt, prec, impl, scale)
        with r.autocast():
            out = m(torch.full((1, 1), 2.0 ** -13))
        r.backward(out.float().sum() * 2.0 ** -13)  # true dL/dw = 2^-26 < 2^-24
        assert r.step(opt)
        return r.master_params()[0].grad.item()

    assert grad("fp16", "auto") == 0.0
    assert grad("mixed", 1024) == 2.0 ** -26


def test_real_model_gradients_underflow_at_s1_not_with_scale():
    x, y = data(n=16)
    tiny = 2.0 ** -22  # shrink the loss so many gradients fall under 2^-24, as in Figure 3

    def grads(prec, scale):
        m = tiny_net()
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        r = recipe_for(m, opt, prec, "paper", scale)
        with r.autocast():
            loss = nn.functional.cross_entropy(m(x), y) * tiny
        r.backward(loss)
        r.step(opt)
        return torch.cat([p.grad.flatten() for p in r.master_params() if p.grad is not None])

    g32, g1, gs = grads("fp32", "auto"), grads("fp16", "auto"), grads("mixed", 2.0 ** 16)
    nz32 = (g32 != 0).sum().item()
    assert (g1 != 0).sum().item() < 0.5 * nz32  # S = 1 flushes most of them to zero
    assert (gs != 0).sum().item() >= 0.95 * nz32  # S = 2^16 keeps them
    assert torch.allclose(gs, g32, rtol=0.05, atol=tiny * 1e-3)


@pytest.mark.parametrize("impl", precisions.IMPLS)
@pytest.mark.parametrize("scale", ["dynamic", "128"])
def test_overflow_skips_step_and_reports_culprit(impl, scale):
    x, y = data()
    m = tiny_net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    r = recipe_for(m, opt, "mixed", impl, scale, init_scale=128.0)
    step(r, m, opt, x, y)  # one clean step so the optimizer has state
    before = [p.detach().clone() for p in r.master_params()]
    s0 = r.loss_scale
    with r.autocast():
        loss = nn.functional.cross_entropy(m(x).float(), y)
    r.backward(loss)
    m[5].weight.grad[0, 0] = float("inf")
    assert r.step(opt) is False
    r.update()
    r.zero_grad()
    after = r.master_params()
    assert all(torch.equal(b, a) and torch.isfinite(a).all() for b, a in zip(before, after))
    assert r.skipped_steps == 1 and r.last_overflow == "5.weight"
    assert r.loss_scale == (s0 / 2 if scale == "dynamic" else s0)


@pytest.mark.parametrize("impl", precisions.IMPLS)
@pytest.mark.parametrize("scale", ["dynamic", "128"])
def test_one_host_read_per_step_and_training_goes_on_after_a_skip(impl, scale, monkeypatch):
    """A clean step reads the device once (the skip decision the engine needs on the host; GradScaler
    would read it a second time in scaler.step); a skipped step changes nothing, the next ones apply."""
    x, y = data()
    m = tiny_net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    r = recipe_for(m, opt, "mixed", impl, scale, init_scale=128.0)
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _orig=orig, _name=name: reads.append(_name) or _orig(t, *a))
    for overflow in (False, True, False, False):
        with r.autocast():
            loss = nn.functional.cross_entropy(m(x).float(), y)
        r.backward(loss)
        if overflow:
            m[5].weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in r.master_params()]
        reads.clear()
        applied = r.step(opt, clip_grad_norm=1.0)
        n = len(reads)
        r.update()
        r.zero_grad()
        changed = any(not torch.equal(b, a) for b, a in zip(before, r.master_params()))
        assert applied is (not overflow) and changed is applied
        if not overflow:  # (an overflow also reads the gradients to name the culprit)
            assert n == 1, reads
    assert r.skipped_steps == 1 and r.last_overflow == "5.weight"


@pytest.mark.parametrize("impl", precisions.IMPLS)
def test_dynamic_scale_grows_after_interval(impl):
    x, y = data()
    m = tiny_net()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    r = recipe_for(m, opt, "mixed", impl, "dynamic", init_scale=64.0, growth_interval=3)
    for _ in range(2):
        step(r, m, opt, x, y)
    assert r.loss_scale == 64.0
    step(r, m, opt, x, y)
    assert r.loss_scale == 128.0


@pytest.mark.parametrize("impl", precisions.IMPLS)
def test_clipping_sees_unscaled_gradients(impl):
    x, y = data()
    ref, m = tiny_net(), tiny_net()
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    o = torch.optim.SGD(m.parameters(), lr=0.5)
    r_ref = recipe_for(ref, o_ref, "fp32", impl)
    r = recipe_for(m, o, "mixed", impl, 1024)
    step(r_ref, ref, o_ref, x, y, clip=0.05)
    step(r, m, o, x, y, clip=0.05)
    # Had clipping seen gradients scaled by 1024, the update would be ~1000x smaller.
    for a, b in zip(r_ref.master_params(), r.master_params()):
        assert torch.allclose(a, b, atol=2e-3), (a - b).abs().max()


def test_accumulation_equals_big_batch_fp32():
    x, y = data(n=12)
    a, b = tiny_net(), tiny_net()
    for mod in (a, b):  # batch statistics differ per micro-batch; compare without them
        mod[1].eval()
    oa, ob = (torch.optim.SGD(n.parameters(), lr=0.1) for n in (a, b))
    ra, rb = recipe_for(a, oa, "fp32", "autocast"), recipe_for(b, ob, "fp32", "autocast")
    ra.backward(nn.functional.cross_entropy(a(x), y))
    ra.step(oa)
    for xs, ys in zip(x.chunk(3), y.chunk(3)):
        rb.backward(nn.functional.cross_entropy(b(xs), ys) / 3)
    rb.step(ob)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.allclose(pa, pb, atol=1e-6)


@pytest.mark.parametrize("impl", precisions.IMPLS)
def test_checkpoint_round_trip_continues_bit_identically(impl):
    x, y = data()
    m = tiny_net()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    r = recipe_for(m, opt, "mixed", impl, "dynamic", init_scale=2.0 ** 20, growth_interval=2)
    for _ in range(3):
        step(r, m, opt, x, y)
    sd = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict(), "recipe": r.state_dict()})
    for _ in range(3):
        step(r, m, opt, x, y)
    m2 = tiny_net(seed=5)
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    r2 = recipe_for(m2, opt2, "mixed", impl, "dynamic", init_scale=2.0 ** 20, growth_interval=2)
    m2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["opt"])
    r2.load_state_dict(sd["recipe"])
    for _ in range(3):
        step(r2, m2, opt2, x, y)
    assert r2.loss_scale == r.loss_scale and r2.skipped_steps == r.skipped_steps
    for a, b in zip(r.master_params(), r2.master_params()):
        assert torch.equal(a, b)
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)


def test_two_optimizers_share_one_scaler():
    """The DCGAN case: two optimizers, one scale, each step skipped independently."""
    x, y = data()
    m = tiny_net()
    o1 = torch.optim.SGD(list(m.parameters())[:4], lr=0.1)
    o2 = torch.optim.Adam(list(m.parameters())[4:], lr=0.01)
    r = precision.build(cfg_of("mixed", "paper", "dynamic", init_scale=256.0), "cpu")
    r.prepare(m, [o1, o2])
    with r.autocast():
        loss = nn.functional.cross_entropy(m(x), y)
    r.backward(loss)
    m[5].bias.grad[0] = float("nan")  # belongs to o2
    assert r.step(o1) is True
    assert r.step(o2) is False
    r.update()
    assert r.loss_scale == 128.0


@pytest.mark.parametrize("prec,impl", ALL)
def test_every_recipe_trains(prec, impl):
    x, y = data(n=16)
    m = tiny_net()
    opt = torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9)
    r = recipe_for(m, opt, prec, impl)
    losses = [step(r, m, opt, x, y)[0] for _ in range(8)]
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_paper_impl_stores_fp16_keeps_norms_fp32():
    m = tiny_net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    r = recipe_for(m, opt, "mixed", "paper")
    assert m[0].weight.dtype == torch.float16 and m[5].weight.dtype == torch.float16
    assert m[1].weight.dtype == torch.float32 and m[1].running_mean.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in r.master_params())
    assert m(torch.randn(2, 3, 8, 8)).dtype == torch.float32  # loss reduces in FP32 (3.3)


@pytest.mark.parametrize("kw,msg", [
    (dict(prec="fp4"), "unknown precision 'fp4'"),
    (dict(impl="apex"), "unknown impl 'apex'"),
    (dict(prec="mixed", loss_scale="0"), "must be a positive"),
    (dict(prec="mixed", loss_scale="lots"), "is not a number"),
])
def test_bad_input_is_one_line_error(kw, msg):
    with pytest.raises(UserError, match=msg):
        precision.build(cfg_of(**kw), "cpu")


def test_paper_impl_rejects_unwrappable_optimizer():
    m = tiny_net()
    with pytest.raises(UserError, match="cannot wrap optimizer LBFGS"):
        recipe_for(m, torch.optim.LBFGS(m.parameters()), "mixed", "paper")


@pytest.mark.parametrize("prec,scale", [("fp16", 1), ("mixed", 128)])
def test_paper_master_starts_from_fp32_init_and_matches_section_3(prec, scale):
    """The FP32 master copy is the model's FP32 initial weights (not their FP16 rounding), and 20
    steps of impl=paper equal a by-hand section 3: FP16 copy of the master forward/backward, scaled
    loss, FP32 unscaled gradient, SGD with momentum and weight decay on the master."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 3)
    init = [p.detach().clone() for p in lin.parameters()]
    assert any((p.half().float() != p).any() for p in init)  # the test would be blind otherwise
    opt = torch.optim.SGD(lin.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    r = recipe_for(lin, opt, prec, "paper", loss_scale=scale)
    for m, p in zip(r.master_params(), init):
        assert m.dtype == torch.float32 and torch.equal(m, p)

    masters = [p.clone().requires_grad_(False) for p in init]
    ref_opt = torch.optim.SGD([torch.nn.Parameter(m) for m in masters], lr=0.05, momentum=0.9, weight_decay=1e-3)
    ref_params = ref_opt.param_groups[0]["params"]
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        step(r, lin, opt, x, y)
        w16 = [p.detach().half().requires_grad_() for p in ref_params]
        out = nn.functional.linear(x.half(), w16[0], w16[1]).float()
        (nn.functional.cross_entropy(out, y) * scale).backward()
        for p, w in zip(ref_params, w16):
            p.grad = w.grad.float() / scale
        ref_opt.step()
    for m, p in zip(r.master_params(), ref_params):
        assert torch.equal(m, p.detach())


# ------------------------------------------------------------------------------------------------
# the edges of the recipes


def _toy_run(tmp_path, **kw):
    from toy_mlp import ToyMLP, config

    s = run_task(config(tmp_path, **kw), ToyMLP)
    assert s["status"] == "completed", s
    lines = (tmp_path / "toy_mlp" / s["run_name"] / "metrics.jsonl").read_text().splitlines()
    import json

    return [x for x in map(json.loads, lines) if x["kind"] == "numerics"]


def test_fp16_pure_swamping_is_measured_on_the_fp16_weights(tmp_path):
    """Item 1: at lr 1e-5 almost every update is lost in FP16 weights. fp16_pure measures what its
    FP16 weights received against what the optimizer intended (it used to compare the FP16 weights
    with themselves and report 0); fp16 (FP32 master) reports what FP16 weights would lose."""
    kw = dict(optim={"lr": 1e-5, "momentum": 0.0}, numerics=1, train={"max_steps": 2})
    pure = _toy_run(tmp_path / "pure", precision="fp16_pure", **kw)
    master = _toy_run(tmp_path / "master", precision="fp16", impl="paper", **kw)
    for line in pure:
        assert line["numerics/swamp/swamped_measured"] is True
        assert line["numerics/swamp/changed"] > 0.9 * line["numerics/swamp/total"]
        assert line["numerics/swamp/frac_swamped"] > 0.9, line
        assert line["numerics/swamp/frac_swamped_2048"] >= line["numerics/swamp/frac_swamped"]
    for line in master:
        assert line["numerics/swamp/swamped_measured"] is False
        assert line["numerics/swamp/frac_swamped"] > 0.9, line
    # A learning rate the weights can hold: few updates lost.
    kept = _toy_run(tmp_path / "kept", precision="fp16_pure", optim={"lr": 0.1, "momentum": 0.0},
                    numerics={"every": 1, "hist_lo": -70, "hist_hi": 10}, train={"max_steps": 1})
    assert kept[0]["numerics/swamp/frac_swamped"] < 0.5
    # The histogram range comes from the config.
    assert (kept[0]["numerics/hist_lo"], kept[0]["numerics/hist_hi"]) == (-70, 10)
    assert len(kept[0]["numerics/weight/overall/hist"]) == 81


def test_fp16_pure_keeps_optimizer_state_and_eps_in_fp32():
    """Item 6: Adam's eps = 1e-8 is 0 in FP16, so a zero gradient gave 0/0. fp16_pure's optimizer
    works on FP32 copies of the FP16 weights: state FP32, no NaN; the weights stay FP16."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    r = recipe_for(m, opt, "fp16_pure", "autocast")
    x = torch.randn(6, 4)
    x[:, 0] = 0  # the first input column gets a zero weight gradient
    for _ in range(2):
        with r.autocast():
            loss = m(x).float().square().mean()
        r.backward(loss)
        assert r.step(opt)
        r.update()
        r.zero_grad()
    assert all(p.dtype == torch.float16 and torch.isfinite(p).all() for p in m.parameters())
    state = [t for s in opt.state.values() for t in s.values() if t.dim() > 0]
    assert state and all(t.dtype == torch.float32 for t in state)
    # The FP16 weights are the optimizer's FP32 result rounded (which the next step starts from).
    assert all(torch.equal(f.half(), w) for w, f in zip(r.weights_of(opt), r.params_of(opt)))


def test_fp16_pure_loses_updates_every_step():
    """The FP32 copy carries nothing between steps: 4096 - 1 rounds back to 4096 every time."""
    m = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        m.weight.fill_(4096.0)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    r = recipe_for(m, opt, "fp16_pure", "paper")
    for _ in range(3):
        r.backward(m(torch.ones(1, 1).half()).float().sum())
        r.step(opt)
        r.update()
        r.zero_grad()
    assert m.weight.item() == 4096.0


@pytest.mark.parametrize("prec,impl", [("mixed", "paper"), ("fp16_pure", "autocast"), ("fp16_storage", "autocast")])
def test_sparse_gradients_are_a_one_line_error(prec, impl):
    """Item 4: the FP32 master copy takes dense gradients (copy_() between dense and sparse crashed)."""
    m = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(UserError, match=r"0 = Embedding\(sparse=True\).*sparse=False"):
        recipe_for(m, torch.optim.SGD(m.parameters(), lr=0.1), prec, impl)
    m = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))  # autocast recipes take them
    r = recipe_for(m, torch.optim.SGD(m.parameters(), lr=0.1), "mixed", "autocast")
    assert r.impl == "autocast"


def test_ddp_paper_masters_follow_rank0(tmp_path):
    """Item 5: 2 gloo ranks that initialise different weights end with the same model: DDP broadcast
    rank 0's FP16 model, and the FP32 masters (copied before wrapping) are broadcast after it."""
    from conftest import REPO, run_gloo_ranks

    run_gloo_ranks(REPO / "tests" / "ddp_paper_worker.py", str(tmp_path), "mixed", "8")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert any(not torch.equal(r0["initial"][k], r1["initial"][k]) for k in r0["initial"])  # not blind
    for k in r0["final"]:
        assert r0["final"][k].dtype == torch.float16
        assert torch.equal(r0["final"][k], r1["final"][k]), k


# ------------------------------------------------------------------------------------------------
# FP16 storage, FP32 math (DeepSpeech 2, section 4.3)


@pytest.mark.parametrize("impl", precisions.IMPLS)
def test_fp16_storage_stores_fp16_and_computes_fp32(impl):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    r = recipe_for(m, opt, "fp16_storage", impl)
    assert r.impl == "paper" and r.loss_scale == 1.0
    assert all(p.dtype == torch.float16 for p in m.parameters())
    assert all(p.dtype == torch.float32 for p in r.master_params())
    seen = {}
    m[0].register_forward_hook(lambda mod, args, out: seen.update(x=args[0], out=out))
    x = torch.randn(5, 16)
    with r.autocast():
        y = m(x)
    assert seen["x"].dtype == seen["out"].dtype == torch.float16  # activations stored in FP16
    w, b = m[0].weight, m[0].bias
    # The layer's output: FP32 arithmetic on the FP16 values, rounded once into FP16 storage.
    expected = nn.functional.linear(x.half().float(), w.float(), b.float()).half()
    assert torch.equal(seen["out"], expected)
    r.backward(nn.functional.cross_entropy(y, torch.tensor([0, 1, 2, 0, 1])))
    assert all(p.grad.dtype == torch.float16 for p in m.parameters())  # gradients stored in FP16
    assert r.step(opt)


def test_fp16_storage_differs_from_fp16_math():
    """A recurrent layer: PyTorch's FP16 kernels (half_math=native) round every gate to FP16; FP16
    storage with FP32 math keeps the cell's arithmetic in FP32 and rounds its output once. Emulated
    FP16 math on the CPU runs a recurrent layer the same way as FP16 storage."""
    def gru_output(prec, half_math="native"):
        torch.manual_seed(0)
        m = nn.GRU(8, 16, batch_first=True)
        ref = copy.deepcopy(m)
        r = recipe_for(m, torch.optim.SGD(m.parameters(), lr=0.1), prec, "paper", half_math=half_math)
        x = torch.randn(4, 12, 8)
        with r.autocast():
            out = m(x)[0]
        ref.load_state_dict({k: v.half().float() for k, v in ref.state_dict().items()})
        return out, ref(x.half().float())[0].half().float()

    out, fp32_math = gru_output("fp16_storage")
    assert torch.equal(out, fp32_math)
    out16, fp32_math = gru_output("fp16")
    assert (out16 != fp32_math).float().mean() > 0.1
    out16, fp32_math = gru_output("fp16", "emulated")
    assert torch.equal(out16, fp32_math)


def test_fp16_storage_loss_scale_and_validation():
    assert precisions.parse_loss_scale("auto", "fp16_storage") is None
    assert precisions.parse_loss_scale("dynamic", "fp16_storage") == "dynamic"
    assert precisions.parse_loss_scale("128", "fp16_storage") == 128.0
    from mpt.config import validate

    validate(cfg_of("fp16_storage", "paper", "dynamic"))


def test_fp32_kept_module_is_its_own_master():
    """A module marked keep_fp32 (the bigLSTM's softmax) keeps FP32 parameters under impl=paper, gets
    FP32 inputs, and needs no second FP32 copy; the checkpoint holds only the separate masters."""
    class Head(nn.Linear):
        keep_fp32 = True

        def forward(self, x):
            self.seen = x.dtype
            return super().forward(x)

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), Head(4, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    r = recipe_for(m, opt, "mixed", "paper", 8)
    assert m[0].weight.dtype == torch.float16 and m[2].weight.dtype == torch.float32
    masters = r.master_params()
    assert masters[4] is m[2].weight and masters[2] is m[1].weight  # no copies of FP32 parameters
    assert masters[0] is not m[0].weight and masters[0].dtype == torch.float32
    x, y = data(n=6)
    step(r, m, opt, x[:, :, 0, :4].mean(1), y)
    assert m[2].seen == torch.float32
    assert len(r.state_dict()["master"][0]) == 2  # the first Linear's weight and bias


def test_fp16_pure_matches_by_hand_ablation():
    """fp16_pure, 20 steps, equals by hand: FP16 weights, forward/backward in FP16, each step an FP32
    copy of the FP16 weights updated by SGD (momentum, Nesterov, weight decay; state FP32) and rounded
    back into FP16."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 3)
    ref_w16 = [p.detach().half() for p in lin.parameters()]
    opt = torch.optim.SGD(lin.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    r = recipe_for(lin, opt, "fp16_pure", "paper")
    work = [torch.zeros(w.shape) for w in ref_w16]
    ref_opt = torch.optim.SGD(work, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        step(r, lin, opt, x, y)
        w16 = [w.clone().requires_grad_() for w in ref_w16]
        nn.functional.cross_entropy(nn.functional.linear(x.half(), w16[0], w16[1]).float(), y).backward()
        with torch.no_grad():
            for wk, w in zip(work, w16):
                wk.copy_(w)
                wk.grad = w.grad.float()
        ref_opt.step()
        ref_w16 = [wk.detach().half() for wk in work]
    for p, w in zip(lin.parameters(), ref_w16):
        assert torch.equal(p.detach(), w)


@pytest.mark.parametrize("row", [p for p in precisions.TABLE if not p.tf32], ids=lambda p: p.name)
def test_each_row_of_the_precision_table_says_what_its_recipe_does(row):
    """mpt/precisions.py against the recipes built from it: what the model is stored in, whether the
    trained weights are FP32, the dtype of an activation, what loss_scale=auto gives."""
    for impl in precisions.IMPLS:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        r = recipe_for(net, opt, row.name, impl)
        paper_way = impl == "paper" or impl not in row.impls  # autocast keeps FP32 parameters
        assert net[0].weight.dtype == getattr(torch, row.storage if paper_way else "float32")
        assert all(w.dtype == torch.float32 for w in r.weights_of(opt)) == row.master
        seen = []
        net[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
        with r.autocast():
            net(torch.randn(2, 4))
        assert seen == [getattr(torch, row.compute if row.half_compute else row.storage)]
        dynamic = Config().scaler.init_scale
        assert r.loss_scale == (dynamic if row.auto_loss_scale == "dynamic" else 1.0)


def test_every_row_names_a_recipe_that_exists():
    """Precision.recipe names one of precisions.RECIPE_KINDS, each of which mpt/precision.py runs; the
    simulated-format precisions and, of those, the block-scaled ones follow from the rows."""
    assert set(precision.RECIPES) | {"impl"} == set(precisions.RECIPE_KINDS)
    assert {p.name: precisions.recipe_of(p.name) for p in precisions.TABLE} == {
        "fp32": "FP32", "tf32": "FP32", "fp16": "impl", "mixed": "impl", "bf16": "impl", "fp16_pure": "NoMasterCopy",
        "fp16_storage": "FP16Storage", "fp8": "formats", "fp8_rowwise": "formats", "fp8_rowwise_gw_hp": "formats",
        "fp8_block": "formats", "mxfp8": "formats", "nvfp4": "formats", "nvfp4_paper": "formats",
        "bf16_pure": "NoMasterCopy"}
    assert precisions.FORMATS == ("fp8", "fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_block", "mxfp8", "nvfp4", "nvfp4_paper")
    assert precisions.BLOCK_SCALED == ("fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_block", "mxfp8", "nvfp4", "nvfp4_paper")


def test_config_and_paper_tables_import_no_torch():
    """The precision table is read where torch may be absent (a laptop making the tables)."""
    import subprocess
    import sys

    from conftest import REPO

    code = ("import sys, mpt.config, mpt.precisions, paper_tables.specs, paper_tables.results; "
            "sys.exit(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def _optim_cfg(name, **kw):
    from mpt.config import OptimCfg

    o = OptimCfg(name=name, lr=0.01, momentum=0.9, weight_decay=5e-4)
    for k, v in kw.items():
        setattr(o, k, v)
    return o


@pytest.mark.parametrize("name,kw", [("sgd", {}), ("sgd", {"nesterov": True}), ("sgd", {"momentum": 0.0}),
                                     ("adam", {}), ("adamw", {}), ("adagrad", {}), ("rmsprop", {}),
                                     ("rmsprop", {"momentum": 0.0})])
def test_optimizers_step_foreach_with_the_per_parameter_loops_bits(name, kw):
    """build_optimizer asks for torch's multi-tensor step everywhere (a CPU would otherwise loop over
    the parameters op by op); its weights and state are those of the per-parameter loop, bit for bit,
    with a parameter left without a gradient on some steps."""
    from mpt.optim import build_optimizer

    def train(foreach):
        torch.manual_seed(0)
        ps = [nn.Parameter(torch.randn(*s)) for s in [(70, 50), (5,), (30, 3, 3, 3), (1111,)]]
        opt = build_optimizer(_optim_cfg(name, **kw), ps)
        assert opt.defaults["foreach"] is True
        for g in opt.param_groups:
            g["foreach"] = foreach
        gen = torch.Generator().manual_seed(1)
        for s in range(8):
            for i, p in enumerate(ps):
                p.grad = None if (i == 1 and s % 3 == 0) else torch.randn(p.shape, generator=gen) * 10.0 ** (s - 4)
            opt.step()
        return ps + [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]

    for a, b in zip(train(True), train(False), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("prec,impl", [("mixed", "paper"), ("fp16_storage", "paper"), ("fp16_pure", "paper"),
                                       ("fp16", "paper")])
def test_kept_fp32_weight_copies_change_no_bit(prec, impl):
    """The paper recipes keep FP32 copies of their FP16 weights for the emulated dot products
    (half_math.FP32Copies): losses, FP16 weights, FP32 masters and momentum equal those of casting at
    every use, after several updates, after a checkpoint load and after a weight written in place."""
    x, y = data()
    runs = []
    for keep in (True, False):
        m = tiny_net()
        m.add_module("head2", nn.Linear(3, 3))
        opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-3)
        r = recipe_for(m, opt, prec, impl, half_math="emulated")
        if not keep:
            r.fp32_copies.keep = False  # the reference: every weight cast at each use
        losses = [step(r, m, opt, x, y)[0] for _ in range(4)]
        if keep:  # the copies were used and follow the updated weights
            assert len(r.fp32_copies.copies) == 6  # conv and both linears, weight and bias
            for ref, _, up in r.fp32_copies.copies.values():
                assert torch.equal(up, ref().float())
        sd = {k: v.clone() for k, v in m.state_dict().items()}
        losses += [step(r, m, opt, x, y)[0] for _ in range(2)]
        m.load_state_dict(sd)  # weights written by a checkpoint load, not by the recipe
        losses.append(step(r, m, opt, x, y)[0])
        with torch.no_grad():
            m[0].weight.mul_(0.5)  # and in place
        losses += [step(r, m, opt, x, y)[0] for _ in range(2)]
        runs.append((losses, [t.clone() for t in list(m.parameters()) + r.master_params()
                              + [s["momentum_buffer"] for s in opt.state.values()]]))
    (la, ta), (lb, tb) = runs
    assert la == lb
    for a, b in zip(ta, tb, strict=True):
        assert torch.equal(a, b)


def test_fp32_copies_follow_their_weights_and_go_with_them():
    """A copy is w.float() at the weight's current version and is dropped with its weight; anything
    but a parameter is cast afresh each time."""
    copies = FP32Copies()
    w = nn.Parameter(torch.randn(4, 3).half())
    up = copies.get(w)
    assert up.dtype == torch.float32 and torch.equal(up, w.float()) and copies.get(w) is up
    with torch.no_grad():
        w.add_(1)
    assert torch.equal(copies.get(w), w.float())  # written in place: cast afresh
    with torch.no_grad():
        w.mul_(2)
    copies.refresh()
    assert torch.equal(copies.copies[id(w)][2], w.float()) and copies.get(w) is copies.copies[id(w)][2]
    x = torch.randn(3).half()
    assert copies.get(x) is not copies.get(x) and len(copies.copies) == 1
    del w
    assert copies.copies == {}
