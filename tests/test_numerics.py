"""FP16 numerics instrumentation (mpt/bands.py, mpt/numerics.py): exact band edges, exponent histograms, the
loss-scale advisor, swamping (section 3.1) and sampling a tiny model's gradients (Figure 3)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from mpt import bands as B
from mpt import numerics as N
from mpt.errors import UserError


def below(x: float, dtype=torch.float32) -> float:
    """The largest value of `dtype` below x."""
    return torch.nextafter(torch.tensor(x, dtype=dtype), torch.tensor(0.0, dtype=dtype)).item()


def test_constants():
    assert B.FP16_MIN_SUBNORMAL == torch.finfo(torch.float16).smallest_normal * 2.0**-10 == 2.0**-24
    assert B.FP16_MIN_NORMAL == torch.finfo(torch.float16).smallest_normal == 2.0**-14
    assert B.FP16_MAX == torch.finfo(torch.float16).max == 65504.0


def above(x: float, dtype=torch.float64) -> float:
    return torch.nextafter(torch.tensor(x, dtype=dtype), torch.tensor(math.inf, dtype=dtype)).item()


def test_bands_follow_fp16_rounding_at_the_edges():
    """A value is banded by what FP16's round-to-nearest-even stores for it."""
    f64 = torch.float64
    values = [
        0.0, -0.0,                                                       # zero
        2.0**-30, below(2.0**-25, f64), 2.0**-25, -(2.0**-25),           # underflow: 2^-25 ties to 0
        above(2.0**-25), 1.5 * 2.0**-25, 2.0**-24, below(2.0**-14 - 2.0**-25, f64),  # subnormal
        2.0**-14 - 2.0**-25, 2.0**-14, -1.5, 65504.0, 65519.0, below(65520.0, f64),  # normal
        65520.0, -1e6, math.inf, -math.inf, math.nan,                    # overflow (3 non-finite)
    ]
    bands = B.fp16_bands(torch.tensor(values, dtype=f64))
    assert bands == {"zero": 2, "underflow": 4, "subnormal": 4, "normal": 6, "overflow": 5,
                     "nonfinite": 3, "total": len(values)}
    # The two cases, and the thresholds against torch's own (single) FP32 -> FP16 rounding.
    assert torch.tensor(1.5 * 2.0**-25).half().item() == 2.0**-24 and torch.tensor(65519.0).half().item() == 65504
    g = torch.Generator().manual_seed(0)
    x = torch.exp2(torch.empty(20_000).uniform_(-27, 17, generator=g)).float()
    x = torch.cat([x, torch.tensor([2.0**-25, above(2.0**-25, torch.float32), 2.0**-14 - 2.0**-25,
                                    below(2.0**-14 - 2.0**-25), 65520.0, below(65520.0)])])
    h = x.half().float()
    expected = {"zero": 0, "underflow": int((h == 0).sum()), "subnormal": int(((h > 0) & (h < 2.0**-14)).sum()),
                "normal": int(((h >= 2.0**-14) & torch.isfinite(h)).sum()), "overflow": int(torch.isinf(h).sum()),
                "nonfinite": 0, "total": x.numel()}
    assert B.fp16_bands(x) == expected
    # FP16 input: the representable edges themselves.
    h = torch.tensor([2.0**-24, 2.0**-14, below(2.0**-14, torch.float16), 65504.0, math.inf], dtype=torch.float16)
    assert B.fp16_bands(h) == {"zero": 0, "underflow": 0, "subnormal": 2, "normal": 2, "overflow": 1,
                               "nonfinite": 1, "total": 5}


