"""Results committed beside the experiments, and the README tables made from them.

A results file (experiments/<name>/results/<name>.jsonl) holds one JSON line per run: what the run was
(experiment, model, the table's precision column, impl, loss scale, TF32, the grid keys that set its cell,
seed, profile, data), what it gave (status, primary metric and every metric, steps, skipped steps, wall
time, the gradients' SQNR against FP32 where the run sampled it), where (the machine) and how (the command
or grid that made it, the code version and torch from the run's env.json). `python -m paper_tables export`
writes one from run directories; nothing else writes them.

A README shows such a file as a table between two markers:

    <!-- paper_tables: results/demo.jsonl -->
    (generated)
    <!-- /paper_tables -->

the path relative to the Markdown file. `python -m paper_tables readme` rewrites every block from its file
(mean ± sample std over seeds, the per-seed values, Δ against the model's FP32 with the 2-standard-error
test: paper_tables.tables.Cell; a recipe with fmt.* switches flipped also against its preset, and the
SQNR where the runs measured it), and tests/test_paper_tables_readme.py fails when a committed block differs
from what its file gives."""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import shlex
import statistics

from mpt.errors import UserError
from mpt.rundir import atomic_write_bytes
from paper_tables import results, specs, tables

REPO = pathlib.Path(__file__).resolve().parent.parent
# The Markdown files `readme` looks through when it is given none.
DOC_GLOBS = ("README.md", "docs/*.md", "experiments/*/README.md", "paper_tables/README.md")
# `metric=NAME` picks a metric other than the runs' primary one (translation: bleu beside perplexity).
BLOCK = re.compile(r"(<!-- paper_tables: (?P<src>[^\s>]+)(?: metric=(?P<metric>\w+))? -->\n)(?P<body>.*?)"
                   r"(<!-- /paper_tables -->)", re.S)
HIGHER_IS_BETTER = ("top1", "top5", "mAP", "map", "bleu")  # for a metric that is not the runs' primary one
# Overrides a grid gives every cell that say where and how a run logs, not what it computes.
NOT_THE_CELL = ("out_dir", "wandb.", "train.progress", "profile", "model", "precision", "seed")


# ----------------------------------------------------------------------------- export
def _submissions(exp_dir: pathlib.Path) -> dict:
    """run name -> (command, grid, the cell's overrides) from slurm.submit's submissions.jsonl."""
    out = {}
    path = exp_dir / "submissions.jsonl"
    if not path.is_file():
        return out
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            sub = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if not isinstance(sub, dict):
            continue
        cmd = shlex.join(["python", "-m", "slurm.submit", *map(str, sub.get("argv") or [])])
        for cell in sub.get("cells") or []:
            out[cell.get("run_name")] = (cmd, sub.get("grid"), _cell_keys(cell.get("overrides")))
    return out


def _cell_keys(overrides) -> list[str]:
    """What a cell's overrides set that makes it this cell (not where or how it logs), sorted."""
    return sorted({o for o in overrides or [] if not o.split("=")[0].startswith(NOT_THE_CELL)})


