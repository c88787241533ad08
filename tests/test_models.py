"""The ImageNet CNNs of Table 1: published parameter counts at full size, and forward/backward of
tiny-width variants on CPU."""
import pytest
import torch
import torch.nn.functional as F

from models import build, has_batch_norm, names
from models.imagenet_cnns import AUX_WEIGHTS, INPUT_SIZE, LRN, _same_max_pool
from mpt.errors import UserError

torch.set_num_threads(1)

MODELS = ["alexnet", "vgg16", "googlenet", "inception_v2", "inception_v3", "resnet50_preact"]

# Full size (width=1, 1000 classes). Where a model has auxiliary heads: (with aux, without aux).
PARAM_COUNTS = {
    # Caffe models/bvlc_alexnet (two-group conv2/4/5, 96-256-384-384-256): 60,965,224.
    "alexnet": 60_965_224,
    # torchvision.models.vgg16 = VGG configuration D (Simonyan & Zisserman 2015: "138M").
    "vgg16": 138_357_544,
    # Caffe bvlc_googlenet: 6,998,552 in deploy.prototxt (main tower), plus the two loss1/loss2
    # heads (3,188,840 + 3,190,888). torchvision's googlenet differs (BN, 3x3 "5x5" branch).
    "googlenet": (13_378_280, 6_998_552),
    # Cadene pretrainedmodels bninception has 11,295,240: the same layers, but every conv keeps
    # the bias of the Caffe model it was converted from (10,016 of them, redundant before BN);
    # ours (and Caffe models/default_googlenet_v2) have bias_term: false.
    "inception_v2": 11_285_224,
    # NVCaffe 0.16 models/inception_v3/train_val.prototxt, counted layer by layer (conv weights,
    # BN scale + bias, FC weights + biases): 32,410,760 without the loss1/loss2 heads, plus
    # 3,709,928 (loss1: 1x1 conv 128, fc 3200->1024, fc 1000) + 2,405,864 (loss2: fc 512->1024).
    # The 7x7/1 final pool leaves 2x2 x 2048, so its classifier alone has 8,193,000.
    "inception_v3": (38_526_552, 32_410_760),
    # timm resnetv2_50 (pre-activation ResNet-50 with final BN) has the same count; computed:
    # torchvision resnet50 (25,557,032) minus the projection-shortcut BNs, plus the final BN.
    "resnet50_preact": 25_549_352,
}


def _count(model):
    return sum(p.numel() for p in model.parameters())


def test_registry_has_all_six():
    assert set(MODELS) <= set(names())
    assert set(INPUT_SIZE) == set(MODELS)
    assert AUX_WEIGHTS == {"googlenet": 0.3, "inception_v3": 0.3}  # both prototxts: loss_weight 0.3


@pytest.mark.parametrize("name", names())
def test_registry_says_which_models_have_batch_norm(name):
    """The registry's batch_norm flag (what the launcher's plan reads instead of building the model) is
    what the built model has, for every registered model."""
    bn = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)
    assert has_batch_norm(name) == any(isinstance(m, bn) for m in build(name, width=1 / 64).modules())
    assert not has_batch_norm(f"{name}_not_registered")


@pytest.mark.parametrize("name", MODELS)
def test_full_size_parameter_count(name):
    expected = PARAM_COUNTS[name]
    with torch.device("meta"):  # shapes only: no memory, no init cost
        if isinstance(expected, tuple):
            assert _count(build(name)) == expected[0]  # aux heads on by default
            assert _count(build(name, aux_logits=False)) == expected[1]
        else:
            assert _count(build(name)) == expected


@pytest.mark.parametrize("name", MODELS)
def test_tiny_forward_backward(name):
    torch.manual_seed(0)
    model = build(name, num_classes=10, width=1 / 16)
    x = torch.randn(2, 3, 80, 80)
    y = torch.tensor([1, 7])

    model.train()
    out = model(x)
    if name in AUX_WEIGHTS:
        logits, aux = out
        assert len(aux) == 2  # GoogLeNet and NVCaffe's Inception v3: loss1 and loss2
        assert all(a.shape == (2, 10) for a in aux)
        loss = F.cross_entropy(logits, y) + AUX_WEIGHTS[name] * sum(F.cross_entropy(a, y) for a in aux)
    else:
        logits = out
        loss = F.cross_entropy(logits, y)
    assert logits.shape == (2, 10)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient for {pname}"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient for {pname}"

    model.eval()
    with torch.no_grad():
        out = model(x)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 10)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["googlenet", "inception_v3"])
