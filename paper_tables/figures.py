"""Figures 2-6 and the loss-scale trajectories, drawn from metrics.jsonl (or wandb history).

Uses matplotlib's object API (Figure + savefig), never pyplot, so no backend or global state is
touched: it runs headless and inside other programs alike. A figure whose runs do not exist yet is
returned as missing with the reason, never drawn empty.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re

import numpy as np
from matplotlib.figure import Figure
import matplotlib.image

from mpt import formats, precisions
from mpt.plots import FP16_MAX, draw_hist, render
from paper_tables import specs
from paper_tables.results import Problem, RunResult
from paper_tables.tables import variant_key

MAX_POINTS = 4000  # per curve: keeps the SVGs small; the shape of a training curve survives
# mpt.numerics' keys first (its "weight"/"act" histograms are of the gradients), then spellings
# an older or other logger might use.
HIST_KEYS = {
    "weight_grad": ("numerics/weight/overall/hist", "numerics/wgrad/overall/hist",
                    "numerics/weight_grad/overall/hist", "numerics/grad/overall/hist"),
    "act_grad": ("numerics/act/overall/hist", "numerics/agrad/overall/hist",
                 "numerics/act_grad/overall/hist", "numerics/activation_grad/overall/hist"),
}
HIST_PATTERN = {"weight_grad": re.compile(r"^numerics/.*(wgrad|weight).*/hist$"),
                "act_grad": re.compile(r"^numerics/.*(agrad|act).*/hist$")}
ROLE_NAME = {"weight_grad": "weight-gradient", "act_grad": "activation-gradient"}


@dataclasses.dataclass
class FigureResult:
    spec: specs.FigureSpec
    profile: str
    missing: str | None = None  # why it is not drawn
    notes: list = dataclasses.field(default_factory=list)
    png: bytes | None = None
    svg: bytes | None = None
    problems: list = dataclasses.field(default_factory=list)

    @property
    def stem(self) -> str:
        return self.spec.id + specs.profile_suffix(self.profile)

    @property
    def title(self) -> str:
        m = re.fullmatch(r"figure(\w+)", self.spec.id)
        return f"Figure {m.group(1)}: {self.spec.paper['title']}" if m else self.spec.paper["title"]

    @property
    def label(self) -> str | None:
        return specs.profile_label(self.profile)

    @property
    def paper_text(self) -> str:
        p = self.spec.paper
        return f"Paper (section {p['section']}): {p['paper']}"


def _color(prec: str) -> str | None:
    col = precisions.column(prec)
    return col.color if col else None


def variant_label(v) -> str:
    prec, impl, scale, tf32 = v
    col, row = precisions.column(prec), precisions.of_column(prec)
    base = col.legend if col else prec
    if row is not None and row.auto_loss_scale == "dynamic":  # scaled by default: S always named
        base += ", dynamic S" if scale == "dynamic" else (f", S={scale}" if scale is not None else "")
    elif row is not None and row.loss_scaling and scale not in (None, 1):  # scaled where asked
        base += f", S={scale}"
    if col is not None and col.beyond_paper:
        base = col.label  # the paper's successors, labelled as such
    if tf32:
        base += " (TF32)"
    if impl and impl != "autocast":
        base += f" [impl={impl}]"
    return base


def _rank(value, preferred) -> int:
    return len(preferred) - preferred.index(value) if value in preferred else 0


def _seeds(rs) -> str:
    return ", ".join(f"s{r.seed}" for r in rs)


def _thin(x: np.ndarray, y: np.ndarray):
    if len(x) > MAX_POINTS:
        idx = np.linspace(0, len(x) - 1, MAX_POINTS).astype(int)
        return x[idx], y[idx]
    return x, y


def _float_array(values) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def _candidates(spec: specs.FigureSpec, runs, profile):
    mine = [r for r in runs if r.profile == profile and (not spec.precisions or r.precision in spec.precisions)]
    if spec.experiments and not spec.any_experiment:
        mine = [r for r in mine if r.experiment in spec.experiments]
    return mine


# ----------------------------------------------------------------------------- training curves
def _curves(spec, runs, profile, problems, notes):
    """Figures 2a, 4, 5: training loss (or perplexity = exp(loss)) against step, per precision."""
    ykind = spec.param("y", "loss")
    groups = collections.defaultdict(list)
    for r in _candidates(spec, runs, profile):
        lines = r.lines(problems)
        if any(v is not None for v in lines.train_loss):
            groups[(r.experiment, r.model)].append(r)
    if not groups:
        where = (" or ".join(spec.experiments) + " runs" if spec.experiments and not spec.any_experiment
                 else "runs of any experiment")
        return None, (f"no {where} ({profile} profile) with train losses in precisions "
                      f"{', '.join(spec.precisions)}")

    def score(key):
        return (len({r.precision for r in groups[key]}), _rank(key[0], spec.experiments),
                _rank(key[1], spec.models), key)

    keys = sorted(groups, key=score, reverse=True)
    if spec.param("single"):
        keys = keys[:1]
    elif len(keys) > 4:
        notes.append(f"{len(keys) - 4} more model(s) not drawn: {', '.join(m for _, m in keys[4:])}")
        keys = keys[:4]
    fig = Figure(figsize=(6.4 * min(len(keys), 2), 4.2 * math.ceil(len(keys) / 2)), layout="constrained")
    axes = fig.subplots(math.ceil(len(keys) / 2), min(len(keys), 2), squeeze=False).ravel()
    expect = spec.param("expect") or tuple((p, None) for p in spec.precisions)
    for ax, key in zip(axes, keys):
        rs = groups[key]
        variants = sorted({r.variant for r in rs}, key=variant_key)
        for i, v in enumerate(variants):
            color = _color(v[0]) if sum(w[0] == v[0] for w in variants) == 1 else f"C{i}"
            vr = [r for r in rs if r.variant == v]
            if spec.param("band") and len(vr) > 1 and _band(ax, vr, ykind, color, variant_label(v), problems):
                notes.append(f"{key[0]}/{key[1]}: {variant_label(v)} from {len(vr)} run(s) ({_seeds(vr)}; "
                             f"status {', '.join(sorted({r.status for r in vr}))}): mean line, min-max band")
                continue
            for j, r in enumerate(vr):
                lines = r.lines(problems)
                x, y = _float_array(lines.train_step), _float_array(lines.train_loss)
                if ykind == "perplexity":
                    y = np.exp(np.minimum(y, 700.0))  # exp overflows float64 past ~709
                x, y = _thin(x, y)
                label = f"{variant_label(v)} ({len(vr)} seed{'s' if len(vr) > 1 else ''})" if j == 0 else None
                ax.plot(x, y, color=color, lw=1.0, alpha=0.85, label=label)
                if r.status == "diverged" and len(x):
                    ok = np.isfinite(y)
                    if ok.any():
                        ax.plot(x[ok][-1], y[ok][-1], "x", color=color, ms=8)
                ev = [(e.get("step"), e.get("loss")) for e in lines.eval
                      if isinstance(e.get("loss"), (int, float)) and isinstance(e.get("step"), (int, float))]
                if spec.param("eval") and ev:
                    ex, ey = np.array(ev, dtype=float).T
                    ax.plot(ex, ey, "--", color=color, lw=1.0,
                            label=f"{variant_label(v)}, eval" if j == 0 else None)
            notes.append(f"{key[0]}/{key[1]}: {variant_label(v)} from {len(vr)} run(s) ({_seeds(vr)}; "
                         f"status {', '.join(sorted({r.status for r in vr}))})")
        for prec, scale in expect:
            if not any(v[0] == prec and (scale is None or v[2] == scale) for v in variants):
                want = variant_label((prec, None, scale, False))
                notes.append(f"{key[0]}/{key[1]}: not run yet: {want}")
        if ykind == "perplexity":
            ax.set_yscale("log")
        ax.set_xlabel("iteration")
        ax.set_ylabel("training perplexity" if ykind == "perplexity" else "loss (solid: train)")
        ax.set_title(f"{key[0]} / {key[1]}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    if any(r.status == "diverged" for k in keys for r in groups[k]):
        notes.append("x marks the last finite point of a diverged run")
    return fig, None


def _band(ax, vr, ykind: str, color, label: str, problems) -> bool:
    """Seeds of one variant as their mean curve and a min-max band (the paper's Figure 4 shows three
    FP32 runs because FP32 runs varied), over the steps every seed logged. False when they share none."""
    curves = []
    for r in vr:
        lines = r.lines(problems)
        x, y = _float_array(lines.train_step), _float_array(lines.train_loss)
        curves.append(dict(zip(x.tolist(), (np.exp(np.minimum(y, 700.0)) if ykind == "perplexity" else y).tolist())))
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    if not steps:
        return False
    ys = np.array([[c[s] for s in steps] for c in curves])
    x = np.array(steps, dtype=float)
    ax.fill_between(x, np.nanmin(ys, 0), np.nanmax(ys, 0), color=color, alpha=0.25, lw=0)
    ax.plot(*_thin(x, np.nanmean(ys, 0)), color=color, lw=1.0, alpha=0.9, label=f"{label} (mean of {len(vr)} seeds, "
                                                                              f"band: min-max)")
    return True


# ----------------------------------------------------------------------------- exponent histograms
def _bound(line: dict, key: str, which: str):
    """hist_lo/hist_hi for a histogram key: next to it, else further up its path, else global."""
    tries = [f"{key}_{which}"]
    parts = key.split("/")
    for i in range(len(parts) - 1, 0, -1):
        tries.append("/".join(parts[:i]) + f"/hist_{which}")
    tries.append(f"hist_{which}")
    for k in tries:
        v = line.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return int(v)
    return None


def _parse_hist(line: dict, key: str):
    """-> ({exponent: count}, None) or (None, why). The contract: a list of counts for the integer
    exponents hist_lo..hist_hi; also read a wandb Histogram ({"bins", "values"}) or {exp: count}."""
    h = line[key]
    if isinstance(h, dict) and isinstance(h.get("bins"), list) and isinstance(h.get("values"), list):
        lo = round(h["bins"][0])
        return {lo + i: float(c) for i, c in enumerate(h["values"])}, None
    if isinstance(h, dict):
        try:
            return {int(k): float(c) for k, c in h.items()}, None
        except (TypeError, ValueError):
            return None, f"{key}: not a histogram"
    if not isinstance(h, list) or not all(isinstance(c, (int, float)) for c in h):
        return None, f"{key}: not a list of counts"
    lo, hi = _bound(line, key, "lo"), _bound(line, key, "hi")
    if lo is None:
        return None, f"{key}: no hist_lo beside it"
    if hi is not None and len(h) not in (hi - lo + 1, hi - lo):
        return None, f"{key}: {len(h)} bins do not fit exponents {lo}..{hi}"
    return {lo + i: float(c) for i, c in enumerate(h)}, None


def _hist_keys(line: dict, role: str) -> list[str]:
    for k in HIST_KEYS[role]:
        if k in line:
            return [k]
    found = sorted(k for k in line if HIST_PATTERN[role].match(str(k)))
    overall = [k for k in found if "/overall/" in k]
    return overall[:1] or found  # per-layer histograms sum to the overall one


def _zeros(line: dict, key: str):
    """(zero fraction, values counted) beside a histogram (mpt.numerics: <G>/<L>/frac_zero, count)."""
    prefix = key.rsplit("/", 1)[0]
    count = line.get(f"{prefix}/count")
    count = float(count) if isinstance(count, (int, float)) and not isinstance(count, bool) else None
    for name in ("frac_zero", "zero_frac", "zero_fraction"):
        v = line.get(f"{prefix}/{name}")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v), count
    return None, None


def _line_scale(line: dict, fallback) -> float:
    s = line.get("numerics/loss_scale")
    if isinstance(s, (int, float)) and not isinstance(s, bool) and s > 0 and math.isfinite(s):
        return float(s)
    return float(fallback) if isinstance(fallback, (int, float)) and fallback > 0 else 1.0


def _gather_hist(rs: list[RunResult], role: str, problems: list[Problem], stored: bool = False):
    """Sum the histograms of every snapshot of these runs. mpt.numerics records true gradients
    (|g| / S); stored=True shifts each snapshot by log2 of its S, giving what FP16 held during the
    loss-scaled backward pass (section 3.2)."""
    total = collections.Counter()
    zeros = {"fracs": [], "zero": 0.0, "count": 0.0}
    snapshots, steps, scales, reported = 0, [], set(), set()
    bands = {"nonzero": 0.0, "under": 0.0, "over": 0.0}
    for r in rs:
        for line in r.lines(problems).numerics:
            for key in _hist_keys(line, role):
                h, why = _parse_hist(line, key)
                if h is None:
                    if (r.where, why) not in reported:
                        reported.add((r.where, why))
                        problems.append(r.problem(f"numerics: {why}; not in the histogram"))
                    continue
                if stored:
                    scale = _line_scale(line, r.loss_scale)
                    scales.add(scale)
                    shift = int(round(math.log2(scale)))
                    h = {e + shift: c for e, c in h.items()}
                total.update(h)
                snapshots += 1
                steps.append(line.get("step"))
                frac, count = _zeros(line, key)
                if frac is not None and count is not None:
                    zeros["zero"] += frac * count
                    zeros["count"] += count
                elif frac is not None:
                    zeros["fracs"].append(frac)
                if stored and bands is not None:
                    bands = _add_bands(bands, line, key)
    if stored and (not snapshots or not bands):
        bands = None
    return total, snapshots, steps, zeros, scales, bands


def _add_bands(acc: dict, line: dict, key: str) -> dict | None:
    """mpt.numerics' band fractions are of the stored values (true gradient x S) and exact, where
    a shifted histogram smears its clamped end bins; None once a snapshot lacks them."""
    prefix = key.rsplit("/", 1)[0]
    vals = [line.get(f"{prefix}/{k}") for k in ("count", "frac_zero", "frac_underflow", "frac_overflow")]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
        return None
    n, fz, fu, fo = (float(v) for v in vals)
    return {"nonzero": acc["nonzero"] + n * (1 - fz), "under": acc["under"] + n * fu,
            "over": acc["over"] + n * fo}


def _zero_text(zeros) -> str:
    if zeros["count"]:
        return f"; zeros {100 * zeros['zero'] / zeros['count']:.1f}% of all values"
    if zeros["fracs"]:
        return f"; zeros {100 * float(np.mean(zeros['fracs'])):.1f}% of all values"
    return ""


def _has_hist(r: RunResult, role: str, problems) -> bool:
    return any(_hist_keys(line, role) for line in r.lines(problems).numerics)


def _hist(spec, runs, profile, problems, notes):
    """Figures 2b and 3: exponent histograms from the numerics lines, FP16's range marked."""
    role = spec.param("role")
    mine = [r for r in runs if r.profile == profile and _has_hist(r, role, problems)]
    if not mine:
        return None, (f"no {profile}-profile run has {ROLE_NAME[role]} histograms in its numerics "
                      f"lines (e.g. {HIST_KEYS[role][0]})")
    groups = collections.defaultdict(list)
    for r in mine:
        groups[(r.experiment, r.model, r.variant)].append(r)

    def score(key):  # the paper measured FP32 training of its model (sections 3.1, 3.2)
        return (key[2][0] in spec.precisions, _rank(key[0], spec.experiments), _rank(key[1], spec.models),
                -variant_key(key[2])[0], str(key))

    key = max(groups, key=score)
    hist, snaps, steps, zeros, _, _ = _gather_hist(groups[key], role, problems)
    if not hist:
        return None, f"the {ROLE_NAME[role]} histograms of {key[0]}/{key[1]} could not be read (see problems)"
    desc = f"{key[0]}/{key[1]}, {variant_label(key[2])}"
    steps = [s for s in steps if isinstance(s, (int, float))]
    span = f", steps {min(steps):g}..{max(steps):g}" if steps else ""
    notes.append(f"Ours: {desc}, {len(groups[key])} run(s) ({_seeds(groups[key])}); "
                 f"{snaps} histogram snapshot(s) summed{span}; true gradient values (|g| / S); "
                 "the first and last bins also hold everything beyond them.")

    second = None
    if spec.param("with_loss_scale"):
        # The numerics histograms hold true gradients; what FP16 stores in a loss-scaled backward
        # pass is S times that (section 3.2). Measured S from a loss-scaled run of the same model
        # if there is one, else the paper's S for SSD.
        scaled = [k for k in groups if k[:2] == key[:2] and k[2][0] in ("mixed", "fp16_pure")
                  and k[2][2] is not None and k[2][2] != 1]
        if scaled:
            k2 = max(scaled, key=str)
            h2, _, _, _, scales, bands = _gather_hist(groups[k2], role, problems, stored=True)
            if h2:
                srange = f"{min(scales):g}" if len(scales) == 1 else f"{min(scales):g}..{max(scales):g}"
                second = (h2, f"stored at S = {srange}: {key[0]}/{key[1]}, {variant_label(k2[2])} "
                              f"({_seeds(groups[k2])})", bands)
        if second is None:
            s = spec.paper.get("paper_loss_scale", 8)
            shift = int(round(math.log2(s)))
            second = (collections.Counter({e + shift: c for e, c in hist.items()}),
                      f"ours stored at S = {s} (the paper's; no loss-scaled run with histograms): "
                      f"shifted by log2(S) = {shift}", None)
    rows = 2 if second else 1
    fig = Figure(figsize=(10, 3.6 * rows), layout="constrained")
    axes = fig.subplots(rows, 1, squeeze=False, sharex=True).ravel()
    mark = tuple(spec.param("mark", ()))
    below, over = draw_hist(axes[0], hist, f"{desc}" + (", no loss scaling" if second else ""), "tab:blue", mark)
    summary = f"{below:.2f}% of non-zero values below 2^-24, {over:.2f}% above {FP16_MAX:g}" + _zero_text(zeros)
    axes[0].set_title(summary, fontsize=9)
    notes.append(("Without loss scaling: " if second else "") + summary + ".")
    if second:
        b2, o2 = draw_hist(axes[1], second[0], second[1], "tab:cyan", mark)
        under, over = "below 2^-24", f"above {FP16_MAX:g}"
        if second[2] and second[2]["nonzero"]:  # exact band counts beat the shifted histogram
            b2 = 100 * second[2]["under"] / second[2]["nonzero"]
            o2 = 100 * second[2]["over"] / second[2]["nonzero"]
            # mpt.numerics bands by FP16 rounding: <= 2^-25 stores as 0, >= 65520 as inf.
            under, over = "round to 0 in FP16", "overflow FP16"
        axes[1].set_title(f"with loss scaling: {b2:.2f}% {under}, {o2:.2f}% {over}", fontsize=9)
        notes.append(f"With loss scaling ({second[1]}): {b2:.2f}% {under}, {o2:.2f}% {over}.")
    axes[-1].set_xlabel(f"log2 |{ROLE_NAME[role]}| (exponent)")
    for ax in axes:  # outside the axes: a histogram may sit anywhere in the exponent range
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig, None


