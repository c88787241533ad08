"""What each number format would do to this model, from one FP32 pass: for every module (mpt.bands.hook_targets)
its forward outputs, weights, output gradients and weight gradients are rounded to each format of
mpt.bands.FORMATS, in FP64, and compared with themselves: the share of non-zero values flushed to zero, the
share above the format's largest value (inf, or saturated where the format's casts saturate), and the SQNR
(signal over rounding noise, dB). Nothing is trained: the question is what storing these very values would lose.

A format is read from its FORMATS row (min_subnormal, min_normal, max, mantissa, and optionally "block": values
sharing one scale), so a row added there is examined here too. How a format is scaled:
  fp16        gradients at each loss scale S of a sweep (section 3.2), the rest as they are
  bf16        as they are (FP32's exponent range)
  any other   each tensor (each block of `block` values) at its own scale, max / amax, as mpt.fp8's current
              scaling does; the casts saturate (mpt.fp8)
"""
from __future__ import annotations

import copy
import math

import torch

from mpt.bands import FORMATS, hook_targets, tensors_in
from mpt.doctor.targets import Patient, call_loss
from mpt.doctor.verdict import label, pct
from mpt.fp8 import FP8Math, FP8State
from mpt.ranks import to_device

KINDS = ("activations", "weights", "activation grads", "weight grads")
GRADS = KINDS[2:]
SWEEP = tuple(2.0**k for k in range(-24, 25, 2))  # the loss scales tried for fp16's gradients (below 1 too:
#                                                   gradients that overflow at S = 1 need S < 1)
# The formats whose casts clip to the largest value (mpt.fp8: E4M3, E5M2); the others make inf (FP16, BF16).
SATURATES = {fmt for fmt, f in FORMATS.items() if f.get("saturates")}
OK_SHARE = 1e-3  # flushed or overflowed share of non-zero values called negligible (verdict.TOLERANCE)


def scaling_of(fmt: str) -> str:
    """How a what-if row scales: an element format's range scaling (mpt.formats.Element.range_scaling), or
    "recipe" for a simulated precision of the table (its recipe's own scales, recipe_rows)."""
    return FORMATS[fmt].get("scaling") or "per_tensor" if fmt in FORMATS else "recipe"


def quantize(v: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """v (FP64) rounded to `fmt` (nearest, ties to even), and where it overflowed. Above the largest value:
    inf, or the largest value where the format's casts saturate."""
    f = FORMATS[fmt]
    a = v.abs()
    _, e = torch.frexp(a)  # a = m 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    e = (e.to(torch.int64) - 1).clamp_(min=round(math.log2(f["min_normal"])))  # subnormals: one exponent
    ulp = torch.ldexp(torch.ones_like(a), e - f["mantissa"])
    q = torch.round(a / ulp) * ulp  # torch.round: half to even
    over = (q > f["max"]) | ~torch.isfinite(a)
    q = torch.where(over, torch.full_like(q, f["max"] if fmt in SATURATES else math.inf), q)
    return torch.copysign(q, v), over


def _scaled(v: torch.Tensor, fmt: str, s: float | None) -> torch.Tensor:
    """v x its scale: S for a loss scale, max / amax per tensor or per block, 1 otherwise (returns v * scale
    and scale, broadcastable)."""
    kind = scaling_of(fmt)
    if kind == "loss_scale":
        return v * (s or 1.0), torch.tensor(s or 1.0, dtype=v.dtype, device=v.device)
    if kind == "none":
        return v, torch.ones((), dtype=v.dtype, device=v.device)
    block = FORMATS[fmt].get("block") or v.numel()
    flat = v.reshape(-1)
    pad = (-flat.numel()) % block
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, block)
    amax = blocks.abs().amax(1, keepdim=True)
    scale = torch.where(amax > 0, FORMATS[fmt]["max"] / amax, torch.ones_like(amax))
    scaled = (blocks * scale).reshape(-1)[: flat.numel()].view_as(v)
    return scaled, scale.expand_as(blocks).reshape(-1)[: flat.numel()].view_as(v)


