"""A format recipe's fields as config keys (fmt.*), the 2-D 16x16 block granularity of NVFP4's weights, and the
NVFP4 paper's recipe (nvfp4_paper: the last layers kept in BF16, BF16 for the last steps)."""
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mpt import cli, formats, precision, precisions
from mpt import config as C
from mpt import identity
from mpt.config import Config, FP8Cfg, FmtCfg
from mpt.errors import UserError
from mpt.fp8 import FP8State, block_quantize, round_to

NOWHERE = "task.data_root=/nonexistent"


def _cfg(prec, **fmt) -> Config:
    """Config(precision=prec) with fmt.<role>.<field> given as role_field=value, or fmt.<key> as key=value."""
    c = Config(precision=prec)
    for k, v in fmt.items():
        role, _, field = k.partition("__")
        if field:
            setattr(getattr(c.fmt, role), field, v)
        else:
            setattr(c.fmt, role, v)
    return c


# ------------------------------------------------------------------------------------------------
# the keys: they take effect, --print-config shows them, impossible ones are one line, ids unchanged


def test_overrides_take_effect_in_the_recipe_that_trains():
    """fmt.x.scale_rounding=floor on mxfp8: the recipe FP8State trains with has FLOOR activations and nothing
    else changed, and an activation block whose amax is just above a power of 2 times 448 is quantised
    differently (FLOOR's scale lets 480 saturate to 448; RCEIL's halves it)."""
    base = formats.RECIPES["mxfp8"]
    r = precision.build(_cfg("mxfp8", x__scale_rounding="floor"), "cpu")
    assert r.state.recipe == dataclasses.replace(base, x=formats.TensorFormat("e4m3", "mx32", "floor"))
    assert precision.build(Config(precision="mxfp8"), "cpu").state.recipe is base  # no key set: the preset

    lin = nn.Linear(32, 4, bias=False)
    nn.init.eye_(lin.weight)  # the output is the quantised input's first four features
    x = torch.full((1, 32), 1.0)
    x[0, 0] = 480.0  # floor(log2 480) = 8 = emax(E4M3): scale 1, 480 saturates to 448
    outs = []
    for c in (Config(precision="mxfp8"), _cfg("mxfp8", x__scale_rounding="floor")):
        c.fp8.ends = "fp8"
        rec = precision.build(c, "cpu")
        rec.prepare(lin, [])
        with rec.autocast():
            outs.append(lin(x)[0, 0].item())
    assert outs == [480.0, 448.0]  # RCEIL: scale 1/2, 240 is an E4M3 value; FLOOR: saturated

    # SR off and the Hadamard off on nvfp4: the switches of the study of which switches matter
    nv = precision.build(_cfg("nvfp4", g__rounding="nearest", g_wgrad__rounding="nearest",
                              x_wgrad__hadamard=False, g_wgrad__hadamard=False), "cpu").state.recipe
    assert {f.rounding for f in nv.roles.values()} == {"nearest"} and not any(f.hadamard for f in nv.roles.values())
    assert nv.w == formats.RECIPES["nvfp4"].w
    # an own operand's field starts from the preset's role: fp8_rowwise's data-gradient weight per tensor
    rw = precisions.format_recipe(_cfg("fp8_rowwise", w_dgrad__granularity="tensor"))
    assert rw.w_dgrad == formats.TensorFormat("e4m3", "tensor", "pow2")
    assert precisions.format_recipe(_cfg("fp8_rowwise", w_dgrad__element="none")).w_dgrad is None
    # wgrad other than own drops the preset's own weight-gradient operands with it
    sh = precisions.format_recipe(_cfg("nvfp4", wgrad="shared"))
    assert (sh.wgrad, sh.x_wgrad, sh.g_wgrad) == ("shared", None, None)
    # precision=fp8 with current scaling takes block-scaled roles
    c = _cfg("fp8", w__granularity="mx32", w__scale_rounding="rceil")
    c.fp8.scaling = "current"
    assert precisions.format_recipe(c).w == formats.TensorFormat("e4m3", "mx32", "rceil")


