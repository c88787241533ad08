"""The simulated formats' rounding chains fused into one pass each by torch.compile (fmt.compile; beyond the paper).

mpt.fp8's quantisers are chains of elementwise torch operations -- scale, clamp, the binade's spacing from the
exponent bits, add and subtract the nearest-even constant, copy the sign, unscale -- each a pass over an
activation-sized tensor, memory-bound on a CPU, after a reduction of |x| per block. Here each chain (and the
reduction) is one function that torch.compile (inductor, a C++ kernel on a CPU) turns into one loop: the same FP32
operations in the same order, so the same bits (checked as int32 against the eager chain in tests/test_fused.py) --
but for a NaN's sign and payload bits: a NaN stays a NaN in the same place, but which NaN comes out differs
(inductor's min and max make every NaN 0x7fffffff; torch's own kernels keep one operand's NaN or the other's
depending on whether the element falls in a vectorised stretch of the loop or its scalar tail, so their NaN's sign
varies with the position even in eager). mpt.fp8 keeps its eager code as the reference: it takes every decision
(which path, whether a tensor is finite) as before and calls in here only for the chain itself (with a power-of-2
block quantisation, pow2_blocks and pow2_two_ways, and with NVFP4, nvfp4, its amax and scales too: NVFP4's finite
check is then read from the kernel, and a tensor that fails it rounded by mpt.fp8 again), and runs its own where
compilation fails (no C++ compiler: one line on stderr, then eager).

Compiled with dynamic shapes: one compilation per kernel and tensor rank (and size-1 axes), not per shape.
The format's constants are 0-dim tensors, not Python numbers, for the same reason (a number is a guard)."""
from __future__ import annotations

import functools
import sys

import torch

from mpt import formats

_STATE = {"on": False, "failed": False}


def enable(on: bool) -> None:
    """Turn the fused quantisers on or off (mpt.precision sets it from fmt.compile)."""
    _STATE["on"] = bool(on)
    if on:
        # Each kernel is compiled once per rank and size-1 axes of its blocks (a linear layer's and a convolution's
        # differ): more than dynamo's default number of versions per function.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


def on() -> bool:
    return _STATE["on"] and not _STATE["failed"]


# Where the fused kernel pays (measured on a CPU, ResNet-50's shapes at width 0.25): a compiled call costs ~40 us
# before its loop starts, more than a chain of small tensors' passes (a 3x3 convolution's weight, a linear layer's
# input of 8k values), and inductor's loop runs along the last axis, slow where that axis is short and its scale
# varies along it (a 3x3 kernel's 9 positions after the channel axis; the eager kernels handle that better).
_LEAST = 1 << 16  # values
_SHORT = 64  # a last axis shorter than this (but 1) with a scale varying along it: eager


def pays(t: torch.Tensor, s: torch.Tensor | tuple | None = None) -> bool:
    """The fused chain is on and faster than the eager one for `t` scaled by `s` (broadcast to t's shape; or the
    shape it will have). CPU only: a GPU's compiled kernels (Triton) are not checked bit for bit against the eager
    chain here."""
    if not on() or t.device.type != "cpu" or t.numel() < _LEAST:
        return False
    last = t.shape[-1] if t.dim() else 1
    shape = s.shape if isinstance(s, torch.Tensor) else s
    return shape is None or len(shape) == 0 or shape[-1] == 1 or last == 1 or last >= _SHORT


