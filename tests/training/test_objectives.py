"""KTO and DPO with TRL as the oracle: TRL's own loss code (``KTOTrainer._compute_loss``, ``DPOTrainer._compute_loss``,
run on a minimal trainer object: the attributes they read, no dataset, no training loop) over transformers + PEFT
holding our adapter, against ours.

- the loss values of the same batch (the same log-probabilities) equal TRL's within 1e-6 in fp32;
- our trainer's gradients (``FeedbackBatch`` -> ``Trainer``, recomputed) equal those of TRL's loss through PEFT;
- replayed from records, a step of SFT + KTO + DPO samples equals the same step recomputed, and so does a step whose
  passes without gradient (the base model's reference, KTO's z0 under the adapter) replay.
"""

from __future__ import annotations

import dataclasses
import types
from collections import defaultdict

import peft
import pytest
import torch
import transformers
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.kto_trainer import KTOTrainer
from trl.trainer.utils import add_fused_lm_head

from alchemist.activations.store import ActivationStore
from alchemist.config.training import ObjectivesConfig
from alchemist.model.loader import build_model
from alchemist.model.lora import LoraConfig
from alchemist.model.peft_format import peft_key, save_adapter
from alchemist.training.feedback_batch import FeedbackBatch, Item
from alchemist.training.objectives import dpo_losses, kto_kl, kto_losses, mismatched
from alchemist.training.slices import run_to_end
from alchemist.training.trainer import Sample, Trainer, TrainerConfig
from tests.model.test_lora import random_adapter, rel_l2
from tests.training.recording import record_alone
from tests.training.test_replay import flat

VARIANT = "llama-gqa-untied"
BETA = 0.1
W_DESIRABLE, W_UNDESIRABLE = 1.0, 1.5  # unequal: the weights must land on the right samples


class _Accelerator:
    """What the loss code asks of accelerate's Accelerator, on one process."""

    device = torch.device("cpu")

    def unwrap_model(self, model):
        return model

    def gather_for_metrics(self, x):
        return x

    def gather(self, x):
        return x


def trl_trainer(cls, model, **attrs):
    """An instance of TRL's trainer ``cls`` without its __init__: the attributes its loss code reads."""
    trainer = object.__new__(cls)
    trainer.__dict__.update(
        model=model, ref_model=None, accelerator=_Accelerator(), aux_loss_enabled=False, precompute_ref_logps=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None), beta=BETA, **attrs,
    )  # fmt: skip
    return trainer


def dpo_loss_trl(model, inputs):
    trainer = trl_trainer(DPOTrainer, model, ld_alpha=None, f_divergence_type="reverse_kl", loss_types=["sigmoid"],
                          loss_weights=[1.0], use_weighting=False, label_smoothing=0.0)  # fmt: skip
    return DPOTrainer._compute_loss(trainer, model, inputs, False)


def kto_loss_trl(model, inputs, desirable_weight=W_DESIRABLE, undesirable_weight=W_UNDESIRABLE):
    trainer = trl_trainer(KTOTrainer, model, calculate_KL=True, loss_type="kto", desirable_weight=desirable_weight,
                          undesirable_weight=undesirable_weight)  # fmt: skip
    return KTOTrainer._compute_loss(trainer, model, inputs, False), trainer._metrics["train"]["kl"][-1]


def ids(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]


PROMPTS = ids([9, 5, 14, 7], seed=1)
RESPONSES = ids([6, 11, 3, 8], seed=2)
REJECTED = ids([4, 9, 7, 5], seed=3)
DESIRABLE = [True, False, False, True]


@dataclasses.dataclass
class Case:
    model: object  # ours
    adapter: object  # ours
    peft_model: peft.PeftModel  # the same weights and adapter in transformers + PEFT, TRL's fused LM head added


