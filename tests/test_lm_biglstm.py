"""Figure 5's bigLSTM: the model in every precision, the sampled softmax against the full one, the
One Billion Word prep on the tiny release, the stream layout, a tiny run that learns, bit-identical
resume, and the tiny grid through the launcher into the figure."""
from __future__ import annotations

import gzip
import json
import math
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import models
from conftest import REPO, run_interrupted
from data_prep.lm1b import prepare as prep
from data_prep.lm1b.dataset import Prepared, StreamWindows, TokenStream
from data_prep.lm1b.tiny import generate
from experiments.lm_biglstm import main as lm_main
from experiments.lm_biglstm.task import Task, TaskCfg
from models.lm import FULL, Softmax, expected_count, log_uniform_prob, parameter_count, sample_log_uniform
from mpt import precision, precisions
from mpt.config import Config, OptimCfg
from mpt.data import EpochSampler
from mpt.errors import UserError
from mpt.optim import build_optimizer, clip_groups

torch.set_num_threads(1)  # the CPU is shared; one thread per process is the most predictable
# CPU PyTorch runs projected LSTMs without oneDNN and says so; expected here.
pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections is not supported")


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> Path:
    return generate(tmp_path_factory.mktemp("lm1b_archive"))


@pytest.fixture(scope="module")
def data(archive, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lm1b") / "prepared"
    prep.prepare(archive, out, workers=1, log=quiet)
    return out


def run_args(root, out_dir, *extra):
    return ["profile=tiny", f"task.data_root={root}", f"out_dir={out_dir}", "wandb.mode=disabled",
            "train.progress=false", *extra]


def lines(d: Path) -> list[dict]:
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------------
# the model


def test_full_size_parameter_count():
    with torch.device("meta"):
        m = models.build("biglstm")
    n = sum(p.numel() for p in m.parameters())
    tables = FULL["vocab_size"] * 1024
    lstm = sum(p.numel() for p in m.lstm.parameters())
    assert n == parameter_count(FULL["vocab_size"], 1024, 8192, 1024, 2) == 1_776_948_095
    assert m.embedding.weight.numel() == m.softmax.weight.numel() == tables == 812_514_304
    assert lstm == 2 * 75_563_008  # per layer: 4H x (1024 + 1024) + 2 x 4H biases + 1024 x H projection
    print(f"bigLSTM full size: {n:,} parameters ({2 * tables:,} in the two tables, {lstm:,} in the LSTMs)")


def tiny_model(**kw):
    torch.manual_seed(0)
    return models.build("biglstm", vocab_size=60, width=1 / 128, num_sampled=12, **kw)


def test_tiny_forward_backward_every_precision():
    x, y = torch.randint(0, 60, (3, 4)), torch.randint(0, 60, (3, 4))
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[0, 1] = False
    for prec in precisions.PRECISIONS:
        for impl in precisions.IMPLS:
            if prec in ("fp16_pure", "fp16_storage") and impl == "autocast":
                continue  # the same recipe as impl=paper
            m = tiny_model()
            opt = build_optimizer(OptimCfg(name="adagrad", lr=0.2, initial_accumulator_value=1.0),
                                         m.parameters())
            scale = "128" if prec == "mixed" else "auto"
            r = precision.build(Config(precision=prec, impl=impl, loss_scale=scale), "cpu")
            m = r.prepare(m, [opt])
            with r.autocast():
                nll, state = m(x, y, mask, None)
            assert nll.dtype == torch.float32 and nll.shape == (3, 4) and nll[0, 1] == 0, (prec, impl)
            assert len(state) == 2 and state[0][0].shape == (3, 8) and state[0][1].shape == (3, 64)
            r.backward(nll.sum() / mask.sum())
            assert r.step(opt), (prec, impl)
            r.update()
            assert all(torch.isfinite(p).all() for p in r.master_params()), (prec, impl)
            m.eval()
            with torch.no_grad(), r.autocast():
                full, _ = m(x, y, mask, state)
            assert torch.isfinite(full).all() and full[mask].min() > 0, (prec, impl)


def test_engine_adagrad_groups_and_group_clipping():
    """The engine's Adagrad starts each param group from its own accumulator, creates its state at the
    first step (so impl=paper can swap in master copies), runs step hooks once; a group's own
    clip_grad_norm clips that group only."""
    torch.optim.Adagrad([torch.zeros(1, requires_grad=True)])  # torch wraps Adagrad.step on first use
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = build_optimizer(OptimCfg(name="adagrad", lr=0.1, initial_accumulator_value=0.5),
                                 [{"params": [a], "initial_accumulator_value": 2.0, "clip_grad_norm": 1.0},
                                  {"params": [b]}])
    assert len(opt.state) == 0
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append(1))
    opt.register_step_pre_hook(clip_groups)
    a.grad, b.grad = torch.full((3,), 3.0), torch.full((2,), 3.0)
    opt.step()
    assert calls == [1]
    assert torch.allclose(a.grad.norm(), torch.tensor(1.0)) and torch.equal(b.grad, torch.full((2,), 3.0))
    assert torch.allclose(opt.state[a]["sum"], 2.0 + a.grad ** 2) and torch.equal(opt.state[b]["sum"], torch.full((2,), 9.5))


