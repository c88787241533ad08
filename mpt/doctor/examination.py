"""The whole examination: FP32 measured, the FP16 (S = 1) replay, the verdict, and a replay in the recipe it
recommends -- each phase a replay.train of the same patient -- gathered into the report's dict."""
from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.nn as nn

from mpt.bands import FP16_MAX, HIST_HI, HIST_LO
from mpt.doctor.replay import diverges, fp32_gain, progress, tail_steps, train, untrained_losses
from mpt.doctor.targets import STEPS, LossError, Patient
from mpt.doctor.verdict import MARGIN, TOLERANCE, analyse, confirm, label
from mpt.doctor.keep_wide import search
from mpt.doctor.narrowest import find
from mpt.doctor.whatif import whatif
from mpt.errors import UserError, one_line


def examine(patient: Patient, steps: int = STEPS, device="cpu", tol: float = TOLERANCE, margin: float = MARGIN,
            verify: bool = True, keep_wide: str | None = None, wide: str = "fp32", narrowest: bool = False) -> dict:
    """The whole examination: FP32 with numerics, the FP16 (S = 1) replay, the analysis and verdict, and a
    replay in the recommended recipe; the what-if per format; with `keep_wide` (a precision), the smallest set of
    modules to keep in `wide` for it to train (keep_wide.search); with `narrowest`, the narrowest simulated format
    that trains as FP32 does (narrowest.find). Returns the report as a dict (report.json)."""
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
    untrained = untrained_losses(patient, steps, device)
    judge = fp32_gain(fp32["losses"], untrained)
    if diverges(judge):
        # The same: a forward "overflow above 65504" or a BF16 verdict would be read as the cure for a loss
        # that FP32 itself drives up (a learning rate too high), and a higher learning rate as the next try.
        top = max(fp32["forward"].items(), key=lambda kv: kv[1]["max_abs"], default=None)
        acts = f", activations up to {top[1]['max_abs']:.3g} in {label(top[0], fp32['types'])}" if top else ""
        n = len(tail_steps(steps))
        raise UserError(f"{patient.name}: FP32 itself diverges: its mean loss over the last {n} steps' batches rose "
                        f"from the untrained model's {judge['untrained']:.3g} to {judge['untrained'] - judge['gain']:.3g}"
                        f" in {steps} steps{acts}: the setup is unstable before any precision is lowered; make it "
                        f"train in FP32 first (a lower learning rate, gradient clipping, a normalisation) -- no "
                        f"precision verdict until then")
    fp16 = train(patient, "fp16", steps=steps, device=device, watch=True)
    found = analyse(fp32, fp16, untrained, tol, margin)
    v = found["verdict"]
    runs = {"fp32": fp32, "fp16": fp16}
    notes = list(patient.notes)
    if verify and (v["precision"], v["loss_scale"]) != ("fp16", "auto"):
        key = v["precision"] if v["loss_scale"] == "auto" else f"{v['precision']} loss_scale={v['loss_scale']}"
        runs[key] = train(patient, v["precision"], v["loss_scale"], steps=steps, device=device, numerics=False)
    rnn_cpu = device.type == "cpu" and any(isinstance(m, nn.RNNBase) for m in patient.model.modules())
    if rnn_cpu:
        notes.append("memory of the recurrent model measured with half_math=native and PyTorch's own RNN kernels "
                     "(not oneDNN's, which has no FP16 LSTM here), one step: emulated FP16 math keeps a recurrent "
                     "layer's FP32 internals")
    for key, r in runs.items():
        r["memory"] = _memory(patient, r, device, rnn_cpu, notes)
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
    narrow = find(patient, fp32, untrained, formats, fp16["first_inf"], steps, device, wide) if narrowest else None
    confirm(v, checks, verified, found["backward"]["s_high"], steps, judge)
    return {"patient": patient.name, "device": str(device), "steps": steps, "notes": notes, "fp32_gain": judge,
            "whatif": formats, "keep_wide": kept, "narrowest": narrow,
            "untrained_tail_loss": sum(untrained) / len(untrained), "fp16_max": FP16_MAX, "hist_lo": HIST_LO,
            "hist_hi": HIST_HI, **found, "runs": checks, "forward_hist": _sum_hists(fp32["forward"]),
            "wall_s": time.time() - t0}


def _memory(patient: Patient, run: dict, device, rnn_cpu: bool, notes: list) -> dict | None:
    """The activation bytes step 1 of `run`'s recipe saves for backward, measured in a step of its own with no
    observer attached (replay.train(meter=True)): the same for the same model and batch, whatever the replay
    watched. A recurrent model on a CPU is measured with PyTorch's FP16 kernels (half_math=native) and its own
    RNN kernels, every recipe alike (oneDNN refuses an FP16 LSTM without proj_size). None, with a note, where
    the step cannot run at all."""
    half_math = "native" if rnn_cpu and run["precision"] != "fp32" else "auto"
    try:
        with _without_onednn() if rnn_cpu else contextlib.nullcontext():
            mem = train(patient, run["precision"], run["loss_scale"], steps=1, device=device, half_math=half_math,
                        meter=True)["memory"]
    except LossError as e:
        # The examination's replays ran this model; only the memory step's kernels fail: skip the figure.
        notes.append(f"memory of {run['precision']} not measured: its step failed with half_math={half_math} "
                     f"({one_line(e.cause)[:120]})")
        return None
    mem["half_math"] = half_math
    return mem


@contextlib.contextmanager
def _without_onednn():
    """PyTorch's own CPU kernels instead of oneDNN's (torch.backends.mkldnn.flags also resets TF32 settings,
    with a warning)."""
    was = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = was


def _sum_hists(summary: dict) -> list[int]:
    """Every layer's forward-value histogram summed (histograms.png's first panel)."""
    total = None
    for r in summary.values():
        total = r["hist"] if total is None else [a + b for a, b in zip(total, r["hist"])]
    return total or []

