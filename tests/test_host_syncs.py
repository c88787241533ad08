"""No host read in the training step's forward and backward (the throughput item of "Ready for the GPU
cluster"). On a GPU every .item(), int()/float()/bool() of a tensor, nonzero, boolean-mask indexing,
unique, masked_select or .tolist() waits for the queue to drain; torch.cuda.set_sync_debug_mode says
so on CUDA only. Here, on the CPU, a dispatch mode counts the aten operations that would be such a
read (and .tolist()/.numpy()/.cpu() are counted by patching), during task.loss + backward of one
tiny batch of each experiment.

What is not seen here: host-to-device copies of host data inside torch (the CUDA ctc_loss copies the
lengths it reads on the host back to the GPU, a synchronising copy we cannot avoid from outside), and
the optimizer step (the precision recipe's overflow check reads one flag per step by design)."""
from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import REPO  # noqa: F401  (puts the repository on sys.path)

pytestmark = pytest.mark.usefixtures("one_thread")

aten = torch.ops.aten
# Operations whose CUDA kernels read a device value on the host (their output size or a Python
# scalar depends on the data).
_SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
             aten.is_nonzero.default, aten.equal.default, aten.masked_scatter.default,
             aten._unique.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
             aten.repeat_interleave.Tensor}
_BOOL_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class HostReads(TorchDispatchMode):
    """Counts, by operation name, the operations that read device data on the host."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNC_OPS:
            self.counts[str(func.overloadpacket.__name__)] += 1
        elif func in _BOOL_INDEX_OPS and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])
                if i is not None):
            self.counts[f"{func.overloadpacket.__name__}(bool mask)"] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_reads():
    mode = HostReads()
    patched = {}
    for name in ("tolist", "numpy", "cpu"):  # Python-level reads that bypass the dispatcher on the CPU
        orig = getattr(torch.Tensor, name)
        patched[name] = orig

        def wrapper(self, *a, _orig=orig, _name=name, **kw):
            mode.counts[_name] += 1
            return _orig(self, *a, **kw)

        setattr(torch.Tensor, name, wrapper)
    try:
        with mode:
            yield mode.counts
    finally:
        for name, orig in patched.items():
            setattr(torch.Tensor, name, orig)


def _step(task, model, batch) -> Counter:
    """Host reads of one training step's forward (task.loss) and backward."""
    model.train()
    with count_host_reads() as counts:
        loss, items = task.loss(model, batch)
        loss.backward()
    assert torch.isfinite(loss) and isinstance(items, int) and items > 0  # the engine sums Python ints
    return counts


def test_counter_sees_the_reads_it_should():
    x = torch.randn(6)
    with count_host_reads() as counts:
        int(x.sum() > 0)
        x[x > 0]
        torch.unique(x)
        x.tolist()
        torch.where(x > 0, x, 0.0)  # masked arithmetic: no read
    assert counts == Counter({"_local_scalar_dense": 1, "index(bool mask)": 1, "_unique2": 1, "tolist": 1})


def test_biglstm_step_reads_nothing():
    from experiments.lm_biglstm.task import Task, TaskCfg
    from mpt.config import Config

    torch.manual_seed(0)
    B, T, V = 4, 5, 40
    cfg = Config(model="biglstm", width=1 / 128, task=TaskCfg(num_sampled=8))
    cfg.train.batch_size, cfg.train.accum_steps = B, 1  # one stream per row of the batch
    task = Task(cfg, Task.Facts(vocab_size=V))
    model = task.build_model()
    mask = torch.rand(B, T) < 0.8
    batch = {"x": torch.randint(0, V, (B, T)), "y": torch.randint(0, V, (B, T)), "mask": mask,
             "stream": torch.arange(B), "window": torch.tensor([0, 1, 0, 2])}
    assert _step(task, model, batch) == Counter()


def test_deepspeech2_step_reads_nothing():
    from experiments.deepspeech2.task import ENGLISH, Task, TaskCfg
    from mpt.config import Config

    torch.manual_seed(0)
    task = Task(Config(model="english", width=0.05, task=TaskCfg(window_ms=10.0, pad_to_multiple=16)),  # 81 bins
                Task.Facts(chars=ENGLISH))
    model = task.build_model()
    batch = task.collate([(torch.randn(81, n), torch.randint(1, 29, (k,)), "x" * k)
                          for n, k in ((37, 5), (50, 9), (12, 2))])
    assert _step(task, model, batch) == Counter()


def test_translation_step_reads_nothing():
    import models
    from experiments.wmt_translation.task import Task
    from mpt.config import Config

    torch.manual_seed(0)
    task = Task(Config(), Task.Facts(vocab={"en": 20, "fr": 22}, pad=0, bos=1, eos=2))
    model = models.build("nmt_lstm3", src_vocab=20, tgt_vocab=22, width=1 / 128, pad_id=0)
    batch = task.collate([(torch.randint(3, 20, (n,)), torch.randint(3, 22, (m,))) for n, m in ((4, 6), (7, 3), (2, 9))])
    assert batch["n_tgt"] == int((batch["tgt_out"] != task.facts.pad).sum())
    assert _step(task, model, batch) == Counter()


def test_cnn_step_reads_nothing():
    import models
    from experiments.ilsvrc_cnns.task import Task, TaskCfg
    from mpt.config import Config

    task = Task(Config(task=TaskCfg(label_smoothing=0.1, aux_weight=0.3)), Task.Facts(num_classes=10))
    model = models.build("resnet50_preact", width=1 / 16, num_classes=10)
    batch = (torch.randn(2, 3, 32, 32), torch.tensor([1, 7]))
    assert _step(task, model, batch) == Counter()
