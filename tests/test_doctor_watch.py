"""mpt.doctor.watch on a user's own loop: the first non-finite value is named where it is made (the operation,
its module, forward or backward, the step), not where it is passed on; the setup checks fire on a planted
mistake and stay silent on a correct loop."""
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mpt.doctor import examples as ex
from mpt.doctor.watch import watch
from mpt.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")


class SqrtAtZero(nn.Module):
    """x + sqrt(|x - x|): its output is x, finite, but the gradient of sqrt(|d|) at d = 0 is
    sign(0) / (2 sqrt(0)) = 0 x inf = nan (the norm of a zero vector)."""

    def forward(self, x):
        return x + (x - x.detach()).abs().sqrt()


class Late(nn.Module):
    """Multiplies by 1e30 from step `at` on (counted by its own calls): a producer of inf that starts late."""

    def __init__(self, at):
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x):
        self.calls += 1
        return x * 1e30 * 1e30 if self.calls > self.at else x


def _train(model, steps, every, x, y, lines, scaler=None, trace_every=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, every=every, optimizer=opt, scaler=scaler, log=lines.append, trace_every=trace_every) as w:
        for _ in range(steps):
            loss = F.mse_loss(model(x).float(), y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            w.step(loss)
    return w


def test_forward_producer_inside_a_module_whose_output_is_finite():
    """The RMS-norm toy in FP16: x * x overflows inside the norm, whose output x / sqrt(inf) = 0 is finite; the
    next modules and the loss only pass the result on. The watch names the product, in the norm, forward."""
    model, _, batches, _ = ex.overflow_inside()
    model = model.half()
    outs = []
    model[1].register_forward_hook(lambda m, a, out: outs.append(bool(torch.isfinite(out).all())))
    x, y = batches[0]
    lines = []
    w = _train(model, 2, 1, x.half(), y, lines)
    assert outs[0], "the planted module's output alone must look fine"
    f = w.first
    assert (f["module"], f["phase"], f["op"], f["step"]) == ("1 (_RMSNorm)", "forward", "aten.mul", 0), f
    assert any("inf made by aten.mul in 1 (_RMSNorm), forward, step 0" in line for line in lines), lines


class From(nn.Module):
    """Its inner module from step `at` on (counted by its own calls), the identity before."""

    def __init__(self, at, inner):
        super().__init__()
        self.at, self.calls, self.inner = at, 0, inner

    def forward(self, x):
        self.calls += 1
        return self.inner(x) if self.calls > self.at else x


def _sqrt_model(at):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(From(at, SqrtAtZero()), nn.Linear(4, 4)), nn.Linear(4, 1))


def test_backward_producer_nested_in_a_block_is_named_not_its_parents():
    """Traced (every operation, step 0): the producer is the division in the sqrt's backward, in its module."""
    w = _train(_sqrt_model(0), 1, 1, torch.randn(8, 4), torch.randn(8, 1), [])
    f = w.first
    assert (f["module"], f["phase"], f["step"]) == ("1.0.inner (SqrtAtZero)", "backward", 0), f
    assert f["op"].startswith("aten."), f
    assert w.run_up["1.0.inner (SqrtAtZero)"][-1][1] < 10  # its forward values: finite


def test_module_level_sample_names_the_module_then_the_trace_names_the_operation():
    """At module level (step 1, not traced) the first non-finite record is the sqrt's input gradient: its module,
    backward -- not the modules before it that received nan. The GradScaler skips the update, the weights stay
    finite, and the next step's trace names the operation."""
    lines = []
    w = _train(_sqrt_model(1), 3, 1, torch.randn(8, 4), torch.randn(8, 1), lines,
               scaler=torch.amp.GradScaler("cpu"), trace_every=1000)
    f = w.first
    assert (f["module"], f["phase"], f["what"], f["step"]) == ("1.0.inner (SqrtAtZero)", "backward",
                                                               "input gradient", 1), f
    t = f["traced"]
    assert (t["module"], t["phase"], t["step"]) == ("1.0.inner (SqrtAtZero)", "backward", 2) and t["op"], t
    assert "traced: nan made by" in " ".join(lines) or "traced: inf made by" in " ".join(lines), lines


