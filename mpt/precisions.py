"""Every precision, one row each: what the config's checks, the recipes (mpt/precision.py), the
speed/memory benchmark and the generated tables and figures (paper_tables) know about it. Imports no
torch, so the config and paper_tables read it on any machine.

A new precision is a row here naming the recipe that runs it (Precision.recipe): an existing scheme, a
new recipe class in mpt/precision.py (registered in its RECIPES and in RECIPE_KINDS here), or, for a
simulated low-precision format, "formats" and a FormatRecipe of the same name in mpt.formats.RECIPES --
then nothing else: the config's checks, the recipe and paper_tables' columns follow from the two rows.
A row whose recipe is missing is a one-line error when a config names it (check), never a run in FP32
under the new name.
"""
from __future__ import annotations

import dataclasses
import math

from mpt import formats
from mpt.errors import UserError

IMPLS = ("autocast", "paper")
HALF_MATHS = ("auto", "emulated", "native")
ROUNDINGS = ("nearest", "stochastic", "kahan")
FP8_SCALINGS = ("delayed", "current")
FP8_AMAX_ALGOS = ("max", "most_recent")
FP8_ENDS = ("bf16", "fp8")
# What Precision.recipe may name: "impl", the scheme cfg.impl names (mpt.precision.IMPL_RECIPES:
# Autocast or MasterCopy); "formats", the simulated-format recipe (mpt.precision.FP8) on the
# FormatRecipe of the precision's name in mpt.formats.RECIPES; or a recipe class of mpt/precision.py
# by name (its RECIPES, which tests/test_precision.py holds to this tuple).
RECIPE_KINDS = ("impl", "formats", "FP32", "FP16Storage", "NoMasterCopy")


@dataclasses.dataclass(frozen=True)
class Column:
    """A column of the generated tables and a curve of the figures: a precision, or a variant of one
    that a config key makes another recipe (paper_tables.results.run_precision names them)."""

    name: str
    label: str  # the column's header where no column of the paper's takes it
    color: str | None = None  # its curves' colour (matplotlib); None: the next of the default cycle
    beyond_paper: bool = False  # the paper's successors: labelled so in every table and figure
    figure_label: str = ""  # its legend entry, where that is not the label

    @property
    def legend(self) -> str:
        return self.figure_label or self.label


def _beyond(name: str, what: str, color: str | None = None) -> Column:
    return Column(name, f"beyond the paper: {what}", color, beyond_paper=True)


@dataclasses.dataclass(frozen=True)
class Precision:
    """One precision: what it stores and computes in, how it treats the loss scale, which impls run it,
    and its columns in the generated tables."""

    name: str
    doc: str  # what it is, and where the paper (or the successor it comes from) describes it
    storage: str  # torch dtype of the weights, activations and gradients in the paper's scheme (impl=paper)
    compute: str  # what the dot products' operands are: float32 | tfloat32 | float16 | bfloat16 | float8 | float4
    # The optimizer's result lives on in FP32 (a master copy, or FP32 weights that are their own);
    # False: it is rounded into FP16/BF16 weights each step and what rounding loses is lost (section 3.1).
    master: bool
    loss_scaling: bool  # takes loss_scale=<S> and dynamic (section 3.2)
    auto_loss_scale: str | None  # what loss_scale=auto means: "dynamic", or None (S = 1, no scaler)
    # The impls that run it: both, the paper's alone (what the model stores is the precision, which
    # autocast's FP32 weights cannot express), or none where cfg.impl changes nothing.
    impls: tuple[str, ...]
    columns: tuple[Column, ...]
    recipe: str  # what runs it: one of RECIPE_KINDS (check() refuses a row whose recipe is missing)
    beyond_paper: bool = False
    tf32: bool = False  # FP32 with TF32 tensor-core math: a setting of fp32 (cfg.tf32), not a recipe
    # The error for a loss scale other than 1 where the precision takes none ({value}, {name}).
    refuses_scale: str = "loss_scale={value} does nothing for precision={name}; leave it at auto"
    # A simulated format's price: at most this many times FP32's step time on the CPU benchmark
    # (experiments.speed_memory.formats_cost); None: measured and reported, with no goal.
    cost_goal: float | None = None

    @property
    def half_compute(self) -> bool:
        """A GPU runs its convolutions and matmuls in FP16/BF16 (tensor cores)."""
        return self.compute in ("float16", "bfloat16")

    @property
    def run_as(self) -> str:
        """cfg.precision of a run in this precision (TF32: fp32, with cfg.tf32 on)."""
        return "fp32" if self.tf32 else self.name


