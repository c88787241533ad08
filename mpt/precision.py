"""The one precision switch (paper section 3). Every experiment runs every precision through here;
the training loop calls the same five methods whatever the precision and never branches on it:

    recipe = build(cfg, device)                  # from cfg.precision / cfg.impl / cfg.loss_scale
    model = recipe.prepare(model, [optimizer])   # before DDP wrapping and before any step
    recipe.broadcast_masters()                   # after DDP wrapping (DDP broadcasts only the model)
    with recipe.autocast():
        loss = loss_fn(model(x), y)
    recipe.backward(loss)                        # scales by S (section 3.2); call k times to accumulate
    applied = recipe.step(optimizer, clip_grad_norm)   # unscale, skip on inf/nan, clip, update
    recipe.update()                              # once per iteration, after every optimizer's step
    recipe.zero_grad()

Recipes (cfg.precision):
  fp32          everything FP32 (TF32 is a separate switch, off by default).
  fp16          the paper's "MP without loss scaling": FP16 forward/backward, FP32 master weights,
                S = 1 and no overflow skipping, so a network that diverges (SSD, Table 2) diverges here.
  mixed         FP16 + FP32 master weights + loss scaling: constant S (the paper's) or dynamic
                (a later framework feature, section 5); both skip the update on inf/nan.
  bf16          BF16 compute, FP32 master weights, no scaling (BF16 has FP32's exponent range).
  fp16_pure     Figure 2a's ablation: FP16 weights updated directly, no FP32 master copy (loss
                scaling optional). The optimizer's arithmetic and state stay FP32 -- each step it
                works on an FP32 copy made from the FP16 weights, and its result is rounded back
                into them; the copy carries nothing to the next step, so whatever the rounding
                loses is lost (section 3.1). The ablation is about the weights: an Adam eps of
                1e-8 (0 in FP16) or an FP16 momentum buffer would be a second, different effect.
  fp16_storage  "FP16 storage, FP32 math", how the paper ran DeepSpeech 2 (section 4.3): weights,
                activations and gradients stored in FP16, FP32 master weights, and every dot
                product (linear, matmul, convolution, recurrent layer) and softmax computed in
                FP32 on the FP16 values, its result stored in FP16. Point-wise ops and reductions
                run PyTorch's FP16 kernels, which already compute in FP32 and round once on
                output. No loss scaling unless loss_scale is set. The FP32 temporaries autograd
                saves make its memory and speed those of FP32: it reproduces the numerics only.

Implementations (cfg.impl):
  autocast   torch.autocast + torch.amp.GradScaler: parameters stay FP32 (they *are* the master
             copy) and matmuls/convolutions run in FP16 on autocast's casts.
  paper      the paper's own scheme: parameters, activations and gradients stored in FP16, an FP32
             master copy that the optimizer updates, FP16 gradients unscaled into FP32 master
             gradients, the updated master rounded back into the FP16 model. Norm layers keep FP32
             parameters and statistics and compute in FP32 while reading/writing FP16, and the
             model's outputs are cast to FP32 so softmax and the loss reduce in FP32 (section 3.3).
             A module with `keep_fp32 = True` (the bigLSTM's softmax, as in its reference code)
             keeps FP32 parameters and gets FP32 inputs. A parameter kept in FP32 is its own master.
  fp16_pure and fp16_storage are defined by what the model stores, which autocast's FP32 weights
  cannot express, so both impls run them the paper's way.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mpt import torch_private as TP
from mpt.errors import UserError
from mpt.numerics import first_nonfinite

PRECISIONS = ("fp32", "fp16", "mixed", "bf16", "fp16_pure", "fp16_storage")
# Precisions that store the model in FP16 whatever cfg.impl says (see the module docstring).
_PAPER_ONLY = ("fp16_pure", "fp16_storage")
IMPLS = ("autocast", "paper")
# Norm layers keep FP32 parameters and statistics; their kernels read FP16 input with FP32
# parameters and reduce in FP32 (section 3.3), so no FP32 copy of the activation is made or saved.
_NORMS = (TP.NormBase, nn.LayerNorm, nn.GroupNorm)
# Layers with no FP16 kernel on some devices, or whose reduction must stay in FP32 (a sum of squares,
# 3.3): computed in FP32 on a cast of their input. A model's own layer opts in with `fp32_compute = True`.
_FP32_COMPUTE = (nn.LocalResponseNorm,)
# Optimizers whose step needs a closure or sparse gradients: the master-weight swap cannot wrap them.
_UNWRAPPABLE = (torch.optim.LBFGS, torch.optim.SparseAdam)
# Layers that can produce sparse gradients (sparse=True): impl=paper copies gradients into dense FP32
# masters with dense kernels.
_SPARSE_CAPABLE = (nn.Embedding, nn.EmbeddingBag)


# ------------------------------------------------------------------------------------------------
# config checks


def parse_loss_scale(value: str, precision: str):
    """'auto' | 'dynamic' | a positive number  ->  None (no scaling), 'dynamic' or float S."""
    v = str(value).strip().lower()
    if v == "auto":
        return "dynamic" if precision == "mixed" else None
    if v == "dynamic":
        if precision not in ("mixed", "fp16_pure", "fp16_storage"):
            raise UserError(f"loss_scale=dynamic needs precision=mixed, fp16_pure or fp16_storage, not {precision}")
        return "dynamic"
    try:
        s = float(v)
    except ValueError:
        raise UserError(f"loss_scale={value!r} is not a number; use a positive number, 'dynamic' or 'auto'") from None
    if not math.isfinite(s) or s <= 0:
        raise UserError(f"loss_scale={value!r} must be a positive finite number (the paper used 8 to 32K)")
    if precision in ("fp32", "bf16") and s != 1:
        raise UserError(f"loss_scale={value} does nothing for precision={precision}; leave it at auto")
    if precision == "fp16" and s != 1:
        raise UserError(
            f"precision=fp16 is the paper's 'without loss scaling' mode (S = 1); "
            f"for S = {value} use precision=mixed loss_scale={value}")
    if precision in ("fp32", "bf16", "fp16"):
        return None
    return s


def check(cfg) -> None:
    if cfg.precision not in PRECISIONS:
        raise UserError(f"unknown precision {cfg.precision!r}; choose one of: {', '.join(PRECISIONS)}")
    if cfg.impl not in IMPLS:
        raise UserError(f"unknown impl {cfg.impl!r}; choose one of: {', '.join(IMPLS)}")
    parse_loss_scale(cfg.loss_scale, cfg.precision)
    s = cfg.scaler
    if not (s.init_scale > 0 and s.growth_factor > 1 and 0 < s.backoff_factor < 1 and s.growth_interval >= 1):
        raise UserError("scaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")


# ------------------------------------------------------------------------------------------------
# FP16 storage, FP32 math (fp16_storage)


def _ops(owner, names):
    return {getattr(owner, n) for n in names if hasattr(owner, n)}


# Dot products (section 3.3's first category), recurrent layers and softmax: the operations whose
# FP16 kernels may round partial results (FP16 GEMM reductions on GPUs, the gates inside an FP16
# recurrent cell). Point-wise ops and reductions are left to PyTorch's FP16 kernels, which compute
# in FP32 and round their output once -- the same numbers as FP32 math on FP16 storage.
_FP32_MATH_OPS = (
    _ops(torch, ("matmul", "mm", "bmm", "addmm", "addmv", "mv", "baddbmm", "addbmm", "einsum", "dot",
                 "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                 "gru", "lstm", "rnn_tanh", "rnn_relu", "gru_cell", "lstm_cell", "rnn_tanh_cell", "rnn_relu_cell",
                 "softmax", "log_softmax"))
    | _ops(torch.Tensor, ("matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "addmv", "mv", "baddbmm",
                          "addbmm", "dot", "softmax", "log_softmax"))
    | _ops(F, ("linear", "bilinear", "softmax", "log_softmax"))
)


def _has_fp16(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.dtype == torch.float16
    if isinstance(obj, (list, tuple)):
        return any(_has_fp16(o) for o in obj)
    return False


def _fp16_to_fp32(obj):
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype == torch.float16 else obj
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_fp16_to_fp32(o) for o in obj)
    return obj


class FP32Math(TorchFunctionMode):
    """Within this context, the operations in _FP32_MATH_OPS that read FP16 tensors compute in FP32
    on exact FP32 copies of them and store their floating results in FP16. The casts are recorded by
    autograd, so the backward pass computes in FP32 too and stores each gradient in FP16 (the cast's
    backward rounds it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func not in _FP32_MATH_OPS or "out" in kwargs or not (_has_fp16(args) or _has_fp16(list(kwargs.values())))
                or kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)):
            return func(*args, **kwargs)  # not a dot product, or the caller chose the output's dtype
        out = func(*_fp16_to_fp32(args), **{k: _fp16_to_fp32(v) for k, v in kwargs.items()})
        return _cast_floats(out, torch.float16)


