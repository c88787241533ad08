"""The simulated low-precision formats (mpt.fp8, mpt.formats): per-tensor FP8's edge cases, the model ends
kept in BF16, the block-scaled formats against hand-worked values from their papers and specifications,
and the recipes end to end."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn as nn

import models
from mpt import formats, fp8, precision
from mpt.config import Config
from mpt.errors import UserError
from mpt.formats import ELEMENTS
from mpt.fp8 import FP8State, block_quantize, round_to
from mpt.numerics import sqnr_db

# ------------------------------------------------------------------------------------------------
# per-tensor FP8: scales of tiny tensors


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_a_tensor_of_tiny_values_is_not_made_nan(scaling):
    """FP8_MAX / amax overflows FP32 for amax below ~1e-34; an inf scale made 0 * inf = NaN of every
    element. The scale is capped at the largest finite FP32 (Transformer Engine's choice)."""
    st = FP8State(scaling, history_len=2)
    x = torch.tensor([0.0, 1e-36, -3e-37])
    q = st.quantizer("layer:g", "e5m2")
    q(x)
    st.update()  # delayed: the scale now comes from amax 1e-36
    y = q(x)
    assert torch.isfinite(y).all()
    assert y[0] == 0 and y[1] > 0 and y[2] < 0
    assert y[1].item() == pytest.approx(1e-36, rel=0.25)  # E5M2 keeps 2 mantissa bits
    if scaling == "delayed":
        assert st.scale["layer:g"].item() == torch.finfo(torch.float32).max


# ------------------------------------------------------------------------------------------------
# the ends kept in BF16, from the model's dataflow


def _bf16_layers(model, *inputs, train=True):
    r = precision.build(Config(precision="fp8"), "cpu")
    r.prepare(model, [torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)])
    model.train(train)
    with r.autocast():
        model(*inputs)
    return sorted(name for name, bf16 in r.state.sites.values() if bf16)


def _detection_batch(size=64):
    torch.manual_seed(0)
    images = [torch.rand(3, size, size) for _ in range(2)]
    targets = [{"boxes": torch.tensor([[4.0, 6.0, 40.0, 50.0]]), "labels": torch.tensor([3])} for _ in range(2)]
    return images, targets


def test_ssd_keeps_every_prediction_convolution_in_bf16():
    """SSD's prediction convolutions (a class and a box convolution per feature map: 12 at 300 px, 8 at
    64 px) all produce the model's outputs: all are its last layers, and VGG's conv1_1 its first.
    Registration order kept one of them."""
    torch.manual_seed(0)
    ssd = models.build("ssd300_vgg16", width=1 / 16, size=64)
    ends = _bf16_layers(ssd, *_detection_batch())
    preds = sorted(f"head.{n}" for n, m in ssd.head.named_modules() if isinstance(m, nn.Conv2d))
    assert len(preds) == 8
    assert ends == ["backbone.vgg.0"] + preds


def test_faster_rcnn_keeps_both_heads_predictions_in_bf16_and_frozen_layers_are_still_upstream():
    """The RPN's objectness and box convolutions and the RoI head's classifier and box regressor are
    the last layers (registration order kept bbox_pred alone); conv1_1 is the first. With conv1_1 ..
    conv2_2 frozen their outputs carry no autograd graph, and conv3_1 must still not count as a first
    layer."""
    torch.manual_seed(0)
    frcnn = models.build("faster_rcnn_vgg16", width=1 / 16, size=64, freeze="conv2_2")
    ends = _bf16_layers(frcnn, *_detection_batch())
    assert ends == ["backbone.body.0", "roi_heads.box_predictor.head.bbox_pred",
                    "roi_heads.box_predictor.head.cls_score", "rpn.head.head.bbox_pred", "rpn.head.head.cls_logits"]


def test_the_probe_forward_leaves_no_trace():
    """find_ends runs the model once more at its first call: batch-norm statistics, the output and the
    random stream afterwards are those of the same call without the probe."""
    import copy

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    plain = copy.deepcopy(net)
    x = torch.randn(16, 4)
    st = FP8State("current")
    st.register(net, "bf16")
    torch.manual_seed(1)
    y = net(x)  # the pre-hook probes first
    after = torch.rand(3)
    torch.manual_seed(1)
    y_plain = plain(x)
    assert torch.equal(y, y_plain) and torch.equal(torch.rand(3), after)
    assert all(torch.equal(a, b) for a, b in zip(net.buffers(), plain.buffers()))
    assert sorted(n for n, bf16 in st.sites.values() if bf16) == ["0", "3"]


class _HeadFirst(nn.Module):
    """A classifier registered before the layers that feed it: registration order's "first and last"
    (head, mid) are not the dataflow's (body, head)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 2)
        self.body = nn.Linear(4, 8)
        self.mid = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(torch.relu(self.mid(torch.relu(self.body(x)))))


def _resumed(net, sd):
    st = FP8State("current")
    st.register(net, "bf16")
    st.load_state_dict(sd)
    return st


def test_a_resume_that_would_keep_other_layers_in_bf16_is_refused():
    """The checkpoint records the layers its steps kept in BF16; a resume whose code keeps others (a
    checkpoint written when registration order chose them) stops in one line instead of mixing two
    recipes in one run. Where both rules agree (a plain stack) the old checkpoint resumes."""
    from mpt.errors import UserError

    torch.manual_seed(0)
    net, x = _HeadFirst(), torch.randn(2, 4)
    st = FP8State("current")
    st.register(net, "bf16")
    net(x)
    sd = st.state_dict()
    assert sd["ends"] == ["body", "head"]
    _resumed(net, sd)  # the same ends: fine
    net(x)
    old = {k: v for k, v in sd.items() if k != "ends"}  # written before the ends were recorded
    _resumed(net, old)
    with pytest.raises(UserError, match=r"kept \['head', 'mid'\] in BF16 .* keeps \['body', 'head'\]"):
        net(x)
    stack = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    _resumed(stack, old)
    stack(x)  # registration order's ends are the dataflow's: the old checkpoint resumes


# ------------------------------------------------------------------------------------------------
# element rounding and the block formats by hand: the OCP MX specification's and the papers'
# definitions worked out here (an oracle independent of torchao)

E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP MX spec v1.0, section 5.3.3


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "fp16", "bf16"])
def test_rounding_by_spacing_is_torchs_cast(fmt):
    """The arithmetic that rounds E2M1 and every stochastic rounding, checked on the formats torch casts
    to: every code's neighbourhood, the ties between codes, subnormals and saturation."""
    from mpt.fp8 import round_by_spacing

    dtype = getattr(torch, ELEMENTS[fmt].torch_dtype)
    torch.manual_seed(0)
    x = torch.cat([torch.randn(20000) * 10.0 ** torch.randint(-8, 5, (20000,)).float(),
                   torch.linspace(-1, 1, 5001) * min(ELEMENTS[fmt].max * 1.5, 3e38)])
    if fmt in ("e4m3", "e5m2"):  # exact ties: the midpoints of neighbouring codes
        codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        codes = codes[torch.isfinite(codes)].unique()
        x = torch.cat([x, codes, (codes[1:] + codes[:-1]) / 2])
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])])
    top = ELEMENTS[fmt].max
    cast = x.clamp(-top, top).to(dtype).float()
    for ours in (round_by_spacing(x, fmt), round_to(x, fmt)):
        same = (ours == cast) & (torch.signbit(ours) == torch.signbit(cast))
        assert (same | (ours.isnan() & cast.isnan())).all()


