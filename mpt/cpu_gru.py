"""A GRU for training on a CPU: the same function as torch.gru, its time loop run by hand in both directions.

Why: PyTorch's CPU GRU runs each time step as a handful of ATen operations (a matrix product, sigmoids, tanh,
products, sums) and autograd records every one of them, so its backward walks ~15 graph nodes per step and
layer -- DeepSpeech 2's tiny profiles spent about two thirds of a training step in their GRUs. One layer of the
tiny Mandarin profile (84 inputs, 141 units, batch 8, 125 steps), forward and backward on one core of a 2-core
AMD EPYC: torch.gru 20.7 ms, this 13.9 ms; at English's batch of 32 both are bound by the same matrix products
(53.2 and 50.2 ms): `python -m experiments.speed_memory.cpu_gru`. cuDNN's GRU, on a GPU, is one kernel and is
not touched.

How: the forward keeps what the backward needs (the gates r, z, n, the recurrent product W_hh h + b_hh and the
hidden states), one output buffer each, written step by step. The backward then needs no autograd graph: from
those it forms, for every step at once, the factors K_t that carry dh_t into the recurrent product's gradient,
so the only sequential work left is dh_{t-1} = g_{t-1} + dh_t z_t + (dh_t K_t) W_hh (one small product per
step); each weight gradient is then one large matrix product over all steps instead of one small one per step.
Mathematically torch.gru's gradient, so only the order of floating-point sums differs (float64: equal to
~1e-12; float32: to within the rounding an order change makes; tests/test_cpu_gru.py).

Where: CPUGRU, a torch function mode that TrainStep enters around each iteration of a model that holds an
nn.GRU on a CPU, beneath the precision recipe's own modes (mpt.half_math, mpt.fp8). A recipe sees torch.gru
as before, quantises or casts its operands as before, and its final call of torch.gru lands here, so the
same kernel runs under every precision. The hand loop runs only where it is torch.gru's training case with
nothing else to honour: a grad-enabled call, tensors of one floating dtype on the CPU (FP16 and BF16 too, where
half_math=native runs PyTorch's own CPU kernels in them: op by op here as in torch.gru's loop), a padded (not
packed) batch, biases, one direction, no dropout between layers, autocast off. Anything else (evaluation
under no_grad included, where PyTorch's loop records nothing) goes to torch.gru.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode


class _GRULayer(torch.autograd.Function):
    """One unidirectional GRU layer, time-major: x (T, B, I), h0 (B, H) -> (hs (T, B, H), h_T (B, H)).
    PyTorch's gate order and equations (nn.GRU): r, z, n; n = tanh(W_in x + b_in + r * (W_hn h + b_hn))."""

    @staticmethod
    def forward(ctx, x, h0, w_ih, w_hh, b_ih, b_hh):
        T, B, _ = x.shape
        H = w_hh.shape[1]
        x2 = x.reshape(T * B, -1)  # steps by batch rows (a copy for a batch-first input: kept for the backward)
        # The input's part of every gate for all steps at once: one large product.
        gi = torch.addmm(b_ih, x2, w_ih.t()).view(T, B, 3 * H)
        gh = x.new_empty(T, B, 3 * H)  # W_hh h_{t-1} + b_hh, every step
        rz = x.new_empty(T, B, 2 * H)  # the reset and update gates
        n = x.new_empty(T, B, H)  # the candidate state
        hs = x.new_empty(T, B, H)  # the hidden states: the layer's output
        # Per-step views made once (an index per step costs more than the step's small operations).
        gi_rz, gi_n = gi[..., :2 * H].unbind(0), gi[..., 2 * H:].unbind(0)
        gh_t, gh_rz, gh_n = gh.unbind(0), gh[..., :2 * H].unbind(0), gh[..., 2 * H:].unbind(0)
        rz_t, r_t, z_t = rz.unbind(0), rz[..., :H].unbind(0), rz[..., H:].unbind(0)
        n_t, hs_t = n.unbind(0), hs.unbind(0)
        w_hh_t = w_hh.t()
        h = h0
        for t in range(T):
            torch.addmm(b_hh, h, w_hh_t, out=gh_t[t])
            torch.add(gi_rz[t], gh_rz[t], out=rz_t[t]).sigmoid_()
            torch.addcmul(gi_n[t], r_t[t], gh_n[t], out=n_t[t]).tanh_()
            h = torch.lerp(n_t[t], h, z_t[t], out=hs_t[t])  # (1 - z) n + z h
        ctx.save_for_backward(x2, h0, w_ih, w_hh, rz, n, gh, hs)
        ctx.x_shape = x.shape
        # Copies out, so that the caller may change them in place (as it may torch.gru's outputs).
        return hs.clone(), h.clone()

    @staticmethod
    def backward(ctx, g_out, g_last):
        x2, h0, w_ih, w_hh, rz, n, gh, hs = ctx.saved_tensors
        T, B, H = hs.shape
        need_x, need_h0, need_wih, need_whh, need_bih, need_bhh = ctx.needs_input_grad
        r, z = rz[..., :H], rz[..., H:]
        # dh_t -> the gradient of the recurrent product W_hh h_{t-1} + b_hh, for every step at once, as factors
        # k (T, B, 3, H) of dh_t:  r's: a (W_hn h + b_hn) r (1 - r);  z's: (h_{t-1} - n) z (1 - z);  n's: a r,
        # with a = (1 - z)(1 - n^2) (n's pre-activation; r multiplies the recurrent product's n part only).
        # Written into k's slices with one pass each where torch has the fused operation.
        k = hs.new_empty(T, B, 3, H)
        k_r, k_z, k_n = k.unbind(2)
        a = torch.addcmul(torch.ones((), dtype=n.dtype), n, n, value=-1).mul_(torch.rsub(z, 1))
        torch.addcmul(r, r, r, value=-1, out=k_r).mul_(a).mul_(gh[..., 2 * H:])
        torch.addcmul(z, z, z, value=-1, out=k_z)
        k_z[0].mul_(h0 - n[0])
        k_z[1:].mul_(hs[:-1] - n[1:])
        torch.mul(a, r, out=k_n)
        dh_all = torch.empty_like(hs)
        dgh = hs.new_empty(T, B, 3, H)
        carry = g_last if g_last is not None else torch.zeros_like(h0)
        if g_out is None:
            g_out = torch.zeros_like(hs)
        dh_t, dgh_t, k_t, z_t, g_t = dh_all.unbind(0), dgh.unbind(0), k.unbind(0), z.unbind(0), g_out.unbind(0)
        for t in range(T - 1, -1, -1):
            dh = torch.add(g_t[t], carry, out=dh_t[t])
            d = torch.mul(dh.unsqueeze(1), k_t[t], out=dgh_t[t])
            carry = torch.addmm(dh * z_t[t], d.view(B, 3 * H), w_hh)
        dgh = dgh.view(T * B, 3 * H)
        # The input's part: the recurrent one's r and z parts, and n's own (dh a: r does not multiply it).
        dgi_rz, dgi_n = dgh[:, :2 * H], dh_all.mul_(a).view(T * B, H)
        gx = gw_ih = gw_hh = None
        if need_x:
            gx = torch.mm(dgi_rz, w_ih[:2 * H]).addmm_(dgi_n, w_ih[2 * H:]).view(ctx.x_shape)
        if need_wih:
            gw_ih = w_ih.new_empty(w_ih.shape)
            torch.mm(dgi_rz.t(), x2, out=gw_ih[:2 * H])
            torch.mm(dgi_n.t(), x2, out=gw_ih[2 * H:])
        if need_whh:  # h_{t-1}: h0 for the first step, the layer's own output after it
            gw_hh = torch.mm(dgh[B:].t(), hs[:-1].reshape((T - 1) * B, H)).addmm_(dgh[:B].t(), h0)
        gb_ih = torch.cat([dgi_rz.sum(0), dgi_n.sum(0)]) if need_bih else None
        return gx, carry if need_h0 else None, gw_ih, gw_hh, gb_ih, dgh.sum(0) if need_bhh else None


