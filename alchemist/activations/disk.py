"""The disk tier's file format: one safetensors file per record, read one layer at a time, checked on every read.

A record's tensors are stored as ``"{layer}.{name}"``; the header's metadata holds, per layer, its tensor names (in
the record's order) and a CRC-32 of each tensor's name, dtype, shape and bytes, so a read of some of a layer's
tensors checks just those. Reads memory-map the file (safetensors' ``safe_open``), copy one layer's tensors out of
the map and verify them: a truncated file, an altered byte (in the data or the header) or a missing entry raises
``CorruptFileError``, never returns wrong values.

Files are written under a temporary name and renamed when complete, so a crash never leaves a file that looks whole;
files of an earlier run (the suffix ``SUFFIX``) are removed by ``remove_stale`` when a store starts.

    size = write_record(path, record.layers)
    layer = read_layer(path, 7)  # {name: (num_tokens, width) tensor}, on the CPU
    inputs = read_layer(path, 7, names=("h",))  # only these tensors are read and checked
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

SUFFIX = ".activations.safetensors"
_TMP = ".tmp"  # appended to SUFFIX while a file is being written


class CorruptFileError(Exception):
    """A record file that is truncated, altered or unreadable."""


def tensor_crc32(name: str, t: torch.Tensor) -> int:
    """CRC-32 of a tensor's name, dtype, shape and bytes (bf16 has no numpy dtype: checksum the bytes)."""
    crc = zlib.crc32(f"{name}:{t.dtype}:{list(t.shape)}".encode())
    return zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy(), crc)


def _layer_entry(layer: dict[str, torch.Tensor], crcs: dict[str, int]) -> str:
    return json.dumps({"names": list(layer), "crc32": crcs})


def file_bytes_bound(layers: list[dict[str, torch.Tensor]]) -> int:
    """At least the size of the file ``write_record`` makes of ``layers``: budgeted before the write starts.

    The data, plus the header: per tensor a JSON entry of its name, dtype, shape and offsets (under 200 characters
    beside the name), and the metadata (escaped: at most twice as long; a CRC-32 has at most 10 digits), padded.
    """
    data = sum(t.numel() * t.element_size() for layer in layers for t in layer.values())
    entries = sum(len(f"{i}.{name}") + 200 for i, layer in enumerate(layers) for name in layer)
    meta = sum(
        2 * (len(f"layer.{i}") + len(_layer_entry(layer, dict.fromkeys(layer, 2**32 - 1)))) + 8
        for i, layer in enumerate(layers)
    )
    return data + 8 + entries + meta + 64


def write_record(path: Path, layers: list[dict[str, torch.Tensor]]) -> int:
    """Writes ``layers`` (CPU tensors) to ``path``; returns the file's size in bytes."""
    tensors = {f"{i}.{name}": t.contiguous() for i, layer in enumerate(layers) for name, t in layer.items()}
    tmp = path.with_name(path.name + _TMP)
    try:
        metadata = {
            f"layer.{i}": _layer_entry(layer, {name: tensor_crc32(name, t) for name, t in layer.items()})
            for i, layer in enumerate(layers)
        }
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def read_layer(path: Path, layer: int, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """One layer's tensors (``names``, default all), copied out of the memory-mapped file and verified, each
    against its own checksum (``CorruptFileError`` if not intact). ``FileNotFoundError`` if there is no file."""
    try:
        with safe_open(path, framework="pt") as f:
            entry = json.loads(f.metadata()[f"layer.{layer}"])
            # Copied out of the map before the checksum: what is returned is what was checked, whatever happens
            # to the file afterwards.
            tensors = {name: f.get_tensor(f"{layer}.{name}").clone() for name in names or entry["names"]}
            expected = {name: entry["crc32"][name] for name in tensors}
    except FileNotFoundError:
        raise
    # RuntimeError: torch maps the file, and says so if it cannot (e.g. removed since safetensors opened it).
    except (SafetensorError, OSError, RuntimeError, KeyError, TypeError, ValueError) as e:
        raise CorruptFileError(f"{path}: {type(e).__name__}: {e}") from e
    for name, t in tensors.items():
        if tensor_crc32(name, t) != expected[name]:
            raise CorruptFileError(f"{path}: layer {layer} {name} does not match its checksum")
    return tensors


def remove_stale(directory: Path) -> int:
    """Removes the record files (finished or not) left in ``directory`` by an earlier run; returns how many."""
    removed = 0
    for path in directory.iterdir():
        if path.is_file() and (path.name.endswith(SUFFIX) or path.name.endswith(SUFFIX + _TMP)):
            path.unlink(missing_ok=True)
            removed += 1
    return removed
