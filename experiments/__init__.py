"""One folder per result of the paper: its config, its task glue, its grid and its README.
Run one training run with `python -m experiments.<name> key=value ...`."""


def main(experiment: str, overrides: list[str]) -> dict:
    from mpt.engine import main as _main

    return _main(experiment, overrides)
