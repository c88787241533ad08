"""FP8, simulated (precision=fp8; beyond the paper: Micikevicius et al. 2022, "FP8 Formats for Deep
Learning", and Transformer Engine's HYBRID format).

Every dot product of a weight-bearing layer (linear, convolution, recurrent) reads FP8 operands: E4M3
for weights and activations in the forward pass, E5M2 for the gradient of the layer's output in the
backward pass, each tensor at its own scale (FP8State). Simulated on every device by quantise-dequantise:
x -> fp8(clamp(x * s, -max, max)) / s, computed in FP32, then the FP32 kernel on the FP32 values of the
FP8 numbers (exact), accumulating in FP32 -- what an FP8 GEMM with FP32 accumulation computes, up to
summation order, as the FP8 paper itself simulated: the numerics, not the speed. Both casts saturate
finite values (Transformer Engine's choice: a value beyond the delayed scale's range is clipped, not
made inf). E4M3 has no infinities, so inf saturates too; E5M2 keeps inf (it has one); nan stays nan in
both, so a diverging run is still seen as one.

Not quantised: a recurrent layer's state inside its fused kernel (its input sequence and weights are;
the gradient of its output sequence is), dot products without a weight (attention's), embeddings
(lookups), modules marked keep_fp32.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mpt.half_math import float_tensors, map_tensors, ops_of

# (torch dtype, largest finite magnitude): E4M3 has no infinities, so its top binade reaches 448;
# E5M2 is IEEE-like, 57344 (FP8 paper, Table 1).
FP8_FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
# Table lookups: layers with a weight but no dot product to quantise.
_LOOKUPS = (nn.Embedding, nn.EmbeddingBag)


def fp8_quantize(x: torch.Tensor, fmt: str, scale=1.0) -> torch.Tensor:
    """x rounded to FP8 format `fmt` ("e4m3" | "e5m2") at per-tensor `scale` (a number or a 0-dim
    tensor) and returned in FP32 at x's magnitude: fp8(x * scale) / scale, round to nearest even,
    saturating at the format's largest value, subnormals kept."""
    dtype, top = FP8_FORMATS[fmt]
    y = x.float() * scale
    q = y.clamp(-top, top).to(dtype).float()
    if fmt == "e5m2":
        q = torch.where(torch.isinf(y), y, q)
    return q / scale


def bf16_quantize(x: torch.Tensor) -> torch.Tensor:
    """x rounded to BF16 (nearest even) and returned in FP32: fp8.ends=bf16's 16-bit operands."""
    return x.to(torch.bfloat16).float()


