"""Beyond the paper: precision=fp8 (simulated E4M3/E5M2 with per-tensor scaling) and
precision=bf16_pure (BF16 weights without an FP32 master copy, rounding nearest|stochastic|kahan),
checked against hand-computed values."""
import re

import pytest
import torch
import torch.nn as nn

from toy_gan import run_task
from mpt import config as C
from mpt import config_parse, identity
from mpt import precision, precisions
from mpt.config import Config, FP8Cfg
from mpt.formats import ELEMENTS
from mpt.errors import UserError
from mpt.fp8 import FP8State, fp8_quantize
from mpt.rounding import kahan_round_, stochastic_round

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------------
# FP8 quantisation, by hand


def q(values, fmt, scale=1.0):
    return fp8_quantize(torch.tensor(values, dtype=torch.float32), fmt, scale).tolist()


def test_e4m3_by_hand():
    # E4M3 (bias 7, no infinities): max 1.75 x 2^8 = 448; 464 is the tie between 448 and the
    # would-be 480 (a NaN code) and goes to 448; beyond it saturates, inf included.
    assert q([448.0, 464.0, 1000.0, -1e6, float("inf"), -float("inf")], "e4m3") == [448, 448, 448, -448, 448, -448]
    # subnormals: smallest 2^-9; 2^-10 is the tie with 0 (even), 1.5 x 2^-10 rounds up, 3 x 2^-9 exact
    assert q([2**-9, 2**-10, 1.5 * 2**-10, 3 * 2**-9, 2**-11], "e4m3") == [2**-9, 0, 2**-9, 3 * 2**-9, 0]
    # smallest normal 2^-6; 3 mantissa bits: 0.3 lies between 0.28125 and 0.3125, nearer the latter
    assert q([2**-6, 0.3, 1.0625, 1.1875], "e4m3") == [2**-6, 0.3125, 1.0, 1.25]  # ties to even
    assert torch.isnan(fp8_quantize(torch.tensor([float("nan")]), "e4m3")).all()


def test_e5m2_by_hand():
    # E5M2 (IEEE-like): max 1.75 x 2^15 = 57344; finite values beyond saturate, inf stays inf
    assert q([57344.0, 60000.0, -1e9, float("inf")], "e5m2") == [57344, 57344, -57344, float("inf")]
    # smallest normal 2^-14, smallest subnormal 2^-16; 2^-17 ties to 0
    assert q([2**-14, 2**-16, 2**-17, 1.5 * 2**-17, 3 * 2**-16, 2**-18], "e5m2") == [2**-14, 2**-16, 0, 2**-16,
                                                                                     3 * 2**-16, 0]
    assert q([1.125, 1.375], "e5m2") == [1.0, 1.5]  # 2 mantissa bits, ties to even


def test_per_tensor_scale_keeps_what_the_format_alone_flushes():
    assert q([2**-20], "e5m2") == [0.0]
    assert q([2**-20], "e5m2", scale=2.0**10) == [2**-20]  # stored as 2^-10, divided back
    # 1000 saturates at scale 1; at scale 1/4 it is 250, which rounds to 256 (16 apart in [128, 256))
    assert q([1000.0], "e4m3", scale=0.25) == [1024.0]


# ------------------------------------------------------------------------------------------------
# per-tensor scaling rules


def test_current_scaling_maps_the_amax_to_the_format_max():
    st = FP8State("current")
    x = torch.tensor([0.001, -3.0, 0.5])
    out = st.quantizer("l:x", "e4m3")(x)
    assert out[1].item() == pytest.approx(-3.0, rel=1e-6)  # -3 * 448/3 = -448, exact in E4M3
    assert out[0].item() == pytest.approx(0.001, rel=2**-4)  # a normal at this scale: 3 bits kept
    assert fp8_quantize(x, "e4m3")[0].item() == 2**-9  # unscaled: the smallest subnormal, 95% off
    assert st.quantizer("l:x", "e4m3")(torch.zeros(3)).tolist() == [0, 0, 0]  # amax 0: scale 1


