"""Each private torch name in mpt/torch_private.py against the public behaviour it stands for: a torch
upgrade that changes one fails here, by name."""
import math

import pytest
import torch
import torch.nn as nn

from mpt import torch_private as TP


def test_norm_base_covers_every_layer_with_running_statistics():
    for cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm2d):
        assert issubclass(cls, TP.NormBase), cls
    for cls in (nn.LayerNorm, nn.GroupNorm, nn.Conv2d, nn.LocalResponseNorm):
        assert not issubclass(cls, TP.NormBase), cls


@pytest.mark.parametrize("bad", [False, True])
def test_scaler_found_inf_is_what_scaler_step_acts_on(bad):
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale((w * torch.tensor([1.0, 2.0, math.inf if bad else 3.0])).sum()).backward()
    scaler.unscale_(opt)
    flags = TP.scaler_found_inf(scaler, opt)
    assert len(flags) == 1 and flags[0].item() == float(bad)
    before = w.detach().clone()
    scaler.step(opt)  # skips exactly when the flag says so
    assert torch.equal(w.detach(), before) == bad
    if not bad:
        assert torch.equal(w.grad, torch.tensor([1.0, 2.0, 3.0]))  # unscaled by 1/4


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_unscale_and_check_multiplies_in_place_and_flags_non_finite(dtype):
    grads = [torch.tensor([2.0, 4.0], dtype=dtype), torch.tensor([8.0], dtype=dtype)]
    found, inv = torch.zeros(1), torch.full((1,), 0.25)
    TP.unscale_and_check_(grads, found, inv)
    assert found.item() == 0.0
    assert torch.equal(grads[0], torch.tensor([0.5, 1.0], dtype=dtype)) and grads[1].item() == 2.0
    for bad in (math.inf, -math.inf, math.nan):
        g = [torch.tensor([1.0, bad], dtype=dtype)]
        found.zero_()
        TP.unscale_and_check_(g, found, inv)
        assert found.item() == 1.0


def test_foreach_copy_equals_copy_including_the_cast():
    src = [torch.randn(5, dtype=torch.float32) * 1e3, torch.randn(2, 3, dtype=torch.float16)]
    dst = [torch.empty(5, dtype=torch.float16), torch.empty(2, 3, dtype=torch.float32)]
    TP.foreach_copy_(dst, src)
    for d, s in zip(dst, src):
        assert torch.equal(d, torch.empty_like(d).copy_(s))


def test_version_counts_in_place_writes_that_autograd_checks():
    w = nn.Parameter(torch.ones(3, dtype=torch.float16))
    v0 = TP.version(w)
    with torch.no_grad():
        TP.foreach_copy_([w], [torch.full((3,), 2.0)])
    assert TP.version(w) == v0 + 1
    x = torch.ones(3, requires_grad=True)
    y = (x * w.float()).sum()  # saves w's cast, not w: no error below
    out = x.exp()
    ver = TP.version(out)
    with torch.no_grad():
        out.add_(1)
    assert TP.version(out) == ver + 1  # what makes autograd refuse out as a saved tensor
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    y.backward()


def test_ntuple_repeats_a_number_and_keeps_a_sequence():
    assert TP.ntuple(2)(3) == (3, 3) and TP.ntuple(3)(1) == (1, 1, 1)
    assert tuple(TP.ntuple(2)((1, 2))) == (1, 2) and tuple(TP.ntuple(2)([4, 5])) == (4, 5)


def test_reset_compiled_makes_torch_compile_compile_again():
    graphs = []

    def backend(gm, example_inputs):  # counts the graphs torch.compile hands over, runs them as they are
        graphs.append(gm)
        return gm.forward

    f = torch.compile(lambda x: x * 2 + 1, backend=backend)
    x = torch.ones(3)
    f(x), f(x)
    assert len(graphs) == 1  # compiled once, then reused
    TP.reset_compiled()
    assert torch.equal(f(x), x * 2 + 1) and len(graphs) == 2


def test_forward_hooks_suspended_silences_earlier_hooks_only():
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    calls = []
    net[0].register_forward_hook(lambda m, a, out: calls.append("old"))
    net.register_forward_pre_hook(lambda m, a: calls.append("old-pre"))
    with TP.forward_hooks_suspended(net):
        h = net[0].register_forward_hook(lambda m, a, out: calls.append("new"))
        net(torch.randn(1, 2))
    net(torch.randn(1, 2))
    assert calls == ["new", "old-pre", "old"]  # the hook made inside went with the suspended set's swap
    h.remove()


def test_in_backward_is_true_only_while_autograd_runs_a_graph():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("forward", TP.in_backward()))
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(("backward", TP.in_backward()))
            return g * 2

    x = torch.ones(3, requires_grad=True)
    Probe.apply(x).sum().backward()
    assert seen == [("forward", False), ("backward", True)] and not TP.in_backward()