def test_a_producer_between_samples_is_chased_when_the_scaler_skips():
    """Every 10 steps sampled; the producer starts at step 13 (unsampled). The GradScaler skips that update, so
    the weights stay finite; the watch samples the next steps and names the producer at step 14."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Late(13), nn.Linear(8, 1))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    w = _train(model, 20, 10, x, y, [], scaler=torch.amp.GradScaler("cpu"))
    f = w.first
    assert (f["module"], f["phase"], f["op"], f["step"]) == ("1 (Late)", "forward", "aten.mul", 14), f
    assert w.samples == 3  # steps 0, 10 and 14: chasing stops once the producer is seen


def test_without_a_scaler_a_producer_between_samples_is_reported_as_nonfinite_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Late(3), nn.Linear(8, 1))
    w = _train(model, 12, 5, torch.randn(8, 4), torch.randn(8, 1), [])
    assert w.first["step"] == 5 and w.first["phase"] == "before the step", w.first
    assert "already non-finite as step 5 began" in " ".join(w.report()), w.report()


def test_a_non_finite_loss_between_samples_is_chased_then_called_a_one_off():
    """A loss that is nan at step 3 only (the loop skips that update itself; the watch has no optimizer to see it):
    the losses since the last sample are read with the sample at step 5, which starts tracing the next steps; none
    makes it again: a one-off, said once -- the finite losses after it do not start a second chase."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    lines = []
    with watch(model, every=5, log=lines.append, trace_every=1000) as w:
        for i in range(30):
            loss = F.mse_loss(model(x), y) * (float("nan") if i == 3 else 1.0)
            if torch.isfinite(loss):
                loss.backward()
                opt.step()
            opt.zero_grad()
            w.step(loss)
    assert w.first is None
    assert [line for line in lines if "one-off" in line] == [
        "a non-finite value between steps 1 and 5, not made again in the 5 steps after it, all traced: a one-off "
        "(a batch? the loss?)"], lines
    assert w.traced == 1 + 5  # step 0 (trace_every), then steps 6-10 chasing it


@pytest.mark.parametrize("in_place", [False, True])
def test_a_non_finite_loss_in_a_rewritten_buffer_is_seen(in_place):
    """The losses between samples are held as views until the sample reads them. A loop that writes each loss into
    one tensor in place (a CUDA graph's static output) would leave only the last value in them: the watch sees the
    buffer come back and copies each loss from then on, so a nan at step 3, overwritten by the finite loss of
    step 4 before the sample at step 5 reads it, is still seen -- as it is with a new tensor each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    buf = torch.zeros(())
    lines = []
    with watch(model, every=5, log=lines.append, trace_every=1000) as w:
        for i in range(12):
            loss = F.mse_loss(model(x), y).detach() * (float("nan") if i == 3 else 1.0)
            w.step(buf.copy_(loss) if in_place else loss)
    assert any("between steps 1 and 5" in line for line in lines), lines
    assert w._copy_losses is in_place


def test_losses_of_other_shapes_and_dtypes_between_samples():
    """A loop may pass a per-example loss vector on one step and a BF16 scalar on another: each is checked as it
    is (not stacked), and a nan among them is seen."""
    model = nn.Sequential(nn.Linear(4, 1))
    x = torch.randn(2, 4)
    lines = []
    with watch(model, every=5, log=lines.append, trace_every=1000) as w:
        for i in range(12):
            model(x)
            loss = (torch.tensor([1.0, float("nan") if i == 3 else 2.0]) if i % 2 else
                    torch.tensor(3.0, dtype=torch.bfloat16))
            w.step(loss)
    assert any("between steps 1 and 5" in line for line in lines), lines


def test_the_run_up_is_the_samples_before_the_first_non_finite_value():
    """Late makes inf from step 12 on and the weights are nan after it; the watch samples on to step 28 -- more
    than its 8 kept samples. The run-up the report prints is the finite samples before step 12, not the nan ones
    after it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Late(12), nn.Linear(8, 1))
    w = _train(model, 30, 2, torch.randn(16, 4), torch.randn(16, 1), [])
    assert w.first["step"] == 12 and w.first["module"] == "1 (Late)", w.first
    assert all(s > 12 for s, _, _ in w.run_up["0 (Linear)"]), "the later samples filled the kept ones"
    said = w.report()
    ups = [line for line in said if line.startswith(("  its run-up: ", "  largest |value| in "))]
    assert len(ups) == 4, said
    for line in ups:
        steps = [int(s) for s in re.findall(r"step (\d+) fwd", line)]
        assert steps == [4, 6, 8, 10] and "nan" not in line and "inf" not in line, line


