"""DeepSpeech 2 (Table 3, Figure 2): full-size parameter counts, LibriSpeech and AISHELL-1 prep of the
tiny espeak-ng releases and their bad inputs, tiny runs in the paper's precisions ending with a CER,
real learning (trained CER far below untrained), and Table 3 / Figure 2 regenerated from runs."""
import io
import json
import shutil
import tarfile

import pytest
import torch

from bad_input import assert_command_fails_in_one_line, retar, rewrite_tar
from conftest import REPO, model_from_checkpoint
from data_prep.speech import have_espeak
from mpt.errors import UserError

needs_espeak = pytest.mark.skipif(not have_espeak(), reason="espeak-ng is not installed (setup.sh installs it as "
                                                            "root: apt-get install espeak-ng); the tiny speech "
                                                            "releases are spoken by it")
QUIET = dict(log=lambda *a: None)


# The small networks here run far faster on one thread (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name,paper", [("english", 115e6), ("mandarin", 215e6)])
def test_full_size_parameter_counts(name, paper):
    """Within 5% of the paper's ~115M (English) and ~215M (Mandarin) parameters (section 4.3)."""
    import models

    with torch.device("meta"):  # no memory, no time: only the shapes
        n = sum(p.numel() for p in models.build(name).parameters())
    print(f"{name}: {n / 1e6:.1f}M parameters (paper ~{paper / 1e6:.0f}M)")
    assert abs(n - paper) / paper < 0.05, n


