"""The disk tier's file format: bit-exact round trips, and every damage to a file detected (never wrong values)."""

from __future__ import annotations

import json

import pytest
import torch

from alchemist.activations import disk
from alchemist.activations.record import RECORDED
from alchemist.model.flash import lse_dtype

WIDTHS = {"h": 5, "qkv": 9, "attn": 6, "lse": 3, "o": 5, "gate_up": 8}


def make_layers(dtype: torch.dtype, num_tokens: int = 4, num_layers: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(num_layers):
        layer = {}
        for name in RECORDED:
            t = torch.randn(num_tokens, WIDTHS[name], generator=g).to(lse_dtype(dtype) if name == "lse" else dtype)
            layer[name] = t
        layers.append(layer)
    # Values whose bits a lossy path would change: signed zero, infinities, a NaN, a subnormal.
    specials = torch.tensor([-0.0, float("inf"), -float("inf"), float("nan"), 1e-40])
    layers[0]["qkv"].view(-1)[: len(specials)] = specials.to(dtype)
    return layers


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_layer_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert same_bits(got[name], want[name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    layers = make_layers(dtype)
    path = tmp_path / f"r{disk.SUFFIX}"
    size = disk.write_record(path, layers)
    assert size == path.stat().st_size <= disk.file_bytes_bound(layers)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the temporary name is gone
    for i in reversed(range(len(layers))):
        assert_layer_equal(disk.read_layer(path, i), layers[i])


def test_truncated_file_is_detected(tmp_path):
    layers = make_layers(torch.bfloat16)
    path = tmp_path / f"r{disk.SUFFIX}"
    size = disk.write_record(path, layers)
    whole = path.read_bytes()
    for keep in (0, 5, 8, 40, size // 2, size - 1):
        path.write_bytes(whole[:keep])
        for i in range(len(layers)):
            with pytest.raises(disk.CorruptFileError):
                disk.read_layer(path, i)


def test_every_flipped_byte_is_detected_or_harmless(tmp_path):
    """Flip each byte of a small file in turn (header and data): a read is exact or raises CorruptFileError."""
    layers = make_layers(torch.bfloat16, num_tokens=1, num_layers=2)
    path = tmp_path / f"r{disk.SUFFIX}"
    disk.write_record(path, layers)
    whole = path.read_bytes()
    detected = 0
    for pos in range(len(whole)):
        damaged = bytearray(whole)
        damaged[pos] ^= 0x10
        path.write_bytes(damaged)
        for i in range(len(layers)):
            try:
                got = disk.read_layer(path, i)
            except disk.CorruptFileError:
                detected += 1
                continue
            assert_layer_equal(got, layers[i])
    assert detected >= len(whole)  # every byte of data is some layer's, most header bytes all layers'


def test_missing_file_and_missing_layer(tmp_path):
    path = tmp_path / f"r{disk.SUFFIX}"
    with pytest.raises(FileNotFoundError):
        disk.read_layer(path, 0)
    disk.write_record(path, make_layers(torch.float32, num_layers=2))
    with pytest.raises(disk.CorruptFileError):
        disk.read_layer(path, 2)


def test_remove_stale_takes_only_record_files(tmp_path):
    for name in (f"1{disk.SUFFIX}", f"2{disk.SUFFIX}.tmp", "model.safetensors", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / f"sub{disk.SUFFIX}").mkdir()
    assert disk.remove_stale(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "notes.txt", f"sub{disk.SUFFIX}"]


def test_a_partial_read_checks_what_it_reads(tmp_path):
    layers = make_layers(torch.bfloat16, num_layers=2)
    path = tmp_path / f"r{disk.SUFFIX}"
    disk.write_record(path, layers)
    got = disk.read_layer(path, 1, names=("h", "lse"))
    assert list(got) == ["h", "lse"] and all(same_bits(got[n], layers[1][n]) for n in got)
    damaged = bytearray(path.read_bytes())
    header_len = int.from_bytes(damaged[:8], "little")  # safetensors: u64 header size, JSON header, data
    start, _ = json.loads(damaged[8 : 8 + header_len])["1.gate_up"]["data_offsets"]
    damaged[8 + header_len + start] ^= 0x01  # a byte of layer 1's "gate_up"
    path.write_bytes(damaged)
    assert same_bits(disk.read_layer(path, 1, names=("h",))["h"], layers[1]["h"])
    with pytest.raises(disk.CorruptFileError):
        disk.read_layer(path, 1, names=("gate_up",))