def _simulated(name: str, doc: str, label: str, color: str, *, compute: str = "float8", cost_goal: float,
               per: str = "each block", all_label: str | None = None) -> Precision:
    """A simulated low-precision format's row: FP32 storage and master weights around its recipe of
    mpt.formats (recipe="formats", a FormatRecipe of the same name), no loss scale (its own scales replace
    it), and two columns: the first and last layers in BF16 (fp8.ends=bf16) and every layer quantised."""
    return Precision(
        name, doc, storage="float32", compute=compute, master=True, loss_scaling=False, auto_loss_scale=None,
        impls=(), recipe="formats", beyond_paper=True,
        columns=(_beyond(name, f"{label}, BF16 first/last layers", color),
                 _beyond(f"{name}_all", all_label or f"{label}, every layer")),
        cost_goal=cost_goal,
        refuses_scale=f"precision={name} scales {per} on its own; loss_scale={{value}} is not used: leave it at auto")


TABLE: tuple[Precision, ...] = (
    Precision(
        "fp32", "Everything FP32: the paper's baseline (TF32 is a separate switch, off by default).",
        storage="float32", compute="float32", master=True, loss_scaling=False, auto_loss_scale=None,
        impls=(), recipe="FP32",
        columns=(Column("fp32", "FP32", "black"),)),
    Precision(
        "tf32", "FP32 storage, matmuls and convolutions on TF32 tensor cores (precision=fp32 tf32=true): "
        "a baseline the paper predates.",
        storage="float32", compute="tfloat32", master=True, loss_scaling=False, auto_loss_scale=None,
        impls=(), recipe="FP32",
        columns=(Column("tf32", "TF32 baseline"),), tf32=True),
    Precision(
        "fp16", "The paper's \"MP without loss scaling\": FP16 forward and backward, FP32 master weights, "
        "S = 1 and no overflow skipping, so a network that diverges (SSD, Table 2) diverges here.",
        storage="float16", compute="float16", master=True, loss_scaling=False, auto_loss_scale=None,
        impls=IMPLS, recipe="impl",
        columns=(Column("fp16", "FP16 math, no loss scaling", "tab:orange", figure_label="MP, no loss scaling (S=1)"),),
        refuses_scale="precision=fp16 is the paper's 'without loss scaling' mode (S = 1); "
                      "for S = {value} use precision=mixed loss_scale={value}"),
    Precision(
        "mixed", "FP16 math, FP32 master weights and loss scaling (section 3): a constant S (the paper's) "
        "or dynamic (a later framework feature, section 5); both skip the update on inf/nan.",
        storage="float16", compute="float16", master=True, loss_scaling=True, auto_loss_scale="dynamic",
        impls=IMPLS, recipe="impl",
        columns=(Column("mixed", "FP16 math, loss scaling", "tab:blue", figure_label="MP"),)),
    Precision(
        "bf16", "BF16 math, FP32 master weights, no loss scaling (BF16 has FP32's exponent range): later "
        "practice, not the paper's.",
        storage="bfloat16", compute="bfloat16", master=True, loss_scaling=False, auto_loss_scale=None,
        impls=IMPLS, recipe="impl",
        columns=(Column("bf16", "BF16", "tab:green"),)),
    Precision(
        "fp16_pure", "Figure 2a's ablation: FP16 weights updated directly, no FP32 master copy (section 3.1); "
        "loss scaling only where asked.",
        storage="float16", compute="float16", master=False, loss_scaling=True, auto_loss_scale=None,
        impls=("paper",), recipe="NoMasterCopy",
        columns=(Column("fp16_pure", "FP16 weights, no master copy", "tab:red"),
                 _beyond("fp16_pure_stochastic", "FP16 weights, no master copy, stochastic rounding"),
                 _beyond("fp16_pure_kahan", "FP16 weights, no master copy, Kahan summation"))),
    Precision(
        "fp16_storage", "\"FP16 storage, FP32 math\", how the paper ran DeepSpeech 2 (section 4.3): FP16 "
        "weights, activations and gradients, FP32 master weights, every dot product and softmax computed in "
        "FP32; loss scaling only where asked.",
        storage="float16", compute="float32", master=True, loss_scaling=True, auto_loss_scale=None,
        impls=("paper",), recipe="FP16Storage",
        columns=(Column("fp16_storage", "FP16 storage, FP32 math", "tab:purple"),)),
    Precision(
        "fp8", "FP8 operands for every dot product of a weight-bearing layer, E4M3 forward and E5M2 backward, "
        "each tensor at its own scale (Micikevicius et al. 2022, \"FP8 Formats for Deep Learning\"), FP32 "
        "master weights; simulated, so its numerics, not its speed.",
        storage="float32", compute="float8", master=True, loss_scaling=False, auto_loss_scale=None,
        impls=(), recipe="formats", beyond_paper=True,
        columns=(_beyond("fp8_delayed", "FP8, delayed scaling, BF16 first/last layers", "tab:brown"),
                 _beyond("fp8_current", "FP8, current scaling, BF16 first/last layers", "tab:pink"),
                 _beyond("fp8_delayed_all", "FP8, delayed scaling, every layer", "tab:olive"),
                 _beyond("fp8_current_all", "FP8, current scaling, every layer", "tab:cyan")),
        cost_goal=2.0,  # FP8 family 2x, NVFP4 3x (stochastic rounding and the Hadamard on top)
        refuses_scale="precision=fp8 scales each tensor on its own (fp8.scaling); loss_scale={value} "
                      "is not used: leave it at auto"),
    _simulated(
        "fp8_rowwise", "torchao.float8's rowwise recipe (Float8LinearConfig.from_recipe_name('rowwise')): E4M3 "
        "operands for every weight-bearing dot product, one power-of-2 scale per row along the reduction axis "
        "for activations, weights and output gradients; FP32 accumulation and master weights; simulated "
        "(mpt.formats).",
        "row-wise FP8 (torchao)", "darkorange", cost_goal=2.0, per="each row"),
    _simulated(
        "fp8_rowwise_gw_hp", "torchao.float8's rowwise_with_gw_hp recipe: fp8_rowwise's forward, the data "
        "gradient from the row-wise E4M3 output gradient and a per-tensor E4M3 weight, the weight gradient "
        "from the unquantised input and output gradient (high precision); simulated (mpt.formats).",
        "row-wise FP8, weight gradient in high precision (torchao)", "goldenrod", cost_goal=2.0, per="each row"),
    _simulated(
        "fp8_block", "DeepSeek-V3's fine-grained FP8 (arXiv 2412.19437, section 3.3): E4M3 operands for every "
        "weight-bearing dot product, activations and gradients scaled per 1x128 tile, weights per 128x128 "
        "block, power-of-2 scales; FP32 accumulation and master weights; simulated (mpt.formats).",
        "block-scaled FP8 (1x128 / 128x128)", "peru", cost_goal=2.0),
    _simulated(
        "mxfp8", "OCP Microscaling MXFP8 (arXiv 2310.10537): E4M3 operands in 32-element blocks, each with a "
        "power-of-2 (E8M0) scale rounded up so that no block overflows (RCEIL, arXiv 2506.08027); FP32 "
        "accumulation and master weights; simulated (mpt.formats).",
        "MXFP8 (32-element E8M0 blocks)", "teal", cost_goal=2.0),
    _simulated(
        "nvfp4", "NVFP4 (arXiv 2509.25149; Transformer Engine's NVFP4BlockScaling): E2M1 operands in 16-element "
        "blocks with E4M3 scales under an FP32 per-tensor scale; gradients rounded stochastically; a 16x16 random "
        "Hadamard transform on the weight-gradient product's operands; FP32 accumulation and master weights; "
        "simulated (mpt.formats).",
        "NVFP4 (16-element E4M3-scaled blocks)", "crimson", compute="float4", cost_goal=3.0),
    _simulated(
        "nvfp4_paper", "The NVFP4 pretraining paper's recipe (arXiv 2509.25149): nvfp4's formats (2-D 16x16 weight "
        "blocks, stochastic rounding on gradients, the random Hadamard transform on the weight-gradient operands), "
        "the last 15% of the weight-bearing layers in BF16 (fmt.keep_last) and BF16 operands for the last 18% of "
        "the steps (fmt.bf16_tail); FP32 accumulation and master weights; simulated (mpt.formats).",
        "NVFP4, the NVFP4 paper's recipe (last 15% of layers and last 18% of steps in BF16)", "darkred",
        compute="float4", cost_goal=3.0,
        # its kept last layers stay in BF16 with fp8.ends=fp8 too: that column is not "every layer"
        all_label="NVFP4, the NVFP4 paper's recipe (last 15% of layers and last 18% of steps in BF16)"),
    Precision(
        "bf16_pure", "BF16 weights updated directly, no FP32 master copy: fp16_pure's scheme in BF16 "
        "(Zamirai et al. 2020, \"Revisiting BFloat16 Training\"), the update rounded by `rounding`.",
        storage="bfloat16", compute="bfloat16", master=False, loss_scaling=False, auto_loss_scale=None,
        impls=("paper",), recipe="NoMasterCopy", beyond_paper=True,
        columns=(_beyond("bf16_pure", "BF16 weights, no master copy, round to nearest", "tab:gray"),
                 _beyond("bf16_pure_stochastic", "BF16 weights, no master copy, stochastic rounding", "darkgreen"),
                 _beyond("bf16_pure_kahan", "BF16 weights, no master copy, Kahan summation", "navy"))),
)