def test_scale_moves_bands_without_underflowing_the_measurement():
    t = torch.tensor([2.0**-26])
    assert B.fp16_bands(t, scale=1)["underflow"] == 1
    assert B.fp16_bands(t, scale=4)["subnormal"] == 1  # 2^-24
    assert B.fp16_bands(t, scale=2**12)["normal"] == 1  # 2^-14
    assert B.fp16_bands(torch.tensor([1.0]), scale=2**16)["overflow"] == 1  # 65536 > 65504
    # An FP32 subnormal times a small scale would vanish in FP32; FP64 keeps it non-zero.
    assert B.fp16_bands(torch.tensor([2.0**-140]), scale=2.0**-20)["underflow"] == 1
    with pytest.raises(ValueError):
        B.fp16_bands(t, scale=0)


def test_exponent_histogram_known_tensor():
    values = [1.0, 1.5, -0.75, 2.0**-24, 3 * 2.0**-25, below(2.0**-24), 65504.0,
              2.0**-45, 2.0**20, 0.0, math.inf, math.nan]
    hist = B.exponent_histogram(torch.tensor(values), lo=-40, hi=16)
    assert hist.dtype == torch.int64 and hist.shape == (57,)
    expected = torch.zeros(57, dtype=torch.int64)
    for exponent, n in {0: 2, -1: 1, -24: 2, -25: 1, 15: 1, -40: 1, 16: 1}.items():
        expected[exponent + 40] = n
    assert torch.equal(hist, expected)
    assert hist.sum() == 9  # the non-zero finite values
    # Same values stored in FP16 / FP64 bin identically where representable.
    h = torch.tensor([1.0, 2.0**-24, 2.0**-14, 65504.0, 0.0], dtype=torch.float16)
    assert B.exponent_histogram(h, lo=-30, hi=20).nonzero().flatten().tolist() == [-24 + 30, -14 + 30, 0 + 30, 15 + 30]
    assert B.exponent_histogram(torch.tensor([2.0**-1074], dtype=torch.float64), lo=-1074, hi=0)[0] == 1


@pytest.mark.parametrize(
    "max_abs, margin, expected",
    [
        (1.0, 2.0, 2.0**14),  # 16384 * 2 < 65504 <= 32768 * 2
        (2.0**-5, 2.0, 2.0**19),
        (65504 / 32768, 1.0, 2.0**14),  # S = 2^15 gives exactly 65504: not strictly below
        (0.1, 1.0, 2.0**19),
        (65504.0, 1.0, 0.5),  # even S = 1 overflows: advise scaling down
        (1e-30, 2.0, 2.0**24),  # capped at max_scale
        (0.0, 2.0, 2.0**24),
    ],
)
def test_advise_loss_scale(max_abs, margin, expected):
    s = B.advise_loss_scale(max_abs, margin)
    assert s == expected
    if 0 < max_abs and s < 2.0**24:
        assert s * max_abs * margin < 65504 <= 2 * s * max_abs * margin


def test_advise_loss_scale_nonfinite_and_cap():
    assert B.advise_loss_scale(math.inf) is None
    assert B.advise_loss_scale(math.nan) is None
    assert B.advise_loss_scale(1e-30, max_scale=1024) == 1024
    with pytest.raises(ValueError):
        B.advise_loss_scale(-1.0)


def test_swamping_fraction():
    f64 = torch.float64  # 5 + 2^-30 needs FP64 master weights to be representable
    before = [torch.tensor([4096.0, 1024.0]), torch.tensor([[1.0, 5.0]], dtype=f64)]
    after = [torch.tensor([4097.0, 1025.0]), torch.tensor([[1.0, 5.0 + 2.0**-30]], dtype=f64)]
    s = B.swamping_fraction(before, after)
    # 4096 + 1: 1 < 2^-11 * 4096 = 2, and FP16 rounds 4097 to 4096 (ulp 4): lost;
    # 1024 + 1 = 1025 kept; 5 + 2^-30 lost.
    assert s["total"] == 4 and s["changed"] == 3 and s["swamped"] == 2 and s["swamped_2048"] == 2
    assert s["frac_swamped"] == pytest.approx(2 / 3) and s["frac_swamped_all"] == pytest.approx(2 / 4)
    assert s["update_underflow"] == 1  # 2^-30 rounds to zero in FP16
    assert s["swamped_measured"] is False
    empty = B.swamping_fraction([torch.ones(3)], [torch.ones(3)])
    assert empty["changed"] == 0 and empty["frac_swamped"] == 0.0
    with pytest.raises(ValueError):
        B.swamping_fraction([torch.ones(3)], [])