def measure(t: torch.Tensor, fmt: str, s: float | None = None) -> dict:
    """Counts of one tensor in one format: n, nonzero, flushed, overflowed, signal and noise energy."""
    v = t.detach().to(torch.float64)
    x, scale = _scaled(v, fmt, s)
    q, over = quantize(x, fmt)
    back = q / scale
    nonzero = (v != 0) & torch.isfinite(v)
    flushed = nonzero & (q == 0)
    finite = torch.isfinite(back)
    noise = torch.where(finite, back - v, torch.zeros_like(v))
    return {"n": v.numel(), "nonzero": int(nonzero.sum()), "flushed": int(flushed.sum()),
            "overflow": int((over & nonzero).sum()), "inf": int((~finite & nonzero).sum()),
            "signal": float((v[nonzero] ** 2).sum()), "noise": float((noise**2).sum())}


def _add(acc: dict, m: dict) -> None:
    for k, v in m.items():
        acc[k] = acc.get(k, 0) + v


def _summary(c: dict) -> dict:
    nz = c.get("nonzero", 0)
    sqnr = (-math.inf if c.get("inf") else math.inf if c.get("noise", 0) == 0
            else 10 * math.log10(c["signal"] / c["noise"]) if c.get("signal") else math.inf)
    return {"flushed": c.get("flushed", 0) / nz if nz else 0.0, "overflow": c.get("overflow", 0) / nz if nz else 0.0,
            "sqnr_db": sqnr, "nonzero": nz}


def collect(patient: Patient, device="cpu", batches: int = 1) -> tuple[dict, dict]:
    """One FP32 forward and backward of a copy of the patient's model on its first batch(es): {(module, kind):
    [tensors]} for the four kinds (KINDS), on the CPU; and each module's label, "features.4 (Linear)"."""
    device = torch.device(device)
    model = copy.deepcopy(patient.model).to(device)
    names = {m: name for name, m in hook_targets(model)}
    labels = {name: f"{name} ({type(m).__name__})" for m, name in names.items()}
    got: dict = {}

    def keep(name, kind, t):
        if t.is_floating_point() and t.numel():
            got.setdefault((name, kind), []).append(t.detach().cpu())

    def hook(mod, args, out):
        ins = list(tensors_in(args))
        for t in tensors_in(out):
            if not any(t is x for x in ins):
                keep(names[mod], "activations", t)
                if t.requires_grad:
                    t.register_hook(lambda g, n=names[mod]: keep(n, "activation grads", g))

    handles = [m.register_forward_hook(hook) for m in names]
    loss_fn = patient.loss_fn()
    torch.manual_seed(patient.seed)
    try:
        for b in patient.batches[:batches]:
            out = call_loss(loss_fn, model, to_device(b, device, False), patient.name)
            (out[0] if isinstance(out, tuple) else out).backward()
    finally:
        for h in handles:
            h.remove()
    for m, name in names.items():
        for p in m.parameters(recurse=False):
            keep(name, "weights", p)
            if p.grad is not None:
                keep(name, "weight grads", p.grad)
    return got, labels