def test_lm_optimizer_clips_the_lstm_group_only():
    """The LM's optimizers() (not the engine) hooks the per-group clipping: after a step with large
    gradients the LSTM's gradients have the global norm task.lstm_clip_norm, the others are untouched."""
    from experiments.lm_biglstm.task import Task, TaskCfg

    cfg = Config(model="biglstm", width=1 / 128, task=TaskCfg(num_sampled=8, lstm_clip_norm=0.5),
                 optim=OptimCfg(name="adagrad", lr=0.1))
    task = Task(cfg, Task.Facts(vocab_size=40))
    model = task.build_model()
    (opt,) = task.optimizers(model).values()
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    opt.step()
    lstm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.lstm.parameters()]))
    assert torch.allclose(lstm, torch.tensor(0.5))
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0))
               for p in [model.embedding.weight, *model.softmax.parameters()])


def test_sampler_expected_counts_are_unbiased():
    """Horvitz-Thompson: sum over the sample of f(k) / expected count(k) estimates sum_k f(k) -- the
    correction the sampled softmax applies to its logits."""
    torch.manual_seed(1)
    V = 1000
    f = torch.exp(torch.randn(V, dtype=torch.float64))
    est = []
    for _ in range(1500):
        ids, tries = sample_log_uniform(64, V, "cpu")
        assert ids.unique().numel() == 64 and tries >= 64
        est.append(float((f[ids] / expected_count(ids, tries, V)).sum()))
    assert np.mean(est) / float(f.sum()) == pytest.approx(1.0, abs=0.02)


def _sample_log_uniform_drawwise(num_sampled, vocab_size):
    """The sampler as it was before it ran without host reads: TensorFlow's procedure literally, draws
    in blocks until num_sampled distinct ids appeared (torch.unique + a Python loop), first
    appearances in draw order, num_tries = the draw that brought the last one."""
    log_range = math.log(vocab_size + 1.0)
    draws = torch.empty(0, dtype=torch.long)
    block = 2 * num_sampled + 64
    while True:
        u = torch.rand(block, dtype=torch.float64)
        draws = torch.cat([draws, (torch.exp(u * log_range).floor_().long() - 1).clamp_(0, vocab_size - 1)])
        uniq, inverse = torch.unique(draws, return_inverse=True)
        if uniq.numel() >= num_sampled:
            pos = torch.arange(draws.numel())
            first = torch.full_like(uniq, draws.numel()).scatter_reduce_(0, inverse, pos, "amin")
            first = first.sort().values[:num_sampled]
            return draws[first], first[-1] + 1
        block = draws.numel()