# ----------------------------------------------------------------------------- DCGAN samples
def _natural(p) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def _samples(spec, runs, profile, problems, notes):
    """Figure 6: the latest sample grid of the newest run of each precision, side by side, with
    its metric (DCGAN: the SWD) and, beneath, its G/D loss curves. A precision in the spec's `extra`
    is drawn after the paper's and titled as not in the paper's figure."""
    panels, shown = [], []
    for prec in spec.precisions:
        extra = "extra, not in the paper's figure: " if prec in spec.param("extra", ()) else ""
        rs = [r for r in _candidates(spec, runs, profile) if r.precision == prec and r.run_dir is not None
              and r.experiment in spec.experiments]
        image = None
        for r in sorted(rs, key=lambda r: r.updated, reverse=True):
            files = sorted(r.run_dir.glob("samples_*.png"), key=_natural)
            for f in reversed(files):
                try:
                    image = matplotlib.image.imread(f)
                except Exception as e:  # noqa: BLE001 -- a half-written PNG: try an older one
                    problems.append(r.problem(f"{f.name} unreadable ({type(e).__name__}); skipped"))
                    continue
                panels.append((f"{extra}{variant_label(r.variant)}\n{r.name}/{f.name}", image))
                shown.append(r)
                notes.append(f"{extra}{variant_label(r.variant)}: {r.where}/{f.name} (status {r.status})")
                break
            if image is not None:
                break
        if image is None:
            notes.append(f"not run yet (no samples_*.png): {extra}{variant_label((prec, None, None, False))}")
    if not panels:
        return None, f"no {' or '.join(spec.experiments)} run ({profile} profile) has samples_*.png files"
    # Beneath the grids: the G and D losses of the same runs, and their sample-quality metric.
    curves = [(title, run) for (title, _), run in zip(panels, shown) if run.lines(problems).train_parts]
    fig = Figure(figsize=(5 * len(panels), 5.4 + (3.0 if curves else 0)), layout="constrained")
    rows = fig.subplots(2 if curves else 1, len(panels), squeeze=False,
                        gridspec_kw={"height_ratios": [5, 3]} if curves else None)
    for ax, (title, image), run in zip(rows[0], panels, shown):
        ax.imshow(image)
        key = spec.param("metric")
        m = {key: run.metrics[key]} if key in run.metrics else {}
        ax.set_title(title + "".join(f"\n{k} {v:.1f}" for k, v in m.items() if isinstance(v, (int, float))),
                     fontsize=9)
        ax.axis("off")
        for k, v in m.items():
            notes.append(f"{variant_label(run.variant)}: {k} = {v} ({spec.param('metric_note', '')})")
    if curves:
        for ax, run in zip(rows[1], shown):
            for name, pts in sorted(run.lines(problems).train_parts.items()):
                x, y = _thin(_float_array([p[0] for p in pts]), _float_array([p[1] for p in pts]))
                ax.plot(x, y, lw=1.0, label=name)
            ax.set_xlabel("iteration")
            ax.set_ylabel("training loss")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    return fig, None


