"""impl=paper's mixed-precision recipe (mpt.precision): layers marked fp32_compute (and torch's LRN)
compute in FP32, and a skipped step names the parameter whose gradient overflowed."""
import math

import pytest
import torch
import torch.nn as nn

from mpt import precision
from mpt.config import Config

torch.set_num_threads(1)


class _SumOfSquares(nn.Module):
    """A model's own layer that must reduce in FP32 (like Caffe's LRN): it opts in by marker."""
    fp32_compute = True

    def forward(self, x):
        self.seen = x.dtype
        return x * x.pow(2).sum(1, keepdim=True)


class _Plain(_SumOfSquares):
    fp32_compute = False


@pytest.mark.parametrize("layer,inside", [(_SumOfSquares, torch.float32), (_Plain, torch.float16),
                                          (lambda: nn.LocalResponseNorm(3), None)])
def test_paper_impl_computes_marked_layers_in_fp32(layer, inside):
    lay = layer()
    net = nn.Sequential(nn.Linear(5, 5), lay, nn.Linear(5, 2))  # on (N, C, L): LRN wants 3-D
    r = precision.build(Config(precision="mixed", impl="paper", loss_scale="8"), "cpu")
    r.prepare(net, [torch.optim.SGD(net.parameters(), lr=0.1)])
    seen, lrn_in = [], []
    net[2].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))  # what the next layer reads
    if inside is None:  # torch's LRN: watch its input (after the recipe's cast)
        lay.register_forward_pre_hook(lambda m, a: lrn_in.append(a[0].dtype))
    out = net(torch.randn(3, 4, 5))
    assert out.dtype == torch.float32 and seen == [torch.float16]  # back to FP16 after the layer
    assert (lrn_in[0] if inside is None else lay.seen) == (torch.float32 if inside is None else inside)


def test_a_skipped_step_names_the_parameter_whose_gradient_overflowed():
    """Of two parameters, only b's gradient is infinite: the skipped step names b, not the first
    parameter of the model."""
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))

        def forward(self, x):
            return self.a * x[0] + self.b * x[1]

    net = Two()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    r = precision.build(Config(precision="mixed", impl="paper", loss_scale="8"), "cpu")
    r.prepare(net, [opt])
    r.backward(net(torch.tensor([1.0, math.inf])).sum())
    assert r.step(opt) is False and r.last_overflow == "b" and r.skipped_steps == 1
