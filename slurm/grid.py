"""Grid files: the runs of one experiment as the product of a few axes.

experiments/<name>/grid.yaml:

    experiment: ilsvrc_cnns
    axes:                       # the grid is the product of these lists; any config key may be an axis
      model: [alexnet, resnet50_preact]
      precision: [fp32, mixed]   # or a group of the precision table: formats, block_scaled, no_master_copy
      seed: [0]
    variants:                   # optional: cells that differ in several keys at once, each crossed with the axes
      - {precision: fp32}       # (one switch flipped at a time from a preset); default: one empty variant
      - {precision: nvfp4, fmt.w.granularity: nvfp4_16}
    overrides: []               # key=value applied to every cell
    profiles:                   # one per config profile (mpt.config): `profile=<name>` is set for you
      tiny:
        axes: {...}             # optional: replaces the top-level axes of the same name
        variants: [...]         # optional: replaces the top-level variants
        overrides: [...]        # optional: more key=value for every cell of this profile
        resources: {gpus: 0, tasks: 1, threads: 1, hours: 0.01}
      paper:
        resources: {gpus: 8, hours: {default: 24, alexnet: 8}}

resources (what one run needs; where it runs is the cluster profile's business, slurm/clusters/):
    gpus     GPUs per run, one process (DDP rank) per GPU; 0 = a CPU run
    tasks    processes per CPU run (gloo DDP); must be 1 or equal gpus when gpus > 0
    threads  CPU threads per process on the local backend (SLURM: the cluster's cpus_per_task)
    hours    estimated wall-clock hours per run, a number or {model: hours, default: hours};
             only used for --dry-run's GPU-hour estimate

Each cell is one run: its id is mpt.identity.cell_id of the resolved config (infrastructure keys such
as out_dir or data paths excluded) and its run directory is mpt.identity.run_dir.
"""
from __future__ import annotations

import itertools
import math
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from mpt.errors import UserError

GRID_KEYS = {"experiment", "description", "axes", "variants", "overrides", "profiles"}
PROFILE_KEYS = {"description", "axes", "variants", "overrides", "resources"}
RESOURCE_KEYS = {"gpus", "tasks", "threads", "hours"}


@dataclass
class Resources:
    gpus: int = 0
    tasks: int = 1
    threads: int = 1
    hours: Any = 1.0  # number or {model: hours, default: hours}

    @property
    def world(self) -> int:
        """Processes (DDP ranks) per run: one per GPU, or `tasks` CPU processes."""
        return self.gpus if self.gpus > 0 else self.tasks

    def hours_for(self, model: str) -> float:
        if isinstance(self.hours, dict):
            return float(self.hours.get(model, self.hours.get("default", 0.0)))
        return float(self.hours)


@dataclass
class Cell:
    """One run of the grid."""

    experiment: str
    axes: dict[str, Any]  # this cell's axis values, e.g. {"model": "alexnet", "precision": "fp32"}
    overrides: list[str]  # everything the run needs: python -m experiments.<name> <overrides>
    cfg: Any  # the resolved mpt.config.Config
    cell_id: str
    run_name: str
    run_dir: pathlib.Path

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.axes.items())


@dataclass
class Grid:
    path: pathlib.Path
    experiment: str
    profile: str
    axes: dict[str, list]
    overrides: list[str]
    resources: Resources
    cells: list[Cell] = field(default_factory=list)


