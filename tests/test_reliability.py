"""Faults a run meets on a shared cluster, one test per item: a torn metrics
line, a damaged summary, a completed result re-run, stop signals, tampered archives, file modes,
stale temp files, a full disk and other one-line errors, two copies of one run, equal values as
one cell, wandb without a network."""
import contextlib
import dataclasses
import errno
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import warnings
import zipfile

import pytest
import torch

from conftest import REPO, run_interrupted
from conftest import mount_tmpfs as _mount_tmpfs
from mpt import config as C
from mpt import config_parse, identity, registry
from mpt import cli, engine
from mpt.record import RunRecord
from mpt.errors import UserError, one_line
from mpt.rundir import RunDirBusy, RunLock, atomic_torch_save
from mpt.signals import STOP_SIGNALS
from slurm import state
from toy_gan import ToyGan, config, run_task

torch.set_num_threads(1)
KEYS = ("kind", "step", "loss", "loss_D", "loss_G", "gap", "lr", "loss_scale", "skipped_steps")


def lines(d):
    return [{k: x.get(k) for k in KEYS} for x in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())]


def same_weights(da, db):
    ca, cb = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (da, db))
    return ca["step"] == cb["step"] and all(torch.equal(ca["model"][k], cb["model"][k]) for k in ca["model"])