# ------------------------------------------------------------------------------------------------
# loss scaler for the paper impl


class LossScaler:
    """Loss scale S with the paper's overflow rule (section 3.2): if any weight gradient is inf/nan,
    skip the update. mode 'none' is S = 1 without checks, 'static' a constant S, 'dynamic' backs off
    by `backoff` on overflow and grows by `growth` after `interval` clean steps."""

    def __init__(self, mode: str, scale: float = 1.0, growth: float = 2.0, backoff: float = 0.5, interval: int = 2000):
        self.mode, self.scale = mode, float(scale)
        self.growth, self.backoff, self.interval = growth, backoff, interval
        self.clean_steps = 0

    def update(self, found_inf: bool) -> None:
        if self.mode != "dynamic":
            return
        if found_inf:
            self.scale *= self.backoff
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.interval:
                self.scale *= self.growth
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"mode": self.mode, "scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self.clean_steps = float(sd["scale"]), int(sd["clean_steps"])


# ------------------------------------------------------------------------------------------------
# recipes


class Recipe:
    """Common state: the optimizers handed to prepare(), skip counting, the overflow culprit."""

    name = "fp32"
    impl = "autocast"
    compute_dtype = torch.float32

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.optimizers: list[torch.optim.Optimizer] = []
        self.model: nn.Module | None = None
        self._model_params: list[torch.Tensor] | None = None  # _free_model_grads' list
        self.skipped_steps = 0
        self.last_overflow: str | None = None  # first parameter holding a non-finite gradient
        self._found_inf = False  # any optimizer of the current iteration overflowed

    # -- setup --
    def prepare(self, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> nn.Module:
        self.model, self.optimizers = model, list(optimizers)
        self._model_params = None
        return model

    def autocast(self):
        return contextlib.nullcontext()

    # -- per iteration --
    @property
    def loss_scale(self) -> float:
        return 1.0

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer, clip_grad_norm: float = 0.0) -> bool:
        if clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params_of(optimizer), clip_grad_norm, foreach=True)
        optimizer.step()
        return True

    def update(self) -> None:
        self._found_inf = False

    def zero_grad(self) -> None:
        self._free_model_grads()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def _free_model_grads(self) -> None:
        """model.zero_grad(set_to_none=True) without its module walk: nn.Module.zero_grad walks the
        module tree every call, 0.22 ms for ResNet-50 on a CPU -- most of the engine's ~0.25 ms overhead
        per step (experiments/speed_memory/engine_overhead.py). The parameters are fixed once training
        runs, so they are listed once, at the first call (after the first forward)."""
        if self.model is None:
            return
        if self._model_params is None:
            self._model_params = list(self.model.parameters())
        for p in self._model_params:
            p.grad = None

    # -- introspection --
    @staticmethod
    def params_of(optimizer) -> list[torch.Tensor]:
        return [p for g in optimizer.param_groups for p in g["params"]]

    def master_params(self) -> list[torch.Tensor]:
        """The tensors the optimizers update (FP32 masters where the recipe keeps them; in fp16_pure
        the FP32 copies each step starts from the FP16 weights)."""
        return [p for opt in self.optimizers for p in self.params_of(opt)]

    def weights_of(self, optimizer) -> list[torch.Tensor]:
        """The tensors that hold the weights `optimizer` trains, matched by position with
        params_of(optimizer): the same tensors, except in fp16_pure, where the optimizer's result
        (params_of) is what the update intended and these FP16 weights are what they received."""
        return self.params_of(optimizer)

    def broadcast_masters(self, src: int = 0) -> None:
        """After DDP wrapping: make weights DDP does not broadcast (FP32 masters) rank src's."""

    def _note_overflow(self) -> None:
        self.skipped_steps += 1
        self.last_overflow = first_nonfinite(self.model.named_parameters()) if self.model is not None else None

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.skipped_steps = int(sd["skipped_steps"])


