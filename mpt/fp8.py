"""FP8, simulated (precision=fp8; beyond the paper: Micikevicius et al. 2022, "FP8 Formats for Deep
Learning", and Transformer Engine's HYBRID format).

Every dot product of a weight-bearing layer (linear, convolution, recurrent) reads FP8 operands: E4M3
for weights and activations in the forward pass, E5M2 for the gradient of the layer's output in the
backward pass, each tensor at its own scale (FP8State). Simulated on every device by quantise-dequantise:
x -> fp8(clamp(x * s, -max, max)) / s, computed in FP32, then the FP32 kernel on the FP32 values of the
FP8 numbers (exact), accumulating in FP32 -- what an FP8 GEMM with FP32 accumulation computes, up to
summation order, as the FP8 paper itself simulated: the numerics, not the speed. Both casts saturate
finite values (Transformer Engine's choice: a value beyond the delayed scale's range is clipped, not
made inf). Under delayed scaling (Transformer Engine's) E4M3 saturates an inf too, E5M2 keeps inf (it
has one), a nan stays in its element; under current scaling a tensor holding inf or nan has no scale
and comes back nan, whole (torchao's tensorwise) -- either way a diverging run is still seen as one.
A bias's gradient is the output gradient summed before its rounding (_FP8Grad, _Passes).

The same mechanism runs the block-scaled successors (precisions fp8_block, mxfp8, nvfp4; their
switches are data, mpt.formats): each role's tensor is cut into blocks along the product's reduction
axis (_AXES), each block scaled by its own amax and rounded (block_quantize). A block holding inf or nan
comes back nan, whole (torchao's MX: E8M0's NaN scale; a row, torchao's rowwise; under NVFP4 the tensor,
whose per-tensor scale it spoils); a scale is never below top / FLT_MAX, so values near FP32's largest
saturate rather than unscale to inf (block_scale). Where a recipe gives the backward products operands
of their own (FormatRecipe.w_dgrad, wgrad), FP8Math._split runs each product on its own.

Not quantised: a recurrent layer's state inside its fused kernel (its input sequence and weights are;
the gradient of its output sequence is), dot products without a weight (attention's), embeddings
(lookups), modules marked keep_fp32.

With fp8.ends=bf16 the model's ends compute on BF16 operands, found from its dataflow at its first
forward (FP8State.find_ends): every layer that reads the model's input without another layer before it,
and every layer whose output reaches no other layer (a classifier, each of a detector's prediction
convolutions). A recipe's keep_last (mpt.formats.FormatRecipe) keeps the last of the layers in the order of
that probe's calls in BF16 too (FP8State.kept_last); its bf16_tail puts every product on BF16 operands for the
last steps (FP8State.wide, set per iteration by mpt.precision.BF16Tail).

With fmt.compile=true the rounding chains of fp8_quantize, block_quantize and _nvfp4 (scale, round, unscale) run as
one compiled loop each on a CPU (mpt.fused), the same bits -- a power-of-2 block quantisation whole, its amax and
scales too; the decisions around them stay here, in eager code.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mpt import formats, fused
from mpt import torch_private as TP
from mpt.errors import UserError
from mpt.half_math import float_tensors, map_tensors, ops_of

# Table lookups: layers with a weight but no dot product to quantise.
_LOOKUPS = (nn.Embedding, nn.EmbeddingBag)
# A scale is capped at the largest finite FP32 (Transformer Engine does the same): FP8_MAX / amax of a
# tensor whose amax is below ~1e-34 is inf otherwise, and 0 * inf makes its zeros NaN.
FLT_MAX = torch.finfo(torch.float32).max


def fp8_quantize(x: torch.Tensor, fmt: str, scale=1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """x rounded to FP8 format `fmt` ("e4m3" | "e5m2") at per-tensor `scale` (a number or a 0-dim
    tensor) and returned in FP32 at x's magnitude: fp8(x * scale) / scale, round to nearest even (or
    stochastically, with a generator), saturating at the format's largest value, subnormals kept."""
    if generator is None and (_by_spacing(fmt) or _add_sub_finite(formats.ELEMENTS[fmt]) and _finite_on_cpu(x, scale)):
        # y is ours: rounded and unscaled in place (E5M2 too where x * scale has no inf to keep: its cast, the isinf
        # and the where cost a CPU twice the arithmetic, for the same bits)
        def eager():
            return _round_in_place(x.float() * scale, fmt, sign=x).div_(scale)
        if isinstance(scale, torch.Tensor) and fused.pays(x):
            return fused.call("tensor", fmt, x, scale, fallback=eager)
        return eager()
    y = x.float() * scale
    q = round_to(y, fmt, generator)
    if fmt == "e5m2":  # the FP8 format with an inf keeps an input's inf (the module docstring)
        q = torch.where(torch.isinf(y), y, q)
    return q / scale


