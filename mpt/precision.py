"""The one precision switch (paper section 3): build(cfg, device) returns the recipe of cfg.precision
(a row of mpt/precisions.py) and cfg.impl. Every experiment runs every precision through here; the
training loop calls the same methods whatever the precision and never branches on it:

    recipe = build(cfg, device)                  # from cfg.precision / cfg.impl / cfg.loss_scale
    model = recipe.prepare(model, [optimizer])   # before DDP wrapping and before any step
    recipe.broadcast_masters()                   # after DDP wrapping (DDP broadcasts only the model)
    with recipe.autocast():
        loss = loss_fn(model(x), y)
    recipe.backward(loss)                        # scales by S (section 3.2); call k times to accumulate
    applied = recipe.step(optimizer, clip_grad_norm)   # unscale, skip on inf/nan, clip, update
    recipe.update()                              # once per iteration, after every optimizer's step
    recipe.zero_grad()

One recipe class per scheme: FP32; Autocast (torch.autocast and GradScaler); the paper's FP16 model
(HalfModel) with FP32 master weights (MasterCopy), with FP32 math (FP16Storage) or without a master copy
(NoMasterCopy); FP8. The arithmetic they call lives beside: mpt.half_math (FP16/BF16 dot products on a
CPU), mpt.fp8, mpt.rounding and mpt.loss_scaler.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable

import torch
import torch.nn as nn

from mpt import formats, fused, precisions
from mpt import torch_private as TP
from mpt.bands import first_nonfinite
from mpt.errors import UserError
from mpt.fp8 import FP8Math, FP8State
from mpt.half_math import FP32Copies, FP32Math, HalfMath, resolve_half_math
from mpt.loss_scaler import LossScaler
from mpt.precisions import HALF_COMPUTE, check, parse_loss_scale
from mpt.rounding import kahan_round_, stochastic_round
from mpt.step import Observer

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


def channels_last_pays(cfg, device, task_is_cnn: bool) -> bool:
    """channels_last=auto: NHWC for an image CNN on CUDA where tensor cores run its convolutions (FP16,
    BF16, TF32). Measured on an H200 (cuDNN 9.19, ResNet-50 at batch 256, experiments/speed_memory/
    results/nvidia-h200-2026-11-27-gpu_check-call2.json), NHWC / NCHW step time: mixed 0.51-0.52,
    TF32 0.70, but strict FP32 2.13 (cuDNN's FP32 NHWC kernels are the slow ones). On a CPU, NCHW."""
    if isinstance(cfg.channels_last, bool):
        return cfg.channels_last
    return device.type == "cuda" and task_is_cnn and (cfg.precision in HALF_COMPUTE or cfg.tf32)


# The process-wide math switches a run sets: (its name in env.json, the torch.backends object, attribute).
_MATH_FLAGS = (("tf32_matmul", torch.backends.cuda.matmul, "allow_tf32"),
               ("tf32_cudnn", torch.backends.cudnn, "allow_tf32"),
               ("fp16_reduced_precision_reduction", torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
               ("bf16_reduced_precision_reduction", torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"))


def set_backend_flags(tf32: bool) -> dict:
    """The process-wide math settings of a run, set in one place (the engine and the speed benchmark):
    TF32 only where asked (a separate baseline, not the paper's FP32); FP16 and BF16 products reduced
    in FP32. cuBLAS may otherwise add a split-K product's partial sums in FP16/BF16 (PyTorch's default
    allows it), where section 3.3's recipe accumulates FP16 products into FP32. Returns what was set,
    for env.json."""
    want = {"tf32_matmul": tf32, "tf32_cudnn": tf32, "fp16_reduced_precision_reduction": False,
            "bf16_reduced_precision_reduction": False}
    for name, owner, attr in _MATH_FLAGS:
        setattr(owner, attr, want[name])
    return backend_flags()


def backend_flags() -> dict:
    return {name: bool(getattr(owner, attr)) for name, owner, attr in _MATH_FLAGS}


@contextlib.contextmanager
def restored_backend_flags():
    """Leave the math flags and cudnn.benchmark as they were (a benchmark sets them per row)."""
    switches = [(owner, attr) for _, owner, attr in _MATH_FLAGS] + [(torch.backends.cudnn, "benchmark")]
    saved = [getattr(owner, attr) for owner, attr in switches]
    try:
        yield
    finally:
        for (owner, attr), value in zip(switches, saved):
            setattr(owner, attr, value)


class Recipe:
    """Common state: the optimizers handed to prepare(), skip counting, the overflow culprit."""

    name = "fp32"
    impl = "autocast"
    compute_dtype = torch.float32
    half_math = "none"  # what computes the FP16/BF16 dot products: emulated | native | device | none
    # train.cuda_graphs (mpt.graphs): whether a micro-batch's forward/backward can be captured and
    # replayed exactly. Not where a forward updates host-side state (fp8's amax records and scales).
    graphable = True

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.optimizers: list[torch.optim.Optimizer] = []
        self.model: nn.Module | None = None
        self._model_params: list[torch.Tensor] | None = None  # _free_model_grads' list
        self.skipped_steps = 0
        self.last_overflow: str | None = None  # first parameter holding a non-finite gradient
        self._found_inf = False  # any optimizer of the current iteration overflowed

    @classmethod
    def from_config(cls, cfg, device) -> Recipe:
        """The recipe for a checked config (build)."""
        return cls(device)

    @classmethod
    def half_math_for(cls, setting: str, dtype: torch.dtype, device) -> str:
        """What computes this recipe's `dtype` dot products on `device` under cfg.half_math=setting."""
        return resolve_half_math(setting, dtype, device)

    # -- setup --
    def prepare(self, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> nn.Module:
        self.model, self.optimizers = model, list(optimizers)
        self._model_params = None
        return model

    def autocast(self):
        return contextlib.nullcontext()

    def graph_key(self):
        """The host values this recipe's forward and backward read as constants: a CUDA graph captured
        with one value is captured again when it changes (mpt.graphs). None: nothing (GradScaler's scale
        is a device tensor the graph reads at each replay)."""
        return None

    def untouched(self):
        """A context whose forward and backward passes leave this recipe's state as it was: what a
        measurement beside training (mpt.numerics.fidelity) runs in. The loss scaler changes only in
        step() and update(), so there is nothing to keep here; FP8 keeps its recorded amaxes and its
        stochastic-rounding generators."""
        return contextlib.nullcontext()

    def observers(self, total_steps: int) -> tuple:
        """Hooks the training loop runs around each iteration for this recipe (mpt.step.Observer), for a run of
        total_steps iterations: a schedule of the recipe's own (FP8's BF16 tail). None by default."""
        return ()

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
        """The tensors the optimizers update (FP32 masters where the recipe keeps them; without a master
        copy, the FP32 copies each step starts from the FP16 weights)."""
        return [p for opt in self.optimizers for p in self.params_of(opt)]

    def weights_of(self, optimizer) -> list[torch.Tensor]:
        """The tensors that hold the weights `optimizer` trains, matched by position with
        params_of(optimizer): the same tensors, except without a master copy, where the optimizer's
        result (params_of) is what the update intended and these FP16 weights are what they received."""
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
    """fp16, mixed and bf16 under impl=autocast: torch.autocast for the FP16/BF16 compute, GradScaler for
    loss scaling and skipping. The parameters stay FP32 (they *are* the master copy) and matmuls and
    convolutions run in FP16 on autocast's casts."""

    impl = "autocast"

    def __init__(self, device, name: str, dtype: torch.dtype, scale, scaler_cfg=None, half_math: str = "auto"):
        super().__init__(device)
        self.name, self.compute_dtype = name, dtype
        self.half_math = self.half_math_for(half_math, dtype, self.device)
        self.static_scale = scale if isinstance(scale, float) else None
        if scale is None:
            self.scaler = None  # fp16 without loss scaling / bf16: S = 1, nothing skipped
        else:
            c = scaler_cfg
            init = scale if isinstance(scale, float) else c.init_scale
            self.scaler = torch.amp.GradScaler(
                self.device.type, init_scale=init, growth_factor=c.growth_factor,
                backoff_factor=c.backoff_factor, growth_interval=c.growth_interval)

    @classmethod
    def from_config(cls, cfg, device):
        return cls(device, *_half_args(cfg))

    def autocast(self):
        if self.half_math != "emulated":
            return torch.autocast(self.device.type, dtype=self.compute_dtype)
        return _both(torch.autocast(self.device.type, dtype=self.compute_dtype), HalfMath(self.compute_dtype))

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


@contextlib.contextmanager
def _both(outer, inner):
    with outer, inner:
        yield


def cast_floats(obj, dtype, keep_dicts: bool = False):
    """Floating tensors in obj cast to dtype. keep_dicts: mappings (a detector's targets) are left as
    they are -- the model-input cast under BF16, whose 8-bit mantissa would move a 300-px box corner
    by up to a pixel (and torchvision's detectors refuse BF16 boxes; they accept FP16 ones)."""
    if keep_dicts and isinstance(obj, dict):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(cast_floats(o, dtype, keep_dicts) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floats(o, dtype, keep_dicts) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
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
                lambda mod, args, kwargs: (cast_floats(args, torch.float32), cast_floats(kwargs, torch.float32)),
                with_kwargs=True))
        elif isinstance(m, _FP32_COMPUTE) or getattr(m, "fp32_compute", False):
            handles.append(m.register_forward_pre_hook(lambda mod, args: cast_floats(args, torch.float32)))
            handles.append(m.register_forward_hook(lambda mod, args, out: cast_floats(out, dtype)))
    # Several named models (a GAN's generator and discriminator) are called one by one, never
    # through their container: each gets the FP16-in / FP32-out boundary.
    keep = dtype == torch.bfloat16
    for m in (model.values() if isinstance(model, nn.ModuleDict) else [model]):
        handles.append(m.register_forward_pre_hook(
            lambda mod, args, kwargs: (cast_floats(args, dtype, keep), cast_floats(kwargs, dtype, keep)),
            with_kwargs=True))
        handles.append(m.register_forward_hook(lambda mod, args, out: cast_floats(out, torch.float32)))
    return handles


def check_dense(model: nn.Module, what: str) -> None:
    """One-line error for layers that make sparse gradients: the FP32 master copy is dense."""
    for name, m in model.named_modules():
        if isinstance(m, _SPARSE_CAPABLE) and m.sparse:
            raise UserError(f"{what} cannot train {name or 'the model'} = {type(m).__name__}(sparse=True): "
                            f"the FP32 master copy takes dense gradients; build it with sparse=False "
                            f"(or use impl=autocast with precision fp16/mixed/bf16)")


def _half_args(cfg) -> tuple:
    """(name, dtype, loss scale, scaler config, half_math setting) of an FP16/BF16 recipe."""
    p = cfg.precision
    return p, _dtype(p), parse_loss_scale(cfg.loss_scale, p), cfg.scaler, getattr(cfg, "half_math", "auto")


def _dtype(precision: str) -> torch.dtype:
    """The dtype a precision stores the model in under the paper's scheme (FP32 for fp32 and fp8)."""
    return getattr(torch, precisions.BY_NAME[precision].storage)


class HalfModel(Recipe):
    """The paper's scheme (section 3): parameters, activations and gradients stored in FP16 (BF16), the
    optimizer stepping FP32 tensors, FP16 gradients copied into FP32 gradients and unscaled there
    (LossScaler), the FP32 result rounded back into the FP16 model. Norm layers keep FP32 parameters
    and statistics and compute in FP32 while reading and writing FP16, and the model's outputs are cast
    to FP32 so softmax and the loss reduce in FP32 (section 3.3; convert_model). A module with
    `keep_fp32 = True` (the bigLSTM's softmax, as in its reference code) keeps FP32 parameters and gets
    FP32 inputs.

    Per optimizer it keeps (model params, FP32 params the optimizer holds, `own`: the positions
    whose FP32 tensor is a separate copy). A model parameter that stays FP32 (norm layers,
    keep_fp32 modules) is handed to the optimizer itself: it needs no second FP32 copy. The
    subclasses decide what the FP32 copies are between steps and how the result is written back."""

    impl = "paper"

    def __init__(self, device, name: str, dtype: torch.dtype, scale, scaler_cfg=None, half_math: str = "auto"):
        super().__init__(device)
        self.name, self.compute_dtype = name, dtype
        self.half_math = self.half_math_for(half_math, dtype, self.device)
        c = scaler_cfg
        if scale is None:
            self.scaler = LossScaler("none")
        elif scale == "dynamic":
            self.scaler = LossScaler("dynamic", c.init_scale, c.growth_factor, c.backoff_factor, c.growth_interval)
        else:
            self.scaler = LossScaler("static", scale)
        self._pairs: list[tuple[list[torch.Tensor], list[torch.Tensor], list[int]]] = []
        # FP32 copies of the FP16 weights for emulated FP32-accumulating dot products: one cast per
        # weight per update instead of two or three per layer (mpt.half_math.FP32Copies)
        self.fp32_copies = FP32Copies()

    @classmethod
    def from_config(cls, cfg, device):
        return cls(device, *_half_args(cfg))

    def autocast(self):
        """HalfMath where this recipe's FP16/BF16 dot products are emulated (it builds their backward
        too: nothing is needed around backward())."""
        return HalfMath(self.compute_dtype, self.fp32_copies) if self.half_math == "emulated" else contextlib.nullcontext()

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

    def _pair(self, optimizer):
        return self._pairs[self.optimizers.index(optimizer)]

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def graph_key(self):
        """S: a Python number in the backward's multiply (below)."""
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
            self._start_step(model_p, fp32, own)
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
        if copied:  # the updated FP32 weights back into the FP16 model (3.1)
            with torch.no_grad():
                self._write_back(optimizer, model_p, fp32, copied)
            self.fp32_copies.refresh()
        return True

    def _start_step(self, model_p, fp32, own) -> None:
        """What the FP32 copies start the step from, before the gradients are copied in (a master copy:
        where the last step left them)."""

    def _write_back(self, optimizer, model_p, fp32, copied) -> None:
        """The updated FP32 weights rounded to nearest into the FP16 model (3.1)."""
        TP.foreach_copy_([model_p[i] for i in copied], [fp32[i] for i in copied])

    def update(self):
        self.scaler.update(self._found_inf)
        self._found_inf = False

    def zero_grad(self):
        # Model (FP16) gradients are freed; the FP32 copies' gradients are kept allocated and overwritten.
        self._free_model_grads()

    def state_dict(self):
        sd = super().state_dict()
        sd["scaler"] = self.scaler.state_dict()
        return sd

    def load_state_dict(self, sd):
        super().load_state_dict(sd)
        self.scaler.load_state_dict(sd["scaler"])


class MasterCopy(HalfModel):
    """fp16, mixed and bf16 under impl=paper: an FP32 master copy of the weights (section 3.1) that the
    optimizer updates, rounded into the FP16 model after every step. It starts from the model's FP32
    initial weights, so the FP16 model is derived from it, never the other way round."""

    def weights_of(self, optimizer) -> list[torch.Tensor]:
        """The FP32 masters."""
        return self._pair(optimizer)[1]

    def broadcast_masters(self, src: int = 0) -> None:
        """Give every rank rank `src`'s FP32 masters. DDP broadcasts the model's (FP16) weights when it
        wraps it, but the masters were copied before, from each rank's own initial weights: ranks
        started from different weights would round different masters into their models and drift
        apart. Call after DDP wrapping, before the first step."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        with torch.no_grad():
            for _, fp32, own in self._pairs:
                for i in own:
                    dist.broadcast(fp32[i], src)
        self.sync_model_from_master()

    def sync_model_from_master(self) -> None:
        with torch.no_grad():
            for model_p, fp32, own in self._pairs:
                if own:
                    TP.foreach_copy_([model_p[i] for i in own], [fp32[i] for i in own])

    def state_dict(self):
        sd = super().state_dict()
        # Only the separate copies: the FP32 model parameters are in the model's state_dict.
        sd["master"] = [[fp32[i].detach().clone() for i in own] for _, fp32, own in self._pairs]
        return sd

    def load_state_dict(self, sd):
        super().load_state_dict(sd)
        with torch.no_grad():
            for (_, fp32, own), saved in zip(self._pairs, sd["master"]):
                for i, s in zip(own, saved):
                    fp32[i].copy_(s)
        self.sync_model_from_master()


class FP16Storage(MasterCopy):
    """fp16_storage, "FP16 storage, FP32 math", how the paper ran DeepSpeech 2 (section 4.3): weights,
    activations and gradients stored in FP16, FP32 master weights, and every dot product (linear,
    matmul, convolution, recurrent layer) and softmax computed in FP32 on the FP16 values, its result
    stored in FP16 (FP32Math, on every device). Point-wise ops and reductions run PyTorch's FP16
    kernels, which already compute in FP32 and round once on output. No loss scaling unless loss_scale
    is set. The FP32 temporaries autograd saves make its memory and speed those of FP32: it reproduces
    the numerics only."""

    @classmethod
    def half_math_for(cls, setting, dtype, device):
        return "emulated"  # FP32 math on FP16 values is the precision's definition, whatever the setting

    def autocast(self):
        return FP32Math(self.fp32_copies)


class NoMasterCopy(HalfModel):
    """fp16_pure (Figure 2a's ablation) and bf16_pure: FP16 (BF16) weights updated directly, with no FP32
    master copy. The optimizer's arithmetic and state stay FP32 -- each step it works on an FP32 copy
    made from the FP16 weights, and its result is rounded back into them; the copy carries nothing to
    the next step, so whatever the rounding loses is lost (section 3.1). The ablation is about the
    weights: an Adam eps of 1e-8 (0 in FP16) or an FP16 momentum buffer would be a second, different
    effect.

    `rounding` writes the result into the weights (mpt.rounding): nearest (round to nearest even: small
    updates are lost), stochastic (up or down with probabilities that make it unbiased; seeded from
    cfg.seed, its generator in the checkpoint) or kahan (a compensation buffer per weight carries what
    the rounding lost into the next update)."""

    def __init__(self, device, name: str, dtype: torch.dtype, scale, scaler_cfg=None, half_math: str = "auto",
                 rounding: str = "nearest", seed: int = 0):
        super().__init__(device, name, dtype, scale, scaler_cfg, half_math)
        self.rounding = rounding
        self._gen = None
        if rounding == "stochastic":  # seeded, and in the checkpoint: a resume is bit-identical
            self._gen = torch.Generator(device=self.device).manual_seed(1_000_003 * (int(seed) + 1))
        self._comp: dict[tuple[int, int], torch.Tensor] = {}  # kahan: (optimizer, position) -> buffer

    @classmethod
    def from_config(cls, cfg, device):
        return cls(device, *_half_args(cfg), getattr(cfg, "rounding", "nearest"), cfg.seed)

    def weights_of(self, optimizer) -> list[torch.Tensor]:
        """The FP16 weights: what the update received (params_of holds what it intended)."""
        return self._pair(optimizer)[0]

    def _start_step(self, model_p, fp32, own) -> None:
        TP.foreach_copy_([fp32[i] for i in own], [model_p[i] for i in own])  # nothing survives a step

    def _write_back(self, optimizer, model_p, fp32, copied) -> None:
        if self.rounding == "nearest":
            super()._write_back(optimizer, model_p, fp32, copied)
        elif self.rounding == "stochastic":
            for i in copied:
                model_p[i].copy_(stochastic_round(fp32[i], model_p[i].dtype, self._gen))
        else:  # kahan
            k = self.optimizers.index(optimizer)
            for i in copied:
                c = self._comp.get((k, i))
                if c is None:
                    c = self._comp[(k, i)] = torch.zeros_like(model_p[i])
                kahan_round_(model_p[i], fp32[i], c)

    def state_dict(self):
        sd = super().state_dict()
        if self._gen is not None:
            sd["rounding_rng"] = self._gen.get_state()
        if self._comp:
            sd["kahan"] = {f"{k}:{i}": c.clone() for (k, i), c in self._comp.items()}
        return sd

    def load_state_dict(self, sd):
        super().load_state_dict(sd)
        if self._gen is not None and "rounding_rng" in sd:
            self._gen.set_state(sd["rounding_rng"])
        self._comp = {}
        for key, c in sd.get("kahan", {}).items():
            k, i = (int(v) for v in key.split(":"))
            self._comp[(k, i)] = c.clone().to(self.device)


class FP8(Recipe):
    """precision=fp8, fp8_block, mxfp8 and nvfp4, beyond the paper (mpt.fp8, their formats mpt.formats): FP32
    parameters that are the master copy, every weight-bearing dot product on FP8 operands (FP8Math),
    per-tensor scales (FP8State, checkpointed),
    FP32 accumulation and outputs, no loss scaling (the per-tensor scales replace it). The same recipe
    for impl=autocast and impl=paper.

    `fp8.scaling`: `current` (FP8_MAX / amax of the tensor now) or `delayed` (FP8_MAX / the max over an
    amax history of fp8.amax_history_len iterations, Transformer Engine's DelayedScaling defaults: 1024,
    "max", margin 0; the scale starts at 1 and is recomputed once per iteration). `fp8.ends=bf16`
    (default) keeps the first and the last weight-bearing layers of each model in BF16, as the FP8 paper
    kept them in 16 bits -- found from the model's dataflow at its first call (FP8State.find_ends): every
    layer reading the input, every layer whose output reaches no other layer; `fp8.ends=fp8` quantises
    them too."""

    name = "fp8"
    graphable = False  # each forward records amaxes on the host side (FP8State)

    def __init__(self, device, f8, impl: str = "autocast", name: str = "fp8", seed: int = 0,
                 fmt: formats.FormatRecipe | None = None):
        super().__init__(device)
        self.impl, self.name = impl, name
        self.ends = f8.ends
        # The precision's formats (mpt.formats), as the config's fmt.* keys leave them
        # (precisions.format_recipe): precision=fp8 takes its scaling from fp8.scaling; the block-scaled
        # ones scale from each block now.
        if fmt is None:
            fmt = formats.RECIPES[name]
            if name == "fp8":
                fmt = fmt.with_scaling(f8.scaling)
        self.state = FP8State(fmt.scaling, f8.amax_history_len, f8.amax_compute_algo, f8.margin, fmt, seed)

    @classmethod
    def from_config(cls, cfg, device):
        fused.enable(cfg.fmt.compile)
        return cls(device, cfg.fp8, cfg.impl, cfg.precision, cfg.seed, precisions.format_recipe(cfg))

    def observers(self, total_steps: int) -> tuple:
        """The recipe's BF16 tail (FormatRecipe.bf16_tail), where it has one: BF16Tail over total_steps."""
        tail = self.state.recipe.bf16_tail
        return (BF16Tail(self.state, total_steps - math.floor(tail * total_steps + 0.5)),) if tail > 0 else ()

    def prepare(self, model, optimizers):
        self.state.register(model, self.ends)
        return super().prepare(model, optimizers)

    def autocast(self):
        return FP8Math(self.state)

    def untouched(self):
        return self.state.untouched()

    def update(self):
        import torch.distributed as dist

        if self.state._seen and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank must quantise with the same scales: the amax of the global batch.
            keys = sorted(self.state._seen)
            t = torch.stack([self.state._seen[k] for k in keys])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            self.state._seen = dict(zip(keys, t.unbind()))
        self.state.update()
        super().update()

    def state_dict(self):
        return {**super().state_dict(), "fp8": self.state.state_dict()}

    def load_state_dict(self, sd):
        super().load_state_dict(sd)
        self.state.load_state_dict(sd["fp8"], self.device)


class BF16Tail(Observer):
    """The end of training on BF16 operands (FormatRecipe.bf16_tail; the NVFP4 paper's switch to higher
    precision for the last ~18% of its tokens): before each iteration, every product of the format recipe
    runs on BF16 operands from iteration `switch_at` on (0-based). A function of the iteration alone, which a
    checkpoint restores, so a resumed run switches where the uninterrupted one does."""

    def __init__(self, state: FP8State, switch_at: int):
        self.state, self.switch_at = state, int(switch_at)

    def begin(self, step, micro_batches) -> None:
        self.state.wide = step.iteration >= self.switch_at


# The recipe each row of mpt/precisions.py names (Precision.recipe, one of precisions.RECIPE_KINDS): a
# class of its own, or "formats" -- FP8 on the row's FormatRecipe (mpt.formats.RECIPES) -- or "impl",
# the scheme cfg.impl names (IMPL_RECIPES; fp16, mixed, bf16).
RECIPES: dict[str, type[Recipe]] = {"FP32": FP32, "FP16Storage": FP16Storage, "NoMasterCopy": NoMasterCopy,
                                    "formats": FP8}
IMPL_RECIPES: dict[str, type[Recipe]] = {"autocast": Autocast, "paper": MasterCopy}


def recipe_class(precision: str, impl: str) -> type[Recipe]:
    kind = precisions.recipe_of(precision)  # a row without its recipe: a one-line error, not FP32
    return IMPL_RECIPES[impl] if kind == "impl" else RECIPES[kind]


def half_math_used(cfg, device) -> str:
    """What build(cfg, device).half_math will be, without building it (env.json)."""
    cls = recipe_class(cfg.precision, cfg.impl)
    return cls.half_math_for(getattr(cfg, "half_math", "auto"), _dtype(cfg.precision), torch.device(device))


def build(cfg, device) -> Recipe:
    """The recipe named by cfg.precision / cfg.impl / cfg.loss_scale (validated by check())."""
    check(cfg)
    device = torch.device(device)
    if _dtype(cfg.precision) == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError(f"precision={cfg.precision} needs a GPU with BF16 (Ampere or newer); "
                        f"{torch.cuda.get_device_name(device)} has none: use precision=mixed")
    return recipe_class(cfg.precision, cfg.impl).from_config(cfg, device)
