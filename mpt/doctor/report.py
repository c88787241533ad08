"""The report, from examination.examine's dict: the one-screen text, report.md (the text and per-layer
tables), report.json (everything measured) and histograms.png (exponent histograms against FP16's range)."""
from __future__ import annotations

import collections
import math
from pathlib import Path

from mpt.doctor.replay import tail_steps
from mpt.doctor.verdict import MAX_SCALE, pct, pow2
from mpt.doctor.keep_wide import lines as keep_wide_lines
from mpt.doctor.narrowest import lines as narrowest_lines
from mpt.doctor.whatif import table
from mpt.plots import draw_hist, render
from mpt.rundir import atomic_write_bytes, atomic_write_json, atomic_write_text


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _memory_line(runs: dict) -> tuple[str, dict]:
    fp32 = (runs["fp32"]["memory"] or {}).get("activation_only_bytes")
    lines, saved = [], {}
    for key, r in runs.items():
        m = r["memory"]
        if m is None:
            lines.append(f"{key}: not measured (see the note)")
            continue
        by = ", ".join(f"{d} {_bytes(b)}" for d, b in m["activation_only_bytes_by_dtype"].items())
        frac = 1 - m["activation_only_bytes"] / fp32 if fp32 else 0.0
        saved[key] = frac
        lines.append(f"{key}: {_bytes(m['activation_only_bytes'])} ({by})"
                     + ("" if key == "fp32" or not fp32 else f", {pct(frac)} less than fp32"))
    return "; ".join(lines), saved


def text_report(rep: dict, max_layers: int = 4) -> list[str]:
    """The one-screen report, as lines (the Markdown file adds tables)."""
    out = _head_lines(rep) + _forward_lines(rep, max_layers) + _backward_lines(rep) + _update_lines(rep)
    if rep.get("whatif"):
        out.append("What-if per format (the first batch's FP32 values rounded to each; fp16 gradients at the best S)")
        out += table(rep["whatif"])
    if rep.get("keep_wide"):
        out += keep_wide_lines(rep["keep_wide"])
    if rep.get("narrowest"):
        out += narrowest_lines(rep["narrowest"])
    mem, _ = _memory_line(rep["runs"])
    out.append(f"Memory (activations saved for backward, step 1): {mem}")
    return out + _verdict_lines(rep)


def _head_lines(rep: dict) -> list[str]:
    v, runs = rep["verdict"], rep["runs"]
    out = [f"mpt.doctor {rep['patient']}: {rep['steps']} steps on {rep['device']} in FP32, replayed in FP16 at S = 1"]
    out += [f"  note: {n}" for n in rep["notes"]]
    f32, f16 = runs["fp32"], runs["fp16"]
    n_tail = len(tail_steps(rep["steps"]))
    out.append(f"  mean loss over the last {n_tail} steps' batches: untrained {rep['untrained_tail_loss']:.4g}, "
               f"fp32 {f32['tail_loss']:.4g}, fp16 (S = 1) {f16['tail_loss']:.4g} "
               + (f"(progress {pct(f16['progress'])} of fp32's)" if not v.get("unjudged") else "(progress: n/a)"))
    if v.get("unjudged"):
        out.append(f"  CANNOT JUDGE PROGRESS: {v['unjudged']}")
    return out


def _forward_lines(rep: dict, max_layers: int) -> list[str]:
    fw = rep["forward"]
    out = ["Forward pass (FP32 values against FP16's range)"]
    rows = sorted(fw["rows"], key=lambda r: -r["max_abs"])
    if rows:
        r = rows[0]
        out.append(f"  largest |activation|: {r['max_abs']:.3g} in {r['layer']} ({r['type']})"
                   + (" -- above 65504: inf in FP16" if r["frac_overflow"] > 0 else " (FP16 max 65504)"))
    for r in [r for r in rows if r["frac_overflow"] > 0][:max_layers]:
        out.append(f"  OVERFLOW {r['layer']} ({r['type']}): {pct(r['frac_overflow'])} of its outputs above 65504 "
                   f"(max {r['max_abs']:.3g}); fp16 replay: {r['fp16_nonfinite']} inf/nan values")
    fi = fw["first_inf"]
    if fi:
        out.append(f"  fp16 replay: the first inf/nan made from finite values: {fi['op']} in {fi['module']} "
                   f"(step {fi['step'] + 1}, inputs up to {fi['input_max_abs']:.3g})")
    if fw["weight_overflow"]:
        out.append(f"  OVERFLOW weights of {', '.join(fw['weight_overflow'])} above 65504")
    under = sorted((r for r in fw["rows"] if r["flushed"] > 0), key=lambda r: -r["flushed"])
    worst = f"at most {pct(under[0]['flushed'])} of a layer's non-zero outputs ({under[0]['label']})" if under else ""
    out.append("  activations flushed to zero in FP16: " + (worst or "none"))
    return out


