import sys

from experiments.speed_memory import main
from mpt.errors import cli

if __name__ == "__main__":
    cli(main)(sys.argv[1:])
