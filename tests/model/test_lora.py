"""LoRA adapters against PEFT: the on-disk format both ways, logits, and recompute-path gradients.

PEFT and transformers are the oracles (test-only use of their model code). Every adapter has a non-zero B, so the
LoRA delta is live in the logits and A gets a gradient.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from alchemist.model import peft_format
from alchemist.model.attention import AttentionMetadata
from alchemist.model.llama import Llama
from alchemist.model.loader import build_model, read_config
from alchemist.model.lora import FUSED_PARTS, LoraAdapter, LoraConfig
from alchemist.model.peft_format import load_adapter, peft_key, save_adapter
from alchemist.training.recompute import recompute_loss
from tests.tiny_models import TINY_VARIANTS

VARIANTS = sorted(TINY_VARIANTS)
# One variant targets a subset, so fused groups hold untargeted parts (zero deltas) next to targeted ones.
TARGETS = {"llama-mha-tied": ("q_proj", "v_proj", "gate_proj", "down_proj")}
MESSAGES = [{"role": "user", "content": "Give me two tips for staying focused while studying."}]
ANSWER = "1. Put your phone in another room.\n2. Work in 25-minute blocks with short breaks."
GRAD_REL_L2 = 1e-5
LOGITS_ABS = 1e-4


@dataclass
class Case:
    """Our model and adapter, and the same adapter loaded by PEFT into transformers' model of the same weights."""

    model: Llama
    adapter: LoraAdapter
    peft_model: peft.PeftModel
    adapter_dir: Path


def random_adapter(model: Llama, config: LoraConfig, seed: int, b_std: float) -> LoraAdapter:
    adapter = LoraAdapter(model.config, config, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for b in adapter.B.values():
            b.copy_(torch.randn(b.shape, generator=g) * b_std)
    return adapter


def make_case(hf_dir: Path, model: Llama, adapter: LoraAdapter, adapter_dir: Path) -> Case:
    save_adapter(adapter, adapter_dir, base_model_name_or_path=str(hf_dir))
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=True).eval()
    return Case(model, adapter, peft_model, adapter_dir)


@pytest.fixture(scope="module", params=VARIANTS)
def tiny_case(request, tiny_dirs, tmp_path_factory) -> Case:
    hf_dir = tiny_dirs[request.param]
    model = build_model(hf_dir, torch.float32)
    config = LoraConfig(r=4, alpha=8.0, target_modules=TARGETS.get(request.param, LoraConfig().target_modules))
    adapter = random_adapter(model, config, seed=0, b_std=0.2)
    return make_case(hf_dir, model, adapter, tmp_path_factory.mktemp("adapter") / request.param)


@pytest.fixture(scope="module")
def smollm2_case(smollm2, tmp_path_factory) -> Case:
    adapter = random_adapter(smollm2.model, LoraConfig(r=16, alpha=32.0), seed=0, b_std=0.02)
    return make_case(smollm2.hf_dir, smollm2.model, adapter, tmp_path_factory.mktemp("adapter") / "smollm2")


@pytest.fixture(scope="module")
def chat_sample(smollm2) -> tuple[torch.Tensor, torch.Tensor]:
    """A real chat prompt and response (the response ends with the end-of-turn tokens)."""
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template(MESSAGES)
    full = tok.apply_chat_template(MESSAGES + [{"role": "assistant", "content": ANSWER}], add_generation_prompt=False)
    assert full[: len(prompt)] == prompt
    return torch.tensor(prompt), torch.tensor(full[len(prompt) :])


def random_sample(vocab_size: int, num_prompt: int = 40, num_response: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab_size, (num_prompt + num_response,), generator=g)
    return ids[:num_prompt], ids[num_prompt:]


def our_logits(model: Llama, ids: torch.Tensor, adapter: LoraAdapter | None) -> torch.Tensor:
    hidden = model(ids, torch.arange(len(ids)), AttentionMetadata.single(len(ids)), adapter=adapter)
    return model.logits(hidden)


def rel_l2(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


# --- 1. what we save, PEFT loads ---------------------------------------------------------------------------------


def check_logits_match(case: Case, ids: torch.Tensor) -> None:
    with torch.no_grad():
        got = our_logits(case.model, ids, case.adapter)
        expected = case.peft_model(ids[None]).logits[0]
        base = our_logits(case.model, ids, None)
    assert (got - expected).abs().max().item() <= LOGITS_ABS
    assert (got - base).abs().max().item() > 100 * LOGITS_ABS  # the adapter is live, the comparison not vacuous


def test_saved_adapter_loads_in_peft_with_same_logits(tiny_case):
    check_logits_match(tiny_case, torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(2)))


def test_saved_adapter_loads_in_peft_with_same_logits_smollm2(smollm2_case, chat_sample):
    prompt, response = chat_sample
    check_logits_match(smollm2_case, torch.cat([prompt, response]))


# --- 3. recompute-path gradients equal transformers + PEFT --------------------------------------------------------