@pytest.mark.parametrize("V,k", [(30, 8), (12, 10)])
def test_sampler_matches_drawwise_sampling(V, k):
    """The exponential-race sampler (no host read) against the draw-by-draw one: the same law of the
    first id, of each id's inclusion, of the number of draws (its mean and quantiles) and the same
    expected counts as a function of it; deterministic given the generator. k = 10 of V = 12 needs
    the rare ids (many blocks in the draw-by-draw loop)."""
    n = 4000
    torch.manual_seed(0)
    old = [_sample_log_uniform_drawwise(k, V) for _ in range(n)]
    g = torch.Generator().manual_seed(0)
    new = [sample_log_uniform(k, V, "cpu", generator=g) for _ in range(n)]
    for ids, tries in new:
        assert ids.unique().numel() == k and tries.dtype == torch.int64 and int(tries) >= k
    g = torch.Generator().manual_seed(0)
    again = sample_log_uniform(k, V, "cpu", generator=g)
    assert torch.equal(again[0], new[0][0]) and torch.equal(again[1], new[0][1])

    def laws(samples):
        first = torch.bincount(torch.stack([i[0] for i, _ in samples]), minlength=V).double() / n
        incl = torch.bincount(torch.cat([i for i, _ in samples]), minlength=V).double() / n
        tries = torch.stack([t for _, t in samples]).double()
        return first, incl, tries

    f0, i0, t0 = laws(old)
    f1, i1, t1 = laws(new)
    # Two independent samples of n: a difference of frequencies has sd sqrt(2 q (1 - q) / n).
    for a, b in ((f0, f1), (i0, i1)):
        q = (a + b) / 2
        assert ((a - b).abs() <= 5 * (2 * q * (1 - q) / n).sqrt() + 1e-9).all(), (a, b)
    assert (f1 - log_uniform_prob(torch.arange(V), V)).abs().max() < 0.03  # the first id follows p
    sd = ((t0.var() + t1.var()) / n).sqrt()
    assert abs(t0.mean() - t1.mean()) < 5 * sd, (t0.mean(), t1.mean())
    for q in (0.1, 0.5, 0.9):
        assert abs(float(t0.quantile(q) - t1.quantile(q))) <= max(1.0, 0.1 * float(t0.quantile(q)))