def test_delayed_scaling_history_by_hand():
    """Transformer Engine's DelayedScaling: the scale of an iteration comes from the amax history of
    the iterations before it, reduced by max over amax_history_len entries (or most_recent); it
    starts at 1; an iteration's amax is the largest over every tensor the slot quantised."""
    st, rec = FP8State("delayed", history_len=3, algo="max"), FP8State("delayed", history_len=3, algo="most_recent")

    def iteration(amaxes, state):
        quant = state.quantizer("layer:x", "e4m3")
        outs = [quant(torch.tensor([a, -a / 8])) for a in amaxes]
        state.update()
        return outs, state.scale["layer:x"].item()

    outs, s1 = iteration([1000.0], st)
    assert outs[0][0].item() == 448.0  # scale 1 before any history: 1000 saturates
    assert s1 == pytest.approx(448 / 1000)
    _, s2 = iteration([4.0, 8.0], st)  # two calls in one iteration: their max enters the history
    assert st.history["layer:x"].tolist() == [8.0, 1000.0, 0.0] and s2 == pytest.approx(448 / 1000)
    _, s3 = iteration([1.0], st)
    assert s3 == pytest.approx(448 / 1000)
    _, s4 = iteration([1.0], st)  # 1000 has left the 3-entry window
    assert st.history["layer:x"].tolist() == [1.0, 1.0, 8.0] and s4 == pytest.approx(448 / 8)
    _, s5 = iteration([1.0], st)
    assert s5 == pytest.approx(448.0)
    for amaxes in ([1000.0], [8.0], [1.0]):
        _, s = iteration(amaxes, rec)
    assert s == pytest.approx(448.0)  # most_recent: only the last iteration counts
    # the gradient slot ("g") is E5M2: 57344 / amax; margin m divides by 2^m
    g = FP8State("delayed", history_len=4, margin=2)
    g.quantizer("layer:g", "e5m2")(torch.tensor([2.0]))
    g.update()
    assert g.scale["layer:g"].item() == pytest.approx(57344 / 2 / 4)
    # an iteration that recorded nothing keeps the scale; evaluation (record=False) adds nothing
    g.quantizer("layer:g", "e5m2", record=False)(torch.tensor([1e6]))
    g.update()
    assert g.scale["layer:g"].item() == pytest.approx(57344 / 2 / 4)
    # the state is keyed by names: a load gives the same scales and history
    fresh = FP8State("delayed", history_len=3)
    fresh.load_state_dict(st.state_dict())
    assert fresh.scale["layer:x"].item() == pytest.approx(s5)
    assert torch.equal(fresh.history["layer:x"], st.history["layer:x"])


def test_fp8_linear_forward_and_backward_by_hand():
    """y = q4(x) q4(W)^T + b in FP32; dx = q5(dy) q4(W), dW = q5(dy)^T q4(x), each operand at its
    current scale: what an FP8 GEMM with FP32 accumulation computes."""
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3), nn.Linear(3, 2))  # the middle one is FP8
    c = Config(precision="fp8")
    c.fp8.scaling = "current"
    r = precision.build(c, "cpu")
    r.prepare(lin, [torch.optim.SGD(lin.parameters(), lr=0.1)])
    with r.autocast():
        lin(torch.randn(2, 5))  # the first call finds the ends from the dataflow
    assert [r.state.sites[id(m.weight)][1] for m in lin] == [True, False, True]  # the ends in BF16
    mid = lin[1]
    h = torch.randn(6, 4, requires_grad=True)
    dy = torch.randn(6, 3) * 1e-6  # flushed to zero in E5M2 without its scale
    with r.autocast():
        y = mid(h)
    y.backward(dy)

    def cur(t, fmt):
        return fp8_quantize(t, fmt, ELEMENTS[fmt].max / t.abs().max())

    hq, wq, gq = cur(h.detach(), "e4m3"), cur(mid.weight.detach(), "e4m3"), cur(dy, "e5m2")
    assert not torch.equal(hq, h.detach())  # the test would be blind otherwise
    assert torch.allclose(y, hq @ wq.t() + mid.bias, rtol=1e-6, atol=1e-7)
    assert torch.allclose(h.grad, gq @ wq, rtol=1e-5, atol=1e-14)
    assert torch.allclose(mid.weight.grad, gq.t() @ hq, rtol=1e-5, atol=1e-14)
    assert (fp8_quantize(dy, "e5m2") == 0).all()  # the scale is what keeps these gradients
    # a first/last layer computes on BF16 operands
    x = torch.randn(6, 5)
    with r.autocast():
        y0 = lin[0](x)
    ref = x.to(torch.bfloat16).float() @ lin[0].weight.to(torch.bfloat16).float().t() + lin[0].bias
    assert torch.allclose(y0, ref, rtol=1e-6, atol=1e-7)


