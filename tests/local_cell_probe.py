"""A cell for the local launcher's tests: `python -m local_cell_probe REPORT CODE [wait]` writes what its
process looks like to REPORT (json), prints a line, then waits for SIGTERM (wait) or exits with CODE
("raise": an uncaught exception)."""
import sys

PRELOADED = "torch" in sys.modules  # imported before this module ran: a fork of the preloaded server

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

report, code = sys.argv[1], sys.argv[2]
info = {"preloaded": PRELOADED, "argv": sys.argv[1:], "name": __name__, "cwd": os.getcwd(),
        "own_session": os.getsid(0) == os.getpid(), "threads": torch.get_num_threads(),
        "probe_var": os.environ.get("PROBE_VAR"), "pid": os.getpid()}
with open(report, "w") as f:
    json.dump(info, f)
print(f"probe says hello from {os.getpid()}", flush=True)
if sys.argv[3:] == ["wait"]:
    signal.signal(signal.SIGTERM, lambda *a: (open(report + ".sigterm", "w").close(), sys.exit(3)))
    while True:
        time.sleep(0.05)
if code == "raise":
    raise RuntimeError("probe failed")
sys.exit(int(code))