def interrupted(monkeypatch, out, at_step=4, **kw):
    s = run_interrupted(monkeypatch, lambda _: run_task(config(out, **kw), ToyGan), None, at_step=at_step)
    assert s["status"] == "interrupted"
    return s, out / "toy_gan" / s["run_name"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted toy run every resumed one must equal."""
    out = tmp_path_factory.mktemp("reference")
    s = run_task(config(out), ToyGan)
    return s, out / "toy_gan" / s["run_name"]


# 1. a torn last line of metrics.jsonl; a corrupt summary.json; slurm.status names the bad file
def test_torn_metrics_line_is_dropped_and_the_run_resumes_bit_identically(tmp_path, monkeypatch, reference, capfd):
    ref, ref_dir = reference
    _, d = interrupted(monkeypatch, tmp_path)
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 99, "ep')  # what ENOSPC mid-append leaves
    s = run_task(config(tmp_path), ToyGan)
    assert s["status"] == "completed" and s["metrics"] == ref["metrics"]
    assert "dropped 1 unreadable (torn) line" in capfd.readouterr().err
    assert lines(d) == lines(ref_dir) and same_weights(d, ref_dir)


def test_corrupt_summary_does_not_block_a_resume_and_status_names_it(tmp_path, monkeypatch, reference):
    ref, _ = reference
    _, d = interrupted(monkeypatch, tmp_path)
    (d / "summary.json").write_text('{"status": "interr')
    st = state.cell_state(d, "x", None, None)
    assert str(d / "summary.json") in st.error and "unreadable" in st.error
    s = run_task(config(tmp_path), ToyGan)
    assert s["status"] == "completed" and s["metrics"] == ref["metrics"]
    assert json.loads((d / "summary.json").read_text())["status"] == "completed"


def test_status_survives_wrong_typed_summary_fields(tmp_path, monkeypatch, capsys):
    d = tmp_path / "run"
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"status": "completed", "step": "12", "total_steps": 12.0,
                                                "primary_metric": "gap", "metrics": {"gap": "0.1"}}))
    (d / "job.json").write_text(json.dumps({"job_id": "local:h:1", "attempts": "many"}))
    (d / "metrics.jsonl").write_text('{"kind": "train", "step": "x", "loss": "nan?"}\n[1, 2]\n')
    st = state.cell_state(d, "x", None, None)
    assert st.state == "completed" and st.step is None and st.total_steps == 12 and st.latest == ""
    assert "summary.json has wrong-typed field(s) step='12'" in st.error and "job.json" in st.error
    from slurm import status

    cell = type("Cell", (), {"run_name": "r", "cell_id": "x", "run_dir": d, "axes": {}})()
    monkeypatch.setattr(status, "collect", lambda *a, **k: (None, [(cell, st)], False))
    status.main(["grid.yaml", "--profile", "tiny"])  # the table, with the note, and no traceback
    assert "wrong-typed field(s) step='12'" in capsys.readouterr().out


# 2. a completed result is never replaced by a later invocation's failure
def test_completed_result_is_never_replaced(tmp_path):
    out = tmp_path
    s = run_task(config(out), ToyGan)
    d = out / "toy_gan" / s["run_name"]
    summary, metrics = (d / "summary.json").read_bytes(), (d / "metrics.jsonl").read_bytes()

    class Broken(ToyGan):
        def datasets(self):
            raise FileNotFoundError("/nonexistent/train")

    # a final result is returned before the data is even opened: a later invocation that could not
    # read it (moved, unmounted) neither fails nor touches the result
    assert run_task(config(out), Broken)["metrics"] == s["metrics"]
    assert (d / "summary.json").read_bytes() == summary
    (d / "checkpoint.pt").unlink()  # a result does not need its checkpoint
    again = run_task(config(out), ToyGan)
    assert again["status"] == "completed" and again["metrics"] == s["metrics"]
    assert (d / "summary.json").read_bytes() == summary and (d / "metrics.jsonl").read_bytes() == metrics


def test_completed_result_with_a_truncated_checkpoint_is_kept(tmp_path):
    """A final result is returned before its checkpoint is read, so a checkpoint cut
    short afterwards (a full disk during a copy) does not turn it into "delete it to restart"."""
    s = run_task(config(tmp_path), ToyGan)
    d = tmp_path / "toy_gan" / s["run_name"]
    ckpt = d / "checkpoint.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    with pytest.raises(Exception):  # it is unreadable indeed
        torch.load(ckpt, weights_only=True)
    summary = (d / "summary.json").read_bytes()
    again = run_task(config(tmp_path), ToyGan)
    assert again["status"] == "completed" and again["metrics"] == s["metrics"]
    assert (d / "summary.json").read_bytes() == summary


class _Killed(BaseException):
    """A kill -9: nothing after it runs, nothing is recorded."""


def test_kill_between_final_checkpoint_and_summary_logs_one_final_eval(tmp_path, monkeypatch, reference):
    """Killed after the last checkpoint (written after the final evaluation) and
    before summary.json says completed, the re-run resumed at the last step and evaluated again, so
    metrics.jsonl held the final eval line twice. Now the result equals the uninterrupted run's."""
    ref, ref_dir = reference

    def finish(self, status, *a, **k):
        raise _Killed(status)

    monkeypatch.setattr(engine.Run, "finish", finish)
    monkeypatch.setattr(RunRecord, "record_failure", lambda *a, **k: None)
    with pytest.raises(_Killed, match="completed"):
        run_task(config(tmp_path), ToyGan)
    monkeypatch.undo()
    d = tmp_path / "toy_gan" / ref["run_name"]
    assert json.loads((d / "summary.json").read_text())["status"] == "running"
    assert torch.load(d / "checkpoint.pt", weights_only=True)["step"] == ref["step"]
    s = run_task(config(tmp_path), ToyGan)
    assert s["status"] == "completed" and s["metrics"] == ref["metrics"]
    assert [x["step"] for x in lines(d) if x["kind"] == "eval"] == [x["step"] for x in lines(ref_dir) if x["kind"] == "eval"]
    assert lines(d) == lines(ref_dir) and same_weights(d, ref_dir)


# 3 + 8. SIGTERM / SIGINT stop at a step boundary with a checkpoint, exit 128 + signal, and the
# resumed run equals the uninterrupted one; a second copy of a running run is refused
def _check_stopped_then_resumed(d, out, sig, reference):
    ref, ref_dir = reference
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "interrupted" and 2 <= s["step"] < 12, s
    assert s["error"] == f"stopped: {signal.Signals(sig).name}"
    assert torch.load(d / "checkpoint.pt", weights_only=True)["step"] == s["step"]
    resumed = run_task(config(out), ToyGan)
    assert resumed["status"] == "completed" and resumed["metrics"] == ref["metrics"]
    assert lines(d) == lines(ref_dir) and same_weights(d, ref_dir)


def test_sigterm_from_another_process_checkpoints_exits_143_and_resumes(tmp_path, reference):
    """A real `kill` of a real command (tests/toy_cli.py runs mpt.cli.cli_run, as experiments do)."""
    out = tmp_path / "sig"
    d = out / "toy_gan" / reference[0]["run_name"]
    p = subprocess.Popen([sys.executable, str(REPO / "tests" / "toy_cli.py"), str(out), "12", "0.3"],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not ((d / "metrics.jsonl").exists()
                                              and (d / "metrics.jsonl").read_text().count('"train"') >= 2):
            time.sleep(0.05)
        # item 8: a second copy of the run (this process) is refused, naming the holder
        with pytest.raises(RunDirBusy, match=rf"in use by pid {p.pid} on "):
            run_task(config(out), ToyGan)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err
    _check_stopped_then_resumed(d, out, signal.SIGTERM, reference)


def test_closed_terminal_checkpoints_exits_129_and_resumes(tmp_path, reference):
    """SIGHUP (the terminal or ssh session closed) killed the run with no checkpoint and left its
    summary "running". It now stops like SIGTERM; its output, a terminal gone, goes nowhere instead of
    failing the run on the first print (EIO)."""
    import pty
    import threading

    out = tmp_path / "hup"
    d = out / "toy_gan" / reference[0]["run_name"]
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, str(REPO / "tests" / "toy_cli.py"), str(out), "12", "0.3"],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)

    def drain():  # what the terminal would show, until it is closed
        try:
            while os.read(master, 4096):
                pass
        except OSError:
            pass

    threading.Thread(target=drain, daemon=True).start()
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not ((d / "metrics.jsonl").exists()
                                              and (d / "metrics.jsonl").read_text().count('"train"') >= 2):
            time.sleep(0.05)
        os.close(master)  # the terminal is gone: writes to it fail from now on
        p.send_signal(signal.SIGHUP)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGHUP
    _check_stopped_then_resumed(d, out, signal.SIGHUP, reference)


