"""The one precision switch (paper section 3). Every experiment runs every precision through here;
the training loop calls the same five methods whatever the precision and never branches on it:

    recipe = build(cfg, device)                  # from cfg.precision / cfg.impl / cfg.loss_scale
    model = recipe.prepare(model, [optimizer])   # before DDP wrapping and before any step
    with recipe.autocast():
        loss = loss_fn(model(x), y)
    recipe.backward(loss)                        # scales by S (section 3.2); call k times to accumulate
    applied = recipe.step(optimizer, clip_grad_norm)   # unscale, skip on inf/nan, clip, update
    recipe.update()                              # once per iteration, after every optimizer's step
    recipe.zero_grad()

Recipes (cfg.precision):
  fp32       everything FP32 (TF32 is a separate switch, off by default).
  fp16       the paper's "MP without loss scaling": FP16 forward/backward, FP32 master weights,
             S = 1 and no overflow skipping, so a network that diverges (SSD, Table 2) diverges here.
  mixed      FP16 + FP32 master weights + loss scaling: constant S (the paper's) or dynamic
             (a later framework feature, section 5); both skip the update on inf/nan.
  bf16       BF16 compute, FP32 master weights, no scaling (BF16 has FP32's exponent range).
  fp16_pure  Figure 2a's ablation: FP16 weights updated directly, no FP32 master copy
             (loss scaling optional).

Implementations (cfg.impl):
  autocast   torch.autocast + torch.amp.GradScaler: parameters stay FP32 (they *are* the master
             copy) and matmuls/convolutions run in FP16 on autocast's casts.
  paper      the paper's own scheme: parameters, activations and gradients stored in FP16, an FP32
             master copy that the optimizer updates, FP16 gradients unscaled into FP32 master
             gradients, the updated master rounded back into the FP16 model. Norm layers keep FP32
             parameters and statistics and compute in FP32 while reading/writing FP16, and the
             model's outputs are cast to FP32 so softmax and the loss reduce in FP32 (section 3.3).
  fp16_pure has no FP32 weights to autocast from, so both impls run it the same way.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable

import torch
import torch.nn as nn

from mpt import torch_private as TP
from mpt.errors import UserError
from mpt.numerics import first_nonfinite

PRECISIONS = ("fp32", "fp16", "mixed", "bf16", "fp16_pure")
IMPLS = ("autocast", "paper")
# Norm layers keep FP32 parameters and statistics; their kernels read FP16 input with FP32
# parameters and reduce in FP32 (section 3.3), so no FP32 copy of the activation is made or saved.
_NORMS = (TP.NormBase, nn.LayerNorm, nn.GroupNorm)
# Layers with no FP16 kernel on some devices, or whose reduction must stay in FP32 (a sum of squares,
# 3.3): computed in FP32 on a cast of their input. A model's own layer opts in with `fp32_compute = True`.
_FP32_COMPUTE = (nn.LocalResponseNorm,)
# Optimizers whose step needs a closure or sparse gradients: the master-weight swap cannot wrap them.
_UNWRAPPABLE = (torch.optim.LBFGS, torch.optim.SparseAdam)


# ------------------------------------------------------------------------------------------------
# config checks


def parse_loss_scale(value: str, precision: str):
    """'auto' | 'dynamic' | a positive number  ->  None (no scaling), 'dynamic' or float S."""
    v = str(value).strip().lower()
    if v == "auto":
        return "dynamic" if precision == "mixed" else None
    if v == "dynamic":
        if precision not in ("mixed", "fp16_pure"):
            raise UserError(f"loss_scale=dynamic needs precision=mixed or fp16_pure, not {precision}")
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
        self.skipped_steps = 0
        self.last_overflow: str | None = None  # first parameter holding a non-finite gradient
        self._found_inf = False  # any optimizer of the current iteration overflowed

    # -- setup --
    def prepare(self, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> nn.Module:
        self.model, self.optimizers = model, list(optimizers)
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
        if self.model is not None:
            self.model.zero_grad(set_to_none=True)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    # -- introspection --
    @staticmethod
    def params_of(optimizer) -> list[torch.Tensor]:
        return [p for g in optimizer.param_groups for p in g["params"]]

    def master_params(self) -> list[torch.Tensor]:
        """The tensors the optimizers update (FP32 masters where the recipe keeps them)."""
        return [p for opt in self.optimizers for p in self.params_of(opt)]

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
        found = sum(v.item() for v in TP.scaler_found_inf(self.scaler, optimizer))
        if found:
            self._found_inf = True
            self._note_overflow()
        elif clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params_of(optimizer), clip_grad_norm, foreach=True)
        self.scaler.step(optimizer)  # skips optimizer.step() itself when found
        return not found

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
    layers, which keep FP32 parameters and statistics and reduce in FP32 on FP16 inputs (3.3).
    Inputs are cast to `dtype` on entry; outputs are cast to FP32 so that softmax and the loss
    reduce in FP32 (3.3). Returns the hook handles."""
    model.to(dtype)
    handles = []
    for m in model.modules():
        if isinstance(m, _NORMS):
            m.float()
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


