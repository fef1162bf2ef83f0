"""Generation throughput: vLLM (rl-vllm, one engine in its own venv) against Hugging Face generation.

Both decode the same prompts greedily with the same locally built, randomly initialised model
(default: Qwen2, hidden 512, 10 layers, 8 heads of 64, about 31M parameters) in float32, on the
same number of CPU threads. The Hugging Face side is the project's own HF backend
(`rl_dtensor.sampling.generate_batch`, batched with a KV cache, in this process); the vLLM side is
`rl_vllm.generation.VllmGeneration` with one engine on a Ray bundle of that many CPUs. Prints the
generated tokens per second of each (after a warm-up; the best of `--rounds` alternating timed
runs, so that background load on a shared machine hits both alike), their ratio, and how many rows
the two decoded identically.

    .venv/bin/python benchmarks/generation_throughput.py [--prompts 64 --new-tokens 256 --threads 2 --rounds 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_algos.models.tiny import arithmetic_corpus, build_tiny_causal_lm, build_tokenizer
from rl_core.data import BatchedDataDict
from rl_core.policy.config import SamplingConfig
from rl_dtensor.sampling import generate_batch

if importlib.util.find_spec("rl_vllm") is None:  # a dev venv synced before rl-vllm was a dependency
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "rl-vllm" / "src"))


def build_model(root: Path, hidden: int, layers: int, heads: int, kv_heads: int, max_len: int) -> Path:
    build_tokenizer(arithmetic_corpus(), vocab_size=384, out_dir=root / "tokenizer")
    return build_tiny_causal_lm(
        root / "tokenizer",
        root / "model",
        arch="qwen2",
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=3 * hidden,
        max_position_embeddings=max_len,
    )


def make_prompts(tokenizer: Any, count: int, length: int) -> BatchedDataDict[Any]:
    """`count` prompts of `length` tokens cut from the arithmetic corpus (all the same length)."""
    text = " ".join(arithmetic_corpus(count * 4, seed=7))
    ids = tokenizer(text)["input_ids"]
    rows = [ids[i * length : (i + 1) * length] for i in range(count)]
    return BatchedDataDict(input_ids=torch.tensor(rows), input_lengths=torch.full((count,), length))


def generated(out: BatchedDataDict[Any]) -> list[list[int]]:
    rows = []
    for row in range(out.size):
        end = int(out["unpadded_sequence_lengths"][row])
        rows.append(out["output_ids"][row, end - int(out["generation_lengths"][row]) : end].tolist())
    return rows


class HfGenerator:
    """Greedy batched generation with the project's HF backend (KV cache), in this process."""

    name = "HF generation"

    def __init__(self, model_dir: Path, new_tokens: int, max_len: int) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.sampling = SamplingConfig(max_new_tokens=new_tokens)
        self.max_len = max_len

    def generate(self, data: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
        ids, lengths = data["input_ids"], data["input_lengths"]
        return BatchedDataDict(
            generate_batch(self.model, self.tokenizer, ids, lengths, self.sampling, self.max_len, greedy=True)
        )

    def shutdown(self) -> None:
        pass


class VllmGenerator:
    """Greedy generation with one rl-vllm engine (its own venv) on a Ray bundle of `threads` CPUs."""

    name = "vLLM generation"

    def __init__(self, model_dir: Path, new_tokens: int, max_len: int, threads: int, compiled: bool) -> None:
        from rl_core.distributed import RayVirtualCluster, init_ray
        from rl_vllm.generation import VllmGeneration

        init_ray(num_cpus=threads, num_gpus=0)
        self.cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=threads, name="bench-vllm")
        started = time.perf_counter()
        config = {
            "model_name": str(model_dir),
            "max_total_sequence_length": max_len,
            "max_new_tokens": new_tokens,
            "enforce_eager": not compiled,
        }
        self.engine = VllmGeneration(self.cluster, config, env_vars={"OMP_NUM_THREADS": str(threads)})
        self.startup_s = time.perf_counter() - started

    def generate(self, data: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
        return self.engine.generate(data, greedy=True)

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.cluster.shutdown()


def timed(generator: HfGenerator | VllmGenerator, data: BatchedDataDict[Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = generator.generate(data)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument(
        "--heads",
        type=int,
        default=8,
        help="hidden / heads must be a head size vLLM's CPU attention supports",
    )
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="timed runs of each backend, alternating; the fastest of each counts (robust to a shared machine)",
    )
    parser.add_argument(
        "--vllm-eager",
        action="store_true",
        help="run vLLM eager (rl-vllm's CPU default: faster start-up) instead of compiled",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    max_len = args.prompt_tokens + args.new_tokens

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp), args.hidden, args.layers, args.heads, args.kv_heads, max_len)
        params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(model_dir)).parameters())
        data = make_prompts(AutoTokenizer.from_pretrained(str(model_dir)), args.prompts, args.prompt_tokens)
        print(
            f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
            f"({params / 1e6:.1f}M parameters), float32; {args.prompts} prompts x {args.prompt_tokens} tokens, "
            f"up to {args.new_tokens} new tokens each, greedy; {args.threads} CPU threads; "
            f"best of {args.rounds} alternating rounds",
            flush=True,
        )
        hf = HfGenerator(model_dir, args.new_tokens, max_len)
        vllm = VllmGenerator(model_dir, args.new_tokens, max_len, args.threads, compiled=not args.vllm_eager)
        print(f"vLLM engine start-up: {vllm.startup_s:.0f} s (not counted)", flush=True)
        rates: dict[str, float] = {}
        outputs: dict[str, Any] = {}
        try:
            for generator in (hf, vllm):
                generator.generate(data.slice(0, 4))  # warm-up
            for round_index in range(args.rounds):
                for generator in (hf, vllm):
                    seconds, out = timed(generator, data)
                    tokens = int(out["generation_lengths"].sum())
                    print(
                        f"round {round_index + 1} {generator.name:16s} {tokens} tokens in {seconds:7.2f} s "
                        f"= {tokens / seconds:8.1f} tokens/s",
                        flush=True,
                    )
                    rates[generator.name] = max(rates.get(generator.name, 0.0), tokens / seconds)
                    outputs[generator.name] = out
        finally:
            vllm.shutdown()
        hf_rate, vllm_rate = rates[hf.name], rates[vllm.name]
        same = sum(a == b for a, b in zip(generated(outputs[hf.name]), generated(outputs[vllm.name])))
        print(f"HF generation:   {hf_rate:8.1f} tokens/s (best round)")
        print(f"vLLM generation: {vllm_rate:8.1f} tokens/s (best round)")
        print(
            f"ratio vLLM / HF: {vllm_rate / hf_rate:.2f}x; identical greedy outputs: {same}/{args.prompts} rows"
        )


if __name__ == "__main__":
    main()
