"""One rank of the 2-rank gloo test of impl=paper (tests/test_precision.py): ranks initialise
different weights; DDP broadcasts rank 0's model, and the FP32 masters must follow."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from mpt import engine
from toy_mlp import ToyMLP, config

torch.set_num_threads(1)
__import__("faulthandler").dump_traceback_later(60, exit=True)  # a hang prints where
out = Path(sys.argv[1])
cfg = config(out, precision=sys.argv[2], impl="paper", loss_scale=sys.argv[3], optim={"lr": 0.05},
             train={"max_steps": 5})
s = engine.run(cfg, ToyMLP(cfg, seed_per_rank=True, dump_dir=str(out)))
assert s["status"] == "completed", s
