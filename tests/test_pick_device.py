"""The device choice every command makes (mpt.ranks.pick_device): a bad or absent device is one line."""
import pytest
import torch

from mpt.errors import UserError
from mpt.ranks import pick_device


def test_pick_device():
    assert pick_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert pick_device("auto", local_rank=1) == torch.device("cpu")
        with pytest.raises(UserError, match="no CUDA GPU is visible"):
            pick_device("cuda:0")
    with pytest.raises(UserError, match="not a torch device"):
        pick_device("gpu0")
    with pytest.raises(UserError, match="only cpu and cuda"):
        pick_device("meta")
