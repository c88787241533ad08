"""One rank of the 2-rank gloo test (tests/test_engine.py): the toy GAN run twice in one process.
The second call finds the run completed; every rank must return (none may wait in a collective)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from toy_gan import ToyGan, config, run_task

torch.set_num_threads(1)
__import__('faulthandler').dump_traceback_later(60, exit=True)  # a hang prints where
out = Path(sys.argv[1])
cfg = config(out, train={"max_steps": 4})
first = run_task(cfg, ToyGan)
# A fresh rendezvous port: re-using the first one races with the other rank's teardown of its store.
__import__("os").environ["MASTER_PORT"] = sys.argv[2]
second = run_task(cfg, ToyGan)
rank = int(__import__("os").environ["RANK"])
(out / f"rank{rank}.json").write_text(json.dumps({"first": first["status"], "second": second["status"],
                                                  "step": second["step"]}))
