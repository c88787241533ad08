"""Activation memory: the bytes autograd saves for backward, measured with saved-tensor hooks.
Works on any device. Parameters (and anything sharing their storage) are not activations and are
left out; each storage is counted once however many views of it are saved."""
from __future__ import annotations

import contextlib

import torch


class SavedTensorBytes:
    def __init__(self, model: torch.nn.Module | None = None):
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()} if model is not None else set()
        self._seen: dict[int, int] = {}

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def _pack(self, t: torch.Tensor):
        try:
            st = t.untyped_storage()
            key = st.data_ptr()
            if key not in self._params and key not in self._seen:
                self._seen[key] = st.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some wrappers)
            pass
        return t

    @contextlib.contextmanager
    def measure(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self