def test_e2m1_by_hand():
    """Round to nearest even on E2M1's grid, saturating at 6: 0.25 -> 0 and 0.75 -> 1 (ties to the even
    code), 2.5 -> 2, 5 -> 4, 7 -> 6."""
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.3, -2.9, 0.0])
    assert round_to(x, "e2m1").tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.5, -3.0, 0.0]
    grid = torch.tensor(E2M1_GRID)
    assert torch.equal(round_to(grid, "e2m1"), grid)


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_stochastic_rounding_is_unbiased_and_stays_on_the_grid(fmt):
    g = torch.Generator().manual_seed(0)
    x = torch.full((200000,), 2.4)
    q = round_to(x, fmt, g)
    assert set(q.unique().tolist()) == ({2.0, 3.0} if fmt == "e2m1" else {2.25, 2.5})  # E4M3's spacing in [2, 4): 1/4
    assert q.mean().item() == pytest.approx(2.4, abs=2e-3)


def _fmt(element="e4m3", granularity="mx32", scale_rounding="rceil"):
    return formats.TensorFormat(element, granularity, scale_rounding)


def test_mx_floor_overflows_where_rceil_does_not():
    """OCP MX (arXiv 2310.10537, section 6.3): shared exponent floor(log2 amax) - emax(E4M3) =
    floor(log2 1000) - 8 = 1, so X = 2 and 1000 / 2 = 500 is past E4M3's 448: clipped, 896 comes back.
    RCEIL (arXiv 2506.08027): X = 2^ceil(log2(1000 / 448)) = 4, 250 rounds to 256 (E4M3 spacing 16 in
    [128, 256)), 1024 comes back. The block's small values: 1.3 / 2 = 0.65 -> 0.625 (spacing 1/16 in
    [0.5, 1)): 1.25; 1.3 / 4 = 0.325 -> 0.3125 (spacing 1/32 in [0.25, 0.5)): 1.25."""
    x = torch.zeros(32)
    x[0], x[1], x[5] = 1000.0, 1.3, -3.0
    floor = block_quantize(x, _fmt(scale_rounding="floor"))
    rceil = block_quantize(x, _fmt())
    assert floor[[0, 1, 5]].tolist() == [896.0, 1.25, -3.0]
    assert rceil[[0, 1, 5]].tolist() == [1024.0, 1.25, -3.0]
    assert (floor[2:5] == 0).all() and (rceil[2:5] == 0).all()


def _scale_by_frexp(amax: torch.Tensor, fmt: str, rounding: str) -> torch.Tensor:
    """block_scale's power-of-2 scales as the definitions read, through frexp and ldexp."""
    top = ELEMENTS[fmt].max
    pow2 = lambda e: torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)  # noqa: E731
    if rounding == "pow2":
        s = pow2(torch.frexp((torch.full_like(amax, top) / amax).clamp(max=torch.finfo(torch.float32).max))[1] - 1)
    elif rounding == "floor":
        s = pow2(-((torch.frexp(amax)[1] - 1) - (int(torch.frexp(torch.tensor(top))[1]) - 1)).clamp(-127, 127))
    else:
        mant, e = torch.frexp(amax / top)
        s = pow2(-torch.where(mant == 0.5, e - 1, e).clamp(-127, 127))
    s = s.clamp(min=fp8._least_scale(fmt, rounding))
    return torch.where(amax > 0, s, torch.ones_like(s)).masked_fill(~torch.isfinite(amax), math.nan)


@pytest.mark.parametrize("rounding", ["pow2", "floor", "rceil"])
def test_power_of_two_scales_are_frexps_bit_for_bit(rounding):
    """block_scale reads a power-of-2 scale's exponent from the FP32 bits (one pass over the scales, not frexp's
    several): the same scales as frexp and ldexp give at every exponent -- subnormal amaxes, quotients that underflow
    to subnormals or 0, exact powers of 2 and their neighbours, FLT_MAX, 0, inf and NaN."""
    g = torch.Generator().manual_seed(0)
    e = torch.arange(-149, 128)
    amax = torch.cat([torch.ldexp(1 + torch.rand(len(e) * 50, generator=g), e.repeat_interleave(50)),
                      *[torch.ldexp(torch.full((len(e),), top), e) for top in (1.0, 448.0, 57344.0, 6.0)],
                      torch.tensor([0.0, math.inf, math.nan, torch.finfo(torch.float32).max, 2.0 ** -149])])
    amax = torch.cat([amax, torch.nextafter(amax, torch.tensor(math.inf)), torch.nextafter(amax, torch.tensor(0.0))])
    amax = amax[~torch.isinf(amax) | (amax == math.inf)].abs()
    for fmt in ("e4m3", "e5m2", "e2m1"):
        ours, ref = fp8.block_scale(amax.clone(), fmt, rounding), _scale_by_frexp(amax, fmt, rounding)
        assert torch.equal(ours.view(torch.int32), ref.view(torch.int32)), fmt


def test_mx_blocks_are_32_along_the_reduction_axis_and_scales_are_e8m0():
    """Each 32-element block has its own power-of-2 scale: a block of tiny values next to a block of
    large ones keeps its precision; the E8M0 range clamps the exponent at -127 (a block of 1e-40 values:
    2^127 * 1e-40 ~ 1.7e-2, so E4M3's subnormals keep a few of its bits)."""
    x = torch.cat([torch.full((32,), 1000.0), torch.full((32,), 3e-4), torch.full((32,), 1e-40)])
    q = block_quantize(x, _fmt())
    assert q[:32].unique().tolist() == [1024.0]
    assert q[32:64].unique().item() == pytest.approx(3e-4, rel=2 ** -4)
    assert q[64:].unique().item() == pytest.approx(1e-40, rel=0.2)
    # along dim 1 of a [O, C, kh, kw] convolution weight: blocks run over input channels
    w = torch.zeros(2, 64, 1, 1)
    w[0, :32], w[0, 32:] = 1000.0, 3e-4
    assert torch.equal(block_quantize(w, _fmt(), axis=1)[0, :, 0, 0], q[:64])


def test_deepseek_blocks_by_hand():
    """arXiv 2412.19437: a 1x128 tile's scale is 448 / amax rounded down to a power of 2 (1000: 0.25,
    1000 -> 250 -> 256 -> 1024); a weight's 128x128 block shares one scale over rows and columns."""
    x = torch.zeros(2, 256)
    x[0, 0], x[0, 1], x[0, 200] = 1000.0, 1.3, 5.0
    q = block_quantize(x, _fmt(granularity="tile128", scale_rounding="pow2"))
    assert q[0, [0, 1, 200]].tolist() == [1024.0, 1.25, 5.0]  # 5.0: its own tile, scale 64
    w = torch.full((130, 256), 0.01)
    w[0, 0] = 100.0  # the block of rows 0-127, columns 0-127: scale 4
    qw = block_quantize(w, _fmt(granularity="block128x128", scale_rounding="pow2"))
    assert qw[127, 5].item() == round_to(torch.tensor(0.04), "e4m3").item() / 4  # scaled with 100's block
    assert qw[129, 5].item() == round_to(torch.tensor(0.01 * 2 ** 15), "e4m3").item() / 2 ** 15  # own block
    assert qw[0, 200].item() == qw[129, 5].item()