def test_ctrl_c_checkpoints_exits_130_and_resumes(tmp_path, reference):
    """A real SIGINT delivered to this process mid-run, through the command's handlers (cli_run)."""

    class CtrlC(ToyGan):
        def train_step(self, ctx, micro):
            if ctx.iteration == 3:
                os.kill(os.getpid(), signal.SIGINT)
            return super().train_step(ctx, micro)

    old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        with pytest.raises(SystemExit) as e:
            cli.cli_run(lambda: run_task(config(tmp_path), CtrlC))
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        engine.STOP.clear()
    assert e.value.code == 130
    _check_stopped_then_resumed(tmp_path / "toy_gan" / reference[0]["run_name"], tmp_path, signal.SIGINT, reference)


@pytest.mark.parametrize("name", [".lock", "metrics.jsonl"])
def test_a_symlink_planted_in_a_run_folder_is_refused_not_followed(tmp_path, name):
    """Run folders are group-writable under umask 002: a `.lock` link made the run truncate and
    overwrite its target, a metrics.jsonl link appended to it. Neither is followed now."""
    from mpt.rundir import append_jsonl

    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(target)
    with pytest.raises(UserError, match=rf"{run / name} is a symbolic link, where this writes a file of its own"):
        RunLock(run).acquire() if name == ".lock" else append_jsonl(run / name, {"kind": "train"})
    assert target.read_text() == "keep me\n"


