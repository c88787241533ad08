"""The heuristics that turn the replays' measurements into advice: per-layer findings (forward values and
gradients against FP16's range, the usable loss-scale range, the update's swamping), the recipe to use and
why, and whether the replay of that recipe confirms it. Plain functions of the dicts replay.train returns."""
from __future__ import annotations

import math
import re

from mpt.bands import FP16_ROUNDS_TO_INF, HIST_LO, advise_loss_scale
from mpt.config import Config
from mpt.doctor.replay import progress, unjudged

TOLERANCE = 1e-3  # a share of non-zero values flushed to zero that we call negligible
MARGIN = 2.0  # headroom of the advised static S: S x max|gradient| x MARGIN < 65504 (section 3.2)
MAX_SCALE = 2.0**24  # the largest S advised (advise_loss_scale's cap; the paper's largest was 32K)
SWAMP_MATTERS = 0.01  # FP16 weights losing more than 1% of the updates: the FP32 master copy matters
LOST_OK = 0.01  # when no S fits, a share flushed at the largest safe S that FP16 + dynamic S may still accept
CONFIRM = 0.8  # a replay reaching 80% of FP32's progress over the same steps confirms a recipe
WIDE = 16.0  # a static S is advised when the usable range spans at least this factor; else dynamic


def pct(x: float | None) -> str:
    """A share as the verdict's reasons and the report print it: two significant digits below 0.1%."""
    return "n/a" if x is None else f"{100 * x:.1f}%" if abs(x) >= 0.001 or x == 0 else f"{100 * x:.2g}%"


def pow2(s: float | None) -> str:
    """A loss scale as 2^k (a power of two, as every S the doctor advises) or as its value."""
    if s is None:
        return "none"
    k = math.log2(s)
    return f"2^{round(k)}" if k == round(k) else f"{s:g}"


def label(layer: str | None, types: dict) -> str | None:
    """A layer as the report names it: its path and class, "features.4 (Linear)" -- a bare index inside an
    nn.Sequential ("4") says nothing on its own."""
    t = types.get(layer)
    return f"{layer} ({t})" if t and layer is not None else layer


def _flushed_at(hist: list[int], k: int, lo: int = HIST_LO) -> int:
    """Non-zero values of a true-gradient exponent histogram that FP16 stores as zero at S = 2^k: exponent
    at most -26 - k (below 2^-25 / S; a value in [2^-25, 2^-24) x S rounds up to 2^-24, and only 2^-25 itself
    rounds to zero, which this leaves out)."""
    cut = -26 - k - lo
    return sum(hist[: cut + 1]) if cut >= 0 else 0


def _gradients(samples: list[dict]) -> dict:
    """Per (kind, layer) over every sampled step: counts, zeros, FP16 underflow at S = 1 (exact bands:
    the FP32 run's S is 1), non-finite, max |g|, and the summed exponent histogram."""
    acc: dict = {}
    for s in samples:
        for key, v in s.items():
            m = re.match(r"^numerics/(act|weight)/(.+)/count$", key)
            if not m:
                continue
            kind, layer = m.groups()
            p = f"numerics/{kind}/{layer}/"
            a = acc.setdefault((kind, layer), {"count": 0, "zero": 0.0, "underflow": 0.0, "overflow": 0.0,
                                               "max_abs": 0.0, "hist": None})
            a["count"] += v
            for band in ("zero", "underflow", "overflow"):
                a[band] += s[p + f"frac_{band}"] * v
            a["max_abs"] = max(a["max_abs"], s[p + "max_abs"])
            h = s[p + "hist"]
            a["hist"] = h if a["hist"] is None else [x + y for x, y in zip(a["hist"], h)]
    out = {}
    for (kind, layer), a in acc.items():
        nonzero = a["count"] - round(a["zero"])
        out.setdefault(kind, {})[layer] = {
            "count": a["count"], "frac_zero": a["zero"] / a["count"] if a["count"] else 0.0,
            "flushed_s1": a["underflow"] / nonzero if nonzero else 0.0, "overflow_s1": a["overflow"] / a["count"]
            if a["count"] else 0.0, "max_abs": a["max_abs"], "hist": a["hist"], "nonzero": sum(a["hist"] or [])}
    return out