class Paper(Recipe):
    """The paper's scheme (section 3): FP16 model, FP32 master weights, loss scaling."""

    impl = "paper"

    def __init__(self, device, name: str, dtype: torch.dtype, scale, scaler_cfg=None, master: bool = True):
        super().__init__(device)
        self.name, self.compute_dtype, self.master = name, dtype, master
        c = scaler_cfg
        if scale is None:
            self.scaler = LossScaler("none")
        elif scale == "dynamic":
            self.scaler = LossScaler("dynamic", c.init_scale, c.growth_factor, c.backoff_factor, c.growth_interval)
        else:
            self.scaler = LossScaler("static", scale)
        self._pairs: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # per optimizer: (model, master)

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
        # The FP32 master copy (3.1) starts from the model's FP32 initial weights, taken before the
        # model is converted: the FP16 model is derived from the master, never the other way round
        # (copying back from the FP16 model would start the master from FP16-rounded weights).
        inits = [[p.detach().float().clone() for p in self.params_of(opt)] if self.master else None
                 for opt in optimizers]
        self._handles = convert_model(model, self.compute_dtype)
        for opt, masters in zip(optimizers, inits):
            model_p = self.params_of(opt)
            if self.master:
                it = iter(masters)
                for g in opt.param_groups:
                    g["params"] = [next(it) for _ in g["params"]]
                self._pairs.append((model_p, masters))
            else:
                self._pairs.append((model_p, model_p))
        return super().prepare(model, optimizers)

    def _pair(self, optimizer):
        return self._pairs[self.optimizers.index(optimizer)]

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def backward(self, loss):
        # Scaling the loss scales every gradient by S through the chain rule (3.2).
        (loss.float() * self.scaler.scale if self.scaler.scale != 1.0 else loss).backward()

    def step(self, optimizer, clip_grad_norm=0.0):
        model_p, masters = self._pair(optimizer)
        live = [i for i, p in enumerate(model_p) if p.grad is not None]
        if self.master:
            for i, (p, m) in enumerate(zip(model_p, masters)):
                if p.grad is None:
                    m.grad = None  # unused this step: the optimizer skips it, as in FP32
                elif m.grad is None:
                    m.grad = torch.empty_like(m)
            grads = [masters[i].grad for i in live]
            # FP16 -> FP32 first, then unscale: unscaling in FP16 would flush small values again.
            TP.foreach_copy_(grads, [model_p[i].grad for i in live])
        else:
            grads = [model_p[i].grad for i in live]
        found = False
        if self.scaler.mode != "none" and grads:
            found_inf = torch.zeros(1, device=grads[0].device)
            inv = torch.full((1,), 1.0 / self.scaler.scale, device=grads[0].device)
            TP.unscale_and_check_(grads, found_inf, inv)
            found = bool(found_inf.item())
        if found:  # section 3.2: skip the update when any gradient overflowed
            self._found_inf = True
            self._note_overflow()
            return False
        if clip_grad_norm > 0:  # on unscaled FP32 gradients
            torch.nn.utils.clip_grad_norm_([masters[i] for i in live], clip_grad_norm, foreach=True)
        optimizer.step()
        if self.master:  # round the updated master back into the FP16 model (3.1)
            with torch.no_grad():
                TP.foreach_copy_([model_p[i] for i in live], [masters[i] for i in live])
        return True

    def update(self):
        self.scaler.update(self._found_inf)
        self._found_inf = False

    def zero_grad(self):
        # Model (FP16) gradients are freed; master gradients are kept allocated and overwritten.
        if self.model is not None:
            self.model.zero_grad(set_to_none=True)
        if not self.master:
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)

    def sync_model_from_master(self) -> None:
        with torch.no_grad():
            for model_p, masters in self._pairs:
                if self.master:
                    TP.foreach_copy_(model_p, masters)

    def state_dict(self):
        sd = super().state_dict()
        sd["scaler"] = self.scaler.state_dict()
        if self.master:
            sd["master"] = [[m.detach().clone() for m in masters] for _, masters in self._pairs]
        return sd

    def load_state_dict(self, sd):
        super().load_state_dict(sd)
        self.scaler.load_state_dict(sd["scaler"])
        if self.master:
            with torch.no_grad():
                for (_, masters), saved in zip(self._pairs, sd["master"]):
                    TP.foreach_copy_(masters, [s.to(masters[0].device) for s in saved])
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
    if p == "fp16_pure":
        return Paper(device, p, dtype, scale, cfg.scaler, master=False)
    if cfg.impl == "paper":
        return Paper(device, p, dtype, scale, cfg.scaler, master=True)
    return Autocast(device, p, dtype, scale, cfg.scaler)