@pytest.fixture(scope="module")
def case(tiny_dirs, tmp_path_factory) -> Case:
    hf_dir = tiny_dirs[VARIANT]
    model = build_model(hf_dir, torch.float32)
    adapter = random_adapter(model, LoraConfig(r=4, alpha=8.0), seed=0, b_std=0.2)
    # A few SFT steps on the mismatched pairs: the adapter raises their log-probabilities, so KTO's z0 is positive
    # (with the random adapter alone it is clamped at 0, and the test would not see it).
    trainer = Trainer(model, adapter, None, TrainerConfig(lr=1e-2, replay=False))
    for _ in range(3):
        mismatched_pairs = [Sample(p, RESPONSES[j]) for p, j in zip(PROMPTS, mismatched(range(4)), strict=True)]
        run_to_end(trainer.step_slices(mismatched_pairs))
    adapter_dir = tmp_path_factory.mktemp("adapter") / VARIANT
    save_adapter(adapter, adapter_dir, base_model_name_or_path=str(hf_dir))
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    add_fused_lm_head(base, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    peft_model = peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    peft_model.train()  # TRL reads the mode; the tiny models have no dropout
    return Case(model, adapter, peft_model)


def padded(rows):
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows])


def completion_inputs(prompts, completions, prefix=""):
    """TRL's collated tensors: prompt + completion, right-padded; the completion mask marks the completion."""
    return {
        prefix + "input_ids": padded([p + c for p, c in zip(prompts, completions, strict=True)]),
        prefix + "attention_mask": padded([[1] * (len(p) + len(c)) for p, c in zip(prompts, completions, strict=True)]),
        prefix + "completion_mask": padded([[0] * len(p) + [1] * len(c)
                                            for p, c in zip(prompts, completions, strict=True)]),  # fmt: skip
    }


def kto_inputs(desirable=DESIRABLE):
    kl_completions = [RESPONSES[-1]] + RESPONSES[:-1]  # TRL's rotation (KTOTrainer's add_kl_completion_ids)
    return completion_inputs(PROMPTS, RESPONSES) | completion_inputs(PROMPTS, kl_completions, "KL_") | {
        "label": torch.tensor(desirable)
    }


def dpo_inputs():
    return completion_inputs(PROMPTS + PROMPTS, RESPONSES + REJECTED)  # [chosen..., rejected...]


def peft_logps(peft_model, prompts, completions, adapter: bool) -> torch.Tensor:
    """Sequence log-probabilities from transformers + PEFT (TRL's fused head), with the adapter on or off."""
    inputs = completion_inputs(prompts, completions)
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    with torch.no_grad():
        if adapter:
            out = peft_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels,
                             fused_lm_head=True)  # fmt: skip
        else:
            with peft_model.disable_adapter():
                out = peft_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels,
                                 fused_lm_head=True)  # fmt: skip
    return out.log_probs.sum(-1)


def test_kto_loss_equals_trl(case):
    theirs, trl_kl = kto_loss_trl(case.peft_model, kto_inputs())
    logps, ref = (peft_logps(case.peft_model, PROMPTS, RESPONSES, on) for on in (True, False))
    kl_completions = [RESPONSES[j] for j in mismatched(range(len(RESPONSES)))]
    kl = kto_kl(*(peft_logps(case.peft_model, PROMPTS, kl_completions, on) for on in (True, False)))
    ours = kto_losses(logps, ref, torch.tensor(DESIRABLE), kl, BETA, W_DESIRABLE, W_UNDESIRABLE).mean()
    assert kl.item() == pytest.approx(trl_kl, abs=1e-6)
    assert abs(ours.item() - theirs.item()) <= 1e-6
    # not vacuous: the adapter moves the log-probabilities, z0 is positive, the classes are weighted
    assert (logps - ref).abs().min() > 1e-3 and kl.item() > 0
    assert abs(kto_losses(logps, ref, torch.tensor(DESIRABLE), kl, BETA).mean().item() - theirs.item()) > 1e-4


def test_dpo_loss_equals_trl(case):
    theirs = dpo_loss_trl(case.peft_model, dpo_inputs())
    chosen, ref_chosen = (peft_logps(case.peft_model, PROMPTS, RESPONSES, on) for on in (True, False))
    rejected, ref_rejected = (peft_logps(case.peft_model, PROMPTS, REJECTED, on) for on in (True, False))
    ours = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, BETA).mean()
    assert abs(ours.item() - theirs.item()) <= 1e-6
    assert abs(ours.item() - torch.nn.functional.softplus(torch.tensor(0.0)).item()) > 1e-3  # not log 2: moved