def test_fp8_first_last_layer_option_and_skipped_layers():
    import models

    m = models.build("biglstm", vocab_size=60, width=1 / 128, num_sampled=12)
    r = precision.build(Config(precision="fp8"), "cpu")
    r.prepare(m, [torch.optim.SGD(m.parameters(), lr=0.1)])
    m.train()
    with r.autocast():
        m(torch.randint(0, 60, (2, 5)), torch.randint(0, 60, (2, 5)), torch.ones(2, 5, dtype=torch.bool))
    # the embedding (a lookup) and the keep_fp32 softmax are the ends: both LSTMs are FP8
    assert sorted(set(r.state.sites.values())) == [("lstm.0", False), ("lstm.1", False)]
    c = Config(precision="fp8")
    c.fp8.ends = "fp8"
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    r = precision.build(c, "cpu")
    r.prepare(net, [torch.optim.SGD(net.parameters(), lr=0.1)])
    assert [v[1] for v in r.state.sites.values()] == [False, False]


def test_fp8_recurrent_layer_is_quantised():
    torch.manual_seed(0)
    rnn = nn.ModuleDict({"m": nn.LSTM(4, 8)})
    c = Config(precision="fp8")
    c.fp8.ends = "fp8"
    r = precision.build(c, "cpu")
    r.prepare(rnn, [torch.optim.SGD(rnn.parameters(), lr=0.1)])
    r.state.scale.update({"m:x": torch.tensor(64.0), "m:w0": torch.tensor(64.0), "m:w1": torch.tensor(64.0)})
    x = torch.randn(5, 2, 4)
    with r.autocast():
        y, _ = rnn["m"](x)
    ref, _ = rnn["m"](x)
    assert not torch.equal(y, ref) and torch.allclose(y, ref, atol=0.1)
    y.sum().backward()
    assert all(p.grad is not None for p in rnn.parameters())
    # input sequence, both weight matrices (E4M3) and the output sequence's gradient (E5M2) recorded
    assert set(r.state._seen) == {"m:x", "m:w0", "m:w1", "m:g"}


