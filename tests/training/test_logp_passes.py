"""The preference objectives' passes without gradient, replayed from records, equal them recomputed; the trainer's
rules decide which record may serve (the base model's pass: records the base model made only; the adapter's: the
staleness bound), and a record that goes bad mid-pass is recomputed."""

from __future__ import annotations

import pytest
import torch
import transformers

from alchemist.activations import disk
from alchemist.activations.store import ActivationStore
from alchemist.model.loader import build_model
from alchemist.training.logp_passes import LogpPass, sequence_logps_slices
from alchemist.training.recompute import sequence_logps_slices as recomputed_logps_slices
from alchemist.training.replay import ReplaySample, replay_logps_slices
from alchemist.training.slices import run_to_end
from alchemist.training.trainer import Trainer, TrainerConfig
from tests.tiny_models import TINY_VARIANTS
from tests.training.recording import record_alone, record_batched_chunked
from tests.training.test_replay import lora_with_nonzero_b
from tests.training.test_tiered_replay import flip_byte_of, record_down_to

# (prompt, response) lengths: a one-token prompt (no record row is read) and a one-token response among them
SHAPES = [(37, 9), (12, 20), (1, 6), (25, 1), (8, 8)]


def pairs_of(shapes, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (p,), generator=g), torch.randint(0, 256, (r,), generator=g)) for p, r in shapes]


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
@pytest.mark.parametrize("policy", ["adapter", "base"])
@pytest.mark.parametrize("prefill", ["alone", "batched_chunked"])
def test_replayed_logps_equal_recomputed(tiny_dirs, variant, policy, prefill):
    """The live forward over fp32 records made by the policy gives the recompute path's log-probabilities, a group
    of samples at once; records made by another policy do not (why the base model's pass needs its own records)."""
    model = build_model(tiny_dirs[variant], torch.float32)
    lora = lora_with_nonzero_b(model)
    adapter = lora if policy == "adapter" else None
    pairs = pairs_of(SHAPES)
    g = torch.Generator().manual_seed(4)

    def record(prompt, made_by):
        if prefill == "alone":
            return record_alone(model, made_by, prompt)
        return record_batched_chunked(model, made_by, prompt, [torch.randint(0, 256, (30,), generator=g)], chunk=16)

    def replayed(made_by):
        records = [record(prompt, made_by) for prompt, _ in pairs]
        samples = [ReplaySample(p, r, rec.layers.__getitem__) for (p, r), rec in zip(pairs, records, strict=True)]
        return run_to_end(replay_logps_slices(model, adapter, samples))

    expected = run_to_end(recomputed_logps_slices(model, adapter, [(p.tolist(), r.tolist()) for p, r in pairs]))
    assert replayed(adapter) == pytest.approx(expected, rel=1e-6, abs=1e-5)
    other = replayed(None if policy == "adapter" else lora)
    long = [i for i, (p, _) in enumerate(pairs) if len(p) > 1]  # a one-token prompt reads no record
    assert all(abs(other[i] - expected[i]) > 1e-3 for i in long)


def base_store(model, adapter, pairs, versions: dict[int, int]) -> ActivationStore:
    """Records "r<i>" of the pairs' prompts: by the base model (version 0) or by ``adapter`` tagged
    ``versions[i]``; none for a prompt whose version is -1."""
    store = ActivationStore(budget_bytes=1 << 30)
    for i, (prompt, _) in enumerate(pairs):
        if versions[i] >= 0:
            made_by = None if versions[i] == 0 else adapter
            store.put(record_alone(model, made_by, prompt, record_id=f"r{i}", version=versions[i]))
    return store


def test_reference_pass_replays_only_records_the_base_model_made(model, adapter):
    pairs = pairs_of(SHAPES)
    versions = {0: 0, 1: 0, 2: 0, 3: 2, 4: -1}  # base, base, base (a one-token prompt), adapter v2, none
    store = base_store(model, adapter, pairs, versions)
    adapter.version = 2
    trainer = Trainer(model, adapter, store, TrainerConfig(max_staleness=10))
    passes = [LogpPass(p.tolist(), r.tolist(), f"r{i}") for i, (p, r) in enumerate(pairs)]
    got = run_to_end(sequence_logps_slices(trainer, passes, "reference", group_size=2))
    expected = run_to_end(recomputed_logps_slices(model, None, [(p.tolist(), r.tolist()) for p, r in pairs]))
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-5)
    assert (trainer.stats.reference_replayed, trainer.stats.reference_recomputed) == (3, 2)
    assert (trainer.stats.stale, trainer.stats.missing, trainer.stats.replayed) == (0, 0, 0)  # sample passes' only
    assert all(store.evict(f"r{i}") for i in range(4))  # nothing left pinned


