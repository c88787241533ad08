"""Low-precision formats as data (beyond the paper): what each simulated FP8/FP4 precision quantises,
in which element format, at which scale granularity and scale rounding, with which rounding. Imports
no torch (the config checks and paper_tables read it); mpt.fp8 does the arithmetic.

A recipe is a named choice of these switches, one per tensor role of a dot product -- its input
activation (x), its weight (w) and the gradient arriving at its output (g):

    fp8        per-tensor scales, E4M3 forward / E5M2 backward (arXiv 2209.05433); its scaling (delayed
               or current) and its first/last layers are config keys (fp8.*).
    fp8_block  DeepSeek-V3's fine-grained FP8 (arXiv 2412.19437, section 3.3.1): E4M3 everywhere,
               1x128 tiles for activations and gradients, 128x128 blocks for weights, scales rounded
               to powers of 2 (as Transformer Engine's Float8BlockScaling does).
    mxfp8      OCP Microscaling MXFP8 (arXiv 2310.10537): 32-element blocks with an E8M0 (power-of-2)
               shared scale, E4M3 elements; the scale rounded up ("RCEIL", arXiv 2506.08027) where the
               spec's FLOOR can push a block's largest value past E4M3's 448.
    nvfp4      NVIDIA's NVFP4 recipe (arXiv 2509.25149): E2M1 elements in 16-element blocks with an
               E4M3 block scale and an FP32 per-tensor scale; gradients rounded stochastically and
               passed through a 16x16 random Hadamard transform.

A block runs along the tensor's reduction axis in the forward product (a linear layer's input
features, a convolution's input channels; mpt.fp8._AXES). The backward products read the same
quantised gradient and weights (one quantisation per tensor, as the per-tensor simulation does); a
hardware recipe quantises the weight-gradient product's operands again along the batch axis. This is
a simulation's simplification, stated here and in the README.
"""
from __future__ import annotations

import dataclasses

ELEMENTS = ("e4m3", "e5m2", "e2m1", "fp16", "bf16")
# tensor: one scale per tensor; row: one per row along the reduction axis; tile128: 1x128 tiles
# along it; block128x128: 128x128 blocks of the 2-D view (rows x reduction axis); mx32: OCP MX
# 32-element blocks; nvfp4_16: 16-element blocks with E4M3 scales under an FP32 per-tensor scale.
GRANULARITIES = ("tensor", "row", "tile128", "block128x128", "mx32", "nvfp4_16")
# exact: FP32 scale = format max / amax; pow2: that rounded down to a power of 2; floor: OCP MX's
# shared exponent floor(log2 amax) - emax(element); rceil: 2^ceil(log2(amax / format max)) (never
# overflows); e4m3: NVFP4's block scale, amax / format max rounded to E4M3.
SCALE_ROUNDINGS = ("exact", "pow2", "floor", "rceil", "e4m3")
ROUNDINGS = ("nearest", "stochastic")
SCALINGS = ("delayed", "current")
# fp32: every dot product accumulates in FP32 (section 3.3); another format: each addition of a linear
# layer's dot products rounded to it, to show what section 3.3 guards against (mpt.fp8.accumulate_linear).
ACCUMULATIONS = ("fp32", *ELEMENTS)


def _one_of(what: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; choose one of: {', '.join(allowed)}")


@dataclasses.dataclass(frozen=True)
class TensorFormat:
    """How one tensor role is quantised."""

    element: str
    granularity: str = "tensor"
    scale_rounding: str = "exact"
    rounding: str = "nearest"  # nearest even | stochastic (seeded; the recipe's generator)
    hadamard: bool = False  # a 16x16 random Hadamard transform along the blocks before quantising

    def __post_init__(self):
        _one_of("element format", self.element, ELEMENTS)
        _one_of("scale granularity", self.granularity, GRANULARITIES)
        _one_of("scale rounding", self.scale_rounding, SCALE_ROUNDINGS)
        _one_of("rounding", self.rounding, ROUNDINGS)
        if (self.granularity == "nvfp4_16") != (self.scale_rounding == "e4m3"):
            raise ValueError("nvfp4_16 blocks and E4M3 scales go together (arXiv 2509.25149)")
        if self.hadamard and (self.block or 1) % 16:
            raise ValueError("the random Hadamard transform is 16x16: blocks of a multiple of 16 elements")
        if self.granularity == "mx32" and self.scale_rounding not in ("floor", "rceil"):
            raise ValueError("MX blocks have E8M0 scales: scale_rounding floor or rceil")

    @property
    def block(self) -> int | None:
        """Elements per block along the reduction axis (None: the whole axis or the whole tensor)."""
        return {"tile128": 128, "block128x128": 128, "mx32": 32, "nvfp4_16": 16}.get(self.granularity)


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
    accumulate: str = "fp32"

    def __post_init__(self):
        _one_of("scaling", self.scaling, SCALINGS)
        _one_of("accumulation", self.accumulate, ACCUMULATIONS)
        if self.scaling == "delayed" and any((f.granularity, f.scale_rounding) != ("tensor", "exact")
                                             for f in self.roles.values()):
            raise ValueError("delayed scaling keeps one amax history per tensor: per-tensor exact scales only")

    @property
    def roles(self) -> dict[str, TensorFormat]:
        return {"x": self.x, "w": self.w, "g": self.g}

    def with_scaling(self, scaling: str) -> FormatRecipe:
        return dataclasses.replace(self, scaling=scaling)


_E4M3, _E5M2 = TensorFormat("e4m3"), TensorFormat("e5m2")
_TILE = TensorFormat("e4m3", "tile128", "pow2")
_MX = TensorFormat("e4m3", "mx32", "rceil")
_NV = TensorFormat("e2m1", "nvfp4_16", "e4m3")

RECIPES: dict[str, FormatRecipe] = {r.name: r for r in (
    # The scaling of precision=fp8 is its config key fp8.scaling (delayed by default).
    FormatRecipe("fp8", x=_E4M3, w=_E4M3, g=_E5M2, scaling="delayed"),
    FormatRecipe("fp8_block", x=_TILE, w=TensorFormat("e4m3", "block128x128", "pow2"), g=_TILE),
    FormatRecipe("mxfp8", x=_MX, w=_MX, g=_MX),
    FormatRecipe("nvfp4", x=_NV, w=_NV, g=dataclasses.replace(_NV, rounding="stochastic", hadamard=True)),
)}
