"""FP16 (BF16) dot products computed as section 3.3 describes them: products accumulated in FP32, the
result rounded to FP16 (BF16) once, on write -- what tensor cores do.

HalfMath is a torch function mode. Within it every dot product that reads FP16 (BF16) operands (linear,
matmul, convolution, a recurrent layer as a whole, the embedding's gradient sum; forward and backward)
runs the FP32 kernel on exact FP32 copies of them and rounds its result once. Casting FP16 operands
to FP32 is exact, so only the summation order can differ from another FP32-accumulating kernel, by an
ulp. Point-wise ops and reductions keep PyTorch's kernels, which already compute in FP32 and round
once. FP32Math is the same mode with softmax added: precision=fp16_storage (section 4.3).

What computes a run's FP16/BF16 dot products (cfg.half_math: auto | emulated | native):
  emulated   HalfMath. With PyTorch's CPU FP16 kernels a training step took 3.5-42x FP32's here
             (experiments/speed_memory/README.md); emulated, 0.94-1.5x (width 1/16, batch 32).
  native     PyTorch's CPU FP16/BF16 kernels.
  auto       emulated for FP16; for BF16 native where the processor has BF16 dot-product instructions
             (AVX512-BF16 or AMX-BF16: oneDNN's BF16 kernels beat FP32 there) and emulated where it
             has none.
A GPU runs its own kernels, but for `emulated`, which computes there as on a CPU: what a GPU run of the
CPU's arithmetic tells apart from the GPU's kernels (speed_memory's gpu_check --cifar fp16+emulated).

Why at the function level (a TorchFunctionMode, ~270 calls in a tiny ResNet-50 forward) and not below
autograd (a TorchDispatchMode would see every aten op of forward and backward, ~820 there, ~9,200 in a
2-layer GRU over 100 frames): measured here, the dispatch mode's Python call costs ~16 us per op --
13 ms of a 46 ms ResNet-50 step and 63 ms of an 84 ms GRU step before any arithmetic. Convolutions,
linear layers and embeddings get autograd Functions that save the FP16 tensors (activation memory stays
FP16's) and run the FP32 backward kernels themselves; the other dot products are differentiated through
their casts, so autograd saves their FP32 copies.
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mpt import torch_private as TP


def ops_of(owner, names):
    """The functions of `owner` (a module or class) with these names, where this torch has them."""
    return {getattr(owner, n) for n in names if hasattr(owner, n)}


def map_tensors(obj, f):
    """f applied to every tensor in obj (tensors, lists and tuples of them; a torch function's arguments
    and results). Lighter than torch.utils._pytree, whose cost showed at ~50 calls per step."""
    if isinstance(obj, torch.Tensor):
        return f(obj)
    if isinstance(obj, (list, tuple)):
        items = [map_tensors(o, f) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return {k: map_tensors(v, f) for k, v in obj.items()}
    return obj


def float_tensors(obj, out: list) -> list:
    """The floating-point tensors in obj, appended to out."""
    for a in obj:
        if isinstance(a, torch.Tensor):
            if a.is_floating_point():
                out.append(a)
        elif isinstance(a, (list, tuple)):
            float_tensors(a, out)
    return out


def _fp32_call(func, args, kwargs, low: torch.dtype):
    """func(*args, **kwargs) in FP32 on exact FP32 copies of the `low`-precision tensors, floating
    results rounded to `low` once. Differentiable: the casts are recorded by autograd, so the
    backward runs in FP32 too and rounds each gradient to `low` once."""
    up = lambda t: t.float() if t.dtype == low else t  # noqa: E731
    out = func(*map_tensors(args, up), **map_tensors(kwargs, up))
    return map_tensors(out, lambda t: t.to(low) if t.dtype == torch.float32 else t)


def _round(t, low):
    return None if t is None else t.to(low)


class FP32Copies:
    """Exact FP32 copies of low-precision parameters, kept from one weight update to the next. Each
    convolution and linear layer reads its FP16 weight in FP32 twice a step (forward, and the input's
    gradient in backward) and its bias once; the paper's recipes (impl=paper, fp16_storage) hold one
    FP32 copy per weight instead, made at the first use and refreshed by the recipe after each update
    with one foreach copy (refresh()). A copy is used only while its weight's version counter is the
    one it was made from, so a weight written any other way (a checkpoint load) is cast afresh. The
    values are those of w.float(): casting up is exact, so results are bit-identical. Costs 4 bytes a
    parameter. keep=False casts at every use instead (the reference the benchmark and tests compare to)."""

    def __init__(self, keep: bool = True):
        self.keep = keep
        self.copies: dict[int, tuple] = {}  # id(weight) -> (weakref to it, its version, FP32 copy)

    def get(self, w: torch.Tensor) -> torch.Tensor:
        """w.float() for a parameter (a leaf that requires grad); for any other tensor, a fresh cast."""
        if not (self.keep and w.is_leaf and w.requires_grad):
            return w.float()
        entry = self.copies.get(id(w))
        if entry is not None and entry[0]() is w and entry[1] == TP.version(w):
            return entry[2]
        up = w.detach().float()
        self.copies[id(w)] = (self._ref(w), TP.version(w), up)
        return up

    def _ref(self, w):
        """A weak reference to w whose death drops w's copy (a model deep-copied for a replay, then freed)."""
        return weakref.ref(w, lambda _, key=id(w), copies=self.copies: copies.pop(key, None))

    def refresh(self) -> None:
        """Bring every stale copy up to its weight, in one foreach copy: call after the recipe writes
        the weights."""
        stale = []
        for key, (ref, ver, up) in list(self.copies.items()):
            w = ref()
            if w is not None and ver != TP.version(w):
                stale.append((key, w, up))
        if stale:
            with torch.no_grad():
                TP.foreach_copy_([up for _, _, up in stale], [w for _, w, _ in stale])
            for key, w, up in stale:
                self.copies[key] = (self._ref(w), TP.version(w), up)


