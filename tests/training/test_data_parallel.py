"""Data-parallel steps are exact: two replicas (processes, gloo), each over its share of the samples, take the step
one process takes over all of them, replayed or recomputed, through two steps (AdamW's state).

fp32: the first step's gradients agree per tensor to 1e-6 (the replicas' sums differ from one process's in the order
of their additions, and in how samples are grouped through the model), and the adapters as a whole to 1e-6. Per
tensor, AdamW's first update divides each gradient by its own magnitude, which magnifies the rounding of the
near-zero ones (as in tests/training/test_trainer.py): a small tensor's weights then differ by up to ~3e-6, and the
second step's gradients, taken at those weights, by up to ~2e-6. fp64 is the check that the math is one: every
tensor of every step to 1e-12.
"""

from __future__ import annotations

import pytest
import torch

from alchemist.model.loader import build_model
from alchemist.training.data_parallel import backend_for
from tests.training.replicas import MAX_GRAD_NORM, Case, run_replicas, take_steps
from tests.training.test_replay import flat, max_rel_l2

# a sample's prompt and response lengths: different, so that no share is a copy of another
LENGTHS = [(23, 7), (9, 12), (31, 5), (14, 9), (6, 3), (18, 11)]
SHARES = {"even": [3, 3], "uneven": [1, 5], "one-with-none": [0, 6]}
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
CASES = {
    **{f"{path}-{split}-{name}": Case(replay=path == "replay", shares=shares, dtype=dtype)
       for path in ("replay", "recompute") for split, shares in SHARES.items()
       for name, dtype in DTYPES.items()},  # fmt: skip
    # given scales are global ones: a sample's share of the whole step
    "replay-scaled-fp32": Case(replay=True, shares=[2, 4], scales=[0.3, 0.05, 0.2, 0.1, 0.25, 0.1]),
    # the screen of one replica refuses the first step: no replica takes it, and the second is the first update
    "replay-vetoed-fp32": Case(replay=True, shares=[4, 2], vetoes=[False, True]),
}
RTOL = 1e-6
FP32_LATER_RTOL = 1e-5  # per tensor, after AdamW's first update (the module's docstring)
FP64_RTOL = 1e-12


@pytest.fixture(scope="module")
def samples():
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(0, 256, (p,), generator=g).tolist(), torch.randint(0, 256, (r,), generator=g).tolist())
            for p, r in LENGTHS]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tiny_dirs):
    return tiny_dirs["llama-gqa-untied"]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, model_dir, samples):
    """Every case on two replicas, in one pair of processes (spawning costs seconds); by rank."""
    return run_replicas(tmp_path_factory.mktemp("replicas"), model_dir, CASES, samples)


@pytest.fixture(scope="module")
def models(model_dir):
    return {dtype: build_model(model_dir, dtype) for dtype in DTYPES.values()}


def whole_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The relative L2 error of all tensors as one vector."""
    return ((flat(a) - flat(b)).norm() / flat(a).norm()).item()


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_replicas_take_the_step_of_one_process_over_all_samples(replicas, models, samples, name):
    case = CASES[name]
    alone = take_steps(models[case.dtype], case, samples, veto=any(case.vetoes))
    ranks = [seen[name] for seen in replicas]
    fp64 = case.dtype == torch.float64
    for seen in ranks:
        assert seen.updated == alone.updated and seen.versions == alone.versions
        assert seen.losses == pytest.approx(alone.losses, rel=RTOL)  # the global mean, on every replica
        first = True  # the first update's gradients
        for step in range(case.num_steps):
            assert seen.grads[step].keys() == alone.grads[step].keys()
            if alone.grads[step]:
                bound = FP64_RTOL if fp64 else RTOL if first else FP32_LATER_RTOL
                assert max_rel_l2(alone.grads[step], seen.grads[step]) <= bound, (step, "gradients")
                first = False
            if fp64:
                assert max_rel_l2(alone.adapters[step], seen.adapters[step]) <= FP64_RTOL, (step, "adapter")
            else:
                assert whole_rel(alone.adapters[step], seen.adapters[step]) <= RTOL, (step, "adapter")
    # lockstep: the replicas hold the very same adapter (one all-reduced gradient, the same update)
    for step in range(case.num_steps):
        assert all(torch.equal(ranks[0].adapters[step][n], t) for n, t in ranks[1].adapters[step].items())
    # replayed where records were (each replica's own), recomputed otherwise: as many as one process
    assert sum(seen.replayed for seen in ranks) == alone.replayed == (case.replay * len(samples) * case.num_steps)
    # the gradients moved in every step that took them, and in none that a replica vetoed; the replicas met in all
    assert all([t > 0 for t in seen.allreduce_s] == seen.updated for seen in ranks)
    assert all(seen.sync_s > 0 for seen in ranks)


def test_the_steps_clip_and_local_counts_would_show(models, samples):
    """The cases are sharp: every update is clipped (so a clip before the all-reduce would differ), and dividing by
    each replica's own count instead of the global one lands outside the tolerance on the uneven split."""
    case, model = CASES["replay-uneven-fp32"], models[torch.float32]
    alone = take_steps(model, case, samples)
    assert all(torch.cat([g.flatten() for g in grads.values()]).norm() > MAX_GRAD_NORM for grads in alone.grads)
    # local counts: replica r's gradients weigh 1/n_r instead of 1/N, i.e. N/n_r times as much
    parts = [take_steps(model, Case(replay=True, shares=[n], num_steps=1), samples[first : first + n], first)
             for first, n in ((0, 1), (1, 5))]  # fmt: skip
    local = {k: sum(part.grads[0][k] for part in parts) for k in alone.grads[0]}
    assert max_rel_l2(alone.grads[0], local) > 100 * RTOL


def test_replicas_sum_their_counts_and_refuse_a_step_out_of_lockstep(replicas):
    assert [seen["sums"] for seen in replicas] == [[3.0, 1.0]] * 2
    assert all("out of lockstep" in seen["out of lockstep"] for seen in replicas)


def test_the_backend_follows_the_device():
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"