BY_NAME = {p.name: p for p in TABLE}
PRECISIONS = tuple(p.name for p in TABLE if not p.tf32)  # the values of cfg.precision
# Precisions whose convolutions and matmuls a GPU runs in FP16/BF16 on tensor cores. fp16_storage
# computes in FP32 (section 4.3) and fp8 is simulated around FP32 kernels: neither is among them.
HALF_COMPUTE = tuple(p.name for p in TABLE if p.half_compute)
# The order of table columns and figure legends: the paper's precisions and its baselines first, then
# the precisions beyond the paper, then the variants beyond it of the first (fp16_pure's roundings).
_OWN = [p for p in TABLE if not p.tf32 and not p.beyond_paper]
COLUMNS = (tuple(c for p in _OWN for c in p.columns if not c.beyond_paper)
           + tuple(c for p in TABLE if p.beyond_paper for c in p.columns)
           + tuple(c for p in _OWN for c in p.columns if c.beyond_paper))
# The precisions the simulated-format recipe runs, each on its FormatRecipe (mpt.formats.RECIPES), and of
# those the block-scaled ones, whose scales are the blocks' own: read from the rows, so a new row is enough.
FORMATS = tuple(p.name for p in TABLE if p.recipe == "formats")
BLOCK_SCALED = tuple(n for n in FORMATS if n in formats.RECIPES and formats.RECIPES[n].block_scaled)
# Groups a grid may name on its precision axis (slurm.grid): `precision: [block_scaled]` runs every
# block-scaled precision of the table, today's and any row added later. Read from the rows.
GROUPS: dict[str, tuple[str, ...]] = {
    "formats": FORMATS,  # every simulated low-precision format (per-tensor FP8 and the block-scaled)
    "block_scaled": BLOCK_SCALED,
    "no_master_copy": tuple(p.name for p in TABLE if not p.master),  # section 3.1's ablation and its BF16 twin
}
assert not set(GROUPS) & {p.name for p in TABLE}, "a group must not share a precision's name"


