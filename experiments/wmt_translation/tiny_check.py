"""Mean +- std over seeds of finished translation runs: the numbers of README "Tiny profile".

    python -m experiments.wmt_translation.tiny_check RUNS_DIR [RUNS_DIR ...] [--step N]

Reads every run folder under each RUNS_DIR (paper_tables.results, the reader the figures use) and
prints, per dataset and precision/loss-scale variant: final training perplexity (exp of the mean
training loss of the last 3 train log lines: 30 steps in the tiny profile), validation perplexity (metrics.perplexity), test BLEU
(metrics.bleu), overflow-skipped steps, wall time, and the runs that did not complete. With --step N:
the same at step N of every run that got there (the evaluation logged at step N, the training
perplexity of the three train log lines up to N), finished or not -- runs compared at one point.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import statistics

from mpt.errors import cli


def _ms(xs: list[float]) -> str:
    if not xs:
        return "--"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.2f} +- {sd:.2f}"


def _at(r, problems, step: int | None):
    """(train ppl, eval line) of a run: at its end, or at `step` (None when it did not get there)."""
    lines = r.lines(problems)
    reached = max((x for x in lines.train_step if x is not None), default=-1)
    pts = [(x, v) for x, v in zip(lines.train_step, lines.train_loss)
           if x is not None and v is not None and math.isfinite(v) and (step is None or x <= step)]
    if step is None:
        if r.status != "completed":
            return None, None
        ev = r.metrics
    else:
        ev = next((e for e in lines.eval if e.get("step") == step), None)
        if reached < step:
            return None, None
    train = math.exp(statistics.mean(v for _, v in pts[-3:])) if pts else None
    return train, ev


def summarize(root, step: int | None = None) -> list[str]:
    from paper_tables import figures, results
    from paper_tables.tables import variant_key

    runs, problems = results.collect_dir(root)
    rows = collections.defaultdict(list)
    for r in runs:
        rows[(r.data_name, r.model, r.variant)].append(r)
    where = "at the end" if step is None else f"at step {step}"
    out = [f"## {root} ({where})",
           "| data | model | variant | n | seeds | train ppl | val ppl | test BLEU | skipped | wall s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(rows, key=lambda k: (k[0], k[1], variant_key(k[2]))):
        rs = sorted(rows[key], key=lambda r: str(r.seed))
        got = [(r, *_at(r, problems, step)) for r in rs]
        ok = [g for g in got if g[1] is not None]
        evs = [g for g in ok if g[2] is not None]
        wall = [float(json.loads((r.run_dir / "summary.json").read_text()).get("wall_time_s") or 0)
                for r, _, _ in ok if r.status == "completed"]
        out.append(f"| {key[0]} | {key[1]} | {figures.variant_label(key[2])} | {len(ok)}/{len(rs)} | "
                   f"{','.join(str(r.seed) for r, _, _ in ok)} | {_ms([t for _, t, _ in ok])} | "
                   f"{_ms([e['perplexity'] for _, _, e in evs])} | {_ms([e['bleu'] for _, _, e in evs])} | "
                   f"{_ms([float(r.skipped_steps or 0) for r, _, _ in ok])} | {_ms(wall)} |")
    return out


@cli
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.wmt_translation.tiny_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="folders holding run directories (out_dir of the runs)")
    p.add_argument("--step", type=int, default=None, help="compare every run at this step instead of at its end")
    a = p.parse_args(argv)
    for root in a.runs:
        print("\n".join(summarize(root, a.step)) + "\n")


if __name__ == "__main__":
    main()