def _job_overrides(run_dir: pathlib.Path | None) -> list | None:
    """The cell's overrides as the run itself recorded them (slurm.job's job.json), None where it did not."""
    try:
        rec = json.loads((run_dir / "job.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return None
    got = rec.get("overrides") if isinstance(rec, dict) else None
    return got if isinstance(got, list) else None


def record(r: results.RunResult, machine: str | None, subs: dict) -> dict:
    """One run as a results line (the keys in the module docstring)."""
    cmd, grid, keys = subs.get(r.name, (None, None, []))
    env = r.env
    sqnr = results.run_sqnr(r, [])  # an unreadable history is listed by export's collect_dir already
    return {
        "experiment": r.experiment, "model": r.model, "precision": r.precision, "impl": r.impl,
        "loss_scale": r.loss_scale, "tf32": r.tf32, "config": keys, "seed": r.seed, "profile": r.profile,
        "data": r.data_name, "data_fingerprint": r.data, "status": r.status,
        "primary_metric": r.primary_metric, "higher_is_better": r.higher_is_better,
        "metrics": r.metrics, "step": r.step, "total_steps": r.total_steps, "skipped_steps": r.skipped_steps,
        "wall_time_s": r.wall_time_s,
        # The gradients' SQNR against FP32 in dB (numerics.sqnr_every; results.run_sqnr), None unmeasured.
        "sqnr_db": None if sqnr is None or not math.isfinite(sqnr) else round(sqnr, 3),
        # The machine: --machine, else the GPU's name or the CPU's model (env.json's "cpu", newer runs).
        "machine": machine or (env.get("device_name") if env.get("cuda") else env.get("cpu")) or env.get("device_name"),
        "device": env.get("device_name"),
        "world_size": env.get("world_size"), "command": cmd,
        "grid": grid, "run_name": r.name,
        "code": {"git_commit": env.get("git_commit"), "git_dirty": env.get("git_dirty"), "torch": env.get("torch"),
                 "date": env.get("date")},
    }


def export(runs_dir, out, *, experiment: str | None = None, machine: str | None = None) -> list[dict]:
    """Every run under runs_dir (of `experiment`, if given) as a results file at `out`, one line per run
    in a stable order; returns the lines. Runs paper_tables would skip are listed on the way."""
    runs, problems = results.collect_dir(runs_dir)
    runs = [r for r in runs if experiment is None or r.experiment == experiment]
    if not runs:
        raise UserError(f"--runs {runs_dir}: no run" + (f" of experiment {experiment}" if experiment else "")
                        + " to export; pass the folder that holds <experiment>/<run>/summary.json")
    subs: dict = {}
    for exp_dir in {r.run_dir.parent for r in runs if r.run_dir is not None}:
        subs.update(_submissions(exp_dir))
    for r in runs:  # a cell no submission record names (its launcher killed before writing one): its own job.json
        own = None if r.name in subs else _job_overrides(r.run_dir)
        if own is not None:
            subs[r.name] = (None, None, _cell_keys(own))
    lines = sorted((record(r, machine, subs) for r in runs),
                   key=lambda d: (d["experiment"], d["model"], d["precision"], str(d["config"]), repr(d["seed"])))
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, "".join(json.dumps(d, sort_keys=True) + "\n" for d in lines).encode())
    for p in problems:
        print(f"  skipped: {p}")
    return lines


# ----------------------------------------------------------------------------- read back
def load(path) -> list[dict]:
    path = pathlib.Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such results file; write it with `python -m paper_tables export --runs RUNS "
                        f"--out {path}`")
    out = []
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            d = json.loads(raw)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not JSON ({e.msg}); re-export the file") from None
        missing = [k for k in ("experiment", "model", "precision", "seed", "status", "metrics") if k not in d]
        if missing:
            raise UserError(f"{path}:{n}: missing {', '.join(missing)}; re-export the file")
        out.append(d)
    return out


# ----------------------------------------------------------------------------- one table
@dataclasses.dataclass
class Row:
    model: str
    column: str  # the precision column, with the cell's other keys
    variant: tuple
    cell: tables.Cell
    seeds: list = dataclasses.field(default_factory=list)  # (seed, value or status)
    sqnr: list = dataclasses.field(default_factory=list)  # each run's gradient SQNR in dB, where measured
    vs_preset: tables.Cell | None = None  # a recipe with fmt.* switches: the same values against its preset's
    skipped: list = dataclasses.field(default_factory=list)
    wall: list = dataclasses.field(default_factory=list)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _spec(experiment: str) -> specs.TableSpec | None:
    return next((s for s in specs.TABLES if s.experiment == experiment), None)


def _column(d: dict) -> str:
    # The column names what changes the computation; the data, the sampling and the recorded fields
    # (impl, loss scale) are said elsewhere.
    # fmt.* keys are in the precision column already (results.run_precision).
    keys = [k for k in d.get("config") or [] if not k.startswith(("task.data_root", "numerics.", "impl=", "loss_scale="))
            and k not in d["precision"].split()]
    scale = d.get("loss_scale")
    return " ".join([d["precision"], *([f"S={scale}"] if scale not in (None, 1) else []),
                     *([f"impl={d['impl']}"] if d.get("impl") == "paper" and d["precision"] != "fp32" else []),
                     *keys])


def rows_of(lines: list[dict], metric: str | None = None) -> tuple[list[Row], str, bool, int]:
    """Rows (model, column) in the paper tables' order with their cells of `metric` (default: the runs'
    primary metric); the metric; higher is better; decimals."""
    primary = next((d["primary_metric"] for d in lines if d.get("primary_metric")), None)
    spec = _spec(lines[0]["experiment"]) if lines else None
    primary = primary or (spec.metric[0] if spec else "loss")
    metric = metric or primary
    hib = next((d["higher_is_better"] for d in lines if d.get("higher_is_better") is not None),
               spec.higher_is_better if spec else False) if metric == primary else metric in HIGHER_IS_BETTER
    decimals = spec.decimals if spec else 2
    by: dict = {}
    for d in sorted(lines, key=lambda d: repr(d["seed"])):
        key = (d["model"], _column(d))
        variant = (d["precision"], d.get("impl"), d.get("loss_scale"), bool(d.get("tf32")))
        row = by.setdefault(key, Row(d["model"], key[1], variant, tables.Cell(decimals, comparable=False)))
        value = d["metrics"].get(metric) if isinstance(d["metrics"], dict) else None
        if d["status"] == "completed" and _finite(value):
            row.cell.values.append(float(value))
            row.seeds.append((d["seed"], f"{value:.{decimals}f}"))
        else:
            row.cell.others["no_metric" if d["status"] == "completed" else d["status"]] += 1
            row.seeds.append((d["seed"], d["status"]))
        row.skipped.append(d.get("skipped_steps") or 0)
        if _finite(d.get("wall_time_s")):
            row.wall.append(d["wall_time_s"])
        if _finite(d.get("sqnr_db")):
            row.sqnr.append(d["sqnr_db"])
    rows = sorted(by.values(), key=lambda r: (r.model, tables.variant_key(r.variant), r.column))
    for r in rows:  # Δ against the same model's FP32 (tables.Cell.vs_ref_text)
        ref = next((x for x in rows if x.model == r.model and x.variant[0] == "fp32" and not x.variant[3]), None)
        if ref is not None and ref is not r:
            r.cell.ref = ref.cell
        # A preset with switches flipped ("nvfp4 fmt.w.granularity=nvfp4_16") against the preset itself, the
        # row whose column is this one without the fmt.* keys.
        base = " ".join(w for w in r.column.split() if not w.startswith("fmt."))
        preset = next((x for x in rows if x.model == r.model and x.column == base), None)
        if base != r.column and preset is not None:
            r.vs_preset = dataclasses.replace(r.cell, ref=preset.cell, ref_name=base.split()[0])
    return rows, metric, hib, decimals


def table(lines: list[dict], metric: str | None = None) -> tuple[list[str], bool]:
    """The Markdown table of results lines (one row per model and column), and whether it has an SQNR column."""
    rows, metric, hib, _ = rows_of(lines, metric)
    # Two columns only where the lines have them: Δ against the preset (fmt.* switches), the gradients' SQNR.
    presets, sqnr = any(r.vs_preset for r in rows), any(r.sqnr for r in rows)
    head = ["model", "precision", f"{metric} ({'higher' if hib else 'lower'} is better)", "per seed", "Δ vs FP32",
            *(["Δ vs preset"] if presets else []), *(["grad SQNR dB (seeds' range)"] if sqnr else []), "skipped steps",
            "wall s per run"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        delta = r.cell.diff_text() if r.cell.ref is not None else ""
        per_seed = ", ".join(f"{s}: {v}" for s, v in r.seeds)
        wall = f"{sum(r.wall) / len(r.wall):.0f}" if r.wall else "—"
        extra = ([r.vs_preset.diff_text() if r.vs_preset else ""] if presets else []) + \
            ([_sqnr_text(r.sqnr)] if sqnr else [])
        out.append("| " + " | ".join([r.model, r.column, r.cell.ours_text(), per_seed, delta, *extra,
                                      ", ".join(map(str, r.skipped)), wall]) + " |")
    return out, sqnr


def _sqnr_text(dbs: list) -> str:
    """The median over seeds, and their range: how far apart two cells' SQNR must be to be more than seed noise."""
    if not dbs:
        return ""
    return f"{statistics.median(dbs):.1f}" + (f" ({min(dbs):.1f}-{max(dbs):.1f})" if len(dbs) > 1 else "")


SQNR_NOTE = ("grad SQNR: the gradients' SQNR against FP32 on the same weights and batch (numerics.sqnr_every), the "
             "median over sampled steps of the median over parameters, its median over seeds")


def to_markdown(lines: list[dict], link: str, metric: str | None = None) -> str:
    """The table of one results file, and the line that says where it comes from (no commit or date:
    those are in the file)."""
    if not lines:
        return f"[{link}]({link}) holds no runs.\n"
    out, sqnr = table(lines, metric)
    profiles = sorted({str(d.get("profile")) for d in lines})
    machines = sorted({str(d.get("machine")) for d in lines})
    data = sorted({str(d.get("data")) for d in lines if d.get("data")})
    commands = sorted({str(d["command"]) for d in lines if d.get("command")})
    # (a run started by hand, not by slurm.submit, records no command: say how many, not nothing)
    unrecorded = sum(not d.get("command") for d in lines)
    out += ["", f"Generated by `python -m paper_tables readme` from [{link}]({link}) ({len(lines)} runs; profile "
            f"{', '.join(profiles)}; data {', '.join(data) or 'not recorded'}; machine {', '.join(machines)}; "
            "mean ± sample std over seeds, Δ with the 2-standard-error test" + (f"; {SQNR_NOTE}" if sqnr else "")
            + "; the code version of each run is in the file). "
            + ("Made by " + "; ".join(f"`{c}`" for c in commands)
               + (f"; {unrecorded} of the runs outside slurm.submit, their command not recorded" if unrecorded else "")
               + "." if commands else "The command that made them is not recorded.")]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- README blocks
def render(text: str, base: pathlib.Path) -> str:
    """text with every paper_tables block regenerated from its results file (a path relative to base)."""
    def one(m: re.Match) -> str:
        src = m.group("src")
        return m.group(1) + to_markdown(load(base / src), src, m.group("metric")) + m.group(5)
    return BLOCK.sub(one, text)


def doc_files(root: pathlib.Path = REPO) -> list[pathlib.Path]:
    """The Markdown files that hold a block."""
    paths = sorted({p for g in DOC_GLOBS for p in root.glob(g)})
    return [p for p in paths if BLOCK.search(p.read_text(encoding="utf-8"))]


def stale(paths: list[pathlib.Path]) -> list[pathlib.Path]:
    return [p for p in paths if render(t := p.read_text(encoding="utf-8"), p.parent) != t]


def rewrite(paths: list[pathlib.Path]) -> list[pathlib.Path]:
    """Regenerate the blocks of each file; returns the files that changed."""
    changed = []
    for p in paths:
        text = p.read_text(encoding="utf-8")
        new = render(text, p.parent)
        if new != text:
            atomic_write_bytes(p, new.encode("utf-8"))
            changed.append(p)
    return changed


