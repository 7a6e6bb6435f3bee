"""CUDA checks of serving, recording, replay and the online trainer (run on a GPU machine; not part of CI, which
has no GPU):

    python -m tests.cuda.check_system            # on the GPU
    python -m tests.cuda.check_system --device cpu   # the same checks on the CPU (they check themselves)

The exactness guarantees of the CPU test suite, on the device: the attention kernels that give and take the lse
against the CPU flash kernels; replay gradients equal recompute gradients (tiny configs, a prompt prefilled alone
and inside a batched, chunked prefill; a SmolLM2-shaped model); samples trained together land where one at a time
does; records that went down to pinned host memory and disk replay to the same gradients bit for bit; the engine's
batched, chunked outputs equal each request alone, records made in the engine replay exactly, a merged adapter
serves the same tokens as the separate delta; the online trainer trains, publishes, checkpoints and resumes. Each
check prints one line; the exit status is the number of failed checks.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from alchemist.activations.store import ActivationStore
from alchemist.bench.training import make_steps, record_prefill
from alchemist.config import EngineConfig, OnlineConfig, RecordConfig
from alchemist.config.training import QueueConfig, StoppingConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.feedback.sqlite_log import SQLiteFeedbackLog
from alchemist.model import flash
from alchemist.model.attention import bottom_right_causal_mask
from alchemist.model.loader import build_model
from alchemist.model.lora import LoraAdapter
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.slices import run_to_end as run_slices
from alchemist.training.trainer import Sample, Trainer, TrainerConfig
from tests.engine.helpers import char_tokenizer, random_adapter, random_prompts, run_to_end
from tests.tiny_models import TINY_VARIANTS, make_tiny_hf_dir
from tests.training.recording import record_batched_chunked
from tests.training.test_online import beside, drain, serve_and_log
from tests.training.test_replay import flat, lora_with_nonzero_b, max_rel_l2, recompute_grads, replay_grads

CHECKS: list[Callable[[Context], str]] = []


class Context:
    def __init__(self, device: torch.device, root: Path) -> None:
        self.device, self.root = device, root
        self.tiny = {v: make_tiny_hf_dir(root / "tiny", v) for v in sorted(TINY_VARIANTS)}
        self.smol = _smollm2_shaped(root / "smol")

    def model(self, hf_dir: Path, dtype: torch.dtype = torch.float32):
        return build_model(hf_dir, dtype, self.device)

    def ids(self, n: int, seed: int, vocab: int = 256) -> torch.Tensor:
        return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).to(self.device)


def check(fn: Callable[[Context], str]) -> Callable[[Context], str]:
    CHECKS.append(fn)
    return fn


def _smollm2_shaped(root: Path) -> Path:
    """A random model with SmolLM2-135M's shapes (the real weights are a 98 MB file that does not travel)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(root, safe_serialization=True)
    return root


def _on(adapter, device):
    moved = copy.deepcopy(adapter).to(device)
    moved.version = adapter.version
    return moved