def test_nvfp4_by_hand():
    """arXiv 2509.25149, section 2: the tensor's FP32 scale g = amax / (6 * 448); a block's scale is
    e4m3(amax_b / 6 / g) and its elements E2M1 at g times that. Tensor amax 12: g = 12 / 2688 and the
    largest block's scale is e4m3(448) = 448, a decode scale of 2: 12 -> 6 -> 12, 5 -> 2.5 -> 2 (tie to
    even) -> 4, 0.7 -> 0.35 -> 0.5 -> 1. The second block (amax 0.3): e4m3(0.05 * 2688 / 12 = 11.2) =
    11 (spacing 1 in [8, 16)), decode scale 11 * 12 / 2688 = 0.049107..., 0.3 / 0.0491 = 6.1 -> 6."""
    f = formats.TensorFormat("e2m1", "nvfp4_16", "e4m3")
    x = torch.zeros(32)
    x[0], x[1], x[2], x[16] = 12.0, 5.0, 0.7, 0.3
    q = block_quantize(x, f)
    assert q[:3].tolist() == [12.0, 4.0, 1.0]
    d = torch.tensor(11.0) * (torch.tensor(12.0) / (6 * 448))
    assert q[16].item() == (torch.tensor(6.0) * d).item()
    assert (q[3:16] == 0).all() and (q[17:] == 0).all()


def test_nvfp4_hadamard_is_on_the_weight_gradient_operands_along_the_batch(monkeypatch):
    """Transformer Engine's NVFP4: the 16x16 random Hadamard transform only on the weight-gradient product's
    operands, the input and the output gradient each cut into blocks along the batch (the axis that product
    reduces over); the data gradient reads the output gradient quantised along the output features, no
    transform. Checked on a linear layer with nearest rounding in place of the stochastic one (the same
    recipe otherwise): the weight gradient is g_w^T x_w of those roundings, the input gradient g_q w_q,
    bit for bit -- and the transform changes the weight gradient."""
    import dataclasses

    r = formats.RECIPES["nvfp4"]
    assert r.wgrad == "own" and r.x_wgrad.hadamard and r.g_wgrad.hadamard and not r.g.hadamard
    assert not r.x.hadamard and r.g.rounding == r.g_wgrad.rounding == "stochastic"
    near = lambda f: dataclasses.replace(f, rounding="nearest")  # noqa: E731
    nearest = dataclasses.replace(r, g=near(r.g), g_wgrad=near(r.g_wgrad))
    monkeypatch.setitem(formats.RECIPES, "nvfp4", nearest)
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=False)
    x, grad = torch.randn(48, 64), torch.randn(48, 32)
    xx = x.clone().requires_grad_()
    with _ours(lin, "nvfp4")():
        y = lin(xx)
    (y * grad).sum().backward()
    w_q = block_quantize(lin.weight.detach(), r.w)
    assert torch.equal(xx.grad, block_quantize(grad, nearest.g) @ w_q)
    x_w = block_quantize(x.t(), nearest.x_wgrad).t()
    g_w = block_quantize(grad.t(), nearest.g_wgrad).t()
    assert torch.equal(lin.weight.grad, g_w.t() @ x_w)
    plain = block_quantize(grad.t(), near(_NVFP4)).t().t() @ block_quantize(x.t(), _NVFP4).t()
    assert not torch.equal(lin.weight.grad, plain)


def test_hadamard_is_orthonormal_and_inverted():
    """The 16x16 random Hadamard transform is undone after quantising (arXiv 2509.25149, section 4.2): with
    an element format fine enough, what comes back is the tensor itself."""
    from mpt.fp8 import _hadamard16

    h = _hadamard16(torch.device("cpu"))
    assert torch.allclose(h @ h.t(), torch.eye(16), atol=1e-6)
    x = torch.randn(4, 64)
    f = formats.TensorFormat("bf16", "tile128", "pow2", hadamard=True)
    assert sqnr_db(x, block_quantize(x, f)) > 45


def test_hadamard_formats_take_any_axis_length():
    """The transform runs over whole runs of 16 and a format's blocks are whole multiples of 16 (32, 128): an axis that
    is not a whole number of blocks is padded to whole blocks, one shorter than a block to whole runs of 16, with zeros
    (which change no block's amax) -- each the quantisation of the zero-padded tensor, cut back, and close to the
    tensor with a fine element format. (An axis of 70 under 128-element tiles, or 80 under MX's 32, was a shape error.)"""
    import torch.nn.functional as F

    for gran, scale in (("tile128", "pow2"), ("mx32", "floor"), ("nvfp4_16", "e4m3")):
        elem = "e2m1" if gran == "nvfp4_16" else "e4m3"
        f = formats.TensorFormat(elem, gran, scale, hadamard=True)
        for k in (5, 16, 20, 70, 80, 130):
            x = torch.randn(6, k, generator=torch.Generator().manual_seed(k))
            whole = (-k % 16) if k < f.block else (-k % f.block)
            want = block_quantize(F.pad(x, (0, whole)), f)[:, :k]
            got = block_quantize(x, f)
            assert got.shape == x.shape and torch.equal(got, want), (gran, k)
            assert sqnr_db(x, got) > (5 if elem == "e2m1" else 15), (gran, k)