def round_to(x: torch.Tensor, fmt: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """FP32 x (already scaled) rounded to element format `fmt`, saturating at its largest value, returned
    in FP32. Round to nearest even, or with a generator stochastically: up with probability equal to
    the distance from the value below, in units of the spacing there (unbiased). Torch's own casts where
    they are cheap; E4M3 and E2M1 by the spacing of each value's binade (round_by_spacing): on a CPU,
    torch's FP8-to-FP32 cast costs several times the arithmetic, and the result is the same bits."""
    if generator is None and _torch_casts(fmt):
        e = formats.ELEMENTS[fmt]
        return x.float().clamp(-e.max, e.max).to(getattr(torch, e.torch_dtype)).float()
    return round_by_spacing(x, fmt, generator)


def round_by_spacing(x: torch.Tensor, fmt: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """round_to's arithmetic for any format of mpt.formats.ELEMENTS (the tests check it against torch's
    casts). The spacing u of a value's binade is its FP32 exponent bits (the value with its mantissa
    cleared) times 2^-mantissa_bits, and at least the spacing of the format's subnormals. Nearest even:
    adding and subtracting C = 1.5 * 2^23 * u makes FP32's own round-to-nearest-even round x to a multiple
    of u (the sum lies in the binade whose spacing is u); for BF16, whose C would overflow, the same on
    x / u."""
    e = formats.ELEMENTS[fmt]
    m, emin, top = e.mantissa_bits, e.emin, e.max
    if generator is None and _add_sub_finite(e):
        return _round_in_place(x.float().clamp(-top, top), fmt, sign=x, saturated=True)
    xc = x.float().clamp(-top, top)
    binade = (xc.view(torch.int32) & 0x7F800000).view(torch.float32).clamp_min_(2.0 ** emin)
    u = binade.mul_(2.0 ** -m)
    if generator is None:  # x / u is exact (u is a power of 2) and below 2^22 in magnitude
        q = (xc / u).add_(1.5 * 2.0 ** 23).sub_(1.5 * 2.0 ** 23).mul_(u)
    else:  # floor(|x| / u + U), U uniform in (0, 1): up with probability the distance from the value below
        r = xc.abs_().div_(u)  # xc is ours
        bits = formats.SR_BITS
        q = r.add_(_sr_bits(r.shape, generator, r.device), alpha=2.0 ** -bits).add_(0.5 + 2.0 ** -(bits + 1))
        q = q.floor_().mul_(u)
    return q.copysign_(x.float())


def _sr_bits(shape, generator: torch.Generator, device) -> torch.Tensor:
    """k - 2^15 for a uniform random 16-bit k (formats.SR_BITS), one per element of `shape`, as FP32: the signed
    16-bit halves of uniform random 64-bit words. With U = (k + 1/2) / 2^16 the probability of rounding up is the
    distance from the value below rounded to a multiple of 2^-16 of the spacing, so the rounding is unbiased to
    within 2^-17 of a spacing (hardware stochastic rounding draws a few random bits per value too); four values to
    one 64-bit draw cost a CPU a quarter of torch.rand's 32-bit draw per value. Converted to FP32 here (exact), for
    mpt.fused's kernels too: inductor's CPU loop reading int16 runs unvectorised, ~4x as long as the same loop
    reading FP32 plus this conversion's pass."""
    n = math.prod(shape)
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-2 ** 63, None, generator=generator)
    return words.view(torch.int16)[:n].view(shape).float()


# Torch's cast to E4M3 costs several times the arithmetic on a CPU (its FP8-to-FP32 cast above all);
# E5M2, FP16 and BF16 casts are cheap.
_SLOW_CASTS = ("e4m3",)


def _finite_on_cpu(t: torch.Tensor, scale) -> bool:
    """t is on a CPU (where reading a value costs no device sync) and t * scale holds no inf nor nan: its largest
    and smallest values times scale are finite (rounding is monotonic: no other product is larger)."""
    if t.device.type != "cpu" or not t.numel():
        return False
    lo, hi = min_max(t.detach().float())  # (nan where t holds one)
    return math.isfinite(lo * scale) and math.isfinite(hi * scale)


def _torch_casts(fmt: str) -> bool:
    """round_to rounds `fmt` to nearest by torch's own cast where torch has the dtype and the cast is
    cheap; by its spacing otherwise (E4M3, E2M1, any new row of the table): the same bits."""
    return formats.ELEMENTS[fmt].torch_dtype is not None and fmt not in _SLOW_CASTS


def _by_spacing(fmt: str) -> bool:
    """The quantisers round `fmt` in place on their own temporary (_round_in_place), nearest even: the
    formats round_to does not cast whose add-and-subtract constant is finite."""
    return not _torch_casts(fmt) and _add_sub_finite(formats.ELEMENTS[fmt])


def _add_sub_finite(e) -> bool:
    """The nearest-even trick's constant C = 1.5 * 2^23 * u stays finite in FP32 at the largest spacing u
    = 2^(emax - mantissa bits) (FP16, the FP8 and FP4 formats; not BF16, whose spacing reaches 2^120)."""
    return e.emax - e.mantissa_bits + 24 <= 127


def _round_in_place(y: torch.Tensor, fmt: str, sign: torch.Tensor, saturated: bool = False) -> torch.Tensor:
    """round_by_spacing's nearest-even arithmetic on an FP32 temporary `y` that the caller gives away: y is
    saturated, rounded and returned, in place; `sign`: a tensor with y's signs (y's before it was scaled:
    the sign of a value rounded to zero); `saturated`: y is already within the format's range (clamped by the caller). The
    same bits as computing on copies: the same FP32 operations in the same order, with fewer temporaries
    of an activation's size (y and the spacings, not six)."""
    e = formats.ELEMENTS[fmt]
    m, emin, top = e.mantissa_bits, e.emin, e.max
    if not saturated:
        y.clamp_(-top, top)
    c = torch.bitwise_and(y.view(torch.int32), 0x7F800000)
    c = c.view(torch.float32).clamp_min_(2.0 ** emin).mul_(1.5 * 2.0 ** (23 - m))
    return y.add_(c).sub_(c).copysign_(sign)


def bf16_quantize(x: torch.Tensor) -> torch.Tensor:
    """x rounded to BF16 (nearest even) and returned in FP32: fp8.ends=bf16's 16-bit operands."""
    return x.to(torch.bfloat16).float()


def _over(top: float, amax: torch.Tensor) -> torch.Tensor:
    """top / amax, one correctly rounded FP32 division (torchao's FP64 quotient rounded to FP32 is the same
    number). torch's number / tensor is reciprocal(tensor) x number, two roundings: a scale one ulp off."""
    return torch.full_like(amax, top).div_(amax)


_LONG = 512  # (measured on a CPU: a 24x24 activation's channels are long enough, a 12x12 one's are not)


def min_max(t: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """t's smallest and largest values, as torch.aminmax gives them (nan where t holds one; written into `out`'s
    two 0-dim tensors when given), by the reduction that reads t's layout fastest: a min and a max are exact in
    any order. On a CPU aminmax reads a contiguous tensor in one pass but any other layout slowly: a channels-last
    activation several times slower than the same values contiguous, where amin and amax read it about as fast
    (docs/doctor.md: a watched channels-last sample of the tiny ResNet-50 ~30% cheaper). For a contiguous tensor
    just made, one pass beats two (its values still in cache); a GPU's aminmax reads any layout well."""
    if t.device.type != "cpu" or t.is_contiguous():
        return torch.aminmax(t, out=out) if out is not None else tuple(torch.aminmax(t))
    if out is None:
        return t.amin(), t.amax()
    torch.amin(t, out=out[0])
    torch.amax(t, out=out[1])
    return out


def _abs_max(t: torch.Tensor, dims: tuple[int, ...] | None = None) -> torch.Tensor:
    """amax(|t|) over `dims` (None: every axis, as a 0-dim tensor; otherwise kept as axes of size 1): nan where a
    block holds a nan, +0 where it is all zeros, as t.abs().amax(dims) gives it, bit for bit. Where the reduction
    runs over long contiguous stretches (a whole tensor; one axis with at least _LONG elements after it), from
    t's largest and smallest values: two reading passes, without a temporary |t| of t's size; elsewhere a
    reduction costs a CPU more than |t| does, and one reduction of |t| is the cheaper."""
    if dims is not None and len(dims) > 1 and t.is_contiguous():
        # Several axes (a whole batch axis, _along_batch): the contiguous stretch of reduced axes at t's end first,
        # then the rest on that small result -- a reduction across strided axes costs a CPU several times as much.
        # (A max is exact in any order.)
        dims = sorted(d % t.dim() for d in dims)
        tail = next((i for i in range(len(dims)) if dims[i:] == list(range(dims[i], t.dim()))), len(dims))
        if 0 < tail < len(dims):
            inner = t.flatten(dims[tail])  # (a view of the contiguous t)
            if inner.shape[-1] >= _LONG:
                lo, hi = inner.amin(dim=-1, keepdim=True), inner.amax(dim=-1, keepdim=True)
                part = torch.maximum(hi, lo.neg_()).abs_()
            else:
                part = inner.abs().amax(dim=-1, keepdim=True)
            keep = [1 if d in dims else n for d, n in enumerate(t.shape)]
            return part.amax(dim=dims[:tail], keepdim=True).reshape(keep)
        dims = tuple(dims)
    if dims is None:
        lo, hi = min_max(t)
    elif len(dims) == 1 and t.stride(dims[0]) >= _LONG:
        lo, hi = t.amin(dim=dims, keepdim=True), t.amax(dim=dims, keepdim=True)
    else:
        return t.abs().amax(dim=dims, keepdim=True)
    # max(hi, -lo) is |t|'s largest (nan where either is); abs_ makes a -0 (a block of -0s) and a nan's sign what |t| gives
    return torch.maximum(hi, lo.neg_()).abs_()


def _finite_abs(t: torch.Tensor) -> torch.Tensor:
    a = t.abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a))


def _pow2(e: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)


def _least_scale(fmt: str, rounding: str) -> float:
    """The smallest scale s at which every value of `fmt` unscales to a finite FP32 (top / s <= FLT_MAX):
    a block whose amax is within a factor 2 of FLT_MAX would otherwise get a smaller one, and its
    largest value, rounded up to the next power of 2, unscale to 2^128 = inf."""
    top = formats.ELEMENTS[fmt].max
    if rounding == "exact":
        return math.nextafter(top / FLT_MAX, math.inf)  # (top / that <= FLT_MAX, as FP32 divides it too)
    return 2.0 ** math.ceil(math.log2(top / FLT_MAX))  # the power-of-2 scales: pow2, floor, rceil