class _FP8Operand(torch.autograd.Function):
    """Forward: an operand of a dot product rounded (E4M3 at its scale, or BF16); backward: the
    gradient passes through unchanged (straight-through) -- the gradient that reaches the
    operand was already computed from the quantised output gradient (_FP8Grad)."""

    @staticmethod
    def forward(ctx, x, quant):
        return quant(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _FP8Grad(torch.autograd.Function):
    """Forward: the dot product's output, unchanged (a copy: a later in-place op on it must not
    write into this function's output view); backward: the gradient arriving at the output rounded
    to E5M2 (or BF16) at its own scale before both backward products (input and weight gradients)
    read it, as an FP8 GEMM's backward reads it."""

    @staticmethod
    def forward(ctx, y, quant):
        ctx.quant = quant
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        return ctx.quant(g), None


def _amax(t: torch.Tensor) -> torch.Tensor:
    """Largest finite |t| as an FP32 0-dim tensor (0 for an empty or all-non-finite tensor)."""
    a = t.detach().abs().float()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax() if a.numel() else a.new_zeros(())


class FP8State:
    """The per-tensor scales of precision=fp8: one slot per (layer, role) -- role "x" (the input,
    E4M3), "w<i>" (a weight, E4M3), "g" (the gradient of the output, E5M2).

    current: each quantisation computes scale = FP8_MAX / amax(tensor) / 2^margin from the tensor
    itself (amax 0: scale 1).
    delayed (Transformer Engine's DelayedScaling): each slot has an amax history of `history_len`
    entries (index 0 the newest) and a scale. During an iteration the slot's scale is fixed and the
    amax of every tensor it quantises (several per iteration for a layer called several times) is
    recorded; `update()` -- once per iteration, after the optimizer steps -- rolls the history, puts
    the iteration's amax first and recomputes scale = FP8_MAX / reduce(history) / 2^margin, with
    reduce = max (default) or most_recent; where that is 0 or not finite the scale is kept. The
    scale starts at 1, before any history exists. Only training passes (grad enabled) record amax;
    evaluation uses the scales as they are. Slots are keyed by parameter names, so the state is
    checkpointed and a resumed run continues bit-identically."""

    def __init__(self, scaling: str = "delayed", history_len: int = 1024, algo: str = "max", margin: int = 0):
        self.scaling, self.history_len, self.algo, self.margin = scaling, int(history_len), algo, int(margin)
        self.sites: dict[int, tuple[str, bool]] = {}  # id(weight parameter) -> (layer name, in BF16)
        self.history: dict[str, torch.Tensor] = {}
        self.scale: dict[str, torch.Tensor] = {}
        self._seen: dict[str, torch.Tensor] = {}  # this iteration's amax per slot (delayed)

    def register(self, model: nn.Module, ends: str = "bf16") -> None:
        """Find the weight-bearing layers: every module owning a parameter of 2 or more dimensions.
        Lookups (nn.Embedding) and keep_fp32 modules (with everything inside them) are layers too,
        but never quantised. With ends="bf16" the first and the last layer of each model (registration
        order; each entry of an nn.ModuleDict is a model) compute on BF16 operands instead of FP8 --
        where that layer is an embedding or a keep_fp32 softmax (the bigLSTM), it already is in
        higher precision, and every layer between is FP8."""
        self.sites = {}
        tops = list(model.items()) if isinstance(model, nn.ModuleDict) else [("", model)]
        for prefix, top in tops:
            layers, skip = [], ()
            for name, m in top.named_modules():
                if skip and name.startswith(skip):
                    continue
                if getattr(m, "keep_fp32", False):
                    layers.append((name, None))  # FP32 whole: nothing inside it is quantised
                    skip = name + "."
                    continue
                if isinstance(m, _LOOKUPS):
                    layers.append((name, None))
                    continue
                ws = [p for p in m.parameters(recurse=False) if p.dim() >= 2]
                if ws:
                    layers.append((name, ws))
            kept = {0, len(layers) - 1} if ends == "bf16" and layers else set()
            for i, (name, ws) in enumerate(layers):
                for w in ws or ():
                    self.sites.setdefault(id(w), (".".join(x for x in (prefix, name) if x) or "root", i in kept))

    def quantizer(self, key: str, fmt: str, record: bool = True):
        """The function that rounds a tensor of slot `key` to `fmt` at the slot's scale; `record`: its
        amax goes into this iteration's history entry (training, not evaluation)."""
        top = FP8_FORMATS[fmt][1] / 2.0 ** self.margin

        def quant(t: torch.Tensor) -> torch.Tensor:
            if self.scaling == "current":
                a = _amax(t)
                s = torch.where(a > 0, top / a, torch.ones_like(a))
            else:
                s = self.scale.get(key)
                if s is None:
                    s = self.scale[key] = torch.ones((), device=t.device)
                    self.history[key] = torch.zeros(self.history_len, device=t.device)
                if record:
                    a = _amax(t)
                    seen = self._seen.get(key)
                    self._seen[key] = a if seen is None else torch.maximum(seen, a)
            return fp8_quantize(t, fmt, s)
        return quant

    def update(self) -> None:
        """Delayed scaling, once per iteration: push this iteration's amax, recompute the scales."""
        if self.scaling != "delayed":
            return
        for key, a in self._seen.items():
            h = self.history[key]
            h.copy_(torch.roll(h, 1))
            h[0] = a
            ref = h.max() if self.algo == "max" else h[0]
            top = {"g": FP8_FORMATS["e5m2"][1]}.get(key.rpartition(":")[2], FP8_FORMATS["e4m3"][1])
            new = top / ref / 2.0 ** self.margin
            self.scale[key] = torch.where((ref > 0) & torch.isfinite(new), new, self.scale[key])
        self._seen = {}

    def state_dict(self) -> dict:
        return {"history": {k: v.clone() for k, v in self.history.items()},
                "scale": {k: v.clone() for k, v in self.scale.items()}}

    def load_state_dict(self, sd: dict, device=None) -> None:
        """`device`: where the model is. A checkpoint is read onto the CPU; scales left there would cost
        a host-device copy at every quantisation (~160 a ResNet-50 step) after a resume on CUDA."""
        self.history = {k: v.to(device).clone() for k, v in sd["history"].items()}
        self.scale = {k: v.to(device).clone() for k, v in sd["scale"].items()}
        self._seen = {}


# The dot products precision=fp8 quantises when one of their operands is a registered weight.
_FP8_OPS = ({F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}
            | ops_of(torch, ("gru", "lstm", "rnn_tanh", "rnn_relu", "gru_cell", "lstm_cell", "rnn_tanh_cell",
                             "rnn_relu_cell")))


class FP8Math(TorchFunctionMode):
    """Within this context every dot product of _FP8_OPS that reads a registered weight runs on
    quantised operands: its input (args[0]) and each registered weight rounded to E4M3 at their
    scales (BF16 for a first/last layer under fp8.ends=bf16), the FP32 kernel, and in the backward
    the gradient of its (first) output rounded to E5M2 at its scale (BF16). Anything else runs as
    it would without the mode."""

    def __init__(self, state: FP8State):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _FP8_OPS:
            return func(*args, **kwargs)
        sites = self.state.sites
        weights = [t for t in float_tensors(kwargs.values(), float_tensors(args, [])) if id(t) in sites]
        if not weights or "out" in kwargs:
            return func(*args, **kwargs)
        layer, keep16 = sites[id(weights[0])]
        st = self.state
        # Only training passes feed the delayed scales (autograd Functions run their forward without
        # grad, so the decision is taken here); the backward's gradient is training's by definition.
        record = torch.is_grad_enabled()
        q = (lambda key, fmt: bf16_quantize) if keep16 else \
            (lambda key, fmt: st.quantizer(f"{layer}:{key}", fmt, record or fmt == "e5m2"))
        order = {id(w): i for i, w in enumerate(weights)}

        def operand(t):
            if id(t) in order:
                return _FP8Operand.apply(t, q(f"w{order[id(t)]}", "e4m3"))
            return t

        x = args[0]
        new_args = list(map_tensors(tuple(args), operand))
        if isinstance(x, torch.Tensor) and x.is_floating_point() and id(x) not in order:
            new_args[0] = _FP8Operand.apply(x, q("x", "e4m3"))
        out = func(*new_args, **map_tensors(kwargs, operand))
        grad_q = q("g", "e5m2")
        if isinstance(out, torch.Tensor):
            return _FP8Grad.apply(out, grad_q) if out.requires_grad else out
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) and out[0].requires_grad:
            return (_FP8Grad.apply(out[0], grad_q), *out[1:])
        return out