def weights(**overrides) -> ObjectivesConfig:
    return ObjectivesConfig(**{"kto_desirable_weight": W_DESIRABLE, "kto_undesirable_weight": W_UNDESIRABLE,
                               **overrides})  # fmt: skip


def our_step_grads(case, items, store=None, replay=False, group_size=4, max_staleness=4, stats=None, **objectives):
    """Our trainer's gradients of one step over ``items`` (not applied), and its samples' (loss, replayed); its
    counters into ``stats`` (a dict), if given."""
    case.adapter.zero_grad(set_to_none=True)
    config = TrainerConfig(replay=replay, group_size=group_size, max_staleness=max_staleness)
    trainer = Trainer(case.model, case.adapter, store, config)
    batch = FeedbackBatch(items, weights(**objectives), group_size)
    samples, scales = run_to_end(batch.samples_slices(trainer))
    results = run_to_end(trainer.backward_slices(samples, scales))
    if stats is not None:
        stats.update(vars(trainer.stats))
    return {key: g.clone() for key, g in case.adapter.module_tensors(grads=True).items()}, samples, results


def peft_grads(case, loss):
    case.peft_model.zero_grad(set_to_none=True)
    loss.backward()
    return {name.replace(".default", ""): p.grad for name, p in case.peft_model.named_parameters() if "lora_" in name}


