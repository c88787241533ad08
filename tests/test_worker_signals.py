"""DataLoader workers and stop signals (mpt.signals.worker_init).

SLURM signals every process of a job step, the DataLoader workers too (USR2 before the time limit,
SIGTERM at preemption / requeue / scancel; tests/test_slurm_cluster.py has the real thing). A worker
that dies of one fails the run mid-step, so workers ignore them; but SIGTERM from their own main
process (DataLoader shutdown, multiprocessing's exit handler) must still end them, and a worker whose
main process is gone must not stay behind. Each check runs a loader in a subprocess of its own."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

LOADER = """
import os, subprocess, sys, time, torch
from torch.utils.data import DataLoader, Dataset
from mpt.signals import worker_init

class Slow(Dataset):
    def __len__(self): return 100000
    def __getitem__(self, i): time.sleep(0.005); return torch.tensor([i])

it = iter(DataLoader(Slow(), batch_size=2, num_workers=2, worker_init_fn=worker_init))
# Two batches: one from each worker (they take turns), so both have run worker_init. After one,
# the second worker may still be starting on a loaded machine, and a signal then meets torch's handlers.
next(it), next(it)
print(*(w.pid for w in it._workers), flush=True)
"""

# Signals from another process, as from slurmstepd: every stop signal, to every worker, mid-epoch.
# Then exit with the iterator still referenced (as an exception's traceback would keep it):
# torch's shutdown is skipped at interpreter exit and multiprocessing terminate()s the daemonic
# workers and joins them without a timeout -- a hang if the workers ignored that SIGTERM too.
SIGNALLED = LOADER + """
for s in ("USR2", "TERM", "USR1", "INT"):
    subprocess.run(["kill", "-s", s, *(str(w.pid) for w in it._workers)], check=True)
time.sleep(0.2)
n = sum(1 for _, b in zip(range(50), it))
print("batches after the signals:", n, flush=True)
sys.exit(0)
"""

KEEPS_RUNNING = LOADER + """
time.sleep(600)
"""


def _python(code: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not hasattr(signal, "sigwaitinfo"), reason="needs sigwaitinfo (Linux)")
def test_workers_ignore_stop_signals_but_not_their_main_process():
    p = _python(SIGNALLED)
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"the process did not exit: its workers ignored the main process's SIGTERM\n{err[-2000:]}")
    assert p.returncode == 0, err[-3000:]
    pids = [int(x) for x in out.split("\n")[0].split()]
    assert "batches after the signals: 50" in out, err[-3000:]
    deadline = time.time() + 10
    while any(_alive(w) for w in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(w) for w in pids)


@pytest.mark.heavy  # torch's watchdog polls the parent every 5 s
def test_workers_exit_when_their_main_process_is_killed():
    p = _python(KEEPS_RUNNING)
    pids = [int(x) for x in p.stdout.readline().split()]
    assert len(pids) == 2 and all(_alive(w) for w in pids), p.stderr.read() if p.poll() is not None else pids
    p.send_signal(signal.SIGKILL)  # no shutdown, no exit handlers: an OOM kill, a node's SIGKILL
    p.wait(30)
    deadline = time.time() + 20
    while any(_alive(w) for w in pids) and time.time() < deadline:
        time.sleep(0.2)
    left = [w for w in pids if _alive(w)]
    for w in left:
        os.kill(w, signal.SIGKILL)
    assert not left, f"workers {left} outlived their main process"
