"""Profile (not a benchmark): the protected directions' eigendecompositions in fp64 against fp32.

    OMP_NUM_THREADS=1 python docs/profiles/protected_eigh.py

The default model in bf16 (as served here) through the ordinary chats, each seam's second moment summed as
``alchemist.training.protected`` sums it; then per seam ``torch.linalg.eigh`` in fp64 and in fp32, timed, and the
cut at 0.97 of the energy: whether k differs, how much of the moment's energy the fp32 subspace holds against the
fp64 one (relative), and the seams whose two subspaces differ most (1 - the cosine of the largest principal angle),
with the eigenvalues either side of the cut (relative to the largest).
"""

import json
import time

import torch

from alchemist.model.loader import build_model, hf_dir_for
from alchemist.model.lora import LoraAdapter
from alchemist.model.tokenizer import Tokenizer
from alchemist.training import protected
from alchemist.training.recompute import responses_hidden_slices
from alchemist.training.slices import run_to_end

ENERGY = 0.97  # TrainerConfig's protect_energy default

model = build_model(hf_dir_for(None), torch.bfloat16)
tokenizer = Tokenizer.from_pretrained(hf_dir_for(None))
adapter = LoraAdapter(model.config)
chats = json.loads(protected.ORDINARY_FILE.read_text())
pairs = [(torch.tensor(tokenizer.user_prompt(c["user"])), torch.tensor(tokenizer.encode_reply(c["assistant"])))
         for c in chats]  # fmt: skip
moments = protected._Moments(set(adapter.A.keys()))
with torch.no_grad():
    for start in range(0, len(pairs), 16):
        run_to_end(responses_hidden_slices(model, moments, pairs[start : start + 16]))


def cut(values: torch.Tensor) -> int:
    held = values.cumsum(0) / values.sum()
    return min(int((held < ENERGY).sum()) + 1, len(values))


seconds = {"fp64": 0.0, "fp32": 0.0}
k_differ, worst_energy, angles = 0, 0.0, []
for key, moment in moments.sums.items():
    m = moment.double()
    start = time.perf_counter()
    values64, vectors64 = torch.linalg.eigh(m)
    seconds["fp64"] += time.perf_counter() - start
    start = time.perf_counter()
    values32, vectors32 = torch.linalg.eigh(moment.float())
    seconds["fp32"] += time.perf_counter() - start
    values = values64.flip(0).clamp(min=0)
    k = cut(values)
    k_differ += k != cut(values32.double().flip(0).clamp(min=0))
    a, b = vectors64.flip(1)[:, :k], vectors32.flip(1)[:, :k].double()
    held64, held32 = float(torch.trace(a.t() @ m @ a)), float(torch.trace(b.t() @ m @ b))
    worst_energy = max(worst_energy, abs(held64 - held32) / held64)
    cosine = float(torch.linalg.svdvals(a.t() @ b).min())
    angles.append((1 - cosine, key, k, float(values[k - 1] / values[0]), float(values[k] / values[0])))
print(f"{len(moments.sums)} seams: eigh fp64 {seconds['fp64']:.1f} s, fp32 {seconds['fp32']:.1f} s; "
      f"k differs at {k_differ}; energy held, worst relative difference {worst_energy:.1e}")
for angle, key, k, before, after in sorted(angles, reverse=True)[:5]:
    print(f"  {key}: 1 - cos {angle:.3f} at k={k}, eigenvalues either side of the cut {before:.3e} {after:.3e}")