def expand_groups(values: list) -> list:
    """A precision axis with its group names replaced by their members, in table order, each once."""
    out: list = []
    for v in values:
        for name in GROUPS.get(v, (v,)) if isinstance(v, str) else (v,):
            if name not in out:
                out.append(name)
    return out


_ROW_OF = {c.name: p for p in TABLE if not p.tf32 for c in p.columns}
_TF32 = {p.run_as: p.columns[0] for p in TABLE if p.tf32}


def column(name: str, tf32: bool = False) -> Column | None:
    """The column of that name (FP32 with tf32: the TF32 baseline's); None for a name not in the table."""
    if tf32 and name in _TF32:
        return _TF32[name]
    row = _ROW_OF.get(name)
    return next(c for c in row.columns if c.name == name) if row else None


def of_column(name: str) -> Precision | None:
    """The precision a column belongs to (fp8_delayed: fp8); None for a name not in the table."""
    return _ROW_OF.get(name)


def recipe_of(precision: str) -> str:
    """The RECIPE_KINDS entry that runs `precision` (a row of TABLE), or a one-line UserError where the row
    names none that exists: a precision without its recipe must not train as FP32 under its own name."""
    row = BY_NAME[precision]
    if row.recipe not in RECIPE_KINDS:
        raise UserError(f"precision={precision} names recipe {row.recipe!r}, which does not exist; set its row's "
                        f"recipe in mpt/precisions.py to one of: {', '.join(RECIPE_KINDS)}")
    if row.recipe == "formats" and precision not in formats.RECIPES:
        raise UserError(f"precision={precision} has no format recipe: add FormatRecipe({precision!r}, ...) to "
                        f"mpt.formats.RECIPES (the formats of its x, w and g)")
    if row.recipe == "impl" and not row.impls:
        raise UserError(f"precision={precision} is run by the scheme cfg.impl names but its row lists no impl; "
                        f"set its impls in mpt/precisions.py (autocast, paper) or a recipe of its own")
    return row.recipe