def _backward_lines(rep: dict) -> list[str]:
    bw = rep["backward"]
    out = ["Backward pass (gradients at S = 1; section 3.2)"]
    for kind, k in bw["kinds"].items():
        o = k["overall"]
        worst = ", ".join(f"{r['label']} {pct(r['flushed_s1'])}" for r in k["layers"][:3] if r["flushed_s1"] > 0)
        out.append(f"  {kind}-gradients: {pct(o['flushed_s1'])} of non-zero values flushed to zero at S = 1"
                   + (f" (worst: {worst})" if worst else "") + f"; max |g| {o['max_abs']:.3g}; "
                   f"keeping all but {pct(bw['tolerance'])} needs S >= "
                   f"{pow2(k['s_min']) if k['s_min'] else 'more than 2^24'}")
        if k["fp16_frac_zero"] is not None:
            out.append(f"    fp16 replay: zeros {pct(o['frac_zero'])} of values in fp32 -> "
                       f"{pct(k['fp16_frac_zero'])}")
    fo = bw["first_overflow"]
    cap = " (the doctor's cap)" if bw["s_high"] == MAX_SCALE else ""
    if bw["s_low"] is not None and bw["s_low"] <= bw["s_high"]:
        usable = f"{pow2(bw['s_low'])} .. {pow2(bw['s_high'])}{cap}"
    else:  # (a range printed low .. high, never inverted)
        usable = (f"none (keeping all but {pct(bw['tolerance'])} needs S >= "
                  f"{pow2(bw['s_low']) if bw['s_low'] else 'more than 2^24'}; the largest S without overflow is "
                  f"{pow2(bw['s_high'])})")
    out.append(f"  usable S: {usable}; first to overflow as S grows: "
               f"{fo['kind']}-gradient of {fo['label']} (max {fo['max_abs']:.3g}) at S = {pow2(fo['at_scale'])}")
    return out


def _update_lines(rep: dict) -> list[str]:
    up = rep["update"]
    return ["Update (section 3.1: FP16 weights without the FP32 master copy)",
            f"  an FP16 weight would lose {pct(up['frac_swamped_mean'])} of the updates "
            f"(max {pct(up['frac_swamped_max'])} "
            f"in a step); {pct(up['frac_update_underflow_mean'])} are below 2^-24 outright -> "
            + ("keep the FP32 master copy (mixed / fp16, not fp16_pure)" if up["master_matters"]
               else "the master copy matters little at this learning rate")]


def _verdict_lines(rep: dict) -> list[str]:
    v, runs = rep["verdict"], rep["runs"]
    cmd = f"precision={v['precision']}" + ("" if v["loss_scale"] == "auto" else f" loss_scale={v['loss_scale']}")
    out = [f"Verdict: {cmd}", f"  because {v['why']}"]
    if v["checked"] is None:
        out.append("  not checked (--no-verify)")
    elif v["confirmed"] is None:
        c = runs[v["checked"]]
        out.append(f"  checked: {v['checked']} replay: {c['skipped']} skipped steps, {c['nonfinite_losses']} "
                   f"non-finite "
                   f"losses; progress not judged -> neither confirmed nor refuted (FP32 itself did not learn enough)")
    else:
        c = runs[v["checked"]]
        allowed = ""
        if v["loss_scale"] == "dynamic":
            back = f"backing off from 2^16 to {pow2(rep['backward']['s_high'])} takes {v['backoff_skips']}"
            allowed = (f" (<= {v['allowed_skips']}: {back})" if v["allowed_skips"] == v["backoff_skips"] else
                       f" (<= {v['allowed_skips']}, half the steps; {back})")
        out.append(f"  checked: {v['checked']} replay: {c['skipped']} skipped steps{allowed}, {c['nonfinite_losses']} "
                   f"non-finite losses, progress {pct(c['progress'])} of fp32's -> "
                   + ("confirmed" if v["confirmed"] else "NOT confirmed: look at the report before trusting it"))
    for a in v["alternatives"]:
        out.append(f"  or: {a}")
    return out