def test_add_grad_hook_is_register_hook_without_the_handle():
    """Fired with the gradient, in turn with the hooks register_hook placed before and after it; a handle made
    after it still removes its own hook only."""
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    seen = []
    y.register_hook(lambda g: seen.append(("first", g.tolist())))
    TP.add_grad_hook(y, lambda g: seen.append(("added", g.tolist())))
    h = y.register_hook(lambda g: seen.append(("removed", None)))
    y.register_hook(lambda g: seen.append(("last", g.tolist())))
    h.remove()
    (y * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert seen == [("first", [1.0, 2.0, 3.0]), ("added", [1.0, 2.0, 3.0]), ("last", [1.0, 2.0, 3.0])]


def _multi_grad_events(register, only_a: bool):
    """The order in which a hook on each tensor of a small graph and fn (placed by `register` on a, b, c and one
    no gradient reaches) fire in a backward, and in a second one after the handles are removed."""
    a = torch.ones(2, requires_grad=True)
    b = torch.full((2,), 2.0, requires_grad=True)
    c = a * b
    unused = a * 3
    events = []
    for name, t in (("a", a), ("b", b), ("c", c), ("unused", unused)):
        t.register_hook(lambda g, name=name: events.append(name))
    handles = register([a, b, c, unused], lambda: events.append("fn"))
    (c * a).sum().backward(inputs=[a] if only_a else None)  # (inputs=[a]: b's gradient is not waited for)
    for h in handles:
        h.remove()
    events.append("removed")
    (c.detach() * a).sum().backward()
    return events


@pytest.mark.parametrize("only_a", [False, True])
def test_when_all_grads_ready_fires_where_register_multi_grad_hook_does(only_a):
    def torchs(tensors, fn):
        return [torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: fn())]

    def ours(tensors, fn):
        return TP.when_all_grads_ready(tensors, fn)

    def with_nodes(tensors, fn):  # (the leaves' accumulators given, as a trace gives them)
        return TP.when_all_grads_ready(tensors, fn, [t.grad_fn or TP.grad_accumulator(t) for t in tensors])

    want = _multi_grad_events(torchs, only_a)
    assert want.count("fn") == 1 and want.index("fn") < want.index("removed"), want
    assert _multi_grad_events(ours, only_a) == want
    assert _multi_grad_events(with_nodes, only_a) == want


def test_when_all_grads_ready_holds_no_gradient_so_the_engine_takes_them_into_grad():
    # A weight's gradient that arrives before the last one waited for is not held: the engine takes it into .grad
    # as it does unwatched, so backward runs the same operations (register_multi_grad_hook holds it: a copy).
    layer = nn.Linear(3, 3)
    x = torch.ones(2, 3)

    def backward_ops(register) -> list[str]:
        layer.zero_grad(set_to_none=True)
        ws = [layer.weight, layer.bias]
        handles = register(ws, lambda: None)
        ops = []

        class Seen(TP.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.append(str(func.overloadpacket))
                return func(*args, **(kwargs or {}))

        loss = layer(x).sum()
        with Seen():
            loss.backward()
        for h in handles:
            h.remove()
        return ops

    plain = backward_ops(lambda ws, fn: [])
    held = backward_ops(lambda ws, fn: [torch.autograd.graph.register_multi_grad_hook(ws, lambda grads: fn())])
    assert "aten.copy_" not in plain and "aten.copy_" in held, (plain, held)  # (the test can tell them apart)
    assert backward_ops(TP.when_all_grads_ready) == plain


def test_when_all_grads_ready_hands_its_nodes_to_empty():
    # The hooks count with the graph's nodes, on tensors whose nodes hold the hooks: a cycle through C++ that the
    # collector does not always see (tests/test_doctor_watch.py: a trace's graph outlived its step). `held` gets
    # the list the hooks count with -- the nodes given, or the ones found -- for the caller to empty afterwards.
    a = torch.ones(3, requires_grad=True)
    b, c = a * 2, a * 3
    held, fired = [], []
    TP.when_all_grads_ready([b, c], lambda: fired.append(1), held=held)
    nodes = [b.grad_fn, TP.grad_accumulator(a)]
    TP.when_all_grads_ready([b, a], lambda: fired.append(2), nodes, held)
    assert len(held) == 2 and held[0] == [b.grad_fn, c.grad_fn] and held[1] is nodes
    (b + c).sum().backward()
    assert sorted(fired) == [1, 2]
    for n in held:
        n.clear()  # after the backward: nothing of the graph held any more


def test_scaler_scale_tensor_is_get_scale_without_the_sync():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    assert TP.scaler_scale_tensor(scaler) is None  # lazily made on the first scale()
    scaler.scale(torch.ones(()))
    t = TP.scaler_scale_tensor(scaler)
    assert isinstance(t, torch.Tensor) and t.item() == scaler.get_scale() == 2.0**10


def test_dispatch_mode_sees_each_op_and_tree_flatten_its_leaves():
    ops = []

    class Seen(TP.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.ones(2).mul(3).add(1)
    assert ops[-2:] == ["aten.mul", "aten.add"]
    assert TP.tree_flatten({"a": (1, [2, 3])})[0] == [1, 2, 3]
