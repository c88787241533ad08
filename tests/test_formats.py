"""The simulated low-precision formats (mpt.fp8, mpt.formats): per-tensor FP8's edge cases, the model ends
kept in BF16, the block-scaled formats against hand-worked values from their papers and specifications,
and the recipes end to end."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import models
from mpt import formats, precision
from mpt.config import Config
from mpt.fp8 import FP8State, block_quantize, round_to

# ------------------------------------------------------------------------------------------------
# per-tensor FP8: scales of tiny tensors


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_a_tensor_of_tiny_values_is_not_made_nan(scaling):
    """FP8_MAX / amax overflows FP32 for amax below ~1e-34; an inf scale made 0 * inf = NaN of every
    element. The scale is capped at the largest finite FP32 (Transformer Engine's choice)."""
    st = FP8State(scaling, history_len=2)
    x = torch.tensor([0.0, 1e-36, -3e-37])
    q = st.quantizer("layer:g", "e5m2")
    q(x)
    st.update()  # delayed: the scale now comes from amax 1e-36
    y = q(x)
    assert torch.isfinite(y).all()
    assert y[0] == 0 and y[1] > 0 and y[2] < 0
    assert y[1].item() == pytest.approx(1e-36, rel=0.25)  # E5M2 keeps 2 mantissa bits
    if scaling == "delayed":
        assert st.scale["layer:g"].item() == torch.finfo(torch.float32).max


# ------------------------------------------------------------------------------------------------
# the ends kept in BF16, from the model's dataflow


def _bf16_layers(model, *inputs, train=True):
    r = precision.build(Config(precision="fp8"), "cpu")
    r.prepare(model, [torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)])
    model.train(train)
    with r.autocast():
        model(*inputs)
    return sorted(name for name, bf16 in r.state.sites.values() if bf16)


def _detection_batch(size=64):
    torch.manual_seed(0)
    images = [torch.rand(3, size, size) for _ in range(2)]
    targets = [{"boxes": torch.tensor([[4.0, 6.0, 40.0, 50.0]]), "labels": torch.tensor([3])} for _ in range(2)]
    return images, targets


def test_ssd_keeps_every_prediction_convolution_in_bf16():
    """SSD's prediction convolutions (a class and a box convolution per feature map: 12 at 300 px, 8 at
    64 px) all produce the model's outputs: all are its last layers, and VGG's conv1_1 its first.
    Registration order kept one of them."""
    torch.manual_seed(0)
    ssd = models.build("ssd300_vgg16", width=1 / 16, size=64)
    ends = _bf16_layers(ssd, *_detection_batch())
    preds = sorted(f"head.{n}" for n, m in ssd.head.named_modules() if isinstance(m, nn.Conv2d))
    assert len(preds) == 8
    assert ends == ["backbone.vgg.0"] + preds


def test_faster_rcnn_keeps_both_heads_predictions_in_bf16_and_frozen_layers_are_still_upstream():
    """The RPN's objectness and box convolutions and the RoI head's classifier and box regressor are
    the last layers (registration order kept bbox_pred alone); conv1_1 is the first. With conv1_1 ..
    conv2_2 frozen their outputs carry no autograd graph, and conv3_1 must still not count as a first
    layer."""
    torch.manual_seed(0)
    frcnn = models.build("faster_rcnn_vgg16", width=1 / 16, size=64, freeze="conv2_2")
    ends = _bf16_layers(frcnn, *_detection_batch())
    assert ends == ["backbone.body.0", "roi_heads.box_predictor.head.bbox_pred",
                    "roi_heads.box_predictor.head.cls_score", "rpn.head.head.bbox_pred", "rpn.head.head.cls_logits"]


def test_the_probe_forward_leaves_no_trace():
    """find_ends runs the model once more at its first call: batch-norm statistics, the output and the
    random stream afterwards are those of the same call without the probe."""
    import copy

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    plain = copy.deepcopy(net)
    x = torch.randn(16, 4)
    st = FP8State("current")
    st.register(net, "bf16")
    torch.manual_seed(1)
    y = net(x)  # the pre-hook probes first
    after = torch.rand(3)
    torch.manual_seed(1)
    y_plain = plain(x)
    assert torch.equal(y, y_plain) and torch.equal(torch.rand(3), after)
    assert all(torch.equal(a, b) for a, b in zip(net.buffers(), plain.buffers()))
    assert sorted(n for n, bf16 in st.sites.values() if bf16) == ["0", "3"]
