"""One rank of the multi-rank tests of tests/test_cluster_ready.py (gloo, CPU).
argv: out_dir mode [second_port]
  full      6 steps uninterrupted; writes this rank's first dropout mask and negatives, its final
            model and task state
  resumed   stopped after step 3 (every rank asked, as SLURM signals every task), then started again
            on a fresh rendezvous port to finish 6 steps; writes the same as `full`
  fail      rank 1 raises in its second step"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from toy_gan import run_task
from mpt import engine
from toy_mlp import config
from toy_ranks import RankToy
from conftest import StopAt

torch.set_num_threads(1)
__import__("faulthandler").dump_traceback_later(120, exit=True)  # a hang prints where
out, mode = Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])
cfg = config(out / mode, optim={"lr": 0.05}, train={"max_steps": 6, "dist_timeout_min": 1.0})
if mode == "fail":
    run_task(cfg, RankToy, fail_rank=1, fail_at=2)
    raise SystemExit(0)
task = RankToy(cfg)
if mode == "resumed":
    engine.Run.extra_observers = (StopAt(2),)
    s = engine.run(cfg, task)
    assert s["status"] == "interrupted" and s["step"] == 3, s
    engine.Run.extra_observers = ()
    engine.STOP.clear()
    os.environ["MASTER_PORT"] = sys.argv[3]  # a fresh rendezvous: the first one is being torn down
    task = RankToy(cfg)  # a new process would start with nothing: only the checkpoint carries state
    s = engine.run(cfg, task)
else:
    s = engine.run(cfg, task)
assert s["status"] == "completed", s
torch.save({"first": task.first, "acc": task.acc, "calls": task.calls, "model": task.model.state_dict()},
           out / f"{mode}.rank{rank}.pt")