@functools.cache
def _constants(fmt: str, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(largest value, smallest spacing's binade 2^emin, 1.5 x 2^(23 - mantissa bits), 2^-mantissa bits) of `fmt`, as
    0-dim FP32 tensors (all exact in FP32) on `device` (None: the CPU): the numbers mpt.fp8._round_in_place and
    round_by_spacing compute with. Made once per device: moving them on every call cost ~3 us each, ~700 a step."""
    if device is not None:
        return tuple(t.to(device) for t in _constants(fmt))
    e = formats.ELEMENTS[fmt]
    return (torch.tensor(float(e.max)), torch.tensor(2.0 ** e.emin), torch.tensor(1.5 * 2.0 ** (23 - e.mantissa_bits)),
            torch.tensor(2.0 ** -e.mantissa_bits))


def _binade(y):
    """The power of 2 at or below each |y| (normal FP32): y's exponent bits alone."""
    return torch.bitwise_and(y.view(torch.int32), 0x7F800000).view(torch.float32)


def _nearest(y, sign, lo, c):
    """mpt.fp8._round_in_place on a saturated y: the nearest-even multiple of its binade's spacing, signed by `sign`."""
    cc = _binade(y).clamp_min(lo) * c
    return (y + cc - cc).copysign(sign)


def _tensor(x, scale, top, lo, c):
    """fp8_quantize's nearest chain: x x scale saturated, rounded, signed by x, / scale."""
    y = (x.float() * scale).clamp(-top, top)
    return _nearest(y, x, lo, c) / scale


def _block_div(blocks, s, r, top, lo, c):
    return _nearest((blocks * s).clamp(-top, top), blocks, lo, c) / r


def _block_mul(blocks, s, r, top, lo, c):
    return _nearest((blocks * s).clamp(-top, top), blocks, lo, c) * r


def _sr(y, bits, top, lo, m):
    """mpt.fp8.round_by_spacing's stochastic branch on its drawn bits (mpt.fp8._sr_bits, in FP32): floor(|y| / u + U) x
    u, signed by y."""
    xc = y.clamp(-top, top)
    u = _binade(xc).clamp_min(lo) * m
    q = (xc.abs() / u + bits * (2.0 ** -formats.SR_BITS)) + (0.5 + 2.0 ** -(formats.SR_BITS + 1))
    return (q.floor() * u).copysign(y)


def _sr_div(blocks, s, r, bits, top, lo, m):
    return _sr(blocks * s, bits, top, lo, m) / r


def _sr_mul(blocks, s, r, bits, top, lo, m):
    return _sr(blocks * s, bits, top, lo, m) * r


def _abs_max(t, dims):
    """mpt.fp8._abs_max over `dims`: amax(|t|), the reduced axes kept -- one reading pass, no |t| in memory (a max is
    exact in any order; a NaN in a block makes its amax a NaN, as torch's does)."""
    return t.abs().amax(dim=dims, keepdim=True)


def _pow2_scales(t, dims, top, least):
    """mpt.fp8.block_scale's pow2 for the blocks of t along `dims` (the reduced axes kept), and its reciprocal: top /
    amax capped at FLT_MAX, its exponent bits, at least `least`; 1 for a zero block, NaN for a block holding inf or
    NaN."""
    amax = _abs_max(t, dims)
    s = (top / amax).clamp(max=torch.finfo(torch.float32).max)
    s = _binade(s).clamp(min=least)
    s = torch.where(amax == 0, 1.0, s)
    s = torch.where(amax < float("inf"), s, float("nan"))
    return s, s.reciprocal()


# The kernels below that compute scales and then round with them return the scales too, unused: an output is
# computed once into memory and the rounding's loop reads it there, where otherwise inductor recomputes a block's
# scale (a division, its bits, two selections) for every value of the block -- ~1.5x the kernel's time on a CPU
# (measured on ResNet-50's activations at width 0.25), and as fast as a call for the scales and another for the
# rounding without that second call's ~50 us.


def _pow2_blocks(blocks, dims, top, lo, c, least):
    """mpt.fp8's nearest block quantisation at power-of-2 scales, whole: the blocks' scales (_pow2_scales), the values
    rounded and unscaled (_block_mul); the scales returned too (above)."""
    s, r = _pow2_scales(blocks, dims, top, least)
    return _block_mul(blocks, s, r, top, lo, c), s, r


def _pow2_two_ways(t, dims_a, dims_b, inner, top, lo, c, least):
    """_pow2_blocks of t twice, its blocks along dims_a and along dims_b, from one |t|: a row-scaled recipe's two
    roundings of one tensor (a weight for the forward and for the data gradient; an input or output gradient along
    its channels and along its batch). The second laid out with axis `inner` innermost (None: as t), written so by
    the kernel's own loop rather than copied after it; the scales returned too (above)."""
    sa, ra = _pow2_scales(t, dims_a, top, least)
    sb, rb = _pow2_scales(t, dims_b, top, least)
    qb = _block_mul(t, sb, rb, top, lo, c)
    return _block_mul(t, sa, ra, top, lo, c), qb if inner is None else qb.movedim(inner, -1).contiguous(), sa, sb


def _nvfp4_scales(blocks, dims, top, top_e4m3, e4m3_max, e4m3_min, tiny, lo, c):
    """mpt.fp8._nvfp4's scales: the blocks' amax, the tensor's FP32 decode scale g, each block's E4M3 scale s (rounded
    to nearest as mpt.fp8._round_in_place rounds), the factor k = (1 / g) / s the values are multiplied by before
    rounding and s x g after."""
    amax = _abs_max(blocks, dims)
    t_amax = amax.amax()
    g = torch.where(t_amax > 0, t_amax / top_e4m3, 1.0).clamp(min=tiny)
    g = torch.where(torch.isfinite(t_amax), g, float("nan"))
    y = (amax / top / g).clamp(e4m3_min, e4m3_max)
    s = _nearest(y.clamp(-e4m3_max, e4m3_max), y, lo, c)
    return (1.0 / g) / s, s * g


def _nvfp4(blocks, dims, top, top_e4m3, e4m3_max, e4m3_min, tiny, lo, c, e2_lo, e2_c):
    """mpt.fp8._nvfp4 to nearest, whole: its scales (_nvfp4_scales), the values rounded (_block_mul), and k, s x g and
    whether every k is finite (mpt.fp8 rounds otherwise where one is not)."""
    k, sg = _nvfp4_scales(blocks, dims, top, top_e4m3, e4m3_max, e4m3_min, tiny, lo, c)
    return _block_mul(blocks, k, sg, top, e2_lo, e2_c), k, sg, torch.isfinite(k).all()


def _nvfp4_sr(blocks, dims, bits, top, top_e4m3, e4m3_max, e4m3_min, tiny, lo, c, e2_lo, e2_m):
    """_nvfp4 rounding stochastically on the drawn `bits` (_sr_mul)."""
    k, sg = _nvfp4_scales(blocks, dims, top, top_e4m3, e4m3_max, e4m3_min, tiny, lo, c)
    return _sr_mul(blocks, k, sg, bits, top, e2_lo, e2_m), k, sg, torch.isfinite(k).all()


_KERNELS = {"tensor": _tensor, "block_div": _block_div, "block_mul": _block_mul, "sr_div": _sr_div, "sr_mul": _sr_mul,
            "abs_max": _abs_max, "pow2_blocks": _pow2_blocks, "pow2_two_ways": _pow2_two_ways, "nvfp4": _nvfp4,
            "nvfp4_sr": _nvfp4_sr}


@functools.cache
def _compiled(kind: str):
    return torch.compile(_KERNELS[kind], dynamic=True)


def call(kind: str, fmt: str, *tensors, fallback):
    """The fused `kind` of mpt.fp8's chains for element format `fmt` on `tensors` (a None bits: round to nearest);
    `fallback()`, the eager chain, where compiling fails -- once, said on stderr, and eager from then on."""
    top, lo, c, m = _constants(fmt, tensors[0].device)
    args = [t for t in tensors if t is not None]
    if kind.startswith("block") and tensors[-1] is not None:  # drawn bits: the stochastic kernel
        kind = "sr" + kind[len("block"):]
    args += [top, lo, m if kind.startswith("sr") else c]
    return _run(kind, args, fallback)


def abs_max(t: torch.Tensor, dims: tuple[int, ...], fallback):
    """The blocks' amax(|t|) over `dims` (mpt.fp8._abs_max), fused; `fallback()` where compiling fails."""
    return _run("abs_max", (t, dims), fallback)


def pow2_blocks(fmt: str, blocks: torch.Tensor, dims: tuple[int, ...], least: float, fallback):
    """`blocks` rounded to `fmt` to nearest at power-of-2 scales, each block the values along `dims` (mpt.fp8's
    _quantize_blocks), fused: the amax, the scales and the rounding in one compiled call; `least`: the smallest scale
    (mpt.fp8._least_scale); `fallback()` where compiling fails."""
    top, lo, c, _ = _constants(fmt, blocks.device)
    got = _run("pow2_blocks", (blocks, dims, top, lo, c, _number(least, blocks.device)), lambda: None)
    return fallback() if got is None else got[0]


def pow2_two_ways(fmt: str, t: torch.Tensor, dims_a: tuple[int, ...], dims_b: tuple[int, ...], inner: int | None,
                  least: float, fallback):
    """pow2_blocks of `t` along dims_a and along dims_b in one compiled call (_pow2_two_ways): the two results, the
    second with axis `inner` innermost (None: t's layout); `fallback()` where compiling fails."""
    top, lo, c, _ = _constants(fmt, t.device)
    got = _run("pow2_two_ways", (t, dims_a, dims_b, inner, top, lo, c, _number(least, t.device)), lambda: None)
    return fallback() if got is None else got[:2]


def nvfp4(fmt: str, blocks: torch.Tensor, dims: tuple[int, ...], bits: torch.Tensor | None):
    """mpt.fp8._nvfp4 of `blocks` (element format `fmt`, blocks along `dims`) in one compiled call, to nearest or
    (with drawn `bits`) stochastically: (the rounded blocks, k, s x g, whether every k is finite); None where compiling
    fails."""
    e4m3 = formats.ELEMENTS["e4m3"]
    top = formats.ELEMENTS[fmt].max
    dev = blocks.device
    lo, c = _constants("e4m3", dev)[1:3]
    _, e2_lo, e2_c, e2_m = _constants(fmt, dev)
    numbers = [_number(float(x), dev) for x in (top, top * e4m3.max, e4m3.max, e4m3.min_normal,
                                                     torch.finfo(torch.float32).tiny)]
    if bits is None:
        return _run("nvfp4", (blocks, dims, *numbers, lo, c, e2_lo, e2_c), lambda: None)
    return _run("nvfp4_sr", (blocks, dims, bits, *numbers, lo, c, e2_lo, e2_m), lambda: None)


@functools.cache
def _number(x: float, device: torch.device) -> torch.Tensor:
    return torch.tensor(x, device=device)


def _run(kind: str, args, fallback):
    try:
        return _compiled(kind)(*args)
    except Exception as e:  # noqa: BLE001 -- no C++ compiler, an unsupported platform: the eager chain is the same bits
        _STATE["failed"] = True
        print(f"fmt.compile: torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
              f"the quantisers run eager (the same bits, slower)", file=sys.stderr)
        return fallback()
