"""mpt.doctor.whatif: what rounding to each format loses, on tensors whose exponents are known, and on the toys
whose answers are known."""
import math

import pytest
import torch

from mpt.doctor.targets import load
from mpt.doctor.whatif import SATURATES, measure, quantize, whatif
from mpt.bands import FORMATS

pytestmark = pytest.mark.usefixtures("one_thread")


def _known(a=300, b=200, c=500):
    """a values of 2^-30, b of 2^-20, c of 1 (signs mixed): an exponent histogram known exactly."""
    t = torch.cat([torch.full((a,), 2.0**-30), torch.full((b,), 2.0**-20), torch.ones(c)])
    return t * torch.where(torch.arange(a + b + c) % 2 == 0, 1.0, -1.0)


@pytest.mark.parametrize("fmt,scale,flushed", [
    ("fp16", 1.0, 300),  # 2^-30 <= 2^-25 rounds to zero; 2^-20 is an FP16 subnormal
    ("fp16", 2.0**8, 0),  # x S: 2^-22 and 2^-12 both kept
    ("bf16", None, 0),  # FP32's exponent range
    ("e4m3", None, 500),  # per tensor: x 448 (amax 1): 2^-30 and 2^-20 land below 2^-10, half E4M3's 2^-9
    ("e5m2", None, 0),  # x 57344: 2^-14.2 and 2^-4.2, above E5M2's 2^-17
])
def test_flushed_share_on_a_known_exponent_histogram(fmt, scale, flushed):
    m = measure(_known(), fmt, scale)
    assert (m["nonzero"], m["flushed"], m["overflow"]) == (1000, flushed, 0), m


def test_overflow_and_saturation_thresholds():
    t = torch.tensor([65519.0, 65520.0, 1e6, 1.0])
    assert measure(t, "fp16")["overflow"] == 2  # 65519 rounds to 65504; 65520 ties away to inf
    q, over = quantize(torch.tensor([460.0, 464.0, 470.0], dtype=torch.float64), "e4m3")
    assert q.tolist() == [448.0, 448.0, 448.0] and over.tolist() == [False, False, True]  # saturates (mpt.fp8)
    assert "e4m3" in SATURATES and math.isinf(quantize(torch.tensor([1e5], dtype=torch.float64), "fp16")[0].item())


def test_rounding_matches_torch_casts():
    """The generic rounding (from the FORMATS row alone) gives what torch's own casts give."""
    x = torch.randn(4096, dtype=torch.float64) * torch.exp2(torch.randint(-30, 12, (4096,)).double())
    for fmt, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("e5m2", torch.float8_e5m2)):
        q, over = quantize(x, fmt)
        ref = x.float().to(dtype).double()  # via FP32: exact for these ranges except double rounding at ties
        keep = ~over
        assert (q[keep] == ref[keep]).float().mean() > 0.999, fmt
    assert set(FORMATS) >= {"fp16", "bf16", "e4m3", "e5m2"}


def test_sqnr_grows_with_mantissa_bits():
    x = torch.randn(10000)
    sq = {f: 10 * math.log10(m["signal"] / m["noise"]) for f in ("fp16", "bf16", "e4m3", "e5m2")
          for m in [measure(x, f)]}
    assert sq["fp16"] > sq["bf16"] > sq["e4m3"] > sq["e5m2"] > 10, sq
    assert abs((sq["fp16"] - sq["bf16"]) - 6.02 * 3) < 2  # 3 mantissa bits apart: ~6 dB each


def test_toys_known_answers():
    """The underflowing toy: fp16 flushes its gradients at S = 1 and keeps them at the sweep's S; the overflow
    toy: fp16 overflows in `big` and nowhere else first, bf16 is fine; formats ranked by what they lose."""
    w = whatif(load("mpt.doctor.examples:underflow"))["formats"]
    assert w["fp16@S=1"]["kinds"]["activation grads"]["flushed"] > 0.95
    assert w["fp16"]["kinds"]["activation grads"]["flushed"] < 1e-3 and w["fp16"]["loss_scale"] >= 2.0**16
    o = whatif(load("mpt.doctor.examples:overflow"))
    f16 = o["formats"]["fp16"]
    assert f16["ranked"][0] == "big" and f16["verdict"].startswith("not as is: big (Linear) overflows (activations")
    assert o["formats"]["bf16"]["verdict"] == "ok" and o["order"][0] == "bf16" and o["order"][-1].startswith("fp16")


