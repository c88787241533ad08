"""Weights & Biases logging that never stops training.

Online when WANDB_API_KEY is set (or wandb.mode=online) and the server answers within a few
seconds; offline otherwise (one line on stderr says so: a machine without network never waits
minutes). A server that accepts the connection but then fails or never answers costs at most
init_timeout (WANDB_INIT_TIMEOUT, default 30 s) before the run logs offline, in a fresh wandb state:
the offline record exists whatever the server does, and the process exits without waiting for it
(wandb's telemetry about itself is off unless WANDB_ERROR_REPORTING is set). A WANDB_BASE_URL that is
no usable URL (a bad port) is said in one line and the run logs offline without it. Offline runs are written
under the run directory, can be browsed with `wandb leet <run dir>/wandb` and uploaded later with
`wandb sync <run dir>/wandb/offline-run-*`. The wandb run id is derived from the run's content id,
so a resumed or requeued run continues the same wandb run. Only rank 0 logs. The API key is read by
wandb from the environment and never written into configs or logs."""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import urllib.parse
import warnings


INIT_TIMEOUT_S = 30.0  # an online wandb.init that the server accepted but that hangs (WANDB_INIT_TIMEOUT overrides)
PROBE_TIMEOUT_S = 5.0  # how long to wait for a TCP connection to the wandb server


def base_url_problem() -> str | None:
    """One line when WANDB_BASE_URL is set but is no http(s) URL with a host and a valid port, else None.
    wandb refuses such a URL even offline: the run had no wandb record although it said "offline"."""
    raw = os.environ.get("WANDB_BASE_URL")
    if not raw:
        return None
    try:
        url = urllib.parse.urlsplit(raw)
        url.port  # noqa: B018 -- raises ValueError for a port out of range or not a number
    except ValueError:
        return f"WANDB_BASE_URL={raw!r} has a bad port; fix or unset it"
    if url.scheme not in ("http", "https") or not url.hostname:
        return f"WANDB_BASE_URL={raw!r} is not an http(s) URL with a host; fix or unset it"
    return None


@contextlib.contextmanager
def _environ_without(name: str, drop: bool):
    """os.environ without `name` inside the block (when `drop`): wandb's start reads it, and the
    service it spawns inherits what it sees."""
    old = os.environ.pop(name, None) if drop else None
    try:
        yield
    finally:
        if old is not None:
            os.environ[name] = old