MIN_SCALE = 2.0**-24  # the smallest S searched: gradients that overflow at S = 1 need S < 1 (section 3.2 read down)


def _smallest_scale(hist: list[int], tol: float) -> float | None:
    """The smallest power of two S in MIN_SCALE .. MAX_SCALE at which at most `tol` of the histogram's values
    flush to zero (None: not even at MAX_SCALE)."""
    n = sum(hist)
    for k in range(round(math.log2(MIN_SCALE)), round(math.log2(MAX_SCALE)) + 1):
        if n == 0 or _flushed_at(hist, k) <= tol * n:
            return 2.0**k
    return None


def _overflow_at(max_abs: float) -> float | None:
    """The smallest power of two S at which S x max|g| rounds to inf in FP16."""
    if not max_abs > 0:
        return None
    return 2.0 ** math.ceil(math.log2(FP16_ROUNDS_TO_INF / max_abs))



def analyse(fp32: dict, fp16: dict, untrained: list[float], tol: float = TOLERANCE, margin: float = MARGIN) -> dict:
    """The report's findings and verdict from the FP32 run (with numerics) and the FP16 (S = 1) replay."""
    # Forward: values above 65504 are inf in FP16 (the layer needs BF16 or FP32); at or below 2^-25, zero.
    fwd_rows = []
    for layer, r in fp32["forward"].items():
        nonzero = r["count"] * (1 - r["frac_zero"])
        replay = fp16["forward"].get(layer, {})
        fwd_rows.append({"layer": layer, "label": label(layer, fp32["types"]), "type": fp32["types"].get(layer, ""),
                         "max_abs": r["max_abs"],
                         "frac_overflow": r["frac_overflow"],
                         "flushed": r["frac_underflow"] * r["count"] / nonzero if nonzero else 0.0,
                         "fp16_nonfinite": replay.get("nonfinite", 0), "count": r["count"]})
    overflow_layers = [f"{r['layer']} ({r['type']})" for r in fwd_rows if r["frac_overflow"] > 0]
    weight_overflow = [layer for layer, r in fp32["weights"].items() if r["frac_overflow"] > 0]
    fp16_inf_layers = [r["layer"] for r in fwd_rows if r["fp16_nonfinite"] > 0]
    first_inf = fp16["first_inf"]  # the operation that made it, from finite inputs

    # Backward: gradients at S = 1, the S range that keeps them, the first layer to overflow as S grows.
    grads = _gradients(fp32["numerics"])
    replay_grads = _gradients(fp16["numerics"])
    kinds = {}
    for kind in ("act", "weight"):
        layers = grads.get(kind, {})
        overall = layers.get("overall")
        if overall is None:
            continue
        rows = [{"layer": layer, "label": label(layer, fp32["types"]), **{k: v for k, v in r.items() if k != "hist"},
                 "s_min": _smallest_scale(r["hist"], tol), "s_max": advise_loss_scale(r["max_abs"], 1.0, MAX_SCALE)}
                for layer, r in layers.items() if layer != "overall"]
        rows.sort(key=lambda r: -r["flushed_s1"])
        replay = replay_grads.get(kind, {}).get("overall", {})
        kinds[kind] = {"overall": {k: v for k, v in overall.items() if k != "hist"}, "layers": rows,
                       "hist": overall["hist"], "s_min": _smallest_scale(overall["hist"], tol),
                       "fp16_frac_zero": replay.get("frac_zero")}
    maxima = [(r["max_abs"], kind, r["layer"]) for kind, k in kinds.items() for r in k["layers"]]
    top = max(maxima) if maxima else (0.0, None, None)
    s_low = max((k["s_min"] for k in kinds.values() if k["s_min"] is not None), default=None)
    if any(k["s_min"] is None for k in kinds.values()):
        s_low = None
    s_high = advise_loss_scale(top[0], 1.0, MAX_SCALE) if maxima else MAX_SCALE
    advised = advise_loss_scale(top[0], margin, MAX_SCALE) if maxima else MAX_SCALE
    backward = {
        "kinds": kinds, "s_low": s_low, "s_high": s_high, "advised": advised, "tolerance": tol, "margin": margin,
        "first_overflow": {"kind": top[1], "layer": top[2], "label": label(top[2], fp32["types"]), "max_abs": top[0],
                           "at_scale": _overflow_at(top[0])},
    }

    # The update (section 3.1): what FP16 weights would lose without the FP32 master copy.
    sw = [s for s in fp32["numerics"] if "numerics/swamp/frac_swamped" in s]
    update = {"frac_swamped_mean": sum(s["numerics/swamp/frac_swamped"] for s in sw) / len(sw) if sw else None,
              "frac_swamped_max": max((s["numerics/swamp/frac_swamped"] for s in sw), default=None),
              "frac_update_underflow_mean": sum(s["numerics/swamp/frac_update_underflow"] for s in sw) / len(sw)
              if sw else None}
    update["master_matters"] = (update["frac_swamped_max"] or 0.0) > SWAMP_MATTERS

    verdict = _verdict(overflow_layers + [f"{w} (weights)" for w in weight_overflow], first_inf, backward, fp16)
    return {"forward": {"rows": fwd_rows, "overflow_layers": overflow_layers, "weight_overflow": weight_overflow,
                        "fp16_inf_layers": fp16_inf_layers, "first_inf": first_inf},
            "backward": backward, "update": update, "verdict": verdict,
            "fp16_progress": progress(fp16["losses"], fp32["losses"], untrained)}


