"""Drawing shared by the paper's figures (paper_tables: Figures 2b and 3) and the doctor's histograms.png:
exponent histograms against FP16's range, and a figure rendered to bytes.

Takes matplotlib axes and figures made by the caller (the object API, never pyplot), so importing it
loads no plotting backend.
"""
from __future__ import annotations

import collections
import io
from typing import TYPE_CHECKING

import numpy as np

from mpt import formats

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# FP16's exponent range (section 3; mpt.formats.ELEMENTS): smallest subnormal 2^-24, smallest normal
# 2^-14, largest finite 65504 < 2^16, so normal exponents run -14..15 and subnormals -24..-15.
_FP16 = formats.ELEMENTS["fp16"]
FP16_SUBNORMAL = (_FP16.emin - _FP16.mantissa_bits, _FP16.emin - 1)
FP16_NORMAL = (_FP16.emin, _FP16.emax)
FP16_MAX = _FP16.max


def draw_hist(ax, hist: collections.Counter, label: str, color: str, mark=()):
    """Bars of {exponent: count} as % of the non-zero values, FP16's bands shaded (Figures 2b and 3;
    mpt.doctor's histograms). Returns the % below 2^-24 and above 65504."""
    exps = np.array(sorted(hist))
    counts = np.array([hist[e] for e in exps], dtype=float)
    total = counts.sum()
    pct = 100.0 * counts / total if total else counts
    ax.axvspan(FP16_SUBNORMAL[0] - 0.5, FP16_SUBNORMAL[1] + 0.5, color="tab:orange", alpha=0.15,
               label="FP16 subnormal [2^-24, 2^-14)")
    ax.axvspan(FP16_NORMAL[0] - 0.5, FP16_NORMAL[1] + 0.5, color="tab:green", alpha=0.12,
               label=f"FP16 normal [2^{FP16_NORMAL[0]}, {FP16_MAX:g}]")
    ax.axvline(FP16_SUBNORMAL[0] - 0.5, color="tab:red", lw=1.2, label="below 2^-24: zero in FP16")
    ax.axvline(FP16_NORMAL[1] + 0.5, color="tab:purple", lw=1.2, label=f"above {FP16_MAX:g}: overflow in FP16")
    for m in mark:
        ax.axvline(m - 0.5, color="gray", ls="--", lw=1.0, label=f"2^{m}")
    ax.bar(exps, pct, width=0.9, color=color, label=label)
    ax.set_yscale("log")
    ax.set_ylabel("% of non-zero values")
    ax.grid(alpha=0.3, axis="y")
    below = 100.0 * counts[exps < FP16_SUBNORMAL[0]].sum() / total if total else 0.0
    over = 100.0 * counts[exps > FP16_NORMAL[1]].sum() / total if total else 0.0
    return below, over


def render(fig: Figure, fmt: str) -> bytes:
    """A matplotlib Figure as PNG or SVG bytes."""
    buf = io.BytesIO()
    # No dates in the files, so regenerating unchanged results gives unchanged files.
    meta = {"Date": None} if fmt == "svg" else {"Software": None}
    fig.savefig(buf, format=fmt, dpi=110, metadata=meta)
    return buf.getvalue()
