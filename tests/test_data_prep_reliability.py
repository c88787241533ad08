"""What every data_prep survives (README "What a run survives"), on the tiny generated
releases: the same archives give the same bytes and data_fingerprint; a prep killed mid-write (SIGKILL)
leaves a temp file that the next run removes, and then gives the same output as an uninterrupted run;
the lm1b pool workers die with a killed prep; Ctrl-C and SIGTERM stop a prep in one line (130, 143);
a full disk or a read-only --out is one line naming the path (exit 2)."""
import io
import json
from pathlib import Path
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO, mount_tmpfs
from data_prep.speech import have_espeak
from mpt import prepared
from mpt.errors import UserError

PREPS = ("imagenet", "voc", "librispeech", "aishell", "wmt15", "lm1b", "celeba")
SPEECH = ("librispeech", "aishell")
OPTIONS = {"wmt15": dict(vocab=120, spm_sentences=200)}  # fewer sentences than the corpus: the sample is drawn


def _generate(name, d):
    """The tiny release of data_prep.<name> written under d; the prep's source (folder or archive)."""
    import importlib

    generate = importlib.import_module(f"data_prep.{name}.tiny").generate
    if name == "imagenet":
        generate(d, classes=4, train_per_class=6, val_per_class=3, size=48, seed=3)
    elif name == "voc":
        generate(d, size=64, trainval=6, test=4, trainval12=2)
    elif name == "librispeech":
        return generate(d, train=6, dev=3)
    elif name == "aishell":
        return generate(d, train=4, dev=2, test=2, per_speaker=2).parent
    elif name == "wmt15":
        generate(d, train=600, dev=40, test=40)
    elif name == "lm1b":
        return generate(d)
    elif name == "celeba":
        generate(d, train=8, valid=4, test=4)
    return d


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """name -> the tiny release, generated on first use."""
    made = {}

    def get(name):
        if name in SPEECH and not have_espeak():
            pytest.skip("espeak-ng is not installed (setup.sh installs it as root)")
        if name not in made:
            made[name] = _generate(name, tmp_path_factory.mktemp(f"{name}_release"))
        return made[name]

    return get


def prepare(name, source, out, **kw):
    import importlib

    prep = importlib.import_module(f"data_prep.{name}.prepare")
    return prep.prepare(source, out, log=lambda *a: None, **OPTIONS.get(name, {}), **kw)


def cli_args(name, source, out, workers=None) -> list[str]:
    args = ["--archive" if name == "lm1b" else "--archives", str(source), "--out", str(out)]
    for k, v in OPTIONS.get(name, {}).items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args + (["--workers", str(workers)] if workers else [])


# The prep as a terminal starts it: Ctrl-C at Python's default and no signal blocked, whatever this test
# process inherited or was left with by the tests before (a child keeps an ignored or blocked SIGINT).
CLEAN_SIGNALS = """
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_SETMASK, set())
"""


def start_prep(name, args, before="", **popen):
    """`python -m data_prep.<name> ARGS` as a child process, with the Python code `before` run first
    (a patch that kills it mid-write or slows a worker down)."""
    code = CLEAN_SIGNALS + textwrap.dedent(before) + f"\nfrom data_prep.{name}.__main__ import main\nmain({args!r})\n"
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, **popen)


def run_prep(name, args, before="") -> tuple[int, list[str]]:
    """Run it to its end: (exit code, the non-blank stderr lines)."""
    p = start_prep(name, args, before)
    _, err = p.communicate(timeout=300)
    return p.returncode, [ln for ln in err.splitlines() if ln.strip()]


def contents(out) -> dict[str, bytes]:
    """Every file under out, by relative path; the marker without its volatile keys (when, how long)."""
    files = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    marker = json.loads(files.pop("prepared.json"))
    files["prepared.json"] = json.dumps({k: v for k, v in marker.items() if k not in prepared.MARKER_VOLATILE},
                                        sort_keys=True).encode()
    return files


def fingerprint(out) -> str:
    return prepared.data_fingerprint(out, ("classes.json", "vocab.txt"))  # the files the experiments' tasks name


def temp_files(out) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob(".*.tmp"))