def test_print_config_shows_the_effective_fields(capsys):
    cli.cli_main("ilsvrc_cnns", ["precision=nvfp4", "profile=tiny", "fmt.g.rounding=nearest", NOWHERE,
                                 "--print-config"])
    out = capsys.readouterr().out
    assert "fmt:\n  x:\n    element: preset" in out
    assert "  g:\n    element: preset\n    granularity: preset\n    scale_rounding: preset\n    rounding: nearest" in out
    assert "# format recipe of precision=nvfp4, as it trains" in out
    assert "#   fmt.w: element=e2m1 granularity=block16x16 scale_rounding=e4m3 rounding=nearest hadamard=false" in out
    assert "#   fmt.g: element=e2m1 granularity=nvfp4_16 scale_rounding=e4m3 rounding=nearest hadamard=false" in out
    assert "#   fmt.g_wgrad: element=e2m1 granularity=nvfp4_16 scale_rounding=e4m3 rounding=stochastic " \
           "hadamard=true" in out
    assert "#   fmt.wgrad=own fmt.accumulate=fp32 fmt.keep_last=0.0 fmt.bf16_tail=0.0 scaling=current" in out
    cli.cli_main("ilsvrc_cnns", ["precision=nvfp4_paper", "profile=tiny", NOWHERE, "--print-config"])
    assert "fmt.keep_last=0.15 fmt.bf16_tail=0.18" in capsys.readouterr().out
    cli.cli_main("ilsvrc_cnns", ["precision=mixed", "profile=tiny", NOWHERE, "--print-config"])
    assert "# format recipe" not in capsys.readouterr().out  # no simulated format: nothing to show


@pytest.mark.parametrize("over, msg", [
    (["precision=mxfp8", "fmt.x.scale_rounding=exact"],
     r"^fmt\.x: MX blocks have E8M0 scales: scale_rounding floor or rceil \(precision=mxfp8 fmt\.x\.scale_rounding=exact\)$"),
    (["precision=nvfp4", "fmt.g.scale_rounding=pow2"], r"^fmt\.g: nvfp4_16 blocks have E4M3 scales .*scale_rounding e4m3"),
    (["precision=fp8_block", "fmt.x.scale_rounding=e4m3"], r"^fmt\.x: E4M3 block scales .* nvfp4_16 or block16x16"),
    (["precision=fp8", "fmt.w.granularity=mx32", "fmt.w.scale_rounding=rceil"],
     r"^fmt: delayed scaling keeps one amax history per tensor: .*; or set fp8\.scaling=current \(precision=fp8 "
     r"fmt\.w\.granularity=mx32 fmt\.w\.scale_rounding=rceil\)$"),
    (["precision=mxfp8", "fmt.x.granularity=row", "fmt.x.hadamard=true"],
     r"^fmt\.x: the random Hadamard transform is 16x16: blocks of a multiple of 16 elements .*hadamard=true\)$"),
    (["precision=mxfp8", "fmt.x.element=e3m4"], r"^fmt\.x: unknown element format 'e3m4'; choose one of: e4m3"),
    (["precision=mixed", "fmt.x.element=e4m3"], r"^fmt\.x\.element=e4m3 sets the format recipe of a simulated-format "
                                                r"precision .*; precision=mixed has none: leave fmt\.\* at preset$"),
    (["precision=nvfp4", "fmt.bf16_tail=1"], r"^fmt: bf16_tail=1.0 is a fraction: at least 0 and below 1"),
    (["precision=nvfp4", "fmt.keep_last=lots"], r"fmt\.keep_last' expects a number or preset, got 'lots'"),
    (["precision=nvfp4", "fmt.x.hadamard=maybe"], r"fmt\.x\.hadamard' expects one of preset, true, false"),
    (["precision=nvfp4", "fmt.x.blocks=16"], r"unknown config key 'fmt\.x\.blocks'"),
    (["precision=fp8_rowwise", "fmt.w_dgrad.element=none", "fmt.w_dgrad.rounding=nearest"],
     r"^fmt\.w_dgrad\.element=none drops that operand's own format; leave the other fmt\.w_dgrad\.\* keys at preset"),
])
def test_impossible_combinations_are_one_line_errors_at_resolve_time(over, msg):
    with pytest.raises(UserError, match=msg) as e:
        C.resolve("ilsvrc_cnns", ["profile=tiny", NOWHERE, *over])
    assert "\n" not in str(e.value)


