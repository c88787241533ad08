"""Low-precision formats as data (beyond the paper): what each simulated FP8/FP4 precision quantises,
in which element format, at which scale granularity and scale rounding, with which rounding. Imports
no torch (the config checks and paper_tables read it); mpt.fp8 does the arithmetic.

A recipe is a named choice of these switches, one per tensor role of a dot product -- its input
activation (x), its weight (w) and the gradient arriving at its output (g):

    fp8        per-tensor scales, E4M3 forward / E5M2 backward (arXiv 2209.05433); its scaling (delayed
               or current) and its first/last layers are config keys (fp8.*). With current scaling,
               torchao.float8's "tensorwise" recipe.
    fp8_rowwise        torchao.float8's "rowwise" recipe (Float8LinearConfig.from_recipe_name): E4M3
               everywhere, one power-of-2 scale per row along each product's reduction axis -- the
               backward products quantise their operands again along theirs.
    fp8_rowwise_gw_hp  torchao.float8's "rowwise_with_gw_hp": rowwise forward and data gradient (the
               latter against a per-tensor weight), the weight gradient in high precision.
    fp8_block  DeepSeek-V3's fine-grained FP8 (arXiv 2412.19437, section 3.3.1): E4M3 everywhere,
               1x128 tiles for activations and gradients, 128x128 blocks for weights, scales rounded
               to powers of 2 (as Transformer Engine's Float8BlockScaling does).
    mxfp8      OCP Microscaling MXFP8 (arXiv 2310.10537): 32-element blocks with an E8M0 (power-of-2)
               shared scale, E4M3 elements; the scale rounded up ("RCEIL", arXiv 2506.08027) where the
               spec's FLOOR can push a block's largest value past E4M3's 448.
    nvfp4      NVIDIA's NVFP4 recipe (arXiv 2509.25149) as Transformer Engine's NVFP4BlockScaling runs
               it by default: E2M1 elements in 16-element blocks with an E4M3 block scale and an FP32
               per-tensor scale, weights in 2-D 16x16 blocks; gradients rounded stochastically; a 16x16
               random Hadamard transform on the weight-gradient product's operands only, along the batch.
    nvfp4_paper  the NVFP4 pretraining paper's recipe (arXiv 2509.25149): nvfp4, with the last 15% of the
               weight-bearing layers kept in BF16 (keep_last) and BF16 for the last 18% of the steps
               (bf16_tail).

Every field of a recipe is a config key too (fmt.*, mpt.precisions.format_recipe): unset, the preset's.

A block runs along the tensor's reduction axis in the forward product (a linear layer's input
features, a convolution's input channels; mpt.fp8._AXES). By default the backward products read the
same quantised gradient and weights (one quantisation per tensor: the simulation's simplification,
exact for per-tensor scales); a hardware recipe quantises each product's operands along that product's
reduction axis, which a recipe states with w_dgrad and wgrad (FormatRecipe) where it matters.

The element formats themselves -- bits, range, what overflow does -- are one table, ELEMENTS below:
every module that rounds to a format or reasons about its range (mpt.fp8's quantisers, mpt.numerics'
bands, the doctor's what-if, paper_tables' figures) reads its numbers from there.
"""
from __future__ import annotations

import dataclasses
import math


