"""The prepared dataset under task.data_root as a run sees it, from the marker data_prep writes last
(prepared.json, data_prep/prepared.py): whether it is this run's dataset (check_prepared) and its content
id (data_fingerprint), part of the run's identity. No torch: a config resolves without it."""
from __future__ import annotations

import functools
import hashlib
import json
import pathlib
from typing import Any

from mpt.errors import UserError


def check_prepared(cfg, task_cls) -> None:
    """One line instead of a data loader's traceback when task.data_root holds prepared data that is not
    this run's: a prepared.json that is not a JSON mapping (damaged, or not written by data_prep), or
    another dataset's (its "dataset" is not the one Task.expected_data names). A missing marker is left
    to the task, which names the data_prep command."""
    root = cfg.task.data_root
    want = task_cls.expected_data(cfg) if hasattr(task_cls, "expected_data") else None
    prep = f"python -m data_prep.{want[1]} --archives DIR --out {root}" if want else "its data_prep command"
    marker = pathlib.Path(root) / "prepared.json"
    try:
        st = marker.stat()
    except OSError:
        return
    info, problem = _read_marker(str(marker), st.st_mtime_ns, st.st_size)
    if problem:
        raise UserError(f"{marker} {problem}; prepare the data again: {prep} --force")
    found = info.get("dataset")
    if want and found is not None and found != want[0]:
        raise UserError(f"task.data_root={root} holds {found!r} data (its prepared.json says so), but "
                        f"{cfg.experiment} model={cfg.model} reads {want[0]!r}: set task.data_root to "
                        f"the output of {prep}")


@functools.lru_cache(maxsize=16)
def _read_marker(path: str, mtime_ns: int, size: int) -> tuple[Any, str | None]:
    """(content of a prepared.json, None), or (None, why it is unusable); once per version of it."""
    try:
        info = json.loads(pathlib.Path(path).read_text())
    except OSError as e:
        return None, f"cannot be read ({e.strerror})"
    except ValueError as e:
        return None, f"is not JSON ({str(e).splitlines()[0]}), not what data_prep writes"
    if not isinstance(info, dict):
        return None, f"holds a JSON {type(info).__name__}, not the mapping data_prep writes"
    return info, None


# Keys of a data_prep marker (prepared.json) that say when or where it was made, not what it holds.
MARKER_VOLATILE = {"prepared_at", "seconds", "skipped", "source", "vocab_source", "warnings"}


def data_fingerprint(root, files=()) -> str:
    """A short content id of the prepared dataset at `root`, from what data_prep wrote: its marker
    (counts, class/vocabulary sizes, source-archive sizes and sampled digests, per-shard digests)
    and the `files` beside it that the experiment's task declares identify its data (Task.data_files,
    e.g. a class list or a vocabulary; those present are hashed) -- not the path, so the same data
    on another cluster is the same run. "unprepared" when there is no marker (the run itself then
    fails with the prep command)."""
    if not root:
        return "none"
    root = pathlib.Path(root)
    try:
        st = (root / "prepared.json").stat()
    except OSError:
        return "unprepared"
    # A grid resolves every cell on the same data: hash it once per marker version, not per cell
    # (the full 1B Word vocabulary alone is 10 MB).
    return _fingerprint(str(root.resolve()), st.st_mtime_ns, st.st_size, tuple(files))


@functools.lru_cache(maxsize=16)
def _fingerprint(root: str, mtime_ns: int, size: int, files: tuple[str, ...]) -> str:
    root = pathlib.Path(root)
    info, problem = _read_marker(str(root / "prepared.json"), mtime_ns, size)
    if problem:
        return "unprepared"
    blob = {k: v for k, v in info.items() if k not in MARKER_VOLATILE}
    h = hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode())
    for name in files:
        if (root / name).is_file():
            h.update((root / name).read_bytes())
    return h.hexdigest()[:16]
