"""The whole examination: FP32 measured, the FP16 (S = 1) replay, the verdict, and a replay in the recipe it
recommends -- each phase a replay.train of the same patient -- gathered into the report's dict."""
from __future__ import annotations

import math
import time

import torch
import torch.nn as nn

from mpt.doctor.replay import fp32_gain, progress, tail_steps, train, untrained_losses
from mpt.doctor.targets import STEPS, Patient
from mpt.doctor.verdict import MARGIN, TOLERANCE, analyse, confirm
from mpt.doctor.keep_wide import search
from mpt.doctor.whatif import whatif
from mpt.errors import UserError
from mpt.numerics import FP16_MAX, HIST_HI, HIST_LO


def examine(patient: Patient, steps: int = STEPS, device="cpu", tol: float = TOLERANCE, margin: float = MARGIN,
            verify: bool = True, keep_wide: str | None = None, wide: str = "fp32") -> dict:
    """The whole examination: FP32 with numerics, the FP16 (S = 1) replay, the analysis and verdict, and a
    replay in the recommended recipe; the what-if per format; with `keep_wide` (a precision), the smallest set of
    modules to keep in `wide` for it to train (keep_wide.search). Returns the report as a dict (report.json)."""
    t0 = time.time()
    device = torch.device(device)
    fp32 = train(patient, "fp32", steps=steps, device=device)
    bad = [i for i, x in enumerate(fp32["losses"]) if not math.isfinite(x)]
    if bad:
        # No precision can fix what FP32 already breaks: an overflow "above 65504" or a BF16 advice
        # would send the user after the wrong cause.
        raise UserError(f"{patient.name}: the loss is {fp32['losses'][bad[0]]} in FP32 already (step {bad[0]} of "
                        f"{steps}; {len(bad)} non-finite): fix the model, its data or its learning rate in FP32 "
                        f"before asking which lower precision it can train in")
    fp16 = train(patient, "fp16", steps=steps, device=device, watch=True)
    untrained = untrained_losses(patient, steps, device)
    found = analyse(fp32, fp16, untrained, tol, margin)
    v = found["verdict"]
    runs = {"fp32": fp32, "fp16": fp16}
    notes = list(patient.notes)
    if verify and (v["precision"], v["loss_scale"]) != ("fp16", "auto"):
        key = v["precision"] if v["loss_scale"] == "auto" else f"{v['precision']} loss_scale={v['loss_scale']}"
        runs[key] = train(patient, v["precision"], v["loss_scale"], steps=steps, device=device, numerics=False)
    if device.type == "cpu" and any(isinstance(m, nn.RNNBase) for m in patient.model.modules()):
        # Emulated FP16 math runs a recurrent layer whole in FP32 and autograd keeps its FP32 internals; its
        # memory is measured with PyTorch's own FP16 kernels, one step (README, "FP16 math on a CPU").
        for key, r in runs.items():
            if key != "fp32":
                r["memory"] = train(patient, r["precision"], r["loss_scale"], steps=1, device=device,
                                    numerics=False, half_math="native")["memory"]
                r["memory"]["half_math"] = "native"
        notes.append("memory of the recurrent model measured with half_math=native (one step): emulated "
                     "FP16 math keeps a recurrent layer's FP32 internals")
    checks = {}
    for key, r in runs.items():
        tail = [r["losses"][i] for i in tail_steps(steps)]
        checks[key] = {"first_loss": r["losses"][0], "tail_loss": sum(tail) / len(tail), "skipped": r["skipped"],
                       "nonfinite_losses": r["nonfinite_losses"], "final_loss_scale": r["final_loss_scale"],
                       "progress": progress(r["losses"], fp32["losses"], untrained), "half_math": r["half_math"],
                       "memory": r["memory"], "losses": r["losses"]}
    # The replay of the recommended recipe (the FP16 one itself when that is the verdict); none with verify=False.
    verified = list(checks)[-1] if verify or v["precision"] == "fp16" else None
    formats = whatif(patient, device)
    kept = None
    if keep_wide:
        kept = search(patient, keep_wide, fp32, untrained, formats, fp16["first_inf"], steps, device, wide)
    judge = fp32_gain(fp32["losses"], untrained)
    confirm(v, checks, verified, found["backward"]["s_high"], steps, judge)
    return {"patient": patient.name, "device": str(device), "steps": steps, "notes": notes, "fp32_gain": judge,
            "whatif": formats, "keep_wide": kept,
            "untrained_tail_loss": sum(untrained) / len(untrained), "fp16_max": FP16_MAX, "hist_lo": HIST_LO,
            "hist_hi": HIST_HI, **found, "runs": checks, "forward_hist": _sum_hists(fp32["forward"]),
            "wall_s": time.time() - t0}


def _sum_hists(summary: dict) -> list[int]:
    """Every layer's forward-value histogram summed (histograms.png's first panel)."""
    total = None
    for r in summary.values():
        total = r["hist"] if total is None else [a + b for a, b in zip(total, r["hist"])]
    return total or []

