"""How much of the base model's next-token distribution an anchor's top-k targets keep.

    python docs/profiles/top_k_mass.py 32

SmolLM2-135M-Instruct in fp32, on the response positions of the e2e test's 12 held-out ShareGPT replies
(tests/server/test_online.py): the probability mass of the k most likely tokens per position (mean, median, p10).
"""

import sys

import torch

from alchemist.model.loader import load_model
from alchemist.training.losses import log_probs
from alchemist.training.recompute import responses_hidden_slices
from alchemist.training.slices import run_to_end
from tests.server.test_online import held_out_replies

k = int(sys.argv[1]) if len(sys.argv) > 1 else 32
loaded = load_model(None, dtype="float32", device="cpu")
model, tok = loaded.model, loaded.tokenizer
masses = []
with torch.no_grad():
    for s in held_out_replies(tok):
        prompt, reply = torch.tensor(tok.apply_chat_template(s.messages)), torch.tensor(tok.encode_reply(s.reply))
        (hidden,) = run_to_end(responses_hidden_slices(model, None, [(prompt, reply)]))
        masses.append(log_probs(model.logits(hidden)).topk(k, -1).values.exp().sum(-1))
mass = torch.cat(masses)
summary = f"mean {mass.mean():.3f}, median {mass.median():.3f}, p10 {mass.quantile(0.1):.3f}"
print(f"top-{k} mass over {len(mass)} positions: {summary}")
