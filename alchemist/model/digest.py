"""A digest of a model's weights and dtype: the key of what is computed from them and kept on disk between
processes (the protected directions, the evaluation gate's base values). Hashed at each call (0.2 s for the
default model in bf16 on one thread), so that weights changed in place get another key."""

from __future__ import annotations

import hashlib

import torch

from alchemist.model.llama import Llama


def weights_digest(model: Llama) -> str:
    """sha256 (hex) of the dtype and every tensor of the state dict, by name, as bytes on the CPU."""
    digest = hashlib.sha256(str(model.dtype).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())  # buffer: no copy
    return digest.hexdigest()