# -- setup checks ----------------------------------------------------------------------------------------

def _amp_loop(steps=12, scaler=None, sched_always=False, plant_inf_at=None, checkpoint=None):
    """A CPU autocast FP16 loop over the healthy toy, correct unless told otherwise."""
    model, _, batches, opt_fn = ex.healthy()
    opt = opt_fn(model)
    scaler = torch.amp.GradScaler("cpu") if scaler is None else scaler
    sched = torch.optim.lr_scheduler.StepLR(opt, 4)
    lines = []
    with watch(model, every=5, optimizer=opt, scaler=scaler, scheduler=sched, log=lines.append) as w:
        for i in range(steps):
            x, y = batches[i % len(batches)]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            if i == plant_inf_at:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if sched_always or scaler.get_scale() >= before:  # the correct loop: only applied updates
                sched.step()
            opt.zero_grad()
            w.step(loss)
        ok = w.check_checkpoint(checkpoint(model, opt, scaler, sched) if checkpoint else
                                {"model": model.state_dict(), "opt": opt.state_dict(),
                                 "amp": {"scaler": scaler.state_dict()}, "sched": sched.state_dict()})
    return w, lines, ok


def test_correct_amp_loop_has_no_findings():
    w, lines, ok = _amp_loop(plant_inf_at=7)  # a skipped step, handled correctly
    assert ok and w.findings.keys() <= {"one_off"} and not any("SETUP" in line for line in w.report()), w.report()


@pytest.mark.parametrize("scaler,what", [
    (torch.amp.GradScaler("cpu", enabled=False), "FP16 compute with the GradScaler is disabled"),
    (torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**9), "the GradScaler's scale at 1"),
])
def test_fp16_without_loss_scaling_is_found(scaler, what):
    w, lines, _ = _amp_loop(scaler=scaler)
    assert "fp16_unscaled" in w.findings and what in w.findings["fp16_unscaled"], w.findings
    assert sum("FP16 compute" in line for line in lines) == 1  # said once, not every sample


def test_a_scale_that_collapsed_is_not_called_a_scale_1_setup_mistake():
    """Gradients 2^30 too large: the GradScaler skips every step and halves S from 2^16 to 2^-4 in 20 steps. That
    was reported as "the GradScaler's scale at 1" (a setup mistake); it is the gradients overflowing."""
    model, _, batches, opt_fn = ex.healthy()
    opt, scaler, lines = opt_fn(model), torch.amp.GradScaler("cpu"), []
    with watch(model, every=5, optimizer=opt, scaler=scaler, log=lines.append) as w:
        for i in range(20):
            x, y = batches[i % len(batches)]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y) * 2.0**30
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            w.step(loss)
    report = w.report()
    assert scaler.get_scale() == 2.0**-4 and "fp16_unscaled" not in w.findings, w.findings
    assert any(line.startswith("NOTE: 20 of 20 steps skipped; S fell from 2^16 to 2^-4") for line in report), report
    assert not any(line.startswith("SETUP") for line in report), report


def test_scheduler_stepped_on_a_skipped_update_is_found():
    w, lines, _ = _amp_loop(sched_always=True, plant_inf_at=7)
    assert w.findings["schedule"].startswith("step 7: the scheduler stepped though the optimizer did not"), w.findings
    w, _, _ = _amp_loop(sched_always=True)  # no skipped step: nothing to find
    assert "schedule" not in w.findings


def test_checkpoint_without_scaler_state_is_found():
    w, lines, ok = _amp_loop(checkpoint=lambda m, o, s, sch: {"model": m.state_dict(), "opt": o.state_dict()})
    assert not ok and "has no GradScaler state" in w.findings["checkpoint"] and "scaler.state_dict()" in lines[-1]


def test_watch_step_before_the_optimizer_step_is_found():
    model, _, batches, opt_fn = ex.healthy()
    opt = opt_fn(model)
    with watch(model, every=5, optimizer=opt, log=lambda line: None) as w:
        for i in range(4):
            loss = F.mse_loss(model(batches[0][0]), batches[0][1])
            loss.backward()
            w.step(loss)  # too early: the optimizer steps after it
            opt.step()
            opt.zero_grad()
    assert w.findings["order"].startswith("the optimizer given to watch() did not step before w.step()"), w.findings


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(UserError, match=r"watch\(every=0\)"):
        watch(nn.Linear(1, 1), every=0)
    with pytest.raises(UserError, match="give the torch.nn.Module"):
        watch(lambda x: x)
    with pytest.raises(UserError, match="give the dict passed to torch.save"):
        watch(nn.Linear(1, 1), scaler=torch.amp.GradScaler("cpu")).check_checkpoint([1])


