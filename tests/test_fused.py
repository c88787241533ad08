"""fmt.compile's fused quantisers (mpt.fused) give the eager chains' bits (mpt.fp8): every preset's quantiser of
every role along every axis (the weight-gradient operands along the batch axis too), stochastic rounding from the same
generator state, on zeros, -0, subnormals, values near FP32's largest, inf, NaN and normals from 1e-36 to 1e30, in
shapes that are not whole blocks. Compared as int32, a NaN matching any NaN in the same place."""
import dataclasses
import shutil

import pytest
import torch

from mpt import formats, fp8, fused

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="torch.compile's CPU backend needs a C++ compiler (g++ or c++)")


@pytest.fixture(autouse=True)
def _fused_everywhere(monkeypatch):
    """Every tensor through the fused chains: the small ones here too (mpt.fused.pays leaves small tensors, and
    short last axes with a scale along them, to eager, where eager is faster)."""
    monkeypatch.setattr(fused, "_LEAST", 0)
    monkeypatch.setattr(fused, "_SHORT", 0)


def _inputs():
    """(name, tensor, axes): special values mixed into normals at several scales; shapes cut into blocks with a
    remainder along each axis (37 channels, 70 features, 5x7 images)."""
    g = torch.Generator().manual_seed(3)
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, 1.17e-38, 3e38, -3e38, 3.4028235e38, -3.4028235e38,
                            448.0, 449.0, 6.0, 0.25, 2.0 ** -9, 2.0 ** -10, 1.0 + 2.0 ** -4, 1.0 + 2.0 ** -3])
    out = []
    for scale in (1e-36, 1e-30, 1e-6, 1.0, 1e3, 1e30):  # (1e-36: NVFP4's 1 / g / s overflows, its other path)
        out.append((f"conv {scale:g}", torch.randn(3, 37, 5, 7, generator=g) * scale, (1, 0, -1)))
        out.append((f"linear {scale:g}", torch.randn(33, 70, generator=g) * scale, (-1, 0)))
    mixed = torch.randn(40, 37, generator=g)
    mixed.view(-1)[torch.randperm(mixed.numel(), generator=g)[:len(special)]] = special
    out += [("special", mixed, (-1, 0)), ("zeros", torch.zeros(4, 48), (-1, 0)), ("-0", -torch.zeros(4, 48), (-1,)),
            ("big", mixed * 1e37, (-1, 0))]
    for bad in (float("inf"), float("-inf"), float("nan")):
        t = torch.randn(20, 64, generator=g)
        t[3, 17] = bad
        out.append((f"with {bad}", t, (-1, 0)))
    return out


def _both(run):
    """run() eager and fused: the two results."""
    fused.enable(False)
    try:
        eager = run()
        fused.enable(True)
        return eager, run()
    finally:
        fused.enable(False)


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """a and b the same bits, as int32; a NaN matches a NaN whatever its sign and payload (mpt.fused's docstring:
    torch's own kernels give a NaN's sign by its position in the loop)."""
    assert a.shape == b.shape, what
    nan = torch.isnan(a)
    diff = ((a.view(torch.int32) != b.view(torch.int32)) & ~(nan & torch.isnan(b))).nonzero()
    assert not len(diff), f"{what}: {len(diff)} values differ, first at {diff[0].tolist()}: " \
                          f"{a[tuple(diff[0])].item()!r} eager, {b[tuple(diff[0])].item()!r} fused"


