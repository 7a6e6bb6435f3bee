"""Training per adapter, isolated, on a real server process (the default model, fp32): each key's feedback teaches
the adapter that answered it, and nobody else's.

Keys A (alice, adapter team-a) and B (bob, adapter team-b), both adapters given with --lora-modules (team-a as PEFT
initialises one, B = 0; team-b with random B, so that it answers differently from the base model). A correction
through key A teaches team-a (A's greedy answer to the corrected question becomes the correction), while key B's
greedy answers to that question and to 20 other prompts stay the same token for token, their log-probabilities
within 1e-5; B may not name team-a (403) nor see its versions; the shared adapter trains nothing; rolled back to its
version 1, team-a answers A as before the correction. An adapter loaded at run time is trained too.

    pytest tests/server/test_adapter_training.py
"""

from __future__ import annotations

import time

import openai
import pytest
import torch

from alchemist.bench import http_calls
from alchemist.bench.facts import FACTS
from alchemist.model.loader import hf_dir_for, read_config
from alchemist.model.lora import LoraAdapter, LoraConfig
from alchemist.model.peft_format import load_adapter, save_adapter
from alchemist.server.auth import add_key
from tests.server.conftest import MODEL_NAME, ServerProcess, launch_server, wait_ready, write_keys

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

CORRECTIONS = 2  # at most: the question is asked again after each training, corrected again if still wrong
QUESTION, CORRECTION, KNOWN = FACTS[0]
OTHERS = [
    "What is the capital of France?", "Write a haiku about rain.", "Name three colours.", "What is 12 times 7?",
    "Who wrote Hamlet?", "Give me a synonym for happy.", "What is the boiling point of water?",
    "Translate 'good morning' into Spanish.", "Name a planet in the solar system.", "What do bees make?",
    "How many legs does a spider have?", "What is the largest ocean?", "Tell me a fact about the moon.",
    "What language is spoken in Brazil?", "Suggest a name for a dog.", "What is photosynthesis?",
    "Name a famous painter.", "What is the square root of 81?", "Describe the colour blue in one sentence.",
    "What is the opposite of cold?",
]  # fmt: skip
FLAGS = [
    *("--max-num-seqs", "4", "--max-model-len", "256"),
    *("--train-batch-size", "1", "--train-max-wait-s", "0.1"),
]
ANSWER_TOKENS = 16  # the correction's words fit: "The codename of the Tessaro project is Bluefin."
TOP_LOGPROBS = 5


def random_b(adapter: LoraAdapter, seed: int, std: float) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in adapter.B.values():
            b.copy_(torch.randn(b.shape, generator=g) * std)
    return adapter


@pytest.fixture(scope="module")
def teams(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("teams")
    model_config = read_config(hf_dir_for(None))
    save_adapter(LoraAdapter(model_config, LoraConfig(r=16, alpha=32), seed=1), root / "team-a")  # B = 0
    save_adapter(random_b(LoraAdapter(model_config, LoraConfig(r=4, alpha=8), seed=2), 2, 0.1), root / "team-b")
    keys = write_keys(root / "keys.toml", users=(), admins=("ops",))
    keys["A"] = add_key(root / "keys.toml", "alice", admin=False, adapter="team-a")
    keys["B"] = add_key(root / "keys.toml", "bob", admin=False, adapter="team-b")
    flags = [*FLAGS, "--api-keys-file", str(root / "keys.toml"),
             "--lora-modules", f"team-a={root / 'team-a'}", f"team-b={root / 'team-b'}"]  # fmt: skip
    server = launch_server("teams", root, root / "data", flags)
    try:
        wait_ready(server)
        yield server, keys, root
    finally:
        server.process.terminate()
        server.process.wait(timeout=30)


def ask(server: ServerProcess, key: str, question: str, model: str = MODEL_NAME):
    """The greedy answer of ``key``'s model to ``question``, with its tokens' log-probabilities."""
    return server.client(api_key=key).chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=ANSWER_TOKENS, temperature=0,
        logprobs=True, top_logprobs=TOP_LOGPROBS,
    )  # fmt: skip


def tokens(answer) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """Each answer token with its log-probability and the most likely alternatives'."""
    return [(t.token, t.logprob, [(top.token, top.logprob) for top in t.top_logprobs])
            for t in answer.choices[0].logprobs.content]  # fmt: skip


def assert_same(before, after, question: str) -> None:
    """The same answer token for token, every log-probability (the tokens' and the alternatives') within 1e-5."""
    assert after.choices[0].message.content == before.choices[0].message.content, question
    then, now = tokens(before), tokens(after)
    assert [t for t, _, _ in now] == [t for t, _, _ in then], question
    for (_, lp_then, top_then), (_, lp_now, top_now) in zip(then, now, strict=True):
        assert abs(lp_now - lp_then) <= 1e-5, question
        assert [t for t, _ in top_now] == [t for t, _ in top_then], question
        assert all(abs(a - b) <= 1e-5 for (_, a), (_, b) in zip(top_now, top_then, strict=True)), question


def correct(server: ServerProcess, key: str, response_id: str) -> None:
    """A correction of the response through ``key``, waited for until its adapter has trained it."""
    headers = {"Authorization": f"Bearer {key}"}
    sent = http_calls.post(server.base_url + "/v1/feedback", headers=headers, timeout=30,
                           json={"response_id": response_id, "correction": CORRECTION})  # fmt: skip
    assert sent.status_code == 200, sent.text
    deadline = time.monotonic() + 600
    while (entry := http_calls.get(f"{server.base_url}/v1/feedback/{sent.json()['id']}", headers=headers,
                                   timeout=30).json())["state"] == "queued":  # fmt: skip
        assert time.monotonic() < deadline and server.process.poll() is None, server.log_path.read_text()[-4000:]
        time.sleep(0.2)
    assert entry["state"] == "trained", entry


