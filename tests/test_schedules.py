"""The learning-rate schedules (mpt.optim): each agrees with torch's own scheduler at whole epochs,
moves smoothly between them and under warm-up, an unknown one is a one-line error, and a workload can
register its own."""
import pytest
import torch
import torch.nn as nn

from mpt import config_parse
from mpt.config import Config, SchedCfg
from mpt.errors import UserError
from mpt.optim import lr_factor


def _torch_schedule(name: str, opt, total: int):
    """The same schedule from torch.optim.lr_scheduler, stepped once per epoch: the oracle."""
    S = torch.optim.lr_scheduler
    return {"constant": lambda: S.ConstantLR(opt, factor=1.0, total_iters=0),
            "step": lambda: S.StepLR(opt, step_size=2, gamma=0.5),
            "multistep": lambda: S.MultiStepLR(opt, milestones=[1, 3], gamma=0.1),
            "poly": lambda: S.PolynomialLR(opt, total_iters=total, power=2.0),
            "cosine": lambda: S.CosineAnnealingLR(opt, T_max=total),
            "exponential": lambda: S.ExponentialLR(opt, gamma=0.9)}[name]()


@pytest.mark.parametrize("kw", [dict(name="constant"), dict(name="step", step_epochs=2, gamma=0.5),
                                dict(name="multistep", milestones=[1, 3], gamma=0.1), dict(name="poly", power=2.0),
                                dict(name="cosine"), dict(name="exponential", gamma=0.9)])
def test_every_schedule_agrees_with_torchs_at_every_epoch(kw):
    """At whole epochs each schedule's factor is what torch's own scheduler gives after that many epochs."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    ref = _torch_schedule(kw["name"], opt, 10)
    for epoch in range(11):
        assert lr_factor(SchedCfg(**kw), float(epoch), 10.0) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9,
                                                                              abs=1e-12), (kw, epoch)
        opt.step()
        ref.step()


def test_between_epochs_and_under_warmup():
    """Between whole epochs the factor moves smoothly (exponential: 0.9 ** 2.5 at 2.5), and warm-up
    multiplies every schedule by epoch / warmup_epochs until warm."""
    f = lambda **kw: lr_factor(SchedCfg(**kw), 2.5, 10.0)  # noqa: E731
    assert min(lr_factor(SchedCfg(name="exponential", gamma=0.9), e, 10.0) for e in (2.0, 3.0)) < \
        f(name="exponential", gamma=0.9) < lr_factor(SchedCfg(name="exponential", gamma=0.9), 2.0, 10.0)
    cold = lr_factor(SchedCfg(name="exponential", gamma=0.9, warmup_epochs=2), 1.0, 10.0)
    assert cold == pytest.approx(0.5 * lr_factor(SchedCfg(name="exponential", gamma=0.9), 1.0, 10.0))
    assert lr_factor(SchedCfg(name="cosine", warmup_epochs=2), 3.0, 10.0) == \
        lr_factor(SchedCfg(name="cosine"), 3.0, 10.0)  # warm: no effect


def test_unknown_schedule_and_removed_keys_are_one_line_errors():
    with pytest.raises(UserError, match="exponential"):
        lr_factor(SchedCfg(name="linear"), 0.0, 1.0)
    with pytest.raises(UserError, match="unknown config key 'sched.min_lr' \\(command line\\)"):
        config_parse.set_key(Config(), "sched.min_lr", 0.001, where="command line")


def test_a_workload_can_register_its_own_schedule(monkeypatch):
    from mpt.optim import SCHEDULES, schedule

    monkeypatch.setitem(SCHEDULES, "halving", None)  # restored after the test
    schedule("halving")(lambda s, epoch, total: 0.5 ** int(epoch))
    assert lr_factor(SchedCfg(name="halving"), 2.5, 4.0) == 0.25
    assert lr_factor(SchedCfg(name="halving", warmup_epochs=1.0), 0.5, 4.0) == 0.5  # warm-up on top