def test_hadamard_products_are_the_einsum_bits():
    """The transform of runs along a tensor's last axis is one matrix product (fp8._by_hadamard); it must give
    the bits of the einsum over [pre, runs, 16, post] it replaces, forward (x H) and inverse (x H^T), on values
    spread over many binades and on every shape kind a layer hands it (and the einsum itself where post > 1)."""
    from mpt.fp8 import _by_hadamard, _hadamard16

    h = _hadamard16(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for shape in [(64, 576, 1), (256, 32, 1), (3, 16, 1), (1, 48, 1), (8, 32, 5)]:
        v = torch.randn(shape, generator=g) * torch.rand(shape, generator=g).pow(8) * 1e3
        runs = v.reshape(shape[0], shape[1] // 16, 16, shape[2])
        for m, ref in ((h * 0.25, torch.einsum("pjiq,ic->pjcq", runs, h * 0.25)),  # forward, at 2^-2
                       (h.T, torch.einsum("pjiq,ci->pjcq", runs, h))):  # inverse
            assert torch.equal(_by_hadamard(v, m), ref.reshape(shape)), shape


# ------------------------------------------------------------------------------------------------
# the fidelity gate: the quantisers against torchao's, on nn.Linear-shaped tensors


def _linear_tensors():
    """An activation [64, 256], a weight [128, 256] and an output gradient [64, 128], with rows of very
    different magnitudes (what separates per-tensor from per-row and per-block scales)."""
    torch.manual_seed(0)
    rows = lambda n: 10.0 ** torch.linspace(-3, 2, n)[:, None]  # noqa: E731
    return {"x": torch.randn(64, 256) * rows(64), "w": torch.randn(128, 256) * 0.02,
            "g": torch.randn(64, 128) * rows(64) * 1e-6}


@pytest.fixture(scope="module")
def torchao():
    return pytest.importorskip("torchao", reason="torchao is not installed: the gate runs on the by-hand "
                                                 "oracles above alone")


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_tensorwise_and_rowwise_match_torchao(torchao, granularity, pow2):
    """torchao.float8's scale (float8_utils.tensor_to_scale) and saturated cast against ours: bit-exact (the
    scale one correctly rounded division, as torchao's FP64 quotient rounded to FP32 is)."""
    for role, t in _linear_tensors().items():
        for fmt in ("e4m3", "e5m2"):
            ref, ours = _torchao_and_ours_fp8(t, fmt, granularity, pow2, "l:" + role)
            assert torch.equal(ref, ours), (role, fmt, sqnr_db(ref, ours))


def _torchao_and_ours_fp8(t, fmt: str, granularity: str, pow2: bool, key: str):
    """t through torchao.float8's scale (tensor_to_scale) and saturated cast, and through ours: per-tensor
    exact scales by FP8State's current scaling (slot `key`), any other by block_quantize."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    from mpt.fp8 import FP8State

    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    kw = dict(round_scales_to_power_of_2=pow2)
    if granularity == "row":
        kw.update(scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1)
    s = tensor_to_scale(t, dtype, **kw)
    ref = to_fp8_saturated(t * s, dtype).float() / s
    if granularity == "tensor" and not pow2:
        return ref, FP8State("current").quantizer(key, fmt)(t)
    return ref, block_quantize(t, _fmt(fmt, granularity, "pow2" if pow2 else "exact"))


def _layer_grads(layer, x0, grad, autocast=contextlib.nullcontext):
    """A layer's output and the gradients of its input, weight and bias for the output gradient `grad`."""
    x = x0.clone().requires_grad_()
    with autocast():
        y = layer(x)
    (y * grad).sum().backward()
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _ours(layer, name, **fp8):
    c = Config(precision=name)
    c.fp8.ends = "fp8"
    for k, v in fp8.items():
        setattr(c.fp8, k, v)
    r = precision.build(c, "cpu")
    r.prepare(layer, [torch.optim.SGD(layer.parameters(), lr=0.1)])
    return r.autocast


def _linear_case():
    """A linear layer whose weight and input vary by decades along both axes (what separates a row's scale
    from a column's), and an output gradient that does too."""
    torch.manual_seed(0)
    rows = lambda n, lo, hi: 10.0 ** torch.linspace(lo, hi, n)  # noqa: E731
    lin = nn.Linear(256, 128)
    with torch.no_grad():
        lin.weight.mul_(rows(128, -3, 2)[:, None] * rows(256, -2, 1))
    x = torch.randn(64, 256) * rows(64, -3, 2)[:, None] * rows(256, -2, 2)
    return lin, x, torch.randn(64, 128) * rows(64, -3, 2)[:, None] * 1e-3


@pytest.mark.parametrize("theirs,ours,fp8", [("tensorwise", "fp8", {"scaling": "current"}),
                                             ("rowwise", "fp8_rowwise", {}),
                                             ("rowwise_with_gw_hp", "fp8_rowwise_gw_hp", {})])
def test_fp8_recipes_match_torchao_float8_linear(torchao, theirs, ours, fp8):
    """torchao.float8's recipes (Float8LinearConfig.from_recipe_name, emulated: its GEMMs in FP32 on the
    dequantised operands) against our presets on one linear layer: the output and the gradients of the
    input, the weight and the bias, bit for bit. Each GEMM's operands are quantised along that GEMM's
    reduction axis (rowwise: the weight again along its output features for the data gradient, the input
    and output gradient along the batch for the weight gradient); with_gw_hp: the weight gradient from the
    unquantised operands, the data gradient from a per-tensor weight; the bias gradient from the unrounded
    output gradient in all three. The data separates these: quantising each tensor once (the shared
    simplification) misses torchao's gradients. Without grad (evaluation) the output is the same.
    The output's product bit for bit; its bias torchao adds after the product, ours goes into F.linear, where
    the BLAS chooses how the sum is rounded (MKL's fused bias gave other last bits than product-then-bias on an
    AMD EPYC, the same on an Intel Xeon): within a rounding of the sum there, the bias-free product the same bits."""
    import copy
    import dataclasses

    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    lin, x, grad = _linear_case()
    cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(theirs), emulate=True)
    ref = _layer_grads(Float8Linear.from_float(copy.deepcopy(lin), config=cfg), x, grad)
    mine = copy.deepcopy(lin)
    autocast = _ours(mine, ours, **fp8)
    got = _layer_grads(mine, x, grad, autocast)
    for what, a, b in zip(("input grad", "weight grad", "bias grad"), ref[1:], got[1:]):
        assert torch.equal(a, b), (what, sqnr_db(a, b))
    bias_free = copy.deepcopy(lin)
    bias_free.bias = None
    with torch.no_grad(), _ours(bias_free, ours, **fp8)():
        assert torch.equal(bias_free(x) + lin.bias.detach(), ref[0])
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6 * float(ref[0].abs().max()))
    with torch.no_grad(), autocast():  # evaluation: the value alone, the same
        assert torch.equal(mine(x), got[0])
    if ours != "fp8":
        r = formats.RECIPES[ours]
        shared = dataclasses.replace(r, w_dgrad=None, wgrad="shared")
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(formats.RECIPES, ours, shared)
            mine = copy.deepcopy(lin)
            once = _layer_grads(mine, x, grad, _ours(mine, ours))
        assert torch.equal(once[0], got[0]) and not torch.equal(once[1], ref[1]) and not torch.equal(once[2], ref[2])


def test_rowwise_convolution_quantises_each_product_along_its_own_reduction_axis():
    """fp8_rowwise on a convolution (torchao has linear layers only; the same rule), against torch's own
    convolution gradients of the operands quantised by hand, bit for bit: the data gradient reads the
    output gradient scaled along its channels at each pixel and the weight scaled along its output
    channels; the weight gradient reads the input and the output gradient scaled per channel over the
    batch and the pixels (the axes it reduces over) -- not the forward's roundings."""
    r = formats.RECIPES["fp8_rowwise"]
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 16, 3, padding=1)
    x = torch.randn(4, 8, 6, 6) * 10.0 ** torch.linspace(-2, 2, 8)[:, None, None]
    grad = torch.randn(4, 16, 6, 6) * 10.0 ** torch.linspace(-3, 1, 16)[:, None, None]
    w = conv.weight.detach().clone()
    _, dx, dw, _ = _layer_grads(conv, x, grad, _ours(conv, "fp8_rowwise"))

    def per_channel_over_batch(t, f):  # [N, C, H, W] -> blocks of each channel over N, H, W
        flat = t.movedim(1, -1).reshape(-1, t.shape[1]).t()
        return block_quantize(flat, f).t().reshape(t.movedim(1, -1).shape).movedim(-1, 1)

    g_d = block_quantize(grad, r.g, axis=1)
    w_d = block_quantize(w, r.w_dgrad, axis=0)
    assert torch.equal(dx, torch.nn.grad.conv2d_input(x.shape, w_d, g_d, padding=1))
    x_w, g_w = per_channel_over_batch(x, r.x), per_channel_over_batch(grad, r.g)
    assert torch.equal(dw, torch.nn.grad.conv2d_weight(x_w, w.shape, g_w, padding=1))
    shared = torch.nn.grad.conv2d_weight(block_quantize(x, r.x, axis=1), w.shape, g_d, padding=1)
    assert not torch.equal(dw, shared)


@pytest.mark.parametrize("name,scaling", [("fp8", "delayed"), ("fp8", "current"), ("fp8_block", "delayed"),
                                          ("nvfp4", "delayed"), ("fp8_rowwise", "delayed")])