class FP32(Recipe):
    """Everything in FP32: the same calls as a hand-written loop (bit-identical, tested)."""


class Autocast(Recipe):
    """torch.autocast for the FP16/BF16 compute; GradScaler for loss scaling and skipping."""

    impl = "autocast"

    def __init__(self, device, name: str, dtype: torch.dtype, scale, scaler_cfg=None):
        super().__init__(device)
        self.name, self.compute_dtype = name, dtype
        self.static_scale = scale if isinstance(scale, float) else None
        if scale is None:
            self.scaler = None  # fp16 without loss scaling / bf16: S = 1, nothing skipped
        else:
            c = scaler_cfg
            init = scale if isinstance(scale, float) else c.init_scale
            self.scaler = torch.amp.GradScaler(
                self.device.type, init_scale=init, growth_factor=c.growth_factor,
                backoff_factor=c.backoff_factor, growth_interval=c.growth_interval)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def backward(self, loss):
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer, clip_grad_norm=0.0):
        if self.scaler is None:
            return super().step(optimizer, clip_grad_norm)
        self.scaler.unscale_(optimizer)  # clipping and weight decay see unscaled gradients
        # The one host sync of the step: the skip decision (3.2), which the engine needs on the host
        # (the LR schedule advances only on applied steps). GradScaler.step would read the same flag
        # again (another sync), so the optimizer is stepped here directly; scaler.update() still
        # consumes the flag recorded by unscale_() for the scale's backoff/growth.
        found = sum(v.item() for v in TP.scaler_found_inf(self.scaler, optimizer))  # one per device
        if found:
            self._found_inf = True
            self._note_overflow()
            return False
        if clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params_of(optimizer), clip_grad_norm, foreach=True)
        optimizer.step()
        return True

    def update(self):
        if self.scaler is not None:
            # A constant S is a scaler whose scale never changes but which still skips (section 3.2).
            self.scaler.update(self.static_scale)
        self._found_inf = False

    def state_dict(self):
        sd = super().state_dict()
        if self.scaler is not None:
            sd["scaler"] = self.scaler.state_dict()
        return sd

    def load_state_dict(self, sd):
        super().load_state_dict(sd)
        if self.scaler is not None:
            self.scaler.load_state_dict(sd["scaler"])