def _takes(args, kwargs) -> bool:
    """Whether torch.gru(*args, **kwargs) is the case the hand loop computes (module docstring)."""
    if kwargs or len(args) != 9 or not isinstance(args[2], (list, tuple)):
        return False  # keywords, or the packed-sequence overload (data, batch_sizes, hx, params, ...)
    x, hx, params, has_biases, layers, dropout, train, bidirectional, _ = args
    if not (torch.is_grad_enabled() and has_biases and not bidirectional and (dropout == 0 or not train or layers == 1)):
        return False
    if not (isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[0] > 0 and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16) and len(params) == 4 * layers):
        return False
    if torch.is_autocast_enabled("cpu"):
        return False
    tensors = [x, hx, *params]
    return (all(isinstance(t, torch.Tensor) and t.dtype == x.dtype and t.device.type == "cpu" for t in tensors)
            and any(t.requires_grad for t in tensors))


def gru(x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """torch.gru's (input, hx, params, ...) overload, computed by _GRULayer layer by layer: (output, h_n)."""
    out = x.transpose(0, 1) if batch_first else x
    last = []
    for layer in range(num_layers):
        w_ih, w_hh, b_ih, b_hh = params[4 * layer: 4 * layer + 4]
        out, h = _GRULayer.apply(out, hx[layer], w_ih, w_hh, b_ih, b_hh)
        last.append(h)
    return (out.transpose(0, 1) if batch_first else out), torch.stack(last)


class CPUGRU(TorchFunctionMode):
    """torch.gru computed by `gru` where it is the training case that loop takes (_takes); torch.gru itself
    elsewhere. Enter it beneath any other mode (first), so that theirs see torch.gru (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.gru and _takes(args, kwargs):
            return gru(*args)
        return func(*args, **kwargs)


def mode_for(model: nn.Module, device) -> CPUGRU | None:
    """The CPUGRU mode for training `model` on `device`: one where the device is a CPU and the model holds an
    nn.GRU; None elsewhere (a mode sees every torch call of the step: no cost where it cannot help)."""
    if torch.device(device).type != "cpu" or not any(isinstance(m, nn.GRU) for m in model.modules()):
        return None
    return CPUGRU()
