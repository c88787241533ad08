"""A run's identity: its content id (cell_id, the sha256 of the resolved config without infrastructure
keys), its name and its directory, and the first key in which a stored config differs from a new one
(config_difference: a run directory is never continued with another config). One spelling per loss
scale (canonical_loss_scale), so that equal recipes are one run."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import pathlib

from mpt import formats, precisions
from mpt.errors import UserError


def canonical_loss_scale(value: str, precision: str = "") -> str:
    """One spelling per loss scale, so that equal recipes are one cell (one content id, one run
    directory): 8, 8.0, "8.0" and 8e0 are all "8"; 0.5 stays "0.5"; auto and dynamic in lower case.
    Given the precision, a spelling of what `auto` means there (mpt.precisions.parse_loss_scale) is
    `auto`: dynamic under mixed, and S = 1 under the precisions that never scale. fp16_pure and
    fp16_storage keep 1 and dynamic: there auto is no scaler at all, which skips no overflowing step.
    What is not a number is left for precisions.check to reject."""
    v = str(value).strip().lower()
    try:
        f = float(v)
    except ValueError:
        f = None
    if f is not None and not math.isfinite(f):
        return v
    if _means_auto(v, precision):
        return "auto"
    if f is None:
        return v
    return str(int(f)) if f.is_integer() and abs(f) < 2 ** 53 else repr(f)


def _means_auto(value: str, precision: str) -> bool:
    try:
        return precisions.parse_loss_scale(value, precision) == precisions.parse_loss_scale("auto", precision)
    except UserError:  # an unknown precision, or a loss scale it refuses: not auto's spelling
        return False


def strip_infra(dc) -> dict:
    """A config dataclass as a dict without its infrastructure keys (and its added keys at the value that
    reproduces the runs stored before them: mpt.config.infra, mpt.config.added)."""
    out = {}
    for f in dataclasses.fields(dc):
        v = getattr(dc, f.name)
        if f.metadata.get("infra") or ("added" in f.metadata and v == f.metadata["added"]):
            continue
        out[f.name] = strip_infra(v) if dataclasses.is_dataclass(v) else v
    return out


def flatten(d: dict, prefix: str = "") -> dict:
    """A nested dict with dotted keys: {"optim": {"lr": 0.1}} -> {"optim.lr": 0.1}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# Keys added after runs were stored, with the value that reproduces those runs: at that value a key is
# left out of the content id (the runs keep their ids and directories) and a stored config without it
# is the same run. Another value is another run. The sections in _ADDED_SECTIONS came whole: at their
# defaults (added_keys).
_ADDED_KEYS = {"half_math": "auto", "rounding": "nearest"}
_ADDED_SECTIONS = ("fp8", "fmt")
# The same for keys inside a section (a dotted path; the section of experiments that have the key).
_ADDED_NESTED_KEYS = {"task.decode": "cpu"}
# Keys that became infrastructure (speed settings) after runs were stored, with the value those runs'
# ids were computed with: the id still counts that value, so every earlier run keeps its id.
_NOW_INFRA_KEYS = {"channels_last": False}


def added_keys(cfg) -> dict:
    """The top-level keys added after runs were stored, with the value that reproduces those runs (an
    added section at the defaults of cfg's section). Read only: the sections' dicts are shared."""
    return {**_ADDED_KEYS, **{s: _defaults(type(getattr(cfg, s))) for s in _ADDED_SECTIONS}}


@functools.lru_cache(maxsize=None)
def _defaults(section: type) -> dict:
    # asdict of a section with nested ones costs more than the rest of cell_id: once per class. Without its infra
    # keys (fmt.compile), as strip_infra leaves the config's section.
    return strip_infra(section())


def config_difference(stored: dict, cfg) -> str | None:
    """The first non-infrastructure key whose value differs between a run directory's stored
    config.yaml and cfg, as "key: <stored> stored, <new> now"; None when they are the same run."""
    new = flatten(json.loads(json.dumps(strip_infra(cfg), default=str)))
    old = flatten(json.loads(json.dumps(stored, default=str))) if isinstance(stored, dict) else {}
    if isinstance(stored, dict):
        old = {**flatten(added_keys(cfg)), **_ADDED_NESTED_KEYS, **old}
    for d in (new, old):  # one spelling per loss scale, as in cell_id
        if "loss_scale" in d:
            d["loss_scale"] = canonical_loss_scale(d["loss_scale"], str(d.get("precision", "")))
    for k in sorted(set(new) | set(old)):
        if k in new and k in old and old[k] != new[k]:
            return f"{k}: {old[k]!r} stored, {new[k]!r} now"
        if k in new and k not in old and new[k] not in ("", None):
            return f"{k}: not stored, {new[k]!r} now"
    return None


def cell_id(cfg) -> str:
    """Content id of a run: sha256 of the resolved config without infrastructure keys (values as
    resolve() normalises them: a Config built by hand gets the same id as the resolved one)."""
    ident = strip_infra(cfg)
    ident["loss_scale"] = canonical_loss_scale(ident["loss_scale"], ident["precision"])
    for k, default in added_keys(cfg).items():
        if ident.get(k) == default:
            del ident[k]
    for path, default in _ADDED_NESTED_KEYS.items():
        *sections, leaf = path.split(".")
        d = ident
        for sec in sections:
            d = d.get(sec) if isinstance(d, dict) else None
        if isinstance(d, dict) and d.get(leaf) == default:
            del d[leaf]
    ident.update(_NOW_INFRA_KEYS)
    if ident["precision"] in precisions.FORMATS:  # what the simulated quantisers compute is part of what ran
        ident["quantisers"] = formats.QUANTISERS
        if precisions.format_recipe(cfg).stochastic():  # its random stream is part of what ran
            ident["sr_bits"] = formats.SR_BITS
    blob = json.dumps(ident, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def run_name(cfg) -> str:
    return f"{cfg.model}-{cfg.precision}-s{cfg.seed}-{cell_id(cfg)[:10]}"


def run_dir(cfg) -> pathlib.Path:
    return pathlib.Path(cfg.out_dir) / cfg.experiment / run_name(cfg)