# ------------------------------------------------------------------------------------------------
# rounding without a master copy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_is_unbiased(dtype):
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    x = torch.full((200_000,), 1.0 + ulp / 8)  # below half an ulp of 1: nearest always gives 1
    assert (x.to(dtype) == 1.0).all()
    g = torch.Generator().manual_seed(0)
    r = stochastic_round(x, dtype, g)
    assert r.dtype == dtype and set(r.float().unique().tolist()) == {1.0, 1.0 + ulp}
    p = 1 / 8
    sigma = ulp * (p * (1 - p) / x.numel()) ** 0.5
    assert abs(r.double().mean().item() - (1.0 + ulp / 8)) < 5 * sigma
    y = -x  # negative values round symmetrically
    assert abs(stochastic_round(y, dtype, g).double().mean().item() + 1.0 + ulp / 8) < 5 * sigma
    exact = torch.tensor([1.5, -0.25, 0.0, 3.0])
    assert torch.equal(stochastic_round(exact, dtype, g).float(), exact)
    a = stochastic_round(x[:100], dtype, torch.Generator().manual_seed(7))
    b = stochastic_round(x[:100], dtype, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_kahan_keeps_a_long_sum_of_tiny_updates():
    """10,000 updates of 1e-4 to a BF16 weight of 1.0: each is below half an ulp (2^-8), so round to
    nearest loses every one. Kahan's compensation adds them up to 2.0: exactly (to the final
    rounding) with an FP32 buffer; with the BF16 buffer the recipe keeps (16 bits, so that weight and
    buffer together are no larger than an FP32 master) the buffer's own rounding leaves 2 BF16 ulps
    (2^-5) after 10,000 identical updates."""
    n, u = 10_000, 1e-4
    exact = 1.0 + n * float(torch.tensor(u, dtype=torch.float32))
    w_near = torch.ones(4, dtype=torch.bfloat16)
    w_kahan, comp = torch.ones(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)
    w_sr, g = torch.ones(4, dtype=torch.bfloat16), torch.Generator().manual_seed(0)
    for _ in range(n):
        w_near = (w_near.float() + u).to(torch.bfloat16)
        kahan_round_(w_kahan, w_kahan.float() + u, comp)
        w_sr = stochastic_round(w_sr.float() + u, torch.bfloat16, g)
    assert (w_near == 1.0).all()
    assert (w_kahan.float() - exact).abs().max().item() <= 2.0**-5
    w32, comp32 = torch.ones(4, dtype=torch.bfloat16), torch.zeros(4)
    for _ in range(n):
        kahan_round_(w32, w32.float() + u, comp32)
    assert (w32.float() - exact).abs().max().item() <= 2.0**-7  # half an ulp at 2: exact to rounding
    assert (w_sr.float() - exact).abs().max().item() < 0.1  # unbiased: a random walk around 2


def _pure_weight_after(rounding, steps=2000, lr=1e-4):
    m = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        m.weight.fill_(1.0)
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    r = precision.build(Config(precision="bf16_pure", rounding=rounding, seed=0), "cpu")
    r.prepare(m, [opt])
    for _ in range(steps):
        with r.autocast():
            loss = -m(torch.ones(1, 1)).float().sum()  # d loss / d w = -1: w += lr
        r.backward(loss)
        r.step(opt)
        r.update()
        r.zero_grad()
    assert m.weight.dtype == torch.bfloat16
    return m.weight.float().item(), r


def test_bf16_pure_loses_small_updates_under_nearest_only():
    near, _ = _pure_weight_after("nearest")
    kahan, _ = _pure_weight_after("kahan")
    sr, _ = _pure_weight_after("stochastic")
    assert near == 1.0  # every update (1e-4) is below half an ulp of 1 (2^-8)
    assert abs(kahan - 1.2) <= 2.0**-7
    assert abs(sr - 1.2) < 0.05


def test_rounding_state_is_in_the_recipe_state():
    _, r = _pure_weight_after("stochastic", steps=3)
    sd = r.state_dict()
    _, r2 = _pure_weight_after("stochastic", steps=1)
    assert not torch.equal(r2._gen.get_state(), r._gen.get_state())
    r2.load_state_dict(sd)
    assert torch.equal(r2._gen.get_state(), r._gen.get_state())
    _, rk = _pure_weight_after("kahan", steps=3)
    assert rk.state_dict()["kahan"]["0:0"].dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------
# config: one-line errors, run identity


@pytest.mark.parametrize("kw,msg", [
    (dict(precision="fp32", rounding="stochastic"), "needs precision=fp16_pure or bf16_pure"),
    (dict(precision="bf16_pure", rounding="up"), "unknown rounding 'up'"),
    (dict(precision="fp8", loss_scale="128"), "scales each tensor on its own"),
    (dict(precision="bf16_pure", loss_scale="dynamic"), "loss_scale=dynamic needs"),
    (dict(precision="fp8", fp8={"scaling": "just_in_time"}), "unknown fp8.scaling"),
    (dict(precision="fp8", fp8={"amax_history_len": 0}), "must be >= 1"),
    (dict(precision="mixed", fp8={"scaling": "current"}), "keys do nothing for precision=mixed"),
])
def test_bad_combinations_are_one_line_errors(kw, msg):
    c = Config()
    for k, v in kw.items():
        config_parse.set_key(c, k, v)
    with pytest.raises(UserError, match=msg):
        precisions.check(c)


# Run names of cells as earlier versions of the code named them (each new key -- half_math, rounding,
# fp8.* -- and each key that became a speed setting -- channels_last -- had to leave them unchanged):
# an oracle written down, not recomputed with the implementation's formula. The simulated formats' names
# changed once, on purpose: their ids carry the quantisers' version (mpt.formats.QUANTISERS = 2), so a run of
# the earlier quantisers is another run (fp8 tiny was biglstm-fp8-s0-f5c534479a, current scaling -e54e48d12f).
# Where a tiny profile's recipe changed (DCGAN's evaluations, DeepSpeech 2's English network and its output
# layer's start), the earlier recipe written out as overrides is still the earlier run.
KNOWN_RUN_NAMES = [
    ('ilsvrc_cnns', ['profile=tiny', 'precision=mixed'], 'resnet50_preact-mixed-s0-59f89a97f4'),
    ('ilsvrc_cnns', ['profile=paper', 'model=alexnet', 'precision=fp16'], 'alexnet-fp16-s0-5f09264733'),
    ('dcgan', ['profile=tiny', 'train.eval_every_epochs=4.0'], 'dcgan-fp32-s0-6e4fd6bdcd'),
    ('lm_biglstm', ['profile=tiny', 'precision=fp8'], 'biglstm-fp8-s0-a83bdf8da8'),
    ('lm_biglstm', ['profile=tiny', 'precision=fp8', 'fp8.scaling=current'], 'biglstm-fp8-s0-c001add318'),
    ('wmt_translation', ['profile=tiny', 'precision=bf16_pure', 'rounding=stochastic'], 'nmt_lstm3-bf16_pure-s0-370b1f291c'),
    ('wmt_translation', ['profile=tiny', 'precision=bf16_pure'], 'nmt_lstm3-bf16_pure-s0-c2c3d0ed42'),
    ('deepspeech2', ['profile=tiny', 'model=english', 'precision=fp16_storage', 'width=0.05', 'task.window_ms=10',
                     'task.hop_ms=10', 'train.batch_size=8', 'train.epochs=6', 'train.eval_every_epochs=0.5',
                     'optim.lr=0.03', 'sched.warmup_epochs=0.5',
                     'task.bucket_batches=false', 'task.blank_prior_init=false'], 'english-fp16_storage-s0-3a4fb2915e'),
    ('voc_detection', ['profile=tiny', 'model=ssd300_vgg16', 'precision=mixed', 'loss_scale=8'],
     'ssd300_vgg16-mixed-s0-0e12b59517'),
]


@pytest.mark.parametrize("experiment, overrides, name", KNOWN_RUN_NAMES)
def test_existing_runs_keep_their_names(experiment, overrides, name):
    assert identity.run_name(C.resolve(experiment, overrides + ["task.data_root=/nonexistent"])) == name


def test_new_keys_are_other_runs_and_old_stored_configs_the_same_run():
    """A stored config without rounding and fp8.* (written before they existed) is the same run; other
    values of them are other runs."""
    old = identity.strip_infra(Config(precision="mixed"))
    del old["rounding"], old["fp8"]
    assert identity.config_difference(old, Config(precision="mixed")) is None
    assert len({identity.cell_id(Config(precision="bf16_pure", rounding=r)) for r in precisions.ROUNDINGS}) == 3
    a, b = Config(precision="fp8"), Config(precision="fp8")
    b.fp8.scaling = "current"
    assert identity.cell_id(a) != identity.cell_id(b)
    assert "fp8.scaling" in identity.config_difference(identity.strip_infra(a), b)


# ------------------------------------------------------------------------------------------------
# through the engine: a resume is bit-identical (scales, rounding generator, Kahan buffers)


def _toy(out, **kw):
    from toy_mlp import config

    return config(out, train={"max_steps": 6}, optim={"lr": 0.05}, **kw)


@pytest.mark.heavy
@pytest.mark.parametrize("kw", [dict(precision="bf16_pure", rounding="stochastic"),
                                dict(precision="bf16_pure", rounding="kahan"),
                                dict(precision="fp8", fp8=FP8Cfg(ends="fp8")),
                                # stochastic rounding of the gradients: its generator is in the checkpoint
                                dict(precision="nvfp4", fp8=FP8Cfg(ends="fp8")),
                                dict(precision="nvfp4")])  # the ends found again after the resume
def test_resume_is_bit_identical(tmp_path, monkeypatch, kw):
    from conftest import run_interrupted
    from toy_mlp import ToyMLP

    ref = run_task(_toy(tmp_path / "ref", **kw), ToyMLP)
    assert ref["status"] == "completed"
    s = run_interrupted(monkeypatch, lambda _: run_task(_toy(tmp_path / "cut", **kw), ToyMLP), None, at_step=3)
    assert s["status"] == "interrupted"
    done = run_task(_toy(tmp_path / "cut", **kw), ToyMLP)
    assert done["status"] == "completed"
    ca, cb = (torch.load(tmp_path / d / "toy_mlp" / ref["run_name"] / "checkpoint.pt", weights_only=True)
              for d in ("ref", "cut"))
    assert ca["step"] == cb["step"] == 6
    for k in ca["model"]:
        assert torch.equal(ca["model"][k], cb["model"][k]), k
    flat = lambda sd: {k: v for k, v in torch.utils._pytree.tree_flatten_with_path(sd)[0]}  # noqa: E731
    a, b = flat(ca["recipe"]), flat(cb["recipe"])
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k
    if kw["precision"] == "fp8":
        assert ca["recipe"]["fp8"]["scale"]["0:g"].item() != 1.0  # the delayed scales were in use
    if kw["precision"] == "nvfp4":  # the generator of stochastic rounding was in use where a layer was FP4
        # (with BF16 ends both of the toy's two layers are ends: nothing is FP4)
        assert ("rng" in ca["recipe"]["fp8"]) == ("fp8" in kw)


# ------------------------------------------------------------------------------------------------
# numerics: the new formats' bands, BF16 swamping, forward-value histograms


def test_fp8_bands_by_hand():
    from mpt.bands import FORMATS, format_bands

    e4 = torch.tensor([0.0, 2**-11, 2**-10, 1.5 * 2**-10, 2**-6 - 2**-10, 448.0, 464.0, 465.0, float("inf")])
    assert format_bands(e4, "e4m3") == {"zero": 1, "underflow": 2, "subnormal": 1, "normal": 3, "overflow": 2,
                                        "nonfinite": 1, "total": 9}
    e5 = torch.tensor([2**-17, 2**-16, 2**-14 - 2**-18, 57344.0, 61439.0, 61440.0])
    assert format_bands(e5, "e5m2") == {"zero": 0, "underflow": 1, "subnormal": 1, "normal": 3, "overflow": 1,
                                        "nonfinite": 0, "total": 6}
    # the per-tensor scale moves a tensor into range: 2^-20 underflows E5M2, not at scale 2^10
    assert format_bands(torch.tensor([2**-20]), "e5m2")["underflow"] == 1
    assert format_bands(torch.tensor([2**-20]), "e5m2", scale=2.0**10)["normal"] == 1
    # the bands agree with the casts themselves
    x = torch.logspace(-14, 17, 4001, base=2.0)
    for fmt, over in (("e4m3", x > 464), ("e5m2", x >= 61440)):  # max + half its ulp: ties go down / up
        q = fp8_quantize(x, fmt)
        b = format_bands(x, fmt)
        assert b["underflow"] == int((q == 0).sum())
        assert b["overflow"] == int(over.sum()) > 0
        assert b["subnormal"] == int(((q > 0) & (q < FORMATS[fmt]["min_normal"])).sum())


def test_bf16_swamping_by_hand():
    from mpt.bands import swamping_fraction

    w = torch.ones(5)
    u = torch.tensor([2**-9, 2**-8, -(2**-9), -1.5 * 2**-9, 2**-7])
    s = swamping_fraction([w], [w + u])
    # BF16 (7 bits): half an ulp of 1 is 2^-8 (ties to even keep 1), 2^-9 below it (the gap under 1)
    assert s["swamped_bf16"] == 3 and s["frac_swamped_bf16"] == pytest.approx(3 / 5)
    assert s["swamped"] == 0  # FP16 (10 bits) keeps every one of them


def test_numerics_records_forward_values():
    from mpt.numerics import Numerics

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    num = Numerics(model, every=1)
    num.begin(0)
    (model(torch.randn(16, 4) * 1000).sum()).backward()
    out = num.end(model.named_parameters(), 1.0)
    assert out["numerics/fwd/overall/count"] == 16 * (8 + 8 + 2)
    assert out["numerics/max_abs_fwd"] > 448  # beyond E4M3 unscaled
    assert sum(out["numerics/fwd/0/hist"]) + out["numerics/fwd/0/count"] * out["numerics/fwd/0/frac_zero"] \
        == pytest.approx(16 * 8)
    assert out["numerics/advised_loss_scale"] == out["numerics/advised_loss_scale_act"] or \
        out["numerics/advised_loss_scale"] == out["numerics/advised_loss_scale_weight"]


# ------------------------------------------------------------------------------------------------
# tables and figures: the new precisions are their own columns, labelled beyond the paper


def _tiny_run(root, precision, seed, top1, cfg_extra=None, numerics=()):
    import yaml

    from test_paper_tables import write_run

    d = write_run(root, "ilsvrc_cnns", "resnet50_preact", precision, seed, metrics={"top1": top1},
                  profile="tiny", numerics=numerics, name=f"r-{precision}-{seed}-{abs(hash(str(cfg_extra))) % 1000}")
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    cfg.update(cfg_extra or {})
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    return d


def test_tables_label_the_new_precisions_beyond_the_paper(tmp_path):
    from paper_tables import report, results

    for seed in range(3):
        _tiny_run(tmp_path, "fp32", seed, 97.0 + seed)
        _tiny_run(tmp_path, "fp8", seed, 96.0 + seed, {"fp8": {"scaling": "delayed", "ends": "bf16"}})
        _tiny_run(tmp_path, "fp8", seed, 90.0 + seed, {"fp8": {"scaling": "current", "ends": "fp8"}})
        _tiny_run(tmp_path, "bf16_pure", seed, 80.0 + seed, {"rounding": "kahan"})
        _tiny_run(tmp_path, "bf16_pure", seed, 70.0 + seed, {"rounding": "nearest"})
    runs, problems = results.collect_dir(tmp_path)
    rep = report.build(runs, problems, "test")
    sec = next(s for s in rep.sections if s.profile.startswith("tiny"))
    t = next(t for t in sec.tables if t.spec.id == "table1")
    by_label = {c.label: t.cells[("resnet50_preact", c.id)] for c in t.columns}
    want = {"beyond the paper: FP8, delayed scaling, BF16 first/last layers (fp8_delayed)": 97.0,
            "beyond the paper: FP8, current scaling, every layer (fp8_current_all)": 91.0,
            "beyond the paper: BF16 weights, no master copy, Kahan summation (bf16_pure_kahan)": 81.0,
            "beyond the paper: BF16 weights, no master copy, round to nearest (bf16_pure)": 71.0}
    for label, mean in want.items():
        assert by_label[label].n == 3 and by_label[label].mean == pytest.approx(mean), label
    assert by_label["beyond the paper: FP8, delayed scaling, BF16 first/last layers (fp8_delayed)"].ref is not None


def test_fp8_ranges_figure(tmp_path):
    import numpy as np

    from paper_tables import figures, results, specs

    lo, hi = -40, 16
    e = np.arange(lo, hi + 1)

    def layer(center):
        return np.round(1000 * np.exp(-0.5 * ((e - center) / 2.0) ** 2)).astype(int).tolist()

    line = {"numerics/hist_lo": lo, "numerics/hist_hi": hi, "numerics/loss_scale": 1.0}
    # activations around 2^12 (beyond E4M3's 448) and gradients around 2^-22 (below E5M2's 2^-16)
    for g, center, mx in (("fwd", 12, 2.0**17), ("act", -22, 2.0**-16)):
        line.update({f"numerics/{g}/overall/hist": layer(center), f"numerics/{g}/l1/hist": layer(center),
                     f"numerics/{g}/l1/max_abs": mx})
    _tiny_run(tmp_path, "fp32", 0, 97.0, numerics=[line])
    runs, problems = results.collect_dir(tmp_path)
    spec = next(s for s in specs.FIGURES if s.id == "fp8_ranges")
    f = figures.build_figure(spec, runs, runs[0].profile, problems)
    assert f.missing is None and f.png.startswith(b"\x89PNG"), f.missing
    text = " ".join(f.notes)
    # unscaled: the activations overflow E4M3, the gradients underflow E5M2; scaled: both fit
    m = re.search(r"activations \(forward values\) vs E4M3: as measured \(no scale\): ([\d.]+)% below 2\^-10 "
                  r"\(zero in E4M3\), ([\d.]+)% above 2\^9; with each layer's per-tensor scale: ([\d.]+)% below "
                  r"2\^-10 \(zero in E4M3\), ([\d.]+)% above 2\^9", text)
    assert m and float(m.group(2)) > 90 and float(m.group(4)) == 0.0, text
    m = re.search(r"activation gradients vs E5M2: as measured \(no scale\): ([\d.]+)% below 2\^-17 .*? "
                  r"([\d.]+)% above 2\^16; with each layer's per-tensor scale: ([\d.]+)% below", text)
    assert m and float(m.group(1)) > 50 and float(m.group(3)) < 1, text


def test_task_decode_at_its_default_keeps_the_name_and_gpu_is_another_run():
    """task.decode (the ILSVRC loader's JPEG decoder) came after runs were stored: at cpu, the runs keep
    their names; decode=gpu (other decoder, other pixels within rounding) is another run."""
    base = ["profile=tiny", "precision=mixed", "task.data_root=/nonexistent"]
    name = identity.run_name(C.resolve("ilsvrc_cnns", base))
    assert name == identity.run_name(C.resolve("ilsvrc_cnns", base + ["task.decode=cpu"]))
    assert identity.run_name(C.resolve("ilsvrc_cnns", base + ["task.decode=gpu"])) != name


def test_a_stochastic_recipe_s_id_carries_its_random_draws(monkeypatch):
    """Stochastic rounding's draw (formats.SR_BITS bits a value) is part of what an SR recipe's run computed:
    another draw is another run. Recipes that round to nearest keep their ids."""
    from mpt import formats

    def name(precision):
        return identity.run_name(C.resolve("lm_biglstm", ["profile=tiny", f"precision={precision}",
                                                          "task.data_root=/nonexistent"]))

    before = {p: name(p) for p in ("nvfp4", "nvfp4_paper", "fp8", "mxfp8", "fp8_rowwise")}
    monkeypatch.setattr(formats, "SR_BITS", 8)
    after = {p: name(p) for p in before}
    assert [p for p in before if before[p] != after[p]] == ["nvfp4", "nvfp4_paper"]