# ----------------------------------------------------------------------------- loss scale
def _loss_scale(spec, runs, profile, problems, notes):
    """S over training for every run with a scaler (dynamic scaling is later practice, section 5)."""
    by_exp = collections.defaultdict(list)
    for r in _candidates(spec, runs, profile):
        s = [v for v in r.lines(problems).train_scale if v is not None and math.isfinite(v)]
        if s and not all(v == 1 for v in s):
            by_exp[r.experiment].append(r)
    if not by_exp:
        return None, f"no {profile}-profile run logged a loss scale other than 1 (train lines' loss_scale)"
    exps = sorted(by_exp)
    cols = min(len(exps), 2)
    fig = Figure(figsize=(6.4 * cols, 3.8 * math.ceil(len(exps) / cols)), layout="constrained")
    axes = fig.subplots(math.ceil(len(exps) / cols), cols, squeeze=False).ravel()
    for ax, exp in zip(axes, exps):
        rs = sorted(by_exp[exp], key=lambda r: (r.model, variant_key(r.variant), str(r.seed)))
        for r in rs:
            lines = r.lines(problems)
            x, y = _thin(_float_array(lines.train_step), _float_array(lines.train_scale))
            skipped = f", {r.skipped_steps} skipped" if r.skipped_steps is not None else ""
            ax.plot(x, y, lw=1.0, drawstyle="steps-post",  # S changes in jumps
                    label=f"{r.model} {variant_label(r.variant)} s{r.seed}{skipped}")
        ax.set_yscale("log", base=2)
        ax.set_xlabel("iteration")
        ax.set_ylabel("loss scale S")
        ax.set_title(exp, fontsize=10)
        ax.grid(alpha=0.3)
        if len(rs) <= 10:
            ax.legend(fontsize=7)
        else:
            notes.append(f"{exp}: {len(rs)} runs, legend left out")
        notes.append(f"{exp}: {len(rs)} run(s)")
    for ax in axes[len(exps):]:
        ax.set_visible(False)
    return fig, None