def wrap(lines: list[str], width: int = 118) -> list[str]:
    """Long report lines folded for a terminal, continuations indented under their line."""
    import textwrap

    out = []
    for line in lines:
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        out += textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False) or [""]
    return out


def markdown_report(rep: dict) -> str:
    lines = ["# Precision report: " + rep["patient"], "", "```", *wrap(text_report(rep)), "```", ""]
    lines += ["## Forward pass: values per layer (FP32 run)", "",
              "| layer | max abs | share above 65504 | share of non-zero flushed to zero "
              "| inf/nan in the fp16 replay |",
              "|---|---|---|---|---|"]
    for r in rep["forward"]["rows"]:
        lines.append(f"| {r['label']} | {r['max_abs']:.3g} | {pct(r['frac_overflow'])} | {pct(r['flushed'])} | "
                     f"{r['fp16_nonfinite']} |")
    for kind, k in rep["backward"]["kinds"].items():
        lines += ["", f"## Backward pass: {kind}-gradients per layer (FP32 run, true values)", "",
                  "| layer | flushed at S = 1 | max abs | S keeping all but the tolerance "
                  "| largest S without overflow |",
                  "|---|---|---|---|---|"]
        for r in k["layers"]:
            lines.append(f"| {r['label']} | {pct(r['flushed_s1'])} | {r['max_abs']:.3g} | {pow2(r['s_min'])} | "
                         f"{pow2(r['s_max'])} |")
    lines += ["", "## Replays", "", "| run | first loss | mean loss, last quarter | skipped | non-finite losses "
              "| progress vs fp32 | "
              "activation bytes by dtype |", "|---|---|---|---|---|---|---|"]
    for key, c in rep["runs"].items():
        by = ", ".join(f"{d} {_bytes(b)}" for d, b in c["memory"]["activation_only_bytes_by_dtype"].items()) \
            if c["memory"] else "not measured"
        lines.append(f"| {key} | {c['first_loss']:.4g} | {c['tail_loss']:.4g} | {c['skipped']} | "
                     f"{c['nonfinite_losses']} | {pct(c['progress'])} | {by} |")
    lines += ["", "Histograms: histograms.png. Everything measured: report.json."]
    return "\n".join(lines) + "\n"


def figure(rep: dict) -> bytes:
    """Exponent histograms with FP16's bands: forward activations, activation and weight gradients."""
    from matplotlib.figure import Figure

    lo = rep["hist_lo"]
    panels = [("forward activations (FP32)", rep["forward_hist"], "tab:gray", ())]
    s = rep["verdict"]["loss_scale"]
    mark = ()
    if s not in ("auto", "dynamic"):
        mark = (-24 - round(math.log2(float(s))),)  # below this, flushed even at the advised S
    for kind, k in rep["backward"]["kinds"].items():
        title = f"{kind}-gradients (FP32, true values)" + (f"; dashed: 2^-24 / S, flushed below it at S = {s}"
                                                              if mark else "")
        panels.append((title, k["hist"], "tab:blue", mark))
    fig = Figure(figsize=(9, 2.8 * len(panels)))
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (title, hist, color, m) in zip(axes, panels):
        counter = collections.Counter({lo + i: c for i, c in enumerate(hist) if c})
        if counter:
            draw_hist(ax, counter, title, color, m)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("exponent of |value| (log2)")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{rep['patient']}: {rep['steps']} steps", fontsize=10)
    fig.tight_layout()
    return render(fig, "png")


def _strict(obj):
    """JSON without NaN/Infinity (which strict parsers refuse): non-finite floats as the strings "nan", "inf"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def write(rep: dict, out: Path) -> list[Path]:
    """report.md, report.json and histograms.png in `out`, each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "report.md", out / "report.json", out / "histograms.png"]
    atomic_write_text(files[0], markdown_report(rep))
    atomic_write_json(files[1], _strict(rep))
    atomic_write_bytes(files[2], figure(rep))
    return files