# A linear model over features in three units: 5% of them 2^-30 (their weights' gradients flush unless S is
# large), one 2^12 (its gradients overflow at such an S): the S that flushes least overflows the one feature.
SPIKY = """
import torch, torch.nn as nn, torch.nn.functional as F

def patient():
    torch.manual_seed(0)
    unit = torch.ones(1000)
    unit[:50] = 2.0**-30
    unit[-1] = 2.0**12
    batches = [(x * unit, x[:, 100:108].sum(1, keepdim=True)) for x in torch.randn(4, 32, 1000)]
    return nn.Linear(1000, 1), lambda m, b: F.mse_loss(m(b[0]), b[1]), batches
"""


def test_fp16_row_never_picks_a_scale_at_which_gradients_overflow(tmp_path, monkeypatch):
    """An overflowing gradient is inf (a skipped step), whatever share it is: the fp16 row's S (the sweep's best)
    must not overflow a gradient where another S does not -- it picked S = 2^8, overflowing 0.1% of the weight
    gradients to keep the 5% that flush at smaller S."""
    (tmp_path / "spiky_mod.py").write_text(SPIKY)
    monkeypatch.syspath_prepend(str(tmp_path))
    f16 = whatif(load("spiky_mod:patient"))["formats"]["fp16"]
    assert all(f16["kinds"][k]["overflow"] == 0 for k in ("activation grads", "weight grads")), f16["kinds"]
    assert f16["kinds"]["weight grads"]["flushed"] == pytest.approx(0.05, abs=0.001), f16["kinds"]
    assert f16["verdict"].startswith("loses values: flushes 5.0% of root (Linear)'s weight grads at S = 2^"), f16


@pytest.mark.heavy
@pytest.mark.parametrize("toy,kept", [("overflow", ["big (Linear)"]), ("overflow_inside", ["1 (_RMSNorm)"]),
                                      ("healthy", [])])
def test_smallest_keep_wide_set_on_the_toys(tmp_path, capsys, toy, kept):
    """The layer with huge weights, the RMS norm that overflows inside: each the one module to keep in FP32 for
    FP16 to train (the set before it fails the replay, the set with it passes); the healthy toy needs none."""
    from mpt.doctor.__main__ import main

    rep = main([f"mpt.doctor.examples:{toy}", "--keep-wide", "--out", str(tmp_path)])
    kw = rep["keep_wide"]
    assert kw["kept"] == kept, kw
    assert kw["trials"][-1]["ok"] and all(not t["ok"] for t in kw["trials"][:-1]), kw["trials"]
    assert kw["trials"][-1]["progress"] >= 0.8 and kw["trials"][-1]["output_sqnr_db"] >= 20
    said = " ".join(capsys.readouterr().out.split())
    assert (f"keep wide: {', '.join(kept)} (checked by the last replay)" if kept else "nothing to keep wide") in said