def _left_on(model) -> tuple:
    """What a watch could leave behind: global module hooks, dispatch modes, the model's own hooks and its weights'."""
    from torch.nn.modules import module as M

    return (len(M._global_forward_pre_hooks), len(M._global_forward_hooks), torch._C._len_torch_dispatch_stack(),
            sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
            sum(len(p._backward_hooks or {}) for p in model.parameters()))


def test_a_watch_leaves_nothing_on_the_model_and_is_used_inside_its_block():
    """Sampled and traced steps place hooks and a dispatch mode; the `with` block's end takes every one away. A
    step() outside the block would place them where nothing takes them away again (every later step of the process
    slowed, its records kept): it is a one-line error, as is entering the watch twice -- and neither leaves
    anything on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    clean = _left_on(model)
    assert clean == (0, 0, 0, 0, 0)
    w = _train(model, 6, 2, x, y, [], trace_every=3)  # steps 0 and 3 traced, 2 and 4 sampled
    assert (w.samples, w.traced) == (4, 2) and _left_on(model) == clean
    with pytest.raises(UserError, match=r"w.step\(\) outside the watch's `with` block"):
        w.step()
    assert _left_on(model) == clean
    with w:
        assert _left_on(model)[2] == 1  # (step 6's trace begins with the block)
        with pytest.raises(UserError, match="entered twice"):
            w.__enter__()
    assert _left_on(model) == clean


def test_traced_steps_leave_no_graph_behind():
    """A traced step's backward tracking hooks the step's own tensors with closures that count on the graph's
    nodes: the nodes hold the hooks, the hooks the nodes -- a cycle through C++ that Python's collector does not
    see. Emptied as the trace ends, nothing of a traced step outlives it: after the block, no trace, no graph
    node, no tensor of the steps is alive, however many steps were traced."""
    import gc
    import weakref

    from mpt.doctor.trace import Trace

    def alive():  # traces and autograd nodes that Python objects still reach
        gc.collect()
        return sum(type(o) is Trace or type(o).__name__.endswith("Backward0") for o in gc.get_objects())

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    outs = []  # a weak reference to each step's output of the middle layer
    model[2].register_forward_hook(lambda m, a, out: outs.append(weakref.ref(out)))
    before = alive()
    w = _train(model, 5, 1, x, y, [], trace_every=1)  # every step traced
    assert w.traced == 5 and len(outs) == 5
    del w
    assert alive() == before
    assert all(t() is None for t in outs)


def _sample_beside_reference_hooks(monkeypatch):
    """A module-level sample of one step beside reference hooks, one per tensor as a module makes it (a hook on
    each weight too), each taking its tensor's min and max on its own: (the sample, the reference's min and
    max by record name, the reference's record names in the order its hooks fired, the sample's min and max)."""
    from mpt.doctor import module_sample
    from mpt.doctor.trace import module_labels

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    labels = module_labels(model)
    x = torch.randn(5, 4)
    ref: dict = {}  # (module, phase, what) -> min and max, taken tensor by tensor
    seq: list = []  # the record names as the reference hooks fired

    def keep(key, t):
        ref.setdefault(key, []).append(torch.aminmax(t.detach()))
        seq.append(key)

    def fwd(mod, args, out):
        label = labels[mod]
        for what, t in [("input", a) for a in args if not getattr(mod, "inplace", False)] + [("output", out)]:
            keep((label, "forward", what), t)
            if t.requires_grad and not (what == "input" and t.is_leaf):
                t.register_hook(lambda g, k=(label, "backward", f"{what} gradient"): keep(k, g))

    for m in model:
        m.register_forward_hook(fwd)
        for p in m.parameters():
            p.register_hook(lambda g, k=(labels[m], "backward", "weight gradient"): keep(k, g))
    monkeypatch.setattr(module_sample, "FOLD", 3)  # several stacks and a remainder
    w = watch(model)
    rec = module_sample.ModuleSample(w._plan)
    model(x.requires_grad_()).square().sum().backward()
    rec.close()
    return rec, ref, seq, torch.cat(rec.values).view(-1, 2)


def test_module_sample_stacked_records_equal_each_tensors_min_and_max(monkeypatch):
    """The module-level sample stacks its records FOLD at a time and puts one hook on each gradient however many
    modules record it: each record still holds the min and max of its own tensor, as one hook per record taking
    the tensor's min and max on its own sees it (an in-place ReLU included: the Linear's output before it)."""
    rec, ref, _, got = _sample_beside_reference_hooks(monkeypatch)
    assert len(got) == len(rec.names) >= 20
    seen: dict = {}
    weight_grads: dict = {}  # one module's weights' gradients, in any order among themselves
    for name, (lo, hi) in zip(rec.names, got):
        if name[2] == "weight gradient":
            weight_grads.setdefault(name, []).append((lo.item(), hi.item()))
            continue
        i = seen[name] = seen.get(name, -1) + 1  # the i-th record of that name: its i-th tensor
        want = ref[name][i]
        assert (lo.item(), hi.item()) == (want.min.item(), want.max.item()), name
    for name, pairs in weight_grads.items():
        assert sorted(pairs) == sorted((m.min.item(), m.max.item()) for m in ref[name]), name
    # Every tensor the reference hooks saw is recorded, the inputs of modules after the first once (as the
    # output of the module before).
    assert {k for k in ref if k[2] != "input"} <= set(seen) | set(weight_grads)
    # Each gradient measured once: the records of one gradient tensor (one hook, however many modules record
    # it) are one group, next to each other, numbered by its first record (+ 1), with one min and max.
    assert [g is None for g in rec.grads] == [phase == "forward" for _, phase, _ in rec.names]
    groups: dict = {}
    for j, g in enumerate(rec.grads):
        if g is not None:
            groups.setdefault(g, []).append(j)
    for g, js in groups.items():
        assert js == list(range(g - 1, g - 1 + len(js))), (g, js)
        assert all(got[j].tolist() == got[js[0]].tolist() for j in js)
    assert any(len(js) > 1 for js in groups.values())  # (the Linear's output, the Tanh's input)


def test_weight_gradients_read_as_backward_ends_keep_the_hooks_order(monkeypatch):
    """The weights' gradients are read from .grad as the backward ends, not by a hook on each weight: each record
    still sits where a hook on the weight fired -- after its module's output gradient, before the gradients the
    backward makes after it -- so the first non-finite record in execution order is the same one."""
    rec, _, seq, _ = _sample_beside_reference_hooks(monkeypatch)
    assert [n for n in rec.names if n[1] == "backward"] == [k for k in seq if k[1] == "backward"]
    assert sum(n[2] == "weight gradient" for n in rec.names) == 6


def test_samples_sharing_slots_hold_each_tensors_min_and_max_in_its_dtype():
    """Samples write their min and max into a watch's reusable buffers, one per dtype (Slots), several buffers a
    sample here: each sample, the second on the buffers the first used, holds each forward value's own min and
    max -- an FP16 module's among FP32 ones included."""
    from mpt.doctor import module_sample
    from mpt.doctor.trace import Slots, module_labels

    class Cast(nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.dtype = dtype

        def forward(self, x):
            return x.to(self.dtype)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Cast(torch.float16), nn.Linear(8, 8).half(), Cast(torch.float32),
                          nn.Linear(8, 3))
    labels = module_labels(model)
    slots = Slots(fold=2)
    w = watch(model)
    for scale in (1.0, 100.0):
        outs = {}
        handles = [m.register_forward_hook(lambda m, a, out: outs.update({labels[m]: out.detach().clone()}))
                   for m in model]  # (update: the hook returns None, leaving the output as it is)
        rec = module_sample.ModuleSample(w._plan, slots=slots)
        model(scale * torch.randn(5, 4)).square().sum().backward()
        rec.close()
        for h in handles:
            h.remove()
        got = torch.cat(rec.values).view(-1, 2)
        for name, (lo, hi) in zip(rec.names, got):
            if name[1:] == ("forward", "output"):
                want = outs[name[0]]
                assert (lo.item(), hi.item()) == (want.min().item(), want.max().item()), name
        assert {v.dtype for v in outs.values()} == {torch.float16, torch.float32}
        assert len(slots._buffers) > 2  # (several buffers of each dtype)
