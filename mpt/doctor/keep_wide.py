"""The smallest set of modules to keep wide (FP32, or BF16) for a model to train in a narrower precision: from
the precision asked for, modules are promoted one at a time, in the order of what they lose -- the module whose
operation first made inf/nan in the FP16 replay (mpt.doctor.trace.first_overflow: an overflow inside a module shows
only there), then the what-if's ranking for the format (whatif.py) -- each set checked by a replay, until the
replay's progress and its output's SQNR against FP32 are within tolerance. The last replay is the check."""
from __future__ import annotations

from mpt.doctor.replay import progress, train
from mpt.doctor.targets import Patient
from mpt.doctor.verdict import CONFIRM
from mpt.numerics import sqnr_db
from mpt.precisions import FORMATS

OUTPUT_SQNR = 20.0  # dB: the last step's output within 10% RMS of FP32's
MAX_KEPT = 8  # modules tried at most
# The what-if row each precision's candidates are ranked by: the element format of the FP16/BF16 recipes;
# a simulated precision's own row (its recipe's roles: E5M2 gradients for fp8, the blocks of the others).
FORMAT_OF = {"fp16": "fp16", "mixed": "fp16", "fp16_storage": "fp16", "bf16": "bf16",
             **{name: name for name in FORMATS}}


def _module(label: str) -> str:
    """"big (Linear)" -> "big"; "root (..)" -> "" (the model itself)."""
    name = label.rsplit(" (", 1)[0]
    return "" if name == "root" else name


def search(patient: Patient, precision: str, fp32: dict, untrained: list[float], whatif: dict,
           first_inf: dict | None, steps: int, device, wide: str = "fp32") -> dict:
    """Greedy: the candidates in order, promoted one more at a time, until a replay passes (or MAX_KEPT)."""
    fmt = FORMAT_OF.get(precision, precision)
    ranked = whatif["formats"].get(fmt, {}).get("ranked", [])
    order = ([_module(first_inf["module"])] if first_inf else []) + [m for m in ranked if m != "root"]
    candidates = list(dict.fromkeys(m for m in order if m))  # de-duplicated, in order
    trials = []
    for k in range(0, min(MAX_KEPT, len(candidates)) + 1):
        trials.append(trial(patient, precision, fp32, untrained, steps, device, candidates[:k], wide))
        if trials[-1]["ok"]:
            break
    found = trials[-1]["ok"]
    for t in trials:  # "big (Linear)", as the rest of the report names modules
        t["kept"] = [f"{m} ({type(patient.model.get_submodule(m)).__name__})" for m in t["kept"]]
    return {"precision": precision, "wide": wide, "format": fmt, "candidates": candidates, "trials": trials,
            "kept": trials[-1]["kept"] if found else None, "tolerance": {"progress": CONFIRM, "output_sqnr_db":
                                                                         OUTPUT_SQNR}}


def trial(patient: Patient, precision: str, fp32: dict, untrained: list[float], steps: int, device,
          kept: list[str] = (), wide: str = "fp32") -> dict:
    """One replay of `precision` with the modules `kept` in `wide`, judged against FP32's: it passes with no
    non-finite loss, >= CONFIRM of FP32's progress and its output within OUTPUT_SQNR of FP32's."""
    r = train(patient, precision, steps=steps, device=device, numerics=False, keep_wide=tuple(kept), wide=wide)
    p = progress(r["losses"], fp32["losses"], untrained)
    # At the trial's last step, on the batch FP32's last step read: the recipe as trained (delayed scales
    # from their history, not step 1's unit scales), against FP32 as trained.
    sq = sqnr_db(fp32["last_output"], r["last_output"])
    ok = r["nonfinite_losses"] == 0 and p is not None and p >= CONFIRM and sq >= OUTPUT_SQNR
    return {"kept": list(kept), "progress": p, "output_sqnr_db": sq, "nonfinite_losses": r["nonfinite_losses"],
            "skipped": r["skipped"], "ok": ok}


def lines(kw: dict) -> list[str]:
    """The report's lines."""
    from mpt.doctor.verdict import pct

    tol = kw["tolerance"]
    head = (f"Keep wide for precision={kw['precision']} (modules promoted to {kw['wide'].upper()} one at a time until "
            f"a replay reaches >= {pct(tol['progress'])} of FP32's progress and output SQNR >= "
            f"{tol['output_sqnr_db']:g} dB)")
    tried = "; ".join(f"{{{', '.join(t['kept'])}}}: progress {pct(t['progress'])}, output SQNR "
                      f"{t['output_sqnr_db']:.1f} dB" + (f", {t['nonfinite_losses']} non-finite losses"
                                                         if t["nonfinite_losses"] else "") for t in kw["trials"])
    if kw["kept"] is None:
        res = f"  none found among {len(kw['trials']) - 1} modules promoted in turn ({', '.join(kw['candidates'])})"
    elif not kw["kept"]:
        res = f"  nothing to keep wide: precision={kw['precision']} passes as it is"
    else:
        res = f"  keep wide: {', '.join(kw['kept'])} (checked by the last replay)"
    return [head, res, f"  tried: {tried}"]