# ------------------------------------------------------------------------------------------------
# a precision's format recipe, with the config's fmt.* keys

_ROLE_BASE = {"x": "x", "w": "w", "g": "g", "w_dgrad": "w", "x_wgrad": "x", "g_wgrad": "g"}
_PRESET = "preset"


def set_fmt_keys(fmt: dict) -> list[str]:
    """The fmt.* keys a config's fmt section sets -- given as a dict: dataclasses.asdict of the config's, or a
    stored run's config.json -- as key=value in the section's order: those not at `preset`, and not the
    infra keys (fmt.compile: how the recipe runs, not what it is)."""
    from mpt.config import FmtCfg

    infra = {f.name for f in dataclasses.fields(FmtCfg) if f.metadata.get("infra")}
    out = []
    for k, v in fmt.items():
        if k in infra:
            continue
        if isinstance(v, dict):
            out += [f"fmt.{k}.{kk}={_show(vv)}" for kk, vv in v.items() if vv != _PRESET]
        elif v != _PRESET:
            out.append(f"fmt.{k}={_show(v)}")
    return out


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def format_recipe(cfg) -> formats.FormatRecipe | None:
    """The FormatRecipe a simulated-format precision trains with: its preset (mpt.formats.RECIPES; precision=fp8
    with fp8.scaling's scaling) with every fmt.* key that is not `preset` put in place. A key set on a precision
    that is not a simulated format, or a combination the formats refuse (FormatRecipe's and TensorFormat's own
    checks), is a one-line UserError naming the keys and the fix. Without keys set, the preset itself; None
    for a precision that is not a simulated format."""
    fc = getattr(cfg, "fmt", None)
    keys = set_fmt_keys(dataclasses.asdict(fc)) if fc is not None else []
    if BY_NAME[cfg.precision].recipe != "formats":
        if keys:
            raise UserError(f"{keys[0]} sets the format recipe of a simulated-format precision ({', '.join(FORMATS)}); "
                            f"precision={cfg.precision} has none: leave fmt.* at preset")
        return None
    recipe = formats.RECIPES[cfg.precision]
    if cfg.precision == "fp8":  # its scaling is fp8.scaling's
        recipe = recipe.with_scaling(getattr(getattr(cfg, "fp8", None), "scaling", recipe.scaling))
    if not keys:
        return recipe
    where = f"precision={cfg.precision} {' '.join(keys)}"
    changes: dict = {}
    for role, base in _ROLE_BASE.items():
        rc = getattr(fc, role)
        given = {k.name: getattr(rc, k.name) for k in dataclasses.fields(rc) if getattr(rc, k.name) != _PRESET}
        if not given:
            continue
        if role != base and given.get("element") == "none":  # an own operand dropped: the forward's is read
            if len(given) > 1:
                raise UserError(f"fmt.{role}.element=none drops that operand's own format; leave the other "
                                f"fmt.{role}.* keys at preset ({where})")
            changes[role] = None
            continue
        start = getattr(recipe, role) or getattr(recipe, base)
        try:
            changes[role] = dataclasses.replace(start, **given)
        except ValueError as e:
            raise UserError(f"fmt.{role}: {e} ({where})") from None
    for key in ("wgrad", "accumulate", "keep_last", "bf16_tail"):
        if getattr(fc, key) != _PRESET:
            changes[key] = getattr(fc, key)
    if changes.get("wgrad", "own") != "own":  # x_wgrad and g_wgrad are wgrad=own's; dropped with it unless set
        changes.update({r: changes.get(r) for r in ("x_wgrad", "g_wgrad")})
    try:
        return dataclasses.replace(recipe, **changes)
    except ValueError as e:
        fix = "; or set fp8.scaling=current" if "delayed" in str(e) else ""
        raise UserError(f"fmt: {e}{fix} ({where})") from None


