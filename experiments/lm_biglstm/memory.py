"""Does the full bigLSTM train on the paper's 4 GPUs? Measure small models, extrapolate to full size.

    python -m experiments.lm_biglstm.memory [--out FILE.json] [--gpu-gb 80] [--per-gpu-batch 256]

Two parts of training memory, measured on the CPU with one real training step through the engine's
own optimizer and precision recipes (mpt.optim.build_optimizer, mpt.precision):

1. Per-parameter state: weights, gradients (dense), Adagrad's accumulator, and for impl=paper the FP32
   master weights and their gradients. Counted from the tensors after a step, as bytes per parameter,
   separately for the softmax layer (FP32 in every recipe, as in the reference: models/lm.py) and the
   rest; these do not depend on the model's size (checked at several widths), so the full model needs
   bytes/param x parameters of each part (812,514,304 + 793,471 softmax, 963,640,320 the rest).
   DistributedDataParallel adds one more gradient-sized buffer (its all-reduce buckets;
   gradient_as_bucket_view=False, the engine's setting), and torch's foreach
   Adagrad allocates two FP32 temporaries (sqrt of the accumulator, lr x gradient) for one param group
   at a time -- at most 8 bytes x the largest group, the softmax table; both counted analytically.
2. Activations: the bytes autograd saves for backward (mpt.memory.SavedTensorBytes), measured at a
   dozen small shapes and fitted by least squares (largest relative residual printed) to counts per token and
   layer of the cell size H, the projection P, the embedding E, the samples K, plus K x P and
   per-weight terms; then evaluated at the paper's shape (256 sequences of 20 tokens per GPU). The
   CPU runs PyTorch's reference LSTM; cuDNN keeps a reserve space of the same order (gates and cell
   states of every step), so we add a 50% margin to the activation estimate.

Printed: per recipe, the measured bytes/param, the fitted activation bytes, and the full-size
per-GPU total (state + DDP buckets + optimizer-step temporaries + 1.5 x activations) against the
card (80 GB). Results are written as JSON with --out.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from experiments.lm_biglstm.task import Task, TaskCfg
from models.lm import FULL, BigLSTM, parameter_count
from mpt import precision
from mpt.config import Config, OptimCfg
from mpt.errors import cli
from mpt.memory import SavedTensorBytes
from mpt.optim import build_optimizer
from mpt.step import Observer, TrainStep

RECIPES = [("fp32", "autocast", "auto"), ("mixed", "paper", "128"), ("mixed", "autocast", "128"),
           ("fp16", "paper", "auto"), ("bf16", "autocast", "auto")]
# Small shapes (B, T, V, E, H, P, K, layers): each dimension varied on its own, so the fit is determined.
SHAPES = [
    (4, 5, 300, 16, 64, 16, 32, 2), (8, 5, 300, 16, 64, 16, 32, 2), (4, 10, 300, 16, 64, 16, 32, 2),
    (4, 5, 600, 16, 64, 16, 32, 2), (4, 5, 300, 32, 64, 16, 32, 2), (4, 5, 300, 16, 128, 16, 32, 2),
    (4, 5, 300, 16, 64, 32, 32, 2), (4, 5, 300, 16, 64, 16, 64, 2), (4, 5, 300, 16, 64, 16, 32, 1),
    (6, 7, 400, 24, 96, 24, 48, 2), (3, 6, 500, 20, 80, 12, 40, 1), (5, 4, 350, 28, 112, 20, 56, 2),
    (7, 3, 450, 12, 48, 28, 24, 1), (2, 9, 320, 36, 72, 8, 16, 2),
]
FEATURES = ["tokens*layers*H", "tokens*layers*P", "tokens*E", "tokens*K", "K*P", "tokens", "K",
            "weights(LSTM)", "1"]


def features(B, T, V, E, H, P, K, L) -> list[float]:
    n = B * T
    lstm_weights = parameter_count(0, E, H, P, L)  # vocab 0: the LSTM layers only
    return [n * L * H, n * L * P, n * E, n * K, K * P, n, K, lstm_weights, 1]


def _bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def measure(prec: str, impl: str, scale: str, shape) -> dict:
    """One training step of a small bigLSTM: per-parameter state and saved activation bytes."""
    B, T, V, E, H, P, K, L = shape
    torch.manual_seed(0)
    model = BigLSTM(V, E, H, P, L, num_sampled=K, dropout=0.1)
    # half_math=native: PyTorch's FP16 LSTM saves FP16 gate activations, as a GPU's FP16 layer does; the
    # CPU's emulated FP16 math runs the layer in FP32 and saves FP32 ones (mpt.half_math.HalfMath).
    cfg = Config(precision=prec, impl=impl, loss_scale=scale, task=TaskCfg(), half_math="native",
                 optim=OptimCfg(name="adagrad", lr=0.2, initial_accumulator_value=1.0))
    opt = build_optimizer(cfg.optim, Task(cfg, Task.Facts(vocab_size=V)).param_groups(model))  # the experiment's groups
    recipe = precision.build(cfg, "cpu")
    model = recipe.prepare(model, [opt])
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    # The optimizer's tensor for each parameter (params_of and model.parameters() follow the same
    # param-group order): a separate FP32 master where the recipe keeps one, else the parameter itself.
    held = recipe.params_of(opt)
    softmax = {id(p) for p in model.softmax.parameters()}
    assert [p.shape for p in params] == [h.shape for h in held]

    def loss(batch):  # the reference's loss: the window's summed NLL per sequence (task.py)
        nll, _ = model(*batch)
        return nll.sum() / mask.sum() * T, B * T

    def part(which: str) -> dict:
        pairs = [(p, h) for p, h in zip(params, held) if (id(p) in softmax) == (which == "softmax")]
        n = sum(p.numel() for p, _ in pairs)
        masters = [h for p, h in pairs if h is not p]
        state = [t for _, h in pairs for t in opt.state[h].values() if isinstance(t, torch.Tensor) and t.dim() > 0]
        return {"params": n, "weights": _bytes(p for p, _ in pairs) / n, "grads": _bytes(p.grad for p, _ in pairs) / n,
                "master": _bytes(masters) / n, "master_grads": _bytes(m.grad for m in masters) / n,
                "optimizer": _bytes(state) / n}

    class State(Observer):  # the state after the update, before zero_grad frees the gradients
        def after_update(self, step, name, opt, applied):
            parts = {"softmax": part("softmax"), "rest": part("rest")}
            total = {k: sum(parts[g][k] * parts[g]["params"] for g in parts) / n_params
                     for k in ("weights", "grads", "master", "master_grads", "optimizer")}
            self.out = {"params": n_params, **total, "parts": parts,
                        "grad_dtype_bytes": next(p.grad for p in params if p.grad is not None).element_size()}

    state, meter = State(), SavedTensorBytes(model)
    # The engine's iteration (mpt.step.TrainStep): forward, backward, update, scale update, zero_grad.
    TrainStep(lambda m, batch: loss(batch), model, {"main": opt}, recipe, device=x.device,
              observers=(state,))([(x, y, mask)], meter=meter)
    out = state.out
    return {**out, "activations": meter.bytes}


def analyse(per_gpu_batch: int = 256, gpu_gb: float = 80.0, shapes=SHAPES, log=print) -> dict:
    full_params = parameter_count(FULL["vocab_size"], FULL["emb_size"], FULL["hidden_size"], FULL["proj_size"],
                                  FULL["num_layers"])
    full_shape = (per_gpu_batch, 20, FULL["vocab_size"], FULL["emb_size"], FULL["hidden_size"], FULL["proj_size"],
                  FULL["num_sampled"], FULL["num_layers"])
    out = {"full_params": full_params, "per_gpu_batch": per_gpu_batch, "num_steps": 20, "gpu_gb": gpu_gb,
           "recipes": {}}
    log(f"bigLSTM: {full_params:,} parameters; per GPU: {per_gpu_batch} sequences x 20 tokens "
        f"(the paper's batch 1024 over 4 GPUs)")
    largest_group = FULL["vocab_size"] * (FULL["proj_size"] + 1)  # softmax weight + bias
    full_parts = {"softmax": largest_group, "rest": full_params - largest_group}
    step_b = 8 * largest_group
    log(f"{'recipe':<22}{'B/param':>9}{'rest (w+g+opt+m+mg)':>21}{'softmax':>15}{'state GB':>10}{'DDP GB':>8}"
        f"{'step GB':>9}{'act GB':>8}{'total GB':>10}  fits {gpu_gb:g} GB?")
    keys = ("weights", "grads", "optimizer", "master", "master_grads")
    for prec, impl, scale in RECIPES:
        rows = [measure(prec, impl, scale, s) for s in shapes]
        # Per-parameter state of each part must not depend on the shape: the same bytes/param at every size.
        per = {g: {k: [r["parts"][g][k] for r in rows] for k in keys} for g in full_parts}
        spread = max(max(v) - min(v) for g in per for v in per[g].values())
        bpp_parts = {g: {k: float(np.mean(v)) for k, v in per[g].items()} for g in per}
        bpp = {k: sum(bpp_parts[g][k] * full_parts[g] for g in full_parts) / full_params for k in keys}
        X = np.array([features(*s) for s in shapes], dtype=np.float64)
        yv = np.array([r["activations"] for r in rows], dtype=np.float64)
        coef, *_ = np.linalg.lstsq(X, yv, rcond=None)
        resid = float(np.max(np.abs(X @ coef - yv) / yv))
        act = float(np.dot(coef, features(*full_shape)))
        state_b = sum(bpp.values()) * full_params
        ddp_b = bpp["grads"] * full_params  # DDP's buckets: one more copy of the model's gradients
        total = state_b + ddp_b + step_b + 1.5 * act
        name = f"{prec}/{impl}" + (f" S={scale}" if prec == "mixed" else "")
        fits = total < gpu_gb * 1e9
        out["recipes"][name] = {
            "bytes_per_param": bpp, "bytes_per_param_total": sum(bpp.values()), "bytes_per_param_spread": spread,
            "bytes_per_param_parts": bpp_parts,
            "state_gb": state_b / 1e9, "ddp_buckets_gb": ddp_b / 1e9, "optimizer_step_gb": step_b / 1e9,
            "activations_gb": act / 1e9,
            "activation_fit": dict(zip(FEATURES, map(float, coef))), "activation_fit_max_rel_residual": resid,
            "total_gb_with_margin": total / 1e9, "fits": fits,
        }
        rest, soft = ("+".join(f"{bpp_parts[g][k]:g}" for k in keys) for g in ("rest", "softmax"))
        log(f"{name:<22}{sum(bpp.values()):>9.3g}{rest:>21}{soft:>15}{state_b / 1e9:>10.1f}{ddp_b / 1e9:>8.1f}"
            f"{step_b / 1e9:>9.1f}"
            f"{act / 1e9:>8.1f}"
            f"{total / 1e9:>10.1f}  {'yes' if fits else 'NO'}"
            + (f"  (fit residual {resid:.1%})" if resid > 1e-3 else ""))
    return out


@cli
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.lm_biglstm.memory",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the results here as JSON")
    p.add_argument("--gpu-gb", type=float, default=80.0)
    p.add_argument("--per-gpu-batch", type=int, default=256)
    a = p.parse_args(argv)
    torch.set_num_threads(min(4, torch.get_num_threads()))
    res = analyse(a.per_gpu_batch, a.gpu_gb)
    if a.out:
        from mpt.rundir import atomic_write_json

        atomic_write_json(a.out, res)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