# ----------------------------------------------------------------------------- FP8 ranges
# (numerics group, format, what, smallest-subnormal exponent, smallest-normal exponent, top exponent, max),
# the numbers from the one table of formats (mpt.formats.ELEMENTS)
FP8_ROLES = tuple((group, name.upper(), what, e.emin - e.mantissa_bits, e.emin, e.emax, e.max)
                  for group, name, what in (("fwd", "e4m3", "activations (forward values)"),
                                            ("act", "e5m2", "activation gradients"))
                  for e in [formats.ELEMENTS[name]])


def _layer_hists(line: dict, group: str):
    """{layer: ({exponent: count}, max_abs)} of one numerics line's group, the overall row excluded."""
    out = {}
    for k in line:
        m = re.fullmatch(rf"numerics/{group}/(.+)/hist", str(k))
        if not m or m.group(1) == "overall":
            continue
        h, why = _parse_hist(line, k)
        mx = line.get(f"numerics/{group}/{m.group(1)}/max_abs")
        if h is not None and isinstance(mx, (int, float)) and not isinstance(mx, bool):
            out[m.group(1)] = (h, float(mx))
    return out


def _fp8_hist(spec, runs, profile, problems, notes):
    """Where the values an FP8 recipe quantises lie against E4M3 (activations) and E5M2 (activation
    gradients): as measured, and with each layer's per-tensor scale -- its histogram shifted by
    floor(log2(format max / the layer's max |value|)), the power of two at or below the scale that
    puts the layer's amax at the format's maximum (current scaling; delayed scaling's amax history
    can only lower the scale). A run without forward-value histograms (numerics of earlier versions)
    gives the gradient panel only."""
    def score_run(r):
        lines = r.lines(problems).numerics
        return max((("numerics/fwd/overall/hist" in ln) + ("numerics/act/overall/hist" in ln) for ln in lines),
                   default=0)

    mine = [(score_run(r), r) for r in runs if r.profile == profile]
    mine = [(sc, r) for sc, r in mine if sc > 0]
    if not mine:
        return None, (f"no {profile}-profile run has activation or activation-gradient histograms "
                      "(numerics/fwd/..., numerics/act/...: numerics.every > 0)")
    groups = collections.defaultdict(list)
    best = {}
    for sc, r in mine:
        k = (r.experiment, r.model, r.variant)
        groups[k].append(r)
        best[k] = max(best.get(k, 0), sc)
    key = max(groups, key=lambda k: (best[k], k[2][0] in spec.precisions, _rank(k[0], spec.experiments),
                                     _rank(k[2][0], spec.precisions), str(k)))
    fig = Figure(figsize=(10, 8), layout="constrained")
    axes = fig.subplots(2, 1, squeeze=False).ravel()
    desc = f"{key[0]}/{key[1]}, {variant_label(key[2])}"
    snaps = collections.Counter()
    for ax, (group, fmt, what, sub, normal, top, fmt_max) in zip(axes, FP8_ROLES):
        raw, scaled = collections.Counter(), collections.Counter()
        for r in groups[key]:
            for line in r.lines(problems).numerics:
                if f"numerics/{group}/overall/hist" not in line:
                    continue
                h, _ = _parse_hist(line, f"numerics/{group}/overall/hist")
                if h is None:
                    continue
                raw.update(h)
                snaps[group] += 1
                for lh, mx in _layer_hists(line, group).values():
                    shift = math.floor(math.log2(fmt_max / mx)) if mx > 0 else 0
                    scaled.update({e + shift: c for e, c in lh.items()})
        ax.axvspan(sub - 0.5, normal - 0.5, color="tab:orange", alpha=0.15,
                   label=f"{fmt} subnormal [2^{sub}, 2^{normal})")
        ax.axvspan(normal - 0.5, top + 0.5, color="tab:green", alpha=0.12, label=f"{fmt} normal [2^{normal}, {fmt_max:g}]")
        ax.set_xlabel(f"log2 |{what}|")
        if not raw:
            ax.set_title(f"{what}: no histograms in this run's numerics", fontsize=9)
            notes.append(f"{what} vs {fmt}: no histograms in this run's numerics.")
            continue
        lines = []
        for hist, label, color, off in ((raw, "as measured (no scale)", "tab:blue", -0.2),
                                        (scaled, "with each layer's per-tensor scale", "tab:red", 0.2)):
            if not hist:
                lines.append(f"{label}: no per-layer maxima recorded")
                continue
            exps = np.array(sorted(hist))
            counts = np.array([hist[e] for e in exps], dtype=float)
            total = counts.sum()
            ax.bar(exps + off, 100 * counts / total, width=0.4, color=color, label=label)
            below = 100 * counts[exps < sub - 1].sum() / total
            over = 100 * counts[exps > top].sum() / total
            lines.append(f"{label}: {below:.2f}% below 2^{sub - 1} (zero in {fmt}), {over:.2f}% above 2^{top + 1}")
        ax.set_yscale("log")
        ax.set_ylabel("% of non-zero values")
        ax.grid(alpha=0.3, axis="y")
        ax.set_title(f"{what} vs {fmt}\n" + "\n".join(lines), fontsize=8)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        notes.append(f"{what} vs {fmt}: " + "; ".join(lines) + ".")
    notes.insert(0, f"Ours: {desc}, {len(groups[key])} run(s) ({_seeds(groups[key])}); "
                    f"{max(snaps.values(), default=0)} snapshot(s) summed; non-zero values only; the end bins "
                    "also hold everything beyond them; the scaled histogram shifts each layer by a whole power "
                    "of two, so it may sit up to one binade below the exact per-tensor scale.")
    return fig, None


BUILDERS = {"curves": _curves, "exponent_hist": _hist, "samples": _samples, "loss_scale": _loss_scale,
            "fp8_hist": _fp8_hist}


def build_figure(spec: specs.FigureSpec, runs: list[RunResult], profile: str,
                 problems: list[Problem]) -> FigureResult:
    res = FigureResult(spec, profile)
    local: list[Problem] = []
    try:
        fig, res.missing = BUILDERS[spec.kind](spec, runs, profile, local, res.notes)
        if fig is not None:
            label = specs.profile_label(profile)
            if label:
                fig.suptitle(label, color="tab:red", fontsize=10, fontweight="bold")
            res.png, res.svg = render(fig, "png"), render(fig, "svg")
    except Exception as e:  # noqa: BLE001 -- results we did not foresee must not stop the other figures
        res.missing = f"could not be drawn ({type(e).__name__}: {e}); see problems"
        res.png = res.svg = None
        local.append(Problem(spec.id, f"drawing failed: {type(e).__name__}: {e}", None, profile))
    res.problems = local
    problems.extend(p for p in local if str(p) not in {str(q) for q in problems})
    return res
