"""``GroupedRows`` (a step's deltas grouped over stacked adapters) against its simple twin ``AdapterRows`` (each
adapter's delta on its own rows): the same delta on every row, up to fp32 rounding, on a tiny random model (fp32),
for decode-sized and prefill-sized batches, base rows, adapters' rows apart, cut ranks, adapters of other ranks and
targets; and the slots the stacks keep."""

from __future__ import annotations

import torch

from alchemist.engine.adapter_groups import GROUP_MAX_ROWS, GroupedRows
from alchemist.engine.adapter_rows import AdapterRows
from alchemist.engine.adapter_slots import AdapterSlots
from alchemist.engine.served_adapter import FP32_MAX_ROWS, ServedAdapter
from alchemist.model.llama import Llama
from alchemist.model.lora import FUSED_PARTS, LoraAdapter, LoraConfig
from tests.engine.helpers import random_adapter


def served(model: Llama, seed: int, cut: int = 0, **lora) -> ServedAdapter:
    """A random adapter as served; ``lora``: LoraConfig fields (default rank 16 on every projection)."""
    if lora:
        adapter = LoraAdapter(model.config, LoraConfig(**lora), seed=seed)
        with torch.no_grad():
            for b in adapter.B.values():
                b.normal_(std=0.05, generator=torch.Generator().manual_seed(seed))
    else:
        adapter = random_adapter(model, seed)
    adapter.cut = cut
    return ServedAdapter(adapter, model.dtype, model.device)


def new_slots(model: Llama) -> AdapterSlots:
    return AdapterSlots(model.config, model.dtype, model.device)


def inputs(model: Llama, num_rows: int, seed: int) -> dict[str, torch.Tensor]:
    """A random input (T, in) per fused projection."""
    c, g = model.config, torch.Generator().manual_seed(seed)
    widths = {"qkv": c.hidden_size, "o": c.q_size, "gate_up": c.hidden_size, "down": c.intermediate_size}
    return {name: torch.randn(num_rows, widths[name], generator=g) for name in FUSED_PARTS}


def grouped_rows(model, slots, adapters, num_tokens, answer=(), live=None) -> GroupedRows | AdapterRows:
    """``GroupedRows.of`` after checking its deltas against ``AdapterRows``' on every layer and projection."""
    live = live if live is not None else {a for a in adapters if a is not None}
    rows = GroupedRows.of(slots, adapters, num_tokens, list(answer), live, model.device)
    ref = AdapterRows.of(adapters, num_tokens, list(answer), model.device)
    for name, x in inputs(model, sum(num_tokens), seed=len(num_tokens)).items():
        for layer in range(model.config.num_layers):
            got, want = rows.delta(layer, name, x), ref.delta(layer, name, x)
            if want is None:
                assert got is None, (layer, name)
                continue
            assert got.dtype == want.dtype and want.abs().max() > 0, (layer, name)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"layer {layer} {name}")
    return rows


def test_a_decode_step_of_many_adapters_is_one_group(tiny_model):
    """Eight adapters (with cut ranks, narrower ones targeting some parts only) and base rows, one row per
    sequence, an adapter's rows apart: all grouped, each row's delta as its adapter's alone."""
    a, b, c, d, e = (served(tiny_model, s) for s in (30, 31, 32, 33, 34))
    cut = served(tiny_model, 35, cut=4)
    narrow = served(tiny_model, 36, r=8, target_modules=("q_proj", "v_proj", "down_proj"))
    narrow_cut = served(tiny_model, 37, cut=2, r=8, target_modules=("k_proj", "o_proj", "up_proj"))
    seqs = [a, b, None, cut, c, a, narrow, d, cut, None, e, b, cut, a, narrow_cut, narrow_cut]
    rows = grouped_rows(tiny_model, new_slots(tiny_model), seqs, [1] * len(seqs), answer=[3, 12])
    assert isinstance(rows, GroupedRows) and rows.alone.groups == []
    assert rows.unscoped is not None and int(rows.unscoped.sum()) == 3  # cut's row 8, narrow_cut's two
    assert rows.hi - rows.lo == 8 and rows.gather.numel() == 8 * 3  # 8 slots, 3 rows each (a and cut have 3)


def test_a_prompt_chunk_beside_decodes_goes_alone(tiny_model):
    """A prefill-sized chunk (FP32_MAX_ROWS rows and more) of one adapter beside other adapters' decodes (its own
    too, apart): that adapter's delta alone, the others grouped, base rows zero."""
    a, b, c = (served(tiny_model, s) for s in (40, 41, 42))
    cut = served(tiny_model, 43, cut=4)
    chunk = FP32_MAX_ROWS + 5
    seqs, num_tokens = [b, a, None, c, cut, a, b], [1, chunk, 1, 1, 3, 1, 1]
    answer = list(range(1 + chunk + 2, 1 + chunk + 2 + 2))  # the cut adapter's first prompt rows only
    rows = grouped_rows(tiny_model, new_slots(tiny_model), seqs, num_tokens, answer)
    assert isinstance(rows, GroupedRows)
    assert [adapter for adapter, _, _ in rows.alone.groups] == [a]


def test_a_full_group_beside_base_rows_gets_a_zero_place(tiny_model):
    """Every slot's places taken by its rows (each adapter the same number) and base rows: one more place per slot,
    so that the base rows read a zero; without base rows none is added."""
    a, b, c = (served(tiny_model, s) for s in (50, 51, 52))
    slots = new_slots(tiny_model)
    rows = grouped_rows(tiny_model, slots, [a, b, None, c, b, a, c], [1, 1, 2, 1, 1, 1, 1])
    assert rows.gather.numel() == 3 * 3
    rows = grouped_rows(tiny_model, slots, [a, b, c, b, a, c], [1] * 6)
    assert rows.gather.numel() == 3 * 2


def test_slots_are_reused_grown_and_widened(tiny_model):
    """Slots of adapters no longer live go to new ones, lowest first; the stacks grow in slots and in width (a
    wider adapter) and keep the adapters already in them."""
    slots = new_slots(tiny_model)
    first = [served(tiny_model, s, r=4) for s in range(60, 63)]
    assert slots.assign(first, first) == [0, 1, 2]
    grouped_rows(tiny_model, slots, first, [2, 1, 3])
    later = [served(tiny_model, s) for s in range(63, 68)]  # rank 16: wider stacks, and more slots than room for
    live = [first[0], first[2], *later]
    assert slots.assign(later, live) == [1, 3, 4, 5, 6] and slots.held[1] is later[0]
    grouped_rows(tiny_model, slots, [first[2], *later, first[0]], [1, 2, 1, 1, 1, 2, 1], live=live)


def test_adapters_sparse_in_the_slots_or_too_few_go_alone(tiny_model):
    adapters = [served(tiny_model, s) for s in range(70, 76)]
    slots = new_slots(tiny_model)
    slots.assign(adapters, adapters)
    apart = [adapters[0], None, adapters[5]]  # slots 0 and 5: a range of 6 for 2 adapters
    assert isinstance(grouped_rows(tiny_model, slots, apart, [1, 1, 1], live=adapters), AdapterRows)
    one = [adapters[1], None, adapters[1]]  # one adapter beside the base model
    assert isinstance(grouped_rows(tiny_model, slots, one, [1, 1, 1], live=adapters), AdapterRows)
    many = [adapters[2], adapters[3]]  # more rows than a group takes
    rows = grouped_rows(tiny_model, slots, many, [GROUP_MAX_ROWS + 1, 1], live=adapters)
    assert isinstance(rows, AdapterRows)