def test_run_ids_are_unchanged_with_every_key_at_preset():
    """fmt.* at preset is left out of the content id (mpt.identity.added_keys): every run stored before the keys
    existed keeps its id and directory (tests/test_fp8_bf16_pure.py's KNOWN_RUN_NAMES pins real ones); a stored
    config without fmt is the same run; a key set is another run, named by config_difference."""
    for prec in ("fp32", "mixed", "fp8", "nvfp4"):
        a = Config(precision=prec)
        stored = identity.strip_infra(a)
        del stored["fmt"]  # a config.yaml written before the keys existed
        explicit = Config(precision=prec, fmt=FmtCfg())
        explicit.fmt.x.element = "preset"
        assert identity.cell_id(explicit) == identity.cell_id(a)
        assert identity.config_difference(stored, a) is None
    a, b = Config(precision="nvfp4"), _cfg("nvfp4", g__rounding="nearest")
    assert identity.cell_id(a) != identity.cell_id(b)
    assert identity.config_difference(identity.strip_infra(a), b) == "fmt.g.rounding: 'preset' stored, 'nearest' now"
    # a key set to the preset's own value is still a key set: another cell, the same recipe
    same = _cfg("nvfp4", g__rounding="stochastic")
    assert precisions.format_recipe(same) == formats.RECIPES["nvfp4"]


def test_a_variant_is_its_own_column_in_the_tables():
    from paper_tables.results import run_precision

    assert run_precision("nvfp4", {"fmt": dataclasses.asdict(FmtCfg())}) == "nvfp4"
    cfg = {"fmt": dataclasses.asdict(_cfg("nvfp4", g__rounding="nearest", keep_last=0.2).fmt)}
    assert run_precision("nvfp4", cfg) == "nvfp4 fmt.g.rounding=nearest fmt.keep_last=0.2"


# ------------------------------------------------------------------------------------------------
# 2-D 16x16 blocks (Transformer Engine's NVFP4 weights)


def test_block16x16_by_hand():
    """A 32x32 weight in four 16x16 blocks, NVFP4's two levels: tensor amax 10.5 = 6 x 448 x 2^-8, so the FP32
    tensor scale g is 2^-8; each block's E4M3 scale s = e4m3(amax / 6 / g), its elements e2m1(x / (s g)) s g.
      rows 0-15, cols 0-15: 10.5 at (0, 0), 0.3 elsewhere: s = 448; 0.3 / (448 / 256) = 0.17 -> 0 (below 0.25)
      rows 0-15, cols 16-31: 0.75, and 1.5 at (5, 20): s = e4m3(64) = 64; 0.75 -> 3 -> 0.75, 1.5 -> 6 -> 1.5
      rows 16-31, cols 0-15: 0.125, and -0.5 at (20, 3): s = e4m3(21.33) = 22; 0.125 -> 1.4545 -> 1.5 ->
        1.5 x 22 / 256 = 0.12890625, -0.5 -> -5.818 -> -6 -> -0.515625
      rows 16-31, cols 16-31: zeros -> zeros.
    In 1-D 16-element blocks (nvfp4_16) row 1's 0.3 has a block of its own: s = e4m3(12.8) = 13, 0.3 -> 5.9 -> 6
    -> 6 x 13 / 256 = 0.3046875 -- the 2-D block's shared scale is what flushes it."""
    w = torch.zeros(32, 32)
    w[:16, :16] = 0.3
    w[0, 0] = 10.5
    w[:16, 16:] = 0.75
    w[5, 20] = 1.5
    w[16:, :16] = 0.125
    w[20, 3] = -0.5
    want = torch.zeros(32, 32)
    want[0, 0] = 10.5
    want[:16, 16:] = 0.75
    want[5, 20] = 1.5
    want[16:, :16] = 0.12890625
    want[20, 3] = -0.515625
    f2 = formats.TensorFormat("e2m1", "block16x16", "e4m3")
    assert torch.equal(block_quantize(w, f2, axis=-1), want)
    one = block_quantize(w, formats.TensorFormat("e2m1", "nvfp4_16", "e4m3"), axis=-1)
    assert one[1, 1].item() == 0.3046875 and one[0, 0].item() == 10.5
    # a 2-D block is the same for the weight and its transpose (the data-gradient product's axis)
    assert torch.equal(block_quantize(w.t().contiguous(), f2, axis=-1), want.t())


