"""mpt: the precision machinery of this reproduction of Micikevicius et al., "Mixed Precision
Training" (ICLR 2018), and the one training engine every experiment uses."""
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent  # the repository this package is part of
