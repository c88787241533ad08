"""FP16 numerics instrumentation: the measurements behind the paper's Figures 2b and 3.

Section 3 of Micikevicius et al. argues from histograms of gradient exponents: about 5% of the
Mandarin speech model's weight-gradient values lie below 2^-24 and would become zero in FP16
(Figure 2b, the reason for FP32 master weights, section 3.1), and most of SSD's non-zero activation
gradients lie below FP16's range while its top is unused (Figure 3, the reason for loss scaling,
section 3.2). No framework reports these numbers, so this module measures them:

- `exponent_histogram` / `fp16_bands`: where values fall relative to FP16's range
  (smallest subnormal 2^-24, smallest normal 2^-14, largest 65504); bands by what FP16's
  round-to-nearest-even makes of each value.
- `swamping_fraction`: how many optimizer updates an FP16 weight loses in the addition, exactly
  (section 3.1's rule -- an update 2^11 times smaller than the weight -- is kept beside it as the
  paper's approximation: such updates are *potentially* lost).
- `advise_loss_scale`: the paper's rule for S (section 3.2: S x max|grad| below 65504).
- `first_nonfinite`: which parameter's gradient overflowed (for the engine's overflow report).
- `Numerics`: samples all of the above during training every N steps and returns one flat dict
  (JSON-safe: ints, floats, lists, None, and a string under "numerics/error" only if something
  failed) for metrics.jsonl and wandb.
- `fidelity` / `FidelityObserver` (beyond the paper, numerics.sqnr_every): the SQNR of a precision's
  output and per-parameter gradients against FP32 on the same weights and batch, measured beside
  training without moving it.

Every measurement is taken on an FP64 copy of the values (in bounded chunks), so the measurement
itself cannot underflow or overflow, and on the device where the tensor lives; one host sync per
result, none inside the backward pass.
"""
from __future__ import annotations

import contextlib
import math
import random
import statistics
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mpt import formats
from mpt.errors import UserError
from mpt.ranks import rng_state, set_rng_state

# FP16's range, from the one table of formats (mpt.formats.ELEMENTS): smallest subnormal 2^-24 (smaller
# values flush to zero, section 3.1), smallest normal 2^-14, largest finite value, 10 mantissa bits.
_FP16 = formats.ELEMENTS["fp16"]
FP16_MIN_SUBNORMAL = _FP16.min_subnormal
FP16_MIN_NORMAL = _FP16.min_normal
FP16_MAX = _FP16.max
FP16_MANTISSA_BITS = _FP16.mantissa_bits
# Section 3.1: with a 10-bit mantissa an addend 2^11 = 2048 times smaller than the weight is
# potentially lost. The exact condition is |u| below half an ulp of w, 2^(floor(log2|w|) - 11),
# with ties to even (and half that below a power of two moving down): swamping_fraction rounds.
SWAMP_RATIO = 2.0 ** -(FP16_MANTISSA_BITS + 1)
# The formats a whole tensor is banded in at one scale (format_bands) and that the doctor's what-if
# examines, as rows of mpt.formats.ELEMENTS in the shape they read. E2M1 is not among them: four bits
# hold a tensor only in small blocks, each at its own scale (NVFP4, mpt.fp8.block_quantize).
FORMATS = {n: {"min_subnormal": e.min_subnormal, "min_normal": e.min_normal, "max": e.max,
               "mantissa": e.mantissa_bits, "saturates": e.saturates, "scaling": e.range_scaling}
           for n in ("fp16", "bf16", "e4m3", "e5m2") for e in [formats.ELEMENTS[n]]}


def format_thresholds(fmt: str) -> tuple[float, float, float]:
    """(rounds to zero at or below, rounds to a normal from, overflows from) for round to nearest
    even: half the smallest subnormal ties to 0 (even); the largest subnormal (odd) and the smallest
    normal tie to the normal; the largest finite value plus half its ulp ties away from it where its
    mantissa is odd -- to inf in FP16/BF16/E5M2, to a saturated maximum in the casts of mpt.fp8; E4M3's
    largest value (448) is even, the code above it a NaN, so that tie rounds down to it and a saturating
    cast keeps 448: there overflow starts just above 464 (_band_counts)."""
    e = formats.ELEMENTS[fmt]
    half_ulp_top = 2.0 ** (e.emax - e.mantissa_bits - 1)
    return e.min_subnormal / 2, e.min_normal - e.min_subnormal / 2, e.max + half_ulp_top


# Where round-to-nearest-even puts an FP16 magnitude v (exact thresholds, all representable in FP64):
# v <= 2^-25 rounds to 0 (2^-25 is the tie between 0 and 2^-24, and 0 is even); v >= 2^-14 - 2^-25
# rounds to a normal (the tie between the largest subnormal, odd, and 2^-14); v >= 65520 rounds
# to inf (the tie between 65504 and 2^16, which does not exist, so inf).
FP16_ROUNDS_TO_ZERO, FP16_ROUNDS_TO_NORMAL, FP16_ROUNDS_TO_INF = format_thresholds("fp16")


# Default exponent range of the histograms: the paper's Figures 2b and 3 draw exponents far below
# FP16's 2^-24, down to about 2^-60 by our reading of Figure 3 (an image we could not re-check here),
# so -64 leaves a margin; the end bins also count everything beyond.
HIST_LO, HIST_HI = -64, 16

BANDS = ("zero", "underflow", "subnormal", "normal", "overflow")

# floor(log2|x|) of any finite non-zero FP64 value lies in [-1074, 1023]: histograms recorded over
# this range never clamp, so they can be shifted by log2(loss scale) afterwards without loss.
_RAW_LO, _RAW_HI = -1074, 1023
# Elements converted to FP64 at a time: bounds the measurement's extra memory (32 MiB per chunk)
# even for an 800M-element softmax weight (bigLSTM, section 4.5).
_CHUNK = 1 << 22


# ---------------------------------------------------------------------------------------------
# Plain functions
# ---------------------------------------------------------------------------------------------


def _abs64_chunks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """|t| flattened, as FP64 chunks of at most _CHUNK elements (FP64 holds every FP16/BF16/FP32
    value exactly, and products with a power-of-two scale stay exact)."""
    flat = t.detach().reshape(-1)
    for i in range(0, flat.numel(), _CHUNK):
        yield flat[i : i + _CHUNK].to(torch.float64).abs_()


