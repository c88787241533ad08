"""Read results into RunResult records: from run directories (the contract's layout
<runs>/<experiment>/<run>/{summary.json,config.yaml,env.json,metrics.jsonl}) or from the wandb API.

Nothing here raises on a result it did not expect: a corrupt or partial summary, an unknown
experiment, a second run of the same cell and seed become a Problem (listed under the tables) and
the run is skipped. Only the user's own mistakes (a wrong --runs folder, a malformed --wandb name,
an unreachable wandb) are UserErrors.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import math
import pathlib
import re
import statistics
from typing import Callable

import yaml

from mpt import precisions
from mpt.errors import UserError
from paper_tables import specs

# A folder holding either file is a run (a partial one without summary.json is reported). Not
# config.yaml: wandb writes one of its own under <run>/wandb/.
RUN_FILES = ("summary.json", "metrics.jsonl")
# wandb run.state -> our status, for runs whose summary has no "status" key.
WANDB_STATES = {"finished": "completed", "running": "running", "crashed": "failed",
                "failed": "failed", "killed": "interrupted", "preempted": "interrupted",
                "preempting": "interrupted", "pending": "running"}


@dataclasses.dataclass
class Problem:
    where: str  # a run directory or wandb run
    what: str
    experiment: str | None = None
    profile: str | None = None

    def __str__(self):
        return f"{self.where}: {self.what}"


@dataclasses.dataclass
class Lines:
    """The parts of metrics.jsonl the figures use, kept compact (a paper run logs many steps)."""
    train_step: list = dataclasses.field(default_factory=list)
    train_loss: list = dataclasses.field(default_factory=list)
    train_scale: list = dataclasses.field(default_factory=list)
    eval: list = dataclasses.field(default_factory=list)  # whole eval lines
    numerics: list = dataclasses.field(default_factory=list)  # whole numerics lines
    # Per-model losses of a task with several (DCGAN's loss_D, loss_G): name -> [(step, value)].
    train_parts: dict = dataclasses.field(default_factory=dict)
    bad: int = 0  # lines that were not a JSON object

    def add(self, line: dict):
        kind = line.get("kind")
        step = _num(line.get("step"))
        if kind == "train" or (kind is None and "loss" in line):
            self.train_step.append(step)
            self.train_loss.append(_num(line.get("loss")))
            self.train_scale.append(_num(line.get("loss_scale")))
            for k, v in line.items():
                if str(k).startswith("loss_") and k != "loss_scale":
                    self.train_parts.setdefault(k, []).append((step, _num(v)))
        elif kind == "eval":
            self.eval.append(line)
        elif kind == "numerics" or any(str(k).startswith("numerics/") for k in line):
            self.numerics.append(line)


@dataclasses.dataclass
class RunResult:
    experiment: str
    model: str
    precision: str
    impl: str | None
    loss_scale: object  # None (no scaler), a number, "dynamic"
    tf32: bool
    profile: str
    seed: object
    status: str
    metrics: dict
    step: int | None
    total_steps: int | None
    skipped_steps: int | None
    updated: float  # POSIX seconds; "newest completed run wins" sorts on it
    env: dict
    name: str
    where: str
    run_dir: pathlib.Path | None = None
    data: str = ""  # the prepared dataset's fingerprint (config data_fingerprint); "" for older runs
    data_name: str = ""  # the last part of task.data_root, to name a dataset in a table title
    # As the summary has them (a committed results line carries them): None where it does not.
    primary_metric: object = None
    higher_is_better: object = None
    wall_time_s: object = None
    load_lines: Callable[[], Lines] | None = dataclasses.field(default=None, repr=False)
    _lines: Lines | None = dataclasses.field(default=None, repr=False)

    @property
    def group(self) -> tuple:
        """The cell a run belongs to; seeds aggregate inside it."""
        return (self.experiment, self.model, self.precision, self.impl, self.loss_scale, self.tf32,
                self.profile)

    @property
    def variant(self) -> tuple:
        return (self.precision, self.impl, self.loss_scale, self.tf32)

    def lines(self, problems: list[Problem]) -> Lines:
        if self._lines is None:
            try:
                self._lines = self.load_lines() if self.load_lines else Lines()
            except Exception as e:  # noqa: BLE001 -- a history we cannot read must not stop the other figures
                problems.append(self.problem(f"metrics unreadable ({_oneline(e)}); no curves from it"))
                self._lines = Lines()
            if self._lines.bad:
                problems.append(self.problem(f"metrics.jsonl: {self._lines.bad} unreadable line(s) skipped"))
        return self._lines

    def problem(self, what: str) -> Problem:
        return Problem(self.where, what, self.experiment, self.profile)


SQNR_KEY = "numerics/sqnr/grad_median"  # per sampled step: the median over parameters (mpt.numerics.sqnr_summary)


def run_sqnr(run: RunResult, problems: list) -> float | None:
    """A run's gradient SQNR against FP32 in dB: the median over its sampled steps (numerics.sqnr_every)
    of each step's median over parameters; None when it measured none. FP32's own is infinite."""
    vals = [v for line in run.lines(problems).numerics
            if (v := _num(line.get(SQNR_KEY))) is not None and not math.isnan(v)]
    return statistics.median(vals) if vals else None


# ----------------------------------------------------------------------------- small parsers
def _oneline(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _num(v) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _int(v) -> int | None:
    f = _num(v)
    return int(f) if f is not None and math.isfinite(f) else None


def _bool(v) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


def normalize_loss_scale(precision: str, value):
    """One spelling per loss scale, so that 128, 128.0 and "128" are the same cell."""
    row = precisions.of_column(precision)
    if row is not None and not row.loss_scaling:
        # No scaler, so the setting must not split a cell. FP16 math then runs at S = 1, the paper's
        # "MP without loss scaling" (section 4, Table 2); BF16, FP8 and FP32 have no S at all.
        return 1 if row.compute == "float16" else None
    if isinstance(value, str) and value.strip().lower() in ("dynamic", "auto"):
        # "auto" is what the precision's row says (mpt.precisions.parse_loss_scale reads it too).
        return "dynamic" if value.strip().lower() == "dynamic" else (row.auto_loss_scale if row else None)
    f = _num(value)
    if f is None:
        return None if value is None else str(value)
    return int(f) if f.is_integer() else f


def _parse_time(v) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if not isinstance(v, str):
        return None
    try:
        t = datetime.datetime.fromisoformat(v.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)
    return t.timestamp()


def read_jsonl(path: pathlib.Path) -> Lines:
    out = Lines()
    if not path.is_file():
        return out
    with open(path, encoding="utf-8", errors="replace") as f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                line = json.loads(raw)  # Python's json reads NaN/Infinity, which diverged runs log
            except json.JSONDecodeError:
                out.bad += 1
                continue
            if isinstance(line, dict):
                out.add(line)
            else:
                out.bad += 1
    return out


def run_precision(precision: str, cfg: dict) -> str:
    """A run's column: its precision, except where a key makes it another recipe -- fp8_<scaling>
    (fp8.ends=bf16, the FP8 paper's 16-bit first/last layers) or fp8_<scaling>_all (every layer FP8),
    <format>_all for a block-scaled format (fp8_block, mxfp8, nvfp4) with fp8.ends=fp8,
    and <precision>_<rounding> for weights without a master copy rounded other than to nearest; a format
    recipe changed by fmt.* keys is that name followed by the keys ("nvfp4 fmt.g.rounding=nearest"): another
    recipe, never the preset's column."""
    cfg = cfg if isinstance(cfg, dict) else {}
    fmt = cfg.get("fmt") if isinstance(cfg.get("fmt"), dict) else {}
    return " ".join([_run_precision(precision, cfg), *precisions.set_fmt_keys(fmt)])


def _run_precision(precision: str, cfg: dict) -> str:
    row = precisions.BY_NAME.get(precision)
    f8 = cfg.get("fp8") if isinstance(cfg.get("fp8"), dict) else {}
    if precision == "fp8":
        return f"fp8_{f8.get('scaling', 'delayed')}" + ("" if f8.get("ends", "bf16") == "bf16" else "_all")
    if precision in precisions.BLOCK_SCALED:
        return precision + ("" if f8.get("ends", "bf16") == "bf16" else "_all")
    if row is not None and not row.master and cfg.get("rounding", "nearest") != "nearest":
        return f"{precision}_{cfg['rounding']}"
    return precision


# ----------------------------------------------------------------------------- one run
def make_run(summary: dict, cfg: dict, env: dict, *, where: str, name: str, updated_fallback: float,
             guess_experiment: str | None, problems: list[Problem], run_dir=None,
             load_lines=None) -> RunResult | None:
    """Build a RunResult from a contract-shaped summary (config.yaml fills keys it lacks)."""

    def pick(key):
        v = summary.get(key)
        return cfg.get(key) if v is None else v

    experiment = pick("experiment")
    exp_for_msg = experiment if isinstance(experiment, str) else guess_experiment
    prof_for_msg = pick("profile") if isinstance(pick("profile"), str) else None

    def skip(what):
        problems.append(Problem(where, what + "; skipped", exp_for_msg, prof_for_msg))
        return None

    fields = {k: pick(k) for k in ("experiment", "model", "precision", "seed", "profile")}
    fields["status"] = summary.get("status")
    missing = [k for k, v in fields.items() if v is None or v == ""]
    if missing:
        # No profile would risk a tiny run landing in a paper table: never guess it.
        return skip(f"partial summary: missing {', '.join(missing)}")
    wrong = [k for k in ("experiment", "model", "precision", "profile", "status")
             if not isinstance(fields[k], str)]
    if wrong:
        return skip(f"summary: {', '.join(wrong)} not a string")
    known = specs.known_experiments()
    if experiment not in known:
        return skip(f"unknown experiment {experiment!r} (tables and figures know: {', '.join(known)})")
    status = fields["status"]
    if status not in specs.STATUSES:
        return skip(f"unknown status {status!r} (expected one of {', '.join(specs.STATUSES)})")
    precision = run_precision(fields["precision"], cfg)
    metrics = summary.get("metrics")
    if not isinstance(metrics, dict):
        if metrics is not None:
            problems.append(Problem(where, "summary: metrics is not an object; ignored", experiment,
                                    fields["profile"]))
        metrics = {}
    impossible = specs.impossible_metrics(metrics)
    if impossible:
        return skip(f"impossible metrics: {'; '.join(impossible)} -- a damaged or edited summary, or a bug")
    seed = fields["seed"]
    if isinstance(seed, float) and seed.is_integer():
        seed = int(seed)
    model = specs.model_aliases().get((experiment, fields["model"]), fields["model"])
    env = env if isinstance(env, dict) else {}
    tf32_cfg = cfg.get("tf32", summary.get("tf32"))
    # TF32 is on when the config asked for it or torch reported the matmul switch on (env.json);
    # cuDNN's switch defaults to on in torch, so it is listed under the table rather than trusted here.
    tf32 = _bool(tf32_cfg) or _bool(env.get("tf32_matmul"))
    impl = pick("impl")
    return RunResult(
        experiment=experiment, model=model, precision=precision,
        impl=None if impl is None else str(impl),
        loss_scale=normalize_loss_scale(precision, pick("loss_scale")), tf32=tf32,
        profile=fields["profile"], seed=seed, status=status, metrics=metrics,
        data=str(cfg.get("data_fingerprint") or ""), data_name=_data_name(cfg),
        step=_int(summary.get("step")), total_steps=_int(summary.get("total_steps")),
        skipped_steps=_int(summary.get("skipped_steps")),
        primary_metric=summary.get("primary_metric"), higher_is_better=summary.get("higher_is_better"),
        wall_time_s=summary.get("wall_time_s"),
        updated=_parse_time(summary.get("updated")) or updated_fallback, env=env,
        name=str(summary.get("run_name") or name), where=where, run_dir=run_dir, load_lines=load_lines)


def _data_name(cfg: dict) -> str:
    task = cfg.get("task")
    root = task.get("data_root") if isinstance(task, dict) else None
    return pathlib.PurePath(str(root)).name if root else ""


def split_by_data(runs: list[RunResult]) -> list[RunResult]:
    """Runs of one experiment and profile on different prepared datasets (e.g. the tiny profile on
    the synthetic set and on a real one) must never be averaged into one cell: each dataset becomes
    its own profile section, named after its data_root's folder (or fingerprint when those clash)."""
    by, names = collections.defaultdict(set), collections.defaultdict(set)
    for r in runs:
        by[(r.experiment, r.profile)].add(r.data)
        names[(r.experiment, r.profile, r.data_name)].add(r.data)
    for r in runs:
        if len(by[(r.experiment, r.profile)]) > 1:
            unique = r.data_name and len(names[(r.experiment, r.profile, r.data_name)]) == 1
            r.profile = f"{r.profile}-{r.data_name if unique else 'data' + (r.data[:8] or 'unknown')}"
    return runs


def _read_run_dir(root: pathlib.Path, d: pathlib.Path, problems: list[Problem]) -> RunResult | None:
    rel = d.relative_to(root).parts
    where = str(pathlib.Path(root.name, *rel))  # short and stable: "runs/<experiment>/<run>"
    guess = rel[0] if len(rel) >= 2 else None  # <runs>/<experiment>/<run>
    summary_path = d / "summary.json"
    if not summary_path.is_file():
        problems.append(Problem(where, "no summary.json (a partial or copied run); skipped", guess))
        return None
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problems.append(Problem(where, f"corrupt summary.json ({_oneline(e)}); skipped", guess))
        return None
    if not isinstance(summary, dict):
        problems.append(Problem(where, "summary.json is not a JSON object; skipped", guess))
        return None
    cfg = {}
    cfg_path = d / "config.yaml"
    if cfg_path.is_file():
        try:
            loaded = yaml.safe_load(cfg_path.read_text(encoding="utf-8"))
            if not isinstance(loaded, dict):
                raise ValueError("not a mapping")
            cfg = loaded
        except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError) as e:
            problems.append(Problem(where, f"config.yaml unreadable ({_oneline(e)}); used summary.json alone",
                                    summary.get("experiment") or guess))
    env = summary.get("env")
    if not isinstance(env, dict) and (d / "env.json").is_file():
        try:
            env = json.loads((d / "env.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            env = {}
    return make_run(summary, cfg, env or {}, where=where, name=d.name,
                    updated_fallback=summary_path.stat().st_mtime, guess_experiment=guess,
                    problems=problems, run_dir=d, load_lines=lambda: read_jsonl(d / "metrics.jsonl"))


def dedupe(runs: list[RunResult], problems: list[Problem]) -> list[RunResult]:
    """One run per (cell, seed): the newest completed one, else the newest of any status."""
    by = collections.defaultdict(list)
    for r in runs:
        by[(r.group, repr(r.seed))].append(r)
    kept = []
    for rs in by.values():
        completed = [r for r in rs if r.status == "completed"]
        winner = max(completed or rs, key=lambda r: (r.updated, r.where))
        kept.append(winner)
        for r in rs:
            if r is winner:
                continue
            if r.status == "completed":
                what = f"a second completed run of the same cell and seed; kept the newer {winner.where}"
            elif winner.status == "completed":
                what = f"{r.status} run of a cell and seed that has a completed run ({winner.where})"
            else:
                what = f"older {r.status} run of the same cell and seed as {winner.where}"
            problems.append(r.problem(what + "; skipped"))
    kept.sort(key=lambda r: r.where)
    return kept


def collect_dir(root) -> tuple[list[RunResult], list[Problem]]:
    root = pathlib.Path(root)
    if not root.is_dir():
        raise UserError(f"--runs {root}: no such directory; pass the folder that holds "
                        "<experiment>/<run>/summary.json (the training runs' out_dir, default 'runs')")
    problems: list[Problem] = []
    # wandb's offline folders live inside run directories (mpt/wandb_log.py); hidden folders are
    # temporary files and caches: neither holds runs.
    dirs = {p.parent for name in RUN_FILES for p in root.rglob(name) if p.is_file()
            and not any(part == "wandb" or part.startswith(".") for part in p.relative_to(root).parts[:-1])}
    runs = [r for d in sorted(dirs) if (r := _read_run_dir(root, d, problems))]
    return dedupe(split_by_data(runs), problems), problems


# ----------------------------------------------------------------------------- wandb
def _plain(obj):
    """wandb's config/summary objects -> plain dicts (recursively)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if hasattr(obj, "_json_dict"):
        return _plain(obj._json_dict)
    if hasattr(obj, "items") and callable(obj.items):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def lines_from_history(rows) -> Lines:
    """wandb history rows -> Lines. mpt.engine logs a train line's keys as they are ("loss",
    "loss_scale", ...), an eval line's as "eval/<k>", a numerics line's as "numerics/..." (its
    histograms as wandb Histograms), and wandb merges what was logged at one step into one row.
    So: unprefixed keys with a "loss" (or "train/<k>" keys) make a train line, "eval/<k>" an eval
    line, "numerics/..." keys a numerics line; a row with a "kind" key is taken as logged; the step
    is "step", else wandb's "_step"."""
    out = Lines()
    for row in rows:
        row = _plain(row)
        if not isinstance(row, dict):
            out.bad += 1
            continue
        step = row.get("step", row.get("_step"))
        if "kind" in row:
            out.add(row)
            continue
        plain = {k: v for k, v in row.items() if "/" not in k and not k.startswith("_")}
        train = {**plain, **{k[len("train/"):]: v for k, v in row.items() if k.startswith("train/")}}
        if "loss" in train:
            out.add({**train, "kind": "train", "step": step})
        part = {k[len("eval/"):]: v for k, v in row.items() if k.startswith("eval/")}
        if part:
            out.add({**part, "kind": "eval", "step": step})
        num = {k: v for k, v in row.items() if k.startswith("numerics/")}
        if num:
            out.add({"kind": "numerics", "step": step, **num})
    return out


def _wandb_run(run, path: str, problems: list[Problem]) -> RunResult | None:
    cfg = _plain(getattr(run, "config", {}) or {})
    summ = _plain(getattr(run, "summary", {}) or {})
    cfg = cfg if isinstance(cfg, dict) else {}
    summ = summ if isinstance(summ, dict) else {}
    where = getattr(run, "url", None) or f"wandb:{path}/{getattr(run, 'id', '?')}"
    metrics = dict(summ["metrics"]) if isinstance(summ.get("metrics"), dict) else {}
    metrics.update({k[len("final/"):]: v for k, v in summ.items() if k.startswith("final/")})
    status = summ.get("status")
    if status not in specs.STATUSES:
        status = WANDB_STATES.get(str(getattr(run, "state", "")), getattr(run, "state", None))
    if summ.get("diverged") is True:
        status = "diverged"
    env = summ.get("env") if isinstance(summ.get("env"), dict) else cfg.get("env")
    if not isinstance(env, dict):
        meta = _plain(getattr(run, "metadata", None) or {})
        meta = meta if isinstance(meta, dict) else {}
        env = {"device_name": meta.get("gpu"), "python": meta.get("python"),
               "hostname": meta.get("host"), "git_commit": (meta.get("git") or {}).get("commit")
               if isinstance(meta.get("git"), dict) else None}
    summary = {k: summ.get(k, cfg.get(k)) for k in
               ("experiment", "model", "precision", "impl", "loss_scale", "seed", "profile")}
    summary.update(status=status, metrics=metrics,
                   step=summ.get("step", summ.get("_step")),
                   total_steps=summ.get("total_steps", cfg.get("total_steps")),
                   skipped_steps=summ.get("skipped_steps"), run_name=getattr(run, "name", None),
                   updated=summ.get("updated"))
    fallback = None
    for attr in ("heartbeatAt", "heartbeat_at", "updated_at", "created_at", "createdAt"):
        fallback = _parse_time(getattr(run, attr, None))
        if fallback is not None:
            break
    return make_run(summary, cfg, env, where=where, name=str(getattr(run, "name", "") or where),
                    updated_fallback=fallback or 0.0, guess_experiment=None, problems=problems,
                    load_lines=lambda: lines_from_history(run.scan_history()))


def collect_wandb(path: str) -> tuple[list[RunResult], list[Problem]]:
    """Runs of one wandb project, mapped onto the summary.json contract (README: "From wandb")."""
    if not re.fullmatch(r"[^/\s]+/[^/\s]+", path or ""):
        raise UserError(f"--wandb {path!r}: expected ENTITY/PROJECT, e.g. --wandb my-team/mixed-precision")
    try:
        import wandb

        api_runs = list(wandb.Api().runs(path))
    except Exception as e:  # noqa: BLE001 -- no key, no network, no such project: the user's to fix, in one line
        raise UserError(f"--wandb {path}: could not list runs ({_oneline(e)}); check the name, "
                        "`wandb login` and the network, or read run folders with --runs") from None
    problems: list[Problem] = []
    runs = []
    for run in api_runs:
        try:
            r = _wandb_run(run, path, problems)
        except Exception as e:  # noqa: BLE001 -- one odd run must not stop the tables
            problems.append(Problem(f"wandb:{path}/{getattr(run, 'id', '?')}",
                                    f"unreadable run ({_oneline(e)}); skipped"))
            continue
        if r:
            runs.append(r)
    return dedupe(split_by_data(runs), problems), problems
