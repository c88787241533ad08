"""Mean +- std over seeds of finished translation runs: the numbers of README "Tiny profile".

    python -m experiments.wmt_translation.tiny_check RUNS_DIR [RUNS_DIR ...]

Reads every run folder under each RUNS_DIR (paper_tables.results, the reader the figures use) and
prints, per dataset and precision/loss-scale variant: final training perplexity (exp of the mean
training loss of the last 3 train log lines: 30 steps in the tiny profile), validation perplexity (metrics.perplexity), test BLEU
(metrics.bleu), overflow-skipped steps, wall time, and the runs that did not complete.
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


def summarize(root) -> list[str]:
    from paper_tables import figures, results
    from paper_tables.tables import _variant_key

    runs, problems = results.collect_dir(root)
    rows = collections.defaultdict(list)
    for r in runs:
        rows[(r.data_name, r.model, r.variant)].append(r)
    out = [f"## {root}", "| data | model | variant | n | seeds | train ppl | val ppl | test BLEU | skipped | wall s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(rows, key=lambda k: (k[0], k[1], _variant_key(k[2]))):
        rs = sorted(rows[key], key=lambda r: str(r.seed))
        ok = [r for r in rs if r.status == "completed"]
        train = []
        for r in ok:
            loss = [v for v in r.lines(problems).train_loss if v is not None and math.isfinite(v)][-3:]
            if loss:
                train.append(math.exp(statistics.mean(loss)))
        wall = [float(json.loads((r.run_dir / "summary.json").read_text()).get("wall_time_s") or 0) for r in ok]
        out.append(f"| {key[0]} | {key[1]} | {figures.variant_label(key[2])} | {len(ok)}/{len(rs)} | "
                   f"{','.join(str(r.seed) for r in ok)} | {_ms(train)} | "
                   f"{_ms([r.metrics['perplexity'] for r in ok])} | {_ms([r.metrics['bleu'] for r in ok])} | "
                   f"{_ms([float(r.skipped_steps or 0) for r in ok])} | {_ms(wall)} |")
    return out


@cli
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.wmt_translation.tiny_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="folders holding run directories (out_dir of the runs)")
    a = p.parse_args(argv)
    for root in a.runs:
        print("\n".join(summarize(root)) + "\n")


if __name__ == "__main__":
    main()
