"""The registry of tables and figures: one small spec each, so a new experiment plugs in with a spec
line (and, for a table, the paper's numbers in paper_numbers.yaml) instead of new code."""
from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import re

import yaml

from mpt import precisions

PAPER_NUMBERS = pathlib.Path(__file__).with_name("paper_numbers.yaml")

TINY_LABEL = "TINY PROFILE (CPU smoke data, not comparable to the paper)"
STATUSES = ("completed", "running", "interrupted", "diverged", "failed")
# Orders columns and legends: the paper's three modes first (section 4), then later practice, then what
# is beyond the paper (its successors) -- one column per precision or variant of one (mpt.precisions;
# results.run_precision names a run's column).
PRECISION_ORDER = tuple(c.name for c in precisions.COLUMNS)


@dataclasses.dataclass(frozen=True)
class TableSpec:
    id: str
    experiment: str
    metric: tuple[str, ...]  # candidate keys of summary["metrics"], first found wins
    higher_is_better: bool
    decimals: int
    metric_scale: float = 1.0  # multiply ours by this to reach the paper's unit (percent)

    @property
    def paper(self) -> dict:
        return paper_numbers()["tables"][self.id]


@dataclasses.dataclass(frozen=True)
class FigureSpec:
    id: str
    kind: str  # which builder in paper_tables.figures draws it
    experiments: tuple[str, ...] = ()  # in order of preference; () = any known experiment
    any_experiment: bool = False  # fall back to any experiment when the preferred have nothing
    models: tuple[str, ...] = ()  # preferred models (the paper's), in order
    precisions: tuple[str, ...] = ()
    params: tuple[tuple[str, object], ...] = ()  # kind-specific settings, as pairs to stay hashable

    def param(self, name, default=None):
        return dict(self.params).get(name, default)

    @property
    def paper(self) -> dict:
        return paper_numbers()["figures"][self.id]


TABLES: tuple[TableSpec, ...] = (
    TableSpec("table1", "ilsvrc_cnns", ("top1",), higher_is_better=True, decimals=2),
    TableSpec("table2", "voc_detection", ("mAP", "map"), higher_is_better=True, decimals=1),
    TableSpec("table3", "deepspeech2", ("cer", "CER"), higher_is_better=False, decimals=2),
    # Not the paper's: end-of-training numbers of the experiments the paper shows as figures.
    TableSpec("final_lm", "lm_biglstm", ("ppl",), higher_is_better=False, decimals=2),
    TableSpec("final_nmt", "wmt_translation", ("perplexity",), higher_is_better=False, decimals=2),
    TableSpec("final_gan", "dcgan", ("swd",), higher_is_better=False, decimals=1),
)

# The possible values of each metric a run reports (summary.json "metrics"): [low, high] and what makes
# them the bounds. A value outside is no result -- a bug, a damaged or edited summary -- and is never
# averaged into a table. CER and WER have no upper bound (insertions count), perplexity is exp(NLL >= 0).
METRIC_RANGES: dict[str, tuple[float, float, str]] = {
    **dict.fromkeys(("top1", "top5", "mAP", "map", "bleu"), (0.0, 100.0, "a percentage")),
    **dict.fromkeys(("cer", "CER", "wer", "WER"), (0.0, math.inf, "an error rate in percent")),
    **dict.fromkeys(("ppl", "perplexity"), (1.0, math.inf, "a perplexity")),
    **dict.fromkeys(("nll", "swd"), (0.0, math.inf, "a distance or a negative log-likelihood")),
}


def impossible_metrics(metrics: dict) -> list[str]:
    """'name = value (what: [low, high])' for each finite number in `metrics` outside its possible range
    (METRIC_RANGES); non-finite values are a diverged run's and are handled where tables average."""
    out = []
    for k, v in metrics.items():
        if k in METRIC_RANGES and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            lo, hi, what = METRIC_RANGES[k]
            if not lo <= v <= hi:
                out.append(f"{k} = {v!r} ({what}: {lo:g} to {hi:g})")
    return out