def server_unreachable(timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when a TCP connection to the wandb server (WANDB_BASE_URL, default api.wandb.ai:443)
    opens within `timeout` seconds, else one line saying why. Name resolution has no timeout of its
    own, so the probe runs in a daemon thread that is abandoned when it takes too long."""
    bad = base_url_problem()
    if bad:
        return bad
    url = urllib.parse.urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    host = url.hostname or "api.wandb.ai"
    port = url.port or (80 if url.scheme == "http" else 443)
    out: dict = {}

    def probe():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            out["ok"] = True
        except OSError as e:
            out["error"] = e.strerror or type(e).__name__

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout)
    if out.get("ok"):
        return None
    return f"cannot reach {host}:{port} ({out.get('error') or f'no answer in {timeout:g} s'})"


def init_timeout() -> float:
    """Seconds an online wandb.init may take: WANDB_INIT_TIMEOUT (wandb's own variable) if it is a
    positive number, else INIT_TIMEOUT_S (wandb's default is 90 s, each start and each requeue)."""
    try:
        t = float(os.environ.get("WANDB_INIT_TIMEOUT", ""))
    except ValueError:
        return INIT_TIMEOUT_S
    return t if t > 0 else INIT_TIMEOUT_S


class WandbLogger:
    def __init__(self, cfg, run_dir, run_id: str, run_name: str, config: dict, rank: int = 0):
        self.run = None
        mode = cfg.wandb.mode
        if rank != 0 or mode == "disabled":
            return
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        if mode == "online":
            # Without a network wandb.init would wait up to its timeout at every start (and again at
            # every requeue): ask the server first, briefly, and log offline when it does not answer.
            problem = server_unreachable()
            if problem:
                print(f"wandb: {problem}; logging offline instead (upload later: wandb sync "
                      f"{run_dir}/wandb/offline-run-*)", file=sys.stderr)
                mode = "offline"
        bad_url = base_url_problem() is not None  # said above (online) or unused (offline): start without it
        try:
            with _environ_without("WANDB_BASE_URL", bad_url):
                self._start(cfg, run_dir, run_id, run_name, config, mode)
        except Exception as e:  # noqa: BLE001 -- wandb must never fail a training run
            self._fail("init", e)

    def _start(self, cfg, run_dir, run_id: str, run_name: str, config: dict, mode: str) -> None:
        """wandb.init in `mode`; an online start that fails or outlasts init_timeout() goes offline."""
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        # wandb's own telemetry about itself: at exit it posts to the server, and waited ~20 s more for one
        # that never answers, after the run had gone offline (WANDB_ERROR_REPORTING=true turns it back on).
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        self._wandb = wandb
        kw = dict(project=cfg.wandb.project, entity=cfg.wandb.entity or None, dir=str(run_dir),
                  id=run_id, resume="allow", name=run_name, group=cfg.experiment, job_type=cfg.precision,
                  tags=[cfg.profile, cfg.model, cfg.precision, cfg.impl, *cfg.wandb.tags], config=config)
        try:
            self.run = wandb.init(mode=mode, settings=wandb.Settings(console="off", x_disable_stats=True,
                                                                     init_timeout=init_timeout()), **kw)
        except Exception as e:  # reachable but failing (auth, server error, timeout)
            if mode != "online":
                raise
            print(f"wandb: online start failed ({type(e).__name__}: {str(e).strip().splitlines()[0][:200]}); "
                  "logging offline instead", file=sys.stderr)
            # The failed start leaves its run id registered in wandb's service process, and an
            # offline start with that id fails ("run ID ... is in use"): stop the service first,
            # so the offline run starts in a fresh one and keeps the id (wandb sync continues it).
            with contextlib.suppress(Exception):
                wandb.teardown()
            self.run = wandb.init(mode="offline", settings=wandb.Settings(console="off", x_disable_stats=True), **kw)

    def _fail(self, what: str, e: Exception) -> None:
        warnings.warn(f"wandb {what} failed, continuing without wandb: {type(e).__name__}: {e}")
        self.run = None

    def log(self, data: dict, step: int) -> None:
        if self.run is None:
            return
        try:
            out = {}
            for k, v in data.items():
                if k.endswith("/hist") and isinstance(v, list):
                    lo, hi = data.get("numerics/hist_lo", 0), data.get("numerics/hist_hi", len(v) - 1)
                    edges = [lo + i for i in range(len(v) + 1)] if hi - lo + 1 == len(v) else list(range(len(v) + 1))
                    out[k] = self._wandb.Histogram(np_histogram=(v, edges))
                elif isinstance(v, (int, float, bool)):
                    out[k] = v
            self.run.log(out, step=step)
        except Exception as e:  # noqa: BLE001
            self._fail("log", e)

    def image(self, name: str, path, step: int, caption: str = "") -> None:
        """An image the run wrote (a sample grid) as wandb.Image under `samples/<name>`."""
        if self.run is None:
            return
        try:
            self.run.log({f"samples/{name}": self._wandb.Image(str(path), caption=caption or None)}, step=step)
        except Exception as e:  # noqa: BLE001
            self._fail("image", e)

    def summary(self, data: dict) -> None:
        if self.run is None:
            return
        try:
            for k, v in data.items():
                if isinstance(v, (int, float, str, bool)) or v is None:
                    self.run.summary[k] = v
        except Exception as e:  # noqa: BLE001
            self._fail("summary", e)

    def finish(self, exit_code: int = 0) -> None:
        if self.run is None:
            return
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as e:  # noqa: BLE001
            print(f"wandb finish failed: {e}", file=sys.stderr)
        self.run = None