def test_aux_heads_at_reference_resolution(name):
    """At 224 / 299 the auxiliary heads use the reference 5x5/3 pooling path, not the adaptive one."""
    model = build(name, num_classes=5, width=1 / 32).train()
    size = INPUT_SIZE[name]
    with torch.no_grad():
        logits, aux = model(torch.randn(2, 3, size, size))
    assert logits.shape == (2, 5) and all(a.shape == (2, 5) for a in aux)


def test_aux_off_returns_plain_logits_in_training():
    model = build("inception_v3", num_classes=3, width=1 / 32, aux_logits=False).train()
    out = model(torch.randn(2, 3, 80, 80))
    assert isinstance(out, torch.Tensor) and out.shape == (2, 3)


def test_alexnet_grouped_convolutions_at_every_width():
    """bvlc_alexnet's conv2/4/5 have group 2, so channel counts stay even at any width."""
    for w in (1 / 8, 1 / 32, 0.3):
        convs = [m for m in build("alexnet", num_classes=3, width=w).features if isinstance(m, torch.nn.Conv2d)]
        assert [m.groups for m in convs] == [1, 2, 1, 2, 2]
        assert all(m.out_channels % 2 == 0 for m in convs)
    with torch.device("meta"):
        full = build("alexnet")
    assert [m.out_channels for m in full.features if isinstance(m, torch.nn.Conv2d)] == [96, 256, 384, 384, 256]
    # dropout after fc6 and fc7 (drop6 / drop7), none before fc6
    kinds = [type(m).__name__ for m in full.classifier]
    assert kinds == ["Linear", "ReLU", "Dropout", "Linear", "ReLU", "Dropout", "Linear"]


def test_width_scales_channels():
    small, smaller = (_count(build("resnet50_preact", num_classes=10, width=w)) for w in (1 / 16, 1 / 32))
    assert smaller < small < 200_000


@pytest.mark.parametrize("kwargs", [{"aux_logits": True}, {"width": 0}, {"num_classes": 0}])
def test_bad_arguments_are_user_errors(kwargs):
    with pytest.raises(UserError):
        build("alexnet", **kwargs)


def test_same_max_pool_is_caffe_ceil_pool_on_even_maps_and_matches_conv_on_odd():
    x = torch.randn(1, 2, 28, 28)
    assert torch.equal(_same_max_pool(x), F.max_pool2d(x, 3, 2, ceil_mode=True))
    conv_out = F.conv2d(torch.randn(1, 2, 5, 5), torch.randn(2, 2, 3, 3), stride=2, padding=1)
    assert _same_max_pool(torch.randn(1, 2, 5, 5)).shape == conv_out.shape


def test_lrn_matches_torch_and_survives_fp16():
    x = torch.randn(2, 8, 5, 5)
    assert torch.allclose(LRN()(x), torch.nn.LocalResponseNorm(5, 1e-4, 0.75, 1.0)(x))
    big = torch.full((1, 8, 3, 3), 1000.0, dtype=torch.float16)  # 1000^2 overflows FP16
    out = LRN()(big)
    assert out.dtype == torch.float16 and torch.isfinite(out).all() and (out > 0).all()


def test_sync_bn_switch_converts_batch_norm_on_multi_gpu_runs(monkeypatch):
    """task.sync_bn: SyncBatchNorm when a run has several ranks and GPUs; a one-line
    error on a multi-process CPU run; nothing in a one-process run."""
    from experiments.ilsvrc_cnns.task import Task
    from mpt.config import resolve

    cfg = resolve("ilsvrc_cnns", ["model=inception_v2", "width=0.03125", "task.sync_bn=true"])
    task = Task(cfg, Task.Facts(num_classes=10))

    def n_sync(model):
        return sum(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())

    assert n_sync(task.build_model()) == 0  # one process: plain BN
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="task.sync_bn=true needs GPUs"):
        task.build_model()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = task.build_model()
    assert n_sync(model) > 0 and not any(type(m) is torch.nn.BatchNorm2d for m in model.modules())
    cfg.task.sync_bn = False
    assert n_sync(task.build_model()) == 0