def test_swamping_exact_count_is_the_headline_2048_rule_overcounts():
    """The exact loss (half an ulp of w, ties to even) against the paper's 2^-11 |w|
    rule, on random pairs; and at the edges of one weight."""
    g = torch.Generator().manual_seed(0)
    w = (torch.rand(100_000, generator=g) + 0.5).half().float()  # FP16 weights in [0.5, 1.5]
    u = w * torch.exp2(torch.empty_like(w).uniform_(-13, -10, generator=g)) * (torch.randint(0, 2, w.shape, generator=g) * 2 - 1)
    s = B.swamping_fraction([w], [w + u])
    actual = int(((w + u).half() == w.half()).sum())  # what FP16 addition does (FP32 sum, one rounding)
    assert s["swamped"] == actual
    assert s["swamped_2048"] > 1.2 * s["swamped"]  # the rule counts updates FP16 keeps
    # w = 1: the neighbour above is 2^-10 away, below 2^-11. Up: 2^-11 ties back to 1 (even), more
    # moves; down: 2^-12 ties back, 1.5 x 2^-12 moves -- though the 2^-11 rule calls it lost.
    cases = {2.0**-11: (True, False), 2.0**-11 + 2.0**-30: (False, False), -(2.0**-12): (True, True),
             -1.5 * 2.0**-12: (False, True)}
    for up, (lost, rule) in cases.items():
        one = torch.ones(1, dtype=torch.float64)
        s = B.swamping_fraction([one], [one + up])
        assert (s["changed"], s["swamped"], s["swamped_2048"]) == (1, int(lost), int(rule)), up
    # Measured: given the weights received, the loss is read from them.
    before, intended, received = torch.tensor([1.0, 1.0]), torch.tensor([1.0 + 2.0**-12, 1.5]), torch.tensor([1.0, 1.5])
    m = B.swamping_fraction([before], [intended], [received])
    assert m["swamped_measured"] is True and m["changed"] == 2 and m["swamped"] == 1


def test_first_nonfinite():
    ok = torch.ones(3)
    assert B.first_nonfinite([("a", ok), ("b", None), ("c", torch.tensor([1.0, math.nan])),
                              ("d", torch.tensor([math.inf]))]) == "c"
    assert B.first_nonfinite([("a", ok), ("b", None)]) is None
    model = nn.Linear(2, 2)
    model.weight.grad = torch.zeros(2, 2)
    model.bias.grad = torch.tensor([0.0, -math.inf])
    assert B.first_nonfinite(model.named_parameters()) == "bias"


def _mlp(inplace: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(inplace=inplace), nn.Linear(3, 2))


def _sample(model: nn.Module, scale: float, begin_scale=None) -> dict:
    num = N.Numerics(model, every=2)
    assert num.should_sample(4) and not num.should_sample(3)
    num.begin(4, loss_scale=begin_scale)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    (model(x).sum() * scale).backward()
    stats = num.end(model.named_parameters(), scale)
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
    return stats