def whatif(patient: Patient, device="cpu", formats: tuple[str, ...] | None = None) -> dict:
    """Per format: per (module, kind) and per kind overall, the shares flushed and overflowed and the SQNR; for
    fp16 the loss scale of the sweep that loses least; the modules ranked by what they lose; a verdict.
    `formats`: element formats (mpt.bands.FORMATS) and simulated precisions of the table (their recipes,
    recipe_rows); default every one of both. Formats ranked by what they lose (report.json's "whatif")."""
    from mpt.precisions import FORMATS as RECIPE_ROWS

    # By default the element formats the FP16/BF16 recipes store in (scaled by S, or not at all) and the
    # simulated precisions through their recipes; an FP8 element alone is what a recipe row shows per role.
    asked = tuple(formats or (*(f for f in FORMATS if scaling_of(f) != "per_tensor"), *_distinct(RECIPE_ROWS)))
    tensors, labels = collect(patient, device)
    out = {}
    recipes = [f for f in asked if f in RECIPE_ROWS]
    if recipes:
        out.update(recipe_rows(patient, device, recipes, labels))
    for fmt in (f for f in asked if f not in RECIPE_ROWS):
        scales = SWEEP if scaling_of(fmt) == "loss_scale" else (None,)
        per_s = {}
        for s in scales:
            per: dict = {}
            for (module, kind), ts in tensors.items():
                use = s if kind in GRADS else None
                for t in ts:
                    _add(per.setdefault((module, kind), {}), measure(t, fmt, use))
            per_s[s] = per
        # An S at which a gradient overflows is out (inf: the step is skipped, or worse) whatever it keeps from
        # flushing; among the others the one that loses least, ties to the larger S (headroom aside).
        fits = [s for s in scales if not _overflows(per_s[s])] or list(scales)
        best = min(fits, key=lambda s: (_overflows(per_s[s]), _lost(per_s[s]), -(s or 0)))
        per = per_s[best]
        out[fmt] = _setting(fmt, per, best)
        out[fmt]["sweep"] = {str(s): _lost(per_s[s]) for s in scales} if len(scales) > 1 else None
        out[fmt]["verdict"] = _verdict(fmt, out[fmt], labels)
        if best not in (None, 1.0):  # what the format loses without the loss scale (the paper's point, 3.2)
            out[f"{fmt}@S=1"] = _setting(fmt, per_s[1.0], 1.0)
            out[f"{fmt}@S=1"]["verdict"] = _verdict(fmt, out[f"{fmt}@S=1"], labels)
    order = sorted(out, key=lambda f: (_lost_summary(out[f]["kinds"]),
                                       -min(k["sqnr_db"] for k in out[f]["kinds"].values())))
    return {"formats": {f: out[f] for f in order}, "order": order}


# ------------------------------------------------------------------------------------------------
# The precisions of the table that simulate a format (fp8, fp8_block, mxfp8, nvfp4, ...): measured through
# the training recipe's own quantisers (mpt.fp8.FP8State.role_quantizer under FP8Math), per role as the recipe
# rounds it -- its input x and weights w in their formats and blocks, the gradient g arriving at its output
# in its own (E5M2 for fp8; NVFP4's stochastic rounding and Hadamard transform) -- not a second copy of the
# rounding. Every weight-bearing layer is measured (fp8.ends=fp8): the ranking says whether the first and
# last layers are the ones to keep wide. Weight gradients are not rounded by these recipes (FP32 products of
# rounded operands into the FP32 master weights): their column is empty.
ROLE_KIND = {"x": "activations", "w": "weights", "g": "activation grads"}
# The operands a recipe quantises again for a backward product of its own (mpt.formats.FormatRecipe.roles):
# described in the row, not counted in its columns (the same values, rounded a second way).
OTHER_ROLES = {"wd": "weights, data-gradient product", "xw": "activations, weight-gradient product",
               "gw": "activation grads, weight-gradient product"}


def _distinct(names) -> list[str]:
    """The simulated precisions whose forward operands and output gradient are rounded differently: a preset
    that differs from an earlier one only in its backward products' own operands (fp8_rowwise_gw_hp from
    fp8_rowwise) would show the same row again."""
    from mpt import formats as fmts

    seen, out = set(), []
    for n in names:
        r = fmts.RECIPES[n]
        key = (r.x, r.w, r.g, r.scaling)
        if key not in seen:
            seen.add(key)
            out.append(n)
    return out