def _cast_floats(obj, dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_cast_floats(o, dtype) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def convert_model(model: nn.Module, dtype: torch.dtype) -> list:
    """Store the model in `dtype` (section 3): every parameter and floating buffer, except norm
    layers, which keep FP32 parameters and statistics and reduce in FP32 on FP16 inputs (3.3), and
    modules marked `keep_fp32 = True`, which keep FP32 parameters and are given FP32 inputs (their
    outputs are theirs to choose: a loss head returns FP32). Inputs are cast to `dtype` on entry;
    outputs are cast to FP32 so that softmax and the loss reduce in FP32 (3.3). Returns the hook
    handles."""
    model.to(dtype)
    handles = []
    for m in model.modules():
        if isinstance(m, _NORMS):
            m.float()
        elif getattr(m, "keep_fp32", False):
            m.float()
            handles.append(m.register_forward_pre_hook(
                lambda mod, args, kwargs: (_cast_floats(args, torch.float32), _cast_floats(kwargs, torch.float32)),
                with_kwargs=True))
        elif isinstance(m, _FP32_COMPUTE) or getattr(m, "fp32_compute", False):
            handles.append(m.register_forward_pre_hook(lambda mod, args: _cast_floats(args, torch.float32)))
            handles.append(m.register_forward_hook(lambda mod, args, out: _cast_floats(out, dtype)))
    # Several named models (a GAN's generator and discriminator) are called one by one, never
    # through their container: each gets the FP16-in / FP32-out boundary.
    for m in (model.values() if isinstance(model, nn.ModuleDict) else [model]):
        handles.append(m.register_forward_pre_hook(
            lambda mod, args, kwargs: (_cast_floats(args, dtype), _cast_floats(kwargs, dtype)), with_kwargs=True))
        handles.append(m.register_forward_hook(lambda mod, args, out: _cast_floats(out, torch.float32)))
    return handles


def check_dense(model: nn.Module, what: str) -> None:
    """One-line error for layers that make sparse gradients: the FP32 master copy is dense."""
    for name, m in model.named_modules():
        if isinstance(m, _SPARSE_CAPABLE) and m.sparse:
            raise UserError(f"{what} cannot train {name or 'the model'} = {type(m).__name__}(sparse=True): "
                            f"the FP32 master copy takes dense gradients; build it with sparse=False "
                            f"(or use impl=autocast with precision fp16/mixed/bf16)")


class Paper(Recipe):
    """The paper's scheme (section 3): FP16 model, FP32 master weights, loss scaling.

    master=False is fp16_pure: the optimizer still updates FP32 tensors, but they are overwritten
    from the FP16 weights before every step, so nothing survives the rounding back into FP16.
    fp32_math=True is fp16_storage: autocast() computes the dot products in FP32 (FP32Math).

    Per optimizer it keeps (model params, FP32 params the optimizer holds, `own`: the positions
    whose FP32 tensor is a separate copy). A model parameter that stays FP32 (norm layers,
    keep_fp32 modules) is handed to the optimizer itself: it needs no second FP32 copy."""

    impl = "paper"

    def __init__(self, device, name: str, dtype: torch.dtype, scale, scaler_cfg=None, master: bool = True,
                 fp32_math: bool = False):
        super().__init__(device)
        self.name, self.compute_dtype, self.master, self.fp32_math = name, dtype, master, fp32_math
        c = scaler_cfg
        if scale is None:
            self.scaler = LossScaler("none")
        elif scale == "dynamic":
            self.scaler = LossScaler("dynamic", c.init_scale, c.growth_factor, c.backoff_factor, c.growth_interval)
        else:
            self.scaler = LossScaler("static", scale)
        self._pairs: list[tuple[list[torch.Tensor], list[torch.Tensor], list[int]]] = []

    def autocast(self):
        return FP32Math() if self.fp32_math else contextlib.nullcontext()

    @property
    def _what(self) -> str:
        return f"precision={self.name} (impl=paper)"

    def prepare(self, model, optimizers):
        optimizers = list(optimizers)
        model_params = {id(p) for p in model.parameters()}
        for opt in optimizers:
            if isinstance(opt, _UNWRAPPABLE):
                raise UserError(f"impl=paper cannot wrap optimizer {type(opt).__name__} (closure/sparse steps); "
                                f"use impl=autocast or another torch.optim optimizer")
            if len(opt.state) > 0:
                raise UserError(f"impl=paper must wrap optimizer {type(opt).__name__} before its first step; "
                                f"call recipe.prepare() right after creating it")
            if any(id(p) not in model_params for p in self.params_of(opt)):
                raise UserError(f"impl=paper: optimizer {type(opt).__name__} holds tensors that are not "
                                f"parameters of the model given to prepare()")
        check_dense(model, self._what)
        # The FP32 master copy (3.1) starts from the model's FP32 initial weights, taken before the
        # model is converted: the FP16 model is derived from the master, never the other way round
        # (copying back from the FP16 model would start the master from FP16-rounded weights).
        inits = [[p.detach().float().clone() for p in self.params_of(opt)] for opt in optimizers]
        self._handles = convert_model(model, self.compute_dtype)
        for opt, init in zip(optimizers, inits):
            model_p = self.params_of(opt)
            own = [i for i, p in enumerate(model_p) if p.dtype != torch.float32]
            fp32 = list(model_p)
            for i in own:
                fp32[i] = init[i]
            it = iter(fp32)
            for g in opt.param_groups:
                g["params"] = [next(it) for _ in g["params"]]
            self._pairs.append((model_p, fp32, own))
        return super().prepare(model, optimizers)

    def broadcast_masters(self, src: int = 0) -> None:
        """Give every rank rank `src`'s FP32 masters. DDP broadcasts the model's (FP16) weights when it
        wraps it, but the masters were copied before, from each rank's own initial weights: ranks
        started from different weights would round different masters into their models and drift
        apart. Call after DDP wrapping, before the first step."""
        import torch.distributed as dist

        if not (self.master and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        with torch.no_grad():
            for _, fp32, own in self._pairs:
                for i in own:
                    dist.broadcast(fp32[i], src)
        self.sync_model_from_master()

    def _pair(self, optimizer):
        return self._pairs[self.optimizers.index(optimizer)]

    def weights_of(self, optimizer) -> list[torch.Tensor]:
        """The tensors that hold the trained weights: the FP32 masters, or (fp16_pure) the FP16 model."""
        model_p, fp32, _ = self._pair(optimizer)
        return fp32 if self.master else model_p

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def backward(self, loss):
        # Scaling the loss scales every gradient by S through the chain rule (3.2).
        (loss.float() * self.scaler.scale if self.scaler.scale != 1.0 else loss).backward()

    def step(self, optimizer, clip_grad_norm=0.0):
        model_p, fp32, own = self._pair(optimizer)
        if any(p.grad is not None and p.grad.is_sparse for p in model_p):
            raise UserError(f"{self._what} got a sparse gradient; the FP32 master copy takes dense ones "
                            f"(build embeddings with sparse=False)")
        with torch.no_grad():
            if not self.master:  # fp16_pure: the FP32 copy starts every step from the FP16 weights
                TP.foreach_copy_([fp32[i] for i in own], [model_p[i] for i in own])
            for i in own:
                p, m = model_p[i], fp32[i]
                if p.grad is None:
                    m.grad = None  # unused this step: the optimizer skips it, as in FP32
                elif m.grad is None:
                    m.grad = torch.empty_like(m)
            copied = [i for i in own if model_p[i].grad is not None]
            # FP16 -> FP32 first, then unscale: unscaling in FP16 would flush small values again.
            if copied:
                TP.foreach_copy_([fp32[i].grad for i in copied], [model_p[i].grad for i in copied])
        live = [i for i, m in enumerate(fp32) if m.grad is not None]
        grads = [fp32[i].grad for i in live]
        found = False
        if self.scaler.mode != "none" and grads:
            found_inf = torch.zeros(1, device=grads[0].device)
            inv = torch.full((1,), 1.0 / self.scaler.scale, device=grads[0].device)
            TP.unscale_and_check_(grads, found_inf, inv)
            # The one host sync of the step, as in Autocast: the skip (3.2) must be known on the host
            # to leave optimizer.step(), the FP16 weight copy-back and the LR schedule out.
            found = bool(found_inf.item())
        if found:  # section 3.2: skip the update when any gradient overflowed
            self._found_inf = True
            self._note_overflow()
            return False
        if clip_grad_norm > 0:  # on unscaled FP32 gradients
            torch.nn.utils.clip_grad_norm_([fp32[i] for i in live], clip_grad_norm, foreach=True)
        optimizer.step()
        if copied:  # round the updated FP32 weights back into the FP16 model (3.1)
            with torch.no_grad():
                TP.foreach_copy_([model_p[i] for i in copied], [fp32[i] for i in copied])
        return True

    def update(self):
        self.scaler.update(self._found_inf)
        self._found_inf = False

    def zero_grad(self):
        # Model (FP16) gradients are freed; the FP32 copies' gradients are kept allocated and overwritten.
        self._free_model_grads()

    def sync_model_from_master(self) -> None:
        if not self.master:
            return
        with torch.no_grad():
            for model_p, fp32, own in self._pairs:
                if own:
                    TP.foreach_copy_([model_p[i] for i in own], [fp32[i] for i in own])

    def state_dict(self):
        sd = super().state_dict()
        sd["scaler"] = self.scaler.state_dict()
        if self.master:  # only the separate copies: the FP32 model parameters are in the model's state_dict
            sd["master"] = [[fp32[i].detach().clone() for i in own] for _, fp32, own in self._pairs]
        return sd

    def load_state_dict(self, sd):
        super().load_state_dict(sd)
        self.scaler.load_state_dict(sd["scaler"])
        if self.master:
            with torch.no_grad():
                for (_, fp32, own), saved in zip(self._pairs, sd["master"]):
                    # Older checkpoints saved a master for every parameter, FP32 ones included.
                    idx = own if len(saved) == len(own) else range(len(fp32))
                    for i, s in zip(idx, saved):
                        fp32[i].copy_(s)
            self.sync_model_from_master()


def build(cfg, device) -> Recipe:
    """The recipe named by cfg.precision / cfg.impl / cfg.loss_scale (validated by check())."""
    check(cfg)
    device = torch.device(device)
    p, scale = cfg.precision, parse_loss_scale(cfg.loss_scale, cfg.precision)
    if p == "fp32":
        return FP32(device)
    dtype = torch.bfloat16 if p == "bf16" else torch.float16
    if p == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError(f"precision=bf16 needs a GPU with BF16 (Ampere or newer); "
                        f"{torch.cuda.get_device_name(device)} has none: use precision=mixed")
    if p in _PAPER_ONLY:
        return Paper(device, p, dtype, scale, cfg.scaler, master=p != "fp16_pure", fp32_math=p == "fp16_storage")
    if cfg.impl == "paper":
        return Paper(device, p, dtype, scale, cfg.scaler, master=True)
    return Autocast(device, p, dtype, scale, cfg.scaler)