def test_lock_is_released_when_its_holder_dies(tmp_path):
    """flock, not a pid file: a holder killed with -9 leaves no stale lock."""
    code = ("import sys, time; sys.path.insert(0, sys.argv[2]); from mpt.rundir import RunLock; "
            "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(REPO)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy, match=f"pid {p.pid}"):
            RunLock(tmp_path).acquire()
    finally:
        p.kill()
        p.wait()
    RunLock(tmp_path).acquire().release()


# 4. names taken from archives cannot write outside --out
def _files(root):
    return {str(p) for p in root.rglob("*")}


def test_tampered_imagenet_devkit_writes_nothing(tmp_path, monkeypatch):
    from data_prep.imagenet import prepare as prep
    from data_prep.imagenet import tiny

    monkeypatch.setattr(tiny, "wnid", lambda k: "../../escaped" if k == 0 else f"n{k + 1:08d}")
    arch = tmp_path / "archives"
    tiny.generate(arch, classes=2, train_per_class=1, val_per_class=1, size=8)
    before = _files(tmp_path)
    with pytest.raises(UserError, match=r"unsafe WNID in data/meta.mat '\.\./\.\./escaped'"):
        prep.prepare(arch, tmp_path / "a" / "b" / "out", workers=1, log=lambda *a: None)
    assert _files(tmp_path) == before  # nothing written at all, inside --out or outside


def test_tampered_celeba_and_lm1b_members_are_refused(tmp_path):
    from data_prep.celeba import prepare as celeba
    from data_prep.lm1b import prepare as lm1b

    arch = tmp_path / "celeba"
    arch.mkdir()
    with zipfile.ZipFile(arch / celeba.ZIP, "w") as zf:
        zf.writestr(f"{celeba.FOLDER}/../../../escaped.jpg", b"\xff\xd8")
    (arch / celeba.PARTITION).write_text("escaped.jpg 0\n")
    before = _files(tmp_path)
    with pytest.raises(UserError, match="unsafe member path"):
        celeba.prepare(arch, tmp_path / "o1" / "out", log=lambda *a: None)
    assert _files(tmp_path) == before

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo(f"../../{lm1b.TRAIN_DIR}/{lm1b.TRAIN[0]}")
        info.size = 6
        tar.addfile(info, io.BytesIO(b"a b c\n"))
    (tmp_path / lm1b.ARCHIVE).write_bytes(buf.getvalue())
    out = tmp_path / "o2" / "out"
    with pytest.raises(UserError, match="unsafe member path"):
        lm1b.prepare(tmp_path / lm1b.ARCHIVE, out, workers=1, log=lambda *a: None)
    new = _files(tmp_path) - before - {str(tmp_path / lm1b.ARCHIVE)}
    assert all(p.startswith(str(out)) or str(out).startswith(p + os.sep) for p in new), new


# 5. files honour the umask (group-readable on shared storage)
@pytest.mark.parametrize("mask,mode", [(0o002, 0o664), (0o077, 0o600)])
def test_files_follow_the_umask(tmp_path, mask, mode):
    old = os.umask(mask)
    try:
        s = run_task(config(tmp_path, train={"max_steps": 2}), ToyGan)
    finally:
        os.umask(old)
    d = tmp_path / "toy_gan" / s["run_name"]
    for name in ("summary.json", "config.yaml", "env.json", "checkpoint.pt", "metrics.jsonl"):
        assert (d / name).stat().st_mode & 0o777 == mode, name


# 6. temp files of a writer killed mid-write are removed when the run starts again
def test_stale_temp_files_are_removed_at_start(tmp_path, monkeypatch):
    _, d = interrupted(monkeypatch, tmp_path)
    for name in (".checkpoint.pt.k9x2abcd.tmp", ".summary.json.zz1_ab9c.tmp"):  # mkstemp's 8 characters
        (d / name).write_bytes(b"\0" * 1000)
    keep, not_ours = d / "samples_0000004.png", d / ".notes.tmp"  # a user's hidden file is not ours to delete
    not_ours.write_text("mine")
    assert run_task(config(tmp_path), ToyGan)["status"] == "completed"
    assert list(d.glob(".*.tmp")) == [not_ours] and keep.exists()


# 7. one-line errors: disk full, unwritable out_dir, a bad config.yaml, device=cuda without CUDA,
# errors in DataLoader workers


@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB tmpfs filled up, else None."""
    mnt = tmp_path / "tmpfs"
    if not _mount_tmpfs(mnt, "size=256k"):
        yield None
        return
    try:
        (mnt / "runs").mkdir()
        with open(mnt / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_disk_full_is_a_one_line_error(full_disk, tmp_path, monkeypatch):
    where = full_disk
    if where is None:  # no tmpfs here: the same failure, raised where the kernel would raise it
        def fsync(fd):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "fsync", fsync)
        where = tmp_path
        (where / "runs").mkdir()
    with pytest.raises(UserError) as e:  # torch itself says "unexpected pos"
        atomic_torch_save(where / "runs" / "checkpoint.pt", {"w": torch.zeros(100_000)})
    assert str(e.value).startswith(f"No space left on device: {where / 'runs' / 'checkpoint.pt'}")
    assert not list((where / "runs").glob(".*.tmp"))
    with pytest.raises(UserError, match="^No space left on device: .*config.yaml"):
        run_task(config(where / "runs"), ToyGan)


def test_unwritable_out_dir_is_a_one_line_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"^Not a directory: .*file/toy_gan"):
        run_task(config(tmp_path / "file"), ToyGan)
    ro = tmp_path / "ro"
    if _mount_tmpfs(ro, "ro,size=64k"):  # permissions do not stop root; a read-only mount does
        try:
            with pytest.raises(UserError, match=r"^Read-only file system: .*ro/toy_gan"):
                run_task(config(ro), ToyGan)
        finally:
            subprocess.run(["umount", str(ro)], capture_output=True)
    elif os.geteuid() != 0:
        ro.chmod(0o500)
        with pytest.raises(UserError, match=r"^Permission denied: .*ro/toy_gan"):
            run_task(config(ro), ToyGan)


def test_config_yaml_syntax_error_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken").mkdir(parents=True)
    (tmp_path / "broken" / "config.yaml").write_text("base:\n  optim: {lr: 0.1\nmodels: x\n")
    with pytest.raises(UserError, match=r"config.yaml is not valid YAML: .* at line \d+, column \d+; fix that line"):
        config_parse.load_experiment_yaml(tmp_path / "broken" / "config.yaml")


# bad input that reached a data loader or the file system as a traceback is one line
# when the config is resolved (by a run, --print-config and slurm.submit alike)
PREPARED = [("dcgan", ""), ("ilsvrc_cnns", ""), ("deepspeech2", "english"), ("deepspeech2", "mandarin"),
            ("lm_biglstm", ""), ("voc_detection", ""), ("wmt_translation", "")]


def _prepared(where, marker: str):
    where.mkdir(parents=True)
    (where / "prepared.json").write_text(marker)
    return where


@pytest.mark.parametrize("exp,model", PREPARED, ids=[f"{e}-{m}" if m else e for e, m in PREPARED])
def test_damaged_or_foreign_prepared_data_is_one_line(exp, model, tmp_path):
    import importlib

    over = ["profile=tiny", f"out_dir={tmp_path / 'runs'}"] + ([f"model={model}"] if model else [])
    want, prep = importlib.import_module(f"experiments.{exp}").Task.expected_data(C.resolve(exp, over))
    # what data_prep.<prep> records as its "dataset" is what the task expects
    assert f'"dataset": "{want}"' in (REPO / "data_prep" / prep / "prepare.py").read_text()
    for name, text, msg in (("text", "{not json", "is not JSON"), ("list", "[1, 2]", "holds a JSON list")):
        d = _prepared(tmp_path / name, text)
        with pytest.raises(UserError, match=rf"^{d / 'prepared.json'} {msg}.*: python -m data_prep\.{prep} .*--force$"):
            C.resolve(exp, over + [f"task.data_root={d}"])
    other = "voc" if want != "voc" else "celeba"
    d = _prepared(tmp_path / "other", json.dumps({"dataset": other, "counts": [1]}))
    with pytest.raises(UserError, match=rf"holds '{other}' data .* reads '{re.escape(want)}': set task.data_root to "
                                        rf"the output of python -m data_prep\.{prep} "):
        C.resolve(exp, over + [f"task.data_root={d}"])
    d = _prepared(tmp_path / "mine", json.dumps({"dataset": want, "counts": [1]}))
    assert C.resolve(exp, over + [f"task.data_root={d}"]).data_fingerprint not in ("none", "unprepared")


def test_another_experiments_real_prepared_data_is_one_line(tiny_imagenet, tmp_path):
    """What data_prep.imagenet really writes, given to DCGAN (it failed in the CelebA loader before)."""
    over = ["profile=tiny", f"out_dir={tmp_path}", f"task.data_root={tiny_imagenet}"]
    with pytest.raises(UserError, match=r"holds 'ILSVRC2012' data .* dcgan model=dcgan reads 'celeba'.*data_prep\.celeba"):
        C.resolve("dcgan", over)
    C.resolve("ilsvrc_cnns", over)


def test_grid_only_resolves_the_cells_it_keeps(tmp_path):
    """The demo runs DeepSpeech 2's grid with --only model=english and English data for every cell: the
    Mandarin cells it leaves out are not resolved (they would be refused: their data is AISHELL-1)."""
    from slurm import grid as G

    libri = _prepared(tmp_path / "libri", json.dumps({"dataset": "librispeech"}))
    extra = [f"task.data_root={libri}", f"out_dir={tmp_path / 'runs'}"]
    path = REPO / "experiments" / "deepspeech2" / "grid.yaml"
    cells = G.load(path, "tiny", extra, only=["model=english"]).cells
    assert cells and {c.cfg.model for c in cells} == {"english"}
    with pytest.raises(UserError, match="cell model=mandarin .*holds 'librispeech' data .* reads 'aishell'"):
        G.load(path, "tiny", extra)


def test_too_long_paths_are_one_line(tmp_path):
    for key, value in (("out_dir", "x" * 5000), ("task.data_root", "/y" * 2500), ("out_dir", str(tmp_path / ("z" * 300)))):
        with pytest.raises(UserError, match=rf"^{re.escape(key)}=.* is too long \(a (name in|path under) it has "
                                            rf"[\d,]+ bytes, the file system allows \d+\); choose a shorter {key}"):
            C.resolve("dcgan", ["profile=tiny", f"{key}={value}"])
    C.resolve("dcgan", ["profile=tiny", f"out_dir={tmp_path / ('z' * 200)}"])  # long, but allowed


def test_wrong_typed_value_in_an_experiments_config_yaml_names_file_and_key(tmp_path, monkeypatch):
    import yaml

    spec = yaml.safe_load((REPO / "experiments" / "dcgan" / "config.yaml").read_text())
    where = tmp_path / "experiments" / "dcgan"
    where.mkdir(parents=True)
    # dcgan registered with the copy of its config.yaml (named relative to REPO in the messages)
    monkeypatch.setitem(registry.EXPERIMENTS, "dcgan", dataclasses.replace(registry.get_experiment("dcgan"),
                                                                           config_yaml=where / "config.yaml"))
    monkeypatch.setattr(registry, "REPO", tmp_path)

    def broken(edit):
        data = json.loads(json.dumps(spec))
        edit(data)
        (where / "config.yaml").write_text(yaml.safe_dump(data))
        with pytest.raises(UserError) as e:
            C.resolve("dcgan", ["profile=tiny"])
        return str(e.value)

    assert broken(lambda d: d["base"]["optim"].update(lr="fast")) == \
        "config key 'optim.lr' expects a number, got 'fast' (experiments/dcgan/config.yaml base)"
    assert broken(lambda d: d["profiles"]["tiny"]["train"].update(max_steps=[1])) == \
        "config key 'train.max_steps' expects an integer, got [1] (experiments/dcgan/config.yaml profiles.tiny)"
    assert broken(lambda d: d["profiles"]["tiny"].update(width=None)).endswith(
        "(experiments/dcgan/config.yaml profiles.tiny)")
    assert broken(lambda d: d["models"].update(dcgan=[1])) == \
        "experiments/dcgan/config.yaml models.dcgan must be a mapping of config keys, not a list"
    assert broken(lambda d: d.update(profiles=["tiny"])).endswith("config.yaml: profiles: must be a mapping, not a list")


@pytest.mark.heavy
def test_bad_run_input_is_one_line_from_the_command(tiny_imagenet, tmp_path):
    """The same, end to end: `python -m experiments.<name> ...` prints one line and exits with 2."""
    from bad_input import assert_fails_in_one_line

    listed = _prepared(tmp_path / "listed", "[]")
    base = ["profile=tiny", "wandb.mode=disabled", f"out_dir={tmp_path / 'runs'}"]
    assert_fails_in_one_line("experiments.dcgan", *base, f"task.data_root={listed}", msg="holds a JSON list")
    assert_fails_in_one_line("experiments.dcgan", *base, f"task.data_root={tiny_imagenet}", msg="holds 'ILSVRC2012' data")
    assert_fails_in_one_line("experiments.ilsvrc_cnns", *base, f"task.data_root={tiny_imagenet}", "out_dir=" + "x" * 5000,
                             msg="out_dir=xxx")
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_without_cuda_is_one_line(tmp_path):
    cfg = config(tmp_path)
    cfg.device = "cuda"
    with pytest.raises(UserError, match="device=cuda but CUDA is not available"):
        run_task(cfg, ToyGan)


def test_dataloader_worker_error_is_one_line_in_summary(tmp_path):
    class BadData(ToyGan):
        def datasets(self):
            train, val = super().datasets()
            return _Failing(train), val

    with pytest.raises(ValueError):
        run_task(config(tmp_path, train={"num_workers": 1}), BadData)
    s = json.loads(next(tmp_path.glob("toy_gan/*/summary.json")).read_text())
    assert s["status"] == "failed" and s["error"] == "ValueError: sample 3 is damaged"
    assert one_line(UserError("Caught UserError in DataLoader worker process 0.\nOriginal Traceback:\n"
                              "  File x\nmpt.errors.UserError: bad image a.jpg")) == "UserError: bad image a.jpg"


class _Failing(torch.utils.data.Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        if i == 3:
            raise ValueError("sample 3 is damaged")
        return self.base[i]


# 9. equal values, equal cells
def test_equal_loss_scales_are_one_cell(tmp_path):
    ids = {identity.cell_id(C.resolve("dcgan", ["profile=tiny", "precision=mixed", f"loss_scale={v}"]))
           for v in ("8", "8.0", "8e0", "'8'")}
    assert len(ids) == 1
    assert C.resolve("dcgan", ["precision=mixed", "loss_scale=8.0"]).loss_scale == "8"
    hand = config(tmp_path, precision="mixed", loss_scale="8.0")
    assert identity.cell_id(hand) == identity.cell_id(config(tmp_path, precision="mixed", loss_scale="8"))
    from slurm import grid as G

    g = tmp_path / "grid.yaml"
    g.write_text("experiment: dcgan\naxes: {precision: [mixed], loss_scale: [8, 8.0]}\nprofiles: {tiny: {}}\n")
    with pytest.raises(UserError, match="resolve to the same run"):
        G.load(g, "tiny")


def test_spellings_of_one_recipe_are_one_cell(tmp_path):
    """loss_scale=auto means dynamic under mixed and S = 1 under fp32, bf16 and fp16,
    so those spellings are one run (the default spelling, auto, keeps its id); under fp16_pure S = 1
    is a scaler that skips overflowing steps and auto is none: two recipes, two runs."""
    def cell(prec, scale):
        return C.resolve("dcgan", ["profile=tiny", f"precision={prec}", f"loss_scale={scale}"])

    for prec, spelt in (("mixed", "dynamic"), ("mixed", "DYNAMIC"), ("fp32", "1"), ("fp16", "1.0"), ("bf16", "1")):
        a, b = cell(prec, "auto"), cell(prec, spelt)
        assert b.loss_scale == "auto" and identity.cell_id(a) == identity.cell_id(b), (prec, spelt)
    assert identity.cell_id(cell("mixed", "auto")) == identity.cell_id(C.resolve("dcgan", ["profile=tiny", "precision=mixed"]))
    assert identity.cell_id(cell("fp16_pure", "1")) != identity.cell_id(cell("fp16_pure", "auto"))
    assert identity.cell_id(cell("fp16_pure", "dynamic")) != identity.cell_id(cell("fp16_pure", "auto"))
    assert identity.cell_id(cell("mixed", "1")) != identity.cell_id(cell("mixed", "auto"))
    # a hand-built config (tests, tools) gets the resolved config's id, and its stored config the same run
    hand = config(tmp_path, precision="mixed", loss_scale="dynamic")
    assert identity.cell_id(hand) == identity.cell_id(config(tmp_path, precision="mixed", loss_scale="auto"))
    assert identity.config_difference(identity.strip_infra(hand), config(tmp_path, precision="mixed")) is None
    from slurm import grid as G

    g = tmp_path / "grid.yaml"
    g.write_text("experiment: dcgan\naxes: {precision: [mixed], loss_scale: [auto, dynamic]}\nprofiles: {tiny: {}}\n")
    with pytest.raises(UserError, match="resolve to the same run"):
        G.load(g, "tiny")
    # paper_tables reads both spellings as one cell too (its own normal form: dynamic for mixed)
    from paper_tables.results import normalize_loss_scale as N

    assert N("mixed", "auto") == N("mixed", "dynamic") == "dynamic"
    assert N("fp16", "auto") == N("fp16", "1") and N("fp32", "auto") == N("fp32", "1")


# 10. wandb with a key and no network: offline within seconds, said in one line, key in no file
def test_wandb_without_network_falls_back_to_offline_quickly(tmp_path, monkeypatch, capfd):
    key = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_API_KEY", key)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: no network to wandb
    cfg = config(tmp_path, train={"max_steps": 2})
    cfg.wandb.mode = "auto"
    t0 = time.time()
    s = run_task(cfg, ToyGan)
    took = time.time() - t0
    assert s["status"] == "completed" and took < 60, took
    err = capfd.readouterr().err
    assert "wandb: cannot reach 127.0.0.1:9" in err and "logging offline instead" in err
    d = tmp_path / "toy_gan" / s["run_name"]
    assert list((d / "wandb").glob("offline-run-*"))
    for f in d.rglob("*"):
        if f.is_file():
            assert key.encode() not in f.read_bytes(), f


def test_wandb_server_that_never_answers_still_leaves_an_offline_record(tmp_path, monkeypatch, capfd):
    """A server that accepts connections and never answers passed the TCP probe; the
    online start hung ~46 s, then the offline start failed ("run ID ... is in use") and the run had no
    wandb record at all. Now: at most init_timeout, then an offline run holding the run's metrics."""
    import socket
    import threading

    srv = socket.create_server(("127.0.0.1", 0))
    held = []  # accepted and never answered

    def accept():
        while True:
            try:
                held.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    key = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_API_KEY", key)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{srv.getsockname()[1]}")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    cfg = config(tmp_path, train={"max_steps": 2})
    cfg.wandb.mode = "auto"
    t0 = time.time()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "wandb init failed, continuing without wandb" fails the test
            s = run_task(cfg, ToyGan)
    finally:
        srv.close()
        for c in held:
            c.close()
    took = time.time() - t0
    assert s["status"] == "completed" and took < 25, took  # 3 s of init_timeout, not wandb's 90 or our 30
    assert held, "wandb never connected to the test server"
    err = capfd.readouterr().err
    assert "wandb: online start failed" in err and "logging offline instead" in err and "in use" not in err
    d = tmp_path / "toy_gan" / s["run_name"]
    import wandb

    wandb.teardown()  # what the process's exit does: wandb's service writes out what it holds
    (record,) = (d / "wandb").glob("offline-run-*/run-*.wandb")
    data = record.read_bytes()
    for line in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()):
        for k in ("loss_D", "gap"):  # each logged value, as wandb's history stores it (JSON text)
            if k in line:
                assert json.dumps(line[k]).encode() in data, (k, line)
    for f in d.rglob("*"):
        if f.is_file():
            assert key.encode() not in f.read_bytes(), f


