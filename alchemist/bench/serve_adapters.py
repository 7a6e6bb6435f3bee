"""The named adapters of `alchemist bench serve --adapters K ...` (issue 44): random PEFT LoRA adapters a0, a1, ...,
made once and served by name, ours and any peer's (vLLM: ``--enable-lora --max-loras 16 --max-lora-rank 16``).

    python -m alchemist.bench.serve_adapters DIR [NUM] [--model-path PATH]   # writes DIR/a0.. (default 16 of them)
                                                                             # and prints the --lora-modules args

Each adapter is rank 16 (alpha 32) on every projection PEFT names for a Llama (q, k, v, o, gate, up, down), A as
PEFT initializes it and B drawn from a normal of std ``B_STD``, both from the adapter's own fixed seed: the same
directory every time, and non-zero, so that the adapters change the answers (PEFT's zero B would leave the base
model's). Written by our PEFT writer (``model/peft_format.py``), which PEFT and vLLM read.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

RANK = 16
ALPHA = 32.0
B_STD = 0.02
SEED = 44  # adapter i draws from SEED + i


def adapter_name(i: int) -> str:
    return f"a{i}"


def make_adapters(directory: Path, num_adapters: int, model_path: str | None = None) -> list[tuple[str, Path]]:
    """Writes adapters a0..a{num_adapters-1} for the model at ``model_path`` (default: SmolLM2-135M-Instruct) under
    ``directory``, replacing any of those names; (name, its directory) each."""
    import torch

    from alchemist.model.loader import hf_dir_for, read_config
    from alchemist.model.lora import ALL_TARGETS, LoraAdapter, LoraConfig
    from alchemist.model.peft_format import save_adapter

    hf_dir = hf_dir_for(model_path)
    model_config = read_config(hf_dir)
    config = LoraConfig(r=RANK, alpha=ALPHA, target_modules=ALL_TARGETS)
    adapters = []
    for i in range(num_adapters):
        adapter = LoraAdapter(model_config, config, seed=SEED + i)
        g = torch.Generator().manual_seed(SEED + i)
        with torch.no_grad():
            for b in adapter.B.values():
                b.copy_(torch.randn(b.shape, generator=g) * B_STD)
        name = adapter_name(i)
        save_adapter(adapter, Path(directory) / name, base_model_name_or_path=str(hf_dir))
        adapters.append((name, Path(directory) / name))
    return adapters


def lora_modules(adapters: list[tuple[str, Path]]) -> list[str]:
    """The NAME=PATH arguments of ``--lora-modules`` (ours and vLLM's) that serve ``adapters``."""
    return [f"{name}={path.resolve()}" for name, path in adapters]


def prepare(num_adapters: int, adapters_dir: str | None, model_path: str | None) -> tuple[Path, list[str]]:
    """`bench serve --adapters`' adapters, written into ``adapters_dir`` (else a temporary directory, the caller's
    to remove): (the directory, `alchemist serve`'s arguments that hold them all in the engine). Prints the
    ``--lora-modules`` arguments that serve them, for a peer."""
    directory = Path(adapters_dir or tempfile.mkdtemp(prefix="alchemist-adapters-"))
    modules = lora_modules(make_adapters(directory, num_adapters, model_path))
    kept = " (temporary: removed at the end; keep them with --adapters-dir)" if adapters_dir is None else ""
    print(f"# {num_adapters} adapters (rank {RANK}, every projection) in {directory}{kept}; a peer serves them with: "
          f"--enable-lora --max-loras {num_adapters} --max-lora-rank {RANK} --lora-modules {' '.join(modules)}",
          file=sys.stderr)  # fmt: skip
    # Every adapter stays in the engine: the levels measure serving many, not paging them in and out.
    return directory, ["--lora-modules", *modules, "--max-loras", str(num_adapters)]


def check_served(base_url: str, api_key: str, names: list[str]) -> None:
    """ValueError unless GET /models of the server at ``base_url`` lists every adapter of ``names``."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=2, timeout=30)
    try:
        served = {m.id for m in client.models.list().data}
    except openai.OpenAIError as e:
        raise ValueError(f"--base-url {base_url}: GET /models failed ({type(e).__name__}: {e})") from e
    missing = [name for name in names if name not in served]
    if missing:
        raise ValueError(
            f"--base-url {base_url} does not serve the adapters {', '.join(missing)} (GET /models lists "
            f"{', '.join(sorted(served)) or 'nothing'}); start it with the --lora-modules printed above (vLLM: "
            f"--enable-lora --max-loras {len(names)} --max-lora-rank {RANK} --lora-modules ...)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("num_adapters", type=int, nargs="?", default=16)
    parser.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct")
    args = parser.parse_args(argv)
    print("--lora-modules " + " ".join(lora_modules(make_adapters(args.directory, args.num_adapters, args.model_path))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