def recipe_rows(patient: Patient, device, names, labels: dict) -> dict:
    """{precision: setting} for precisions of the table run by the simulated-format recipe, from one FP32
    forward and backward in which every operand the recipe would round is rounded, compared with itself and
    passed on unrounded (the pass computes what FP32 computes)."""
    from mpt import formats as fmts

    device = torch.device(device)
    out = {}
    for name in names:
        acc: dict = {}
        recipe = fmts.RECIPES[name].with_scaling("current")  # one pass: no amax history to delay by
        state = _Watched(recipe, acc)
        model = copy.deepcopy(patient.model).to(device)
        state.register(model, ends="fp8")
        loss_fn = patient.loss_fn()
        torch.manual_seed(patient.seed)
        with FP8Math(state):
            o = call_loss(loss_fn, model, to_device(patient.batches[0], device, False), patient.name)
        (o[0] if isinstance(o, tuple) else o).backward()
        per = {(layer, kind): c for (layer, kind), c in acc.items()}
        r = _setting(name, per, None)
        r["not_rounded"] = ["weight grads"]
        r["roles"] = {{**ROLE_KIND, **OTHER_ROLES}[k]: _describe(f) for k, f in recipe.roles.items()}
        if recipe.wgrad == "high":
            r["roles"]["weight-gradient product"] = "unquantised operands (high precision)"
        r["blocks"] = _block_summary(acc)
        r["block_scaled"] = recipe.block_scaled
        types = {n or "root": type(m).__name__ for n, m in model.named_modules()}  # FP8State's layer names
        r["verdict"] = _verdict(name, r, {**labels, **{m: label(m, types) for m in r["modules"]}})
        out[name] = r
    return out


def _describe(f) -> str:
    """e4m3 in mx32 blocks, rceil scales: how the recipe rounds one role."""
    parts = [f.element, "per tensor" if f.granularity == "tensor" else f"{f.granularity} blocks",
             f"{f.scale_rounding} scales"]
    return ", ".join(parts + (["stochastic"] if f.rounding == "stochastic" else [])
                     + (["Hadamard-16"] if f.hadamard else []))


class _Watched(FP8State):
    """The recipe's quantisers, watched: each operand is rounded as training rounds it (record=False: no
    delayed history), compared with itself (compare), and handed on unrounded."""

    def __init__(self, recipe, acc: dict):
        super().__init__("current", recipe=recipe)
        self.acc = acc

    def role_quantizer(self, layer, role, record, axis):
        real = super().role_quantizer(layer, role, False, axis)
        base = role.rstrip("0123456789")  # "w1": a layer's second weight
        f = self.recipe.format_of(role)
        key = (layer, ROLE_KIND.get(base))

        def watch(t: torch.Tensor) -> torch.Tensor:
            if key[1] is not None:
                with torch.no_grad():
                    _add(self.acc.setdefault(key, {}), compare(t.detach(), real(t.detach()), f, axis))
            return t.clone()  # an autograd Function's forward returns a new tensor
        return watch