def _reference_2d(t: torch.Tensor, axis: int) -> torch.Tensor:
    """NVFP4 in 16x16 blocks by loops: rows are the leading axes flattened, columns the axis, one block per
    16 x 16 of them at each trailing position (a convolution's kernel position), g from the whole tensor."""
    x = t.float()
    v = x.reshape(-1, x.shape[axis], *x.shape[axis + 1:]).flatten(2) if axis != -1 else x.reshape(-1, x.shape[-1], 1)
    g = x.abs().amax() / (6 * 448)
    out = torch.zeros_like(v)
    for r in range(0, v.shape[0], 16):
        for c in range(0, v.shape[1], 16):
            for p in range(v.shape[2]):
                b = v[r:r + 16, c:c + 16, p]
                s = round_to((b.abs().amax() / 6 / g).clamp(2.0 ** -6, 448.0), "e4m3")
                out[r:r + 16, c:c + 16, p] = round_to(b * ((1.0 / g) / s), "e2m1") * (s * g)
    return out.reshape(t.shape)


@pytest.mark.parametrize("shape, axis", [((48, 40), -1), ((32, 24, 3, 3), 1), ((20, 7), -1)])
def test_block16x16_matches_a_loop_reference(shape, axis):
    """Random weights (a linear layer's, a convolution's along its input channels, one smaller than a block
    along the axis and not a whole number of blocks down the rows): bit for bit the loops' NVFP4."""
    t = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * torch.logspace(-2, 1, shape[-1])
    got = block_quantize(t, formats.TensorFormat("e2m1", "block16x16", "e4m3"), axis=axis)
    assert torch.equal(got, _reference_2d(t, axis))


def test_nvfp4_weights_are_2d_as_transformer_engine():
    r = formats.RECIPES["nvfp4"]
    assert r.w.granularity == "block16x16" and r.x.granularity == r.g.granularity == "nvfp4_16"
    assert r.g.rounding == "stochastic" and r.x_wgrad.hadamard and r.g_wgrad.hadamard and not r.x.hadamard
    p = formats.RECIPES["nvfp4_paper"]
    assert dataclasses.replace(p, name="nvfp4", keep_last=0.0, bf16_tail=0.0) == r
    assert (p.keep_last, p.bf16_tail) == (0.15, 0.18)
    assert precisions.BY_NAME["nvfp4_paper"].cost_goal == 3.0 and "nvfp4_paper" in precisions.GROUPS["block_scaled"]


# ------------------------------------------------------------------------------------------------
# keep_last and the BF16 tail


