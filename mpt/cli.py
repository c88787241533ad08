"""The command line of every experiment: `python -m experiments.<name> [--print-config] key=value ...`.

Stop signals (SIGTERM, SIGINT, SIGUSR1, SIGHUP) checkpoint at the next step and stop; starting the same command
again resumes. User errors are one line (exit 2); the exit status says how the run ended (exit_code).
"""
from __future__ import annotations

import signal
import sys

from mpt import config, identity, precisions, registry
from mpt.engine import run
from mpt.errors import UserError, cli
from mpt.rundir import FINAL
from mpt.signals import STOP, install_stop_handlers


def main(experiment: str | registry.Experiment, overrides: list[str], on_result=None) -> dict:
    """One run of `experiment` (registered, mpt.registry.register; or its name) with the overrides
    (on_result: mpt.engine.run's)."""
    exp = registry.get_experiment(experiment)
    cfg = config.resolve(exp, overrides)
    return run(cfg, exp.task(cfg), on_result)


def exit_code(summary: dict) -> int:
    """A command's exit status for a run's summary: 0 for a result (completed or diverged), 1 for a
    failure, 128 + the signal for a run a signal stopped (130 Ctrl-C, 143 SIGTERM), as a shell
    reports a process killed by it -- so a scheduler or script sees that the run is not done."""
    status = summary.get("status")
    if status in FINAL:
        return 0
    if status == "interrupted":
        return 128 + (STOP.signum or signal.SIGTERM)
    return 1


OPTIONS = ("-h", "--help", "--print-config")


def split_options(argv: list[str]) -> tuple[set[str], list[str]]:
    """(the options, the key=value words in their order): an option may come anywhere, and a word that
    starts with "-" is one (a key=value word starts with its key)."""
    opts = {a for a in argv if a.startswith("-")}
    unknown = sorted(opts - set(OPTIONS))
    if unknown:
        raise UserError(f"unknown option {unknown[0]!r}; the options are {', '.join(OPTIONS)}, the rest key=value words")
    return opts, [a for a in argv if not a.startswith("-")]


def cli_main(experiment: str | registry.Experiment, argv: list[str] | None = None) -> None:
    """`python -m <the experiment's package> key=value ...` (an experiment's __main__ hands itself here);
    options may come before, between or after the key=value words."""
    opts, argv = cli(split_options)(sys.argv[1:] if argv is None else argv)
    if opts & {"-h", "--help"}:
        exp = cli(registry.get_experiment)(experiment)
        prog = exp.task.__module__.rpartition(".")[0] or exp.task.__module__
        print(f"usage: python -m {prog} [--print-config] [key=value ...]\n"
              f"e.g.   python -m {prog} profile=tiny precision=mixed\n"
              f"keys:  see mpt/config.py and {exp.where}\n"
              f"--print-config: print the resolved config and its run directory; run nothing\n"
              f"SIGTERM, SIGINT (Ctrl-C), SIGUSR1 and SIGHUP (a closed terminal) checkpoint at the next step and "
              f"stop (exit 128 + signal: 143, 130, 138, 129); "
              f"starting the same command again resumes")
        return
    if "--print-config" in opts:
        # What a grid cell will do, before it does it (the same resolution as a run).
        cfg = cli(config.resolve)(experiment, argv)
        print(config.dump_yaml(cfg), end="")
        for line in precisions.format_lines(cfg):
            print(f"# {line}")
        print(f"# run directory: {identity.run_dir(cfg)}")
        return
    cli_run(lambda: main(experiment, argv), where=lambda: identity.run_dir(config.resolve(experiment, argv)))


def cli_run(start, where=None) -> None:
    """Run `start()` (-> a run's summary) as a command: stop signals checkpoint instead of losing work,
    user errors are one line, and the exit status says how the run ended (exit_code)."""
    install_stop_handlers()
    try:
        s = cli(start)()
    except KeyboardInterrupt:
        print("aborted (second Ctrl-C): the run resumes from its last checkpoint", file=sys.stderr)
        raise SystemExit(130) from None
    print(f"{s['status']}: {s['run_name']} {s['metrics']}" + (f" ({s['error']})" if s.get("error") else "")
          + (f" -> {where()}" if where is not None else ""))
    code = exit_code(s)
    if code:
        raise SystemExit(code)