def test_the_bias_gradient_is_the_sum_of_the_unrounded_output_gradient(name, scaling):
    """Transformer Engine and torchao reduce a bias's gradient from the high-precision output gradient, not
    from its FP8 rounding: a linear layer's bias gradient is the output gradient summed over the batch, a
    convolution's over the batch and the pixels -- the same FP32 sum as without quantisation. (It was the
    sum of the E5M2 rounding.) The output gradient's values are none of them E5M2 or E4M3 numbers."""
    torch.manual_seed(0)
    fp8 = {} if name != "fp8" else {"scaling": scaling}
    for layer, x, dims in ((nn.Linear(64, 32), torch.randn(16, 64), (0,)),
                           (nn.Conv2d(4, 32, 3), torch.randn(2, 4, 8, 8), (0, 2, 3))):
        grad = torch.randn(*x.shape[:1], 32, *x.shape[2:]) if x.dim() > 2 else torch.randn(16, 32)
        grad = grad[..., 1:-1, 1:-1] if x.dim() > 2 else grad
        grad = grad * (1 + 2.0 ** -9)  # off the FP8 grids
        got = _layer_grads(layer, x, grad, _ours(layer, name, **fp8))[3]
        assert torch.equal(got, grad.sum(dims)), (name, type(layer).__name__)
        assert not torch.equal(got, round_to(grad * 2 ** 10, "e5m2").sum(dims) / 2 ** 10)


@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("element", ["e4m3", "e2m1"])
def test_mx_matches_torchao_to_mx(torchao, mode, element):
    """torchao's MX quantiser (mx_tensor.to_mx, its CPU path) against ours: MXFP8 and MXFP4, FLOOR and
    RCEIL scales -- bit-exact."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    dtype = torch.float8_e4m3fn if element == "e4m3" else torch.float4_e2m1fn_x2
    m = ScaleCalculationMode.FLOOR if mode == "floor" else ScaleCalculationMode.RCEIL
    for role, t in _linear_tensors().items():
        scale, data = to_mx(t, dtype, 32, m)
        ref = to_dtype(data, scale, dtype, 32, torch.float32)
        ours = block_quantize(t, _fmt(element, "mx32", mode))
        assert torch.equal(ref, ours), (role, sqnr_db(ref, ours))


def _torchao_nvfp4(t):
    """torchao's NVFP4 quantise-dequantise of a 2-D tensor with its training path's per-tensor scale
    (per_tensor_amax_to_scale of max |t|), in FP32."""
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    g = per_tensor_amax_to_scale(torch.max(torch.abs(t)))
    scales, packed = nvfp4_quantize(t.contiguous(), 16, g)
    elems = f4_unpacked_to_f32(unpack_uint4(packed)).reshape(t.shape[0], -1, 16)
    return (elems * (scales.float() * g).reshape(t.shape[0], -1, 1)).reshape(t.shape)


_NVFP4 = formats.TensorFormat("e2m1", "nvfp4_16", "e4m3")


def test_nvfp4_matches_torchao(torchao):
    """torchao's NVFP4 quantiser with its per-tensor scale (nvfp4_tensor.nvfp4_quantize) against ours:
    bit-exact in every block, the quietest blocks of a tensor spanning 5 decades among them (their E4M3
    scales clamped up to its smallest normal, as torchao clamps them)."""
    for role, t in _linear_tensors().items():
        assert torch.equal(_torchao_nvfp4(t), block_quantize(t, _NVFP4)), role


def test_an_nvfp4_block_whose_scale_rounds_to_zero_is_quantised_at_the_smallest_normal_scale(torchao):
    """A block far quieter than its tensor: max 2688 x 1024, so g = 2^10, and a block of amax 5, whose scale
    5 / 6 / 2^10 is below half E4M3's smallest subnormal (2^-10): it rounds to 0. torchao clamps it to E4M3's
    smallest normal 2^-6, a decode scale of 16: [0.5, 1, 1.5, 5] / 16 -> E2M1 [0, 0, 0, 0.5] -> [0, 0, 0, 8].
    (It was quantised at scale 1: [0.5, 1, 1.5, 4].)"""
    x = torch.zeros(2, 32)
    x[0, 16] = 2688.0 * 1024
    x[1, :4] = torch.tensor([0.5, 1.0, 1.5, 5.0])
    q = block_quantize(x, _NVFP4)
    assert q[1, :4].tolist() == [0.0, 0.0, 0.0, 8.0] and q[0, 16] == x[0, 16]
    assert torch.equal(q, _torchao_nvfp4(x))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values, a nan where the other has one."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_value_makes_its_scale_group_nan_as_torchao_does(torchao, bad):
    """torchao.float8: an inf or nan makes a tensorwise scale 0 or nan, so the whole tensor comes back nan
    (E4M3 and E5M2, exact or power-of-2 scales); rowwise, the whole row. torchao's NVFP4 training path
    takes its per-tensor scale from max |x|: the whole tensor. Ours the same, bit for bit in every other
    element: per-tensor current scaling (FP8State), rows and NVFP4 blocks (block_quantize). Before, a
    per-tensor inf saturated silently and a nan marked one element."""
    t = _linear_tensors()["x"].clone()
    t[5, 17] = bad
    for fmt in ("e4m3", "e5m2"):
        for pow2 in (False, True):
            for granularity in ("tensor", "row"):
                ref, ours = _torchao_and_ours_fp8(t, fmt, granularity, pow2, "l:x")
                nan_rows = ref.isnan().all(1)
                assert nan_rows.sum() == (64 if granularity == "tensor" else 1), (fmt, granularity)
                assert _same(ref, ours), (fmt, pow2, granularity)
    ref = _torchao_nvfp4(t)
    assert ref.isnan().all() and block_quantize(t, _NVFP4).isnan().all()


def test_delayed_scaling_saturates_an_inf_and_keeps_a_nan_in_its_element():
    """Delayed scaling (Transformer Engine's DelayedScaling; torchao has none) keeps the slot's scale and
    casts with saturation: an inf becomes the format's largest value in E4M3 (which has no inf), stays inf in
    E5M2, and a nan stays in its element; the other elements are as without it."""
    x = torch.tensor([1.0, -2.0, math.inf, math.nan, 0.25])
    for fmt, inf_to in (("e4m3", ELEMENTS["e4m3"].max), ("e5m2", math.inf)):
        q = FP8State("delayed", history_len=2).quantizer("l:x", fmt)(x)
        assert q[2] == inf_to and q[3].isnan() and q[[0, 1, 4]].tolist() == [1.0, -2.0, 0.25]


def _role_formats(names=("fp8_block", "mxfp8", "nvfp4")):
    return [(name, role, f) for name in names for role, f in formats.RECIPES[name].roles.items()]


def _gen(f):
    return torch.Generator().manual_seed(0) if f.rounding == "stochastic" else None


@pytest.mark.parametrize("name,role,f", _role_formats(("fp8_block", "mxfp8")), ids=lambda v: v if isinstance(v, str) else "")
def test_an_inf_or_nan_in_a_block_makes_that_block_nan(name, role, f):
    """A block holding inf or nan has no finite scale: the whole block comes back nan (torchao's MX does
    the same: E8M0's NaN scale). An inf was a finite value before (its amax skipped it, the rounding
    saturated it); a nan stayed in its element. Every other block: as if the bad one were zeros. (NVFP4:
    the whole tensor, through its per-tensor scale, test_nvfp4_a_non_finite_value_makes_the_tensor_nan.)"""
    torch.manual_seed(0)
    x = torch.randn(256, 256)
    rows = 128 if f.granularity == "block128x128" else 1  # its blocks: 128 rows x 128 along the axis
    width = {"tile128": 128, "block128x128": 128, "mx32": 32, "nvfp4_16": 16}[f.granularity]
    for bad in (math.inf, -math.inf, math.nan):
        y = x.clone()
        y[130, 37] = bad
        block = torch.zeros_like(x, dtype=torch.bool)
        r0, c0 = 130 // rows * rows, 37 // width * width
        block[r0:r0 + rows, c0:c0 + width] = True
        q = block_quantize(y, f, -1, _gen(f))
        assert q[block].isnan().all() and not q[~block].isnan().any(), (bad, q[block].isnan().float().mean())
        clean = block_quantize(y.masked_fill(block, 0.0), f, -1, _gen(f))
        assert torch.equal(q[~block], clean[~block]), bad


@pytest.mark.parametrize("role", ["x", "w", "g"])
def test_nvfp4_a_non_finite_value_makes_the_tensor_nan(role):
    """NVFP4's per-tensor scale comes from the tensor's amax (torchao's per_tensor_amax_to_scale of max |x|):
    an inf or nan anywhere leaves it none, and the whole tensor comes back nan, Hadamard or not."""
    f = formats.RECIPES["nvfp4"].roles[role]
    torch.manual_seed(0)
    for bad in (math.inf, -math.inf, math.nan):
        y = torch.randn(32, 64)
        y[7, 37] = bad
        assert block_quantize(y, f, -1, _gen(f)).isnan().all(), bad


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_a_nan_block_is_nan_as_torchao_to_mx_makes_it(torchao, mode):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    """A nan: bit-exact with torchao's to_mx, the block nan (E8M0's NaN scale, 0xFF). An inf too in torchao's
    newer to_mx ("no-saturation E8M0 conversion maps both NaN and Inf to 0xff"); torchao 0.18's gives the
    block a huge scale instead (its other values flush to zero), so an inf is left to the test above."""
    m = ScaleCalculationMode.FLOOR if mode == "floor" else ScaleCalculationMode.RCEIL
    t = _linear_tensors()["x"].clone()
    t[3, 40], t[9, 200], t[20, 0] = math.nan, -math.nan, math.nan
    scale, data = to_mx(t, torch.float8_e4m3fn, 32, m)
    ref = to_dtype(data, scale, torch.float8_e4m3fn, 32, torch.float32)
    ours = block_quantize(t, _fmt("e4m3", "mx32", mode))
    assert ref.isnan().sum() == 3 * 32 and torch.equal(ref.isnan(), ours.isnan())
    assert torch.equal(ref[~ref.isnan()], ours[~ours.isnan()])


@pytest.mark.parametrize("name,role,f", _role_formats(), ids=lambda v: v if isinstance(v, str) else "")
def test_values_near_flt_max_quantise_without_overflow(name, role, f):
    """Blocks whose amax is near FP32's largest value (3.4e38): the largest, rounded up to the next power of
    2, unscaled to 2^128 = inf (every element of fp8_block and mxfp8; the Hadamard transform of nvfp4's
    gradients summed past it). Now finite, within the format's own error of the input."""
    torch.manual_seed(0)
    flt_max = torch.finfo(torch.float32).max
    x = torch.cat([torch.full((8, 256), flt_max), torch.rand(56, 256) * flt_max]) * torch.randn(64, 256).sign()
    q = block_quantize(x, f, -1, _gen(f))
    assert torch.isfinite(q).all(), (~torch.isfinite(q)).sum()
    rel = ((q.double() - x.double()).norm() / x.double().norm()).item()
    assert rel < (0.5 if f.element == "e2m1" else 0.1), rel


def test_formats_are_typed_and_unknown_values_are_errors():
    with pytest.raises(ValueError, match="unknown element format"):
        formats.TensorFormat("e3m4")
    with pytest.raises(ValueError, match="E8M0"):
        formats.TensorFormat("e4m3", "mx32", "exact")
    with pytest.raises(ValueError, match="delayed"):
        formats.FormatRecipe("x", *(_fmt(),) * 3, scaling="delayed")
    assert set(formats.RECIPES) == {"fp8", "fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_block", "mxfp8", "nvfp4", "nvfp4_paper"}


# ------------------------------------------------------------------------------------------------
# the recipes end to end, and the beyond-the-paper table


@pytest.mark.parametrize("name", ["fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_block", "mxfp8", "nvfp4"])
def test_each_format_trains_every_layer_kind(name):
    """Linear, Conv2d, ConvTranspose2d and LSTM layers all quantised (every layer: fp8.ends=fp8), gradients
    reach every parameter, the output is near FP32's and not equal to it; nvfp4's stochastic rounding is
    seeded: two builds give the same gradients."""
    def once():
        torch.manual_seed(0)
        conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.ConvTranspose2d(8, 4, 3), nn.Flatten(),
                             nn.Linear(4 * 8 * 8, 16))
        lstm = nn.LSTM(16, 8)
        both = nn.ModuleDict({"conv": conv, "lstm": lstm})
        c = Config(precision=name)
        c.fp8.ends = "fp8"
        r = precision.build(c, "cpu")
        r.prepare(both, [torch.optim.SGD(both.parameters(), lr=0.1)])
        x = torch.randn(4, 3, 8, 8)
        with r.autocast():
            y, _ = lstm(conv(x)[None])
        ref, _ = lstm(conv(x)[None])
        y.square().sum().backward()
        return y.detach(), ref.detach(), [p.grad.clone() for p in both.parameters()], r

    y, ref, grads, r = once()
    assert r.state.recipe is formats.RECIPES[name]
    assert not torch.equal(y, ref)
    assert (y - ref).norm() / ref.norm() < (0.3 if name == "nvfp4" else 0.1)
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, once()[2]))