def test_wandb_base_url_with_a_bad_port_still_leaves_an_offline_record(tmp_path, monkeypatch, capfd):
    """A bad port in WANDB_BASE_URL printed "logging offline" and then wrote nothing: wandb refuses the
    URL even offline. The line now names the variable, and the offline start goes on without it."""
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:99999")
    cfg = config(tmp_path, train={"max_steps": 2})
    cfg.wandb.mode = "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "wandb init failed, continuing without wandb" fails the test
        s = run_task(cfg, ToyGan)
    assert s["status"] == "completed"
    err = capfd.readouterr().err
    assert "wandb: WANDB_BASE_URL='http://127.0.0.1:99999' has a bad port; fix or unset it; logging offline" in err
    assert os.environ["WANDB_BASE_URL"] == "http://127.0.0.1:99999"  # put back
    import wandb

    wandb.teardown()
    assert list((tmp_path / "toy_gan" / s["run_name"] / "wandb").glob("offline-run-*/run-*.wandb"))


def test_mistyped_wandb_mode_is_refused_at_resolution():
    """wandb.mode=ofline was accepted and the run had no tracking at all."""
    with pytest.raises(UserError, match="'wandb.mode' expects one of auto, online, offline, disabled, got 'ofline'"):
        C.resolve("ilsvrc_cnns", ["profile=tiny", "wandb.mode=ofline"])


