"""A digest of a model's weights and dtype: the key of what is computed from them and kept on disk between
processes (the protected directions, the evaluation gate's base values). Hashed once per model and state: both
callers share it, and weights changed in place (each tensor's version counter moves) are hashed again."""

from __future__ import annotations

import hashlib
import weakref

import torch

from alchemist.model.llama import Llama

_digests: weakref.WeakKeyDictionary[Llama, tuple[tuple[int, ...], str]] = weakref.WeakKeyDictionary()


def weights_digest(model: Llama) -> str:
    """sha256 (hex) of the dtype and every tensor of the state dict, by name, as bytes on the CPU."""
    tensors = sorted(model.state_dict().items())
    versions = tuple(tensor._version for _, tensor in tensors)
    cached = _digests.get(model)
    if cached is None or cached[0] != versions:
        digest = hashlib.sha256(str(model.dtype).encode())
        for name, tensor in tensors:
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())  # buffer: no copy
        cached = _digests[model] = (versions, digest.hexdigest())
    return cached[1]