def test_block_formats_take_only_fp8_ends():
    from mpt.errors import UserError

    c = Config(precision="mxfp8")
    c.fp8.ends = "fp8"
    precision.build(c, "cpu")
    c.fp8.scaling = "current"
    with pytest.raises(UserError, match="only fp8.ends applies"):
        precision.build(c, "cpu")


def test_beyond_the_paper_table(tmp_path):
    """One row per model of the paper's tables, the new formats' columns beside FP32 and the paper's MP,
    Δ against the row's FP32."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_fp8_bf16_pure import _tiny_run

    from paper_tables import beyond, report, results

    # numerics.sqnr_every's lines: each step's median over parameters (FP32 against itself: infinite)
    sqnr = lambda *db: [{"numerics/sqnr/grad_median": v} for v in db]  # noqa: E731
    for seed in range(3):
        _tiny_run(tmp_path, "fp32", seed, 97.0 + seed, numerics=sqnr(math.inf, math.inf))
        _tiny_run(tmp_path, "mxfp8", seed, 96.0 + seed, numerics=sqnr(20.0 + seed, 30.0 + seed, math.nan, 40.0))
        _tiny_run(tmp_path, "nvfp4", seed, 60.0 + seed)
        _tiny_run(tmp_path, "nvfp4", seed, 10.0, {"fp8": {"ends": "fp8"}})  # another column: not this table's
    runs, problems = results.collect_dir(tmp_path)
    rep = report.build(runs, problems, "test")
    t = next(s for s in rep.sections if s.profile.startswith("tiny")).beyond
    cell = lambda c: t.cells[("table1", "resnet50_preact", c)]  # noqa: E731
    assert cell("fp32").mean == 98.0 and cell("mxfp8").mean == 97.0 and cell("nvfp4").mean == 61.0
    assert "within seed noise" in cell("mxfp8").diff_text() and "DIFFERS" in cell("nvfp4").diff_text()
    assert cell("fp8_block").status == "missing"
    md = beyond.to_markdown(t)
    assert "| ResNet-50 (pre-activation) | top1" in md and "| Multibox SSD (VGG-16, 300) |" in md
    # SQNR: per run the median over its steps (NaN left out: 30, 31, 32 dB), over the seeds their median
    key = lambda c: ("table1", "resnet50_preact", c)  # noqa: E731
    assert t.sqnr_db(key("mxfp8")) == 31.0 and t.sqnr_db(key("nvfp4")) is None and t.sqnr_db(key("fp32")) == math.inf
    row = next(ln for ln in md.splitlines() if ln.startswith("| ResNet-50"))
    assert "97.00 ± 1.00 (n=3); 31.0 dB |" in row and "98.00 ± 1.00 (n=3) |" in row and row.count("dB") == 1
    written = report.write(rep, tmp_path / "out")
    assert (tmp_path / "out" / f"{t.stem}.csv") in written
    rows = list(__import__("csv").DictReader((tmp_path / "out" / f"{t.stem}.csv").open()))
    r50 = next(r for r in rows if r["model"] == "resnet50_preact")
    assert float(r50["mxfp8|sqnr_db"]) == 31.0 and r50["nvfp4|sqnr_db"] == "" and r50["fp32|sqnr_db"] == "inf"


def test_accumulating_in_16_bits_loses_what_fp32_keeps():
    """Section 3.3: 4096 products of 2^-10 sum to 4 in FP32; accumulated in FP16 the sum stops at 2 (the
    addend is half FP16's spacing there, and the tie goes to the even value), in BF16 at 0.25. A linear
    layer under a recipe accumulating in FP16 computes the same value; its gradient is the FP32 product's."""
    from mpt.fp8 import FP8Math, accumulate_linear

    x, w = torch.ones(1, 4096), torch.full((1, 4096), 2.0 ** -10)
    assert accumulate_linear(x, w, "fp32").item() == 4.0
    assert accumulate_linear(x, w, "fp16").item() == 2.0
    assert accumulate_linear(x, w, "bf16").item() == 0.25
    exact = formats.TensorFormat("bf16", "row", "pow2")  # 1 and 2^-10 are exact: only the sum is narrow
    for acc, want in (("fp32", 4.0), ("fp16", 2.0)):
        lin = nn.Linear(4096, 1, bias=False)
        with torch.no_grad():
            lin.weight.fill_(2.0 ** -10)
        st = FP8State("current", recipe=formats.FormatRecipe("t", x=exact, w=exact, g=exact, accumulate=acc))
        st.register(lin, "fp8")
        xin = torch.ones(1, 4096, requires_grad=True)
        with FP8Math(st):
            y = lin(xin)
        assert y.item() == want
        y.backward()
        assert torch.equal(lin.weight.grad, torch.ones(1, 4096)) and torch.all(xin.grad == 2.0 ** -10)


def test_fidelity_ranks_the_formats():
    """Output and per-parameter gradient SQNR of each format against FP32 on the same weights and batch:
    finite, and the formats in their order of precision (MXFP8's 3 mantissa bits above NVFP4's 1)."""
    from mpt.numerics import fidelity

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                        nn.Linear(64, 10))
    x = torch.randn(32, 64)
    running = net[1].running_mean.clone()
    db = {}
    for name in ("mxfp8", "nvfp4"):
        c = Config(precision=name)
        c.fp8.ends = "fp8"
        r = precision.build(c, "cpu")
        r.prepare(net, [torch.optim.SGD(net.parameters(), lr=0.1)])
        db[name] = fidelity(net, lambda m: m(x), r.autocast())
    assert set(db["mxfp8"]) == {"output"} | {f"grad/{n}" for n, _ in net.named_parameters()}
    assert 20 < db["mxfp8"]["output"] < 60 and 5 < db["nvfp4"]["output"] < db["mxfp8"]["output"] - 6
    assert db["nvfp4"]["grad/0.weight"] < db["mxfp8"]["grad/0.weight"]
    assert torch.equal(net[1].running_mean, running) and all(p.grad is None for p in net.parameters())


