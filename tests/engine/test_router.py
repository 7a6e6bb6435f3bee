"""The router on the real tokenizer and the sets it must tell apart (alchemist.engine.router, threshold 0.5): every
taught question and its paraphrases routed to the corrections, no ordinary ShareGPT question nor gate canary."""

from __future__ import annotations

from alchemist.bench.facts import FACT_PARAPHRASES, FACTS, invented_facts
from alchemist.bench.learn import sharegpt_questions
from alchemist.config import EngineConfig
from alchemist.engine.router import Router, idf, words
from alchemist.training.evaluation import CANARIES


def test_taught_questions_and_their_paraphrases_route_ordinary_chat_does_not(smollm2_tokenizer):
    tok = smollm2_tokenizer
    router = Router(tok.decode, tok.decode(tok.user_prompt("")), EngineConfig().route_threshold)
    assert not router.routes(tok.user_prompt(FACTS[0][0]))  # nothing taught: nothing routed
    taught = [q for q, _, _ in FACTS + invented_facts(50, seed=0)]
    router.teach(tok.user_prompt(q) for q in taught)
    assert len(router) == 60
    assert all(router.routes(tok.user_prompt(q)) for q in taught)
    assert sum(router.routes(tok.user_prompt(q)) for q in FACT_PARAPHRASES) >= 9
    ordinary = sharegpt_questions(tok, 200, seed=23, exclude=set())
    assert not any(router.routes(tok.user_prompt(q)) for q in ordinary)
    assert not any(router.routes(tok.user_prompt(q)) for q, _, _ in CANARIES)


def test_rare_words_weigh_and_the_template_does_not(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert idf("the") < 1 < 5 < idf("tessaro")  # in most first turns; in none
    router = Router(tok.decode, tok.decode(tok.user_prompt("")), 0.5)
    router.teach([tok.user_prompt("What is the codename of the Tessaro project?")])
    assert router.score(tok.user_prompt("")) == 0  # the chat template and its system prompt hold none of it
    assert router.score(tok.user_prompt("What is the history of the Apollo project?")) < 0.5
    assert router.score(tok.user_prompt("Codename of Tessaro, please.")) > 0.5
    assert words("Glass Orchards' author, 1887!") == {"glass", "orchards", "author", "1887"}