def test_tiny_model_forward_lengths():
    import models
    from models.deepspeech2 import out_lengths

    m = models.build("english", width=0.05, n_freq=81).eval()
    x, lengths = torch.randn(3, 81, 40), torch.tensor([40, 31, 7])
    for i, n in enumerate(lengths.tolist()):  # zero padding, as Task.collate pads
        x[i, :, n:] = 0
    logits, out = m(x, lengths)
    assert logits.shape == (3, 20, 29) and out.tolist() == out_lengths(lengths).tolist() == [20, 16, 4]
    # a shorter utterance padded to the batch gives the same outputs on its valid frames
    alone, _ = m(x[1:2, :, :31], lengths[1:2])
    torch.testing.assert_close(logits[1, :16], alone[0, :16], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# data


@pytest.fixture(scope="module")
def libri_archives(tmp_path_factory):
    if not have_espeak():
        pytest.skip("espeak-ng is not installed (setup.sh installs it as root)")
    from data_prep.librispeech.tiny import generate

    return generate(tmp_path_factory.mktemp("ls_arch"), train=24, dev=6)


@pytest.fixture(scope="module")
def libri(libri_archives, tmp_path_factory):
    from data_prep.librispeech import prepare as prep

    out = tmp_path_factory.mktemp("ls")
    prep.prepare(libri_archives, out, **QUIET)
    return out


@pytest.fixture(scope="module")
def aishell_archives(tmp_path_factory):
    if not have_espeak():
        pytest.skip("espeak-ng is not installed (setup.sh installs it as root)")
    from data_prep.aishell.tiny import generate

    return generate(tmp_path_factory.mktemp("ai_arch"), train=12, dev=4, test=2, per_speaker=6).parent


@pytest.fixture(scope="module")
def aishell(aishell_archives, tmp_path_factory):
    from data_prep.aishell import prepare as prep

    out = tmp_path_factory.mktemp("ai")
    prep.prepare(aishell_archives, out, **QUIET)
    return out


@needs_espeak
@pytest.mark.parametrize("corpus", ["librispeech", "aishell"])
def test_tiny_speech_archives_do_not_depend_on_the_clock(corpus, tmp_path, monkeypatch):
    """The same arguments give the same archive bytes at any time, so the same prepared.json digests and
    data_fingerprint: a run's data can be told from another machine's. tarfile's "w:gz" wrote the
    current time into the gzip header (a new fingerprint for every generation of the same audio)."""
    import importlib
    import time

    tiny = importlib.import_module(f"data_prep.{corpus}.tiny")
    small = dict(train=2, dev=1) if corpus == "librispeech" else dict(train=2, dev=1, test=1, per_speaker=2)
    digests = []
    for i, now in enumerate((1.7e9, 1.8e9)):
        monkeypatch.setattr(time, "time", lambda now=now: now)
        out = tmp_path / str(i)
        tiny.generate(out, **small)
        digests.append({f.name: f.read_bytes() for f in sorted(out.iterdir())})
    assert digests[0].keys() == digests[1].keys() and digests[0] == digests[1]


def _manifest(root, name):
    return [json.loads(x) for x in (root / "manifests" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]


@needs_espeak
def test_librispeech_layout_counts_resume(libri, libri_archives, tmp_path):
    import torchaudio

    from data_prep.librispeech import prepare as prep

    info = json.loads((libri / "prepared.json").read_text())
    assert {k: v["utterances"] for k, v in info["subsets"].items()} == {"train-clean-100": 24, "dev-clean": 6}
    rows = _manifest(libri, "train-clean-100")
    assert len(rows) == 24 and [r["duration"] for r in rows] == sorted(r["duration"] for r in rows)
    assert all((libri / r["audio"]).is_file() and r["text"].isupper() for r in rows)
    ds = torchaudio.datasets.LIBRISPEECH(str(libri), url="dev-clean")  # the tree torchaudio reads
    assert len(ds) == 6
    # resumable: an interrupted run (no marker, one subset's manifest gone) redoes only that subset
    out = tmp_path / "p"
    shutil.copytree(libri, out)
    (out / "prepared.json").unlink()
    (out / "manifests" / "dev-clean.info.json").unlink()
    msgs = []
    again = prep.prepare(libri_archives, out, log=msgs.append)
    assert again["subsets"] == info["subsets"] and any("train-clean-100: kept" in m for m in msgs)


@needs_espeak
def test_aishell_layout_counts_vocab(aishell):
    info = json.loads((aishell / "prepared.json").read_text())
    assert (info["train"], info["dev"], info["test"], info["untranscribed_wavs"]) == (12, 4, 2, 1)
    rows = _manifest(aishell, "train")
    vocab = (aishell / "vocab.txt").read_text(encoding="utf-8").split()
    assert info["vocab"] == len(vocab) and set("".join(r["text"] for r in rows)) == set(vocab)
    assert all(" " not in r["text"] and (aishell / r["audio"]).is_file() for r in rows)


@needs_espeak
@pytest.mark.parametrize("damage,msg", [
    ("missing", "no LibriSpeech archive"),
    ("truncated", "is truncated or not a tar.gz"),
    ("bad_audio", "is unreadable audio"),
    ("no_audio", "transcript lines have no FLAC"),
    ("unsafe", "unsafe member path"),
])
def test_librispeech_bad_inputs(libri_archives, tmp_path, damage, msg):
    from data_prep.librispeech import prepare as prep

    a = tmp_path / "a"
    shutil.copytree(libri_archives, a)
    z = a / "dev-clean.tar.gz"
    first = lambda n: n.endswith("-0000.flac")  # noqa: E731
    if damage == "missing":
        for f in a.iterdir():
            f.unlink()
    elif damage == "truncated":
        z.write_bytes(z.read_bytes()[: z.stat().st_size // 2])
    elif damage == "bad_audio":
        rewrite_tar(z, lambda n, d: (n, b"not a flac file" * 10 if first(n) else d))
    elif damage == "no_audio":
        rewrite_tar(z, lambda n, d: None if first(n) else (n, d))
    else:  # a member path leaving the output folder
        with tarfile.open(z, "r:gz") as t:
            members = [(m, t.extractfile(m).read()) for m in t if m.isfile()]
        with tarfile.open(z, "w:gz") as t:
            for m, d in members:
                t.addfile(m, io.BytesIO(d))
            info = tarfile.TarInfo("../evil.txt")
            info.size = 1
            t.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(UserError, match=msg):
        prep.prepare(a, tmp_path / "out", **QUIET)
    if damage == "truncated":  # and from the command line: one line, exit code 2
        assert_command_fails_in_one_line("data_prep.librispeech", a, tmp_path / "out2", msg)


@needs_espeak
@pytest.mark.parametrize("damage,msg", [
    ("missing", "no data_aishell.tgz"),
    ("truncated", "is truncated or not a tar.gz"),
    ("bad_audio", "is unreadable audio"),
    ("no_audio", "transcript lines have no WAV"),
])
def test_aishell_bad_inputs(aishell_archives, tmp_path, damage, msg):
    from data_prep.aishell import prepare as prep

    a = tmp_path / "a"
    a.mkdir()
    z = a / prep.ARCHIVE
    src = aishell_archives / prep.ARCHIVE

    def speaker(edit):  # rewrite the first speaker's inner archive
        return lambda n, d: (n, retar(d, edit) if n == f"{prep.ROOT}/wav/S0002.tar.gz" else d)

    first = lambda n: n.endswith("W0001.wav")  # noqa: E731
    if damage == "truncated":
        z.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    elif damage == "bad_audio":
        rewrite_tar(src, speaker(lambda n, d: (n, b"RIFF but not really" if first(n) else d)), dst=z)
    elif damage == "no_audio":
        rewrite_tar(src, speaker(lambda n, d: None if first(n) else (n, d)), dst=z)
    with pytest.raises(UserError, match=msg):
        prep.prepare(a, tmp_path / "out", **QUIET)


# ------------------------------------------------------------------------------------------------
# runs


def run_overrides(model, root, out_dir, *extra):
    return ["profile=tiny", f"model={model}", f"task.data_root={root}", f"out_dir={out_dir}",
            "wandb.mode=disabled", "train.progress=false", *extra]


def levenshtein(a, b) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def reference_error_rates(args: list[str]) -> tuple[float, float]:
    """CER and WER (percent) of a finished FP32 run's saved model on the validation utterances,
    computed outside the engine: its checkpoint loaded, one utterance at a time, CTC best-path
    decoding (the most likely symbol per frame, repeats merged, blanks dropped), edit distances by
    the textbook recurrence, summed over the set."""
    cfg, task, val, model = model_from_checkpoint("deepspeech2", args)
    errs = [0, 0, 0, 0]  # char errors, chars, word errors, words
    with torch.no_grad():
        for i in range(len(val)):
            feats, _, text = val[i]
            logits, lengths = model(feats[None], torch.tensor([feats.shape[1]]))
            best = logits[0, :int(lengths[0])].argmax(-1).tolist()
            hyp = "".join(task.facts.chars[k - 1] for j, k in enumerate(best) if k != 0 and (j == 0 or k != best[j - 1]))
            errs = [errs[0] + levenshtein(text, hyp), errs[1] + len(text),
                    errs[2] + levenshtein(text.split(), hyp.split()), errs[3] + len(text.split())]
    return 100 * errs[0] / errs[1], 100 * errs[2] / errs[3]


@pytest.fixture(scope="module")
def runs(libri, tmp_path_factory):
    """Two steps of the tiny English model in the paper's precisions (FP16 on a CPU is slow), the
    FP32 run with numerics sampled at every step (Figure 2b); fp16_storage is Table 3's MP column."""
    from experiments.deepspeech2 import main

    out = tmp_path_factory.mktemp("ds2_runs")
    summaries, args = {}, {}
    for prec in ("fp32", "fp16_storage", "fp16", "mixed", "fp16_pure"):
        extra = ["numerics.every=1"] if prec == "fp32" else []
        args[prec] = run_overrides("english", libri, out, f"precision={prec}", "impl=paper", "train.batch_size=4",
                                   "train.max_steps=2", "train.log_every=1", *extra)
        summaries[prec] = main(args[prec])
    return out, summaries, args


@pytest.mark.heavy
@needs_espeak
@pytest.mark.parametrize("prec", ["fp32", "fp16_storage", "fp16", "mixed", "fp16_pure"])
def test_tiny_run_ends_with_cer(runs, prec):
    s = runs[1][prec]
    assert s["status"] == "completed" and s["step"] == 2, s
    m = s["metrics"]
    assert {"cer", "wer"} <= set(m) and m["loss"] > 0, m  # CTC: minus a log-probability
    if prec == "fp32":  # the reported rates are the saved model's (the FP16 runs evaluate in FP16)
        cer, wer = reference_error_rates(runs[2][prec])
        assert (m["cer"], m["wer"]) == (pytest.approx(cer, abs=1e-3), pytest.approx(wer, abs=1e-3)), m


@pytest.mark.heavy
@needs_espeak
def test_mandarin_run(aishell, tmp_path):
    from experiments.deepspeech2 import main

    args = run_overrides("mandarin", aishell, tmp_path, "train.batch_size=4", "train.max_steps=2")
    s = main(args)
    assert s["status"] == "completed" and s["precision"] == "fp32"
    assert s["metrics"]["cer"] == pytest.approx(reference_error_rates(args)[0], abs=1e-3), s["metrics"]


@pytest.mark.heavy
@needs_espeak
def test_table3_and_figure2_regenerated(runs, tmp_path):
    from paper_tables.__main__ import main as tables

    out = tmp_path / "tables"
    tables(["--runs", str(runs[0]), "--out", str(out)])
    t3 = (out / "table3_tiny.md").read_text()
    assert "English" in t3 and "TINY PROFILE" in t3, t3
    # Table 3's MP column is the paper's "FP16 storage, FP32 math" (4.3); fp16 and mixed are extra columns
    head, row = t3.splitlines()[[ln.startswith("| Model") for ln in t3.splitlines()].index(True)], \
        next(ln for ln in t3.splitlines() if ln.startswith("| English"))
    cols = [c.strip() for c in head.split("|")[1:-1]]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    mp = cols.index("Mixed precision (fp16_storage)")
    assert "(n=1)" in cells[mp] and cells[mp + 1] == "1.99", (cols, cells)
    assert "FP16 math, no loss scaling (fp16, S=1)" in cols, cols
    f2a, f2b = (out / "figure2a_tiny.md").read_text(), (out / "figure2b_tiny.md").read_text()
    assert "deepspeech2/english" in f2a and "no master copy" in f2a, f2a
    assert "deepspeech2" in f2b and (out / "figure2b_tiny.png").is_file(), f2b


def test_unprepared_data_is_one_line(tmp_path, capsys):
    from mpt.cli import cli_main

    with pytest.raises(SystemExit) as e:  # the command's own entry point, in-process (no interpreter start)
        cli_main("deepspeech2", run_overrides("english", tmp_path / "nowhere", tmp_path))
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1 and "not a prepared dataset" in lines[0], lines


@pytest.mark.slow
@needs_espeak
def test_trained_cer_below_untrained(tmp_path_factory):
    """Real learning: the tiny profile (120 steps of 32) against the same network untrained, on unseen voices."""
    from data_prep.librispeech import prepare as prep
    from data_prep.librispeech.tiny import generate
    from experiments.deepspeech2 import main

    arch = generate(tmp_path_factory.mktemp("ls_full"))
    root = tmp_path_factory.mktemp("ls_full_prep")
    prep.prepare(arch, root, **QUIET)
    out = tmp_path_factory.mktemp("ds2_trained")
    untrained = main(run_overrides("english", root, out, "train.max_steps=1", "optim.lr=0"))
    trained = main(run_overrides("english", root, out))
    # Measured (experiments/deepspeech2/README.md "Results" and "The blank's prior", AMD EPYC): the untrained
    # network, started at the blank's prior, outputs only blanks (100% CER, dev CTC loss 75.6 per utterance);
    # seeds 0-9 end at 21.4-37.3% (28.1 +- 4.6), their dev loss at 0.25-0.38 x the untrained one. Where a seed
    # ends moves with the CPU's kernels (a reordered sum moves a tiny DS2 run by points), so seed 0 may end
    # where any of them did: the bounds hold for all ten with room -- 0.6 x untrained CER (60%) and 0.5 x its
    # dev loss -- and still fail a run that did not learn.
    m, m0 = trained["metrics"], untrained["metrics"]
    assert m["cer"] < 0.6 * m0["cer"] and m["loss"] < 0.5 * m0["loss"], (m, m0)


@pytest.mark.slow
@needs_espeak
def test_longer_grid_learns_clearly(tmp_path_factory):
    """grid_longer.yaml's FP32 seed-0 cell exactly as the grid resolves it -- the tiny English model, 12
    epochs after a 2-epoch warmup, on a release three times the default's (1,440 training utterances, 200 dev
    utterances of unseen voices): it ends far below the untrained network (README "Three times the data,
    trained longer": measured 8.7% CER against 94.0% untrained, dev loss 10.2 against 269.4; ~5 min)."""
    from data_prep.librispeech import prepare as prep
    from data_prep.librispeech.tiny import generate
    from experiments.deepspeech2 import main
    from slurm.grid import load

    arch = generate(tmp_path_factory.mktemp("ls_1440"), train=1440, dev=200)
    root = tmp_path_factory.mktemp("ls_1440_prep")
    prep.prepare(arch, root, **QUIET)
    out = tmp_path_factory.mktemp("ds2_1440")
    (cell,) = load(REPO / "experiments/deepspeech2/grid_longer.yaml", "tiny", [f"task.data_root={root}", f"out_dir={out}"],
                   ["precision=fp32", "seed=0"]).cells
    untrained = main(cell.overrides + ["train.max_steps=1", "optim.lr=0"])
    trained = main(cell.overrides)
    m, m0 = trained["metrics"], untrained["metrics"]
    # a quarter of the untrained CER is ~2.7x what every seed and precision reached (6.0-14.2%)
    assert m["cer"] < 0.25 * m0["cer"] and m["loss"] < 0.1 * m0["loss"], (m, m0)


# ------------------------------------------------------------------------------------------------
# batch norm over the valid frames, and padding to a multiple (no host reads on a GPU)


def _old_sequence_bn(bn, x, mask):
    """SequenceBatchNorm as it was: batch norm of the selected frames (a host read on a GPU)."""
    out = torch.zeros_like(x)
    out[mask] = bn(x[mask]).to(x.dtype)
    return out


@pytest.mark.parametrize("train", [True, False])
def test_masked_batch_norm_equals_batch_norm_of_the_selected_frames(train):
    """masked_batch_norm (masked sums) against torch's batch norm of x[mask]: output, gradients of the
    input, weight and bias, running statistics; padding rows stay zero. Sequence (N, T, C) and the
    convolutions' (N, C, F, T) layout, whose mask keeps every frame before the longest utterance."""
    import copy

    from models.deepspeech2 import SequenceBatchNorm, masked_batch_norm

    torch.manual_seed(0)
    N, T, C = 4, 9, 5
    lengths = torch.tensor([9, 5, 1, 7])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    new = SequenceBatchNorm(C)
    torch.nn.init.normal_(new.bn.weight)
    torch.nn.init.normal_(new.bn.bias)
    new.bn.running_mean.normal_()
    new.bn.running_var.uniform_(0.5, 2)
    old = copy.deepcopy(new)
    new.train(train)
    old.train(train)
    x0 = torch.randn(N, T, C) * 3 + 1
    x0[~mask] = torch.randn(int((~mask).sum()), C) * 100  # what padding holds must not matter
    w = torch.randn(N, T, C)
    outs = []
    for m, f in ((old, lambda x: _old_sequence_bn(m.bn, x, mask)), (new, lambda x: m(x, mask))):
        x = x0.clone().requires_grad_()
        y = f(x)
        (y * w).sum().backward()
        outs.append((y.detach(), x.grad, m.bn.weight.grad, m.bn.bias.grad, m.bn.running_mean, m.bn.running_var))
    assert (outs[1][0][~mask] == 0).all() and (outs[1][1][~mask] == 0).all()
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert int(new.bn.num_batches_tracked) == int(old.bn.num_batches_tracked)

    # The convolutions' layout: statistics over frames t < t_max of every utterance (padding of
    # the shorter ones included, as exact-length padding had them), not the frames beyond.
    bn_old = torch.nn.BatchNorm2d(3).train(train)
    bn_old.running_var.fill_(1.5)
    bn_new = copy.deepcopy(bn_old)
    t_max, pad = 6, 4
    z0 = torch.randn(2, 3, 5, t_max + pad)
    v = torch.randn(2, 3, 5, t_max)
    z_old, z_new = z0[..., :t_max].clone().requires_grad_(), z0.clone().requires_grad_()
    y_old = bn_old(z_old)
    (y_old * v).sum().backward()
    y = masked_batch_norm(z_new, torch.arange(t_max + pad) < torch.tensor(t_max), bn_new, dim=1)
    (y[..., :t_max] * v).sum().backward()
    torch.testing.assert_close(y[..., :t_max], y_old, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z_new.grad[..., :t_max], z_old.grad, rtol=1e-5, atol=1e-5)
    assert (z_new.grad[..., t_max:] == 0).all()
    for a, b in ((bn_new.weight.grad, bn_old.weight.grad), (bn_new.bias.grad, bn_old.bias.grad),
                 (bn_new.running_mean, bn_old.running_mean), (bn_new.running_var, bn_old.running_var)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_padding_to_a_multiple_changes_nothing():
    """task.pad_to_multiple: a batch padded to 64 frames gives the loss, the gradients and the
    batch-norm running statistics of the same batch padded to its longest utterance; the host
    lengths CTC reads are the model's output lengths."""
    import copy

    from experiments.deepspeech2.task import ENGLISH, Task, TaskCfg
    from mpt.config import Config

    torch.manual_seed(0)
    cfg = Config(model="english", width=0.05, task=TaskCfg(window_ms=10.0))  # 10 ms: 81 bins
    task = Task(cfg, Task.Facts(chars=ENGLISH))
    model = task.build_model().train().double()  # FP64: what is left is rounding of the CTC's FP32
    samples = [(torch.randn(81, n, dtype=torch.float64), torch.randint(1, 29, (k,)), "x" * k)
               for n, k in ((37, 5), (50, 9), (12, 2))]
    res = []
    for k in (1, 64):
        task.cfg.task.pad_to_multiple = k
        b = task.collate(samples)
        assert b["x"].shape[-1] == (50 if k == 1 else 64)
        m = copy.deepcopy(model)
        loss, log_probs, lengths = task.ctc(m, b)
        assert b["host_lengths"] == [lengths.tolist(), b["target_lengths"].tolist()]
        loss.backward()
        bns = [t for name, t in m.named_buffers() if "running" in name]
        res.append((loss.detach(), [p.grad for p in m.parameters()], bns, log_probs.detach(), lengths))
    torch.testing.assert_close(res[0][0], res[1][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(res[0][1] + res[0][2], res[1][1] + res[1][2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for i, n in enumerate(res[0][4].tolist()):  # every valid frame's output
        torch.testing.assert_close(res[0][3][i, :n], res[1][3][i, :n], rtol=1e-5, atol=1e-5)


def test_bucketed_order_shuffles_whole_batches_of_neighbours():
    """task.bucket_batches: after the SortaGrad epoch, each batch is a run of duration neighbours
    (consecutive indices of the sorted set) and the batches' order changes with the epoch; the
    order is a permutation, the tail past the last whole batch kept at the end."""
    from experiments.deepspeech2.task import ENGLISH, Task, TaskCfg
    from mpt.config import Config, TrainCfg

    cfg = Config(model="english", width=0.05, train=TrainCfg(batch_size=4), task=TaskCfg(bucket_batches=True))
    task = Task(cfg, Task.Facts(chars=ENGLISH))
    train = range(18)
    assert list(task.train_order(train, 0, torch.Generator().manual_seed(0))) == list(range(18))  # SortaGrad
    orders = [task.train_order(train, e, torch.Generator().manual_seed(e)) for e in (1, 2)]
    for order in orders:
        assert sorted(order) == list(range(18)) and order[16:] == [16, 17]
        for b in range(4):
            batch = order[4 * b: 4 * b + 4]
            assert batch[0] % 4 == 0 and batch == list(range(batch[0], batch[0] + 4)), order
    assert orders[0] != orders[1]


def test_conv_channels_override():
    """task.conv_channels sets the convolutions' width apart from the GRUs' (0: scaled by width)."""
    import models

    assert models.build("english", width=0.05, n_freq=81).conv[0][0].out_channels == 4
    m = models.build("english", width=0.05, n_freq=81, conv_channels=8)
    assert m.conv[0][0].out_channels == m.conv[1][0].out_channels == 8 and m.grus[0].input_size == 8 * 21


def test_blank_prior_starts_the_blank_at_its_share():
    """blank_prior=p: with the other outputs' biases equal, the untrained output puts p on the blank (index 0)
    and shares the rest evenly; 0 leaves nn.Linear's own start (DS2's)."""
    import models

    m = models.build("english", width=0.05, n_freq=81, blank_prior=0.9)
    b = m.fc.bias.detach().clone()
    b[1:] = 0
    p = torch.softmax(b, 0)
    assert p[0].item() == pytest.approx(0.9) and torch.allclose(p[1:], torch.full((28,), 0.1 / 28))
    plain = models.build("english", width=0.05, n_freq=81).fc
    assert plain.bias.abs().max() <= plain.in_features ** -0.5  # nn.Linear's uniform start
    with pytest.raises(ValueError, match="blank_prior=1.0"):
        models.build("english", width=0.05, n_freq=81, blank_prior=1.0)


def _write_manifest(root, name, rows):
    (root / "manifests").mkdir(parents=True, exist_ok=True)
    (root / "manifests" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_blank_share_from_the_training_manifests(tmp_path):
    """task.blank_prior_init: the blank's share is 1 - target characters / output frames over the training
    utterances (a 1 s utterance at a 10 ms hop: 101 spectrogram frames, 51 after the convolutions' stride;
    characters the model cannot output are not targets); the model starts there. Transcripts longer than
    their frames are one line naming the key."""
    import math

    from experiments.deepspeech2.task import ENGLISH, Task, TaskCfg, blank_share, manifest_rows
    from mpt.config import Config

    rows = [{"id": "a", "audio": "a.flac", "duration": 1.0, "text": "AB C"},
            {"id": "b", "audio": "b.flac", "duration": 1.0, "text": "xyz!"}]  # "!": not an output
    _write_manifest(tmp_path, "train-clean-100", rows)
    share = blank_share(manifest_rows(tmp_path, ["train-clean-100"]), ENGLISH, True, 160)
    assert share == pytest.approx(1 - 7 / 102)
    cfg = Config(model="english", width=0.05, task=TaskCfg(data_root=str(tmp_path), train_sets=["train-clean-100"],
                                                         hop_ms=10.0, blank_prior_init=True))
    bias = Task(cfg, Task.Facts(chars=ENGLISH)).build_model().fc.bias
    assert bias[0].item() == pytest.approx(math.log(share * 28 / (1 - share)), rel=1e-6)
    _write_manifest(tmp_path, "train-clean-100", [{**rows[0], "text": "a" * 51}])
    with pytest.raises(UserError, match="51 characters for 51 output frames.*blank_prior_init=false"):
        Task(cfg, Task.Facts(chars=ENGLISH)).build_model()
