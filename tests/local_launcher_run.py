"""The local launcher on probe cells, as a process of its own for the tests that signal its process
group or kill its forkserver: `python -m local_launcher_run DIR CAP NAME:CODE[:MODE] ...` runs
local_cell_probe cells forked from a server that preloaded torch, at most CAP at once, and prints the
launcher's lines (then its results as json); a stop signal ends it with its one-line error (exit 2)."""
import json
import os
import pathlib
import sys

from mpt.errors import cli
from slurm import local


def main(argv):
    out, cap, specs = pathlib.Path(argv[0]), int(argv[1]), argv[2:]
    tasks = []
    for spec in specs:
        name, code, *mode = spec.split(":")
        tasks.append(local.LocalTask(
            name, [sys.executable, "-m", "local_cell_probe", str(out / f"{name}.json"), code, *mode],
            env={"PROBE_VAR": name, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
            log=out / f"{name}.log", preload=("torch",)))
    results = local.run_local(tasks, cap, started=lambda t, pid: print(f"started {t.name} {pid}", flush=True),
                               say=lambda line: print(line, flush=True))
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    cli(main)(sys.argv[1:])