def test_sampled_softmax_on_every_row_equals_on_the_counted_rows():
    """BigLSTM.forward runs the softmax on every position and zeroes the ones that do not count; it
    used to select the counted rows first (h[mask], a host read on a GPU). Same sampled ids, same
    values and gradients for the counted rows, zero elsewhere."""
    V, P, N = 40, 6, 25
    sm = Softmax(V, P, num_sampled=9)
    torch.nn.init.normal_(sm.weight)
    torch.nn.init.normal_(sm.bias)
    h0, y = torch.randn(N, P), torch.randint(0, V, (N,))
    mask = torch.rand(N) < 0.7
    mask[:2] = torch.tensor([True, False])
    out, grads = [], []
    for old in (True, False):
        h = h0.clone().requires_grad_()
        sm.zero_grad()
        torch.manual_seed(3)  # the same sampled ids in both
        if old:
            nll = torch.zeros(N).masked_scatter(mask, sm(h[mask], y[mask]))
        else:
            nll = torch.where(mask, sm(h, y), 0.0)
        (nll * torch.linspace(0.5, 2, N)).sum().backward()
        out.append(nll.detach())
        grads.append([h.grad, sm.weight.grad, sm.bias.grad])
    torch.testing.assert_close(out[0], out[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sampled_softmax_approaches_full_softmax():
    """With many samples on a small vocabulary, the mean sampled loss is the full softmax's; with few,
    it is lower (TensorFlow's sampled_softmax_loss, which the reference code uses)."""
    torch.manual_seed(0)
    V, P, N = 50, 8, 32
    sm = Softmax(V, P, num_sampled=V - 1)
    torch.nn.init.normal_(sm.weight, 0, 0.5)
    torch.nn.init.normal_(sm.bias, 0, 0.5)
    h, y = torch.randn(N, P), torch.randint(0, V, (N,))
    with torch.no_grad():
        full = F.cross_entropy(h @ sm.weight.t() + sm.bias, y, reduction="none")
        many = torch.stack([sm(h, y) for _ in range(200)]).mean(0)
        sm.num_sampled = 10
        few = torch.stack([sm(h, y) for _ in range(200)]).mean(0)
    assert many.mean() == pytest.approx(float(full.mean()), rel=0.01)
    assert (many - full).abs().max() < 0.2
    assert few.mean() < many.mean()


def test_eval_perplexity_is_exp_of_mean_nll(data, monkeypatch):
    import models.lm as lm

    monkeypatch.setattr(lm, "_EVAL_CHUNK", 60 * 5)  # several chunks of 5 tokens
    torch.manual_seed(0)
    sm = Softmax(60, 8, num_sampled=12).eval()
    torch.nn.init.normal_(sm.weight)
    torch.nn.init.normal_(sm.bias)
    h, y = torch.randn(23, 8), torch.randint(0, 60, (23,))
    with torch.no_grad():
        assert torch.allclose(sm(h, y), F.cross_entropy(h @ sm.weight.t() + sm.bias, y, reduction="none"), atol=1e-5)
    # The task's evaluation over the whole test set: ppl = exp(sum NLL / targets), every target once.
    cfg = Config(model="biglstm", width=1 / 64, task=TaskCfg(data_root=str(data), num_sampled=12))
    cfg.train.batch_size = 8
    task = Task(cfg)
    _, test = task.datasets()
    model = task.build_model().eval()
    sums = {"nll": 0.0, "n": 0}
    with torch.no_grad():
        for b in torch.utils.data.DataLoader(test, batch_size=8):
            for k, v in task.eval_sums(model, b).items():
                sums[k] += v
    info = Prepared(data).info
    test_shard = next(s for s in info["shards"]["heldout"] if s["file"] == info["test"])
    assert sums["n"] == test_shard["words"] + test_shard["sentences"]  # words and </S>, not <S>
    m = task.eval_metrics(sums)
    mean = sums["nll"] / sums["n"]
    assert m["ppl"] == pytest.approx(math.exp(mean)) and m["nll"] == pytest.approx(mean)


# ------------------------------------------------------------------------------------------------
# data


def test_prep_vocabulary_shards_and_round_trip(archive, data):
    info = json.loads((data / "prepared.json").read_text())
    vocab = prep.load_vocab(data / "vocab.txt")
    counts = [int(ln.split(" ")[1]) for ln in (data / "vocab.txt").read_text().splitlines()]
    assert len(vocab) == info["vocab_size"] == len(set(vocab))
    assert {"<S>", "</S>", "<UNK>"} <= set(vocab) and counts == sorted(counts, reverse=True)
    assert not any(w.startswith("rare") for w in vocab)  # seen fewer than 3 times -> <UNK>
    assert len(info["shards"]["train"]) == 99 and len(info["shards"]["heldout"]) == 50
    assert info["test"] == "heldout/news.en.heldout-00000-of-00050.bin"
    with gzip.open(archive) as gz, tarfile.open(fileobj=gz) as tar:
        texts = {m.name.rsplit("/", 1)[-1]: tar.extractfile(m).read().decode() for m in tar if m.isfile()}
    for split in ("train", "heldout"):
        for s in info["shards"][split]:
            ids = np.fromfile(data / s["file"], dtype="<u4")
            assert ids.size == s["tokens"] == s["words"] + 2 * s["sentences"]
            original = texts[s["name"]].splitlines()
            assert len(original) == s["sentences"]
            if s["name"] in (prep.TRAIN[0], prep.TEST):
                expect = [" ".join(w if w in vocab else "<UNK>" for w in line.split()) for line in original]
                assert prep.text_of(ids, vocab) == expect
    assert info["totals"]["train_unk"] == 2 * 99  # the two one-off words of every training shard
    # Re-running leaves a complete output alone.
    before = {p: p.stat().st_mtime_ns for p in data.rglob("*")}
    assert prep.prepare(archive, data, workers=1, log=quiet)["skipped"]
    assert before == {p: p.stat().st_mtime_ns for p in data.rglob("*")}


def test_prep_errors_are_clear(archive, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        prep.prepare(tmp_path / "nope.tar.gz", tmp_path / "out", log=quiet)
    cut = tmp_path / "cut" / prep.ARCHIVE
    cut.parent.mkdir()
    cut.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(UserError, match="truncated or corrupt"):
        prep.prepare(cut, tmp_path / "out_cut", workers=1, log=quiet)
    # An unpacked release with a shard missing.
    unpacked = tmp_path / "unpacked"
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="data")
    (unpacked / prep.TOP / prep.TRAIN_DIR / prep.TRAIN[5]).unlink()
    with pytest.raises(UserError, match="lacks 1 of its 99"):
        prep.prepare(unpacked, tmp_path / "out_missing", workers=1, log=quiet)
    with pytest.raises(UserError, match="no prepared One Billion Word data"):
        Prepared(tmp_path / "out_missing")


def test_empty_release_is_an_error(archive, data, tmp_path):
    """A release whose training shards are all empty 'succeeded' with 0 tokens to train on;
    with a vocabulary given (no counting) too, and an empty test shard measured perplexity over nothing."""
    unpacked = tmp_path / "unpacked"
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="data")
    shards = unpacked / prep.TOP

    def emptied(names, folder):
        for name in names:
            (shards / folder / name).write_bytes(b"")

    emptied(prep.TRAIN, prep.TRAIN_DIR)
    with pytest.raises(UserError, match=r"the training shards of .* hold no words \(all empty\); re-download"):
        prep.prepare(unpacked, tmp_path / "o1", workers=1, log=quiet)
    with pytest.raises(UserError, match=r"the training shards of .* hold no words"):
        prep.prepare(unpacked, tmp_path / "o2", vocab=data / prep.VOCAB, workers=1, log=quiet)
    with tarfile.open(archive) as tar:  # the training shards back, the test shard empty
        tar.extractall(tmp_path / "unpacked2", filter="data")
    shards = tmp_path / "unpacked2" / prep.TOP
    emptied([prep.TEST], prep.HELDOUT_DIR)
    with pytest.raises(UserError, match=f"the test shard {prep.HELDOUT_DIR}/{prep.TEST} of .* holds no words"):
        prep.prepare(tmp_path / "unpacked2", tmp_path / "o3", workers=1, log=quiet)


def test_batch_rows_continue_their_streams(data):
    """With the engine's ordered sampler, every row of every micro-batch reads one stream, window
    after window, for any number of ranks and accumulation steps (dataset.py's index layout)."""
    p = Prepared(data)
    world, accum, micro = 2, 2, 3
    S = world * accum * micro
    ds = StreamWindows(TokenStream(p.shards("train")), S, 5, p.bos)
    steps = len(ds) // S
    for rank in range(world):
        idx = list(EpochSampler(len(ds), 0, False, rank, world, accum * micro))
        for j in range(steps):
            for a in range(accum):
                batch = [ds[i] for i in idx[(j * accum + a) * micro:(j * accum + a + 1) * micro]]
                assert [b["window"].item() for b in batch] == [j] * micro
                for row, b in enumerate(batch):
                    assert b["stream"].item() == rank + row * world + a * micro * world
                    if j > 0:  # continues exactly where the previous window of this stream ended
                        prev = ds[(j - 1) * S + b["stream"].item()]
                        assert prev["y"][-1] == b["x"][0]


# ------------------------------------------------------------------------------------------------
# training through the engine


@pytest.mark.heavy
def test_tiny_run_beats_unigram_perplexity(data, tmp_path):
    s = lm_main(run_args(data, tmp_path, "train.epochs=2"))
    assert s["status"] == "completed" and s["primary_metric"] == "ppl" and s["higher_is_better"] is False
    unigram = math.exp(Prepared(data).unigram_nll("test"))
    print(f"tiny bigLSTM test perplexity {s['metrics']['ppl']:.2f} vs unigram {unigram:.2f}")
    assert s["metrics"]["ppl"] < 0.5 * unigram
    d = tmp_path / "lm_biglstm" / s["run_name"]
    train = [ln for ln in lines(d) if ln["kind"] == "train"]
    assert math.exp(train[-1]["loss"]) < math.exp(train[0]["loss"])


@pytest.mark.heavy
def test_resume_is_bit_identical(data, tmp_path, monkeypatch):
    args = ["train.max_steps=6", "train.log_every=1", "numerics.every=0"]
    full = lm_main(run_args(data, tmp_path / "a", *args))
    part = run_interrupted(monkeypatch, lm_main, run_args(data, tmp_path / "b", *args), at_step=3)
    assert part["status"] == "interrupted" and part["step"] == 4
    resumed = lm_main(run_args(data, tmp_path / "b", *args))
    assert resumed["status"] == "completed" and resumed["metrics"] == full["metrics"]
    da, db = (tmp_path / x / "lm_biglstm" / full["run_name"] for x in ("a", "b"))
    assert [(x["step"], x.get("loss")) for x in lines(da)] == [(x["step"], x.get("loss")) for x in lines(db)]
    ca, cb = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (da, db))
    for k in ca["model"]:
        assert torch.equal(ca["model"][k], cb["model"][k]), k
    for (ha, sa), (hb, sb) in zip(ca["ranks"][0]["task"]["train"], cb["ranks"][0]["task"]["train"]):
        assert torch.equal(ha, hb) and torch.equal(sa, sb)