def format_lines(cfg) -> list[str]:
    """The format recipe a config trains with, field by field under the fmt.* keys that set them (--print-config
    shows it); [] for a precision that is not a simulated format."""
    r = format_recipe(cfg)
    if r is None:
        return []
    out = [f"format recipe of precision={cfg.precision}, as it trains (each fmt.* key at preset takes its value here):"]
    for role in _ROLE_BASE:
        f = getattr(r, role)
        own = f is None and role in ("x_wgrad", "g_wgrad") and r.wgrad == "own"
        out.append(f"  fmt.{role}: " + ("none" + (f" (as fmt.{_ROLE_BASE[role]})" if own else "") if f is None else
                                         " ".join(f"{k}={_show(v)}" for k, v in dataclasses.asdict(f).items())))
    out.append(f"  fmt.wgrad={r.wgrad} fmt.accumulate={r.accumulate} fmt.keep_last={r.keep_last} "
               f"fmt.bf16_tail={r.bf16_tail} scaling={r.scaling}")
    return out


def _or(names) -> str:
    names = list(names)
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


# ------------------------------------------------------------------------------------------------
# config checks


def parse_loss_scale(value: str, precision: str):
    """'auto' | 'dynamic' | a positive number  ->  None (no scaling), 'dynamic' or float S."""
    if precision not in PRECISIONS:
        raise UserError(f"unknown precision {precision!r}; choose one of: {', '.join(PRECISIONS)}")
    row = BY_NAME[precision]
    v = str(value).strip().lower()
    if v == "auto":
        return row.auto_loss_scale
    if v == "dynamic":
        if not row.loss_scaling:
            scaled = _or(p.name for p in TABLE if p.loss_scaling)
            raise UserError(f"loss_scale=dynamic needs precision={scaled}, not {precision}")
        return "dynamic"
    try:
        s = float(v)
    except ValueError:
        raise UserError(f"loss_scale={value!r} is not a number; use a positive number, 'dynamic' or 'auto'") from None
    if not math.isfinite(s) or s <= 0:
        raise UserError(f"loss_scale={value!r} must be a positive finite number (the paper used 8 to 32K)")
    if not row.loss_scaling:
        if s != 1:
            raise UserError(row.refuses_scale.format(value=value, name=precision))
        return None
    return s