class _Shuffled(nn.Module):
    """Layers registered a, b, c, d, e, head but called c, a, e, b, d, head, behind an embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        for n in "abcde":
            setattr(self, n, nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, i):
        h = self.emb(i)
        for n in "caebd":
            h = torch.tanh(getattr(self, n)(h))
        return self.head(h)


@pytest.mark.parametrize("keep, ends, kept", [
    (0.5, "fp8", {"b", "d", "head"}),  # 3 of the 6 weight-bearing layers (the embedding is not counted)
    (0.34, "fp8", {"d", "head"}),  # 2.04 -> 2
    (0.05, "fp8", set()),  # 0.3 -> 0
    (0.34, "bf16", {"emb", "d", "head"}),  # with fp8.ends' first (the embedding) and last layers
])
def test_keep_last_picks_the_last_layers_called(keep, ends, kept):
    model = _Shuffled()
    c = _cfg("nvfp4", keep_last=keep)
    c.fp8.ends = ends
    r = precision.build(c, "cpu")
    r.prepare(model, [])
    with r.autocast():
        model(torch.tensor([[1, 2, 3]]))
    assert r.state.ends == kept
    wide = {name for name, keep16 in r.state.sites.values() if keep16}
    assert wide == kept - {"emb"}


def test_keep_last_layers_compute_on_bf16_operands():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    x = torch.randn(4, 16)
    c = _cfg("nvfp4", keep_last=0.5)
    c.fp8.ends = "fp8"
    r = precision.build(c, "cpu")
    r.prepare(model, [])
    with r.autocast():
        y = model(x)
    h = model[0](x)
    with r.autocast():
        h_q = model[0](x)  # the first layer: NVFP4
    bf = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    assert torch.equal(y, F.linear(bf(h_q), bf(model[1].weight), model[1].bias))
    assert not torch.equal(h_q, h)


def test_bf16_tail_switches_every_product_to_bf16_from_its_step():
    """recipe.observers(total): the switch at total - round(tail x total); before it the formats, from it on
    every product on BF16 operands."""
    assert precision.build(Config(precision="nvfp4"), "cpu").observers(100) == ()
    r = precision.build(Config(precision="nvfp4_paper"), "cpu")
    (tail,) = r.observers(100)
    assert tail.switch_at == 82
    (tail,) = precision.build(_cfg("nvfp4", bf16_tail=0.5), "cpu").observers(5)
    assert tail.switch_at == 2  # 2.5 rounds up: the last 3 of 5 steps

    torch.manual_seed(0)
    lin = nn.Linear(32, 8)
    c = _cfg("nvfp4", bf16_tail=0.5)
    c.fp8.ends = "fp8"
    r = precision.build(c, "cpu")
    r.prepare(lin, [])
    (tail,) = r.observers(4)
    x = torch.randn(4, 32)
    seen = []
    for it in range(4):
        tail.begin(type("Step", (), {"iteration": it})(), [])
        with r.autocast():
            seen.append(torch.equal(lin(x), F.linear(x.bfloat16().float(), lin.weight.bfloat16().float(), lin.bias)))
    assert seen == [False, False, True, True]


def test_a_resume_on_another_recipe_is_refused():
    a = FP8State("current", recipe=formats.RECIPES["nvfp4"])
    b = FP8State("current", recipe=precisions.format_recipe(_cfg("nvfp4", g__rounding="nearest")))
    FP8State("current", recipe=formats.RECIPES["nvfp4"]).load_state_dict(a.state_dict())
    with pytest.raises(UserError, match=r"checkpoint trained with format recipe g=.*'stochastic'.* resuming would mix"):
        b.load_state_dict(a.state_dict())
    old = a.state_dict()
    del old["recipe"]  # written before the recipe was recorded: not checked
    b.load_state_dict(old)


def _toy(out, **kw):
    from toy_mlp import config

    return config(out, train={"max_steps": 6}, optim={"lr": 0.05}, **kw)


class _Record:
    """An iteration observer that notes whether the recipe's products ran on BF16 operands (FP8State.wide)."""

    def __init__(self):
        self.wide = []

    def begin(self, step, micro_batches): ...

    def before_update(self, *a): ...

    def after_update(self, *a): ...

    def end(self, step):
        self.wide.append(step.recipe.state.wide)