def peft_response_loss(peft_model: peft.PeftModel, prompt: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    ids = torch.cat([prompt, response[:-1]])
    logits = peft_model(ids[None]).logits[0, len(prompt) - 1 :]
    return F.cross_entropy(logits.float(), response)


def max_grad_rel_l2(case: Case, prompt: torch.Tensor, response: torch.Tensor) -> float:
    case.adapter.zero_grad(set_to_none=True)
    case.peft_model.zero_grad(set_to_none=True)
    ours = recompute_loss(case.model, case.adapter, prompt, response)
    ours.backward()
    theirs = peft_response_loss(case.peft_model, prompt, response)
    theirs.backward()
    assert abs(ours.item() - theirs.item()) <= 1e-5 * abs(theirs.item())
    peft_grads = {
        name.replace(".default", ""): p.grad for name, p in case.peft_model.named_parameters() if "lora_" in name
    }
    our_grads = case.adapter.module_tensors(grads=True)
    assert len(our_grads) == len(peft_grads)
    errors = {key: rel_l2(g, peft_grads[peft_key(*key)]) for key, g in our_grads.items()}
    worst = max(errors, key=errors.get)
    print(f"max LoRA grad rel L2 {errors[worst]:.3g} at {peft_key(*worst)}")
    return errors[worst]


def test_recompute_gradients_match_peft(tiny_case):
    prompt, response = random_sample(256)
    assert max_grad_rel_l2(tiny_case, prompt, response) <= GRAD_REL_L2


def test_recompute_gradients_match_peft_smollm2(smollm2_case, chat_sample):
    prompt, response = chat_sample
    assert max_grad_rel_l2(smollm2_case, prompt, response) <= GRAD_REL_L2


# --- 2. round trips -----------------------------------------------------------------------------------------------


def test_round_trip_is_exact(tiny_case, tmp_path):
    tiny_case.adapter.version = 7
    save_adapter(tiny_case.adapter, tmp_path / "a")
    loaded = load_adapter(tmp_path / "a", tiny_case.model.config)
    assert loaded.version == 7
    assert loaded.config == tiny_case.adapter.config
    expected = tiny_case.adapter.module_tensors()
    got = loaded.module_tensors()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_saved_files_are_peft_format(tiny_dirs, tmp_path):
    model_config = read_config(tiny_dirs["llama-gqa-untied"])
    save_adapter(LoraAdapter(model_config, LoraConfig(r=4, alpha=8.0), seed=0), tmp_path / "a", "some/base")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["bias"]) == ("LORA", "CAUSAL_LM", "none")
    assert config["base_model_name_or_path"] == "some/base"
    assert (config["r"], config["lora_alpha"], config["use_dora"], config["modules_to_save"]) == (4, 8, False, None)
    assert "alchemist" not in config and json.loads((tmp_path / "a" / "alchemist.json").read_text()) == {"version": 0}
    with safe_open(tmp_path / "a" / "adapter_model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        assert all(f.get_tensor(k).dtype == torch.float32 for k in keys)
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys
    assert len(keys) == 2 * 7 * model_config.num_layers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temporary directory left behind


@pytest.mark.parametrize("can_exchange", [True, False])
def test_save_replaces_an_existing_adapter(tiny_dirs, tmp_path, monkeypatch, can_exchange):
    if not can_exchange:
        monkeypatch.setattr(peft_format, "exchange", lambda a, b: False)
    model_config = read_config(tiny_dirs["llama-gqa-untied"])
    old, new = (LoraAdapter(model_config, LoraConfig(r=4), seed=s) for s in (0, 1))
    new.version = 1
    save_adapter(old, tmp_path / "a")
    save_adapter(new, tmp_path / "a")
    loaded = load_adapter(tmp_path / "a", model_config)
    assert loaded.version == 1 and torch.equal(loaded.A["0_qkv"], new.A["0_qkv"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_save_refuses_to_replace_a_foreign_directory(tiny_dirs, tmp_path):
    model_config = read_config(tiny_dirs["llama-gqa-untied"])
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="notes.txt"):
        save_adapter(LoraAdapter(model_config, LoraConfig(r=4)), tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    "variant, peft_config",
    [
        ("qwen2-bias", dict(target_modules=["q_proj", "v_proj", "o_proj", "up_proj"], lora_dropout=0.1)),
        ("llama-gqa-untied", dict(target_modules="all-linear")),
        ("mistral", dict(target_modules=["k_proj", "gate_proj", "down_proj"], use_rslora=True)),
    ],
)
def test_peft_created_adapter_loads_with_peft_logits(tiny_dirs, tmp_path, variant, peft_config):
    hf_dir = tiny_dirs[variant]
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    peft_model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=12, task_type="CAUSAL_LM", **peft_config))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    peft_model.save_pretrained(tmp_path)
    model = build_model(hf_dir, torch.float32)
    adapter = load_adapter(tmp_path, model.config)
    assert adapter.version == 0
    ids = torch.randint(0, 256, (50,), generator=g)
    with torch.no_grad():
        expected = peft_model.eval()(ids[None]).logits[0]
        got = our_logits(model, ids, adapter)
        base_logits = our_logits(model, ids, None)
    assert (got - expected).abs().max().item() <= LOGITS_ABS
    assert (got - base_logits).abs().max().item() > 100 * LOGITS_ABS


