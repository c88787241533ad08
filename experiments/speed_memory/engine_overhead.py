"""Engine overhead benchmark: the engine's training step (mpt.engine.Run.train_step through the
precision recipe) versus a hand-written torch.amp loop, same model, same batch, one process,
alternating blocks so drift in machine load hits both equally. Prints figures; asserts nothing.

    python -m experiments.speed_memory.engine_overhead [--model resnet50_preact] [--width 0.0625]
        [--batch 32] [--size 80] [--precisions fp32,mixed] [--rounds 7] [--steps 10] [--device auto]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import models
from mpt import config as C
from mpt import engine
from mpt.errors import cli


class SyntheticTask:
    primary_metric, higher_is_better = "top1", True

    def __init__(self, model_name, width, n, size, classes=10):
        self.model_name, self.width = model_name, width
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, size, size, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.classes = classes

    def datasets(self, cfg):
        ds = TensorDataset(self.x, self.y)
        return ds, ds

    def build_model(self, cfg):
        return models.build(self.model_name, num_classes=self.classes, width=self.width)

    def loss(self, model, batch):
        x, y = batch
        out = model(x)
        out = out[0] if isinstance(out, tuple) else out
        return F.cross_entropy(out.float(), y), y.shape[0]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args, precision: str) -> dict:
    overrides = ["profile=tiny", f"precision={precision}", "wandb.mode=disabled", "train.progress=false",
                 f"train.batch_size={args.batch}", "train.num_workers=0", f"device={args.device}",
                 "out_dir=/tmp/engine_overhead_runs", "model=resnet50_preact"]
    cfg = C.resolve("ilsvrc_cnns", overrides)
    task = SyntheticTask(args.model, args.width, args.batch * 2, args.size)
    run = engine.Run(cfg, task)
    run.setup()
    dev = run.device
    batch = (task.x[: args.batch], task.y[: args.batch])
    xb, yb = batch[0].to(dev), batch[1].to(dev)

    # The hand-written reference: the PyTorch AMP recipe, written out.
    ref = copy.deepcopy(task.build_model(cfg)).to(dev)
    opt = torch.optim.SGD(ref.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum,
                          weight_decay=cfg.optim.weight_decay)
    use_amp = precision == "mixed"
    scaler = torch.amp.GradScaler(dev.type, enabled=use_amp)

    def hand_step():
        with torch.autocast(dev.type, dtype=torch.float16, enabled=use_amp):
            out = ref(xb)
            out = out[0] if isinstance(out, tuple) else out
            loss = F.cross_entropy(out.float(), yb)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.item()  # the engine reads the loss every step too (divergence check)

    def engine_step():
        run.train_step([batch])
        run.step += 1

    def block(fn):
        sync(dev)
        t = time.perf_counter()
        for _ in range(args.steps):
            fn()
        sync(dev)
        return (time.perf_counter() - t) / args.steps

    run.act_bytes = 0  # measure activation memory outside the timed blocks
    for fn in (hand_step, engine_step):  # warm-up
        block(fn)
    hand, eng = [], []
    for r in range(args.rounds):
        order = (hand_step, engine_step) if r % 2 == 0 else (engine_step, hand_step)
        for fn in order:
            (hand if fn is hand_step else eng).append(block(fn))
    h, e = statistics.median(hand), statistics.median(eng)
    ratios = [b / a for a, b in zip(hand, eng)]
    return {"precision": precision, "hand_ms": 1e3 * h, "engine_ms": 1e3 * e, "overhead_pct": 100 * (e / h - 1),
            "ratio_spread": (min(ratios), max(ratios)), "device": str(dev)}


@cli
def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.speed_memory.engine_overhead")
    p.add_argument("--model", default="resnet50_preact")
    p.add_argument("--width", type=float, default=0.0625)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=80)
    p.add_argument("--precisions", default="fp32,mixed")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    print(f"engine vs hand-written torch.amp loop: {args.model} width {args.width}, batch {args.batch}, "
          f"{args.size}px, {args.rounds} alternating rounds of {args.steps} steps, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for prec in args.precisions.split(","):
        r = measure(args, prec)
        print(f"{prec:6s} {r['device']:6s} hand {r['hand_ms']:8.2f} ms/step   engine {r['engine_ms']:8.2f} ms/step   "
              f"overhead {r['overhead_pct']:+5.1f}%   (per-round ratio {r['ratio_spread'][0]:.3f}..{r['ratio_spread'][1]:.3f})")


if __name__ == "__main__":
    main()