def _whole_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Relative L2 error of the whole gradient (all tensors as one vector)."""
    return ((flat(got) - flat(want)).norm() / flat(want).norm()).item()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1.0)).item()


@check
def flash_kernels(ctx: Context) -> str:
    """Explicit-score kernels on the device vs the CPU flash kernels on the CPU, forward and backward."""
    worst = {}
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for heads, kv_heads, lq, lk, causal, masked in ((9, 3, 300, 300, True, False), (9, 3, 7, 290, False, False),
                                                        (4, 2, 33, 90, False, True)):  # fmt: skip
            g = torch.Generator().manual_seed(lq)
            q, k, v, d_out = (torch.randn(1, h, n, 64, generator=g).to(dtype) for h, n in
                              ((heads, lq), (kv_heads, lk), (kv_heads, lk), (heads, lq)))  # fmt: skip
            mask = bottom_right_causal_mask(lq, lk, dtype, q.device) if masked else None
            kw = dict(causal=causal, scale=64**-0.5)
            want = flash.forward(q, k, v, mask=mask, **kw)
            dev = [t.to(ctx.device) for t in (q, k, v, d_out)]
            got = flash.forward(*dev[:3], mask=None if mask is None else mask.to(ctx.device), **kw)
            errs = [_rel(x, y) for x, y in zip(got, want, strict=True)]
            if not masked:
                want_g = flash.backward(d_out, q, k, v, *want, **kw)
                got_g = flash.backward(dev[3], *dev[:3], *got, **kw)
                errs += [_rel(x, y) for x, y in zip(got_g, want_g, strict=True)]
            assert all(x.device.type == ctx.device.type for x in got)
            worst[dtype] = max(worst.get(dtype, 0.0), *errs)
            assert max(errs) <= tol, (dtype, heads, lq, lk, errs)
    return "worst relative L2 vs CPU: " + ", ".join(f"{str(d)[6:]} {e:.1e}" for d, e in worst.items())


@check
def replay_equals_recompute_tiny(ctx: Context) -> str:
    worst = 0.0
    for variant, hf_dir in ctx.tiny.items():
        model = ctx.model(hf_dir)
        cpu_adapter = lora_with_nonzero_b(build_model(hf_dir, torch.float32))
        adapter = _on(cpu_adapter, ctx.device)
        prompt, response = ctx.ids(45, 3), ctx.ids(13, 4)
        others = [ctx.ids(30, 5), ctx.ids(7, 6)]
        for record in (record_prefill(model, adapter, prompt, torch.float32, "r"),
                       record_batched_chunked(model, adapter, prompt, others, chunk=16)):  # fmt: skip
            assert record.layers[0]["lse"].device.type == ctx.device.type
            _, want = recompute_grads(model, adapter, prompt, response)
            _, got = replay_grads(model, adapter, record, prompt, response)
            err = max_rel_l2(want, got)
            worst = max(worst, err)
            assert err <= 1e-5, (variant, err)
        # The device's recompute gradients against the CPU's (fp32 both; TF32 is off for matmuls by default).
        cpu_model = build_model(hf_dir, torch.float32)
        _, on_cpu = recompute_grads(cpu_model, cpu_adapter, prompt.cpu(), response.cpu())
        assert max_rel_l2(on_cpu, {k: v.cpu() for k, v in want.items()}) <= 1e-4, variant
    return f"{len(ctx.tiny)} variants x 2 prefills, worst replay vs recompute relative L2 {worst:.1e}"


@check
def replay_equals_recompute_smollm2_shaped(ctx: Context) -> str:
    model = ctx.model(ctx.smol)
    adapter = _on(lora_with_nonzero_b(model), ctx.device)
    prompt, response = ctx.ids(300, 7, 49152), ctx.ids(64, 8, 49152)
    _, want = recompute_grads(model, adapter, prompt, response)
    _, got = replay_grads(model, adapter, record_prefill(model, adapter, prompt, torch.float32), prompt, response)
    err = max_rel_l2(want, got)
    assert err <= 1e-5, err
    _, bf16 = replay_grads(model, adapter, record_prefill(model, adapter, prompt, torch.bfloat16), prompt, response)
    bf16_err = _whole_rel(bf16, want)
    assert bf16_err <= 0.05, bf16_err
    return f"P=300 R=64: fp32 records {err:.1e} (max over tensors), bf16 records {bf16_err:.2%} (whole gradient)"


@check
def groups_equal_one_at_a_time(ctx: Context) -> str:
    model = ctx.model(ctx.tiny["llama-gqa-untied"])
    adapter = _on(lora_with_nonzero_b(model), ctx.device)  # built on the CPU (its seed), moved
    store = ActivationStore(1 << 30)
    samples = []
    for i, (p, r) in enumerate(((40, 9), (1, 12), (25, 1), (33, 7))):
        prompt = ctx.ids(p, 10 + i)
        if i != 2:  # one sample without a record: recomputed inside the group
            store.put(record_prefill(model, adapter, prompt, torch.float32, f"s{i}"))
        samples.append(Sample(prompt.tolist(), ctx.ids(r, 20 + i).tolist(), record_id=f"s{i}"))
    grads = []
    for group_size in (1, 4):
        trainer = Trainer(model, _on(adapter, ctx.device), store, TrainerConfig(group_size=group_size))
        results = run_slices(trainer.backward_slices(samples, [0.25] * 4))
        assert [replayed for _, replayed in results] == [True, True, False, True]
        grads.append({n: p.grad for n, p in trainer.adapter.named_parameters()})
    err = max_rel_l2(grads[0], grads[1])
    assert err <= 1e-5, err
    return f"4 samples (one recomputed) in a group vs one at a time: gradients' relative L2 {err:.1e}"


@check
def tiered_records_replay_bit_exactly(ctx: Context) -> str:
    model = ctx.model(ctx.tiny["llama-gqa-untied"])
    adapter = _on(lora_with_nonzero_b(model), ctx.device)  # built on the CPU (its seed), moved
    prompt, response = ctx.ids(40, 30), ctx.ids(10, 31)
    sample = Sample(prompt.tolist(), response.tolist(), record_id="resp")
    lines = []
    for dtype in (torch.float32, torch.bfloat16):
        in_memory = ActivationStore(1 << 30)
        in_memory.put(record_prefill(model, adapter, prompt, dtype, "resp"))
        want = _grads(model, adapter, in_memory, sample)
        for tier in ("host", "disk"):
            record = record_prefill(model, adapter, prompt, dtype, "resp")
            size = record.nbytes
            budgets = {"host": (size, size + size // 4, 0), "disk": (size, size + size // 4, 10 * size)}[tier]
            with tempfile.TemporaryDirectory(dir=ctx.root) as tmp:
                store = ActivationStore(budgets[0], host_budget_bytes=budgets[1], disk_budget_bytes=budgets[2],
                                        disk_dir=tmp)  # fmt: skip
                store.put(record)
                store.put(record_prefill(model, adapter, prompt[:30], dtype, "later"))
                store.flush()
                assert store.tier_of("resp") == tier, store.tier_of("resp")
                if ctx.device.type == "cuda" and tier == "host":
                    assert all(t.is_pinned() for t in store._placement.entries["resp"].record.layers[0].values())
                got = _grads(model, adapter, store, sample)
                assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (dtype, tier)
                store.close()
            lines.append(f"{str(dtype)[6:]} {tier}")
    return "gradients bitwise equal to in-memory records: " + ", ".join(lines)


def _grads(model, adapter, store, sample) -> list[torch.Tensor]:
    trainer = Trainer(model, _on(adapter, model.device), store)
    ((_, replayed),) = run_slices(trainer.backward_slices([sample], [1.0]))
    assert replayed
    return [p.grad.clone() for p in trainer.adapter.parameters()]


def _engine(model, policy="none", record_dtype="float32", **fields) -> LLMEngine:
    config = EngineConfig(**{"max_num_seqs": 4, "max_model_len": 256, "max_num_batched_tokens": 32, **fields})
    return LLMEngine(model, char_tokenizer(), config, RecordConfig(policy=policy, dtype=record_dtype))


@check
def engine_batched_chunked_equals_alone(ctx: Context) -> str:
    model = ctx.model(ctx.tiny["llama-gqa-untied"])
    prompts = random_prompts([70, 9, 33, 50], seed=0)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    engine = _engine(model)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy)
    together = {rid: outs[-1].output_token_ids for rid, outs in run_to_end(engine).items()}
    for i, p in enumerate(prompts):
        alone = _engine(model, max_num_batched_tokens=256)
        alone.add_request("a", p, greedy)
        assert run_to_end(alone)["a"][-1].output_token_ids == together[f"r{i}"], i
    return f"{len(prompts)} requests, chunks of 32 tokens, {greedy.max_tokens} greedy tokens each"


@check
def engine_records_replay_and_merge(ctx: Context) -> str:
    hf_dir = ctx.tiny["llama-gqa-untied"]
    model = ctx.model(hf_dir)
    engine = _engine(model, policy="all")
    prompts = random_prompts([70, 9, 33], seed=1)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=5, ignore_eos=True))
    run_to_end(engine)
    assert engine.store.stats.records == 3
    adapter = LoraAdapter(model.config, device=ctx.device, seed=0)  # B = 0: the delta the engine served (none)
    for i, p in enumerate(prompts):
        record = engine.store.lookup(f"r{i}")
        assert record.layers[0]["qkv"].device.type == ctx.device.type
        response = ctx.ids(9, 40 + i)
        _, want = recompute_grads(model, adapter, torch.tensor(p, device=ctx.device), response)
        _, got = replay_grads(model, adapter, record, torch.tensor(p, device=ctx.device), response)
        assert max_rel_l2(want, got) <= 1e-5, i
    # A served adapter, merged one layer per step, gives the tokens of the separate delta.
    served = random_adapter(model, 11)  # on the CPU; set_adapter moves it
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outputs = []
    for merge in (True, False):
        e = _engine(model, merge_adapter=merge)
        e.set_adapter(served, 1)
        e.add_request("warm", prompts[1], greedy)
        run_to_end(e)
        assert e.runner.merged is None or e.runner.merged.complete == merge
        e.add_request("x", prompts[0], greedy)
        outputs.append(run_to_end(e)["x"][-1].output_token_ids)
    assert outputs[0] == outputs[1]
    return "3 records made in the engine replay exactly; merged and separate-delta greedy tokens equal"


@check
def engine_bf16_records_and_merge(ctx: Context) -> str:
    """The serving configuration on a GPU: a bf16 model, bf16 records, a merged adapter."""
    model = ctx.model(ctx.smol, torch.bfloat16)
    engine = LLMEngine(model, char_tokenizer(), EngineConfig(max_num_seqs=4, max_model_len=512,
                       max_num_batched_tokens=256), RecordConfig(policy="all"))  # fmt: skip
    adapter = _on(lora_with_nonzero_b(model), ctx.device)
    engine.set_adapter(adapter, 1)
    prompts = random_prompts([300, 120, 40], seed=2, vocab=256)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=32, ignore_eos=True, temperature=0))
    outs = run_to_end(engine)
    elapsed = time.perf_counter() - t0
    assert all(len(o[-1].output_token_ids) == 32 for o in outs.values())
    assert engine.runner.merged is not None and engine.runner.merged.complete
    record = engine.store.lookup("r0")
    assert record is not None and record.layers[0]["qkv"].dtype == torch.bfloat16
    prompt, response = torch.tensor(prompts[0], device=ctx.device), ctx.ids(32, 50, 256)
    trainer = Trainer(model, _on(adapter, ctx.device), engine.store)
    sample = Sample(prompts[0], response.tolist(), record_id="r0")
    ((loss, replayed),) = run_slices(trainer.backward_slices([sample], [1.0]))
    assert replayed and loss == loss
    _, want = recompute_grads(model, _on(adapter, ctx.device), prompt, response)
    got = {n: p.grad for n, p in trainer.adapter.named_parameters()}
    err = _whole_rel(got, want)
    assert err <= 0.1, err
    return f"3 requests in {elapsed:.2f}s; bf16 replay vs bf16 recompute gradient relative L2 {err:.2%}"


@check
def online_trainer_trains_publishes_resumes(ctx: Context) -> str:
    model = ctx.model(ctx.tiny["llama-gqa-untied"])
    engine = _engine(model, policy="all")
    with tempfile.TemporaryDirectory(dir=ctx.root) as tmp:
        tmp = Path(tmp)
        log = SQLiteFeedbackLog(tmp / "feedback.sqlite")
        checkpoints = AdapterCheckpoints(tmp / "adapters", keep=50)
        config = OnlineConfig(queue=QueueConfig(batch_size=2, max_wait_s=0.0), stopping=StoppingConfig(epochs=2),
                              trainer=TrainerConfig(lr=1e-2))  # fmt: skip
        trainer = beside(engine, log, checkpoints, config)
        seqs = serve_and_log(engine, log, 5)
        drain(trainer)
        versions = checkpoints.versions()
        assert [v.metrics["seqs"] for v in versions] == [seqs[0:2], seqs[2:4], seqs[4:5]]
        assert engine.adapter_version == 6 and trainer.stats.replayed > 0
        assert next(trainer.adapter.parameters()).device.type == ctx.device.type
        # A restart resumes from the last checkpoint: its adapter, its position, nothing left to train.
        resumed = beside(_engine(model, policy="all"), log, AdapterCheckpoints(tmp / "adapters", keep=50), config)
        assert resumed.position == seqs[-1] and not resumed.has_work()
        for a, b in zip(resumed.adapter.parameters(), trainer.adapter.parameters(), strict=True):
            assert torch.equal(a, b)
        replayed = trainer.stats.replayed
        log.close()
    return f"5 feedback, 3 batches, 6 versions published; {replayed} of 10 sample passes replayed; resumed exactly"


@check
def tiers_round_trip(ctx: Context) -> str:
    if ctx.device.type != "cuda":
        return "skipped (CUDA only: pinned host memory, side streams)"
    from tests.cuda.check_tiers import check_round_trip

    for dtype in (torch.bfloat16, torch.float32):
        with tempfile.TemporaryDirectory(dir=ctx.root) as tmp:
            check_round_trip(Path(tmp), dtype)
    return "device -> pinned host -> disk, bf16 and fp32, bit-exact"


def time_steps(ctx: Context, shapes: list[str], repeats: int = 5) -> None:
    """Not a check: step and prefill times (medians of interleaved repeats) of the SmolLM2-shaped model in bf16
    with bf16 records, as `alchemist bench train` measures them on the CPU."""
    model = ctx.model(ctx.smol, torch.bfloat16)
    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else lambda: None
    print("shape      recompute ms  replay ms  ratio  prefill ms  recording +%")
    for shape in shapes:
        num_prompt, num_response = map(int, shape.split("x"))
        steps = make_steps(model, num_prompt, num_response, torch.bfloat16)
        times: dict[str, list[float]] = {}
        for i in range(repeats + 2):
            for name, fn in steps.items():
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                if i >= 2:  # two warm-ups
                    times.setdefault(name, []).append(time.perf_counter() - t0)
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        overhead = ms["prefill_rec_bf16"] / ms["prefill"] - 1
        print(f"{shape:10} {ms['recompute']:12.1f} {ms['replay']:10.1f} {ms['recompute'] / ms['replay']:6.2f} "
              f"{ms['prefill']:11.1f} {overhead:+13.1%}", flush=True)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", nargs="*", help="names of the checks to run (default: all)")
    parser.add_argument("--time", nargs="*", default=[], metavar="PxR", help="also time steps at these shapes")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device")
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    failed = 0
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        ctx = Context(device, Path(root))
        print(f"models made in {time.perf_counter() - t0:.1f}s", flush=True)
        for fn in CHECKS:
            if args.only and fn.__name__ not in args.only:
                continue
            t0 = time.perf_counter()
            try:
                said = fn(ctx)
                line = f"ok   {fn.__name__} ({time.perf_counter() - t0:.1f}s): {said}"
            except Exception:  # every check runs; each failure is reported with its traceback
                failed += 1
                line = f"FAIL {fn.__name__} ({time.perf_counter() - t0:.1f}s)\n{traceback.format_exc()}"
            print(line, flush=True)
        if args.time:
            time_steps(ctx, args.time)
    print(f"{len(CHECKS) - failed if not args.only else '-'} passed, {failed} failed", flush=True)
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