@pytest.fixture(scope="module")
def clean(sources, tmp_path_factory):
    """name -> the output of one uninterrupted prep (in-process, one worker)."""
    made = {}

    def get(name):
        if name not in made:
            out = tmp_path_factory.mktemp(f"{name}_clean") / "out"
            prepare(name, sources(name), out, **({"workers": 1} if name in ("imagenet", "lm1b") else {}))
            made[name] = out
        return made[name]

    return get


# ------------------------------------------------------------------ item 5: deterministic


@pytest.mark.parametrize("name", PREPS)
def test_same_archives_give_the_same_bytes_and_fingerprint(name, sources, clean, tmp_path):
    """Another folder (and, where the prep has workers, another number of them) gives the same bytes.
    WMT15's subword models differed between two fresh preps (sentencepiece's random sample, thread
    count and paths in the model): a different data_fingerprint for the same data."""
    other = tmp_path / "elsewhere" / "prepared"
    prepare(name, sources(name), other, **({"workers": 2} if name in ("imagenet", "lm1b") else {}))
    a, b = contents(clean(name)), contents(other)
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == []
    assert fingerprint(clean(name)) == fingerprint(other) not in ("unprepared", "none")


# ------------------------------------------------------------------ progress of a long step

# One progress line of data_prep.progress.Progress: "<what>: <done>[/<total> (<n>%)], <rate>/s, <t> elapsed[, ~<t> left]"
PROGRESS_LINE = re.compile(r"^.+: [\d,.]+( [kMG]?B)?(/[\d,.]+( [kMG]?B)?)?( [a-z]+)?( \(\d+%\))?, "
                           r"[\d,.]+( [kMG]?B| [a-z]+)?/s, [\dhms]+ elapsed(, ~[\dhms]+ left)?$")


@pytest.mark.parametrize("name", PREPS)
def test_a_prep_shows_its_progress_and_writes_the_same_bytes(name, sources, clean, tmp_path, capsys, monkeypatch):
    """With the interval forced low, every prep prints progress lines on stderr -- whole lines, no carriage
    return, since stderr is not a terminal here -- and its output is byte for byte the output of the prep
    that printed none (the `clean` one, at the default interval)."""
    monkeypatch.setenv("DATA_PREP_PROGRESS", "1e-9")
    out = tmp_path / "out"
    code, lines = _main(name, cli_args(name, sources(name), out, workers=1 if name in ("imagenet", "lm1b") else None),
                        capsys)
    assert code == 0, lines
    assert lines and all(PROGRESS_LINE.match(ln) for ln in lines), lines
    assert not [ln for ln in lines if "\r" in ln]
    a, b = contents(clean(name)), contents(out)
    assert sorted(a) == sorted(b) and [k for k in a if a[k] != b[k]] == []


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_redraws_one_line_on_a_terminal_prints_lines_in_a_log_and_nothing_when_quick(monkeypatch):
    from data_prep.progress import Progress

    monkeypatch.setenv("DATA_PREP_PROGRESS", "1e-9")
    tty, log = _Terminal(), io.StringIO()
    for stream in (tty, log):
        with Progress("step", 4, "files", stream=stream) as p:
            for _ in range(4):
                p.add()
    assert tty.getvalue().count("\r") == 5 and tty.getvalue().count("\n") == 1 and tty.getvalue().endswith("\n")
    lines = log.getvalue().splitlines()  # one a step; the last not repeated when the step ends
    assert "\r" not in log.getvalue() and len(lines) == 4
    assert lines[1].startswith("step: 2/4 files (50%), ") and lines[1].endswith(" left")
    assert lines[-1].startswith("step: 4/4 files (100%), ") and "left" not in lines[-1]
    # stopped by an error: a redrawn line is ended, so the one-line error starts on its own line
    tty = _Terminal()
    with pytest.raises(UserError), Progress("step", 4, stream=tty) as p:
        p.add()
        raise UserError("x")
    assert tty.getvalue().endswith("\n") and tty.getvalue().count("\n") == 1
    # the default interval (1 s on a terminal, 30 s in a log): a quick step prints nothing; off prints nothing
    for env in ("", "off", "0"):
        monkeypatch.setenv("DATA_PREP_PROGRESS", env)
        quiet = _Terminal()
        with Progress("step", 1000, stream=quiet) as p:
            for _ in range(1000):
                p.add()
        assert quiet.getvalue() == "", env