def _exponent_counts(v: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """int64 counts over bins lo..hi of floor(log2 v) for the finite, non-zero entries of v
    (non-negative FP64); out-of-range exponents are clamped into the end bins. No host sync."""
    nbins = hi - lo + 1
    # frexp: v = m * 2^e with m in [0.5, 1), so floor(log2 v) = e - 1 exactly (log2 rounds
    # near powers of two); it handles subnormals too.
    _, e = torch.frexp(v)
    idx = (e.to(torch.int64) - 1).clamp_(lo, hi) - lo
    keep = torch.isfinite(v) & (v > 0)
    idx = torch.where(keep, idx, torch.full_like(idx, nbins))  # zeros/non-finite -> dropped bin
    counts = torch.zeros(nbins + 1, dtype=torch.int64, device=v.device)
    # 1-D scatter_add_ is deterministic on CUDA (and, unlike bincount, does not sync the host).
    counts.scatter_add_(0, idx, torch.ones_like(idx))
    return counts[:nbins]


def _band_counts(v: torch.Tensor, fmt: str = "fp16") -> torch.Tensor:
    """int64 [zero, underflow, subnormal, normal, nonfinite] counts of v (non-negative FP64), each
    value banded by what rounding it to `fmt` gives. Overflow (rounds to inf or saturates, or
    non-finite) is the remainder: numel minus the first four."""
    to_zero, to_normal, to_inf = format_thresholds(fmt)
    normal = (v >= to_normal) & ((v <= to_inf) if formats.ELEMENTS[fmt].max_is_even else (v < to_inf))
    return torch.stack(
        [
            (v == 0).sum(),
            ((v > 0) & (v <= to_zero)).sum(),
            ((v > to_zero) & (v < to_normal)).sum(),
            normal.sum(),
            (~torch.isfinite(v)).sum(),
        ]
    )


def _check_range(lo: int, hi: int) -> None:
    if int(lo) != lo or int(hi) != hi or lo > hi:
        raise ValueError(f"histogram range lo={lo}, hi={hi}: need integers with lo <= hi")


def exponent_histogram(t: torch.Tensor, lo: int = HIST_LO, hi: int = HIST_HI) -> torch.Tensor:
    """Histogram of floor(log2|x|) over the finite, non-zero values x of `t`.

    Returns an int64 tensor of hi - lo + 1 counts on `t`'s device; bin i is exponent lo + i, so
    FP16 subnormals are bins -24..-15 and normals -14..15. Exponents below `lo` are counted in the
    first bin and exponents above `hi` in the last (the end bins are "lo or less" / "hi or more").
    Zeros and inf/nan are not counted here: `fp16_bands` counts them. Computed on FP64 copies, so
    any FP16/BF16/FP32/FP64 input is binned exactly.
    """
    _check_range(lo, hi)
    counts = torch.zeros(hi - lo + 1, dtype=torch.int64, device=t.device)
    for v in _abs64_chunks(t):
        counts += _exponent_counts(v, lo, hi)
    return counts


def format_bands(t: torch.Tensor, fmt: str = "fp16", scale: float = 1.0) -> dict[str, int]:
    """fp16_bands for any format of FORMATS (E4M3, E5M2, BF16 too): the values |x| * scale banded by
    what rounding them to `fmt` gives. For FP8, `scale` is the per-tensor scale (mpt.fp8's
    format max / amax), so format_bands(t, "e4m3", FORMATS["e4m3"]["max"] / amax) is what the simulated
    FP8 recipe keeps."""
    if fmt not in FORMATS:
        raise ValueError(f"format_bands fmt={fmt!r}: choose one of {', '.join(FORMATS)}")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"format_bands scale={scale}: need a finite positive number")
    acc = torch.zeros(5, dtype=torch.int64, device=t.device)
    for v in _abs64_chunks(t):
        if scale != 1.0:
            v.mul_(scale)
        acc += _band_counts(v, fmt)
    zero, under, sub, normal, nonfinite = acc.tolist()
    n = t.numel()
    return {"zero": zero, "underflow": under, "subnormal": sub, "normal": normal,
            "overflow": n - zero - under - sub - normal, "nonfinite": nonfinite, "total": n}


def fp16_bands(t: torch.Tensor, scale: float = 1.0) -> dict[str, int]:
    """Count the values v = |x| * scale of `t` in FP16's bands, by what storing v in FP16 (round to
    nearest, ties to even) gives -- what FP16 would hold at loss scale `scale`:

    - "zero": v == 0
    - "underflow": 0 < v <= 2^-25 (rounds to zero in FP16)
    - "subnormal": 2^-25 < v < 2^-14 - 2^-25 (rounds to a subnormal, 2^-24 .. 2^-14 - 2^-24:
      kept with fewer than 10 mantissa bits)
    - "normal": 2^-14 - 2^-25 <= v < 65520 (rounds to a normal, up to 65504)
    - "overflow": v >= 65520, inf or nan (inf in FP16)

    So 1.5 x 2^-25 is a subnormal (it rounds to 2^-24) and 65519 a normal (it rounds to 65504).
    The exponent histograms keep sharp power-of-two edges instead (bin -25 holds values that round
    up to 2^-24 as well as ones that round to 0), as the paper's Figures 2b and 3 draw them.
    Also "nonfinite" (inf/nan, a subset of "overflow") and "total" (numel). The scale is applied
    on an FP64 copy, so neither it nor the measurement underflows.
    """
    return format_bands(t, "fp16", scale)


def _fp16_keeps(w16: torch.Tensor, u: torch.Tensor, fmt: str = "fp16") -> torch.Tensor:
    """True where rounding w16 + u to FP16 (nearest, ties to even) gives w16 back: |u| below half the
    gap to w16's neighbour in u's direction, or exactly half and w16's mantissa even. Decided from
    the exact values (u FP64), not by converting the sum: torch converts FP64 to FP16 through FP32,
    which can round twice. fmt="bf16": the same for a BF16 weight w16 (BF16 tensor)."""
    f = formats.ELEMENTS[fmt]
    min_sub_exp = f.emin - f.mantissa_bits
    a = w16.abs().to(torch.float64)
    _, e = torch.frexp(a)  # a = m 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    ulp = torch.ldexp(torch.ones_like(a), (e.to(torch.int64) - 1 - f.mantissa_bits).clamp_(min=min_sub_exp))
    ulp = torch.where(a == 0, f.min_subnormal, ulp)
    # Below a normal power of two (above the smallest normal) the neighbour is half an ulp away.
    toward_zero = (u * w16.to(torch.float64)) < 0
    power_of_two = (a > f.min_normal) & (torch.ldexp(torch.ones_like(a), e.to(torch.int64) - 1) == a)
    half_gap = torch.where(toward_zero & power_of_two, ulp / 4, ulp / 2)
    even = (w16.view(torch.int16) & 1) == 0
    abs_u = u.abs()
    return (abs_u < half_gap) | ((abs_u == half_gap) & even)