def fmt_value(v) -> str:
    """An axis value as the right-hand side of a key=value override."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    return str(v)


def _check_keys(d: dict, allowed: set, where: str) -> None:
    if not isinstance(d, dict):
        raise UserError(f"{where} must be a mapping, got {type(d).__name__}")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; allowed: {', '.join(sorted(allowed))}")


def _check_axes(axes, where: str) -> dict[str, list]:
    if axes is None:
        return {}
    if not isinstance(axes, dict):
        raise UserError(f"{where} must map a config key to a list of values")
    out = {}
    for k, vals in axes.items():
        if not isinstance(vals, list) or not vals:
            raise UserError(f"{where}.{k} must be a non-empty list of values, e.g. {k}: [a, b]")
        for v in vals:
            if isinstance(v, (dict, list)):
                raise UserError(f"{where}.{k}: values must be scalars, got {v!r}")
        out[str(k)] = vals
    return out


def _check_variants(variants, axes: dict, where: str) -> list[dict]:
    """A list of mappings config key -> scalar, none of them an axis (a key is set in one place)."""
    if not isinstance(variants, list) or not variants:
        raise UserError(f"{where} must be a non-empty list of mappings, e.g. [{{precision: fp32}}, {{precision: nvfp4}}]")
    out = []
    for v in variants:
        if v is None:
            v = {}
        if not isinstance(v, dict) or any(isinstance(x, (dict, list)) for x in v.values()):
            raise UserError(f"{where}: each variant maps config keys to scalars, got {v!r}")
        both = sorted(set(map(str, v)) & set(axes))
        if both:
            raise UserError(f"{where}: {', '.join(both)} is an axis and a variant key; set it in one place")
        out.append({str(k): x for k, x in v.items()})
    return out


def _check_overrides(ov, where: str) -> list[str]:
    if ov is None:
        return []
    if not isinstance(ov, list) or not all(isinstance(o, str) and "=" in o for o in ov):
        raise UserError(f"{where} must be a list of key=value strings, e.g. [train.epochs=1]")
    return list(ov)


def _resources(d, where: str) -> Resources:
    d = d or {}
    _check_keys(d, RESOURCE_KEYS, where)
    r = Resources(**d)
    for k in ("gpus", "tasks", "threads"):
        v = getattr(r, k)
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if k == "gpus" else 1):
            raise UserError(f"{where}.{k} must be an integer >= {0 if k == 'gpus' else 1}, got {v!r}")
    if r.gpus > 0 and "tasks" in d and r.tasks not in (1, r.gpus):
        raise UserError(f"{where}: tasks={r.tasks} with gpus={r.gpus}; GPU runs use one task per GPU, drop tasks")
    if isinstance(r.hours, dict):
        if not all(isinstance(v, (int, float)) for v in r.hours.values()):
            raise UserError(f"{where}.hours must map model names (or default) to numbers")
    elif not isinstance(r.hours, (int, float)) or isinstance(r.hours, bool):
        raise UserError(f"{where}.hours must be a number or a mapping {{model: hours, default: hours}}")
    return r


def load_spec(path) -> dict:
    path = pathlib.Path(path)
    if not path.is_file():
        raise UserError(f"grid file {path} not found; grids live in experiments/<name>/grid.yaml")
    from mpt.config_parse import safe_load, yaml_error

    try:
        spec = safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise UserError(f"grid file {path} is not valid YAML: {yaml_error(e)}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"grid file {path} is not UTF-8 text (byte {e.start}); give a grid.yaml") from None
    _check_keys(spec, GRID_KEYS, str(path))
    if not spec.get("experiment"):
        raise UserError(f"{path}: missing 'experiment: <name>' (a folder in experiments/)")
    if not isinstance(spec["experiment"], str) or not re.fullmatch(r"[A-Za-z_]\w*", spec["experiment"]):
        # it becomes a module name and a folder of runs/: no path characters
        raise UserError(f"{path}: experiment: {spec['experiment']!r} is not the name of a folder in experiments/ "
                        f"(letters, digits, underscores)")
    if not isinstance(spec.get("profiles"), dict) or not spec["profiles"]:
        raise UserError(f"{path}: missing 'profiles:' (e.g. tiny and paper)")
    return spec


def load(path, profile: str, extra: list[str] = (), only: list[str] = ()) -> Grid:
    """Expand a grid file for one profile into resolved cells.

    extra: key=value overrides appended to every cell (the command's --set); only: key=value filters
    (the command's --only; several values of one key are alternatives, different keys must all match).
    Relative out_dir values are made absolute here so that jobs, wherever they start, write where
    slurm.status looks."""
    from mpt import config, identity

    path = pathlib.Path(path)
    spec = load_spec(path)
    profiles = spec["profiles"]
    if profile not in profiles:
        raise UserError(f"{path}: unknown profile {profile!r}; choose one of: {', '.join(profiles)}")
    prof = profiles[profile] or {}
    where = f"{path}: profiles.{profile}"
    _check_keys(prof, PROFILE_KEYS, where)
    axes = _check_axes(spec.get("axes"), f"{path}: axes")
    axes.update(_check_axes(prof.get("axes"), f"{where}.axes"))
    if not axes:
        raise UserError(f"{path}: no axes; give at least one, e.g. axes: {{model: [alexnet]}}")
    if "precision" in axes:  # group names (mpt.precisions.GROUPS, e.g. block_scaled) stand for their members
        from mpt.precisions import expand_groups

        axes["precision"] = expand_groups(axes["precision"])
    variants = prof.get("variants", spec.get("variants"))
    variants = [{}] if variants is None else _check_variants(
        variants, axes, f"{where}.variants" if "variants" in prof else f"{path}: variants")
    fixed = (_check_overrides(spec.get("overrides"), f"{path}: overrides")
             + _check_overrides(prof.get("overrides"), f"{where}.overrides"))
    extra = _check_overrides(list(extra), "--set")
    for o in (*fixed, *extra):  # the profile is the grid's own choice: a second one would name other cells
        if o.split("=", 1)[0].strip() == "profile":
            raise UserError(f"{o!r}: choose the profile with --profile (this grid's: {', '.join(profiles)}), "
                            "not as an override")
    grid = Grid(path, str(spec["experiment"]), profile, axes, fixed, _resources(prof.get("resources"), f"{where}.resources"))

    filters: dict[str, set[str]] = {}
    for o in only:
        if "=" not in o:
            raise UserError(f"--only {o!r}: write key=value, e.g. --only model=alexnet")
        k, v = o.split("=", 1)
        filters.setdefault(k.strip(), set()).add(v.strip())

    keys = list(axes)
    seen: dict[str, Cell] = {}
    # Variants outermost: a variant's cells (all its seeds) are submitted together.
    for variant, values in itertools.product(variants, itertools.product(*(axes[k] for k in keys))):
        point = {**variant, **dict(zip(keys, values))}
        if any(fmt_value(point[k]) not in wanted for k, wanted in filters.items() if k in point):
            # left out by an axis value: not resolved either (a model's data given by --set task.data_root
            # is not the other model's: DeepSpeech 2's English data for --only model=english)
            continue
        overrides = [f"profile={profile}", *fixed, *(f"{k}={fmt_value(v)}" for k, v in point.items()), *extra]
        try:
            cfg = config.resolve(grid.experiment, overrides)
        except UserError as e:
            label = " ".join(f"{k}={fmt_value(v)}" for k, v in point.items())
            raise UserError(f"{path} profile {profile}, cell {label}: {e}") from None
        if not pathlib.Path(cfg.out_dir).is_absolute():
            cfg.out_dir = str(pathlib.Path(cfg.out_dir).resolve())
            overrides.append(f"out_dir={cfg.out_dir}")
        if filters and not _matches(cfg, point, filters):
            continue
        cid = identity.cell_id(cfg)
        cell = Cell(grid.experiment, {k: fmt_value(v) for k, v in point.items()}, overrides, cfg, cid,
                    identity.run_name(cfg), identity.run_dir(cfg))
        if cid in seen:  # e.g. an axis over an infrastructure key: same run twice
            raise UserError(f"{path} profile {profile}: cells {seen[cid].label!r} and {cell.label!r} resolve to the "
                            f"same run {cell.run_name}; an axis varies only infrastructure keys")
        seen[cid] = cell
        grid.cells.append(cell)
    if filters and not grid.cells:
        raise UserError(f"--only {' '.join(only)} matches no cell of {path} profile {profile}")
    return grid


def config_value(cfg, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        if not hasattr(obj, part):
            raise UserError(f"--only {dotted}=...: unknown config key {dotted!r}")
        obj = getattr(obj, part)
    return obj


def _matches(cfg, point: dict, filters: dict[str, set[str]]) -> bool:
    for k, wanted in filters.items():
        have = fmt_value(point[k]) if k in point else fmt_value(config_value(cfg, k))
        if have not in wanted:
            return False
    return True


def nodes_and_tasks(res: Resources, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, tasks per node) for one run: one task per GPU, filling whole nodes."""
    if res.gpus == 0:
        return 1, res.tasks
    if gpus_per_node <= 0:
        raise UserError(f"the grid asks for {res.gpus} GPUs per run but the cluster profile has gpus_per_node: 0; "
                        "use a GPU cluster profile or a CPU grid profile (gpus: 0)")
    per_node = min(res.gpus, gpus_per_node)
    if res.gpus % per_node:
        raise UserError(f"{res.gpus} GPUs per run do not fill whole nodes of {gpus_per_node} GPUs; "
                        f"use a multiple of {gpus_per_node}")
    return math.ceil(res.gpus / per_node), per_node
