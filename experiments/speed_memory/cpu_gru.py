"""What mpt.cpu_gru buys a GRU layer on a CPU: one layer's forward and backward (FP32, one thread) by torch.gru and
by mpt.cpu_gru's hand-run time loop, at the tiny DeepSpeech 2 profiles' shapes (Mandarin: 84 inputs from the
convolutions, 141 units, batch 8, ~125 steps in a batch; English: 164 inputs, 210 units, batch 32, ~80 steps) or
any given, and each one's forward alone. The calls alternate within each round (drift in the machine's speed
falls on all alike); each round's figure is the mean over `reps` calls, timed by the thread's CPU time; the
median of rounds is printed with the ratio, the CPU's name and a check that both give the same output and
gradients (to FP32 rounding).
Writes the figures with the command and the CPU to out= (results/cpu-<cpu>-<date>-cpu_gru[-tag].json).

    OMP_NUM_THREADS=1 python -m experiments.speed_memory.cpu_gru [shapes=mandarin,english] [rounds=9] [reps=5]
        [out=experiments/speed_memory/results] [tag=]

A shape is a name above or INPUTSxUNITSxBATCHxSTEPS (e.g. 84x141x8x125).
"""
from __future__ import annotations

import contextlib
import re
import shlex
import statistics
import sys
import time

import torch
import torch.nn as nn

from experiments.speed_memory import check_least, check_tag, write_one_thread_result
from mpt import cpu_gru
from mpt.config_parse import parse_options
from mpt.errors import UserError, cli
from mpt.rundir import cpu_model, now

SHAPES = {"mandarin": (84, 141, 8, 125), "english": (164, 210, 32, 80)}


def _shape(s: str) -> tuple[str, tuple[int, ...]]:
    if s in SHAPES:
        return s, SHAPES[s]
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)x(\d+)", s)
    if not m or 0 in (v := tuple(int(g) for g in m.groups())):
        raise UserError(f"shapes={s}: give {', '.join(SHAPES)} or INPUTSxUNITSxBATCHxSTEPS, each at least 1 "
                        f"(e.g. 84x141x8x125)")
    return s, v


def measure(name: str, shape: tuple[int, ...], rounds: int, reps: int) -> dict:
    i, h, b, t = shape
    torch.manual_seed(0)
    gru = nn.GRU(i, h, batch_first=True)
    x = torch.randn(b, t, i, requires_grad=True)
    g_out = torch.randn(b, t, h)
    mode = cpu_gru.CPUGRU()

    def call(hand: bool, backward: bool = True):
        x.grad = None
        for p in gru.parameters():
            p.grad = None
        with mode if hand else contextlib.nullcontext():
            out = gru(x)[0]
        if backward:
            out.backward(g_out)
        return out.detach(), [x.grad, *(p.grad for p in gru.parameters())]

    ref, got = call(False), call(True)
    same = torch.allclose(got[0], ref[0], rtol=1e-4, atol=1e-5) and all(
        torch.allclose(a, c, rtol=1e-3, atol=1e-4 * c.abs().max().item()) for a, c in zip(got[1], ref[1]))
    # (torch.gru or the hand loop, forward and backward or the forward alone) -> ms per round
    times: dict = {(hand, bwd): [] for hand in (False, True) for bwd in (True, False)}
    for _ in range(rounds):
        spent = dict.fromkeys(times, 0.0)
        for _ in range(reps):
            for key in times:
                t0 = time.thread_time()
                call(*key)
                spent[key] += time.thread_time() - t0
        for key in times:
            times[key].append(1e3 * spent[key] / reps)
    ms = {key: statistics.median(v) for key, v in times.items()}
    torch_ms, hand_ms = ms[False, True], ms[True, True]
    return {"shape": name, "inputs": i, "units": h, "batch": b, "steps": t, "rounds": rounds, "reps": reps,
            "torch_gru_ms": torch_ms, "cpu_gru_ms": hand_ms, "speedup": torch_ms / hand_ms, "same_result": same,
            "torch_gru_forward_ms": ms[False, False], "cpu_gru_forward_ms": ms[True, False],
            "torch_gru_ms_rounds": times[False, True], "cpu_gru_ms_rounds": times[True, True]}


def main(argv=None) -> list[dict]:
    o = parse_options(argv or [], {"shapes": ",".join(SHAPES), "rounds": 9, "reps": 5,
                                   "out": "experiments/speed_memory/results", "tag": ""},
                      "experiments.speed_memory.cpu_gru")
    shapes = [_shape(s) for s in str(o["shapes"]).split(",") if s]
    if not shapes:
        raise UserError(f"shapes= is empty: name at least one of {', '.join(SHAPES)} or INPUTSxUNITSxBATCHxSTEPS")
    check_least(o, {"rounds": 1, "reps": 1})
    check_tag(o["tag"])
    if torch.get_num_threads() != 1:
        raise UserError("the calls are timed by this thread's CPU time: run with OMP_NUM_THREADS=1")
    cpu = cpu_model()
    print(f"one GRU layer, forward and backward, FP32, one thread of {cpu} (thread CPU time, median of rounds)")
    out = []
    for name, shape in shapes:
        r = measure(name, shape, int(o["rounds"]), int(o["reps"]))
        out.append(r)
        print(f"{name} ({r['inputs']} inputs, {r['units']} units, batch {r['batch']}, {r['steps']} steps): "
              f"torch.gru {r['torch_gru_ms']:.2f} ms, mpt.cpu_gru {r['cpu_gru_ms']:.2f} ms: {r['speedup']:.2f}x "
              f"(the forward alone {r['torch_gru_forward_ms']:.2f} and {r['cpu_gru_forward_ms']:.2f} ms); "
              f"same output and gradients (to FP32 rounding): {'yes' if r['same_result'] else 'NO'}", flush=True)
    result = {"command": "OMP_NUM_THREADS=1 python -m experiments.speed_memory.cpu_gru " + shlex.join(argv or []),
              "date": now(), "cpu": cpu, "threads": 1, "shapes": out}
    write_one_thread_result(o["out"], "cpu_gru", o["tag"], result)
    return out


if __name__ == "__main__":
    cli(main)(sys.argv[1:])