def swamping_fraction(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor],
                      received: Sequence[torch.Tensor] | None = None) -> dict:
    """Section 3.1's measure of updates lost when they are added to FP16 weights.

    `before`: the weights before one optimizer step; `after`: what the optimizer computed for them
    (the update it intended, in FP32); matched by position. With update u = after - before
    (computed in FP64) and w = before:

    - "total": number of parameters; "changed": those with a finite non-zero u.
    - "swamped" / "frac_swamped" (over changed) / "frac_swamped_all" (over total): the headline, the
      updates an FP16 weight loses -- exactly:
        * with `received` (the FP16 weights after the step, fp16_pure): measured, the changed
          weights whose stored value did not move (received == before);
        * without it (FP32 master weights, which keep every update): what an FP16 weight would
          lose, fp16(fp16(w) + u) == fp16(w), the sum rounded once as FP16 addition does: u below
          half an ulp of w, 2^(floor(log2|w|) - 11), ties to even.
      "swamped_measured" says which (True: measured on FP16 weights).
    - "swamped_2048" / "frac_swamped_2048": the paper's approximation (section 3.1), changed with
      |u| < 2^-11 |w| -- *potentially* lost: it counts updates between a quarter and a half ulp
      that FP16 keeps (about 1.4x the exact count on random pairs).
    - "update_underflow" / "frac_update_underflow": changed with 0 < |u| <= 2^-25, which FP16
      cannot even represent (section 3.1's first reason, Figure 2b: they round to zero), over changed.
    - "swamped_bf16" / "frac_swamped_bf16" (beyond the paper): what a BF16 weight would
      lose, bf16(bf16(w) + u) == bf16(w), exactly (7 mantissa bits: updates below 2^-8 |w| or so;
      bf16_pure measures its own loss in "frac_swamped", on the BF16 weights it updates).

    One tensor at a time, in bounded FP64 chunks; no per-element Python; one host sync.
    """
    before, after = list(before), list(after)
    if len(before) != len(after):
        raise ValueError(f"swamping_fraction: {len(before)} tensors before the step, {len(after)} after")
    if received is not None:
        received = list(received)
        if len(received) != len(before):
            raise ValueError(f"swamping_fraction: {len(before)} tensors before the step, {len(received)} received")
    per_device: dict[torch.device, torch.Tensor] = {}
    total = 0
    for j, (b_t, a_t) in enumerate(zip(before, after)):
        r_t = received[j] if received is not None else None
        if b_t.shape != a_t.shape or (r_t is not None and r_t.shape != b_t.shape):
            raise ValueError(f"swamping_fraction: shapes differ, {tuple(b_t.shape)} vs {tuple(a_t.shape)}"
                             + (f" vs {tuple(r_t.shape)}" if r_t is not None else ""))
        total += b_t.numel()
        b_flat = b_t.detach().reshape(-1)
        a_flat = a_t.detach().reshape(-1).to(b_flat.device)
        r_flat = r_t.detach().reshape(-1).to(b_flat.device) if r_t is not None else None
        acc = per_device.setdefault(b_flat.device, torch.zeros(5, dtype=torch.int64, device=b_flat.device))
        for i in range(0, b_flat.numel(), _CHUNK):
            w = b_flat[i : i + _CHUNK].to(torch.float64)
            u = a_flat[i : i + _CHUNK].to(torch.float64) - w
            abs_u = u.abs()
            changed = torch.isfinite(u) & (u != 0)
            if r_flat is not None:
                lost = r_flat[i : i + _CHUNK].to(torch.float64) == w
            else:
                lost = _fp16_keeps(b_flat[i : i + _CHUNK].to(torch.float16), u)
            acc += torch.stack(
                [
                    changed.sum(),
                    (changed & lost).sum(),
                    (changed & (abs_u < SWAMP_RATIO * w.abs())).sum(),
                    (changed & (abs_u <= FP16_ROUNDS_TO_ZERO)).sum(),
                    (changed & _fp16_keeps(b_flat[i : i + _CHUNK].to(torch.bfloat16), u, "bf16")).sum(),
                ]
            )
    sums = [0, 0, 0, 0, 0]
    for acc in per_device.values():
        sums = [s + c for s, c in zip(sums, acc.tolist())]
    changed, swamped, swamped_2048, update_underflow, swamped_bf16 = sums
    return {
        "total": total,
        "changed": changed,
        "swamped": swamped,
        "frac_swamped": swamped / changed if changed else 0.0,
        "frac_swamped_all": swamped / total if total else 0.0,
        "swamped_measured": received is not None,
        "swamped_2048": swamped_2048,
        "frac_swamped_2048": swamped_2048 / changed if changed else 0.0,
        "update_underflow": update_underflow,
        "frac_update_underflow": update_underflow / changed if changed else 0.0,
        "swamped_bf16": swamped_bf16,
        "frac_swamped_bf16": swamped_bf16 / changed if changed else 0.0,
    }


def advise_loss_scale(max_abs_grad: float, margin: float = 2.0, max_scale: float = 2.0**24) -> float | None:
    """The paper's rule for a constant loss scale (section 3.2): the largest power of two S with
    S * max_abs_grad * margin < 65504, capped at `max_scale`.

    `max_abs_grad` is the largest true (unscaled) gradient magnitude; `margin` leaves headroom for
    larger gradients later in training. Returns `max_scale` when max_abs_grad is 0 (nothing can
    overflow), None when it is inf/nan (the true maximum is unknown: it already overflowed), and a
    power of two below 1 when even S = 1 would overflow FP16 (max_abs_grad * margin >= 65504).
    """
    m, margin, max_scale = float(max_abs_grad), float(margin), float(max_scale)
    if not math.isfinite(m):
        return None
    if m < 0:
        raise ValueError(f"advise_loss_scale max_abs_grad={m}: a magnitude cannot be negative")
    if not (math.isfinite(margin) and margin > 0):
        raise ValueError(f"advise_loss_scale margin={margin}: need a finite positive number")
    if not max_scale > 0:
        raise ValueError(f"advise_loss_scale max_scale={max_scale}: need a positive number")
    if m == 0:
        return max_scale
    k = math.floor(math.log2(FP16_MAX) - math.log2(m) - math.log2(margin))
    if k - 1 >= math.log2(max_scale):  # even allowing for rounding in the logs, S >= max_scale
        return max_scale
    k = max(k, -1070)  # keep ldexp representable; such an m is beyond FP64's range anyway

    def fits(j: int) -> bool:
        return math.ldexp(1.0, j) * m * margin < FP16_MAX

    # The logs may round across a power of two; settle the strict inequality exactly.
    while not fits(k) and k > -1070:
        k -= 1
    while fits(k + 1) and k + 1 <= math.log2(max_scale):
        k += 1
    return min(math.ldexp(1.0, k), max_scale)


