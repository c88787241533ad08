"""mpt.cpu_gru: torch.gru's training case computed with a hand-run time loop, against torch.gru itself."""
import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mpt import cpu_gru
from mpt.half_math import HalfMath


def _hand_loop_in(out: torch.Tensor) -> bool:
    """Whether the hand loop's backward is in out's graph."""
    chain, seen = [out.grad_fn], set()
    while chain:
        f = chain.pop()
        if f is not None and f not in seen:
            seen.add(f)
            chain += [n for n, _ in f.next_functions]
    return any("_GRULayer" in type(f).__name__ for f in seen)


def _run(gru: nn.GRU, x, h0, mode: bool):
    """(output, h_n, gradients of a fixed function of both w.r.t. x, h0 and every weight)."""
    leaves = [x, h0, *gru.parameters()]
    for t in leaves:
        t.grad = None
    with cpu_gru.CPUGRU() if mode else contextlib.nullcontext():
        out, hn = gru(x, h0)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    ((out * w).sum() + (hn.float() ** 2).sum()).backward()
    return out.detach(), hn.detach(), [t.grad.clone() for t in leaves]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("layers", [1, 2])
def test_float64_equals_torch_gru(batch_first, layers):
    torch.manual_seed(0)
    g = nn.GRU(5, 7, num_layers=layers, batch_first=batch_first).double()
    shape = (3, 9, 5) if batch_first else (9, 3, 5)
    x = torch.randn(shape, dtype=torch.double, requires_grad=True)
    h0 = torch.randn(layers, 3, 7, dtype=torch.double, requires_grad=True)
    ref, got = _run(g, x, h0, mode=False), _run(g, x, h0, mode=True)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-12, atol=1e-12)
    for a, b in zip(got[2], ref[2]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    torch.manual_seed(1)
    args = [torch.randn(6, 2, 3, dtype=torch.double, requires_grad=True),
            torch.randn(2, 4, dtype=torch.double, requires_grad=True),
            torch.randn(12, 3, dtype=torch.double, requires_grad=True),
            torch.randn(12, 4, dtype=torch.double, requires_grad=True),
            torch.randn(12, dtype=torch.double, requires_grad=True),
            torch.randn(12, dtype=torch.double, requires_grad=True)]
    assert torch.autograd.gradcheck(cpu_gru._GRULayer.apply, args)


def test_float32_close_to_torch_gru_and_runs_the_hand_loop():
    torch.manual_seed(2)
    g = nn.GRU(16, 24, batch_first=True)
    x = torch.randn(4, 30, 16, requires_grad=True)
    h0 = torch.zeros(1, 4, 24, requires_grad=True)
    with cpu_gru.CPUGRU():
        out, _ = g(x, h0)
    assert _hand_loop_in(out)
    ref, got = _run(g, x, h0, mode=False), _run(g, x, h0, mode=True)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(got[2], ref[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_other_cases_are_torch_gru_bit_for_bit():
    """Evaluation (no grad), packed sequences, bidirectional: torch.gru itself, the same bits."""
    torch.manual_seed(3)
    x = torch.randn(3, 8, 5)
    plain = nn.GRU(5, 6, batch_first=True)
    packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([8, 5, 2]), batch_first=True)
    cases = [(plain, lambda g: g(x)[0], True),
             (nn.GRU(5, 6, batch_first=True, bidirectional=True), lambda g: g(x)[0], False),
             (plain, lambda g: g(packed)[0].data, False)]
    for g, f, no_grad in cases:
        with torch.no_grad() if no_grad else torch.enable_grad():
            ref = f(g)
            with cpu_gru.CPUGRU():
                got = f(g)
        assert got.requires_grad != no_grad and not (got.requires_grad and _hand_loop_in(got))
        assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_tensors_run_the_hand_loop_in_their_dtype(dtype):
    """half_math=native: PyTorch's CPU kernels in FP16/BF16, op by op, here as in torch.gru's own loop."""
    torch.manual_seed(6)
    g = nn.GRU(8, 10, batch_first=True).to(dtype)
    x = torch.randn(2, 12, 8, dtype=dtype, requires_grad=True)
    h0 = torch.zeros(1, 2, 10, dtype=dtype, requires_grad=True)
    ref, got = _run(g, x, h0, mode=False), _run(g, x, h0, mode=True)
    with cpu_gru.CPUGRU():
        assert _hand_loop_in(g(x, h0)[0])
    tol = 1e-2 if dtype == torch.float16 else 5e-2
    torch.testing.assert_close(got[0], ref[0], rtol=tol, atol=tol)
    for a, b in zip(got[2], ref[2]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())


def test_in_place_change_of_the_output_is_allowed():
    g = nn.GRU(4, 5, batch_first=True)
    x = torch.randn(2, 6, 4, requires_grad=True)
    with cpu_gru.CPUGRU():
        out, _ = g(x)
    F.relu(out, inplace=True).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_beneath_half_math_it_computes_the_fp32_gru():
    """A recipe's mode sees torch.gru first and calls it on FP32 copies: that call is the hand loop's, with
    HalfMath's FP16 rounding of the result as before."""
    torch.manual_seed(4)
    g = nn.GRU(8, 10, batch_first=True).half()
    x = torch.randn(2, 12, 8, dtype=torch.half, requires_grad=True)
    with HalfMath(torch.float16):
        ref = g(x)[0]
    with cpu_gru.CPUGRU(), HalfMath(torch.float16):
        got = g(x)[0]
    assert got.dtype == torch.float16
    assert _hand_loop_in(got)
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)


def test_mode_only_for_a_gru_model_on_a_cpu():
    assert isinstance(cpu_gru.mode_for(nn.Sequential(nn.Linear(2, 2), nn.GRU(2, 2)), "cpu"), cpu_gru.CPUGRU)
    assert cpu_gru.mode_for(nn.Linear(2, 2), "cpu") is None
    assert cpu_gru.mode_for(nn.GRU(2, 2), "cuda") is None


def test_train_step_runs_a_gru_model_through_it():
    from mpt import precision
    from mpt.config import Config
    from mpt.step import TrainStep

    torch.manual_seed(5)
    model = nn.GRU(3, 4, batch_first=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recipe = precision.build(Config(), torch.device("cpu"))
    model = recipe.prepare(model, [opt])
    seen = []

    def loss(m, b):
        out = m(b)[0]
        seen.append(_hand_loop_in(out))
        return out.pow(2).mean(), b.shape[0]

    step = TrainStep(loss, model, {"main": opt}, recipe)
    step([torch.randn(2, 5, 3)])
    assert seen == [True]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-3)])