@pytest.mark.parametrize("version", [0, 1, 2])
def test_adapter_pass_replays_within_the_staleness_bound(model, adapter, version):
    """Records made by the adapter at version 5 serve its pass at version 5 + ``version`` while max_staleness
    allows (1): exact at 0, recomputed at 2; the base model's records never serve the reference pass here."""
    pairs = pairs_of(SHAPES[:3])
    store = base_store(model, adapter, pairs, {0: 5, 1: 5, 2: 5})
    adapter.version = 5 + version
    trainer = Trainer(model, adapter, store, TrainerConfig(max_staleness=1))
    passes = [LogpPass(p.tolist(), r.tolist(), f"r{i}") for i, (p, r) in enumerate(pairs)]
    got = run_to_end(sequence_logps_slices(trainer, passes, "kl"))
    replayed = 3 if version <= 1 else 0
    assert (trainer.stats.kl_replayed, trainer.stats.kl_recomputed) == (replayed, 3 - replayed)
    expected = run_to_end(recomputed_logps_slices(model, adapter, [(p.tolist(), r.tolist()) for p, r in pairs]))
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-5)  # the record was made by this very adapter
    run_to_end(sequence_logps_slices(trainer, passes, "reference"))
    assert trainer.stats.reference_recomputed == 3
    off = Trainer(model, adapter, store, TrainerConfig(replay=False))
    run_to_end(sequence_logps_slices(off, passes, "kl"))
    assert (off.stats.kl_replayed, off.stats.kl_recomputed) == (0, 3)
    assert all(store.evict(f"r{i}") for i in range(3))


def test_record_corrupt_mid_pass_is_recomputed(model, adapter, tmp_path):
    prompt, response = pairs_of([(40, 10)])[0]
    adapter.version = 0
    store = record_down_to("disk", model, None, prompt, torch.float32, tmp_path)
    path = sorted(tmp_path.glob(f"*{disk.SUFFIX}"))[0]  # files are numbered in order of writing: "resp" went first
    flip_byte_of(path, "1.qkv")  # read by the live forward's second layer
    trainer = Trainer(model, adapter, store, TrainerConfig(prefetch_depth=0))
    passes = [LogpPass(prompt.tolist(), response.tolist(), "resp")]
    got = run_to_end(sequence_logps_slices(trainer, passes, "reference"))
    expected = run_to_end(recomputed_logps_slices(model, None, [(prompt.tolist(), response.tolist())]))
    assert got == pytest.approx(expected, rel=1e-6)
    assert (trainer.stats.unreadable, trainer.stats.reference_replayed, trainer.stats.reference_recomputed) == (1, 0, 1)
    assert store.stats.corrupt == 1 and "resp" not in store


def test_going_on_scores_each_token_among_those_that_go_on(tiny_dirs):
    """``going_on``: a token other than the end is scored by the softmax without the end token (its probability
    over 1 - p(end)), the end token as it is; the gate's held-out replies are scored so."""
    hf_dir = tiny_dirs[sorted(TINY_VARIANTS)[0]]
    model = build_model(hf_dir, torch.float32)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    (prompt, response), end = pairs_of([(7, 12)])[0], 5
    response[[3, 11]] = end  # the end token inside the reply and at its end
    plain, going_on = (run_to_end(recomputed_logps_slices(model, None, [(prompt.tolist(), response.tolist())],
                                                          going_on=g))[0] for g in (None, end))  # fmt: skip
    with torch.no_grad():
        logits = oracle(torch.cat([prompt, response])[None]).logits[0, len(prompt) - 1 : -1]
    without_end = logits.clone()
    without_end[:, end] = float("-inf")
    at = torch.arange(len(response))
    expected = torch.where(response == end, logits.log_softmax(-1)[at, response],
                           without_end.log_softmax(-1)[at, response]).sum()  # fmt: skip
    assert going_on == pytest.approx(expected.item(), abs=1e-4)
    assert plain == pytest.approx(logits.log_softmax(-1)[at, response].sum().item(), abs=1e-4)
    assert going_on > plain  # every going-on token gained what the end's probability took