WANDB_RUN = """
import sys, time
sys.path.insert(0, "tests")
from toy_gan import ToyGan, config, run_task
cfg = config(sys.argv[1], train={"max_steps": 2})
cfg.wandb.mode = "auto"
print(run_task(cfg, ToyGan)["status"])
"""


@pytest.mark.heavy
def test_wandb_server_that_never_answers_costs_the_init_timeout_and_no_more(tmp_path):
    """The whole command, exit included: after the run had gone offline, wandb's telemetry about itself
    posted to the silent server at exit and waited ~20 s more (a start cost ~53 s against the 30 s said)."""
    import socket
    import threading

    srv = socket.create_server(("127.0.0.1", 0))
    held = []

    def hold():  # accept and never answer, until the socket is closed at the end of the test
        with contextlib.suppress(OSError):
            while True:
                held.append(srv.accept()[0])

    threading.Thread(target=hold, daemon=True).start()
    env = {**os.environ, "WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567", "WANDB_INIT_TIMEOUT": "3",
           "WANDB_BASE_URL": f"http://127.0.0.1:{srv.getsockname()[1]}", "OMP_NUM_THREADS": "1"}
    env.pop("WANDB_ERROR_REPORTING", None)
    # The same command with no server to try (no key: offline from the start), timed alike: what the silent
    # server may add is measured against it, so a loaded machine (parallel test workers) slows both.
    quiet = {k: v for k, v in env.items() if k not in ("WANDB_API_KEY", "WANDB_BASE_URL")}
    t0 = time.time()
    b = subprocess.run([sys.executable, "-c", WANDB_RUN, str(tmp_path / "baseline")], cwd=REPO, env=quiet,
                       capture_output=True, text=True, timeout=120)
    baseline = time.time() - t0
    assert b.returncode == 0 and b.stdout.strip().endswith("completed"), b.stderr[-2000:]
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, "-c", WANDB_RUN, str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=120)
    finally:
        srv.close()
        for c in held:
            c.close()
    took = time.time() - t0
    assert p.returncode == 0 and p.stdout.strip().endswith("completed"), p.stderr[-2000:]
    assert "logging offline instead" in p.stderr and held
    # 3 s of init_timeout and a fresh offline start over the baseline; not the 20 s more at exit it cost
    assert took - baseline < 12, (took, baseline)