@pytest.mark.parametrize("inplace", [False, True])
def test_numerics_records_activation_and_weight_gradients(inplace):
    model = _mlp(inplace)
    stats = _sample(model, scale=8.0)
    assert "numerics/error" not in stats
    json.dumps(stats, allow_nan=False)  # ready for metrics.jsonl
    assert stats["numerics/hist_lo"] == B.HIST_LO == -64 and stats["numerics/hist_hi"] == B.HIST_HI == 16
    assert stats["numerics/loss_scale"] == 8.0
    # Activation gradients: outputs of 0 (5x3), 1 (5x3), 2 (5x2).
    for name, n in {"0": 15, "1": 15, "2": 10, "overall": 40}.items():
        key = f"numerics/act/{name}/"
        assert stats[key + "count"] == n
        zeros = round(stats[key + "frac_zero"] * n)
        assert sum(stats[key + "hist"]) == n - zeros - stats[key + "nonfinite"]
        assert sum(stats[key + f"frac_{b}"] for b in B.BANDS) == pytest.approx(1.0)
    # d(sum)/d(output) = 1: stored as 8, histogrammed as the true gradient (exponent 0).
    assert stats["numerics/act/2/hist"][0 - B.HIST_LO] == 10 and stats["numerics/act/2/max_abs"] == 1.0
    # Weight gradients per layer equal a direct measurement of .grad / S.
    for layer in ("0", "2"):
        grads = [p.grad / 8.0 for n, p in model.named_parameters() if n.startswith(layer + ".")]
        direct = sum(B.exponent_histogram(g) for g in grads)
        assert stats[f"numerics/weight/{layer}/hist"] == direct.tolist()
        assert stats[f"numerics/weight/{layer}/count"] == sum(g.numel() for g in grads)
    assert stats["numerics/weight/overall/count"] == sum(p.numel() for p in model.parameters())
    wmax = max(p.grad.abs().max().item() for p in model.parameters()) / 8.0
    assert stats["numerics/max_abs_weight_grad"] == pytest.approx(wmax)
    assert stats["numerics/max_abs_act_grad"] == 1.0
    assert stats["numerics/advised_loss_scale_act"] == 2.0**14
    assert stats["numerics/advised_loss_scale"] == min(
        stats["numerics/advised_loss_scale_act"], stats["numerics/advised_loss_scale_weight"])


def test_inplace_relu_gives_same_numbers_and_begin_scale_is_equivalent():
    a = _sample(_mlp(False), scale=8.0)
    b = _sample(_mlp(True), scale=8.0)
    c = _sample(_mlp(True), scale=8.0, begin_scale=8.0)
    assert a == b == c