def _verdict(overflow: list[str], first_inf: dict | None, bw: dict, fp16: dict) -> dict:
    """precision + loss_scale to use, why (the measurement), and the alternatives."""
    s_low, s_high, advised = bw["s_low"], bw["s_high"], bw["advised"]
    kinds = bw["kinds"]
    flushed = {k: v["overall"]["flushed_s1"] for k, v in kinds.items()}
    flushed_txt = ", ".join(f"{100 * v:.2f}% of non-zero {k}-gradient values" for k, v in flushed.items())
    if overflow:
        return {"precision": "bf16", "loss_scale": "auto",
                "why": f"forward overflow: {', '.join(overflow)} reach(es) |x| > 65504 in FP32 training, inf in FP16 "
                       f"(no loss scale changes the forward pass); BF16 has FP32's range",
                "alternatives": [f"keep {', '.join(overflow)} in FP32 (and fp16 elsewhere)",
                                 "rescale the layer (a normalisation before it) so its outputs stay below 65504"],
                "keep_fp32": overflow}
    if s_low is None or s_low > s_high:
        # FP16's range is narrower than the gradients': the best one S can do is the largest that does not
        # overflow, which a dynamic scaler finds. Good enough when it flushes little; else BF16.
        k = round(math.log2(s_high))
        lost = max(_flushed_at(v["hist"], k) / max(1, sum(v["hist"])) for v in kinds.values())
        why = (f"no single loss scale fits: keeping all but {100 * bw['tolerance']:g}% of the gradients needs "
               f"S >= {pow2(s_low) if s_low else 'more than 2^24'}, but the {bw['first_overflow']['kind']}-gradient "
               f"of {bw['first_overflow']['label']} overflows above S = {pow2(s_high)}, where FP16 still flushes "
               f"{pct(lost)} of a gradient kind's non-zero values")
        if lost <= LOST_OK:
            return {"precision": "mixed", "loss_scale": "dynamic",
                    "why": why + f" (<= {pct(LOST_OK)}): a dynamic scaler keeps S at that edge",
                    "alternatives": ["bf16 keeps every gradient (FP32's exponent range)"], "keep_fp32": []}
        return {"precision": "bf16", "loss_scale": "auto", "why": why + f" (> {pct(LOST_OK)}); BF16 keeps them",
                "alternatives": ["mixed loss_scale=dynamic, accepting the flushed share at the edge of overflow"],
                "keep_fp32": []}
    if first_inf:
        # No module output leaves FP16's range in FP32, yet an operation of the FP16 forward made inf/nan from
        # finite inputs: a value computed inside a module (a sum of squares, an exp), as in T5's FP16 layer norm.
        first = first_inf["module"]
        return {"precision": "bf16", "loss_scale": "auto",
                "why": f"in the FP16 replay {first_inf['op']} inside {first} made inf/nan from finite inputs "
                       f"(largest {first_inf['input_max_abs']:.3g}, step {first_inf['step'] + 1}), though no layer's "
                       f"output exceeds 65504 in FP32: a value computed inside it overflows FP16; BF16 has FP32's "
                       f"range",
                "alternatives": [f"keep {first} in FP32 (impl=paper: give its class fp32_compute = True)"],
                "keep_fp32": [first]}
    if s_low <= 1 <= s_high and fp16["nonfinite_losses"] == 0:
        return {"precision": "fp16", "loss_scale": "auto",
                "why": f"at S = 1 FP16 flushes only {flushed_txt} (<= {100 * bw['tolerance']:g}%): no scaling "
                       f"needed (as the paper's Table 1 CNNs)",
                "alternatives": ["mixed loss_scale=dynamic costs nothing and guards against later growth"],
                "keep_fp32": []}
    s = min(max(advised, s_low), s_high)
    fo = bw["first_overflow"]
    # Wide: the scales between S_low and the first overflow (not the cap) span WIDE or more.
    static = (fo["at_scale"] or math.inf) / 2 / s_low >= WIDE
    why = (f"at S = 1 FP16 flushes {flushed_txt}; S >= {pow2(s_low)} keeps all but {100 * bw['tolerance']:g}%; "
           f"the largest gradient ({fo['max_abs']:.3g}, {fo['kind']}-gradient of {fo['label']}) overflows at "
           f"S = {pow2(fo['at_scale'])}; S = {pow2(s)}: "
           + ("the largest power of two with S x max|g| x 2 < 65504" if s == advised and advised < MAX_SCALE else
              f"the doctor's cap (2^{round(math.log2(MAX_SCALE))})" if s == MAX_SCALE else "the range's edge"))
    if static:
        return {"precision": "mixed", "loss_scale": _num(s), "why": why + " (section 3.2)",
                "alternatives": ["mixed loss_scale=dynamic finds a scale in the same range by itself"], "keep_fp32": []}
    return {"precision": "mixed", "loss_scale": "dynamic",
            "why": why + f"; the range is narrow (x{s_high / s_low:g}): let the scale follow the gradients",
            "alternatives": [f"mixed loss_scale={_num(s)} (static)"], "keep_fp32": []}


