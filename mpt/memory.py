"""Activation memory: the bytes autograd saves for backward, measured with saved-tensor hooks.
Works on any device (ActivationMeter splits the count by kind and dtype: the speed/memory benchmark
and mpt.doctor). Parameters (and anything sharing their storage) are not activations and are
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


# Autograd nodes that only view or cast their input: a saved tensor reached from a parameter
# through these alone is a copy of that parameter (autocast's FP16 weight casts), not an activation.
_VIEW_OR_CAST = {"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
                 "UnsafeViewBackward0", "ExpandBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
                 "SqueezeBackward1", "AliasBackward0", "AsStridedBackward0", "ReshapeAliasBackward0",
                 "CloneBackward0", "ContiguousBackward0"}


class ActivationMeter(SavedTensorBytes):
    """mpt.memory's count of the bytes saved for backward (parameters left out), split into what
    it holds: casts of parameters that torch.autocast saves (its FP16 copies of conv/linear weights,
    made every forward), model buffers saved by reference (batch-norm running statistics), and
    activations proper, by dtype."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self._buffers = {b.untyped_storage().data_ptr() for b in model.buffers()}
        self._kind: dict[int, tuple[str, str]] = {}  # storage -> (kind, dtype)

    def _from_param(self, t: torch.Tensor) -> bool:
        fn = t.grad_fn
        for _ in range(8):
            if fn is None or type(fn).__name__ not in _VIEW_OR_CAST:
                return False
            nxt = [f for f, _ in fn.next_functions if f is not None]
            if len(nxt) != 1:
                return False
            fn = nxt[0]
            if type(fn).__name__ == "AccumulateGrad":
                return fn.variable.untyped_storage().data_ptr() in self._params
        return False

    def _pack(self, t):
        n = len(self._seen)
        out = super()._pack(t)
        if len(self._seen) > n:  # a storage counted for the first time
            key = t.untyped_storage().data_ptr()
            kind = "weight_cast" if self._from_param(t) else "buffer" if key in self._buffers else "activation"
            self._kind[key] = (kind, str(t.dtype).replace("torch.", ""))
        return out

    def breakdown(self) -> dict:
        by_kind = {"weight_cast": 0, "buffer": 0, "activation": 0}
        by_dtype: dict[str, int] = {}
        for key, nbytes in self._seen.items():
            kind, dtype = self._kind[key]
            by_kind[kind] += nbytes
            if kind == "activation":
                by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
        return {"activation_bytes": self.bytes, "saved_weight_cast_bytes": by_kind["weight_cast"],
                "saved_buffer_bytes": by_kind["buffer"], "activation_only_bytes": by_kind["activation"],
                "activation_only_bytes_by_dtype": dict(sorted(by_dtype.items()))}
