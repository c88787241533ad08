"""Where values fall in a number format's range, and what FP16 does to an update: the pure measurements behind
the paper's Figures 2b and 3 (section 3), on plain tensors.

Section 3 of Micikevicius et al. argues from histograms of gradient exponents: about 5% of the Mandarin speech
model's weight-gradient values lie below 2^-24 and would become zero in FP16 (Figure 2b, the reason for FP32
master weights, section 3.1), and most of SSD's non-zero activation gradients lie below FP16's range while its
top is unused (Figure 3, the reason for loss scaling, section 3.2). No framework reports these numbers, so this
module measures them:

- `exponent_histogram` / `fp16_bands` / `format_bands`: where values fall relative to FP16's range (smallest
  subnormal 2^-24, smallest normal 2^-14, largest 65504) or another format's of FORMATS; bands by what
  round-to-nearest-even makes of each value.
- `swamping_fraction`: how many optimizer updates an FP16 weight loses in the addition, exactly (section 3.1's
  rule -- an update 2^11 times smaller than the weight -- is kept beside it as the paper's approximation: such
  updates are *potentially* lost).
- `advise_loss_scale`: the paper's rule for S (section 3.2: S x max|grad| below 65504).
- `first_nonfinite`: which parameter's gradient overflowed (for the engine's overflow report).
- `Tally`: the running counts of one layer's values (exponents, bands, largest), kept on their device: what
  mpt.numerics' sampler and the doctor's value ranges accumulate; `hook_targets` / `tensors_in`: which
  modules' outputs they measure, and the tensors in an output or an operation's arguments.

Every measurement is taken on an FP64 copy of the values (in bounded chunks), so the measurement itself cannot
underflow or overflow, and on the device where the tensor lives; one host sync per result.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from mpt import formats

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
RAW_LO, RAW_HI = -1074, 1023
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


def check_range(lo: int, hi: int) -> None:
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
    check_range(lo, hi)
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


def _update_counts(before: torch.Tensor, after: torch.Tensor, received: torch.Tensor | None) -> torch.Tensor:
    """swamping_fraction's int64 [changed, swamped, swamped_2048, update_underflow, swamped_bf16] counts of one
    chunk of flat tensors (on one device). No host sync."""
    w = before.to(torch.float64)
    u = after.to(torch.float64) - w
    abs_u = u.abs()
    changed = torch.isfinite(u) & (u != 0)
    if received is not None:
        lost = received.to(torch.float64) == w
    else:
        lost = _fp16_keeps(before.to(torch.float16), u)
    return torch.stack(
        [
            changed.sum(),
            (changed & lost).sum(),
            (changed & (abs_u < SWAMP_RATIO * w.abs())).sum(),
            (changed & (abs_u <= FP16_ROUNDS_TO_ZERO)).sum(),
            (changed & _fp16_keeps(before.to(torch.bfloat16), u, "bf16")).sum(),
        ]
    )


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
            acc += _update_counts(b_flat[i : i + _CHUNK], a_flat[i : i + _CHUNK],
                                  r_flat[i : i + _CHUNK] if r_flat is not None else None)
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



class Tally:
    """Running statistics of one layer's gradients, kept on their device until `end`:
    raw exponent counts over [RAW_LO, RAW_HI] of |g| / divisor, band counts of the stored |g|,
    the largest finite |g| / divisor, and the element count."""

    __slots__ = ("hist", "bands", "max_abs", "count")

    def __init__(self, device: torch.device):
        self.hist = torch.zeros(RAW_HI - RAW_LO + 1, dtype=torch.int64, device=device)
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
            self.hist += _exponent_counts(v, RAW_LO, RAW_HI)
            finite_max = torch.where(torch.isfinite(v), v, torch.zeros_like(v)).amax()
            torch.maximum(self.max_abs, finite_max, out=self.max_abs)
        self.count += g.numel()

    def summary(self, lo: int, hi: int, shift: int = 0, residual: float = 1.0) -> dict:
        """{"hist", "count", "frac_<band>" for each of BANDS, "nonfinite", "max_abs"}: the exponents as counts over
        bins lo..hi, each raw exponent lowered by `shift` (log2 of a loss scale the values still carry) and the
        end bins collecting everything beyond; the largest |value| divided by `residual`."""
        raw_exp = torch.arange(RAW_LO, RAW_HI + 1, dtype=torch.int64)
        target = (raw_exp - shift).clamp_(lo, hi) - lo
        hist = torch.zeros(hi - lo + 1, dtype=torch.int64).index_add_(0, target, self.hist.cpu())
        zero, under, sub, normal, nonfinite = self.bands.cpu().tolist()
        n = self.count
        fracs = dict(zip(BANDS, (zero, under, sub, normal, n - zero - under - sub - normal)))
        return {"hist": hist.tolist(), "count": n, **{f"frac_{b}": (c / n if n else 0.0) for b, c in fracs.items()},
                "nonfinite": nonfinite, "max_abs": float(self.max_abs.cpu()) / residual}

    @classmethod
    def combined(cls, tallies: Iterable[Tally]) -> Tally:
        """One tally (on the host) of all the values of `tallies`."""
        total = cls(torch.device("cpu"))
        for t in tallies:
            total.hist += t.hist.cpu()
            total.bands += t.bands.cpu()
            torch.maximum(total.max_abs, t.max_abs.cpu(), out=total.max_abs)
            total.count += t.count
        return total


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


# -- Where on a model values are measured -----------------------------------------------------------------


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