def _num(s: float) -> str:
    return str(int(s)) if s == int(s) else repr(s)


def confirm(v: dict, checks: dict, verified: str | None, s_high: float, steps: int, judge: dict | None = None) -> None:
    """Judge the verdict `v` by the replay `verified` of its recipe (a key of `checks`, the replays' summaries;
    None: not replayed), in place: v["checked"], v["allowed_skips"], v["confirmed"] (None: not replayed, or
    FP32 itself moved the loss too little to judge -- `judge`, replay.fp32_gain; v["unjudged"] says so), and
    FP16 at S = 1 as an alternative where its own replay learned anyway."""
    c = checks.get(verified, {"skipped": 0, "nonfinite_losses": 0, "progress": None})
    v["checked"] = verified
    # A static S must never skip; a dynamic scaler skips while it backs off from its initial 2^16 to the
    # measured range (one skip per halving), and no more.
    # Capped at half the steps, so that the check can fail: a scaler still backing off after that has not
    # found a scale in time (and the replay has hardly trained).
    v["allowed_skips"] = v["backoff_skips"] = 0
    if v["loss_scale"] == "dynamic":
        v["backoff_skips"] = max(0, math.ceil(math.log2(Config().scaler.init_scale / s_high)))
        v["allowed_skips"] = min(v["backoff_skips"], steps // 2)
    failed = c["skipped"] > v["allowed_skips"] or c["nonfinite_losses"] > 0
    v["unjudged"] = unjudged(judge, steps) if judge is not None and not judge["enough"] else None
    if verified is None or (v["unjudged"] and not failed):
        v["confirmed"] = None  # skips or inf/nan refute a recipe even when progress cannot be judged
    else:
        v["confirmed"] = not failed and c["progress"] is not None and c["progress"] >= CONFIRM
    p16 = checks["fp16"]["progress"]
    if v["precision"] == "mixed" and p16 is not None and p16 >= CONFIRM and checks["fp16"]["nonfinite_losses"] == 0:
        v["alternatives"].append(f"precision=fp16 (S = 1) also reached {pct(p16)} of FP32's progress in its replay, "
                                 f"flushed values notwithstanding: over {steps} steps they did not matter")
