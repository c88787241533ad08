"""A call's machinery: each part in a child process of its own (a CUDA error or a leak cannot reach the
next part; a hang is killed at its limit), the call's time budget, its temp work folder, and the results
file, rewritten atomically while each part runs and after it."""
from __future__ import annotations

import collections
import dataclasses
import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from experiments.speed_memory.gpu_check.data import REPO
from experiments.speed_memory.gpu_check.parts import GPU, PART_FNS, SMOKE, Ctx
from experiments.speed_memory.gpu_check.report import SCHEMA, add_e2e_ratios, summary_text
from mpt.errors import UserError, one_line

MODULE = "experiments.speed_memory.gpu_check"  # the command: python -m MODULE
COMMAND = f"python -m {MODULE}"
RESULTS_DIR = "experiments/speed_memory/results"
# The whole call's default limit, the environment probe included: 6 minutes. A 15-minute GPU job
# spends 1-2 on the machine's start; 6 here leaves room for a second call that reruns what failed.
DEFAULT_CALL_S = 360
STACK_DUMP_S = 3  # a hung part's time to print its stacks before the kill
PROBE_S = 60  # importing torch and reading the device: ~10-20 s with CUDA's first initialisation
# Each part's limit on one H100/H200, in seconds (its process is killed past it; what it finished is
# kept). Measured on an H200 (results/nvidia-h200-2026-11-27-gpu_check-call*.json): headline 124 s (8
# rows; the first 65 s, cuDNN's search for FP32 NHWC algorithms), resume 24 s, ds2_worst 101 s (English
# 68 s, Mandarin 22 s; 80 s cut it), 13 of the 24 models cells in 96 s. An H100 has the same SMs at lower
# memory bandwidth: ~10-20% more. models gets what is left of the call (its first cells); ddp needs 2 GPUs.
# 2026-11-28 (results/nvidia-h200-2026-11-28-gpu_check-call*.json): the headline's first 5 rows took 127 s
# and 150 s cut its last 3; e2e 59 s (its photographs written in ~10 s), ssd_e2e 63 s, cifar 147 s (12 runs,
# four at a time). A first call of the default parts gets through headline, e2e and ssd_e2e in ~330 s; a
# second call runs --parts resume,ds2_worst,cifar,models; --parts watch is a call of its own.
GPU_BUDGET_S = {"headline": 200, "e2e": 120, "ssd_e2e": 100, "resume": 45, "ds2_worst": 120, "cifar": 180,
                "models": 120, "ddp": 60, "watch": 120}
# The CPU smoke's limits: generous (a loaded 2-core machine), they only catch a hang.
SMOKE_BUDGET_S = {"headline": 120, "e2e": 150, "ssd_e2e": 150, "cifar": 240, "models": 180, "ds2_worst": 120,
                  "resume": 120, "ddp": 180, "watch": 120}
SMOKE_CALL_S = PROBE_S + sum(SMOKE_BUDGET_S.values())


def source_digest(root: Path | None = None) -> str:
    """sha256 of the repository's Python sources (path and bytes, sorted): names the code that ran where
    the copy on a remote machine carries no usable git state. `--source-digest` prints it here, to
    compare with a results file's."""
    from mpt.rundir import files_digest

    root = root or REPO
    return files_digest(root, [f for d in ("mpt", "experiments", "models", "data_prep", "slurm", "paper_tables")
                               for f in sorted((root / d).rglob("*.py")) if "__pycache__" not in f.parts])


def child_main(part: str, state: Path, smoke: bool, work: Path, selection: dict) -> int:
    """Run one part in this process; its result (partial ones as it goes) lands in `state`."""
    from mpt.rundir import atomic_write_json

    def emit(result: dict, **kw) -> None:
        atomic_write_json(state, {"result": result, **kw})

    partial: dict = {}
    # A hang is diagnosed from where it hangs: the parent sends SIGUSR1 before its kill, and every thread's
    # Python stack (the loader's pin-memory thread included) goes to the output the parent keeps.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    def emit_partial(r: dict) -> None:
        partial.clear()
        partial.update(r)
        emit(r)

    try:
        ctx = Ctx(smoke, work, emit_partial, **selection)
        r = PART_FNS[part](ctx)
        emit(r, status=r.pop("status", "ok"), error=r.pop("error", None), traceback=r.pop("traceback", None),
             note=r.pop("note", None))
        return 0
    except BaseException as e:  # noqa: BLE001 -- the parent records it; the other parts still run
        emit(dict(partial), status="failed", error=one_line(e), traceback=traceback.format_exc())
        return 1


def _read_part(state: Path, seconds: float, timeout: float) -> dict:
    """What the part's process has written so far, as one record of the results file."""
    try:
        got = json.loads(state.read_text())
    except (OSError, ValueError):
        got = {}
    return {"status": got.get("status", "running"), "seconds": round(seconds, 1), "budget_s": round(timeout),
            "error": got.get("error"), "traceback": got.get("traceback"), "note": got.get("note"),
            "result": got.get("result") or {}}