FIGURES: tuple[FigureSpec, ...] = (
    # Figure 2a: the master-copy ablation was run on the Mandarin speech model (section 3.1), in the
    # pseudo-FP16 of section 4.3 (FP16 storage, FP32 math, no loss scaling) with and without the FP32
    # master copy: fp16_storage beside fp16_pure, so that the master copy is the one thing that differs.
    FigureSpec("figure2a", "curves", experiments=("deepspeech2",), any_experiment=True,
               models=("mandarin", "english"), precisions=("fp32", "fp16_storage", "fp16_pure"),
               params=(("single", True), ("y", "loss"), ("eval", True))),
    FigureSpec("figure2b", "exponent_hist", experiments=("deepspeech2",), any_experiment=True,
               models=("mandarin", "english"), precisions=("fp32",),
               params=(("role", "weight_grad"),)),
    # Figure 3 is SSD's activation gradients (section 3.2); S = 8 is what SSD needed.
    FigureSpec("figure3", "exponent_hist", experiments=("voc_detection",), any_experiment=True,
               models=("ssd300_vgg16",), precisions=("fp32",),
               params=(("role", "act_grad"), ("with_loss_scale", True), ("mark", (-27,)))),
    # Figure 4 shows three FP32 runs "because FP32 runs varied": several seeds of a precision as a band.
    FigureSpec("figure4", "curves", experiments=("wmt_translation",), precisions=("fp32", "fp16", "mixed"),
               params=(("y", "perplexity"), ("band", True))),
    FigureSpec("figure5", "curves", experiments=("lm_biglstm",), precisions=("fp32", "fp16", "mixed"),
               params=(("y", "perplexity"), ("expect", (("fp32", None), ("fp16", None), ("mixed", 128))))),
    # Figure 6 is qualitative: FP32 beside MP without loss scaling (fp16, S = 1: section 4.6, "no loss
    # scaling"); mixed (dynamic S, later practice) is an extra panel, labelled so. The number beside each
    # grid is ours: the multi-scale sliced Wasserstein distance (Karras et al. 2018) to held-out faces
    # (experiments/dcgan/README.md).
    FigureSpec("figure6", "samples", experiments=("dcgan",), precisions=("fp32", "fp16", "mixed"),
               params=(("metric", "swd"), ("metric_note", "SWD x 1e3 to held-out faces, lower is better"),
                       ("extra", ("mixed",)))),
    FigureSpec("loss_scale", "loss_scale", any_experiment=True, precisions=("mixed", "fp16_pure", "fp16")),
    # Beyond the paper: the values an FP8 recipe quantises, against E4M3 / E5M2, unscaled and
    # with each layer's per-tensor scale; from any run whose numerics hold forward-value histograms.
    FigureSpec("fp8_ranges", "fp8_hist", experiments=("ilsvrc_cnns", "voc_detection", "deepspeech2"),
               any_experiment=True, precisions=("fp32", "fp8_delayed", "fp8_current")),
)

# Experiments with no table or figure of their own whose runs are still results (Figure 2a, the
# loss-scale plot and the histograms take any experiment).
OTHER_EXPERIMENTS: tuple[str, ...] = ()


@functools.cache
def paper_numbers() -> dict:
    return yaml.safe_load(PAPER_NUMBERS.read_text())


def known_experiments() -> tuple[str, ...]:
    names = [t.experiment for t in TABLES] + [e for f in FIGURES for e in f.experiments]
    return tuple(dict.fromkeys(names + list(OTHER_EXPERIMENTS)))


def model_aliases() -> dict[tuple[str, str], str]:
    """(experiment, alias) -> the table row's model name (Table 3: ds2_english -> english)."""
    out = {}
    for t in TABLES:
        for row in t.paper["rows"]:
            for alias in row.get("aliases", []):
                out[(t.experiment, alias)] = row["model"]
    return out


def profile_label(profile: str) -> str | None:
    """The banner on every table and figure that is not the paper's setup (None for "paper")."""
    if profile == "paper":
        return None
    if profile == "tiny" or profile.startswith("tiny-"):  # tiny-<dataset>: results.split_by_data
        return TINY_LABEL
    return f"{profile.upper()} PROFILE (not the paper's setup, not comparable to the paper)"


def profile_suffix(profile: str) -> str:
    # The profile comes from run files: keep only characters that are safe in a file name.
    return "" if profile == "paper" else "_" + re.sub(r"[^A-Za-z0-9_-]", "_", profile)
