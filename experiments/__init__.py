"""One folder per result of the paper: its config, its task glue, its grid and its README.
Run one training run with `python -m experiments.<name> key=value ...`; `python -m experiments` is the demo."""