def assert_same_grads(ours, theirs):
    assert len(ours) == len(theirs)
    errors = {key: rel_l2(g, theirs[peft_key(*key)]) for key, g in ours.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, (peft_key(*worst), errors[worst])


def test_kto_gradients_equal_trl_through_peft(case):
    items = [Item("kto", p, r, desirable=d) for p, r, d in zip(PROMPTS, RESPONSES, DESIRABLE, strict=True)]
    ours, samples, results = our_step_grads(case, items)
    loss, _ = kto_loss_trl(case.peft_model, kto_inputs())
    assert_same_grads(ours, peft_grads(case, loss))
    our_loss = sum(s.term.weight * own for s, (own, _) in zip(samples, results, strict=True))
    assert our_loss == pytest.approx(loss.item(), abs=1e-6)


@pytest.mark.parametrize("balance", [True, False])
def test_kto_sides_weighed_alike_as_the_paper_recommends(case, balance):
    """One thumbs-up and three thumbs-down: balanced (the default), the step is TRL's with the desirable weight
    scaled by 4 / (2 x 1) and the undesirable one by 4 / (2 x 3), so each side weighs half (w_d n_d = w_u n_u);
    unbalanced, TRL's with the weights as given."""
    desirable = [True, False, False, False]
    items = [Item("kto", p, r, desirable=d) for p, r, d in zip(PROMPTS, RESPONSES, desirable, strict=True)]
    ours, _, _ = our_step_grads(case, items, kto_balance=balance)
    scale_d, scale_u = (2.0, 2.0 / 3.0) if balance else (1.0, 1.0)
    loss, _ = kto_loss_trl(case.peft_model, kto_inputs(desirable), W_DESIRABLE * scale_d, W_UNDESIRABLE * scale_u)
    assert_same_grads(ours, peft_grads(case, loss))
    other, _ = kto_loss_trl(case.peft_model, kto_inputs(desirable), W_DESIRABLE, W_UNDESIRABLE)
    assert abs(loss.item() - other.item()) > 1e-4 if balance else loss.item() == other.item()


def test_dpo_gradients_equal_trl_through_peft(case):
    items = [Item("dpo", p, c, rejected_ids=r) for p, c, r in zip(PROMPTS, RESPONSES, REJECTED, strict=True)]
    ours, samples, results = our_step_grads(case, items, group_size=3)  # pairs are never cut: groups of 4, 4
    loss = dpo_loss_trl(case.peft_model, dpo_inputs())
    assert_same_grads(ours, peft_grads(case, loss))
    our_loss = sum(s.term.weight * own for s, (own, _) in zip(samples, results, strict=True) if s.term.desirable)
    assert our_loss == pytest.approx(loss.item(), abs=1e-6)


def mixed_items(record_ids):
    return [
        Item("sft", PROMPTS[0], RESPONSES[0], record_ids[0]),
        Item("kto", PROMPTS[1], RESPONSES[1], record_ids[1], desirable=True),
        Item("kto", PROMPTS[2], RESPONSES[2], record_ids[2], desirable=False),
        Item("dpo", PROMPTS[3], RESPONSES[3], record_ids[3], rejected_ids=REJECTED[3]),
        Item("dpo", PROMPTS[0], REJECTED[0], record_ids[0], rejected_ids=RESPONSES[1]),
    ]


@pytest.mark.parametrize("group_size", [1, 3, 8])
def test_replay_equals_recompute_for_sft_kto_and_dpo_together(case, group_size):
    """One step of every objective at once, replayed from fp32 records (made by this adapter), equals it
    recomputed: the values and gradients (groups of 1 and 3 still keep each DPO pair together)."""
    store = ActivationStore(budget_bytes=1 << 30)
    for i, prompt in enumerate(PROMPTS):
        record = record_alone(case.model, case.adapter, torch.tensor(prompt), version=case.adapter.version)
        store.put(dataclasses.replace(record, record_id=f"r{i}"))
    items = mixed_items([f"r{i}" for i in range(len(PROMPTS))])
    recomputed, _, expected = our_step_grads(case, items, store, replay=False, group_size=group_size)
    replayed, samples, results = our_step_grads(case, items, store, replay=True, group_size=group_size)
    assert [r for _, r in results] == [True] * len(samples) == [True] * 7
    assert [loss for loss, _ in results] == pytest.approx([loss for loss, _ in expected], rel=1e-5, abs=1e-6)
    ours, theirs = flat(replayed), flat(recomputed)
    assert ((ours - theirs).norm() / theirs.norm()).item() <= 1e-5
    assert all(store.evict(f"r{i}") for i in range(len(PROMPTS)))  # nothing left pinned


@pytest.mark.parametrize("made_by", ["base", "adapter"])
def test_replayed_reference_and_z0_equal_recomputed(case, made_by):
    """A step of KTO and DPO (and SFT) samples whose passes without gradient replay from fp32 records equals it all
    recomputed: the base model's log-probabilities from records the base model made (version 0; the adapter at
    version 3 then recomputes its passes: max_staleness 0), KTO's z0 and the gradient passes from records the
    adapter made (the reference pass then recomputed)."""
    assert case.adapter.version == 3  # the fixture's three steps
    store = ActivationStore(budget_bytes=1 << 30)
    for i, prompt in enumerate(PROMPTS):
        policy, version = (None, 0) if made_by == "base" else (case.adapter, 3)
        record = record_alone(case.model, policy, torch.tensor(prompt), version=version)
        store.put(dataclasses.replace(record, record_id=f"r{i}"))
    items = mixed_items([f"r{i}" for i in range(len(PROMPTS))])
    recomputed, expected_samples, expected = our_step_grads(case, items)
    stats: dict = {}
    replayed, samples, results = our_step_grads(case, items, store, replay=True, max_staleness=0, stats=stats)
    # what replayed: 8 reference passes (2 KTO responses, 2 x 2 DPO, 2 mismatched pairs), 2 z0 passes, 7 samples
    base = made_by == "base"
    assert (stats["reference_replayed"], stats["reference_recomputed"]) == ((8, 0) if base else (0, 8))
    assert (stats["kl_replayed"], stats["kl_recomputed"]) == ((0, 2) if base else (2, 0))
    assert (stats["replayed"], stats["recomputed"]) == ((0, 7) if base else (7, 0))
    terms = [(s.term.ref_logp, s.term.kl) for s in samples if s.term is not None]
    expected_terms = [(s.term.ref_logp, s.term.kl) for s in expected_samples if s.term is not None]
    assert terms == [pytest.approx(t, rel=1e-5, abs=1e-6) for t in expected_terms]
    assert samples[1].term.kl > 0  # z0 is not clamped away: its value counts
    assert [loss for loss, _ in results] == pytest.approx([loss for loss, _ in expected], rel=1e-5, abs=1e-6)
    ours, theirs = flat(replayed), flat(recomputed)
    assert ((ours - theirs).norm() / theirs.norm()).item() <= 1e-5
    assert all(store.evict(f"r{i}") for i in range(len(PROMPTS)))  # nothing left pinned