@pytest.mark.heavy
def test_bf16_tail_through_the_engine_and_a_resume_across_the_switch(tmp_path, monkeypatch):
    """6 steps with fmt.bf16_tail=0.5: steps 0-2 in NVFP4, 3-5 in BF16; a run stopped after step 1 and resumed
    crosses the switch and ends bit for bit where the uninterrupted one does (weights and recipe state)."""
    from conftest import run_interrupted
    from toy_gan import run_task
    from toy_mlp import ToyMLP

    from mpt import engine

    fmt = FmtCfg(bf16_tail=0.5)
    kw = dict(precision="nvfp4", fp8=FP8Cfg(ends="fp8"), fmt=fmt)
    rec = _Record()
    monkeypatch.setattr(engine.Run, "extra_observers", (rec,))
    ref = run_task(_toy(tmp_path / "ref", **kw), ToyMLP)
    assert ref["status"] == "completed"
    assert rec.wide == [False, False, False, True, True, True]
    monkeypatch.setattr(engine.Run, "extra_observers", ())
    s = run_interrupted(monkeypatch, lambda _: run_task(_toy(tmp_path / "cut", **kw), ToyMLP), None, at_step=1)
    assert s["status"] == "interrupted"
    rec2 = _Record()
    monkeypatch.setattr(engine.Run, "extra_observers", (rec2,))
    done = run_task(_toy(tmp_path / "cut", **kw), ToyMLP)
    assert done["status"] == "completed" and done["run_name"] == ref["run_name"]
    assert rec2.wide == [False, True, True, True]  # steps 2-5 after the resume
    ca, cb = (torch.load(tmp_path / d / "toy_mlp" / ref["run_name"] / "checkpoint.pt", weights_only=True)
              for d in ("ref", "cut"))
    assert ca["step"] == cb["step"] == 6
    for k in ca["model"]:
        assert torch.equal(ca["model"][k], cb["model"][k]), k
    flat = lambda sd: dict(torch.utils._pytree.tree_flatten_with_path(sd)[0])  # noqa: E731
    a, b = flat(ca["recipe"]), flat(cb["recipe"])
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k
    # the tail changed the result: the same run without it ends elsewhere
    plain = run_task(_toy(tmp_path / "plain", precision="nvfp4", fp8=FP8Cfg(ends="fp8")), ToyMLP)
    cp = torch.load(tmp_path / "plain" / "toy_mlp" / plain["run_name"] / "checkpoint.pt", weights_only=True)
    assert not all(torch.equal(ca["model"][k], cp["model"][k]) for k in ca["model"])


@pytest.mark.parametrize("prec", ["fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_block", "mxfp8", "nvfp4"])
def test_an_in_place_op_after_a_split_layer_gets_the_same_gradients(prec):
    """A layer whose backward products read operands of their own (the value pass made apart) hands its output on
    as a plain tensor: ReLU(inplace=True) right after it trains as ReLU() does, bit for bit."""
    def grads(inplace):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=inplace), nn.Flatten(),
                              nn.Linear(16 * 8 * 8, 32), nn.ReLU(inplace=inplace), nn.Linear(32, 10))
        c = _cfg(prec)
        c.fp8.ends = "fp8"  # every layer in the format
        r = precision.build(c, "cpu")
        r.prepare(model, [])
        x = torch.randn(4, 3, 8, 8)
        with r.autocast():
            loss = model(x).square().mean()
        loss.backward()
        return [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads(True), grads(False)))


def test_a_split_layer_keeps_one_rounding_of_its_input_for_the_backward():
    """fp8_rowwise_gw_hp's weight gradient reads the unrounded input and its data gradient only the input's shape:
    what a step saves for the backward is then FP32's activations plus the weights' roundings, not a second
    activation-sized rounding a layer (the data gradient's operand stands in uninitialised, the same bits)."""
    from mpt.memory import SavedTensorBytes

    def saved(prec):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                              nn.Flatten(), nn.Linear(16 * 16 * 16, 10))
        c = _cfg(prec)
        if prec != "fp32":
            c.fp8.ends = "fp8"
        r = precision.build(c, "cpu")
        r.prepare(model, [])
        meter = SavedTensorBytes(model)
        with meter.measure(), r.autocast():
            model(torch.randn(32, 8, 16, 16)).square().mean()
        return meter.bytes

    fp32 = saved("fp32")
    assert saved("fp8_rowwise_gw_hp") < 1.25 * fp32