@pytest.mark.heavy
def test_loss_scaling_histograms(data, tmp_path):
    """The numerics histograms of FP16 activation gradients: at S = 1 a fifth of the tiny model's lie in
    FP16's subnormal range (the next halving flushes them to zero); S = 128 lifts them into the normal
    range. An FP32 run gives the true gradients' fraction below 2^-24."""
    bands = {}
    for prec, ls in (("fp16", "auto"), ("mixed", "128"), ("fp32", "auto")):
        s = lm_main(run_args(data, tmp_path, f"precision={prec}", "impl=paper", f"loss_scale={ls}",
                             "train.max_steps=1", "numerics.every=1"))
        num = [ln for ln in lines(tmp_path / "lm_biglstm" / s["run_name"]) if ln["kind"] == "numerics"]
        assert len(num) == 1 and sum(num[0]["numerics/act/overall/hist"]) > 0
        bands[prec] = {b: num[0][f"numerics/act/overall/frac_{b}"] for b in ("zero", "underflow", "subnormal")}
    assert bands["mixed"]["subnormal"] < 0.1 * bands["fp16"]["subnormal"]
    assert bands["mixed"]["zero"] <= bands["fp16"]["zero"]
    assert bands["fp16"]["underflow"] == bands["mixed"]["underflow"] == 0  # FP16 cannot hold them: zeros
    assert 0 <= bands["fp32"]["underflow"] < 1