class _ResidualBlock(nn.Module):
    """The in-place patterns of torchvision's ResNet: `out += identity` on BatchNorm's output and
    ReLU(inplace=True). A full backward hook on the BatchNorm would raise in this forward pass."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(2)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.bn(self.conv(x))
        out += x
        return self.relu(out)


def test_inplace_residual_block_and_fp16_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(inplace=True), _ResidualBlock(), nn.Flatten(),
                          nn.Linear(2 * 4 * 4, 3))
    num = N.Numerics(model, every=1)
    num.begin(0)
    (model(torch.randn(2, 1, 4, 4)).square().sum() * 128).backward()
    stats = num.end(model.named_parameters(), 128)
    assert "numerics/error" not in stats
    assert {"numerics/act/2.bn/count", "numerics/act/2.relu/count", "numerics/weight/2.conv/count"} <= set(stats)
    assert stats["numerics/act/2.bn/count"] == 2 * 2 * 4 * 4
    # An FP16 model: its stored gradients are FP16 at S; histograms show them divided by S.
    torch.manual_seed(0)
    half = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 1)).half()
    num = N.Numerics(half, every=1)
    num.begin(0)
    (half(torch.randn(4, 8).half()).float().sum() * 2.0**10).backward()
    stats = num.end(half.named_parameters(), 2.0**10)
    assert stats["numerics/act/2/hist"][0 - B.HIST_LO] == 4 and stats["numerics/act/2/frac_normal"] == 1.0
    assert stats["numerics/weight/overall/nonfinite"] == 0
    # S = 2^20 overflows FP16 (2^20 > 65504): every stored output gradient is inf.
    num.begin(1)
    half.zero_grad()
    (half(torch.randn(4, 8).half()).float().sum() * 2.0**20).backward()
    stats = num.end(half.named_parameters(), 2.0**20)
    assert stats["numerics/act/2/frac_overflow"] == 1.0 and stats["numerics/advised_loss_scale"] is None


def test_bands_are_taken_at_the_loss_scale():
    model = nn.Linear(3, 1, bias=False)
    num = N.Numerics(model, every=1)
    num.begin(0)
    (model(torch.ones(1, 3)) * 2.0**-26).sum().backward()  # tiny true output gradient 2^-26
    stats = num.end(model.named_parameters(), 1.0)
    assert stats["numerics/act/root/frac_underflow"] == 1.0  # root = the model itself
    num.begin(1)
    model.zero_grad()
    (model(torch.ones(1, 3)) * 2.0**-26 * 2.0**12).sum().backward()  # same loss, scaled by S = 2^12
    stats = num.end(model.named_parameters(), 2.0**12)
    assert stats["numerics/act/root/frac_normal"] == 1.0
    assert stats["numerics/act/root/hist"][-26 - B.HIST_LO] == 1  # histogram still of the true value


def test_overflow_makes_advice_none():
    model = nn.Linear(2, 2)
    num = N.Numerics(model, every=1)
    model.weight.grad = torch.tensor([[math.inf, 1.0], [0.0, 0.0]])
    stats = num.end(model.named_parameters(), 1.0)  # no begin: weight numbers only
    assert "numerics/act/overall/count" not in stats
    assert stats["numerics/weight/root/nonfinite"] == 1
    assert stats["numerics/advised_loss_scale_weight"] is None and stats["numerics/advised_loss_scale"] is None
    assert stats["numerics/max_abs_weight_grad"] == 1.0
    json.dumps(stats, allow_nan=False)


def test_every_zero_costs_nothing():
    model = _mlp(True)
    num = N.Numerics(model, every=0)
    assert not any(num.should_sample(s) for s in range(10))
    num.begin(0)
    model(torch.randn(2, 4)).sum().backward()
    assert num.end(model.named_parameters(), 1.0) == {}
    assert num.swamping([torch.ones(1)], [torch.ones(1)]) == {}
    for m in model.modules():
        assert not m._forward_hooks and not m._backward_hooks and not m._forward_pre_hooks
    with pytest.raises(UserError):
        N.Numerics(model, every=-1)


def test_tuple_outputs_and_swamping_keys():
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4, batch_first=True)
    num = N.Numerics(lstm, every=1)
    num.begin(0)
    out, (h, c) = lstm(torch.randn(2, 5, 3))
    out.sum().backward()  # h and c get no gradient: their hooks never fire
    stats = num.end(lstm.named_parameters(), 1.0)
    assert "numerics/error" not in stats
    assert stats["numerics/act/root/count"] == out.numel()
    before = [p.detach().clone() for p in lstm.parameters()]
    with torch.no_grad():
        for p in lstm.parameters():
            p.sub_(1e-9 * p.grad)
    swamp = num.swamping(before, [p.detach() for p in lstm.parameters()])
    assert set(swamp) >= {"numerics/swamp/frac_swamped", "numerics/swamp/frac_swamped_all"}
    assert swamp["numerics/swamp/frac_swamped"] > 0.5  # 1e-9 * grad is far below 2^-11 * weight


def test_failures_never_raise():
    model = nn.Linear(2, 2)
    num = N.Numerics(model, every=1)
    num.begin(0)
    model(torch.ones(1, 2)).sum().backward()
    with pytest.warns(UserWarning):
        stats = num.end(model.named_parameters(), math.nan)  # a broken loss scale
    assert "numerics/error" in stats
    assert not model._forward_hooks
    with pytest.warns(UserWarning):
        assert "numerics/swamp/error" in num.swamping([torch.ones(2)], [torch.ones(3)])


def test_histogram_range_default_and_validation():
    """The range is a config key whose default covers Figure 3's axis (2^-60 and below)."""
    from mpt.config import Config, validate

    c = Config()
    assert (c.numerics.hist_lo, c.numerics.hist_hi) == (B.HIST_LO, B.HIST_HI) and B.HIST_LO <= -60
    c.numerics.hist_lo = 20
    with pytest.raises(UserError, match="numerics.hist_lo=20 must be <="):
        validate(c)