def test_keep_wide_precision_is_checked(tmp_path, capsys):
    from mpt.doctor.__main__ import main
    from mpt.errors import cli

    with pytest.raises(SystemExit):
        cli(main)(["mpt.doctor.examples:healthy", "--keep-wide", "fp4", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert err.startswith("error: --keep-wide fp4: choose one of") and err.count("\n") == 1, err


# One Linear layer whose weight holds a single outlier: per-tensor scaling puts every other weight below
# E4M3's range, while a block format loses that one block of its weights.
OUTLIER = """
import torch, torch.nn as nn, torch.nn.functional as F

def patient():
    torch.manual_seed(0)
    m = nn.Linear(256, 4, bias=False)
    with torch.no_grad():
        m.weight.normal_(0, 2.0**-9)
        m.weight[0, 0] = 2.0**12
    batches = [(x, x[:, :4]) for x in torch.randn(2, 8, 256)]
    return m, lambda mod, b: F.mse_loss(mod(b[0]), b[1]), batches
"""


def test_every_simulated_precision_is_a_row_rounded_by_its_recipe(tmp_path, monkeypatch):
    """Each precision of the table that simulates a format has a what-if row, measured through the recipe's
    own quantisers per role: fp8's gradients in E5M2, mxfp8's 32-element blocks; the weights' noise is the
    noise of mpt.fp8.block_quantize on the very weight; weight gradients are not rounded by these recipes."""
    from mpt import formats, precisions
    from mpt.fp8 import block_quantize

    (tmp_path / "outlier_mod.py").write_text(OUTLIER)
    monkeypatch.syspath_prepend(str(tmp_path))
    patient = load("outlier_mod:patient")
    w = whatif(patient)["formats"]
    # every one by default but a preset that rounds x, w and g as an earlier one does (its backward differs, or
    # the layers and steps it keeps in BF16)
    assert set(precisions.FORMATS) - set(w) == {"fp8_rowwise_gw_hp", "nvfp4_paper"}
    w.update(whatif(patient, formats=("fp8_rowwise_gw_hp", "nvfp4_paper"))["formats"])
    assert w["fp8"]["roles"]["activation grads"].startswith("e5m2") and w["fp8"]["roles"]["weights"].startswith("e4m3")
    assert "mx32 blocks" in w["mxfp8"]["roles"]["weights"] and "stochastic" in w["nvfp4"]["roles"]["activation grads"]
    assert "Hadamard-16" in w["nvfp4"]["roles"]["activation grads, weight-gradient product"]  # described, not counted
    assert "high precision" in w["fp8_rowwise_gw_hp"]["roles"]["weight-gradient product"]
    assert all(w[p]["not_rounded"] == ["weight grads"] for p in precisions.FORMATS)

    weight = patient.model.weight.detach().double()
    q = block_quantize(patient.model.weight.detach(), formats.RECIPES["mxfp8"].w, -1).double()
    sqnr = 10 * math.log10(float((weight**2).sum()) / float(((q - weight) ** 2).sum()))
    assert w["mxfp8"]["modules"]["root"]["weights"]["sqnr_db"] == pytest.approx(sqnr, abs=1e-9)

    # The outlier: per tensor, every other weight flushes; in MX blocks, only the outlier's block of 32.
    n = weight.numel()
    assert w["fp8"]["kinds"]["weights"]["flushed"] > 0.99
    assert 0 < w["mxfp8"]["kinds"]["weights"]["flushed"] <= 31 / (n - 1)
    assert w["mxfp8"]["blocks"]["weights"] == {"blocks": n // 32, "blocks_flushing": 1 / (n // 32),
                                              "blocks_emptied": 0.0, "blocks_clipping": 0.0,  # the outlier stays
                                              "spread_over_range": 1 / (n // 32)}
    assert w["fp8"]["verdict"].startswith("loses values: flushes") and w["mxfp8"]["verdict"].startswith("loses values")


def test_keep_wide_takes_every_simulated_precision():
    """--keep-wide ranks by the precision's own what-if row (fp8: its recipe, E5M2 gradients included, not E4M3
    for every role), and a module kept wide is left unquantised by every simulated format's recipe."""
    import torch.nn as nn

    from mpt import precisions
    from mpt.doctor.keep_wide import FORMAT_OF
    from mpt.doctor.replay import keep_modules_wide

    assert all(FORMAT_OF[p] == p for p in precisions.FORMATS)
    for p in precisions.FORMATS:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        for h in keep_modules_wide(model, ["1"], "fp32", "cpu", p):
            h.remove()
        assert getattr(model[1], "keep_fp32", False) and not getattr(model[0], "keep_fp32", False)


# A middle layer whose inputs are ~2^-14 (a fixed scale before it, undone after): under fp8's delayed scaling
# its first step quantises them at scale 1, below E4M3's smallest value, so step 1's output is wrong; once the
# amax history exists (step 2 on) the layer is exact enough.
DELAYED = """
import torch, torch.nn as nn, torch.nn.functional as F


class Scale(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.s = s

    def forward(self, x):
        return x * self.s


def patient():
    torch.manual_seed(0)
    w = torch.randn(16, 1) / 4
    batches = [(x, torch.tanh(x @ w * 2)) for x in torch.randn(8, 32, 16)]
    model = nn.Sequential(nn.Linear(16, 64), Scale(2.0**-14), nn.Linear(64, 64, bias=False), Scale(2.0**14),
                          nn.ReLU(), nn.Linear(64, 1))
    return model, lambda m, b: F.mse_loss(m(b[0]), b[1]), batches
"""


@pytest.mark.heavy
def test_keep_wide_judges_the_output_at_the_trials_last_step(tmp_path, monkeypatch):
    """Under delayed scaling step 1 runs at unit scales: judged there, the toy's middle layer would be kept wide
    for a fault that the recipe's own history removes a step later. At the last step, nothing is kept."""
    from mpt.doctor.__main__ import main
    from mpt.doctor.replay import train
    from mpt.numerics import sqnr_db

    (tmp_path / "delayed_mod.py").write_text(DELAYED)
    monkeypatch.syspath_prepend(str(tmp_path))
    p = load("delayed_mod:patient")
    f32, f8 = train(p, "fp32", numerics=False), train(p, "fp8", numerics=False)
    assert abs(f8["losses"][0] - f32["losses"][0]) > 0.05 * f32["losses"][0]  # step 1: the unit scales lose
    assert sqnr_db(f32["last_output"], f8["last_output"]) >= 20
    kw = main(["delayed_mod:patient", "--keep-wide", "fp8", "--out", str(tmp_path / "out")])["keep_wide"]
    assert kw["kept"] == [] and kw["trials"][0]["output_sqnr_db"] >= 20, kw["trials"]


# Six tanh layers: NVFP4's ~20 dB a layer compounds below 20 dB at the output, the FP8 family's does not.
DEEP = """
import torch, torch.nn as nn, torch.nn.functional as F

def patient():
    torch.manual_seed(0)
    w = torch.randn(16, 1) / 4
    batches = [(x, torch.tanh(x @ w * 2)) for x in torch.randn(8, 32, 16)]
    layers = [nn.Linear(16, 64)]
    for _ in range(5):
        layers += [nn.Tanh(), nn.Linear(64, 64)]
    return nn.Sequential(*layers, nn.Tanh(), nn.Linear(64, 1)), lambda m, b: F.mse_loss(m(b[0]), b[1]), batches
"""


@pytest.mark.heavy
def test_formats_finds_the_narrowest_format_that_trains_as_fp32(tmp_path, monkeypatch, capsys):
    """--formats replays the simulated precisions narrowest first: NVFP4 (4 bits) before the 8-bit ones; on the
    deep toy NVFP4 learns but its output is off (SQNR below 20 dB), so the answer is the first 8-bit one whose
    replay passes, as it is."""
    from mpt.doctor.__main__ import main
    from mpt.doctor.narrowest import bits, order

    assert order()[:2] == ["nvfp4", "nvfp4_paper"] and bits("nvfp4") == bits("nvfp4_paper") == 4
    assert all(bits(n) == 8 for n in order()[2:])
    (tmp_path / "deep_mod.py").write_text(DEEP)
    monkeypatch.syspath_prepend(str(tmp_path))
    n = main(["deep_mod:patient", "--formats", "--out", str(tmp_path / "out")])["narrowest"]
    first, *rest = n["tried"]
    assert first["precision"] == "nvfp4" and not first["ok"] and first["output_sqnr_db"] < 20, first
    assert n["precision"] == rest[-1]["precision"] and rest[-1]["ok"] and n["kept"] == []
    assert [t["precision"] for t in n["tried"]] == order()[:len(n["tried"])]
    assert f"precision={n['precision']} as it is (checked by its replay)" in " ".join(capsys.readouterr().out.split())