@pytest.mark.heavy
def test_tiny_grid_through_launcher_into_figure5(data, tmp_path):
    out, tables = tmp_path / "runs", tmp_path / "tables"
    common = ["--profile", "tiny", "--backend", "local", "--set", f"out_dir={out}", f"task.data_root={data}",
              "train.max_steps=6", "train.log_every=2"]
    from paper_tables.__main__ import main as paper_tables
    from slurm.submit import main as submit

    for grid, only in (("grid.yaml", ["--only", "precision=fp32", "precision=fp16", "seed=0"]),
                       ("grid_scaled.yaml", ["--only", "loss_scale=128", "seed=0"])):
        submit([str(REPO / "experiments" / "lm_biglstm" / grid), *common, *only])  # each cell: a subprocess
    summaries = [json.loads(f.read_text()) for f in (out / "lm_biglstm").glob("*/summary.json")]
    assert sorted((s["precision"], s["loss_scale"]) for s in summaries) == [("fp16", "auto"), ("fp32", "auto"),
                                                                             ("mixed", "128")]
    assert all(s["status"] == "completed" for s in summaries)
    assert paper_tables(["--runs", str(out), "--out", str(tables)]) == 0
    assert (tables / "figure5_tiny.png").is_file()
    caption = (tables / "figure5_tiny.md").read_text()
    assert "lm_biglstm/biglstm" in caption and "not run yet" not in caption, caption