def _one_of(what: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; choose one of: {', '.join(allowed)}")


# ------------------------------------------------------------------------------------------------
# element formats

# How a format spends its top exponent (OCP 8-bit Floating Point spec v1.0; OCP MX spec v1.0):
#   ieee    the top exponent is inf and NaN (FP16, BF16, E5M2)
#   fn      finite and NaN: only the all-ones code is NaN, the rest of the top binade is finite (E4M3),
#           so the largest value's mantissa ends in 0 (1.110 x 2^8 = 448)
#   finite  every code a number, no inf nor NaN (the MX FP4/FP6 elements: E2M1, E3M2, E2M3)
#   scale   unsigned, no mantissa, every code but all-ones a power of 2 (NaN): E8M0, MX's block scale
ENCODINGS = ("ieee", "fn", "finite", "scale")
# How training keeps a tensor of the format in range (what the doctor's what-if assumes): a loss scale
# (FP16, section 3.2), nothing (BF16 has FP32's exponent range), or its own scale per tensor or block.
RANGE_SCALINGS = ("loss_scale", "none", "per_tensor")


@dataclasses.dataclass(frozen=True)
class Element:
    """One number format, by its bits; its range follows from them (exponent bias 2^(e-1) - 1 in every
    format here, as the OCP specs and IEEE 754 have it)."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    encoding: str
    # torch's dtype, where torch has one (a string: this module imports no torch); None: rounded by
    # arithmetic only (mpt.fp8.round_by_spacing). float4_e2m1fn_x2 packs two E2M1 codes to a byte and
    # casts nothing, so E2M1 has none.
    torch_dtype: str | None = None
    # What rounding a finite value beyond `max` gives in this repository's casts: the largest value
    # (saturation, mpt.fp8: Transformer Engine's choice for FP8, the only choice without an inf) or
    # inf (FP16/BF16 as torch computes them in training).
    saturates: bool = True
    range_scaling: str = "per_tensor"

    def __post_init__(self):
        _one_of("encoding", self.encoding, ENCODINGS)
        _one_of("range scaling", self.range_scaling, RANGE_SCALINGS)
        if self.saturates is False and not self.has_inf:
            raise ValueError(f"{self.name} has no inf: its overflow can only saturate")

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def signed(self) -> bool:
        return self.encoding != "scale"

    @property
    def has_inf(self) -> bool:
        return self.encoding == "ieee"

    @property
    def bits(self) -> int:
        return self.signed + self.exponent_bits + self.mantissa_bits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal (E8M0: of its smallest code, 2^-127; it has no zero)."""
        return -self.bias if self.encoding == "scale" else 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value: IEEE formats reserve the top exponent code."""
        top = 2 ** self.exponent_bits - 1
        return top - self.bias - (self.encoding in ("ieee", "scale"))

    @property
    def max(self) -> float:
        """The largest finite value: every mantissa bit set, but for fn (E4M3), where all-ones is NaN."""
        m = self.mantissa_bits
        ones = 2 ** (m + 1) - 1 - (self.encoding == "fn")
        return math.ldexp(ones, self.emax - m)

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """The spacing of the lowest binade (E8M0 has no subnormals: its smallest code)."""
        return math.ldexp(1.0, self.emin - self.mantissa_bits)

    @property
    def max_is_even(self) -> bool:
        """The largest value's last mantissa bit is 0 (E4M3), so the tie just above it rounds down to it
        under round to nearest even; in the other formats that tie goes up, to inf or out of range."""
        return self.encoding == "fn" and self.mantissa_bits > 0


# Every element and scale format by name, in the order choices are listed. A new format is a row here:
# its range follows from the bits (tests/test_formats.py checks each against torch.finfo where torch
# has the dtype, and against the specs' figures); mpt.fp8 rounds any signed row by its spacing, so a
# TensorFormat (and a FormatRecipe) can use it at once.
ELEMENTS: dict[str, Element] = {e.name: e for e in (
    Element("e4m3", 4, 3, "fn", "float8_e4m3fn"),  # OCP FP8: max 448, no inf
    Element("e5m2", 5, 2, "ieee", "float8_e5m2"),  # OCP FP8: max 57344; mpt.fp8's casts saturate finite values
    Element("e2m1", 2, 1, "finite"),  # OCP MX FP4: 0, 0.5, 1, 1.5, 2, 3, 4, 6
    Element("fp16", 5, 10, "ieee", "float16", saturates=False, range_scaling="loss_scale"),  # max 65504
    Element("bf16", 8, 7, "ieee", "bfloat16", saturates=False, range_scaling="none"),
    Element("e8m0", 8, 0, "scale", "float8_e8m0fnu"),  # OCP MX's shared block scale, 2^-127 .. 2^127
)}


def element_names() -> tuple[str, ...]:
    """The formats a tensor's values can be rounded to (signed ones; E8M0 is a scale only). Read when
    asked, not at import, so a row added to ELEMENTS (a test's fixture) is a choice at once."""
    return tuple(n for n, e in ELEMENTS.items() if e.signed)


# tensor: one scale per tensor; row: one per row along the reduction axis; tile128: 1x128 tiles
# along it; block128x128: 128x128 blocks of the 2-D view (rows x reduction axis); mx32: OCP MX
# 32-element blocks; nvfp4_16: 16-element blocks with E4M3 scales under an FP32 per-tensor scale;
# block16x16: 16x16 blocks of the 2-D view (Transformer Engine's NVFP4 weights, with E4M3 scales).
GRANULARITIES = ("tensor", "row", "tile128", "block128x128", "mx32", "nvfp4_16", "block16x16")
# The 2-D granularities: rows of a block (the rest of the view's leading axes: a layer's outputs).
BLOCK_ROWS = {"block128x128": 128, "block16x16": 16}
# exact: FP32 scale = format max / amax; pow2: that rounded down to a power of 2; floor: OCP MX's
# shared exponent floor(log2 amax) - emax(element); rceil: 2^ceil(log2(amax / format max)) (never
# overflows); e4m3: NVFP4's block scale, amax / format max rounded to E4M3.
SCALE_ROUNDINGS = ("exact", "pow2", "floor", "rceil", "e4m3")
ROUNDINGS = ("nearest", "stochastic")
SCALINGS = ("delayed", "current")
# The version of what the simulated quantisers compute, part of every simulated-format run's id
# (mpt.identity.cell_id): raised when a preset or a quantiser changes its numbers, so that a run of the earlier
# version -- its checkpoint and its result -- is a different run, never resumed into or merged with a run of
# this one. 2: scales as torchao computes them, non-finite groups and NVFP4's zero-scale blocks as torchao,
# bias gradients from the unrounded output gradient, NVFP4's Hadamard on the weight-gradient operands and its
# 16x16 weight blocks (Transformer Engine's recipe).
QUANTISERS = 2
# Stochastic rounding's random bits per value (mpt.fp8.round_by_spacing): U = (k + 1/2) / 2^16 for a uniform
# 16-bit k, four values to one 64-bit draw. Part of the id of a run whose recipe rounds a role stochastically
# (mpt.identity.cell_id): another draw is another random stream, so another run; nearest-rounded recipes keep
# their ids.
SR_BITS = 16
WGRADS = ("shared", "high", "own")


@dataclasses.dataclass(frozen=True)
class TensorFormat:
    """How one tensor role is quantised."""

    element: str
    granularity: str = "tensor"
    scale_rounding: str = "exact"
    rounding: str = "nearest"  # nearest even | stochastic (seeded; the recipe's generator)
    hadamard: bool = False  # a 16x16 random Hadamard transform along the blocks before quantising

    def __post_init__(self):
        _one_of("element format", self.element, element_names())
        _one_of("scale granularity", self.granularity, GRANULARITIES)
        _one_of("scale rounding", self.scale_rounding, SCALE_ROUNDINGS)
        _one_of("rounding", self.rounding, ROUNDINGS)
        if self.granularity == "nvfp4_16" and self.scale_rounding != "e4m3":
            raise ValueError("nvfp4_16 blocks have E4M3 scales under an FP32 tensor scale: scale_rounding e4m3 "
                             "(arXiv 2509.25149)")
        if self.scale_rounding == "e4m3" and (self.block or 0) != 16:
            raise ValueError("E4M3 block scales (NVFP4's) are for 16-element blocks: granularity nvfp4_16 or "
                             "block16x16")
        if self.hadamard and (self.block or 1) % 16:
            raise ValueError("the random Hadamard transform is 16x16: blocks of a multiple of 16 elements")
        if self.granularity == "mx32" and self.scale_rounding not in ("floor", "rceil"):
            raise ValueError("MX blocks have E8M0 scales: scale_rounding floor or rceil")

    @property
    def block(self) -> int | None:
        """Elements per block along the reduction axis (None: the whole axis or the whole tensor)."""
        return {"tile128": 128, "block128x128": 128, "mx32": 32, "nvfp4_16": 16, "block16x16": 16}.get(self.granularity)


@dataclasses.dataclass(frozen=True)
class FormatRecipe:
    """A named choice of formats: one TensorFormat per role, the scaling rule of per-tensor scales
    (delayed: an amax history; current: the tensor's amax now -- block scales are always current) and
    the accumulation width (FP32, as the paper's section 3.3 requires of every FP16 product)."""

    name: str
    x: TensorFormat
    w: TensorFormat
    g: TensorFormat
    scaling: str = "current"
    # fp32: every dot product accumulates in FP32 (section 3.3); an element format: each addition of a
    # linear layer's dot products rounded to it, to show what section 3.3 guards against
    # (mpt.fp8.accumulate_linear).
    accumulate: str = "fp32"
    # The backward's two products, where they read operands of their own. A hardware recipe quantises each
    # GEMM's operands along that GEMM's reduction axis; by default (None, "shared") the simulation
    # quantises each tensor once and both backward products read it (module docstring).
    # The weight as the data-gradient product (dx from g and w) reads it: None, the forward's quantised
    # weight; a format, the weight quantised again along the axis that product reduces over (its output
    # features): torchao's rowwise recipes.
    w_dgrad: TensorFormat | None = None
    # What the weight-gradient product (dW from g and x, reduced over the batch) reads: "shared", the x
    # and g the other products read; "high", x and g unquantised, in FP32 (torchao's rowwise_with_gw_hp:
    # "the weight gradient in high precision"); "own", x and g quantised again along the batch axis, as
    # x_wgrad and g_wgrad say (None: as x and g) -- torchao's rowwise, Transformer Engine's NVFP4 with its
    # Hadamard transform there. mpt.fp8.FP8Math runs a product of its own for it (FP8Math._split).
    wgrad: str = "shared"
    x_wgrad: TensorFormat | None = None
    g_wgrad: TensorFormat | None = None
    # The fraction of the model's weight-bearing layers, the last in the order of its first forward, whose
    # products run on BF16 operands (mpt.fp8.FP8State: found with fp8.ends' probe; the count rounded to the
    # nearest, at least 0), beside fp8.ends' first and last layers: the NVFP4 paper's "selective
    # high-precision layers", mostly its last ones.
    keep_last: float = 0.0
    # The fraction of training's steps, the last ones, whose products all run on BF16 operands: the NVFP4
    # paper's switch to higher precision for the end of training. A function of the step
    # (mpt.precision.BF16Tail), so a resumed run switches where the uninterrupted one does.
    bf16_tail: float = 0.0

    def stochastic(self) -> bool:
        """Whether any role, or any backward product's own operand, is rounded stochastically."""
        return any(f is not None and f.rounding == "stochastic"
                   for f in (self.x, self.w, self.g, self.w_dgrad, self.x_wgrad, self.g_wgrad))

    def __post_init__(self):
        _one_of("scaling", self.scaling, SCALINGS)
        for key in ("keep_last", "bf16_tail"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"{key}={getattr(self, key)} is a fraction: at least 0 and below 1")
        _one_of("accumulation", self.accumulate, ("fp32", *element_names()))
        _one_of("weight-gradient operands", self.wgrad, WGRADS)
        if self.split and self.accumulate != "fp32":
            raise ValueError(f"accumulation in {self.accumulate} is simulated on the shared products only: "
                             f"wgrad=shared and no w_dgrad, or accumulate=fp32")
        if self.wgrad != "own" and (self.x_wgrad or self.g_wgrad):
            raise ValueError("x_wgrad and g_wgrad are the weight-gradient product's own operands: wgrad=own")
        if self.scaling == "delayed" and any((f.granularity, f.scale_rounding) != ("tensor", "exact")
                                             for f in self.roles.values()):
            raise ValueError("delayed scaling keeps one amax history per tensor: per-tensor exact scales only")

    @property
    def roles(self) -> dict[str, TensorFormat]:
        """The format of each quantised tensor role: x, w, g; wd (the weight for the data gradient), xw and
        gw (the weight gradient's x and g) where the recipe quantises them again."""
        own = {"xw": self.x_wgrad or self.x, "gw": self.g_wgrad or self.g} if self.wgrad == "own" else {}
        return {"x": self.x, "w": self.w, "g": self.g, **({"wd": self.w_dgrad} if self.w_dgrad else {}), **own}

    @property
    def split(self) -> bool:
        """Some backward product reads operands of its own (w_dgrad, wgrad)."""
        return self.w_dgrad is not None or self.wgrad != "shared"

    def format_of(self, role: str) -> TensorFormat:
        """The format of a quantiser's role name: "x", "g", "w<i>" (a layer's i-th weight), "wd<i>", "xw", "gw"."""
        return self.roles[role.rstrip("0123456789")]

    @property
    def block_scaled(self) -> bool:
        """Some role is scaled block by block: its scales are the blocks' own, computed now, so of the
        config's fp8.* keys only fp8.ends applies (mpt.precisions.check)."""
        return any(f.granularity != "tensor" for f in self.roles.values())

    def with_scaling(self, scaling: str) -> FormatRecipe:
        return dataclasses.replace(self, scaling=scaling)


_E4M3, _E5M2 = TensorFormat("e4m3"), TensorFormat("e5m2")
_TILE = TensorFormat("e4m3", "tile128", "pow2")
_MX = TensorFormat("e4m3", "mx32", "rceil")
_NV = TensorFormat("e2m1", "nvfp4_16", "e4m3")
_NV_SR = dataclasses.replace(_NV, rounding="stochastic")
_NV_2D = TensorFormat("e2m1", "block16x16", "e4m3")

# torchao.float8's rowwise recipes (Float8LinearConfig.from_recipe_name): E4M3 for every operand, one
# power-of-2 scale per row along the reduction axis; with_gw_hp keeps the weight-gradient product in high
# precision and gives the data-gradient product a per-tensor weight.
_ROW = TensorFormat("e4m3", "row", "pow2")

# Transformer Engine's NVFP4BlockScaling at its defaults: weights in 2-D 16x16 blocks (its fp4_quant_fwd_weight:
# fp4_2d_quantization unless disable_2d_quantization), stochastic rounding on gradients only, the 16x16 random
# Hadamard transform only on the weight-gradient product's operands (x and g along the batch; its docs: "used only
# for wgrad GEMM"), so that product reads x and g quantised again there.
_NVFP4 = FormatRecipe("nvfp4", x=_NV, w=_NV_2D, g=_NV_SR, wgrad="own", x_wgrad=dataclasses.replace(_NV, hadamard=True),
                      g_wgrad=dataclasses.replace(_NV_SR, hadamard=True))

RECIPES: dict[str, FormatRecipe] = {r.name: r for r in (
    # The scaling of precision=fp8 is its config key fp8.scaling (delayed by default).
    FormatRecipe("fp8", x=_E4M3, w=_E4M3, g=_E5M2, scaling="delayed"),
    FormatRecipe("fp8_rowwise", x=_ROW, w=_ROW, g=_ROW, w_dgrad=_ROW, wgrad="own"),
    FormatRecipe("fp8_rowwise_gw_hp", x=_ROW, w=_ROW, g=_ROW, w_dgrad=TensorFormat("e4m3", "tensor", "pow2"),
                 wgrad="high"),
    FormatRecipe("fp8_block", x=_TILE, w=TensorFormat("e4m3", "block128x128", "pow2"), g=_TILE),
    FormatRecipe("mxfp8", x=_MX, w=_MX, g=_MX),
    _NVFP4,
    # The NVFP4 pretraining paper (arXiv 2509.25149): the same formats; ~15% of the layers, mostly the last, in
    # BF16; BF16 for the last ~18% of training.
    dataclasses.replace(_NVFP4, name="nvfp4_paper", keep_last=0.15, bf16_tail=0.18),
)}