def first_nonfinite(named_tensors: Iterable[tuple[str, torch.Tensor | None]]) -> str | None:
    """Name of the first gradient in `named_tensors` holding inf or nan, or None.

    Accepts (name, gradient) pairs, with None for a missing gradient, or (name, parameter) pairs
    such as model.named_parameters(): for a leaf tensor that requires grad, its `.grad` is checked.
    One host sync per device, not per tensor.
    """
    names: list[str] = []
    flags: list[torch.Tensor] = []
    for name, t in named_tensors:
        if t is not None and t.is_leaf and t.requires_grad:  # a parameter: look at its gradient
            t = t.grad
        if t is None:
            continue
        if t.is_sparse:
            t = t.coalesce().values()
        names.append(name)
        flags.append((~torch.isfinite(t.detach())).any())
    by_device: dict[torch.device, list[int]] = {}
    for i, f in enumerate(flags):
        by_device.setdefault(f.device, []).append(i)
    bad = set()
    for dev, idx in by_device.items():
        found = torch.stack([flags[i] for i in idx]).tolist()
        bad.update(i for i, b in zip(idx, found) if b)
    return names[min(bad)] if bad else None


# ---------------------------------------------------------------------------------------------
# Sampling during training
# ---------------------------------------------------------------------------------------------


class _Group:
    """Running statistics of one layer's gradients, kept on their device until `end`:
    raw exponent counts over [_RAW_LO, _RAW_HI] of |g| / divisor, band counts of the stored |g|,
    the largest finite |g| / divisor, and the element count."""

    __slots__ = ("hist", "bands", "max_abs", "count")

    def __init__(self, device: torch.device):
        self.hist = torch.zeros(_RAW_HI - _RAW_LO + 1, dtype=torch.int64, device=device)
        self.bands = torch.zeros(5, dtype=torch.int64, device=device)
        self.max_abs = torch.zeros((), dtype=torch.float64, device=device)
        self.count = 0

    def add(self, g: torch.Tensor, divisor: float) -> None:
        dev = self.hist.device
        for v in _abs64_chunks(g):
            v = v.to(dev)
            # Bands of the stored values = bands of the true gradient at the loss scale: what
            # FP16 holds (or would hold) in this backward pass.
            self.bands += _band_counts(v)
            if divisor != 1.0:
                v = v / divisor
            self.hist += _exponent_counts(v, _RAW_LO, _RAW_HI)
            finite_max = torch.where(torch.isfinite(v), v, torch.zeros_like(v)).amax()
            torch.maximum(self.max_abs, finite_max, out=self.max_abs)
        self.count += g.numel()


def tensors_in(obj: Any, max_depth: int = 4, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors in a module's output or an operation's arguments: a tensor, or nested tuples/lists/dicts
    (LSTM, detection heads), down to max_depth levels."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < max_depth and isinstance(obj, (tuple, list)):
        for x in obj:
            yield from tensors_in(x, max_depth, depth + 1)
    elif depth < max_depth and isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x, max_depth, depth + 1)


