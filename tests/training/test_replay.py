"""Replay gradients equal recompute gradients: the exactness guarantee of activation reuse."""

from __future__ import annotations

import pytest
import torch

from alchemist.model.attention import AttentionMetadata
from alchemist.model.loader import build_model
from alchemist.model.lora import LoraAdapter
from alchemist.model.seam import COMPUTE
from alchemist.training.recompute import recompute_loss
from alchemist.training.replay import ReplaySample, replay_backward_slices
from alchemist.training.slices import run_to_end
from tests.tiny_models import TINY_VARIANTS
from tests.training.recording import record_alone, record_batched_chunked


def lora_with_nonzero_b(model, seed=0) -> LoraAdapter:
    adapter = LoraAdapter(model.config, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for b in adapter.B.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.02)
    return adapter


def grads_of(adapter) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in adapter.named_parameters()}


def recompute_grads(model, adapter, prompt, response):
    adapter.zero_grad(set_to_none=True)
    loss = recompute_loss(model, adapter, prompt, response)
    loss.backward()
    return loss.item(), grads_of(adapter)


def replay_grads(model, adapter, record, prompt, response):
    adapter.zero_grad(set_to_none=True)
    sample = ReplaySample(prompt, response, lambda layer: record.layers[layer])
    (loss,) = run_to_end(replay_backward_slices(model, adapter, [sample]))
    return loss, grads_of(adapter)


def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """All gradients as one fp64 vector (the whole-gradient comparisons)."""
    return torch.cat([t.flatten().double() for t in grads.values()])


def max_rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Worst relative L2 error over tensors; a tensor whose reference is exactly zero must be zero too."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / a[k].norm()).item() if a[k].any() else b[k].abs().max().item() for k in a)


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
@pytest.mark.parametrize("prefill", ["alone", "batched_chunked"])
def test_replay_equals_recompute_tiny(tiny_dirs, variant, prefill):
    model = build_model(tiny_dirs[variant], torch.float32)
    adapter = lora_with_nonzero_b(model)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (45,), generator=g)
    response = torch.randint(0, 256, (13,), generator=g)
    if prefill == "alone":
        record = record_alone(model, adapter, prompt)
    else:
        others = [torch.randint(0, 256, (n,), generator=g) for n in (30, 7)]
        record = record_batched_chunked(model, adapter, prompt, others, chunk=16)
    loss_ref, ref = recompute_grads(model, adapter, prompt, response)
    loss, got = replay_grads(model, adapter, record, prompt, response)
    assert loss == pytest.approx(loss_ref, rel=1e-6)
    assert max_rel_l2(ref, got) <= 1e-5


def test_one_token_prompt_and_one_token_response(tiny_dirs):
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    adapter = lora_with_nonzero_b(model)
    for p_len, r_len in ((1, 5), (6, 1)):
        prompt, response = torch.arange(p_len), torch.arange(10, 10 + r_len)
        record = record_alone(model, adapter, prompt)
        _, ref = recompute_grads(model, adapter, prompt, response)
        _, got = replay_grads(model, adapter, record, prompt, response)
        assert max_rel_l2(ref, got) <= 1e-5


@pytest.fixture(scope="module")
def chat_sample(smollm2):
    tok = smollm2.tokenizer
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Explain in two sentences why the sky is blue during the day."},
    ]
    prompt = torch.tensor(tok.apply_chat_template(messages))
    reply = (
        "Sunlight is scattered by air molecules, and blue light scatters the most because of its short "
        "wavelength. So we see blue light coming from every direction of the sky.<|im_end|>"
    )
    response = torch.tensor(tok.encode(reply))
    return prompt, response


@pytest.fixture(scope="module")
def smollm2_fp64(smollm2):
    return build_model(smollm2.hf_dir, torch.float64)