def compare(v: torch.Tensor, q: torch.Tensor, f, axis: int) -> dict:
    """What rounding v to q lost, as measure() counts it, plus per-block counts: blocks (of the role's
    blocks along its reduction axis; the whole axis per row for per-tensor and row scales; 1 x 128 rows of
    a 128 x 128 block), blocks where some non-zero value was flushed, blocks where every non-zero value was
    (the block's scale left nothing: an outlier or an underflowing scale), blocks with a clipped value (the
    block's largest stored value, short of the true one by more than the element's rounding allows), and the
    blocks' spread: log2(largest / smallest non-zero |value|), against what the element spans."""
    from mpt import formats as fmts

    el = fmts.ELEMENTS[f.element]
    x, y = v.double(), q.double()
    if x.dim() == 0:
        x, y = x.reshape(1), y.reshape(1)
    axis = axis % x.dim()
    k = x.shape[axis]
    x = x.reshape(math.prod(x.shape[:axis]), k, -1).transpose(1, 2).reshape(-1, k)
    y = y.reshape(math.prod(y.shape[:axis]), k, -1).transpose(1, 2).reshape(-1, k)
    b = min(f.block or k, k) if f.granularity != "tensor" else x.numel()
    x, y = x.reshape(-1), y.reshape(-1)
    pad = -x.numel() % b
    if pad:
        x, y = torch.cat([x, x.new_zeros(pad)]), torch.cat([y, y.new_zeros(pad)])
    x, y = x.view(-1, b), y.view(-1, b)
    ax, ay = x.abs(), y.abs()
    nonzero = (x != 0) & torch.isfinite(x)
    flushed = nonzero & (y == 0)
    finite = torch.isfinite(y)
    top = ay.masked_fill(~finite, 0).amax(1, keepdim=True)
    # Nearest rounding moves a value by at most half a spacing, stochastic rounding by less than one.
    slack = 2.0 ** -(el.mantissa_bits + (f.rounding == "nearest"))
    clipped = nonzero & finite & (ay == top) & (ay > 0) & (ax > ay * (1 + slack))
    noise = torch.where(finite, y - x, torch.zeros_like(x))
    nz_blocks = nonzero.any(1)
    small = ax.masked_fill(~nonzero, math.inf).amin(1)
    big = ax.masked_fill(~nonzero, 0).amax(1)
    spread = torch.log2(big[nz_blocks] / small[nz_blocks]) if nz_blocks.any() else x.new_zeros(0)
    return {"n": v.numel(), "nonzero": int(nonzero.sum()), "flushed": int(flushed.sum()),
            "overflow": int(clipped.sum()), "inf": int((~finite & nonzero).sum()),
            "signal": float((x[nonzero] ** 2).sum()), "noise": float((noise**2).sum()),
            "blocks": int(nz_blocks.sum()), "blocks_flushing": int((flushed.any(1) & nz_blocks).sum()),
            "blocks_emptied": int((nz_blocks & (flushed.sum(1) == nonzero.sum(1))).sum()),
            "blocks_clipping": int(clipped.any(1).sum()),
            "spread_over_range": int((spread > math.log2(el.max / el.min_subnormal)).sum())}


def _block_summary(acc: dict) -> dict:
    """Per kind: the share of blocks that flush a value, that lose every value, that clip, and whose spread
    exceeds what the element spans -- the per-block view a block format is judged by."""
    out = {}
    for kind in ROLE_KIND.values():
        c: dict = {}
        for (layer, k), v in acc.items():
            if k == kind:
                _add(c, {x: v[x] for x in ("blocks", "blocks_flushing", "blocks_emptied", "blocks_clipping",
                                         "spread_over_range")})
        n = c.get("blocks", 0)
        out[kind] = {"blocks": n, **{x: (c[x] / n if n else 0.0) for x in ("blocks_flushing", "blocks_emptied",
                                                                           "blocks_clipping", "spread_over_range")}}
    return out


def _setting(fmt: str, per: dict, s: float | None) -> dict:
    """One format at one scale: per kind and per module, its modules ranked by what they lose."""
    kinds = {}
    for kind in KINDS:
        acc: dict = {}
        for (module, k), c in per.items():
            if k == kind:
                _add(acc, c)
        kinds[kind] = _summary(acc)
    modules: dict = {}
    for (module, kind), c in per.items():
        modules.setdefault(module, {})[kind] = _summary(c)
    ranked = sorted(modules, key=lambda m: _module_loss(modules[m]), reverse=True)
    return {"format": fmt, "scaling": scaling_of(fmt), "loss_scale": s, "kinds": kinds, "modules": modules,
            "ranked": ranked}


def _lost(per: dict) -> float:
    """What one setting loses: the worst kind's flushed + overflowed share (all modules together)."""
    kinds: dict = {}
    for (module, kind), c in per.items():
        _add(kinds.setdefault(kind, {}), c)
    return _lost_summary({k: _summary(c) for k, c in kinds.items()})