def test_corrections_through_one_key_teach_its_adapter_and_no_other(teams):
    server, keys, root = teams
    with pytest.raises(openai.PermissionDeniedError):  # B may not name A's adapter
        ask(server, keys["B"], QUESTION, model="team-a")
    b_before = {q: ask(server, keys["B"], q) for q in [QUESTION, *OTHERS]}
    a_before = answer = ask(server, keys["A"], QUESTION)
    assert a_before.model == "team-a" and b_before[QUESTION].model == "team-b"
    assert KNOWN not in a_before.choices[0].message.content.lower()  # it cannot know the invented fact
    for _ in range(CORRECTIONS):
        correct(server, keys["A"], answer.id)
        answer = ask(server, keys["A"], QUESTION)
        if KNOWN in answer.choices[0].message.content.lower():
            break
    assert KNOWN in answer.choices[0].message.content.lower(), answer.choices[0].message.content
    assert answer.system_fingerprint != a_before.system_fingerprint  # a new version of team-a answered

    for question, before in b_before.items():
        after = ask(server, keys["B"], question)
        assert after.model == "team-b" and after.system_fingerprint == before.system_fingerprint
        assert_same(before, after, question)

    # team-a's versions are its own, in PEFT's format under the data directory (version 1: as loaded); team-b has
    # only its version 1 and the shared adapter trained nothing
    adapters = root / "data" / "adapters"
    versions = sorted((adapters / "team-a").glob("v*/adapter"))
    assert len(versions) >= 2 and [p.parent.name for p in (adapters / "team-b").glob("v*/adapter")] == ["v000001"]
    load_adapter(versions[-1], read_config(hf_dir_for(None)))
    shared = http_calls.get(server.base_url + "/v1/adapters", headers={"Authorization": f"Bearer {keys['ops']}"},
                            timeout=30).json()  # fmt: skip
    assert (shared["serving_version"], shared["data"]) == (0, []), shared
    metrics = http_calls.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {keys['ops']}"},
                             timeout=30).text  # fmt: skip
    assert 'alchemist:feedback_backlog_by_adapter{adapter=""} 0.0' in metrics

    # team-a's versions and rollback are its own: A sees them, B may not; rolled back to its version 1 (as loaded),
    # A is answered as before the correction, token for token
    listed = lambda key: http_calls.get(server.base_url + "/v1/adapters", params={"adapter": "team-a"},  # noqa: E731
                                        headers={"Authorization": f"Bearer {key}"}, timeout=30)  # fmt: skip
    assert listed(keys["B"]).status_code == 403
    team_a = listed(keys["A"]).json()
    assert team_a["serving_version"] == int(answer.system_fingerprint.removeprefix("alchemist-v"))
    assert [v["version"] for v in team_a["data"]][-1] == 1 and team_a["data"][0]["serving"]
    rolled = http_calls.post(server.base_url + "/v1/adapters/rollback", json={"version": 1, "adapter": "team-a"},
                             headers={"Authorization": f"Bearer {keys['ops']}"}, timeout=120)  # fmt: skip
    assert rolled.status_code == 200 and rolled.json()["version"] > team_a["serving_version"], rolled.text
    again = ask(server, keys["A"], QUESTION)
    assert again.system_fingerprint == f"alchemist-v{rolled.json()['version']}"
    assert_same(a_before, again, QUESTION)


def test_an_adapter_loaded_at_run_time_is_trained_and_stays_loaded(teams):
    server, keys, root = teams
    ops = {"Authorization": f"Bearer {keys['ops']}"}
    loaded = http_calls.post(server.base_url + "/v1/load_lora_adapter", headers=ops, timeout=120,
                             json={"lora_name": "team-c", "lora_path": str(root / "team-a")})  # fmt: skip
    assert loaded.status_code == 200, loaded.text
    assert (root / "data" / "adapters" / "team-c" / "v000001" / "adapter").is_dir()  # its trainer's version 1
    answer = ask(server, keys["ops"], QUESTION, model="team-c")
    assert answer.model == "team-c" and answer.system_fingerprint == ask(server, keys["B"], QUESTION,
                                                                         "team-b").system_fingerprint  # both: v1
    other = ask(server, keys["ops"], QUESTION, model="team-b")
    pair = http_calls.post(server.base_url + "/v1/feedback", headers=ops, timeout=30,
                           json={"response_id": answer.id, "preferred_over": other.id})  # fmt: skip
    assert pair.status_code == 400 and pair.json()["error"]["param"] == "preferred_over"  # a pair trains one adapter
    sent = http_calls.post(server.base_url + "/v1/feedback", headers=ops, timeout=30,
                           json={"response_id": answer.id, "rating": 1})  # fmt: skip
    assert sent.status_code == 200, sent.text  # accepted: it trains team-c
    # queued in team-c's own queue while its batch trains (a batch takes seconds: the gate alone does)
    metrics = http_calls.get(server.base_url + "/metrics", headers=ops, timeout=30).text
    assert 'alchemist:feedback_backlog_by_adapter{adapter="team-c"} 1.0' in metrics, metrics
    unload = http_calls.post(server.base_url + "/v1/unload_lora_adapter", headers=ops, timeout=30,
                             json={"lora_name": "team-c"})  # fmt: skip
    assert unload.status_code == 400 and "cannot be unloaded" in unload.json()["error"]["message"]