# ------------------------------------------------------------------------------------------------
# the element-format table (mpt.formats.ELEMENTS): every module's numbers come from its bits

# The specifications' own figures, written down (OCP 8-bit Floating Point spec v1.0, Table 1; OCP MX
# spec v1.0, section 5.3; IEEE 754 binary16; bfloat16): (max, smallest normal, smallest subnormal).
SPEC_FIGURES = {"e4m3": (448.0, 2.0**-6, 2.0**-9), "e5m2": (57344.0, 2.0**-14, 2.0**-16),
                "e2m1": (6.0, 1.0, 0.5), "fp16": (65504.0, 2.0**-14, 2.0**-24),
                "bf16": ((2 - 2.0**-7) * 2.0**127, 2.0**-126, 2.0**-133), "e8m0": (2.0**127, 2.0**-127, 2.0**-127)}


@pytest.mark.parametrize("name", list(ELEMENTS))
def test_each_element_format_is_what_its_spec_and_torch_say(name):
    """The range derived from the bits is the specification's, and -- where torch has the dtype -- every
    code of it: the largest finite and the smallest positive value, whether an inf exists, finfo."""
    e = ELEMENTS[name]
    assert (e.max, e.min_normal, e.min_subnormal) == SPEC_FIGURES[name]
    if e.torch_dtype is None:
        return
    dtype = getattr(torch, e.torch_dtype)
    fi = torch.finfo(dtype)
    assert (fi.max, fi.smallest_normal, fi.eps, fi.bits) == (e.max, e.min_normal, 2.0**-e.mantissa_bits, e.bits)
    codes = torch.arange(2**e.bits, dtype=torch.int32).to(torch.uint8 if e.bits == 8 else torch.int16)
    v = codes.view(dtype).double()
    finite = v[torch.isfinite(v)]
    assert finite.max().item() == e.max and finite[finite > 0].min().item() == e.min_subnormal
    assert torch.isinf(v).any().item() == e.has_inf
    assert (finite.min().item() == -e.max) == e.signed