def _overflows(per: dict) -> int:
    """How many gradient values one setting overflows (all modules together)."""
    return sum(c.get("overflow", 0) for (module, kind), c in per.items() if kind in GRADS)


def _lost_summary(kinds: dict) -> float:
    return max((k["flushed"] + k["overflow"] for k in kinds.values()), default=0.0)


def _module_loss(kinds: dict) -> tuple:
    """A module's rank key: overflow first (inf or clipped values), then the share flushed, then low SQNR."""
    return (max(k["overflow"] for k in kinds.values()), max(k["flushed"] for k in kinds.values()),
            -min(k["sqnr_db"] for k in kinds.values()))


def _verdict(fmt: str, r: dict, labels: dict) -> str:
    s = "" if r["loss_scale"] is None else f" at S = 2^{round(math.log2(r['loss_scale']))}"
    recipe = r.get("scaling") == "recipe"  # a block format's casts saturate; a share below OK_SHARE is its rounding
    over = [(m, k) for m in r["ranked"] for k, v in r["modules"][m].items() if v["overflow"] > (OK_SHARE if recipe else 0)]
    if over:
        m, k = over[0]
        verb = "clips" if fmt in SATURATES or recipe else "overflows"
        return f"not as is: {labels.get(m, m)} {verb} ({k}, {pct(r['modules'][m][k]['overflow'])}){s}; keep it wide"
    flushed = [(m, k, v["flushed"]) for m in r["ranked"] for k, v in r["modules"][m].items() if v["flushed"] > OK_SHARE]
    if flushed:
        m, k, share = max(flushed, key=lambda x: x[2])
        return f"loses values: flushes {pct(share)} of {labels.get(m, m)}'s {k}{s}"
    return f"ok{s}"


def table(w: dict) -> list[str]:
    """The one-screen table: one line per format, ranked by what it loses."""
    wide = max(9, *(len(f) for f in w["order"]))
    lines = [f"  {'format':<{wide}} {'flushed act/w/act-grad/w-grad':<29} {'over':>6} {'min SQNR':>9}  verdict"]
    for fmt in w["order"]:
        r = w["formats"][fmt]
        k = r["kinds"]
        fl = "/".join("-" if kind in r.get("not_rounded", ()) else _pct(k[kind]["flushed"]) for kind in KINDS)
        over = max(v["overflow"] for v in k.values())
        sq = min(v["sqnr_db"] for v in k.values())
        lines.append(f"  {fmt:<{wide}} {fl:<29} {_pct(over):>6} {sq:>6.1f} dB  {_short(r['verdict'], fmt)}")
    for fmt in w["order"]:  # the per-block view a block format is judged by (recipe_rows), where it loses
        b = w["formats"][fmt].get("blocks") if w["formats"][fmt].get("block_scaled") else None
        if b and any(b[k]["blocks_flushing"] for k in ROLE_KIND.values()):
            row = [" / ".join(_pct(b[k][x]) for k in ROLE_KIND.values())
                   for x in ("blocks_flushing", "blocks_emptied", "spread_over_range")]
            emptied = "" if not any(b[k]["blocks_emptied"] for k in ROLE_KIND.values()) else \
                f"; {row[1]} flush every value"
            lines.append(f"  {fmt} blocks, act / w / act-grad: {row[0]} flush a value{emptied}; {row[2]} exceed "
                         f"its span")
    return lines


def _short(verdict: str, fmt: str) -> str:
    """A verdict in the table's words: the kinds as its header abbreviates them, no S where the row names it
    (one screen)."""
    if fmt.endswith("@S=1"):
        verdict = verdict.replace(" at S = 2^0", "")
    for long, short in (("activation grads", "act-grad"), ("weight grads", "w-grad"), ("activations", "act"),
                        ("weights", "w")):
        verdict = verdict.replace(f"'s {long}", f"'s {short}").replace(f"({long},", f"({short},")
    return verdict


def _pct(x: float) -> str:
    return pct(x) if x else "0"