def run_part(part: str, smoke: bool, work: Path, timeout: float, save=lambda rec: None, every: float = 5.0,
             selection: list[str] = ()) -> dict:
    """The part in a child process (a CUDA error or a leak cannot reach the next part; a hang is
    killed at `timeout`); its output is echoed live, indented. Every `every` seconds what it has
    finished goes to save(record), so a kill of the whole call loses at most those seconds. selection:
    the call's --models/--graphed/--e2e-workers/--cifar arguments, passed on to the part's process."""
    state = work / f"{part}.state.json"
    state.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", MODULE, "--_part", part, "--_state", str(state),
           "--_work", str(work), *selection] + (["--cpu-smoke"] if smoke else [])
    env = dict(os.environ)
    if smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the smoke is a CPU run even on a GPU machine
        # One thread: on a shared CPU, OpenMP threads spin-waiting for busy cores made a step 100x
        # slower (speed_memory README).
        env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.time()
    tail: collections.deque = collections.deque(maxlen=200)  # room for a hung part's stacks
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=REPO, start_new_session=True)

    def pump():
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            print(f"    {line}", end="", file=sys.stderr, flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out, rc = False, None
    try:
        while rc is None:
            left = timeout - (time.time() - t0)
            if left <= 0:
                timed_out = True
                os.kill(proc.pid, signal.SIGUSR1)  # its stacks first (child_main), into the tail kept below
                try:
                    proc.wait(timeout=STACK_DUMP_S)
                except subprocess.TimeoutExpired:
                    pass
                os.killpg(proc.pid, signal.SIGKILL)  # the part's whole process group (torchrun's ranks too)
                rc = proc.wait()
                break
            try:
                rc = proc.wait(timeout=min(every, left))
            except subprocess.TimeoutExpired:
                save(_read_part(state, time.time() - t0, timeout))
    except BaseException as e:  # noqa: BLE001 -- SIGINT / SIGTERM of the call: stop the part, keep what it finished
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rec = _read_part(state, time.time() - t0, timeout)
        rec.update(status="interrupted", error=f"interrupted ({one_line(e) or type(e).__name__}) while running: "
                                               f"its finished rows are kept")
        raise Interrupted(rec) from None
    reader.join(timeout=5)
    rec = _read_part(state, time.time() - t0, timeout)
    if rec["status"] == "running":
        rec["status"] = "failed"
    if timed_out:
        rec.update(status="failed", error=f"timeout: killed after its {timeout:.0f} s budget (what it measured "
                                          f"until then is kept)", traceback="\n".join(tail))
    elif rc != 0 and rec["error"] is None:
        rec.update(status="failed", error=f"the part's process exited with {rc} and left no result",
                   traceback="\n".join(tail))
    return rec


class Interrupted(Exception):
    """The call was stopped (SIGINT, SIGTERM) while a part ran; carries that part's record."""

    def __init__(self, record: dict):
        super().__init__("interrupted")
        self.record = record


def _sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


WORK_PREFIX = "gpu_check_"  # the call's temp work folder: <tmp>/gpu_check_XXXXXXXX (tiny data, runs, states)


def new_work_folder() -> tuple[Path, int]:
    """A fresh temp work folder and the descriptor that holds an flock on it while this call lives; first,
    the folders of calls that are gone are removed. A call killed by SIGKILL (a GPU job's time limit, an OOM kill)
    runs no cleanup and left its folder -- tiny data and runs -- in the temp folder for good; the kernel
    drops a dead call's lock, so a folder whose lock can be taken is a leftover."""
    import fcntl

    for old in Path(tempfile.gettempdir()).glob(f"{WORK_PREFIX}*"):
        try:
            if old.is_symlink() or not old.is_dir() or old.stat().st_uid != os.getuid():
                continue
            fd = os.open(old, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass  # a live call's
        finally:
            os.close(fd)
    work = Path(tempfile.mkdtemp(prefix=WORK_PREFIX))
    fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return work, fd


def remove_work_folder(work: Path, fd: int) -> None:
    """The call's own work folder, removed with further stop signals ignored: a second SIGTERM in the
    middle of the removal left the rest of it behind."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        shutil.rmtree(work, ignore_errors=True)
        os.close(fd)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# ------------------------------------------------------------------------------------------------
# the call: the device probe, then one process per part within the call's budget


def run_call(a, argv: list[str] | None) -> int:
    """The call the parsed command line `a` asks for: the device probe, then each part in its own process
    within what is left of the budget, the results file rewritten as each part goes, the summary printed
    at the end. -> exit status: 0, 1 if any part failed, 130 when interrupted."""
    out = Path(a.out or os.environ.get("OUT") or RESULTS_DIR)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create it ({e.strerror})") from None
    signal.signal(signal.SIGTERM, _sigterm)  # a runner's stop: the same as Ctrl-C, finished rows kept
    work, work_fd = new_work_folder()
    call = None
    try:
        call = Call(a, argv, out, work)
        call.run_parts()
    except (Interrupted, KeyboardInterrupt) as e:
        if call is None:
            raise UserError("interrupted before the device was read: nothing measured") from None
        return call.interrupted(e)
    finally:
        remove_work_folder(work, work_fd)
    return call.finish()


class Call:
    """One call's results: the probe reads the device (counted in the budget, but never cut by it), then
    `res` (the results file's content) gains each part's record as the part runs; save() writes it."""

    def __init__(self, a, argv: list[str] | None, out: Path, work: Path):
        from mpt.rundir import now

        self.a, self.work, self.current, self.failed = a, work, None, []
        self.budgets = {**(SMOKE_BUDGET_S if a.cpu_smoke else GPU_BUDGET_S), **a.limits}
        self.total = a.budget or (SMOKE_CALL_S if a.cpu_smoke else DEFAULT_CALL_S)
        self.t0 = time.time()  # the whole call's budget, the probe included
        probe = run_part("env", a.cpu_smoke, work, PROBE_S)
        if probe["status"] != "ok":
            if "no CUDA GPU" in (probe["error"] or ""):
                raise UserError(probe["error"].split(": ", 1)[-1])
            raise UserError(f"could not read the device: {probe['error']}")
        self.env, slug = probe["result"]["env"], probe["result"]["slug"]
        date = now()
        self.path = out / f"{slug}-{date[:10]}-gpu_check{'-smoke' if a.cpu_smoke else ''}.json"
        self.res = {"schema": SCHEMA, "command": COMMAND + " " + " ".join(argv or sys.argv[1:]),
                    "mode": "cpu-smoke" if a.cpu_smoke else "gpu", "date": date, "env": self.env,
                    "source_digest": source_digest(), "sizes": dataclasses.asdict(SMOKE if a.cpu_smoke else GPU),
                    "budget_s": round(self.total), "part_budgets_s": {p: self.budgets[p] for p in a.parts},
                    "models": list(a.models), "graphed": list(a.graphed), "e2e_workers": list(a.e2e_workers),
                    "cifar": list(a.cifar), "parts": {}, "wall_s": None, "exit_code": None}
        print(f"gpu_check on {self.env['device_name']}: parts {', '.join(a.parts)}; budget {self.total:.0f} s; "
              f"-> {self.path}", file=sys.stderr, flush=True)

    def save(self, p: str | None = None, rec: dict | None = None) -> None:
        """The results file now, with part p's record `rec` when given."""
        from mpt.rundir import atomic_write_json

        if p is not None:
            self.res["parts"][p] = rec
        add_e2e_ratios(self.res)
        self.res["wall_s"] = round(time.time() - self.t0, 1)
        atomic_write_json(self.path, self.res)

    def run_parts(self) -> None:
        """Every part asked for, in order, each within its own limit and what is left of the call's."""
        for p in self.a.parts:
            left = self.total - (time.time() - self.t0)
            if p == "ddp" and not self.a.cpu_smoke and self.env.get("gpu_count", 0) < 2:
                # Decided from the probe: no process, no CUDA initialisation, no time spent.
                n = self.env.get("gpu_count", 0)
                self.save(p, {"status": "skipped", "seconds": 0.0, "budget_s": 0, "result": {}, "traceback": None,
                              "error": None, "note": f"{n} GPU visible; a DDP step needs 2 (run on a 2-GPU machine)"})
            elif left < 5:
                self.save(p, {"status": "failed", "seconds": 0.0, "budget_s": 0, "result": {}, "traceback": None,
                              "note": None, "error": "not run: the call's time budget was spent"})
            else:
                self.run_one(p, min(self.budgets[p], left))
        self.failed = [p for p, r in self.res["parts"].items() if r["status"] == "failed"]
        self.res["exit_code"] = 1 if self.failed else 0
        self.save()

    def run_one(self, p: str, limit: float) -> None:
        """Part p in its process, its finished rows saved every few seconds while it runs."""
        print(f"== {p} (limit {limit:.0f} s)", file=sys.stderr, flush=True)
        self.current = p
        self.save(p, run_part(p, self.a.cpu_smoke, self.work, limit, save=lambda rec: self.save(p, rec),
                              every=self.a._save_every, selection=self.a.selection))
        rec = self.res["parts"][p]
        print(f"== {p}: {rec['status']} in {rec['seconds']:.1f} s" + (f": {rec['error']}" if rec["error"] else ""),
              file=sys.stderr, flush=True)

    def interrupted(self, e: BaseException) -> int:
        """A stop signal: the running part's record as its process left it, the parts not reached failed."""
        if isinstance(e, Interrupted):
            self.res["parts"][self.current] = e.record
        for p in self.a.parts:
            self.res["parts"].setdefault(p, {"status": "failed", "seconds": 0.0, "budget_s": 0, "result": {},
                                             "traceback": None, "note": None,
                                             "error": "not run: the call was interrupted"})
        self.res["exit_code"] = 130
        self.save()
        print(summary_text(self.res))
        print(f"\ninterrupted; wrote what was finished to {self.path}", file=sys.stderr)
        return 130

    def finish(self) -> int:
        """The summary and the call's exit status."""
        print(summary_text(self.res))
        print(f"\nwrote {self.path} ({self.res['wall_s']:.0f} s)"
              + (f"; FAILED: {', '.join(self.failed)}" if self.failed else "; every part ok"))
        return self.res["exit_code"]