def _up(t, copies):
    """t.float(), from `copies` (FP32Copies) where there is one."""
    return t.float() if copies is None else copies.get(t)


def _no_autocast(device_type: str):
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) \
        else contextlib.nullcontext()


_CONV_BACKWARD = torch.ops.aten.convolution_backward.default


class _Conv(torch.autograd.Function):
    """aten.convolution on FP32 copies of FP16 operands, output rounded; saves the FP16 input and
    weight; backward = aten.convolution_backward in FP32, each gradient rounded once."""

    @staticmethod
    def forward(ctx, x, w, b, stride, padding, dilation, transposed, output_padding, groups, copies):
        # What the backward needs, as PyTorch's own convolution saves it: the input only for the
        # weight's gradient, the weight only for the input's.
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w if ctx.needs_input_grad[0] else None)
        ctx.shapes, ctx.low, ctx.copies = (x.shape, w.shape), x.dtype, copies
        ctx.conf = (stride, padding, dilation, transposed, output_padding, groups)
        ctx.bias = None if b is None else list(b.shape)
        b = None if b is None else _up(b, copies)
        return torch.convolution(x.float(), _up(w, copies), b, *ctx.conf).to(x.dtype)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.bias is not None and ctx.needs_input_grad[2]]
        # convolution_backward takes both tensors; the one whose gradient is not asked for is not read
        x = torch.empty(ctx.shapes[0], device=gy.device) if x is None else x.float()
        w = torch.empty(ctx.shapes[1], device=gy.device) if w is None else _up(w, ctx.copies)
        with _no_autocast(gy.device.type):
            gx, gw, gb = _CONV_BACKWARD(gy.float(), x, w, ctx.bias, *ctx.conf, mask)
        low = ctx.low
        return (_round(gx, low) if mask[0] else None, _round(gw, low) if mask[1] else None,
                _round(gb, low) if mask[2] else None, None, None, None, None, None, None, None)


class _Linear(torch.autograd.Function):
    """F.linear in FP32 on FP16 operands, output rounded; saves the FP16 input and weight."""

    @staticmethod
    def forward(ctx, x, w, b, copies):
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w if ctx.needs_input_grad[0] else None)
        ctx.has_bias, ctx.low, ctx.copies = b is not None, x.dtype, copies
        return F.linear(x.float(), _up(w, copies), None if b is None else _up(b, copies)).to(x.dtype)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        low, g = ctx.low, gy.float()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (g @ _up(w, ctx.copies)).to(low)
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[1]:
            gw = (g2.t() @ x.float().reshape(-1, x.shape[-1])).to(low)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0).to(low)
        return gx, gw, gb, None