def test_no_module_keeps_its_own_format_constants():
    """The formats' largest values appear as numbers nowhere but in the table, derived from the bits
    (docstrings may name them): a second copy of a format's range can drift from the first."""
    import ast

    from conftest import REPO

    tops = {e.max for e in ELEMENTS.values() if 100 < e.max < 1e6}  # 448, 57344, 65504 (6 is any six)
    found = []
    for path in [*REPO.glob("mpt/**/*.py"), *REPO.glob("paper_tables/**/*.py"), *REPO.glob("experiments/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and type(node.value) is float and node.value in tops:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value}")
    assert not found, found


@pytest.fixture
def e3m2(monkeypatch):
    """MX FP6 E3M2 (OCP MX spec v1.0, section 5.3.2: max 28, smallest normal 2^-2, subnormal 2^-4, no inf
    nor NaN) added to the table as a new format would be: one row."""
    monkeypatch.setitem(ELEMENTS, "e3m2", formats.Element("e3m2", 3, 2, "finite"))
    # Its grid by hand: 0, the subnormals m x 2^-4 (m = 1..3), the normals (1 + m/4) x 2^(e - 3), e = 1..7.
    grid = [0.0] + [m * 2.0**-4 for m in (1, 2, 3)] + [(1 + m / 4) * 2.0 ** (e - 3) for e in range(1, 8) for m in range(4)]
    return torch.tensor(grid)


def _nearest_even(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """An oracle for round to nearest even on a non-negative grid whose codes count up (the code's last bit
    is the mantissa's), saturating at its end: by distances, not by the quantiser's arithmetic."""
    a = x.abs().clamp(max=grid[-1].item()).reshape(-1)
    d = (a[:, None] - grid[None, :]).abs()
    tie = d == d.min(1, keepdim=True).values
    code = torch.where(tie.sum(1) > 1, (tie & (torch.arange(len(grid)) % 2 == 0)).int().argmax(1), tie.int().argmax(1))
    return grid[code].reshape(x.shape).copysign(x)


def test_a_new_element_format_is_one_row(e3m2):
    """E3M2, a row added to ELEMENTS and nothing else: its range follows from the bits; mpt.fp8 rounds to
    it (nearest even, saturating at 28), per tensor and in MX blocks with E8M0 scales."""
    from mpt.fp8 import fp8_quantize

    e = ELEMENTS["e3m2"]
    assert (e.max, e.min_normal, e.min_subnormal, e.has_inf, e.bits) == (28.0, 0.25, 2.0**-4, False, 6)
    assert "e3m2" in formats.element_names()
    torch.manual_seed(0)
    mids = (e3m2[1:] + e3m2[:-1]) / 2  # every tie between neighbours
    x = torch.cat([torch.randn(4000) * 8, mids, -mids, e3m2, torch.tensor([29.0, 30.0, 1e6, -1e6, float("inf"), 0.01])])
    q = round_to(x, "e3m2")
    assert torch.equal(q, _nearest_even(x, e3m2)) and q.abs().max().item() == 28.0
    assert torch.isin(q.abs(), e3m2).all()
    # per tensor at current scaling: amax onto the top of the grid, every value on the scaled grid
    t = torch.randn(64, 48)
    s = 28.0 / t.abs().max()
    assert torch.equal(fp8_quantize(t, "e3m2", s), _nearest_even(t * s, e3m2) / s)
    # MX blocks (32 along the reduction axis, E8M0 power-of-2 scales): FLOOR's scale 2^(floor(log2 amax) - 4)
    # puts a block with amax 100 at 25, which rounds to 24 -> 96; RCEIL's 2^ceil(log2(100 / 28)) = 4, the same.
    blk = torch.cat([torch.tensor([100.0, 3.0, -1.0]), torch.zeros(29)])[None, :]
    for mode in ("floor", "rceil"):
        got = block_quantize(blk, formats.TensorFormat("e3m2", "mx32", mode))
        assert got[0, :3].tolist() == [96.0, 3.0, -1.0], mode  # 3 / 4 = 0.75 and 1 / 4 = 0.25: on the grid
    t = torch.randn(16, 96) * torch.exp2(torch.randint(-6, 6, (16, 96)).float())
    got = block_quantize(t, formats.TensorFormat("e3m2", "mx32", "rceil")).reshape(16, 3, 32)
    amax = t.reshape(16, 3, 32).abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 28.0)))
    assert torch.equal(got / scale, _nearest_even((t.reshape(16, 3, 32) / scale).reshape(-1), e3m2).reshape(16, 3, 32))


@pytest.fixture
def extra_precision(monkeypatch):
    """Adds a row to the precision table as far as the config reads it (TABLE, BY_NAME, PRECISIONS)."""
    from mpt import precisions

    def add(row):
        monkeypatch.setattr(precisions, "TABLE", (*precisions.TABLE, row))
        monkeypatch.setitem(precisions.BY_NAME, row.name, row)
        monkeypatch.setattr(precisions, "PRECISIONS", (*precisions.PRECISIONS, row.name))
    return add


def _mxfp6_row():
    import dataclasses

    from mpt import precisions

    return dataclasses.replace(precisions.BY_NAME["mxfp8"], name="mxfp6", compute="float6",
                               columns=(precisions.Column("mxfp6", "MXFP6"),))


def test_a_precision_without_its_recipe_is_a_one_line_error(extra_precision):
    """A new precision row whose FormatRecipe is missing, or whose recipe names nothing: refused where the
    config is resolved and where the recipe is built -- never an FP32 run under the new name."""
    import dataclasses

    from mpt import config as C
    from mpt import precisions

    extra_precision(_mxfp6_row())
    with pytest.raises(UserError, match=r"precision=mxfp6 has no format recipe: add FormatRecipe\('mxfp6'") as err:
        C.resolve("dcgan", ["profile=tiny", "precision=mxfp6", "task.data_root=/nonexistent"])
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="has no format recipe"):
        precision.build(Config(precision="mxfp6"), "cpu")
    extra_precision(dataclasses.replace(_mxfp6_row(), name="fp6x", recipe="MXFP6"))
    with pytest.raises(UserError, match=r"precision=fp6x names recipe 'MXFP6', which does not exist; set its"):
        precisions.check(Config(precision="fp6x"))


def test_a_new_format_precision_is_its_row_and_its_format_recipe(extra_precision, e3m2, monkeypatch):
    """The same row with its FormatRecipe (E3M2 in MX blocks) runs on the simulated-format recipe: its
    weights reach the dot products on E3M2's grid at power-of-2 block scales."""
    mx6 = formats.TensorFormat("e3m2", "mx32", "rceil")
    monkeypatch.setitem(formats.RECIPES, "mxfp6", formats.FormatRecipe("mxfp6", x=mx6, w=mx6, g=mx6))
    extra_precision(_mxfp6_row())
    c = Config(precision="mxfp6")
    c.fp8.ends = "fp8"
    r = precision.build(c, "cpu")
    assert type(r) is precision.FP8 and r.state.recipe is formats.RECIPES["mxfp6"]
    torch.manual_seed(0)
    lin = nn.Linear(32, 4, bias=False)
    r.prepare(lin, [torch.optim.SGD(lin.parameters(), lr=0.1)])
    x = torch.randn(2, 32)
    with r.autocast():
        y = lin(x)
    wq, xq = block_quantize(lin.weight.detach(), mx6), block_quantize(x, mx6)
    assert torch.equal(y, nn.functional.linear(xq, wq)) and not torch.equal(wq, lin.weight.detach())
    scale = torch.exp2(torch.ceil(torch.log2(lin.weight.detach().abs().amax(1, keepdim=True) / 28.0)))
    assert torch.isin((wq / scale).abs(), e3m2).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_min_max_is_aminmax_in_every_layout(dtype):
    # fp8.min_max reads a tensor by one aminmax or by amin and amax, by size and layout: the values must be
    # aminmax's in every case, a nan anywhere a nan, an inf an inf, and written in place when `out` is given.
    g = torch.Generator().manual_seed(0)
    shapes = [(7,), (3, 5, 4, 4), (64, 16, 32, 32), (1 << 16,)]  # small and large, 1-D and 4-D
    for shape in shapes:
        base = torch.randn(shape, generator=g).to(dtype)
        views = [base, base.flip(0)]
        if base.dim() == 4:
            views += [base.to(memory_format=torch.channels_last), base.transpose(1, 3)]
        for poke in (None, float("inf"), -float("inf"), float("nan")):
            for v in views:
                t = v.clone(memory_format=torch.preserve_format)
                if poke is not None:  # (into the storage, whatever the layout: a dense clone holds numel values)
                    t.as_strided((t.numel(),), (1,))[t.numel() // 3] = poke
                ref = torch.aminmax(t)
                lo, hi = fp8.min_max(t)
                pair = (torch.zeros((), dtype=dtype), torch.zeros((), dtype=dtype))
                got = fp8.min_max(t, out=pair)
                assert got[0] is pair[0] and got[1] is pair[1]
                for a, b in ((ref.min, lo), (ref.max, hi), (ref.min, pair[0]), (ref.max, pair[1])):
                    assert torch.equal(a, b) or (a.isnan() and b.isnan()), (shape, t.stride(), poke)
