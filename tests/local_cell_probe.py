"""A cell for the local launcher's tests: `python -m local_cell_probe REPORT CODE [MODE]` writes what its
process looks like to REPORT (json), prints a line, then exits with CODE ("raise": an uncaught exception),
or with MODE: `wait` for SIGTERM (then exit 3, as an interrupted slurm.job), `sleep=S` first, or `thread`:
leave a non-daemon thread behind that never ends, and take SIGTERM without stopping (a hung cell)."""
import sys

PRELOADED = "torch" in sys.modules  # imported before this module ran: a fork of the preloaded server

import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

report, code = sys.argv[1], sys.argv[2]
mode = sys.argv[3] if len(sys.argv) > 3 else ""
with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
    cmdline = [a.decode() for a in f.read().rstrip(b"\0").split(b"\0")]
info = {"preloaded": PRELOADED, "argv": sys.argv[1:], "name": __name__, "cwd": os.getcwd(),
        "own_session": os.getsid(0) == os.getpid(), "threads": torch.get_num_threads(),
        "probe_var": os.environ.get("PROBE_VAR"), "pid": os.getpid(), "ppid": os.getppid(), "cmdline": cmdline,
        "np_rand": np.random.rand(), "py_rand": random.random()}
with open(report + ".tmp", "w") as f:
    json.dump(info, f)
os.replace(report + ".tmp", report)  # whole when it appears: the tests poll for it
print(f"probe says hello from {os.getpid()}", flush=True)
if mode == "wait":
    signal.signal(signal.SIGTERM, lambda *a: (open(report + ".sigterm", "a").close(), sys.exit(3)))
    while True:
        time.sleep(0.05)
if mode.startswith("sleep="):
    time.sleep(float(mode[6:]))
if mode == "thread":
    signal.signal(signal.SIGTERM, lambda *a: open(report + ".sigterm", "a").close())
    threading.Thread(target=lambda: time.sleep(10**6)).start()  # non-daemon: the interpreter waits for it
if code == "raise":
    raise RuntimeError("probe failed")
sys.exit(int(code))
