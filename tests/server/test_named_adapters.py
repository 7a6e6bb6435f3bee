"""Named adapters on a real server process (the default model, fp32; one server for the module): vLLM's multi-LoRA
API, keys with an adapter of their own, and more adapters than the engine holds.

The server has a keys file (alice: user key with her own adapter team-a; bob: user key without one; ops: admin),
team-a and 50 small random adapters "many-00".."many-49" from --lora-modules, and --max-loras 4. A response's
``model`` names the adapter that answered it (the base model's name: the shared adapter).

    pytest tests/server/test_named_adapters.py
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import peft
import pytest
import torch
import transformers

from alchemist.bench import http_calls
from alchemist.engine import SamplingParams
from alchemist.model.loader import hf_dir_for, read_config
from alchemist.model.lora import LoraAdapter, LoraConfig
from alchemist.model.peft_format import save_adapter
from alchemist.server.auth import add_key
from tests.server.conftest import MODEL_NAME, ServerProcess, launch_server, wait_ready, write_keys

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

NUM_MANY = 50
MAX_LORAS = 4
FLAGS = ["--max-num-seqs", "8", "--max-model-len", "256", "--no-train", "--max-loras", str(MAX_LORAS)]
HELLO = [{"role": "user", "content": "Tell me one fact about the sea."}]
PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Name three colours."]


def random_b(adapter: LoraAdapter, seed: int, std: float) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in adapter.B.values():
            b.copy_(torch.randn(b.shape, generator=g) * std)
    return adapter


@pytest.fixture(scope="module")
def named(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("named")
    model_config = read_config(hf_dir_for(None))
    modules = []
    # team-a: rank 4 on every projection; the many: rank 2 on q and v only (ranks and targets differ per adapter),
    # with B large enough that most of them answer differently
    for name, config, seed, std in [("team-a", LoraConfig(r=4, alpha=8), 7, 0.1)] + [
        (f"many-{i:02d}", LoraConfig(r=2, alpha=4, target_modules=("q_proj", "v_proj")), 100 + i, 1.0)
        for i in range(NUM_MANY)
    ]:
        save_adapter(random_b(LoraAdapter(model_config, config, seed=seed), seed, std), root / name)
        modules.append(f"{name}={root / name}")
    keys = write_keys(root / "keys.toml", users=("bob",), admins=("ops",))
    keys["alice"] = add_key(root / "keys.toml", "alice", admin=False, adapter="team-a")
    flags = [*FLAGS, "--api-keys-file", str(root / "keys.toml"), "--lora-modules", *modules]
    server = launch_server("named", root, root / "data", flags)
    try:
        wait_ready(server)
        yield server, keys, root
    finally:
        server.process.terminate()
        server.process.wait(timeout=30)


def chat(server: ServerProcess, key: str, model: str, messages=HELLO, max_tokens: int = 6):
    return server.client(api_key=key).chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0
    )


def post(server: ServerProcess, path: str, key: str, body: dict) -> httpx.Response:
    return http_calls.post(server.base_url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def model_ids(server: ServerProcess, key: str) -> dict[str, dict]:
    response = http_calls.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    return {card["id"]: card for card in response.json()["data"]}


def assert_error(response: httpx.Response, status: int, code: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


def metric(server: ServerProcess, key: str, name: str) -> float:
    text = http_calls.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


# --- (a) an adapter PEFT made, loaded at run time -----------------------------------------------------------------


def test_a_peft_adapter_loaded_at_run_time_answers_as_peft_does(named, tokenizer, tmp_path):
    server, keys, _ = named
    hf_dir = hf_dir_for(None)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    torch.manual_seed(3)  # PEFT draws A from the global generator: the tests run before this one must not pick it
    peft_model = peft.get_peft_model(base, peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    peft_model.save_pretrained(tmp_path / "peft-made")
    peft_model.eval()

    assert post(server, "/v1/load_lora_adapter", keys["bob"], {"lora_name": "peft-made",
                "lora_path": str(tmp_path / "peft-made")}).status_code == 403  # fmt: skip  # admins only
    loaded = post(server, "/v1/load_lora_adapter", keys["ops"],
                  {"lora_name": "peft-made", "lora_path": str(tmp_path / "peft-made")})  # fmt: skip
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["parent"] == MODEL_NAME and "peft-made" in model_ids(server, keys["ops"])
    base_differs = False
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ids = torch.tensor([tokenizer.apply_chat_template(messages)])  # the server's prompt ids
        with torch.no_grad():
            theirs = peft_model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
        ours = chat(server, keys["ops"], "peft-made", messages, max_tokens=8)
        assert ours.model == "peft-made"
        assert ours.choices[0].message.content == tokenizer.decode(theirs, skip_special_tokens=True), prompt
        base_differs |= chat(server, keys["ops"], MODEL_NAME, messages, 8).choices[0].message.content != (
            ours.choices[0].message.content)  # fmt: skip
    assert base_differs  # the adapter does change the answers

    unloaded = post(server, "/v1/unload_lora_adapter", keys["ops"], {"lora_name": "peft-made"})
    assert unloaded.status_code == 200 and unloaded.json() == {"id": "peft-made", "object": "model", "deleted": True}
    with pytest.raises(openai.NotFoundError) as info:
        chat(server, keys["ops"], "peft-made")
    assert info.value.body["code"] == "model_not_found"
    assert "peft-made" not in model_ids(server, keys["ops"])


def test_load_and_unload_errors_are_openai_shaped(named, tmp_path):
    server, keys, root = named
    load = lambda name, path: post(server, "/v1/load_lora_adapter", keys["ops"], {"lora_name": name,  # noqa: E731
                                                                                    "lora_path": str(path)})
    assert "already" in assert_error(load("team-a", root / "many-00"), 400, None)["message"]
    assert_error(load(MODEL_NAME, root / "many-00"), 400, None)  # the base model's name
    assert "not a directory" in assert_error(load("fresh", tmp_path / "missing"), 400, None)["message"]
    (tmp_path / "empty").mkdir()
    assert "adapter_config.json" in assert_error(load("fresh", tmp_path / "empty"), 400, None)["message"]
    error = assert_error(post(server, "/v1/unload_lora_adapter", keys["ops"], {"lora_name": "nope"}), 404,
                         "adapter_not_found")  # fmt: skip
    assert error["param"] == "lora_name"
    assert_error(post(server, "/v1/unload_lora_adapter", keys["alice"], {"lora_name": "team-a"}), 403,
                 "permission_denied")  # fmt: skip


# --- (b) keys with an adapter of their own ------------------------------------------------------------------------


def test_a_key_may_name_only_its_own_adapter(named):
    server, keys, _ = named
    with pytest.raises(openai.PermissionDeniedError) as info:
        chat(server, keys["bob"], "team-a")
    assert info.value.body["code"] == "permission_denied" and "team-a" in info.value.body["message"]
    with pytest.raises(openai.PermissionDeniedError):
        chat(server, keys["alice"], "many-03")
    with pytest.raises(openai.NotFoundError) as info:
        chat(server, keys["alice"], "no-such-adapter")
    assert info.value.body["code"] == "model_not_found"

    alices = model_ids(server, keys["alice"])
    assert set(alices) == {MODEL_NAME, "team-a"}
    assert alices["team-a"]["parent"] == MODEL_NAME and alices["team-a"]["root"].endswith("team-a")
    assert alices[MODEL_NAME]["parent"] is None
    assert set(model_ids(server, keys["bob"])) == {MODEL_NAME}
    assert len(model_ids(server, keys["ops"])) == 1 + 1 + NUM_MANY


def test_the_base_models_name_is_a_keys_own_adapter(named):
    server, keys, _ = named
    personal = chat(server, keys["alice"], MODEL_NAME)
    assert personal.model == "team-a"  # the response names the adapter that answered
    named_so = chat(server, keys["ops"], "team-a")
    assert (named_so.model, named_so.choices[0].message.content) == ("team-a", personal.choices[0].message.content)
    shared = chat(server, keys["bob"], MODEL_NAME)
    assert shared.model == MODEL_NAME and shared.choices[0].message.content != personal.choices[0].message.content
    chunks = list(server.client(api_key=keys["alice"]).chat.completions.create(
        model=MODEL_NAME, messages=HELLO, max_tokens=6, temperature=0, stream=True))  # fmt: skip
    assert {c.model for c in chunks} == {"team-a"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        personal.choices[0].message.content)  # fmt: skip


def test_feedback_on_a_named_adapters_response_is_refused(named):
    server, keys, _ = named
    personal = chat(server, keys["alice"], MODEL_NAME)
    error = assert_error(post(server, "/v1/feedback", keys["alice"], {"response_id": personal.id, "rating": 1}),
                         409, "adapter_not_trained")  # fmt: skip
    assert "team-a" in error["message"] and "frozen" in error["message"]
    shared = chat(server, keys["bob"], MODEL_NAME)
    error = assert_error(post(server, "/v1/feedback", keys["ops"], {"response_id": shared.id,
                         "preferred_over": personal.id}), 409, "adapter_not_trained")  # fmt: skip
    assert error["param"] == "preferred_over"
    assert post(server, "/v1/feedback", keys["bob"], {"response_id": shared.id, "rating": 1}).status_code == 200
    assert chat(server, keys["alice"], MODEL_NAME).model == "team-a"  # still serving


def test_the_adapters_summary_has_a_row_per_adapter_the_key_may_use(named):
    """GET /v1/adapters/summary: the shared adapter, then the named ones the key may use (those /v1/models lists
    for it). Nothing trains here (--no-train): the shared adapter's feedback stays queued (its backlog), and the
    named ones are served as loaded, with no versions; a request pages its adapter into the engine."""
    server, keys, _ = named
    summary = lambda key: http_calls.get(server.base_url + "/v1/adapters/summary", timeout=30,  # noqa: E731
                                         headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    before = summary(keys["ops"]).json()["data"][0]["backlog"]
    shared = chat(server, keys["bob"], MODEL_NAME)
    assert post(server, "/v1/feedback", keys["bob"], {"response_id": shared.id, "rating": 1}).status_code == 200
    assert chat(server, keys["alice"], MODEL_NAME).model == "team-a"  # in the engine now: the latest paged in

    listed = summary(keys["ops"])
    assert listed.status_code == 200 and listed.json()["object"] == "list", listed.text
    rows = listed.json()["data"]
    assert [row["adapter"] for row in rows] == [None, *sorted(set(model_ids(server, keys["ops"])) - {MODEL_NAME})]
    assert {f"many-{i:02d}" for i in range(NUM_MANY)} < {row["adapter"] for row in rows}
    assert rows[0] == {"adapter": None, "object": "adapter.summary", "serving_version": 0, "training": "off",
                       "backlog": before + 1, "residence": "engine"}  # fmt: skip
    named_rows = {row["adapter"]: row for row in rows[1:]}
    assert {(row["serving_version"], row["training"], row["backlog"]) for row in named_rows.values()} == {
        (None, "off", 0)}  # fmt: skip
    assert named_rows["team-a"]["residence"] == "engine"
    residences = [row["residence"] for row in named_rows.values()]
    # at most --max-loras in the engine, as many kept read (max_cpu_loras: the same), the rest on disk
    assert residences.count("engine") <= MAX_LORAS and residences.count("memory") <= MAX_LORAS
    assert residences.count("disk") >= len(residences) - 2 * MAX_LORAS

    # a user key sees the shared adapter and its own alone; without a key, the OpenAI-shaped 401
    assert [row["adapter"] for row in summary(keys["alice"]).json()["data"]] == [None, "team-a"]
    assert [row["adapter"] for row in summary(keys["bob"]).json()["data"]] == [None]
    assert_error(http_calls.get(server.base_url + "/v1/adapters/summary", timeout=30), 401, "invalid_api_key")


# --- (c) more adapters than the engine holds ----------------------------------------------------------------------


def test_fifty_adapters_round_robin_through_four_slots(named, smollm2):
    server, keys, root = named
    loads, evictions = (metric(server, keys["ops"], f"alchemist:adapter_{m}_total") for m in ("loads", "evictions"))
    names = [f"many-{i:02d}" for i in range(NUM_MANY)]
    client = server.client(api_key=keys["ops"])
    ask = lambda name: client.completions.create(model=name, prompt="The sea is", max_tokens=4,  # noqa: E731
                                                 temperature=0).choices[0].text  # fmt: skip
    with ThreadPoolExecutor(8) as pool:  # 8 requests in flight: twice the slots, so some wait for one
        first, second = (list(pool.map(ask, names)) for _ in range(2))
    assert first == second  # each adapter paged in twice, beside different neighbours
    assert len(set(first)) > 10  # the adapters do answer differently
    assert metric(server, keys["ops"], "alchemist:adapter_loads_total") - loads >= 2 * NUM_MANY
    assert metric(server, keys["ops"], "alchemist:adapter_evictions_total") - evictions >= 2 * NUM_MANY - MAX_LORAS
    assert metric(server, keys["ops"], "alchemist:adapters_in_engine") == MAX_LORAS

    # and each as that adapter alone gives, in this process's engine (fp32, the adapter as its only one)
    from alchemist.engine import LLMEngine
    from alchemist.model.peft_format import load_adapter

    engine = LLMEngine(smollm2.model, smollm2.tokenizer)
    prompt = smollm2.tokenizer.encode("The sea is", add_special_tokens=True)
    for i in (0, 17, 49):
        engine.set_adapter(load_adapter(root / names[i], smollm2.model.config), i + 1)  # a version each: own cache
        out = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0]
        assert out.text == first[i], names[i]


# --- the keys file ------------------------------------------------------------------------------------------------


def test_keys_add_records_an_adapter_and_keys_without_one_read_as_before(tmp_path, capsys):
    from alchemist.cli import main
    from alchemist.server.auth import hash_key, parse_keys

    path = tmp_path / "keys.toml"
    assert main(["keys", "add", "alice", "--adapter", "team-a", "--file", str(path)]) == 0
    alice = capsys.readouterr().out.split()[-1]
    bob = add_key(path, "bob", admin=False)
    assert path.read_text().count("adapter") == 1  # only alice's entry has the field
    callers = parse_keys(path.read_text(), str(path))
    assert callers[hash_key(alice)].adapter == "team-a" and callers[hash_key(bob)].adapter is None
    assert callers[hash_key(alice)].may_use("team-a") and not callers[hash_key(bob)].may_use("team-a")
    with pytest.raises(ValueError, match="adapter name"):
        add_key(path, "carol", admin=False, adapter="not a name")
    with pytest.raises(ValueError, match="adapter must be an adapter name"):
        parse_keys(f'[[keys]]\nname = "d"\nsha256 = "{"0" * 64}"\nadapter = 3\n', "inline")