@needs_compiler
# Slow, not heavy: it compiles every fused kernel (~50 s of a CPU) for an opt-in speed setting; the default suite
# keeps the per-tensor and stochastic chains below, and this one runs with `pytest -m slow`.
@pytest.mark.slow
def test_fused_quantisers_give_the_eager_bits():
    roles = ("x", "w0", "g", "wd0", "xw", "gw")
    checked = 0
    for name, recipe in formats.RECIPES.items():
        recipes = [recipe] + ([recipe.with_scaling("current")] if recipe.scaling == "delayed" else [])
        for r in recipes:
            for role in roles:
                if r.roles.get(role.rstrip("0123456789")) is None:
                    continue
                for label, t, axes in _inputs():
                    for axis in axes:
                        def run(role=role, t=t, axis=axis):
                            st = fp8.FP8State(r.scaling, recipe=r, seed=1)
                            return st.role_quantizer("layer", role, True, axis)(t.clone())
                        eager, got = _both(run)
                        _same(eager, got, f"{name} ({r.scaling}) {role} {label} axis {axis}")
                        checked += 1
                        if role in ("xw", "gw"):  # the weight-gradient operands as FP8Math._split rounds them
                            def along(role=role, t=t, axis=axis):
                                st = fp8.FP8State(r.scaling, recipe=r, seed=1)
                                q = lambda rl, ax: st.role_quantizer("layer", rl, True, ax)  # noqa: E731
                                return fp8._along_batch(q, role, r.roles[role], t.clone(), axis)
                            eager, got = _both(along)
                            _same(eager, got, f"{name} ({r.scaling}) {role} {label} along the batch, channels {axis}")
    assert checked > 500
    assert fused.on() is False  # switched back off by _both


@needs_compiler
@pytest.mark.heavy
def test_fused_per_tensor_and_stochastic_chains_give_the_eager_bits():
    """fp8_quantize at scales from tiny to FLT_MAX (E4M3, E5M2), and block_quantize's stochastic rounding of every
    block layout from the same generator state (the bits are drawn before the fused chain, as many as eager draws,
    so the generator is left where eager leaves it)."""
    for label, t, _ in _inputs():
        for fmt in ("e4m3", "e5m2"):
            for scale in (1.0, 37.5, 2.0 ** -100, 1e-38, 3.4028235e38):
                s = torch.tensor(scale)
                eager, got = _both(lambda: fp8.fp8_quantize(t, fmt, s))
                _same(eager, got, f"fp8_quantize {fmt} {label} scale {scale:g}")
    for gran in ("tensor", "row", "tile128", "block128x128", "mx32", "nvfp4_16", "block16x16"):
        for elem, rounding in (("e4m3", {"nvfp4_16": "e4m3", "block16x16": "e4m3", "mx32": "rceil"}.get(gran, "pow2")),
                               ("e2m1", "e4m3")):
            if (rounding == "e4m3") != (elem == "e2m1") or (elem == "e2m1" and gran not in ("nvfp4_16", "block16x16")):
                continue
            f = formats.TensorFormat(elem, gran, rounding, "stochastic")
            for label, t, axes in _inputs():
                for axis in axes:
                    def run(f=f, t=t, axis=axis):
                        gen = torch.Generator().manual_seed(5)
                        q = fp8.block_quantize(t, f, axis, gen)
                        return q, torch.randint(0, 2 ** 30, (4,), generator=gen)  # where the generator was left
                    (eager, after_e), (got, after_f) = _both(run)
                    _same(eager, got, f"stochastic {gran} {label} axis {axis}")
                    assert torch.equal(after_e, after_f), f"stochastic {gran}: the generator is left elsewhere"
    for hadamard in (False, True):
        f = dataclasses.replace(formats.RECIPES["nvfp4"].g, hadamard=hadamard)
        t = torch.randn(48, 70) * 1e3
        eager, got = _both(lambda: fp8.block_quantize(t, f, -1, torch.Generator().manual_seed(9)))
        _same(eager, got, f"nvfp4 g hadamard={hadamard}")