def test_memory_bytes_per_parameter():
    """The per-parameter state the README's memory extrapolation rests on (experiments/lm_biglstm/memory.py):
    FP32 weights + gradients + Adagrad = 12 bytes; the paper's scheme adds FP32 masters and their
    gradients to FP16 weights and gradients: 2 + 2 + 4 + 4 + 4 = 16 bytes -- except the softmax layer,
    FP32 as in the reference (f-lm) and its own master: 12 bytes."""
    from experiments.lm_biglstm.memory import SHAPES, measure

    fp32 = measure("fp32", "autocast", "auto", SHAPES[0])
    paper = measure("mixed", "paper", "128", SHAPES[0])
    assert (fp32["weights"], fp32["grads"], fp32["optimizer"], fp32["master"]) == (4, 4, 4, 0)
    parts = ("weights", "grads", "optimizer", "master", "master_grads")
    assert tuple(paper["parts"]["rest"][k] for k in parts) == (2, 2, 4, 4, 4)
    assert tuple(paper["parts"]["softmax"][k] for k in parts) == (4, 4, 4, 0, 0)
    assert 0 < paper["activations"] < fp32["activations"]


def test_softmax_fp32_under_paper_impl_as_the_reference():
    """f-lm keeps softmax_w / softmax_b in FP32 and feeds them FP32 inputs whatever its
    FP16 switches; impl=paper keeps them FP32 (their own master), autocast computes them in FP32, and
    task.softmax_fp16=true is the FP16 variant."""
    import models

    for prec, impl in (("mixed", "paper"), ("fp16", "paper"), ("fp16_storage", "paper"), ("mixed", "autocast")):
        torch.manual_seed(0)
        m = models.build("biglstm", vocab_size=50, width=1 / 128, num_sampled=8, dropout=0.0)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        r = precision.build(Config(precision=prec, impl=impl), "cpu")
        r.prepare(m, [opt])
        seen = {}
        m.softmax.register_forward_hook(lambda mod, args, out: seen.update(h=args[0].dtype))
        assert m.softmax.weight.dtype == m.softmax.bias.dtype == torch.float32, (prec, impl)
        held = {id(t) for t in r.master_params()}
        assert id(m.softmax.weight) in held  # its own master: no second FP32 copy
        x = torch.randint(0, 50, (2, 3))
        with r.autocast():
            nll, _ = m(x, x, torch.ones(2, 3, dtype=torch.bool))
        assert nll.dtype == torch.float32
        if impl == "paper":
            assert m.lstm[0].weight_ih_l0.dtype == torch.float16
            assert seen["h"] == torch.float32, (prec, impl)  # inputs cast to FP32 before the softmax
    m = models.build("biglstm", vocab_size=50, width=1 / 128, num_sampled=8, softmax_fp16=True)
    precision.build(Config(precision="mixed", impl="paper"), "cpu").prepare(m, [torch.optim.SGD(m.parameters(), lr=0.1)])
    assert m.softmax.weight.dtype == torch.float16


def test_real_text_release_prepares_like_the_benchmark(tmp_path):
    """data_prep.lm1b.real_text: real English in the official layout, through the real prep."""
    import math

    from data_prep.lm1b import prepare as prep
    from data_prep.lm1b.dataset import Prepared
    from data_prep.lm1b.real_text import generate

    archive = generate(tmp_path / "arch")
    assert generate(tmp_path / "arch2").read_bytes() == archive.read_bytes()  # deterministic
    info = prep.prepare(archive, tmp_path / "real", workers=1, log=lambda *a: None)
    assert info["vocab_size"] > 500 and info["totals"]["train_tokens"] > 20_000
    assert "the" in (tmp_path / "real" / "vocab.txt").read_text().split()
    assert math.exp(Prepared(tmp_path / "real").unigram_nll("test")) > 100  # real text: no easy grammar
