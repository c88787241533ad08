"""--formats: the narrowest simulated format of the precision table (fp8, fp8_block, mxfp8, nvfp4, and any row
added later) that trains this model as FP32 does. Each is replayed as it is, narrowest element first (NVFP4's
4 bits before the 8-bit ones, ties in the table's order); the first whose replay reaches CONFIRM of FP32's
progress with its last-step output within OUTPUT_SQNR of FP32's is the answer. Where none does as it is, the
same order again with modules kept wide (keep_wide.search, ranked by the format's own what-if row): the first
format that a set of kept modules makes train is the answer, with that set. Every answer is a replay's."""
from __future__ import annotations

from mpt import formats, precisions
from mpt.doctor.keep_wide import OUTPUT_SQNR, search, trial
from mpt.doctor.targets import Patient
from mpt.doctor.verdict import CONFIRM, pct


def bits(name: str) -> int:
    """A simulated precision's width: the widest element any of its roles is rounded to."""
    return max(formats.ELEMENTS[f.element].bits for f in formats.RECIPES[name].roles.values())


def order() -> list[str]:
    return sorted(precisions.FORMATS, key=lambda n: (bits(n), precisions.FORMATS.index(n)))


def find(patient: Patient, fp32: dict, untrained: list[float], whatif: dict, first_inf: dict | None, steps: int,
         device, wide: str = "fp32") -> dict:
    """The narrowest simulated precision that trains as FP32 does, and what it keeps wide (report.json's
    "narrowest")."""
    tried = []
    for name in order():
        t = trial(patient, name, fp32, untrained, steps, device)
        tried.append({"precision": name, "bits": bits(name), **{k: t[k] for k in
                      ("kept", "progress", "output_sqnr_db", "nonfinite_losses", "ok")}})
        if t["ok"]:
            return {"precision": name, "kept": [], "tried": tried}
    for name in order():  # none as it is: the narrowest that a few modules kept wide make train
        kw = search(patient, name, fp32, untrained, whatif, first_inf, steps, device, wide)
        last = kw["trials"][-1]
        tried.append({"precision": name, "bits": bits(name), "kept": last["kept"], "progress": last["progress"],
                      "output_sqnr_db": last["output_sqnr_db"], "nonfinite_losses": last["nonfinite_losses"],
                      "ok": last["ok"]})
        if kw["kept"]:
            return {"precision": name, "kept": kw["kept"], "wide": wide, "tried": tried}
    return {"precision": None, "kept": None, "tried": tried}


def lines(n: dict) -> list[str]:
    """The report's lines."""
    head = (f"Narrowest simulated format (--formats: {', '.join(order())} replayed narrowest first as a run gets "
            f"them -- first and last layers in BF16, fp8.ends=bf16 --, then with modules kept wide; >= "
            f"{pct(CONFIRM)} of FP32's progress and last-step output SQNR >= {OUTPUT_SQNR:g} dB)")
    if n["precision"] is None:
        res = "  none trains as FP32 does, as it is or with up to 8 modules kept wide: stay with the verdict's"
    elif n["kept"]:
        res = (f"  precision={n['precision']} with {', '.join(n['kept'])} kept in {n.get('wide', 'fp32').upper()} "
               f"(checked by its replay)")
    else:
        res = f"  precision={n['precision']} as it is (checked by its replay)"
    tried = "; ".join(f"{t['precision']}{' keeping ' + ', '.join(t['kept']) if t['kept'] else ''}: progress "
                      f"{pct(t['progress'])}, output SQNR {t['output_sqnr_db']:.1f} dB" for t in n["tried"])
    return [head, res, f"  tried: {tried}"]
