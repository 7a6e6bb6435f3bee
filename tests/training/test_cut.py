"""The corrections' ranks cut (RankSplit(..., cut=True), LoraAdapter.cut): they act only on the rows from each
sequence's last prompt token on (or on none, out of scope), and replay still equals recompute, which equals a
forward that spells the cut out with the adapter's own tensors."""

from __future__ import annotations

import pytest
import torch

from alchemist.model.loader import build_model
from alchemist.model.lora import FUSED_PARTS, LoraAdapter
from alchemist.training.rank_split import RankSplit, Scoped
from alchemist.training.recompute import LayerSplitPass, recompute_losses, sample_values
from alchemist.training.replay import ReplaySample, replay_backward_slices
from alchemist.training.slices import run_to_end
from tests.training.recording import record_alone
from tests.training.test_rank_split import PREFERENCE_R, R
from tests.training.test_rank_split import _adapter as random_b_adapter
from tests.training.test_replay import grads_of, max_rel_l2


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return build_model(tiny_dirs["llama-gqa-untied"], torch.float32)


def _adapter(model) -> LoraAdapter:
    adapter = random_b_adapter(model)
    RankSplit(adapter, PREFERENCE_R, cut=True)
    return adapter


class SpelledOut:
    """The cut written out: on rows where ``cut_rows`` is set, each targeted part's delta from its preference
    ranks alone (A's last rows, B's last columns), elsewhere from all ranks; the adapter's own parameters, autograd
    through both."""

    def __init__(self, adapter: LoraAdapter, cut_rows: torch.Tensor) -> None:
        self.adapter, self.cut_rows = adapter, cut_rows

    def delta(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor | None:
        a = self.adapter
        targeted = a.targeted(name)
        if not targeted:
            return None
        outs = []
        for part in FUSED_PARTS[name]:
            if part not in targeted:
                outs.append(x.new_zeros(x.shape[0], a.shapes[part][1]))
                continue
            j = targeted.index(part)
            a_j, b = a.A[f"{layer}_{name}"][j * R : (j + 1) * R], a.B[f"{layer}_{part}"]
            full = x @ a_j.t() @ b.t() * a.config.scaling
            kept = x @ a_j[a.cut :].t() @ b[:, a.cut :].t() * a.config.scaling
            outs.append(torch.where(self.cut_rows[:, None], kept, full))
        return torch.cat(outs, dim=-1)


def _sample(seed: int, p: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (p,), generator=g), torch.randint(0, 256, (r,), generator=g)


def _recompute(model, adapter, pairs, in_scope: bool) -> tuple[float, dict[str, torch.Tensor]]:
    adapter.zero_grad(set_to_none=True)
    split = LayerSplitPass(model, adapter, pairs, in_scope)
    hidden = run_to_end(split.forward_slices())
    losses = sample_values(model, hidden, [(*pair, None) for pair in pairs])
    total = torch.stack(losses).sum()
    run_to_end(split.backward_slices(total))
    return total.item(), grads_of(adapter)


@pytest.mark.parametrize("in_scope", [True, False])
def test_the_cut_ranks_act_only_from_the_last_prompt_token_on(model, in_scope):
    adapter = _adapter(model)
    pairs = [_sample(3, 31, 9), _sample(4, 17, 12)]
    loss, got = _recompute(model, adapter, pairs, in_scope)

    # the oracle: the same pairs laid end to end, the cut spelled out row by row
    cut_rows = torch.cat([torch.arange(len(p) + len(r) - 1) < (len(p) - 1 if in_scope else 10**9) for p, r in pairs])
    adapter.zero_grad(set_to_none=True)
    total = torch.stack(recompute_losses(model, SpelledOut(adapter, cut_rows), [(*pair, None) for pair in pairs]))
    total.sum().backward()
    assert loss == pytest.approx(total.sum().item(), rel=1e-6)
    ref = grads_of(adapter)
    assert max_rel_l2(ref, got) <= 1e-5
    split = RankSplit(adapter, PREFERENCE_R, cut=True)
    for name, grad in got.items():  # out of scope, the cut ranks get no gradient at all
        block = split.a_rows(grad, False) if name.startswith("A.") else grad[:, : adapter.cut]
        assert (block.abs().max() > 0) == in_scope, name

    # and the cut matters: all ranks on every row is another model
    adapter.zero_grad(set_to_none=True)
    plain = LoraAdapter(model.config, adapter.config)
    plain.load_state_dict(adapter.state_dict())
    other = torch.stack(recompute_losses(model, plain, [(*pair, None) for pair in pairs])).sum().item()
    assert abs(other - loss) > 1e-4


@pytest.mark.parametrize("in_scope", [True, False])
def test_replay_of_a_record_made_without_the_cut_ranks_equals_recompute(model, in_scope):
    adapter = _adapter(model)
    pairs = [_sample(5, 40, 11), _sample(6, 23, 7)]
    # the serving prefill of a prompt: its rows 0..P-2 never get the cut ranks, routed or not
    records = [record_alone(model, Scoped(adapter, len(p)), p, record_id=f"r{i}") for i, (p, _) in enumerate(pairs)]
    loss_ref, ref = _recompute(model, adapter, pairs, in_scope)
    adapter.zero_grad(set_to_none=True)
    samples = [ReplaySample(p, r, lambda layer, rec=rec: rec.layers[layer])
               for (p, r), rec in zip(pairs, records, strict=True)]  # fmt: skip
    losses = run_to_end(replay_backward_slices(model, adapter, samples, in_scope))
    assert sum(losses) == pytest.approx(loss_ref, rel=1e-6)
    assert max_rel_l2(ref, grads_of(adapter)) <= 1e-5