# --- 4. validation ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_dir(tiny_dirs, tmp_path_factory) -> Path:
    """An adapter of the llama-gqa-untied variant (2 KV heads), r=4, all targets."""
    model_config = read_config(tiny_dirs["llama-gqa-untied"])
    out = tmp_path_factory.mktemp("saved") / "adapter"
    save_adapter(LoraAdapter(model_config, LoraConfig(r=4), seed=0), out)
    return out


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(bias="all"), "bias='all'"),
        (dict(use_dora=True), "use_dora"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
        (dict(peft_type="IA3"), "peft_type"),
        (dict(r=8), "has shape"),  # the weights are r=4
    ],
)
def test_rejects_unsupported_config(saved_dir, tiny_dirs, tmp_path, change, message):
    directory = tmp_path / "a"
    shutil.copytree(saved_dir, directory)
    config_path = directory / "adapter_config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | change))
    bad_file = directory / ("adapter_model.safetensors" if message == "has shape" else "adapter_config.json")
    with pytest.raises(ValueError, match=f"{re.escape(str(bad_file))}.*{re.escape(message)}"):
        load_adapter(directory, read_config(tiny_dirs["llama-gqa-untied"]))


def test_rejects_adapter_of_another_model(saved_dir, tiny_dirs):
    other = read_config(tiny_dirs["llama-mha-tied"])  # 4 KV heads: k_proj/v_proj B have twice the rows
    with pytest.raises(ValueError, match=f"{re.escape(str(saved_dir / 'adapter_model.safetensors'))}.*k_proj"):
        load_adapter(saved_dir, other)


@pytest.mark.parametrize(
    "edit, message",
    [
        ("extra", "unsupported tensor 'base_model.model.lm_head.lora_A.weight'"),
        ("missing", "lacks 1 tensor"),
    ],
)
def test_rejects_bad_weights(saved_dir, tiny_dirs, tmp_path, edit, message):
    directory = tmp_path / "a"
    shutil.copytree(saved_dir, directory)
    weights_path = directory / "adapter_model.safetensors"
    tensors = load_file(weights_path)
    if edit == "extra":
        tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    else:
        del tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    save_file(tensors, weights_path)
    with pytest.raises(ValueError, match=f"{re.escape(str(weights_path))}.*{re.escape(message)}"):
        load_adapter(directory, read_config(tiny_dirs["llama-gqa-untied"]))


def test_rejects_missing_directory(tiny_dirs, tmp_path):
    with pytest.raises(ValueError, match="adapter_config.json: not found"):
        load_adapter(tmp_path / "nothing", read_config(tiny_dirs["llama-gqa-untied"]))


# --- the replay walk's fused "recorded base output + delta" ---------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_up_equals_base_plus_up(tiny_dirs, variant, dtype):
    """A copy of ``base`` then ``add_up_`` (in-place addmm per part) gives the bits of ``base + up`` in fp32 for
    every fused group and every subset of parts the walk asks for, untargeted parts included (they keep the base
    values)."""
    model = build_model(tiny_dirs[variant], torch.float32)
    config = LoraConfig(r=4, alpha=8.0, target_modules=TARGETS.get(variant, LoraConfig().target_modules))
    adapter = random_adapter(model, config, seed=0, b_std=0.2)
    g = torch.Generator().manual_seed(5)
    for name, parts in [("qkv", None), ("qkv", ("q_proj",)), ("qkv", ("k_proj", "v_proj")), ("o", None),
                        ("gate_up", None), ("down", None)]:  # fmt: skip
        if not adapter.targeted(name):
            continue
        x = torch.randn(9, adapter.shapes[FUSED_PARTS[name][0]][0], generator=g).to(dtype)
        xa = adapter.down(1, name, x)
        width = sum(adapter.shapes[p][1] for p in parts or FUSED_PARTS[name])
        base = torch.randn(9, width, generator=g).to(torch.bfloat16)  # records may be bf16: cast on the copy
        got = adapter.add_up_(1, name, base.to(dtype, copy=True), xa, parts)
        assert got.dtype == dtype and base.dtype == torch.bfloat16
        summed = base.to(dtype) + adapter.up(1, name, xa, parts)
        if dtype == torch.float32:
            assert torch.equal(got, summed), (name, parts)
        else:  # bf16: addmm rounds base + delta once where the sum rounds twice: never further from the truth
            exact = base.double() + adapter.up(1, name, xa.double(), parts)
            assert rel_l2(got.double(), exact) <= rel_l2(summed.double(), exact) + 1e-6, (name, parts)