def hook_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules whose outputs are measured ("root" for the model itself): leaf modules and
    modules owning parameters directly, not nn.Identity."""
    targets = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Identity):
            continue
        is_leaf = next(module.children(), None) is None
        owns_params = next(module.parameters(recurse=False), None) is not None
        if is_leaf or owns_params:
            targets.append((name or "root", module))
    return targets


class ValueRanges:
    """Where the values themselves (not their gradients) fall relative to FP16's range, per layer:
    forward activations (`recording()`: the outputs of the modules `hook_targets` names, for every
    forward pass inside the context) and weights (`add`). An activation above 65504 is inf in FP16
    -- the forward-pass overflow of a model pretrained in BF16 or FP32 -- and one at or below 2^-25
    is zero. Counted like the gradients (FP64 copies, bands by what FP16 rounding stores); an
    output that is the unchanged input of a non-in-place module is counted once, at its producer.

    summary() -> {layer: {"count", "frac_<band>" for each of BANDS, "nonfinite", "max_abs", "hist"}}
    (hist: counts of exponents lo..hi, end bins holding everything beyond)."""

    def __init__(self, lo: int = HIST_LO, hi: int = HIST_HI):
        _check_range(lo, hi)
        self.lo, self.hi = int(lo), int(hi)
        self._groups: dict[str, _Group] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        if t.numel() == 0:
            return
        with torch.no_grad():
            group = self._groups.get(name)
            if group is None:
                group = self._groups[name] = _Group(t.device)
            group.add(t.detach(), 1.0)

    @contextlib.contextmanager
    def recording(self, model: nn.Module):
        handles = [m.register_forward_hook(self._hook(name, bool(getattr(m, "inplace", False))))
                   for name, m in hook_targets(model)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _hook(self, name: str, inplace: bool):
        def hook(mod, inputs, output):
            ins = list(tensors_in(inputs))
            for t in tensors_in(output):
                if t.is_floating_point() and (inplace or not any(t is x for x in ins)):
                    self.add(name, t)

        return hook

    def summary(self) -> dict[str, dict]:
        out = {}
        raw_exp = torch.arange(_RAW_LO, _RAW_HI + 1, dtype=torch.int64)
        target = raw_exp.clamp(self.lo, self.hi) - self.lo
        for name, g in self._groups.items():
            zero, under, sub, normal, nonfinite = g.bands.cpu().tolist()
            n = g.count
            fracs = dict(zip(BANDS, (zero, under, sub, normal, n - zero - under - sub - normal)))
            hist = torch.zeros(self.hi - self.lo + 1, dtype=torch.int64).index_add_(0, target, g.hist.cpu())
            out[name] = {"count": n, **{f"frac_{b}": (c / n if n else 0.0) for b, c in fracs.items()},
                         "nonfinite": nonfinite, "max_abs": float(g.max_abs.cpu()), "hist": hist.tolist()}
        return out


class FirstOverflow(TorchFunctionMode):
    """Which operation first makes inf/nan in a low-precision forward pass, and inside which module.

    `watching(step)` hooks every module of `model` (to know which is running) and enters this mode: until
    one is found, each torch function called inside the model's forward whose FP16/BF16 floating result
    holds inf or nan while all its floating inputs are finite is recorded as `first` = {step, module, op,
    input_max_abs}. Values that only propagate an earlier inf/nan are not (their inputs are not finite). It
    finds what module outputs cannot show: a value computed inside a module (a sum of squares in a norm
    layer) that overflows while the module's output stays finite. One host read per operation until found:
    a diagnostic (mpt.doctor), not for training runs."""

    LOW = (torch.float16, torch.bfloat16)

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.first: dict | None = None
        self._stack: list[str] = []
        self._step = 0

    @contextlib.contextmanager
    def watching(self, step: int):
        def enter(name):
            # "name (Class)"; the hook returns None, leaving the input unchanged
            return lambda mod, args: self._stack.append(f"{name} ({type(mod).__name__})")

        def leave(mod, args, out):
            if self._stack:
                self._stack.pop()  # (a hook returning a value would replace the module's output)

        handles = []
        for name, m in self.model.named_modules():
            handles += [m.register_forward_pre_hook(enter(name or "root")), m.register_forward_hook(leave)]
        self._step = step
        try:
            with self:
                yield self
        finally:
            for h in handles:
                h.remove()
            self._stack.clear()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.first is None and self._stack:
            outs = [t for t in tensors_in(out) if t.dtype in self.LOW]
            if outs and not all(bool(torch.isfinite(t).all()) for t in outs):
                ins = [t for t in tensors_in((args, tuple(kwargs.values()))) if t.is_floating_point()]
                if all(bool(torch.isfinite(t).all()) for t in ins):
                    big = max((float(t.detach().abs().max()) for t in ins if t.numel()), default=0.0)
                    self.first = {"step": self._step, "module": self._stack[-1], "op": _op_name(func),
                                  "input_max_abs": big}
        return out


def _op_name(func) -> str:
    name = getattr(func, "__name__", None) or str(func)
    owner = getattr(func, "__objclass__", None) or getattr(func, "__module__", None)
    owner = getattr(owner, "__name__", owner)
    return f"{owner}.{name}" if isinstance(owner, str) else name


def _layer_of(param_name: str) -> str:
    """Module name owning a parameter: "features.0.weight" -> "features.0"; root -> "root"."""
    return param_name.rpartition(".")[0] or "root"


class Numerics:
    """Samples the FP16 numerics of training every `every` steps (paper section 3, Figures 2b, 3).

    Expected use by the engine (one training step)::

        if num.should_sample(step):
            num.begin(step)                     # hooks on; optionally begin(step, loss_scale=S)
        loss = ...; (loss * S).backward()       # forward and backward as usual
        if num.should_sample(step):
            stats = num.end(model.named_parameters(), recipe.loss_scale)
            # optional, section 3.1: before = [w.detach().clone() for w in recipe.weights_of(opt)]
            # before the step; after it, what the optimizer computed and what the weights received:
            stats.update(num.swamping(before, recipe.params_of(opt), recipe.weights_of(opt)))
            log({"kind": "numerics", "step": step, **stats})

    `end` must run after backward and before the gradients are unscaled, clipped or stepped on
    (and before a dynamic scaler changes S): it reads `.grad` as the loss-scaled values and
    divides by `loss_scale` to get the true gradients.

    `every=0` turns sampling off and costs nothing: `should_sample` is always False, `begin`
    registers no hooks, `end` returns {}. The engine never crashes because of this class: any
    failure inside it becomes a warning and a "numerics/error" string in the returned dict.

    Activation gradients (the gradients of module outputs, Figure 3) are captured with forward
    hooks that put a tensor hook on each output, not with `register_full_backward_hook`: a full
    backward hook wraps the module's output in a view, and any later in-place op on it -- the
    ReLU(inplace=True) after every convolution in AlexNet/VGG, ResNet's `out += identity` --
    raises in the forward pass, in model code no try/except here can guard. A tensor hook
    registered before an in-place op still receives the gradient of the value before that op.
    Hooked modules: leaf modules (no children) and modules owning parameters directly; not
    nn.Identity, and an output that is the unchanged input of a non-in-place module is skipped
    (it would be counted twice). Each module output is a distinct activation, so a ReLU's output
    gradient and its convolution's are both counted in the overall histogram; a module called
    several times (shared weights, RNN steps) accumulates all its calls.
    """

    def __init__(self, model: nn.Module, every: int = 0, lo: int = HIST_LO, hi: int = HIST_HI, margin: float = 2.0):
        if int(every) != every or every < 0:
            raise UserError(f"numerics.every={every}: use a whole number of steps >= 0 (0 turns numerics off)")
        if int(lo) != lo or int(hi) != hi or lo > hi:
            raise UserError(f"numerics histogram range lo={lo}, hi={hi}: use integers with lo <= hi")
        self.model = model
        self.every = int(every)
        self.lo, self.hi = int(lo), int(hi)
        self.margin = float(margin)
        self._handles: list[Any] = []
        self._act: dict[str, _Group] = {}
        self._fwd: dict[str, _Group] = {}  # the module outputs themselves (FP8's E4M3 range)
        self._active = False
        self._generation = 0  # tensor hooks from an earlier sample find a newer generation and do nothing
        self._divisor = 1.0
        self._step: int | None = None
        self._errors: list[str] = []
        self._lock = threading.Lock()  # autograd may run hooks of different devices on different threads

    # -- sampling control ---------------------------------------------------------------------

    def should_sample(self, step: int) -> bool:
        """True on the steps to measure: every `every`-th step, starting at step 0."""
        return self.every > 0 and step % self.every == 0

    def begin(self, step: int, loss_scale: float | None = None) -> None:
        """Start sampling `step`: hook the modules so that the coming backward pass records the
        activation gradients. Give `loss_scale` (the S this backward uses) if known now; else the
        activation histograms are shifted by log2 S in `end`, exact when S is a power of two (as
        for the paper's constants and torch's dynamic scaler) and within one bin otherwise."""
        if self.every <= 0:
            return
        self._remove_hooks()
        self._act = {}
        self._fwd = {}
        self._errors = []
        self._generation += 1
        self._step = step
        self._divisor = self._scale_or_one(loss_scale) if loss_scale is not None else 1.0
        self._active = True
        try:
            for name, module in self._hook_targets():
                self._handles.append(module.register_forward_hook(self._forward_hook(name, module)))
        except Exception as e:  # noqa: BLE001 -- instrumentation must never stop training
            self._note_error("begin", e)
            self._remove_hooks()

    def end(self, named_params: Iterable[tuple[str, nn.Parameter]], loss_scale: float | None) -> dict:
        """Stop sampling; return the flat dict of this step's numerics.

        `named_params`: (name, parameter) pairs such as model.named_parameters(); each `.grad` is
        read as the loss-scaled gradient and divided by `loss_scale` (None means 1) to give the
        true weight gradient. Histograms are of true gradients (|g| / S); bands are of the stored
        values, i.e. the true gradients at scale S -- what FP16 holds at the current loss scale.
        Keys (G is "act" or "weight", L "overall" or a module name from model.named_modules(),
        "root" for the model itself):

            numerics/hist_lo, numerics/hist_hi   exponent of the first / last histogram bin
            numerics/loss_scale                  S
            numerics/G/L/hist                    list of counts, bins hist_lo..hist_hi (end bins
                                                 also hold everything beyond), non-zero finite only
            numerics/G/L/count                   number of values
            numerics/G/L/frac_{zero,underflow,subnormal,normal,overflow}   fractions of count
            numerics/G/L/nonfinite               number of inf/nan values (part of overflow)
            numerics/G/L/max_abs                 largest finite true |gradient|
            numerics/max_abs_act_grad, numerics/max_abs_weight_grad      = G/overall/max_abs
            numerics/advised_loss_scale_act, numerics/advised_loss_scale_weight   the advisor's
                                                 S for each (None if that group holds inf/nan)
            numerics/advised_loss_scale          the smaller of the two (None if either is None)
            numerics/fwd/L/...                   the same keys for the module outputs themselves
                                                 (forward values, no loss scale; beyond the paper:
                                                 FP8's E4M3 range), numerics/max_abs_fwd
            numerics/error                       only if something failed: what

        The act and fwd keys are absent if `begin` was not called for this step. Returns {} when off.
        """
        if self.every <= 0:
            return {}
        try:
            return self._end(named_params, loss_scale)
        except Exception as e:  # noqa: BLE001 -- instrumentation must never stop training
            self._note_error("end", e)
            return {"numerics/error": "; ".join(self._errors)}
        finally:
            self._remove_hooks()
            self._active = False
            self._act = {}
            self._fwd = {}

    def swamping(self, before: Sequence[torch.Tensor], after: Sequence[torch.Tensor],
                 received: Sequence[torch.Tensor] | None = None) -> dict:
        """`swamping_fraction` with keys prefixed "numerics/swamp/" (e.g. numerics/swamp/frac_swamped).
        `before`: the weights snapshotted before the optimizer step; `after`: what the optimizer
        computed for them; `received`: the weights after the step, if they are not `after` itself
        (fp16_pure: the FP16 weights, which may not have received the update). Tensors that are the
        very objects of `after` are ignored as `received` (FP32 masters receive every update: the
        loss is then what an FP16 weight would lose). On failure: {"numerics/swamp/error": ...}."""
        if self.every <= 0:
            return {}
        try:
            if received is not None and all(r is a for r, a in zip(received, after)):
                received = None
            return {f"numerics/swamp/{k}": v for k, v in swamping_fraction(before, after, received).items()}
        except Exception as e:  # noqa: BLE001 -- instrumentation must never stop training
            warnings.warn(f"numerics: swamping measure failed ({type(e).__name__}: {e})", stacklevel=2)
            return {"numerics/swamp/error": f"{type(e).__name__}: {e}"}

    # -- internals ------------------------------------------------------------------------------

    @staticmethod
    def _scale_or_one(loss_scale: Any) -> float:
        s = 1.0 if loss_scale is None else float(loss_scale)
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"loss_scale={s}: need a finite positive number")
        return s

    def _note_error(self, where: str, e: BaseException) -> None:
        msg = f"{where}: {type(e).__name__}: {e}"
        if not self._errors:  # warn once per sample, not once per layer
            warnings.warn(f"numerics: {msg} (training continues without these numbers)", stacklevel=3)
        if len(self._errors) < 5:
            self._errors.append(msg)

    def _remove_hooks(self) -> None:
        for h in self._handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._handles = []

    def _hook_targets(self) -> list[tuple[str, nn.Module]]:
        return hook_targets(self.model)

    def _forward_hook(self, name: str, module: nn.Module):
        generation = self._generation
        inplace = bool(getattr(module, "inplace", False))

        def hook(mod, inputs, output):
            if not torch.is_grad_enabled() or generation != self._generation:
                return None
            try:
                ins = None
                for t in tensors_in(output):
                    if not (t.requires_grad and t.is_floating_point()):
                        continue
                    if not inplace:
                        ins = list(tensors_in(inputs)) if ins is None else ins
                        if any(t is x for x in ins):
                            continue  # passed through unchanged: the producer already records it
                    t.register_hook(self._grad_hook(name, generation))
                    with torch.no_grad(), self._lock:  # the activation itself (forward values)
                        group = self._fwd.get(name)
                        if group is None:
                            group = self._fwd[name] = _Group(t.device)
                        group.add(t.detach(), 1.0)
            except Exception as e:  # noqa: BLE001
                self._note_error(f"forward hook {name}", e)
            return None

        return hook

    def _grad_hook(self, name: str, generation: int):
        def hook(grad):
            if generation != self._generation or not self._active:
                return None
            try:
                with torch.no_grad(), self._lock:
                    group = self._act.get(name)
                    if group is None:
                        group = self._act[name] = _Group(grad.device)
                    group.add(grad, self._divisor)
            except Exception as e:  # noqa: BLE001
                self._note_error(f"gradient hook {name}", e)
            return None  # never changes the gradient

        return hook

    def _end(self, named_params, loss_scale) -> dict:
        scale = self._scale_or_one(loss_scale)
        out: dict[str, Any] = {
            "numerics/hist_lo": self.lo,
            "numerics/hist_hi": self.hi,
            "numerics/loss_scale": scale,
        }
        # Weight gradients: per owning module, true values = stored / S (exact: FP64).
        weight: dict[str, _Group] = {}
        with torch.no_grad():
            for pname, p in named_params:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    g = g.coalesce().values()
                layer = _layer_of(pname)
                group = weight.get(layer)
                if group is None:
                    group = weight[layer] = _Group(g.device)
                group.add(g, scale)

        advised: dict[str, float | None] = {}
        groups = [("weight", weight, 1.0)]
        if self._active:
            # Hooks divided by begin's loss scale (or 1); the remaining factor is a shift.
            groups.insert(0, ("act", dict(self._act), scale / self._divisor))
        for kind, layers, residual in groups:
            shift = round(math.log2(residual))
            overall = self._emit(out, kind, layers, shift, residual)
            out[f"numerics/max_abs_{kind}_grad"] = overall
            has_nonfinite = out[f"numerics/{kind}/overall/nonfinite"] > 0
            advised[kind] = None if has_nonfinite else advise_loss_scale(overall, self.margin)
            out[f"numerics/advised_loss_scale_{kind}"] = advised[kind]
        values = list(advised.values())
        out["numerics/advised_loss_scale"] = None if None in values else min(values)
        if self._active and self._fwd:
            # Forward values: where activations lie against E4M3's range; no loss scale.
            out["numerics/max_abs_fwd"] = self._emit(out, "fwd", dict(self._fwd), 0, 1.0)
        if self._errors:
            out["numerics/error"] = "; ".join(self._errors)
        return out

    def _emit(self, out: dict, kind: str, layers: dict[str, _Group], shift: int, residual: float) -> float:
        """Write the keys of one group (act or weight); returns its overall max |gradient|."""
        nbins = self.hi - self.lo + 1
        # Raw bin i holds exponent _RAW_LO + i of |g| / divisor; the true exponent is that minus
        # `shift`, clamped into [lo, hi] -- the end bins collect everything beyond.
        raw_exp = torch.arange(_RAW_LO, _RAW_HI + 1, dtype=torch.int64)
        target = (raw_exp - shift).clamp_(self.lo, self.hi) - self.lo
        tot_hist = torch.zeros(nbins, dtype=torch.int64)
        tot_bands = torch.zeros(5, dtype=torch.int64)
        tot_count, tot_max = 0, 0.0
        rows = []
        for name, g in layers.items():
            hist = torch.zeros(nbins, dtype=torch.int64).index_add_(0, target, g.hist.cpu())
            bands = g.bands.cpu()
            max_abs = float(g.max_abs.cpu()) / residual
            rows.append((name, hist, bands, g.count, max_abs))
            tot_hist += hist
            tot_bands += bands
            tot_count += g.count
            tot_max = max(tot_max, max_abs)
        for name, hist, bands, count, max_abs in [("overall", tot_hist, tot_bands, tot_count, tot_max), *rows]:
            prefix = f"numerics/{kind}/{name}/"
            zero, under, sub, normal, nonfinite = bands.tolist()
            fracs = dict(zip(BANDS, (zero, under, sub, normal, count - zero - under - sub - normal)))
            out[prefix + "hist"] = hist.tolist()
            out[prefix + "count"] = count
            for band, c in fracs.items():
                out[prefix + f"frac_{band}"] = c / count if count else 0.0
            out[prefix + "nonfinite"] = nonfinite
            out[prefix + "max_abs"] = max_abs
        return tot_max


class NumericsObserver:
    """Numerics sampling as an observer of the training step (mpt.step.Observer's hooks): on a sampled
    iteration, for each optimizer update, the true gradients its backward produced (taken before
    unscaling, divided by that backward's S) and, around the update, what the optimizer intended
    against what the weights received (3.1); whether the update was skipped and, if so, the first
    parameter holding a non-finite gradient. With several optimizers (a GAN's phases) each update's
    keys are named numerics/<optimizer>/... and hooks restart for the next phase's backward.
    `stats` holds the current iteration's sample ({} when it is not sampled)."""

    def __init__(self, numerics: Numerics):
        self.numerics = numerics
        self.stats: dict = {}
        self._sample = False
        self._pending: dict = {}
        self._before: list = []

    def begin(self, step, micro_batches) -> None:
        self.stats = {}
        self._sample = self.numerics.should_sample(step.iteration)
        if self._sample:
            self.numerics.begin(step.iteration)

    def before_update(self, step, name: str, opt) -> None:
        if not self._sample:
            return
        model = step.model
        # The gradients of the model this optimizer trains (a GAN: its entry of the ModuleDict).
        named = list(model.named_parameters()) if len(step.optimizers) == 1 or not isinstance(model, nn.ModuleDict) \
            or name not in model else list(model[name].named_parameters(prefix=name))
        self._pending = self.numerics.end(named, step.recipe.loss_scale)
        # The trained weights (FP32 masters; fp16_pure's FP16 weights) before the update (3.1).
        self._before = [w.detach().clone() for w in step.recipe.weights_of(opt)]

    def after_update(self, step, name: str, opt, applied: bool) -> None:
        if not self._sample:
            return
        stats, self._pending = self._pending, {}
        # The update the optimizer intended (params_of) against what the weights received.
        stats.update(self.numerics.swamping(self._before, step.recipe.params_of(opt), step.recipe.weights_of(opt)))
        self._before = []
        stats["numerics/skipped"] = not applied
        if not applied:
            stats["numerics/overflow_param"] = step.recipe.last_overflow
        if len(step.optimizers) == 1:
            self.stats.update(stats)
        else:
            self.stats.update({k.replace("numerics/", f"numerics/{name}/", 1): v for k, v in stats.items()})
            self.numerics.begin(step.iteration)  # the next phase's backward

    def end(self, step) -> None:
        if self._sample and len(step.optimizers) > 1:
            self.numerics.end([], None)  # drop the hooks of a phase that never stepped


# ---------------------------------------------------------------------------------------------
# Fidelity against FP32: how far a precision moves a model's output and gradients
# ---------------------------------------------------------------------------------------------

# The line torchao draws: its MX linear-layer tests hold an E4M3 layer's output to >= 20 dB SQNR against
# high precision (FP4 elements: >= 11 dB). The summary counts the parameter gradients below it.
SQNR_LINE_DB = 20.0


def sqnr_db(ref: torch.Tensor | None, test: torch.Tensor | None) -> float:
    """Signal to quantisation-noise ratio of `test` against `ref` in dB, 10 log10(|ref|^2 / |ref - test|^2)
    summed in FP64: inf where they are identical, -inf where `test` is missing, of another shape or not
    finite (an overflow is infinite noise)."""
    if ref is None or test is None or ref.shape != test.shape or not bool(torch.isfinite(test).all()):
        return -math.inf
    noise = (ref.double() - test.double()).pow(2).sum()
    return math.inf if noise == 0 else float(10 * torch.log10(ref.double().pow(2).sum() / noise))


@contextlib.contextmanager
def _outputs_recorded(model: nn.Module, into: dict[str, list[torch.Tensor]]):
    """Every floating tensor each top-level model returns (each entry of an nn.ModuleDict is a model),
    flattened in call order into into[name] ("" for a single model)."""
    tops = list(model.items()) if isinstance(model, nn.ModuleDict) else [("", model)]
    handles = []

    def hook(name):
        def record(mod, args, out):
            into.setdefault(name, []).extend(t.detach().float().reshape(-1) for t in tensors_in(out)
                                             if t.is_floating_point())
        return record

    try:
        for name, top in tops:
            handles.append(top.register_forward_hook(hook(name)))
        yield
    finally:
        for h in handles:
            h.remove()


def fidelity(model: nn.Module, run, context, loss_scale: float = 1.0, params: dict | None = None,
             keep=contextlib.nullcontext) -> dict[str, float]:
    """How far a precision moves a model: `run(model)` once in FP32 and once inside `context` (a recipe's
    autocast()), on the same weights, batch and random draws; the SQNR in dB of what the model returns
    ("output"; "output/<name>" for each model of an nn.ModuleDict) and of each parameter's gradient
    ("grad/<parameter name>").

    `run(model)` returns a tensor whose sum is back-propagated (a loss, or an output), or {group: such a
    tensor}, each group's gradient taken for params[group] ((name, parameter) pairs: a GAN's
    discriminator loss for the discriminator's parameters); a single tensor's for every parameter.
    `loss_scale`: the low-precision pass back-propagates the loss x S and divides the gradients by S, as
    training does (section 3.2); the FP32 pass runs at S = 1.

    It leaves no trace on training: gradients are returned by torch.autograd.grad (no .grad is
    written), buffers (batch-norm statistics) and the torch and Python random streams are put back after
    each pass (each pass starts from the same streams: the same dropout masks); `keep()` is a context
    around each pass that puts back whatever else a pass changes (a recipe's recorded amaxes and
    stochastic-rounding generators, Recipe.untouched; a task's recurrent state), so that both passes
    start from the state training is in."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    bufs = [b.detach().clone() for b in model.buffers()]
    rng, py_rng = rng_state(device), random.getstate()

    def put_back():  # the random streams and buffers training left: before each pass, and at the end
        set_rng_state(rng, device)
        random.setstate(py_rng)
        with torch.no_grad():
            for b, v in zip(model.buffers(), bufs):
                b.copy_(v)

    outs: list[dict] = []
    grads: list[dict] = []
    try:
        for ctx, scale in ((contextlib.nullcontext(), 1.0), (context, float(loss_scale))):
            put_back()
            recorded: dict[str, list[torch.Tensor]] = {}
            got: dict[str, torch.Tensor] = {}
            with keep(), _outputs_recorded(model, recorded):
                with ctx:
                    out = run(model)
                losses = out if isinstance(out, dict) else {None: out}
                groups = params if isinstance(out, dict) else {None: list(model.named_parameters())}
                todo = [(k, loss) for k, loss in losses.items() if loss.requires_grad]
                for i, (k, loss) in enumerate(todo):
                    named = [(n, p) for n, p in groups[k] if p.requires_grad]
                    gs = torch.autograd.grad(loss.float().sum() * scale, [p for _, p in named],
                                             retain_graph=i < len(todo) - 1, allow_unused=True)
                    got.update({n: g.float() / scale for (n, _), g in zip(named, gs) if g is not None})
                del out, losses, todo
            outs.append({k: torch.cat(v) if v else torch.zeros(0) for k, v in recorded.items()})
            grads.append(got)
    finally:
        put_back()
    res = {}
    for k, ref in outs[0].items():
        res[f"output/{k}" if k else "output"] = sqnr_db(ref, outs[1].get(k))
    res.update({f"grad/{n}": sqnr_db(g, grads[1][n]) for n, g in grads[0].items() if n in grads[1]})
    return res


def sqnr_summary(res: dict[str, float]) -> dict[str, float | int]:
    """min and median of the parameter-gradient SQNRs of fidelity()'s result (NaNs left out), how many
    there are and how many lie below torchao's 20 dB."""
    vals = [v for k, v in res.items() if k.startswith("grad/") and not math.isnan(v)]
    return {"grad_min": min(vals, default=math.nan), "grad_median": statistics.median(vals) if vals else math.nan,
            "grad_count": len(vals), "grad_below_20db": sum(v < SQNR_LINE_DB for v in vals)}


class FidelityObserver:
    """numerics.sqnr_every=N as an observer of the training step (mpt.step.Observer's hooks): every N
    iterations, before the first forward, fidelity() on the iteration's first micro-batch -- the task's
    measured_loss in FP32 and in the run's precision on the weights about to be trained -- logged as
    numerics/sqnr/output (numerics/sqnr/output/<model> for each model of a GAN), numerics/sqnr/grad/<name>
    per parameter, and the summary over parameters (sqnr_summary: numerics/sqnr/grad_min, grad_median,
    grad_count, grad_below_20db). The measurement leaves the training as it was, bit for bit
    (fidelity's guarantees, the recipe's untouched() and the task's own state put back). It runs before
    numerics sampling's hooks are on, so numerics.every's histograms do not count its passes; any
    failure becomes numerics/sqnr/error, never a stopped run. `stats` holds the current iteration's
    sample ({} when it is not sampled)."""

    def __init__(self, task, every: int):
        self.task, self.every = task, int(every)
        self.stats: dict = {}

    def begin(self, step, micro_batches) -> None:
        self.stats = {}
        if not (self.every > 0 and step.iteration % self.every == 0 and micro_batches):
            return
        model, recipe, batch = step.model, step.recipe, micro_batches[0]
        ids = {name: {id(p) for g in opt.param_groups for p in g["params"]} for name, opt in step.optimizers.items()}
        params = {name: [(n, p) for n, p in model.named_parameters() if id(p) in own] for name, own in ids.items()}
        try:
            res = fidelity(model, lambda m: self.task.measured_loss(m, batch), recipe.autocast(),
                           loss_scale=recipe.loss_scale, params=params, keep=lambda: self._kept(recipe))
        except Exception as e:  # noqa: BLE001 -- instrumentation must never stop training
            warnings.warn(f"numerics: SQNR measurement failed ({type(e).__name__}: {e})", stacklevel=2)
            self.stats = {"numerics/sqnr/error": f"{type(e).__name__}: {e}"}
            return
        res.update(sqnr_summary(res))
        self.stats = {f"numerics/sqnr/{k}": v for k, v in res.items()}

    @contextlib.contextmanager
    def _kept(self, recipe):
        """The recipe's and the task's state as they were before the measurement (the task's is its
        checkpoint state, which resumes a run bit-identically: the bigLSTM's recurrent state)."""
        import copy

        task_state = copy.deepcopy(self.task.state_dict())
        try:
            with recipe.untouched():
                yield
        finally:
            if task_state is not None:
                self.task.load_state_dict(task_state)

    def before_update(self, step, name, opt) -> None: ...

    def after_update(self, step, name, opt, applied) -> None: ...

    def end(self, step) -> None: ...