def test_a_deepspeech2_step_as_torch_gru_computes_it(dtype, tol):
    """The tiny Mandarin model (three GRU layers of 141 units between convolutions, batch norms and CTC), one
    random batch of 8 x 190 frames: every parameter's gradient as torch.gru gives it, to the rounding of a
    reordered sum (measured: 8e-15 in float64, 3e-5 in float32, relative to the gradient's norm)."""
    from models.deepspeech2 import mandarin

    torch.manual_seed(0)
    m = mandarin(vocab=60, width=0.04, n_freq=81).to(dtype)
    x = torch.randn(8, 81, 190, dtype=dtype)
    lens = torch.randint(100, 191, (8,))
    lens[0] = 190
    tgt, tl = torch.randint(1, 60, (8, 12)), torch.full((8,), 12)

    def grads(mode):
        m.zero_grad()
        with cpu_gru.CPUGRU() if mode else contextlib.nullcontext():
            logits, out_lens = m(x, lens)
        F.ctc_loss(logits.log_softmax(-1).transpose(0, 1), tgt, out_lens, tl).backward()
        return {k: p.grad.clone() for k, p in m.named_parameters()}

    ref, got = grads(False), grads(True)
    worst = max(((ref[k] - got[k]).norm() / ref[k].norm()).item() for k in ref)
    assert 0 < worst < tol  # (0: the hand loop did not run)