class _Embedding(torch.autograd.Function):
    """The lookup is exact in FP16; the gradient sums the rows of repeated tokens (a dot product with
    a one-hot matrix): in FP32, rounded once, as CUDA's kernel accumulates it."""

    @staticmethod
    def forward(ctx, idx, w, padding_idx, scale_grad_by_freq):
        ctx.save_for_backward(idx)
        ctx.conf = (w.shape[0], padding_idx, scale_grad_by_freq)
        return torch.embedding(w, idx, padding_idx, scale_grad_by_freq, False)

    @staticmethod
    def backward(ctx, gy):
        (idx,) = ctx.saved_tensors
        n, pad, freq = ctx.conf
        gw = torch.ops.aten.embedding_dense_backward(gy.float(), idx, n, pad, freq).to(gy.dtype)
        return None, gw, None, None


def _arg(args, kwargs, i, name, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _conv(transposed: bool, nd: int):
    tup = TP.ntuple(nd)

    def run(func, args, kwargs, low, copies=None):
        x, w, b = args[0], _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
        stride = tup(_arg(args, kwargs, 3, "stride", 1))
        padding = _arg(args, kwargs, 4, "padding", 0)
        if isinstance(padding, str) or x.dim() != nd + 2:  # "same"/"valid", unbatched input: via the casts
            return _fp32_call(func, args, kwargs, low)
        if transposed:
            out_pad = tup(_arg(args, kwargs, 5, "output_padding", 0))
            groups, dilation = _arg(args, kwargs, 6, "groups", 1), tup(_arg(args, kwargs, 7, "dilation", 1))
        else:
            out_pad = tup(0)
            dilation, groups = tup(_arg(args, kwargs, 5, "dilation", 1)), _arg(args, kwargs, 6, "groups", 1)
        return _Conv.apply(x, w, b, list(stride), list(tup(padding)), list(dilation), transposed, list(out_pad), groups,
                           copies)
    return run


def _linear(func, args, kwargs, low, copies=None):
    return _Linear.apply(args[0], _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias"), copies)


def _embedding(func, args, kwargs, low, copies=None):
    idx, w = args[0], _arg(args, kwargs, 1, "weight")
    pad = _arg(args, kwargs, 2, "padding_idx")
    if _arg(args, kwargs, 3, "max_norm") is not None or _arg(args, kwargs, 6, "sparse", False):
        return func(*args, **kwargs)  # renormalises the table in place / sparse gradients: PyTorch's own
    if pad is not None and pad < 0:
        pad += w.shape[0]
    return _Embedding.apply(idx, w, -1 if pad is None else pad, _arg(args, kwargs, 5, "scale_grad_by_freq", False))


# The dot products (section 3.3's first category) and how each runs. Recurrent layers run whole, in
# FP32, with their outputs rounded: the cell's gates computed in FP32 as cuDNN computes them for FP16
# data (PyTorch sets its math precision to FP32, mathPrec = CUDNN_DATA_FLOAT); unlike cuDNN, the hidden
# state is rounded to FP16 only where the layer writes it, not at every time step (README).
_GENERIC = (ops_of(torch, ("matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum",
                          "gru", "lstm", "rnn_tanh", "rnn_relu", "gru_cell", "lstm_cell", "rnn_tanh_cell",
                          "rnn_relu_cell"))
            | ops_of(torch.Tensor, ("matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm"))
            | ops_of(F, ("bilinear",)))
_HALF_MATH = {f: (lambda func, args, kwargs, low, copies=None: _fp32_call(func, args, kwargs, low)) for f in _GENERIC}
_HALF_MATH.update({F.conv1d: _conv(False, 1), F.conv2d: _conv(False, 2), F.conv3d: _conv(False, 3),
                   F.conv_transpose1d: _conv(True, 1), F.conv_transpose2d: _conv(True, 2),
                   F.conv_transpose3d: _conv(True, 3), F.linear: _linear, F.embedding: _embedding})
# Dot products autocast leaves in FP32 (not in its CPU/CUDA lower-precision lists): matrix-vector
# products. Under autocast only these read FP32 operands as FP32; the rest are rounded to the autocast
# dtype first, as autocast's own casts would.
_NOT_AUTOCAST = ops_of(torch, ("mv", "addmv", "dot")) | ops_of(torch.Tensor, ("mv", "addmv", "dot")) | {F.embedding}
_SOFTMAX = ops_of(torch, ("softmax", "log_softmax")) | ops_of(torch.Tensor, ("softmax", "log_softmax")) \
    | ops_of(F, ("softmax", "log_softmax"))


class HalfMath(TorchFunctionMode):
    """Within this context every dot product (_HALF_MATH) whose floating operands are all of `dtype`
    computes in FP32 on exact FP32 copies and rounds its floating results to `dtype` once (section
    3.3), forward and backward. Under torch.autocast of the same dtype, the FP32 operands of the dot
    products autocast lowers are rounded to `dtype` first (what autocast's casts do), so the result is
    autocast's with FP32 arithmetic. Anything else -- other ops, FP32 operands (an FP32-kept module),
    mixed dtypes (which PyTorch rejects), an out= or dtype= call -- runs as it would without the mode.

    Limit: a Python function with its own __torch_function__ dispatch that is not listed (e.g.
    F.multi_head_attention_forward) runs whole and unseen, its inner dot products on PyTorch's kernels."""

    extra: frozenset = frozenset()

    def __init__(self, dtype: torch.dtype = torch.float16, copies: FP32Copies | None = None):
        super().__init__()
        self.dtype = dtype
        self.copies = copies  # the FP32 copies of the parameters, kept by a recipe; None: cast each use

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        run = _HALF_MATH.get(func)
        if run is None:
            if func not in self.extra:
                return func(*args, **kwargs)
            run = _HALF_MATH[torch.matmul]  # the generic rule
        if "out" in kwargs or kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args):
            return func(*args, **kwargs)  # the caller chose the output's dtype
        flat = float_tensors(kwargs.values(), float_tensors(args, []))
        if not flat:
            return func(*args, **kwargs)
        dev = flat[0].device.type
        if (func not in _NOT_AUTOCAST and torch.is_autocast_enabled(dev)
                and torch.get_autocast_dtype(dev) == self.dtype):
            # autocast's casts, made here: the FP32 operands rounded to the autocast dtype
            down = lambda t: t.to(self.dtype) if t.dtype == torch.float32 else t  # noqa: E731
            args, kwargs = map_tensors(args, down), map_tensors(kwargs, down)
            flat = [down(a) for a in flat]
        if any(a.dtype != self.dtype for a in flat):
            return func(*args, **kwargs)
        with _no_autocast(dev):  # the FP32 kernels must not be cast back down
            return run(func, args, kwargs, self.dtype, self.copies)


@functools.lru_cache(maxsize=None)
def cpu_has_fast_bf16() -> tuple[bool, str]:
    """(whether this CPU has BF16 dot-product instructions, what says so). oneDNN's BF16 kernels use
    AVX512-BF16 / AMX-BF16 and beat FP32 there; without them BF16 is converted in software (measured
    ~25x slower than FP32 on an AVX2-only machine)."""
    caps = {}
    try:
        caps = torch.cpu.get_capabilities()
    except Exception:  # noqa: BLE001 -- older torch or an unknown platform: judge by the ISA level
        pass
    found = [k for k in ("avx512_bf16", "amx_bf16") if caps.get(k)]
    if found:
        return True, "+".join(found)
    return False, f"no avx512_bf16/amx_bf16 (torch CPU capability {torch.backends.cpu.get_cpu_capability()})"


def resolve_half_math(setting: str, dtype: torch.dtype, device) -> str:
    """What computes `dtype` dot products on `device`: 'device' (a GPU's own kernels, whatever the
    setting), 'emulated' or 'native' (see the module docstring); 'none' for FP32."""
    device = torch.device(device)
    if dtype == torch.float32:
        return "none"
    if device.type != "cpu":
        # (emulated only when asked: the CPU runs' arithmetic on a GPU, to tell it from the GPU's own kernels)
        return "emulated" if setting == "emulated" else "device"
    if setting in ("emulated", "native"):
        return setting
    if dtype == torch.bfloat16 and cpu_has_fast_bf16()[0]:
        return "native"
    return "emulated"


def half_math_info(device) -> dict:
    """What half_math=auto picks on `device` and why (env.json)."""
    device = torch.device(device)
    info = {"auto_float16": resolve_half_math("auto", torch.float16, device),
            "auto_bfloat16": resolve_half_math("auto", torch.bfloat16, device)}
    if device.type == "cpu":
        info["bf16_basis"] = cpu_has_fast_bf16()[1]
    return info


class FP32Math(HalfMath):
    """fp16_storage (section 4.3): HalfMath for FP16 on any device (a GPU too), with softmax and
    log_softmax also computed in FP32 on the FP16 values and stored in FP16. Point-wise ops and
    reductions are left to PyTorch's FP16 kernels, which compute in FP32 and round their output
    once -- the same numbers as FP32 math on FP16 storage."""

    extra = frozenset(_SOFTMAX)

    def __init__(self, copies: FP32Copies | None = None):
        super().__init__(torch.float16, copies)