def test_nan_at_the_end_is_never_completed(tmp_path):
    """NaN losses in the last steps, fewer than train.diverge_after (20), used to end
    "completed" with a broken model; a run whose last losses or final metrics are not finite is diverged."""
    from toy_mlp import ToyMLP, config as mlp_config

    class LateNaN(ToyMLP):
        calls = 0

        def loss(self, model, batch):
            loss, n = super().loss(model, batch)
            self.calls += 1
            return (loss * float("nan") if self.calls > 3 else loss), n

    s = run_task(mlp_config(tmp_path, train={"max_steps": 5}), LateNaN)
    assert s["status"] == "diverged" and s["step"] == 5, s
    assert "the last 2 loss(es) non-finite" in s["error"]
    clean = run_task(mlp_config(tmp_path / "clean", train={"max_steps": 5}), ToyMLP)
    assert clean["status"] == "completed"


def test_a_damaged_checkpoint_is_refused(tmp_path, monkeypatch, reference):
    """Bytes flipped inside a tensor of checkpoint.pt still load (torch.load does not
    check the zip's CRCs) as other weights; the checksum written with the checkpoint refuses them."""
    s, d = interrupted(monkeypatch, tmp_path)
    ckpt = d / "checkpoint.pt"
    with zipfile.ZipFile(ckpt) as z:  # the largest tensor record, and where its bytes start
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(ckpt.read_bytes())
    start = info.header_offset + 30 + int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little") \
        + int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
    for i in range(start, start + min(64, info.file_size)):
        raw[i] ^= 0xFF
    ckpt.write_bytes(bytes(raw))
    torch.load(ckpt, weights_only=True)  # still loads: only the checksum can tell
    summary = (d / "summary.json").read_bytes()
    with pytest.raises(UserError, match="checkpoint .* is damaged"):
        run_task(config(tmp_path), ToyGan)
    assert (d / "summary.json").read_bytes() == summary  # the interrupted result is kept as it was