def block_scale(amax: torch.Tensor, fmt: str, rounding: str) -> torch.Tensor:
    """The factor each block is multiplied by before rounding to `fmt` (divided by after), from the
    block's largest |value| (a zero block: 1; a block holding inf or nan: nan, which makes the whole block
    nan -- torchao's MX does the same through E8M0's NaN scale).
      exact  top / amax, capped at FLT_MAX
      pow2   that rounded down to a power of 2 (arXiv 2412.19437's and TE's block scales)
      floor  OCP MX (arXiv 2310.10537, section 6.3): shared exponent floor(log2 amax) - emax(fmt),
             E8M0 clamped to [-127, 127]; a block's largest value can then round past top (saturated)
      rceil  2^-ceil(log2(amax / top)), clamped the same: amax * scale <= top always (arXiv 2506.08027)
    Each at least _least_scale (top / FLT_MAX), so that no rounded value unscales past FLT_MAX: a block
    with amax above top x that (2.98e38 for E4M3) saturates its largest values instead of making inf."""
    top = formats.ELEMENTS[fmt].max
    scale_e = formats.ELEMENTS["e8m0"]  # OCP MX's shared scale: powers of 2 from 2^emin to 2^emax
    if rounding == "exact":
        s = _over(top, amax).clamp(max=FLT_MAX)
    elif rounding == "pow2":
        # the exponent bits of a normal positive FP32 (top / FLT_MAX and above, capped at FLT_MAX) are its power of 2
        # below, frexp's and ldexp's bits in one pass over the scales (0, inf and nan: replaced below)
        s = _over(top, amax).clamp_(max=FLT_MAX)
        s.view(torch.int32).bitwise_and_(0x7F800000)
    elif rounding == "floor":
        emax = int(torch.frexp(torch.tensor(top))[1]) - 1
        # floor(log2 amax): the exponent bits, less the bias (frexp's exponent - 1, a pass over the scales instead of
        # frexp's several); a subnormal amax reads -127 where frexp reads lower, but either saturates the clamp
        s = _pow2(-((amax.view(torch.int32) >> 23) - (127 + emax)).clamp(scale_e.emin, scale_e.emax))
    elif rounding == "rceil":
        x = amax / top
        # ceil(log2 x): the exponent bits, one up where a mantissa bit is set (exact at powers of 2; frexp's exponent,
        # less 1 where its mantissa is 0.5). A subnormal x reads -126: right above 2^-127; at or below it, -127
        # saturates the clamp as frexp's lower exponent does; an x of 0 (an amax below top x 2^-150) has frexp's 0.
        e = ((x.view(torch.int32) + 0x7FFFFF) >> 23).sub_(127)
        e = e.masked_fill_(x <= 2.0 ** -127, -127).masked_fill_(x == 0, 0)
        s = _pow2(-e.clamp_(scale_e.emin, scale_e.emax))
    else:
        raise ValueError(f"block_scale: {rounding!r} is not a scale of its own (nvfp4 scales: _nvfp4)")
    s = s.clamp_(min=_least_scale(fmt, rounding))
    # (amax is |values|' largest: 0, positive, inf or nan)
    return s.masked_fill_(amax == 0, 1.0).masked_fill_(~(amax < math.inf), math.nan)


_HADAMARD: dict = {}


def _hadamard16(device) -> torch.Tensor:
    """A 16x16 orthonormal Hadamard matrix with a fixed random sign on each row (arXiv 2509.25149,
    section 4.2: a random Hadamard transform spreads a block's outliers over its 16 elements). Fixed
    seed: the same transform every step and every run."""
    if device not in _HADAMARD:
        h = torch.ones(1, 1)
        while h.shape[0] < 16:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(16)) * 2.0 - 1
        _HADAMARD[device] = (signs[:, None] * h / 4.0).to(device)
    return _HADAMARD[device]


