from experiments.lm_biglstm import EXPERIMENT
from mpt.cli import cli_main

if __name__ == "__main__":
    cli_main(EXPERIMENT)