def test_without_a_compiler_the_quantisers_run_eager_and_say_so_once(monkeypatch, capsys):
    """A failed compilation (no C++ compiler) is one line on stderr, then the eager chain: the same bits, no crash,
    and the fused path off for the rest of the process."""
    def no_compiler(kind):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")
    monkeypatch.setattr(fused, "_compiled", no_compiler)
    monkeypatch.setitem(fused._STATE, "failed", False)
    t, s = torch.randn(64, 40), torch.tensor(3.0)
    f = formats.RECIPES["nvfp4"].g
    eager = (fp8.fp8_quantize(t, "e4m3", s), fp8.block_quantize(t, f, -1, torch.Generator().manual_seed(2)))
    fused.enable(True)
    try:
        got = (fp8.fp8_quantize(t, "e4m3", s), fp8.block_quantize(t, f, -1, torch.Generator().manual_seed(2)))
        assert not fused.on()
    finally:
        fused.enable(False)
    for a, b in zip(eager, got):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fmt.compile: torch.compile failed (RuntimeError: InvalidCxxCompiler")


def test_fmt_compile_is_a_speed_setting_not_part_of_the_recipe_nor_the_run():
    """fmt.compile=true changes neither the recipe a precision trains with, nor --print-config's recipe lines,
    nor the run's id; on a precision without simulated formats it is no error."""
    from mpt import config as C
    from mpt import identity, precisions

    base = ["profile=tiny", "task.data_root=/nonexistent", "precision=nvfp4"]
    off, on = C.resolve("ilsvrc_cnns", base), C.resolve("ilsvrc_cnns", [*base, "fmt.compile=true"])
    assert on.fmt.compile and not off.fmt.compile
    assert precisions.format_recipe(on) == precisions.format_recipe(off)
    assert precisions.format_lines(on) == precisions.format_lines(off)
    assert identity.run_dir(on) == identity.run_dir(off)
    C.resolve("ilsvrc_cnns", ["profile=tiny", "task.data_root=/nonexistent", "precision=fp32", "fmt.compile=true"])


@needs_compiler
@pytest.mark.slow  # (compiles the kernel for each rank and pair of axes: ~40 s)
def test_a_tensor_rounded_two_ways_at_once_gets_each_ways_bits_and_layout():
    """fp8_rowwise rounds each input and output gradient along its channels and along its batch, and each weight for
    the forward and for the data gradient; with fmt.compile the two come from one kernel (mpt.fp8._two_ways): each the
    bits and the layout of its rounding on its own (block_quantize; _along_batch's channel-innermost layout), on
    zeros, subnormals, inf, NaN and values near FP32's largest."""
    f = formats.RECIPES["fp8_rowwise"].x
    for label, t, _ in _inputs():
        for ch in (1, t.dim() - 1) if t.dim() > 2 else (1,):
            rest = tuple(d for d in range(t.dim()) if d != ch)
            fused.enable(False)
            rows = fp8.block_quantize(t, f, ch)
            batch = fp8._along_batch(lambda role, axis: lambda u: fp8.block_quantize(u, f, axis), "xw", f, t, ch)
            w, wd = fp8.block_quantize(t, f, 1), fp8.block_quantize(t, f, 0)
            fused.enable(True)
            try:
                got = fp8._two_ways(f, f, t, (ch,), rest, ch)
                got_w = fp8._two_ways(f, f, t, (1,), (0,))
            finally:
                fused.enable(False)
            for want, have, what in ((rows, got[0], "rows"), (batch, got[1], "batch"), (w, got_w[0], "w"),
                                     (wd, got_w[1], "wd")):
                _same(want, have, f"{label} channels {ch}: {what}")
                assert want.stride() == have.stride(), f"{label} channels {ch}: {what} laid out otherwise"
    assert fp8._two_ways(f, formats.RECIPES["fp8_rowwise_gw_hp"].w_dgrad, t, (0,), (1,)) is None  # not two rows


@needs_compiler
@pytest.mark.heavy
def test_a_layer_rounding_its_tensors_two_ways_at_once_gets_the_eager_gradients(monkeypatch):
    """fp8_rowwise through FP8Math with fmt.compile: each tensor rounded two ways (mpt.fp8._two_ways) in one kernel
    where it can -- a convolution's and a linear layer's input and weight, the linear layer's output gradient (the
    first layer's is not rounded for a data gradient nobody needs) -- and the gradients eager's, bit for bit."""
    calls = []
    real = fp8._two_ways
    monkeypatch.setattr(fp8, "_two_ways", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(8 * 6 * 6, 5))
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    grads = []
    for on in (False, True):
        st = fp8.FP8State("current", recipe=formats.RECIPES["fp8_rowwise"])
        st.register(net, "fp8")
        net.zero_grad()
        fused.enable(on)
        try:
            with fp8.FP8Math(st):
                out = net(x)
            out.square().sum().backward()
        finally:
            fused.enable(False)
        grads.append([p.grad.clone() for p in net.parameters()])
    for a, b in zip(*grads):
        _same(a, b, "a layer's gradient")
    assert sum(c is not None for c in calls) == 5