def check(cfg) -> None:
    """The precision keys of a config (precision, impl, half_math, loss_scale, rounding, fp8.*, fmt.*, scaler.*)."""
    if cfg.precision not in PRECISIONS:
        raise UserError(f"unknown precision {cfg.precision!r}; choose one of: {', '.join(PRECISIONS)}")
    recipe_of(cfg.precision)
    if cfg.impl not in IMPLS:
        raise UserError(f"unknown impl {cfg.impl!r}; choose one of: {', '.join(IMPLS)}")
    if getattr(cfg, "half_math", "auto") not in HALF_MATHS:
        raise UserError(f"unknown half_math {cfg.half_math!r}; choose one of: {', '.join(HALF_MATHS)}")
    parse_loss_scale(cfg.loss_scale, cfg.precision)
    rounding = getattr(cfg, "rounding", "nearest")
    if rounding not in ROUNDINGS:
        raise UserError(f"unknown rounding {rounding!r}; choose one of: {', '.join(ROUNDINGS)}")
    if rounding != "nearest" and BY_NAME[cfg.precision].master:
        pure = _or(p.name for p in TABLE if not p.master)
        raise UserError(f"rounding={rounding} is how weights without an FP32 master copy are updated; it needs "
                        f"precision={pure}, not {cfg.precision}")
    f8 = getattr(cfg, "fp8", None)
    if f8 is not None:
        for key, value, allowed in (("scaling", f8.scaling, FP8_SCALINGS),
                                    ("amax_compute_algo", f8.amax_compute_algo, FP8_AMAX_ALGOS),
                                    ("ends", f8.ends, FP8_ENDS)):
            if value not in allowed:
                raise UserError(f"unknown fp8.{key} {value!r}; choose one of: {', '.join(allowed)}")
        if f8.amax_history_len < 1:
            raise UserError(f"fp8.amax_history_len={f8.amax_history_len} must be >= 1")
        row = BY_NAME[cfg.precision]
        if row.recipe == "formats" and formats.RECIPES[cfg.precision].block_scaled:
            # Block scales are computed from each block now: only the choice of the ends applies.
            if dataclasses.replace(f8, ends=type(f8)().ends) != type(f8)():
                raise UserError(f"precision={cfg.precision} scales each block from the block itself: of the "
                                f"fp8.* keys only fp8.ends applies; leave the others at their defaults")
        elif cfg.precision != "fp8" and type(f8)() != f8:
            raise UserError(f"fp8.* keys do nothing for precision={cfg.precision}; leave them at their defaults")
    format_recipe(cfg)  # the fmt.* keys: a combination the formats refuse is an error now, not at the first step
    s = cfg.scaler
    if not (s.init_scale > 0 and s.growth_factor > 1 and 0 < s.backoff_factor < 1 and s.growth_interval >= 1):
        raise UserError("scaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