def _by_hadamard(v: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """v [pre, axis, post] with each run of 16 along its axis multiplied by the 16x16 `h` (x h: each output a sum
    over the run). Where the axis is v's last (post = 1, the operands of a weight gradient) on a CPU, one matrix
    product of the runs as rows: what einsum computes there (the same product, the same bits, tested) without
    the reordering einsum does around it. (On a GPU the einsum stays: another GEMM may sum in another order.)"""
    pre, kk, post = v.shape
    if post == 1 and v.device.type == "cpu":
        return (v.reshape(-1, 16) @ h).reshape(v.shape)
    return torch.einsum("pjiq,ic->pjcq", v.reshape(pre, kk // 16, 16, post), h).reshape(v.shape)


def block_quantize(t: torch.Tensor, f: formats.TensorFormat, axis: int | tuple[int, ...] = -1,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """t rounded to format f block by block along `axis` (its dot product's reduction axis) and
    returned in FP32 at t's magnitude. Computed on the view [before axis, axis, after axis] of t, so no
    transposed copy is made; the axis is padded with zeros only where it is longer than a block and not
    a whole number of them (a zero changes no block's amax), and a block longer than the axis is the
    whole axis. A 2-D block (block128x128, block16x16) spans as many rows of the leading axes (a weight's
    outputs) as it spans along the axis, fewer where there are fewer. Per-tensor exact scales take
    FP8State.quantizer's path. A tuple `axis` (whole-axis blocks, granularity row, only): one block across all of
    those axes at once, reduced where t lies, the result in t's layout (_along_batch)."""
    if isinstance(axis, tuple):
        if f.granularity != "row" or f.hadamard:
            raise ValueError(f"block_quantize: blocks across several axes are whole rows, not {f.granularity}")
        return _quantize_blocks(t.float(), axis, f, generator)
    x = t.float()
    shape = x.shape
    if x.dim() == 0:
        x = x.reshape(1)
    axis = axis % x.dim()
    k = x.shape[axis]
    v = x.reshape(math.prod(x.shape[:axis]), k, -1)
    pre, post = v.shape[0], v.shape[2]
    b = min(f.block or k, k)
    pad = -k % b
    if f.hadamard and b < f.block:  # an axis shorter than a block: one block, padded to whole runs of 16 (a block
        pad = -k % 16                # of the format is a multiple of 16 elements; it is padded to whole blocks above)
        b = k + pad
    rows = formats.BLOCK_ROWS.get(f.granularity)  # a 2-D block's rows (None: 1-D blocks)
    rb = min(rows, pre) if rows else pre
    rpad = -pre % rb
    if pad or rpad:
        v = F.pad(v, (0, 0, 0, pad, 0, rpad))
    kk = v.shape[1]
    if f.hadamard:  # along the axis, 16 elements at a time
        # Its rows are 16 entries of +-1/4: an output can reach 4x the largest input. A tensor within that of
        # FLT_MAX is transformed at 2^-2 (exact) and the result unscaled, saturating at FLT_MAX (the inverse
        # transform of rounded values may land past it); any other at 1: bit for bit as without.
        big = _abs_max(v) > FLT_MAX / 4
        # (a number on a CPU, where reading it costs no device sync: then a transform at 1 is not divided by it)
        down = (0.25 if big else 1.0) if v.device.type == "cpu" else torch.where(big, 0.25, 1.0)
        v = _by_hadamard(v, _hadamard16(v.device) * down)
    if f.granularity == "tensor":
        blocks, dims = v, (0, 1, 2)
    elif rows:  # 2-D blocks: 128 (or 16) rows (outputs) x as many along the axis
        blocks, dims = v.reshape(v.shape[0] // rb, rb, kk // b, b, post), (1, 3)
    else:
        blocks, dims = v.reshape(v.shape[0], kk // b, b, post), (2,)
    q = _quantize_blocks(blocks, dims, f, generator).reshape(v.shape)
    if f.hadamard:
        q = _by_hadamard(q, _hadamard16(q.device).T)
        q = (q if isinstance(down, float) and down == 1.0 else q.div_(down)).clamp_(-FLT_MAX, FLT_MAX)
    if pad or rpad:
        q = q[:pre, :k]
    return q.reshape(shape)


def _quantize_blocks(blocks: torch.Tensor, dims: tuple[int, ...], f: formats.TensorFormat,
                     generator: torch.Generator | None) -> torch.Tensor:
    """block_quantize's rounding of FP32 `blocks`, each block the values along `dims` (kept as axes of size 1 in its
    scale): the blocks' amax, their scales, the values rounded and unscaled."""
    if f.scale_rounding == "pow2" and generator is None and _by_spacing(f.element) and \
            fused.pays(blocks, [1 if d in dims else n for d, n in enumerate(blocks.shape)]):
        # the amax, the scales and the rounding below in one compiled call
        return fused.pow2_blocks(f.element, blocks, dims, _least_scale(f.element, "pow2"),
                                 fallback=lambda: _quantize_blocks(blocks, dims, f, None))  # (fused is off then)
    if f.scale_rounding == "e4m3" and _by_spacing(f.element) and fused.on() and blocks.device.type == "cpu" \
            and blocks.numel():
        # NVFP4 whole in one compiled call: amax, two levels of scales (~30 small eager operations a tensor
        # otherwise), the rounding; where a k is not finite (a nan tensor; g so small that 1 / g / s overflows),
        # rounded to nearest as _nvfp4 rounds it there, from the same k and s x g
        bits, again = _drawn(blocks, generator) if generator is not None else (None, lambda: None)
        got = fused.nvfp4(f.element, blocks, dims, bits)
        if got is not None:
            q, k, sg, finite = got
            return q if generator is not None or bool(finite) else _nvfp4_round(blocks, k, sg, finite, f.element, None)
        generator = again()
    # nan or inf where the block holds one: a nan block (block_scale)
    amax = fused.abs_max(blocks, dims, fallback=lambda: _abs_max(blocks, dims)) if fused.pays(blocks) else \
        _abs_max(blocks, dims)
    if f.scale_rounding == "e4m3":  # NVFP4's two levels, in 16-element or 16x16 blocks
        return _nvfp4(blocks, amax, f.element, generator)
    s = block_scale(amax, f.element, f.scale_rounding)
    # A power-of-2 scale's reciprocal is exact (2^-127 .. 2^127): a multiplication, cheaper than x / s.
    back = "div" if f.scale_rounding == "exact" else "mul"
    if _by_spacing(f.element) and fused.pays(blocks, s):  # the same chain in one pass
        bits, again = _drawn(blocks, generator) if generator is not None else (None, lambda: None)
        return fused.call(f"block_{back}", f.element, blocks, s, s if back == "div" else s.reciprocal(), bits,
                          fallback=lambda: _block_round(blocks, s, f.element, back, again()))
    return _block_round(blocks, s, f.element, back, generator)


def _drawn(t: torch.Tensor, generator: torch.Generator):
    """Stochastic rounding's random bits for t (_sr_bits), drawn before the fused chain that reads them, and a
    function that puts the generator back and returns it (the eager chain, where the fused one cannot run, draws
    the same bits again)."""
    state = generator.get_state()
    bits = _sr_bits(t.shape, generator, t.device)

    def again() -> torch.Generator:
        generator.set_state(state)
        return generator
    return bits, again


def _block_round(blocks, s, fmt, back, generator):
    """blocks x s rounded to `fmt` and unscaled: divided by s (`back`="div") or multiplied by its reciprocal ("mul")."""
    y = blocks * s
    if generator is None and _by_spacing(fmt):
        q = _round_in_place(y, fmt, sign=blocks)
    else:
        q = round_to(y, fmt, generator)
    return q.div_(s) if back == "div" else q.mul_(s.reciprocal_())


def _nvfp4(blocks, amax, fmt, generator):
    """NVFP4 (arXiv 2509.25149, section 2), as torchao's nvfp4_quantize computes it: a per-tensor FP32
    decode scale g = amax(tensor) / (E2M1's max x E4M3's max) maps the blocks' scales into E4M3's range;
    each 16-element block's scale is s = e4m3(amax(block) / 6 / g), clamped to [E4M3's smallest normal,
    448] before the rounding, its elements E2M1 of x x ((1 / g) / s), decoded as e2m1 x (s x g).
    The clamp from below is torchao's: a block far quieter than the tensor (amax below ~2e-6 of it) is
    quantised at 2^-6 x g, not at a subnormal or zero scale (a zero scale made it fall back to 1: a
    block [0.5, 1, 1.5, 5] of a tensor whose max is 2688 x 1024 came back [0.5, 1, 1.5, 4], torchao's
    [0, 0, 0, 8]; tests/test_formats.py). A tensor holding inf or nan comes back nan, whole, as torchao's
    per-tensor scale makes it (its amax is inf or nan). g is at least FP32's smallest normal, so a tensor of amax below ~3e-35 is
    still quantised (torchao's g underflows there)."""
    top = formats.ELEMENTS[fmt].max
    e4m3 = formats.ELEMENTS["e4m3"]
    t_amax = amax.amax()  # nan or inf where any block holds one
    g = torch.where(t_amax > 0, t_amax / (top * e4m3.max), torch.ones_like(t_amax))
    g = g.clamp(min=torch.finfo(torch.float32).tiny).masked_fill_(~torch.isfinite(t_amax), math.nan)
    s = round_to((amax / top / g).clamp(e4m3.min_normal, e4m3.max), "e4m3")
    # A multiplication by (1 / g) / s, not a division by s x g: torchao's (and its kernels') arithmetic, bit for bit.
    k = (1.0 / g) / s
    return _nvfp4_round(blocks, k, s * g, torch.isfinite(k).all(), fmt, generator)


def _nvfp4_round(blocks, k, sg, finite, fmt, generator):
    """_nvfp4's rounding: blocks x k rounded to `fmt`, x sg (`finite`: every k is finite, a 0-dim bool tensor)."""
    # Rounded in place on y, its own temporary (round_to copies it), where y's signs are the blocks': every k
    # positive and finite (not so for a nan tensor, nor where g is so small that 1 / g / s overflows; read on a CPU
    # only, where reading it costs no device sync).
    if generator is None and _by_spacing(fmt) and blocks.device.type == "cpu" and bool(finite):
        def eager():
            return _round_in_place(blocks * k, fmt, sign=blocks).mul_(sg)
        if fused.pays(blocks, k):  # the same chain in one pass
            return fused.call("block_mul", fmt, blocks, k, sg, None, fallback=eager)
        return eager()
    if generator is not None and _by_spacing(fmt) and fused.pays(blocks, k):
        bits, again = _drawn(blocks, generator)
        return fused.call("block_mul", fmt, blocks, k, sg, bits,
                          fallback=lambda: round_to(blocks * k, fmt, again()).mul_(sg))
    return round_to(blocks * k, fmt, generator).mul_(sg)


def accumulate_linear(x: torch.Tensor, w: torch.Tensor, fmt: str) -> torch.Tensor:
    """x @ w.T with every addition of each dot product rounded to `fmt`: the running sum of the products,
    taken in order along the reduction axis, is rounded after each one (the products themselves are
    exact in FP32 for FP8 operands). Section 3.3 of the paper: "some networks require that FP16 vector
    dot-product accumulates the partial products into an FP32 value" -- summing 4096 products of 2^-10
    in FP16 stops at 2 (each addend is then half the spacing, and ties go to the even value). One
    Python step per element of the reduction axis: for demonstrations and tests, not for training."""
    p = x.float().unsqueeze(-2) * w.float()  # [..., out, K]: the products
    acc = torch.zeros(p.shape[:-1], device=p.device)
    for k in range(p.shape[-1]):
        acc = acc + p[..., k]  # FP32's own rounding
        if fmt != "fp32":
            acc = round_to(acc, fmt)
    return acc


class _FP8Operand(torch.autograd.Function):
    """Forward: an operand of a dot product rounded (E4M3 at its scale, or BF16); backward: the
    gradient passes through unchanged (straight-through) -- the gradient that reaches the
    operand was already computed from the quantised output gradient (_FP8Grad)."""

    @staticmethod
    def forward(ctx, x, quant):
        return quant(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _FP8Grad(torch.autograd.Function):
    """Forward: the dot product's output, unchanged (a copy: a later in-place op on it must not
    write into this function's output view); backward: the gradient arriving at the output rounded
    to E5M2 (or BF16) at its own scale before both backward products (input and weight gradients)
    read it, as an FP8 GEMM's backward reads it. `bias` (the product ran with it detached): its
    gradient the sum of the arriving gradient over every axis but `channel` (the output's channel
    axis), unrounded -- a bias gradient is reduced from the high-precision gradient in FP8 training
    (Transformer Engine), not from its FP8 rounding."""

    @staticmethod
    def forward(ctx, y, quant, bias=None, channel=None):
        ctx.quant, ctx.channel = quant, channel
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        return ctx.quant(g), None, _bias_grad(g, ctx.channel) if ctx.needs_input_grad[2] else None, None


class _Passes(torch.autograd.Function):
    """The products of a layer whose backward products read operands of their own (FP8Math._split).
    Forward: the value pass's output; backward: the arriving gradient rounded by quant_d to the
    data-gradient pass, by quant_w to the weight-gradient pass (None: as it arrives), and summed over
    every axis but `channel` to the bias, unrounded (_FP8Grad)."""

    @staticmethod
    def forward(ctx, value, dgrad, wgrad, quant_d, quant_w, bias=None, channel=None, both=None):
        ctx.quant_d, ctx.quant_w, ctx.channel, ctx.both = quant_d, quant_w, channel, both
        if value.requires_grad or value._is_view():  # (the data-gradient pass's own output: a copy)
            return value.detach().clone()
        # A value pass made apart (no_grad, held by no one else) is handed on as it is, marked as written here: an
        # input returned unmarked would come back as a view of it, which an in-place op after the layer may not
        # write. (A copy cost ~5 ms of a ~280 ms ResNet-50 step.)
        ctx.mark_dirty(value)
        return value

    @staticmethod
    def backward(ctx, g):
        rounded = lambda quant: g if quant is None else quant(g)  # noqa: E731
        # `both`: the two roundings at once, the same bits (FP8Math._split; None where it cannot)
        got = ctx.both(g) if ctx.both is not None and ctx.needs_input_grad[1] and ctx.needs_input_grad[2] else None
        gd, gw = got or (rounded(ctx.quant_d) if ctx.needs_input_grad[1] else None,
                         rounded(ctx.quant_w) if ctx.needs_input_grad[2] else None)
        return None, gd, gw, None, None, _bias_grad(g, ctx.channel) if ctx.needs_input_grad[5] else None, None, None


class _Alone(torch.autograd.Function):
    """A backward product with no forward of its own (FP8Math._split): forward, a stand-in of the output's
    shape that holds no memory; backward, the gradient of `live` (an operand's rounding, which passes it
    straight through) from the arriving gradient and the other operand by `product` (_backward_products).
    A product reads only `live`'s shape and layout (a data gradient, its input's; a weight gradient, its weight's),
    so `live` is not kept: the input's rounding for the forward would otherwise stay alive to the backward beside
    the rounding the weight gradient reads -- a second activation-sized tensor a layer. An uninitialised tensor of
    its shape and strides stands in for it."""

    @staticmethod
    def forward(ctx, live, other, shape, product):
        ctx.save_for_backward(other)
        ctx.live = (live.shape, live.stride(), live.dtype, live.device)
        ctx.product = product
        return other.new_zeros(()).expand(shape)

    @staticmethod
    def backward(ctx, g):
        if not ctx.needs_input_grad[0]:  # a first layer's input, a frozen weight
            return None, None, None, None
        (other,) = ctx.saved_tensors
        shape, stride, dtype, device = ctx.live
        live = _cpu_stand_in(shape, stride, dtype) if device.type == "cpu" else \
            torch.empty_strided(shape, stride, dtype=dtype, device=device)
        return ctx.product(g, live, other), None, None, None


@functools.lru_cache(maxsize=64)
def _cpu_stand_in(shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor of this shape and layout, made once (_Alone; never written): made afresh on every
    backward, its pages are mapped again wherever a product reads it (oneDNN's strided convolutions copy their input),
    which cost more than the copy of the rounding it replaces. Unread, its pages are never mapped. (A GPU's caching
    allocator hands a fresh one out at no such cost.)"""
    return torch.empty_strided(shape, stride, dtype=dtype)


_CONV_KEYS = ("stride", "padding", "dilation", "groups")  # F.convNd's arguments after the bias
_CONV_T_KEYS = ("stride", "padding", "output_padding", "groups", "dilation")  # F.conv_transposeNd's


def _backward_products(func, args, kwargs):
    """(dgrad(g, x, w), wgrad(g, w, x)): the input's and the weight's gradients of func(x, w) for the output
    gradient g, each computed alone -- a linear layer's g w and g^T x, a convolution's (transposed or not)
    through aten.convolution_backward; None for other products (recurrent layers) and for a convolution
    padded 'same' or 'valid' (their backward products run forwards of their own)."""
    if func is F.linear:
        return (lambda g, x, w: g.reshape(-1, g.shape[-1]).mm(w).reshape(x.shape),
                lambda g, w, x: g.reshape(-1, g.shape[-1]).t().mm(x.reshape(-1, x.shape[-1])))
    if func not in _CONVS and func not in _CONV_TS:
        return None
    transposed = func in _CONV_TS
    given = dict(zip(_CONV_T_KEYS if transposed else _CONV_KEYS, args[3:]))
    given.update((k, v) for k, v in kwargs.items() if k in _CONV_T_KEYS)
    if isinstance(given.get("padding", 0), str):
        return None
    n = (args[1] if len(args) > 1 else kwargs["weight"]).dim() - 2

    def each(key, default):
        v = given.get(key, default)
        return [int(i) for i in v] if isinstance(v, (tuple, list)) else [int(v)] * n

    spec = (each("stride", 1), each("padding", 0), each("dilation", 1), transposed, each("output_padding", 0),
            int(given.get("groups", 1)))

    def grads(g, x, w, mask):
        one = x.dim() == n + 1  # an unbatched input
        got = torch.ops.aten.convolution_backward(g.unsqueeze(0) if one else g, x.unsqueeze(0) if one else x, w,
                                                  None, *spec, mask)
        return got[0].squeeze(0) if mask[0] and one else got[0] if mask[0] else got[1]
    return (lambda g, x, w: grads(g, x, w, [True, False, False]),
            lambda g, w, x: grads(g, x, w, [False, True, False]))


def _bias_grad(g: torch.Tensor, channel: int) -> torch.Tensor:
    """A bias's gradient: g summed over every axis but its channel axis (`channel`, from the end)."""
    ch = channel % g.dim()
    return g.sum([d for d in range(g.dim()) if d != ch]) if g.dim() > 1 else g.clone()


def _along_batch(q, role: str, f: formats.TensorFormat, t: torch.Tensor, axis: int) -> torch.Tensor:
    """t rounded as role `role`'s quantiser q(role, axis) rounds it (format `f`) along its batch axis: every axis but
    its channel axis `axis`, flattened -- the axis a weight-gradient product reduces over.
    One block over the whole batch axis (row scales), rounded to nearest: the blocks are reduced over those axes of t
    as it lies (block_quantize's tuple axis), and only the result is laid out [batch, channels] (one copy of a
    convolution's operand, where the flattened view below is read strided). Otherwise the blocks' order along the
    flattened batch axis matters (16-element blocks; the Hadamard transform's rows; the order stochastic rounding's
    bits are drawn in): t is flattened to [channels, batch] -- with the Hadamard transform copied in that layout at
    once (a convolution's NCHW to C x NHW moves whole rows), not gathered element by element from a transposed view
    by its matrix product; the result laid out as the transposed view's would be."""
    ch = axis % t.dim()
    if f.granularity == "row" and f.rounding == "nearest" and not f.hadamard:
        q = q(role, tuple(d for d in range(t.dim()) if d != ch))(t)
        # handed on with the channel axis innermost, as the flattened layout below leaves it: a convolution's weight
        # gradient from NCHW operands is the same products summed in another order (oneDNN's), not the same bits
        return q.movedim(ch, -1).contiguous().movedim(-1, ch)
    quant = q(role, -1)
    moved = t.movedim(ch, -1)
    if f.hadamard:
        flat = t.movedim(ch, 0).reshape(t.shape[ch], -1)
    else:
        flat = moved.reshape(-1, moved.shape[-1]).t()  # [channels, batch]: blocks along the batch
    return quant(flat).t().reshape(moved.shape).movedim(-1, ch)


def _two_ways(fa: formats.TensorFormat, fb: formats.TensorFormat, t: torch.Tensor, dims_a: tuple[int, ...],
              dims_b: tuple[int, ...], inner: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """t rounded by two row-scaled roles at once, where mpt.fused's kernel for it runs (fmt.compile, a CPU): fa's
    blocks along dims_a as block_quantize makes them, fb's along dims_b (with `inner`, the batch axis around channel
    axis `inner`, as _along_batch lays it out) -- the same bits from one reading of t for both blocks' amax, the
    second written in its layout by the kernel. None where it does not run (other formats, eager): each rounding on
    its own."""
    if not (fa == fb and fa.granularity == "row" and fa.rounding == "nearest" and fa.scale_rounding == "pow2"
            and not fa.hadamard and _by_spacing(fa.element) and fused.on() and t.device.type == "cpu"
            and t.dim() >= 2 and t.numel() and t.is_contiguous()):  # (block_quantize's result is contiguous)
        return None
    x = t.float()

    def eager():
        qb = _quantize_blocks(x, dims_b, fb, None)
        return _quantize_blocks(x, dims_a, fa, None), qb if inner is None else qb.movedim(inner, -1).contiguous()
    qa, qb = fused.pow2_two_ways(fa.element, x, dims_a, dims_b, inner, _least_scale(fa.element, "pow2"), eager)
    return qa, qb if inner is None else qb.movedim(-1, inner)


def _rows_and_batch(fa: formats.TensorFormat, fb: formats.TensorFormat, t: torch.Tensor, axis: int):
    """_two_ways of an operand whose channel axis is `axis`: fa's rows along the channels (as the product that reduces
    over them rounds it) and fb's along every other axis, laid out as _along_batch lays it out; None as _two_ways."""
    ch = axis % t.dim()
    return _two_ways(fa, fb, t, (ch,), tuple(d for d in range(t.dim()) if d != ch), ch)


def _amax(t: torch.Tensor) -> torch.Tensor:
    """Largest finite |t| as an FP32 0-dim tensor (0 for an empty or all-non-finite tensor)."""
    a = t.detach().float()
    if not a.numel():
        return a.new_zeros(())
    if a.device.type == "cpu":  # one pass where every value is finite (reading it there costs no device sync)
        m = _abs_max(a)
        if math.isfinite(m):
            return m
    return a.abs().nan_to_num(nan=0.0, posinf=0.0).amax()


class FP8State:
    """The scales of a simulated FP8/FP4 precision: one slot per (layer, role) -- role "x" (the input),
    "w<i>" (a weight), "g" (the gradient of the output), each quantised as `recipe` (mpt.formats) says:
    for precision=fp8 E4M3, E4M3 and E5M2 at per-tensor scales; for the block-scaled recipes at block
    scales computed from the tensor itself (block_quantize), with no state but the stochastic rounding's
    generator.

    Per-tensor scales:
    current: each quantisation computes scale = FP8_MAX / amax(tensor) / 2^margin from the tensor
    itself (amax 0: scale 1; capped at FLT_MAX).
    delayed (Transformer Engine's DelayedScaling): each slot has an amax history of `history_len`
    entries (index 0 the newest) and a scale. During an iteration the slot's scale is fixed and the
    amax of every tensor it quantises (several per iteration for a layer called several times) is
    recorded; `update()` -- once per iteration, after the optimizer steps -- rolls the history, puts
    the iteration's amax first and recomputes scale = FP8_MAX / reduce(history) / 2^margin, with
    reduce = max (default) or most_recent, capped at FLT_MAX; where the history's amax is 0 the scale
    is kept. The scale starts at 1, before any history exists. Only training passes (grad enabled)
    record amax; evaluation uses the scales as they are. Slots are keyed by parameter names, so the
    state is checkpointed and a resumed run continues bit-identically."""

    def __init__(self, scaling: str = "delayed", history_len: int = 1024, algo: str = "max", margin: int = 0,
                 recipe: formats.FormatRecipe | None = None, seed: int = 0):
        self.scaling, self.history_len, self.algo, self.margin = scaling, int(history_len), algo, int(margin)
        self.recipe = recipe or formats.RECIPES["fp8"].with_scaling(scaling)
        self.seed = int(seed)
        self.sites: dict[int, tuple[str, bool]] = {}  # id(weight parameter) -> (layer name, in BF16)
        self.history: dict[str, torch.Tensor] = {}
        self.scale: dict[str, torch.Tensor] = {}
        self._seen: dict[str, torch.Tensor] = {}  # this iteration's amax per slot (delayed)
        self._gens: dict[str, torch.Generator] = {}  # stochastic rounding, one per device
        self._models: list = []  # (top-level model, its layers) awaiting find_ends
        self.probing = False  # find_ends is running the model: FP8Math quantises nothing meanwhile
        self.ends: set[str] = set()  # the layers found kept in BF16 (fp8.ends=bf16, keep_last), in the checkpoint
        self._resumed_ends: list | None | bool = False  # a checkpoint's ends (None: written before they were kept)
        self._ends_mode = "bf16"  # register's `ends`
        # Every product on BF16 operands: the recipe's BF16 tail (FormatRecipe.bf16_tail), set before each
        # iteration from the step (mpt.precision.BF16Tail).
        self.wide = False

    def register(self, model: nn.Module, ends: str = "bf16") -> None:
        """Find the weight-bearing layers: every module owning a parameter of 2 or more dimensions.
        Lookups (nn.Embedding) and keep_fp32 modules (with everything inside them) are layers too,
        but never quantised. With ends="bf16" the first and the last layers of each model (each entry
        of an nn.ModuleDict is a model) compute on BF16 operands instead of FP8; which they are is
        read from the model's dataflow at its first call (find_ends), since registration order says
        nothing about it (a detector's prediction convolutions are registered among its other layers,
        a classifier may be registered before the layers feeding it)."""
        self.sites, self._models, self._ends_mode = {}, [], ends
        tops = list(model.items()) if isinstance(model, nn.ModuleDict) else [("", model)]
        for prefix, top in tops:
            layers, skip = [], ()
            for name, m in top.named_modules():
                if skip and name.startswith(skip):
                    continue
                full = ".".join(x for x in (prefix, name) if x) or "root"
                if getattr(m, "keep_fp32", False):
                    layers.append((full, m, None))  # FP32 whole: nothing inside it is quantised
                    skip = name + "."
                    continue
                if isinstance(m, _LOOKUPS):
                    layers.append((full, m, None))
                    continue
                ws = [p for p in m.parameters(recurse=False) if p.dim() >= 2]
                if ws:
                    layers.append((full, m, ws))
            for full, _, ws in layers:
                for w in ws or ():
                    self.sites.setdefault(id(w), (full, False))
            if (ends == "bf16" or self.recipe.keep_last > 0) and layers:
                entry = [top, layers, None]
                entry[2] = top.register_forward_pre_hook(
                    lambda mod, args, kwargs, entry=entry: self._probe(entry, args, kwargs), with_kwargs=True)
                self._models.append(entry)

    def _probe(self, entry, args, kwargs) -> None:
        """Forward pre-hook of a model under ends=bf16, at its first call: find_ends on these inputs.
        The probe forward leaves no trace: buffers (batch-norm statistics) and every random generator
        are restored, and nothing is quantised or recorded during it."""
        if self.probing or torch.is_inference_mode_enabled():
            return  # the probe's own call; or no graph to read (the next call finds them)
        top, layers, handle = entry
        handle.remove()
        self._models.remove(entry)
        bufs = [b.detach().clone() for b in top.buffers()]
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
               random.getstate())
        self.probing = True
        order: list[str] = []
        try:
            found = self.find_ends(top, layers, args, kwargs, order)
        finally:
            self.probing = False
            with torch.no_grad():
                for b, v in zip(top.buffers(), bufs):
                    b.copy_(v)
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state_all(rng[1])
            random.setstate(rng[2])
        ends = (found if self._ends_mode == "bf16" else set()) | self.kept_last(layers, order)
        for name, _, ws in layers:
            for w in ws or ():
                if name in ends:
                    self.sites[id(w)] = (name, True)
        self.ends |= set(ends)
        self._check_resumed_ends(layers, ends)

    def _check_resumed_ends(self, layers, ends) -> None:
        """A resumed run must keep the layers its checkpoint's steps kept in BF16: ends found from the
        dataflow replaced registration order (first and last registered layer), which picked others in
        detectors and in models with auxiliary heads, under the same run id. A checkpoint written before
        the ends were recorded is checked against what registration order picked."""
        if self._resumed_ends is False:
            return  # not a resume
        was = ({layers[0][0], layers[-1][0]} if self._resumed_ends is None else set(self._resumed_ends)) & \
            {name for name, _, _ in layers}
        if was != set(ends):
            raise UserError(f"this run's checkpoint kept {sorted(was)} in BF16 (fp8.ends=bf16) but this code keeps "
                            f"{sorted(ends)}: resuming would mix two recipes in one run; finish it with the code "
                            f"that began it, or start it again in another out_dir")

    def kept_last(self, layers, order: list[str]) -> set[str]:
        """The last FormatRecipe.keep_last of the weight-bearing layers (lookups and keep_fp32 modules are not
        counted) in the order of their first call, `order` (find_ends'); the count rounded to the nearest."""
        weighted = {name for name, _, ws in layers if ws}
        seq = [n for n in order if n in weighted]
        k = math.floor(self.recipe.keep_last * len(seq) + 0.5)
        return set(seq[len(seq) - k:]) if k else set()

    @staticmethod
    def find_ends(top: nn.Module, layers, args=(), kwargs=None, order: list | None = None) -> set[str]:
        """The names of the model's end layers, from one forward on (args, kwargs) with autograd's graph
        as the dataflow: a first layer reads the model's input with no layer upstream of it; a last
        layer's output reaches no other layer's input (the FP8 paper's "first and last layers", arXiv
        2209.05433 section 4: the embedding and the classifier, every prediction convolution of a
        detection head). `layers`: (name, module, weights) as register lists them. `order`: a list given is
        filled with the layers' names in the order of their first call."""
        made: dict = {}  # grad_fn of a layer's output -> the layer
        called, upstream_of_some = set(), set()
        firsts = set()

        def upstream(tensors) -> set:
            found, seen = set(), set()
            stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
            while stack:
                n = stack.pop()
                if n is None or n in seen:
                    continue
                seen.add(n)
                if n in made:
                    found.add(made[n])  # the nearest layer on this path: do not look past it
                    continue
                stack.extend(f for f, _ in n.next_functions)
            return found

        def pre(name):
            def hook(mod, a, kw):
                ups = upstream(float_tensors(list(a) + list(kw.values()), []))
                (upstream_of_some.update(ups) if ups else firsts.add(name))
                if order is not None and name not in called:
                    order.append(name)
                called.add(name)
            return hook

        def post(name):
            def tag(t):
                if not t.is_floating_point():
                    return t
                if t.grad_fn is None:  # a frozen layer's output has no graph: give it a node to carry
                    t = t.detach().requires_grad_().clone()
                made.setdefault(t.grad_fn, name)
                return t

            def hook(mod, a, kw, out):
                return map_tensors(out, tag)
            return hook

        with TP.forward_hooks_suspended(top):  # other observers (mpt.numerics) see no probe
            for name, m, _ in layers:
                m.register_forward_pre_hook(pre(name), with_kwargs=True)
                m.register_forward_hook(post(name), with_kwargs=True)
            # Saved-tensor hooks of the innermost pair only run: an identity pair keeps the probe's
            # graph out of an activation-memory meter around the first step (mpt.memory).
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                top(*args, **(kwargs or {}))
        return firsts | (called - upstream_of_some)

    def _generator(self, device) -> torch.Generator:
        key = str(torch.device(device))
        if key not in self._gens:  # seeded, and in the checkpoint: a resume is bit-identical
            self._gens[key] = torch.Generator(device=device).manual_seed(7_919 * (self.seed + 1))
        return self._gens[key]

    def role_quantizer(self, layer: str, role: str, record: bool, axis: int):
        """The function that rounds a tensor of `layer`'s role ("x", "w<i>", "g") as the recipe says;
        `axis`: its dot product's reduction axis, along which blocks run."""
        f = self.recipe.format_of(role)
        if f.granularity == "tensor" and f.scale_rounding == "exact":
            return self.quantizer(f"{layer}:{role}", f.element, record, f.rounding == "stochastic")

        def quant(t: torch.Tensor) -> torch.Tensor:
            gen = self._generator(t.device) if f.rounding == "stochastic" else None
            return block_quantize(t, f, axis, gen)
        return quant

    def quantizer(self, key: str, fmt: str, record: bool = True, stochastic: bool = False):
        """The function that rounds a tensor of slot `key` to `fmt` at the slot's per-tensor scale;
        `record`: its amax goes into this iteration's history entry (training, not evaluation)."""
        top = formats.ELEMENTS[fmt].max / 2.0 ** self.margin

        def quant(t: torch.Tensor) -> torch.Tensor:
            if self.scaling == "current":
                # torchao's tensorwise scale: a tensor holding inf or nan has none, and comes back nan whole
                # (delayed scaling keeps its scale there and saturates, as Transformer Engine does).
                a = _abs_max(t.detach().float()) if t.numel() else t.new_zeros((), dtype=torch.float32)
                s = torch.where(a > 0, _over(top, a).clamp(max=FLT_MAX), torch.ones_like(a))
                s = s.masked_fill_(~torch.isfinite(a), math.nan)
            else:
                s = self.scale.get(key)
                if s is None:
                    s = self.scale[key] = torch.ones((), device=t.device)
                    self.history[key] = torch.zeros(self.history_len, device=t.device)
                if record:
                    a = _amax(t)
                    seen = self._seen.get(key)
                    self._seen[key] = a if seen is None else torch.maximum(seen, a)
            return fp8_quantize(t, fmt, s, self._generator(t.device) if stochastic else None)
        return quant

    @contextlib.contextmanager
    def untouched(self):
        """Passes run in this context leave the state as it was: the amaxes they record (delayed scaling's
        next history entry) and the draws of the stochastic-rounding generators are undone on exit, so a
        measurement beside training (mpt.numerics.fidelity) does not move its scales or its rounding."""
        seen = dict(self._seen)  # entries are replaced, never written in place (quantizer)
        gens = {k: g.get_state() for k, g in self._gens.items()}
        try:
            yield
        finally:
            self._seen = seen
            for k in list(self._gens):
                if k in gens:
                    self._gens[k].set_state(gens[k])
                else:  # made during the passes: the next use seeds it afresh, as it would have
                    del self._gens[k]

    def _check_resumed_recipe(self, was: dict | None) -> None:
        """A resumed run must train on the recipe its checkpoint's steps trained on: a preset changed in the
        code, or a fmt.* key whose default changed, would otherwise mix two recipes under one run id. A
        checkpoint written before the recipe was recorded is not checked."""
        now = dataclasses.asdict(self.recipe)
        if was is None or was == now:
            return
        key = next(k for k in now if was.get(k) != now[k])
        raise UserError(f"this run's checkpoint trained with format recipe {key}={was.get(key)} but this code and config "
                        f"give {key}={now[key]}: resuming would mix two recipes in one run; finish it with the code "
                        f"that began it, or start it again in another out_dir")

    def update(self) -> None:
        """Delayed scaling, once per iteration: push this iteration's amax, recompute the scales."""
        if self.scaling != "delayed":
            return
        for key, a in self._seen.items():
            h = self.history[key]
            h.copy_(torch.roll(h, 1))
            h[0] = a
            ref = h.max() if self.algo == "max" else h[0]
            top = formats.ELEMENTS[self.recipe.format_of(key.rpartition(":")[2]).element].max
            new = (_over(top, ref) / 2.0 ** self.margin).clamp(max=FLT_MAX)
            self.scale[key] = torch.where((ref > 0) & torch.isfinite(new), new, self.scale[key])
        self._seen = {}

    def state_dict(self) -> dict:
        sd = {"history": {k: v.clone() for k, v in self.history.items()},
              "scale": {k: v.clone() for k, v in self.scale.items()}, "ends": sorted(self.ends),
              "recipe": dataclasses.asdict(self.recipe)}
        if self._gens:
            sd["rng"] = {k: g.get_state() for k, g in self._gens.items()}
        return sd

    def load_state_dict(self, sd: dict, device=None) -> None:
        """`device`: where the model is. A checkpoint is read onto the CPU; scales left there would cost
        a host-device copy at every quantisation (~160 a ResNet-50 step) after a resume on CUDA."""
        self._check_resumed_recipe(sd.get("recipe"))
        self.history = {k: v.to(device).clone() for k, v in sd["history"].items()}
        self.scale = {k: v.to(device).clone() for k, v in sd["scale"].items()}
        self._resumed_ends = sd.get("ends")
        self._seen = {}
        for k, state in sd.get("rng", {}).items():
            self._generator(k).set_state(state)


# The dot products precision=fp8 quantises when one of their operands is a registered weight.
_CONVS = {F.conv1d, F.conv2d, F.conv3d}
_CONV_TS = {F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}
_RNNS = ops_of(torch, ("gru", "lstm", "rnn_tanh", "rnn_relu", "gru_cell", "lstm_cell", "rnn_tanh_cell",
                       "rnn_relu_cell"))
_FP8_OPS = {F.linear} | _CONVS | _CONV_TS | _RNNS
# Each product's reduction axis for its (input, weight, output gradient): where a block-scaled format's
# blocks run (mpt.formats). A convolution reduces over input channels (dim 1 of its input and weight;
# dim 0 of a transposed convolution's weight); the gradient of its output is cut along the output
# channels, the axis the input-gradient product reduces over.
_AXES = {**{f: (-1, -1, -1) for f in {F.linear} | _RNNS}, **{f: (1, 1, 1) for f in _CONVS},
         **{f: (1, 0, 1) for f in _CONV_TS}}
# The weight's axis the data-gradient product reduces over (its output features or channels), where the
# recipe quantises the weight again for it (FormatRecipe.w_dgrad); the products whose bias is an argument.
_DGRAD_W_AXES = {**{f: 0 for f in {F.linear} | _RNNS | _CONVS}, **{f: 1 for f in _CONV_TS}}
_BIASED = {F.linear} | _CONVS | _CONV_TS


class FP8Math(TorchFunctionMode):
    """Within this context every dot product of _FP8_OPS that reads a registered weight runs on
    quantised operands: its input (args[0]) and each registered weight rounded as the recipe's x and
    w formats say (BF16 for an end layer under fp8.ends=bf16), the FP32 kernel, and in the backward
    the gradient of its (first) output rounded as the g format says (BF16). Anything else runs as
    it would without the mode."""

    def __init__(self, state: FP8State):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _FP8_OPS or self.state.probing:
            return func(*args, **kwargs)
        sites = self.state.sites
        weights = [t for t in float_tensors(kwargs.values(), float_tensors(args, [])) if id(t) in sites]
        if not weights or "out" in kwargs:
            return func(*args, **kwargs)
        layer, keep16 = sites[id(weights[0])]
        st = self.state
        keep16 = keep16 or st.wide
        # Only training passes feed the delayed scales (autograd Functions run their forward without
        # grad, so the decision is taken here); the backward's gradient is training's by definition.
        record = torch.is_grad_enabled()
        x_axis, w_axis, g_axis = _AXES[func]
        q = (lambda role, axis: bf16_quantize) if keep16 else \
            (lambda role, axis: st.role_quantizer(layer, role, record or role[0] == "g", axis))
        x = args[0]
        split = not keep16 and st.recipe.split and record  # (no backward without grad: the value alone)
        if split:
            q = self._paired(q, func, x, weights)
        order = {id(w): i for i, w in enumerate(weights)}
        wq: dict[int, torch.Tensor] = {}  # id(weight) -> its quantised value (straight-through to it)

        def operand(t):
            if id(t) in order:
                if id(t) not in wq:
                    wq[id(t)] = _FP8Operand.apply(t, q(f"w{order[id(t)]}", w_axis))
                return wq[id(t)]
            return t

        new_args = list(map_tensors(tuple(args), operand))
        if isinstance(x, torch.Tensor) and x.is_floating_point() and id(x) not in order:
            new_args[0] = _FP8Operand.apply(x, q("x", x_axis))
        new_kwargs = map_tensors(kwargs, operand)
        grad_q = q("g", g_axis)
        # The bias's gradient is the sum of the output gradient as it arrives, not of its rounding
        # (Transformer Engine and torchao.float8 reduce it from the high-precision gradient): the products
        # get the bias detached and _FP8Grad / _Passes give it its gradient. An RNN's biases act inside its
        # kernel: left to it.
        bias, channel = None, None
        if func in _BIASED and not keep16 and record:
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(b, torch.Tensor) and b.requires_grad:
                bias, channel = b, 1 - weights[0].dim()  # the output's channel axis, from its end
                if len(new_args) > 2:
                    new_args[2] = b.detach()
                else:
                    new_kwargs["bias"] = b.detach()
        if split:
            return self._split(func, args, kwargs, new_args, new_kwargs, wq, order, q, grad_q, bias, channel)
        out = func(*new_args, **new_kwargs)
        if st.recipe.accumulate != "fp32" and not keep16:
            out = self._narrow(func, new_args, kwargs, out, weights, st.recipe.accumulate)
        if isinstance(out, torch.Tensor):
            return _FP8Grad.apply(out, grad_q, bias, channel) if out.requires_grad or bias is not None else out
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) and out[0].requires_grad:
            return (_FP8Grad.apply(out[0], grad_q, None, None), *out[1:])
        return out

    def _paired(self, q, func, x, weights):
        """`q` with the roundings a split product makes twice of one tensor taken together where _two_ways can: the
        input along its channels (x) and along its batch (xw), the one weight for the forward (w0) and for the data
        gradient (wd0) -- both computed here, then handed out by role, the same bits as each on its own."""
        r, ready = self.state.recipe, {}
        x_axis, w_axis, _ = _AXES[func]
        if r.wgrad == "own" and isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 2:
            got = _rows_and_batch(r.roles["x"], r.roles["xw"], x.detach(), x_axis)
            if got is not None:
                ready["x"], ready["xw"] = got
        if r.w_dgrad is not None and len(weights) == 1 and func in _DGRAD_W_AXES and weights[0].dim() >= 2:
            w = weights[0]
            got = _two_ways(r.roles["w"], r.roles["wd"], w.detach(), (w_axis % w.dim(),), (_DGRAD_W_AXES[func] % w.dim(),))
            if got is not None:
                ready["w0"], ready["wd0"] = got
        if not ready:
            return q
        return lambda role, axis: (lambda t: ready[role]) if role in ready else q(role, axis)

    def _split(self, func, args, kwargs, new_args, new_kwargs, wq, order, q, grad_q, bias, channel):
        """A product whose backward products read operands of their own (FormatRecipe.w_dgrad, wgrad):
        each of the three runs on its own operands, joined by _Passes --
          value: the quantised input and weights (new_args: the forward's output);
          data gradient: the output gradient rounded by grad_q against the weights as w_dgrad rounds them
            (or the forward's), the parameters detached;
          weight gradient: the weights' gradient from the input and output gradient as wgrad says --
            shared: the forward's quantised input and grad_q's rounding; high: both unquantised; own: both
            quantised again along the batch axis (every axis but their channel axis) -- the input and
            any recurrent state detached.
        A linear layer's or convolution's backward products are computed alone (_Alone: no forward runs for
        them); a recurrent layer's run forwards of their own -- its weight-gradient product the quantised
        weights on its own input (the state inside its kernel is that input's), its biases taking their
        gradient from it: the simulation's cost, not the numerics'."""
        r = self.state.recipe
        params = {id(t) for t in float_tensors(kwargs.values(), float_tensors(args, []))
                  if isinstance(t, nn.Parameter) or id(t) in order}
        params |= {id(v) for v in wq.values()} | ({id(bias)} if bias is not None else set())
        x_q, x = new_args[0], args[0]
        x_axis, _, g_axis = _AXES[func]  # the channel axes of x and g

        def call(first, sub, rest):
            more = map_tensors(rest, sub)
            return func(first, *more[0], **more[1])

        quantised = (tuple(new_args[1:]), new_kwargs)  # the weights rounded (straight-through), the bias detached
        constant = lambda t: t.detach() if id(t) in params else t  # noqa: E731
        alone = _backward_products(func, args, kwargs) if len(wq) == 1 else None
        if r.w_dgrad is None:
            value = dgrad = call(x_q, constant, quantised)
        else:
            axis = _DGRAD_W_AXES[func]
            wd = lambda t: q(f"wd{order[id(t)]}", axis)(t.detach()) if id(t) in order else constant(t)  # noqa: E731
            if alone is None:
                dgrad = call(x_q, wd, (tuple(args[1:]), kwargs))
            with torch.no_grad():
                value = call(x_q.detach(), constant, quantised)
            if alone is not None:
                w = next(t for t in float_tensors(kwargs.values(), float_tensors(args, [])) if id(t) in order)
                dgrad = _Alone.apply(x_q, wd(w), value.shape, alone[0])
        quant_w, both = grad_q, None
        if r.wgrad == "high":
            x_w, quant_w = x.detach(), None
        elif r.wgrad == "own":
            x_w = _along_batch(q, "xw", r.roles["xw"], x.detach(), x_axis)
            quant_w = lambda g: _along_batch(q, "gw", r.roles["gw"], g, g_axis)  # noqa: E731
            # the output gradient along its channels (grad_q) and along its batch (quant_w), at once
            both = lambda g: _rows_and_batch(r.roles["g"], r.roles["gw"], g, g_axis)  # noqa: E731
        else:
            x_w = x_q.detach()
        if alone is not None:  # a linear layer, a convolution: no forward for it
            wgrad = _Alone.apply(next(iter(wq.values())), x_w, value.shape, alone[1])
        else:
            # The weights' roundings pass the gradient straight through to them, an RNN's biases take theirs
            # here; anything else (state) is detached.
            wgrad = call(x_w, lambda t: t if id(t) in params and t.requires_grad else t.detach(), quantised)
        if isinstance(value, torch.Tensor):
            return _Passes.apply(value, dgrad, wgrad, grad_q, quant_w, bias, channel, both)
        return tuple(_Passes.apply(v, d, w, *((grad_q, quant_w, None, None, both) if i == 0 else (None,) * 5))
                     if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                     for i, (v, d, w) in enumerate(zip(value, dgrad, wgrad)))

    @staticmethod
    def _narrow(func, args, kwargs, out, weights, fmt):
        """The forward value of a linear layer whose dot products accumulate in `fmt` (accumulate_linear),
        the bias added after; its gradients are the FP32 product's (straight-through)."""
        if func is not F.linear:
            raise NotImplementedError(f"accumulation in {fmt} is simulated for linear layers only, not "
                                      f"{getattr(func, '__name__', func)}")
        x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        with torch.no_grad():
            narrow = accumulate_linear(x, w, fmt)
            if b is not None:
                narrow = narrow + b
        return out + (narrow - out).detach()