@pytest.mark.parametrize("prefill", ["alone", "batched_chunked"])
def test_replay_equals_recompute_smollm2(smollm2, smollm2_fp64, chat_sample, prefill):
    """fp32: the whole gradient agrees to 1e-5, and every tensor is about as close to the exact (fp64) gradient as
    the recompute path's (within 2x of its error). fp64: every tensor agrees to 1e-10 (the math is the same; fp32
    rounding is all that differs).

    Per tensor in fp32 the two paths differ by up to ~1.3e-5 on a small-norm tensor (layer 0): each is ~8e-5 from
    the fp64 gradient, with independent rounding, so that is the fp32 floor, not a replay error.
    """
    prompt, response = chat_sample
    tok = smollm2.tokenizer
    others = [torch.tensor(tok.apply_chat_template([{"role": "user", "content": t}])) for t in ("Hi!", "2+2?")]
    grads = {}
    for model in (smollm2.model, smollm2_fp64):
        adapter = lora_with_nonzero_b(model).to(model.dtype)
        if prefill == "alone":
            record = record_alone(model, adapter, prompt, dtype=model.dtype)
        else:
            record = record_batched_chunked(model, adapter, prompt, others, chunk=24, dtype=model.dtype)
        _, ref = recompute_grads(model, adapter, prompt, response)
        _, got = replay_grads(model, adapter, record, prompt, response)
        grads[model.dtype] = ref, got
    ref32, got32 = grads[torch.float32]
    ref64, got64 = grads[torch.float64]
    assert max_rel_l2(ref64, got64) <= 1e-10
    assert ((flat(ref32) - flat(got32)).norm() / flat(ref32).norm()).item() <= 1e-5
    ratios = []
    for name, exact in ref64.items():
        err_replay = ((got32[name].double() - exact).norm() / exact.norm()).item()
        err_recompute = ((ref32[name].double() - exact).norm() / exact.norm()).item()
        ratios.append(err_replay / err_recompute)
        assert err_replay <= 2 * err_recompute + 1e-6, name
    median = sorted(ratios)[len(ratios) // 2]
    print(f"fp32 error vs fp64 gradient, replay / recompute, per tensor: median {median:.2f}, max {max(ratios):.2f}")


def test_bf16_record_gradient_deviation_is_bounded(smollm2, chat_sample):
    """bf16 records (the default storage) cost about 1% relative L2 of the gradient (measured, then bounded)."""
    model = smollm2.model
    adapter = lora_with_nonzero_b(model)
    prompt, response = chat_sample
    _, fp32 = replay_grads(model, adapter, record_alone(model, adapter, prompt, torch.float32), prompt, response)
    _, bf16 = replay_grads(model, adapter, record_alone(model, adapter, prompt, torch.bfloat16), prompt, response)
    deviation = ((flat(bf16) - flat(fp32)).norm() / flat(fp32).norm()).item()
    print(f"bf16 record gradient deviation: {deviation:.4%} relative L2")
    assert 0 < deviation <= 0.02


def test_replay_runs_in_a_bf16_model_close_to_recompute(tiny_dirs):
    """The served model is bf16 by default, and the online trainer replays in it: same code path, bf16 rounding."""
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.bfloat16)
    adapter = lora_with_nonzero_b(model)
    g = torch.Generator().manual_seed(5)
    prompt, response = torch.randint(0, 256, (40,), generator=g), torch.randint(0, 256, (12,), generator=g)
    record = record_alone(model, adapter, prompt, dtype=torch.bfloat16)
    loss_ref, ref = recompute_grads(model, adapter, prompt, response)
    loss, got = replay_grads(model, adapter, record, prompt, response)
    assert all(t.dtype == torch.float32 for t in got.values())  # fp32 masters keep fp32 gradients
    assert loss == pytest.approx(loss_ref, rel=1e-2)
    assert ((flat(ref) - flat(got)).norm() / flat(ref).norm()).item() < 0.05


def test_replay_pauses_where_serving_may_run_and_serving_there_changes_nothing(tiny_dirs):
    """The replay's slices: a pause after each layer of the live forward but the last, before each sample's loss and
    after the last, and two in each layer of the walk (the MLP, then attention) but the last layer's end. A forward
    of another sequence in every pause (what serving does there) leaves the gradients bitwise the same."""
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    adapter = lora_with_nonzero_b(model)
    g = torch.Generator().manual_seed(5)
    pairs = [(torch.randint(0, 256, (p,), generator=g), torch.randint(0, 256, (r,), generator=g)) for p, r in
             ((20, 6), (9, 4))]  # fmt: skip
    records = [record_alone(model, adapter, p) for p, _ in pairs]
    samples = [ReplaySample(p, r, lambda layer, rec=rec: rec.layers[layer])
               for (p, r), rec in zip(pairs, records, strict=True)]  # fmt: skip
    other = torch.randint(0, 256, (12,), generator=g)

    def run(serve_in_pauses: bool) -> tuple[int, dict[str, torch.Tensor]]:
        adapter.zero_grad(set_to_none=True)
        slices, pauses = replay_backward_slices(model, adapter, samples), 0
        while True:
            try:
                next(slices)
            except StopIteration:
                return pauses, grads_of(adapter)
            pauses += 1
            if serve_in_pauses:
                with torch.inference_mode():
                    model(other, torch.arange(len(other)), AttentionMetadata.single(len(other)), COMPUTE, adapter)

    pauses, served = run(True)
    layers = model.config.num_layers
    assert pauses == (layers - 1) + (len(samples) + 1) + (2 * layers - 1)
    _, alone = run(False)
    assert all(torch.equal(served[k], alone[k]) for k in alone)