def test_a_checkpoint_without_its_checksum_is_refused(tmp_path, monkeypatch, reference):
    """Every checkpoint this code writes carries a checksum: one without it (weights edited by hand, a
    file from elsewhere) is not resumed as if it were the run's."""
    s, d = interrupted(monkeypatch, tmp_path)
    ckpt = d / "checkpoint.pt"
    sd = torch.load(ckpt, weights_only=True)
    del sd["checksum"]
    torch.save(sd, ckpt)
    with pytest.raises(UserError, match="checkpoint .* has no checksum") as e:
        run_task(config(tmp_path), ToyGan)
    assert "written with it" not in str(e.value) and "delete it to restart the run" in str(e.value)


def test_a_clock_stepped_back_leaves_training_time_positive(tmp_path, monkeypatch):
    """NTP stepping the wall clock back an hour in the middle of training: training time, throughput and
    timed checkpoints run on the monotonic clock, so the summary's wall_time_s stays positive."""
    import time as _time

    real, back = _time.time, []
    monkeypatch.setattr(_time, "time", lambda: real() - (3600.0 if back else 0.0))

    class SteppedBack(ToyGan):
        def train_step(self, ctx, micro):
            if ctx.iteration == 2:
                back.append(1)
            return super().train_step(ctx, micro)

    s = run_task(config(tmp_path, train={"max_steps": 4}), SteppedBack)
    assert back and s["status"] == "completed" and 0 <= s["wall_time_s"] < 600, s