@pytest.mark.parametrize("bad", ["soon", "-1", "inf", "nan"])
def test_a_bad_progress_interval_is_one_line(bad, sources, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DATA_PREP_PROGRESS", bad)
    code, lines = _main("celeba", cli_args("celeba", sources("celeba"), tmp_path / "out"), capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: DATA_PREP_PROGRESS={bad!r} is not a "), lines


# ------------------------------------------------------------------ item 8: a killed prep


KILL_AT_THIRD_RENAME = """
import os, signal
_renames, _replace = [0], os.replace
def _killing_replace(src, dst, *a, **k):  # SIGKILL with the 3rd temp file whole but not yet renamed
    if os.path.basename(str(src)).startswith(".") and str(src).endswith(".tmp"):
        _renames[0] += 1
        if _renames[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
    return _replace(src, dst, *a, **k)
os.replace = _killing_replace
"""


@pytest.mark.parametrize("name", PREPS)
def test_killed_prep_leaves_no_temp_file_after_the_rerun(name, sources, clean, tmp_path):
    """kill -9 during a write leaves its `.<file>.XXXX.tmp` (atomic_write's own); the next run removes
    it wherever it lies under --out, and finishes with the bytes of an uninterrupted prep."""
    out = tmp_path / "out"
    code, _ = run_prep(name, cli_args(name, sources(name), out, workers=1 if name in ("imagenet", "lm1b") else None),
                       KILL_AT_THIRD_RENAME)
    assert code == -signal.SIGKILL
    left = temp_files(out)
    assert len(left) == 1 and not (out / "prepared.json").exists(), left
    prepare(name, sources(name), out, **({"workers": 1} if name in ("imagenet", "lm1b") else {}))
    assert temp_files(out) == []
    assert contents(out) == contents(clean(name)) and fingerprint(out) == fingerprint(clean(name))


SLOW_WORKERS = """
import os, pathlib, time
import data_prep.lm1b.prepare as _prep
def _count(*a):  # a pool worker that says it is working, then works for ten minutes: far longer than any
    pathlib.Path({flags!r}, str(os.getpid())).touch()  # wait of the tests, so no task ends before their signal
    time.sleep(600)
_prep._count = _count
"""


def _alive(pid) -> bool:
    """Running (a zombie -- dead, not yet reaped by whoever inherited it -- is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class SlowLm1bPrep:
    """`python -m data_prep.lm1b --workers 2` as a child process whose two pool workers each start a
    task and work in it for ten minutes: `with` it, `workers` holds their pids once both are working.
    On leaving, the prep and any worker still running are killed (never left to the machine), then
    `err` holds the prep's stderr (read only then: a surviving worker holds the pipe open)."""

    def __init__(self, source, out, flags, **popen):
        flags.mkdir()
        self.flags, self.err = flags, None
        self.p = start_prep("lm1b", cli_args("lm1b", source, out, workers=2),
                            SLOW_WORKERS.format(flags=str(flags)), **popen)

    def __enter__(self):
        end = time.time() + 60
        while len(list(self.flags.iterdir())) < 2:
            if self.p.poll() is not None or time.time() > end:
                self.__exit__()
                pytest.fail(f"the pool workers did not start: {self.err[-2000:]}")
            time.sleep(0.1)
        self.workers = [int(f.name) for f in self.flags.iterdir()]
        return self

    def __exit__(self, *exc):
        if self.p.poll() is None:
            self.p.kill()
        for w in (int(f.name) for f in self.flags.iterdir()):
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        self.err = self.p.communicate(timeout=60)[1]

    def survivors(self, timeout=10.0) -> list[int]:
        """The workers still running after up to `timeout` s."""
        end = time.time() + timeout
        while any(_alive(w) for w in self.workers) and time.time() < end:
            time.sleep(0.1)
        return [w for w in self.workers if _alive(w)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_lm1b_workers_die_with_a_killed_prep(sources, tmp_path):
    """kill -9 of the prep (an OOM kill, a cluster's SIGKILL) left its pool workers running their
    tasks to the end (half an hour on the real release); PR_SET_PDEATHSIG kills them with it."""
    with SlowLm1bPrep(sources("lm1b"), tmp_path / "out", tmp_path / "flags") as prep:
        prep.p.kill()  # SIGKILL: no handler, no cleanup runs in the prep
        prep.p.wait(timeout=30)
        survivors = prep.survivors()
    assert survivors == [], "pool workers outlived the killed prep"


# ------------------------------------------------------------------ item 4: Ctrl-C, full or read-only disk


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_ctrl_c_stops_a_prep_in_one_line_and_the_rerun_finishes(sig, code, sources, clean, tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it), SIGTERM or SIGHUP (a closed
    terminal, to the whole group too) during the lm1b prep: one line, exit 128 + the signal, no worker left; the
    same command again finishes the work."""
    out = tmp_path / "out"
    with SlowLm1bPrep(sources("lm1b"), out, tmp_path / "flags", start_new_session=True) as prep:
        if sig in (signal.SIGINT, signal.SIGHUP):
            os.killpg(prep.p.pid, sig)
        else:
            prep.p.send_signal(sig)
        prep.p.wait(timeout=60)
        survivors = prep.survivors()
    lines = [ln for ln in prep.err.splitlines() if ln.strip()]
    assert prep.p.returncode == code, prep.err[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"interrupted ({sig.name}); run the same command again"), "\n".join(lines)
    assert str(out) in lines[0]
    assert survivors == []
    assert run_prep("lm1b", cli_args("lm1b", sources("lm1b"), out, workers=2))[0] == 0
    assert contents(out) == contents(clean("lm1b"))


SLOW_FORK = """
import inspect, os, pathlib, time
def _slow_fork():  # the first fork of a worker pool, in the parent, held open for two seconds
    if any(f.function == "worker_pool" for f in inspect.stack()) and not os.path.exists({flag!r}):
        pathlib.Path({flag!r}).touch()
        time.sleep(2.0)
os.register_at_fork(after_in_parent=_slow_fork)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_while_the_pool_forks_stops_the_lm1b_prep(sources, tmp_path):
    """SIGTERM aimed at the prep while its pool forks: Python runs the handler in the fork's
    after-fork callbacks, whose exceptions it prints and ignores, so the prep went on and finished
    with exit 0 (3 of 8 aimed tries). Blocked around the fork, it is delivered after it: exit 143,
    one line -- the pool killed as on any other exception, not left to the interpreter's exit, where
    its manager thread closing its wake-up pipe raced the exit writing to it (a traceback in 1 of 12)."""
    flag = tmp_path / "forking"
    p = start_prep("lm1b", cli_args("lm1b", sources("lm1b"), tmp_path / "out", workers=2),
                   SLOW_FORK.format(flag=str(flag)))
    try:
        end = time.time() + 60
        while not flag.exists() and p.poll() is None and time.time() < end:
            time.sleep(0.05)
        assert flag.exists(), "the prep never forked its pool"
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p.returncode == 143, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("interrupted (SIGTERM)"), err[-2000:]


@pytest.mark.heavy
@pytest.mark.parametrize("unbuffered", [False, True])
def test_a_closed_stdout_ends_the_prep_quietly(unbuffered, sources, clean, tmp_path):
    """`python -m data_prep.lm1b ... | head -1`: the reader gone, the prep's next print (at its end,
    block-buffered; mid-work, unbuffered) died with BrokenPipeError and a traceback. It now ends as a
    unix tool killed by SIGPIPE does: nothing said, status 141; the same command again finishes the work."""
    out = tmp_path / "out"
    code = CLEAN_SIGNALS + f"\nfrom data_prep.lm1b.__main__ import main\nmain({cli_args('lm1b', sources('lm1b'), out, 2)!r})\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1" if unbuffered else ""}
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    p.stdout.close()  # the reader is gone before the prep's first line
    err = p.stderr.read()
    p.wait(timeout=300)
    assert p.returncode == 141 and err == "", err[-2000:]
    assert temp_files(out) == []
    assert run_prep("lm1b", cli_args("lm1b", sources("lm1b"), out, workers=2))[0] == 0
    assert contents(out) == contents(clean("lm1b"))


HALF_WRITTEN_RESULT = """
import inspect, os, pathlib, struct, time
import data_prep.lm1b.prepare as _prep
def _count(*a):  # a pool worker killed in the middle of sending its result: a header and part of the bytes
    q = next(f.frame.f_locals["result_queue"] for f in inspect.stack() if "result_queue" in f.frame.f_locals)
    os.write(q._writer.fileno(), struct.pack("!i", 1 << 20) + b"x" * 1000)
    pathlib.Path({flags!r}, str(os.getpid())).touch()
    time.sleep(600)
_prep._count = _count
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_result_pipe_left_half_written_does_not_hang_the_stop(sources, tmp_path):
    """The prep killed its workers on Ctrl-C, then waited for the pool to shut down: its reader thread
    was blocked on a result a killed worker had half written, and nothing but kill -9 ended the prep
    (about 1 try in 10 on the real release). The stop now returns at once."""
    flags = tmp_path / "flags"
    flags.mkdir()
    p = start_prep("lm1b", cli_args("lm1b", sources("lm1b"), tmp_path / "out", workers=2),
                   HALF_WRITTEN_RESULT.format(flags=str(flags)))
    try:
        end = time.time() + 60
        while not list(flags.iterdir()) and p.poll() is None and time.time() < end:
            time.sleep(0.1)
        time.sleep(0.5)  # the pool's reader thread is now waiting for the rest of the result
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        for w in (int(f.name) for f in flags.iterdir()):
            if _alive(w):
                os.kill(w, signal.SIGKILL)
    assert p.returncode == 143, err[-2000:]
    assert [ln for ln in err.splitlines() if ln.strip()][-1].startswith("interrupted (SIGTERM)")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_signals_at_random_moments_never_hang_the_lm1b_prep(sources, tmp_path):
    """A fault loop: SIGTERM or Ctrl-C at a random moment of a real lm1b prep (two workers) ends it
    within seconds every time -- interrupted (143, 130), done when the signal comes after the work, or
    killed by it while the interpreter starts or exits."""
    import random

    rng = random.Random(0)
    source = sources("lm1b")
    t0 = time.time()
    assert run_prep("lm1b", cli_args("lm1b", source, tmp_path / "timed", workers=2))[0] == 0
    took = time.time() - t0
    for i in range(30):
        sig = rng.choice([signal.SIGTERM, signal.SIGINT])
        p = start_prep("lm1b", cli_args("lm1b", source, tmp_path / f"out{i}", workers=2), start_new_session=True)
        time.sleep(rng.uniform(0.2, took))
        if p.poll() is None:
            os.killpg(p.pid, sig)
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            pytest.fail(f"try {i}: the prep hung after {sig.name}")
        # -sig: the signal came while the interpreter started or shut down, with its default action
        assert p.returncode in (0, 128 + sig, -sig), (i, p.returncode, err[-2000:])


@pytest.fixture
def full_disk(tmp_path):
    """A 16 KiB tmpfs (a real full disk: smaller than any tiny prep's output), else None."""
    mnt = tmp_path / "full"
    if not mount_tmpfs(mnt, "size=16k"):
        yield None
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


NO_SPACE = """
import errno, os
def _fsync(fd):  # where the kernel would say it (no tmpfs can be mounted here)
    raise OSError(errno.ENOSPC, "No space left on device")
os.fsync = _fsync
"""


@pytest.mark.parametrize("name", ["imagenet", "wmt15"])
def test_full_disk_is_one_line_naming_the_path(name, sources, full_disk, tmp_path):
    where = full_disk or tmp_path / "out"
    code, lines = run_prep(name, cli_args(name, sources(name), where), "" if full_disk else NO_SPACE)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: No space left on device: {where}"), lines
    assert "--out" in lines[0]  # the fix: free space or choose another --out


@pytest.fixture
def read_only(tmp_path):
    """A read-only folder: a read-only tmpfs (root with mount rights), else a folder without write
    permission (not root); the errno's words expected. Root without mount rights: skipped, as nothing
    stops root from writing."""
    mnt = tmp_path / "ro"
    if mount_tmpfs(mnt, "ro,size=16k"):
        try:
            yield mnt, "Read-only file system"
        finally:
            subprocess.run(["umount", str(mnt)], capture_output=True)
    elif os.geteuid() != 0:
        mnt.chmod(0o500)
        yield mnt, "Permission denied"
        mnt.chmod(0o700)
    else:
        pytest.skip("root cannot mount a read-only tmpfs here, and permissions do not stop root")


@pytest.mark.parametrize("name", ["imagenet", "wmt15", "lm1b", "celeba"])
def test_read_only_out_is_one_line_naming_the_path(name, sources, read_only):
    where, words = read_only
    code, lines = run_prep(name, cli_args(name, sources(name), where))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {words}: {where}"), lines
    assert "--out" in lines[0]


# ------------------------------------------------------------------ inputs that are not finite or in range


def _aishell_release(d, samples):
    """A one-utterance AISHELL-1 release whose WAV holds `samples` as 32-bit float (a float WAV can hold
    NaN, inf or any magnitude; 16-bit PCM cannot)."""
    import io

    import soundfile as sf

    from data_prep.aishell.prepare import ARCHIVE, ROOT, TRANSCRIPT
    from data_prep.archives import add_member, tar_gz_writer

    wav = io.BytesIO()
    sf.write(wav, samples, 16_000, format="WAV", subtype="FLOAT")
    spk, inner = io.BytesIO(), "BAC009S0002W0001"
    with tar_gz_writer(spk) as tf:
        add_member(tf, f"train/S0002/{inner}.wav", wav.getvalue())
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ARCHIVE, "wb") as f, tar_gz_writer(f) as tf:
        add_member(tf, f"{ROOT}/wav/S0002.tar.gz", spk.getvalue())
        add_member(tf, TRANSCRIPT, f"{inner} 你 好\n".encode())
    return d


@pytest.mark.parametrize("bad,words", [(float("nan"), "non-finite audio sample"), (float("inf"), "non-finite"),
                                       (1e30, "outside full scale")])
def test_audio_not_finite_or_beyond_full_scale_is_refused_by_the_prep(bad, words, tmp_path):
    """One NaN sample in a float WAV made every loss it entered NaN: a Mandarin run ended "diverged", a
    wrong Table 3 cell. The prep refuses the file in one line naming it (and the DeepSpeech 2 task reads
    every utterance through the same check, so a file changed after its prep fails the run instead)."""
    import numpy as np
    import soundfile as sf

    from data_prep.speech import decode

    samples = np.sin(np.linspace(0, 100, 8000)).astype(np.float32) * 0.5
    good = _aishell_release(tmp_path / "good", samples)
    assert prepare("aishell", good, tmp_path / "good_out")["train"] == 1
    samples[4000] = bad
    src = _aishell_release(tmp_path / "bad", samples)
    code, lines = run_prep("aishell", cli_args("aishell", src, tmp_path / "out"))
    assert code == 2 and len(lines) == 1 and words in lines[0], lines
    assert "BAC009S0002W0001.wav" in lines[0] and not (tmp_path / "out" / "prepared.json").exists()
    # read time: a prepared file replaced by a damaged one is refused as the task reads it
    wav = next((tmp_path / "good_out").rglob("*.wav"))
    sf.write(wav, samples, 16_000, format="WAV", subtype="FLOAT")
    with pytest.raises(UserError, match=words):
        decode(wav, str(wav))


# ------------------------------------------------------------------ prepared data edited after its prep


def _copy(clean, name, tmp_path):
    import shutil

    return shutil.copytree(clean(name), tmp_path / name)


def test_voc_box_moved_outside_its_image_after_the_prep_is_refused_as_read(sources, clean, tmp_path):
    """A prepared annotation edited so that a box lies outside its image trained to a loss of 0 and
    ended "completed" with mAP 0 (training drops such boxes); the loader refuses it in one line."""
    import re

    from data_prep.voc.dataset import VOCDetectionSet, read_marker

    out = _copy(clean, "voc", tmp_path)
    xml = sorted((out / "VOCdevkit" / "VOC2007" / "Annotations").glob("*.xml"))[0]
    box = b"<bndbox><xmin>500</xmin><ymin>500</ymin><xmax>600</xmax><ymax>600</ymax></bndbox>"
    xml.write_bytes(re.sub(rb"<bndbox>.*?</bndbox>", box, xml.read_bytes(), count=1, flags=re.S))
    info = read_marker(out)
    sets = [s for s in info["sets"] if s.startswith("2007")]
    ds = VOCDetectionSet(out, sets, info["classes"])
    k = next(i for i, it in enumerate(ds.items) if it[0].endswith(f"/{xml.stem}.jpg"))
    with pytest.raises(UserError, match=rf"{xml}: object 0 .* entirely outside the .* prepare the data again"):
        ds[k]


def _shard(out):
    info = json.loads((out / "prepared.json").read_text())
    return out / info["shards"]["train"][0]["file"], info["vocab_size"]


@pytest.mark.parametrize("edit,words", [("past_vocab", "outside the vocabulary"), ("swap", "changed since it was prepared")])
def test_lm1b_shard_edited_after_the_prep_is_refused(edit, words, sources, clean, tmp_path):
    """An id past the vocabulary in a prepared shard was a traceback (a device-side assert on a GPU); ids
    swapped inside it trained on other data under the same run identity: the sha256 the prep recorded
    is checked when the shards are opened."""
    import numpy as np

    from data_prep.lm1b.dataset import Prepared

    out = _copy(clean, "lm1b", tmp_path)
    path, vocab = _shard(out)
    ids = np.fromfile(path, dtype="<u4")
    if edit == "past_vocab":
        ids[3] = vocab
    else:
        ids[[1, 2]] = ids[[2, 1]] if ids[1] != ids[2] else (ids[1], ids[1] + 1)
    ids.tofile(path)
    with pytest.raises(UserError, match=rf"{path}.*{words}.*data_prep.lm1b with --force"):
        Prepared(out).shards("train")


def test_lm1b_shard_edited_in_an_interrupted_prep_is_refused_by_the_rerun(sources, tmp_path, monkeypatch):
    """A shard finished by an interrupted prep is kept by the next run: read again, not trusted."""
    import numpy as np

    import data_prep.lm1b.prepare as lm

    out, real, calls = tmp_path / "out", lm.atomic_write_json, []

    def interrupt_after_two_shards(path, obj):
        real(path, obj)
        if str(path).endswith(".bin.json"):
            calls.append(path)
            if len(calls) == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(lm, "atomic_write_json", interrupt_after_two_shards)
    with pytest.raises(KeyboardInterrupt):
        prepare("lm1b", sources("lm1b"), out, workers=1)
    monkeypatch.setattr(lm, "atomic_write_json", real)
    shard = Path(str(calls[0])[: -len(".json")])
    ids = np.fromfile(shard, dtype="<u4")
    ids[0] = 10 ** 9
    ids.tofile(shard)
    with pytest.raises(UserError, match=rf"{shard} holds token id 1000000000, outside the vocabulary"):
        prepare("lm1b", sources("lm1b"), out, workers=1)


def test_wmt15_ids_edited_after_the_prep_are_refused(sources, clean, tmp_path):
    import numpy as np

    from data_prep.wmt15.dataset import Prepared

    out = _copy(clean, "wmt15", tmp_path)
    data = Prepared(out)
    path = out / "train.fr.bin"
    ids = np.fromfile(path, dtype=data.info["dtype"])
    ids[5] = data.vocab["fr"]
    ids.tofile(path)
    with pytest.raises(UserError, match=rf"{path} holds token id {data.vocab['fr']}, outside the vocabulary"):
        data.split("train")
    np.arange(3, dtype=np.int64).tofile(out / "dev.en.idx")
    with pytest.raises(UserError, match="dev.en.idx does not cut dev.en.bin into sentences"):
        data.split("dev")
    with open(out / "spm.fr.model", "ab") as f:
        f.write(b"\0")
    with pytest.raises(UserError, match="spm.fr.model is missing or changed since it was prepared"):
        Prepared(out)


# ------------------------------------------------------------------ a user's mistakes: one line, never a traceback


def _main(name, args, capsys, module="__main__"):
    """`python -m data_prep.<name>[.<module>] ARGS` in this process: (exit code, stderr lines)."""
    import importlib

    main = importlib.import_module(f"data_prep.{name}.{module}" if module != "__main__" else
                                   f"data_prep.{name}.__main__").main
    capsys.readouterr()
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code
    return code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


@pytest.mark.parametrize("name", PREPS)
def test_rerun_over_a_damaged_marker_is_one_line(name, sources, clean, tmp_path, capsys):
    """Re-running a prep over a prepared.json cut short or edited was a traceback (already_prepared)."""
    import shutil

    for damage in (b'{"dataset": "vo', b"[1, 2]", b"\xff\xfe"):
        out = tmp_path / f"out{len(damage)}"
        shutil.copytree(clean(name), out)
        (out / "prepared.json").write_bytes(damage)
        code, lines = _main(name, cli_args(name, sources(name), out), capsys)
        assert code == 2 and len(lines) == 1, lines
        assert lines[0].startswith(f"error: {out / 'prepared.json'} is damaged") and "--force" in lines[0], lines


@pytest.mark.parametrize("errno_name,words", [("EFBIG", "File too large"), ("EMFILE", "Too many open files"),
                                              ("ENAMETOOLONG", "File name too long")])
def test_limits_of_the_file_system_and_the_process_are_one_line(errno_name, words, sources, tmp_path):
    """EFBIG (a file over the file system's or `ulimit -f`'s size), EMFILE (the open-file limit) were
    tracebacks; each is one line naming the path and the fix."""
    raise_it = f"""
import errno, os
def _fsync(fd):
    raise OSError(errno.{errno_name}, os.strerror(errno.{errno_name}))
os.fsync = _fsync
"""
    where = tmp_path / "out"
    code, lines = run_prep("imagenet", cli_args("imagenet", sources("imagenet"), where), raise_it)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {words}: {where}"), lines


def test_out_names_too_long_are_one_line_for_preps_and_generators(sources, tmp_path, capsys):
    """A --out whose name is over 255 bytes: the prep, and the tiny generators, gave a traceback."""
    long = tmp_path / ("x" * 300)
    code, lines = _main("voc", cli_args("voc", sources("voc"), long), capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: File name too long: "), lines
    code, lines = _main("voc", ["--out", long / "release"], capsys, module="tiny")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: File name too long: "), lines


def test_tiny_generator_on_a_read_only_folder_is_one_line(read_only, capsys):
    where, words = read_only
    code, lines = _main("imagenet", ["--out", where / "release"], capsys, module="tiny")
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {words}: "), lines


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_two_preps_into_one_out_at_once_the_second_is_refused(sources, tmp_path):
    """Two preps into one --out at once: one traceback and a stray temp file, or one sweeping the
    other's temp files. The prep holds a lock on the folder (no lock file: the bytes stay the same)."""
    out = tmp_path / "out"
    with SlowLm1bPrep(sources("lm1b"), out, tmp_path / "flags"):
        code, lines = run_prep("lm1b", cli_args("lm1b", sources("lm1b"), out, workers=1))
    assert code == 2 and len(lines) == 1 and f"--out {out} is in use by another prep" in lines[0], lines
    assert temp_files(out) == []


def test_the_temp_file_sweep_removes_only_its_own(sources, tmp_path):
    """The sweep deleted every hidden .tmp file under --out; only atomic_write's own names go now."""
    out = tmp_path / "out"
    (out / "notes").mkdir(parents=True)
    mine, theirs = out / "notes" / ".draft.tmp", out / "notes" / ".prepared.json.ab12cd34.tmp"
    mine.write_text("a user's file")
    theirs.write_text("a killed write's")
    prepare("voc", sources("voc"), out)
    assert mine.read_text() == "a user's file" and not theirs.exists()


@pytest.mark.parametrize("name", ["voc", "aishell", "librispeech", "celeba", "wmt15"])
def test_rerun_after_an_archive_changed_says_so(name, sources, clean, tmp_path):
    """The archive digests prepared.json records were never checked again: a re-run over data made
    from an archive since replaced said "already prepared"."""
    import shutil

    src = sources(name)
    src = src if src.is_dir() else src.parent
    copy = shutil.copytree(src, tmp_path / "src")
    out = shutil.copytree(clean(name), tmp_path / "out")
    assert prepare(name, copy, out)["dataset"]  # unchanged: already prepared, nothing said
    victim = max((p for p in copy.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(victim, "ab") as f:
        f.write(b"\0")
    with pytest.raises(UserError, match=rf"{victim} changed since {out} was prepared from it.*--force"):
        prepare(name, copy, out)
