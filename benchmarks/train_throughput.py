"""Training throughput of `DTensorPolicyWorker.train()` (1 rank) against a plain PyTorch loop.

Both run the same Hugging Face model (built locally, randomly initialised), the same batch, the
same token-level NLL loss, AdamW and gradient clipping; the plain loop is the textbook
forward / backward / clip / step. Prints tokens per second of each and their ratio
(worker / plain; the goal is >= 0.8).

    .venv/bin/python benchmarks/train_throughput.py [--hidden 256 --layers 4 --batch 16 --seq 256 --threads 1]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from rl_algos.models.tiny import arithmetic_corpus, build_tiny_causal_lm, build_tokenizer
from rl_core.data import BatchedDataDict
from rl_core.interfaces import LossType
from rl_dtensor.worker import DTensorPolicyWorker


class NLLLoss:
    loss_type = LossType.TOKEN_LEVEL

    def __call__(
        self,
        logits: torch.Tensor,
        data: Any,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        logprobs = torch.log_softmax(logits.float()[:, :-1], dim=-1)
        picked = logprobs.gather(-1, data["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
        mask = data["token_mask"][:, 1:].float() * data["sample_mask"].float()[:, None]
        return -(picked * mask).sum() / global_valid_toks, {}


def make_batch(vocab: int, batch: int, seq: int, seed: int = 0) -> BatchedDataDict[Any]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=generator)
    lengths[0] = seq
    ids = torch.randint(5, vocab, (batch, seq), generator=generator)
    valid = torch.arange(seq)[None, :] < lengths[:, None]
    return BatchedDataDict(
        input_ids=torch.where(valid, ids, torch.zeros_like(ids)),
        input_lengths=lengths,
        token_mask=valid.long(),
        sample_mask=torch.ones(batch),
    )


def plain_loop(model_dir: Path, data: BatchedDataDict[Any], steps: int, warmup: int, lr: float) -> float:
    """Seconds per step of a plain single-process loop."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_fn = NLLLoss()
    mask = (torch.arange(data["input_ids"].shape[1])[None, :] < data["input_lengths"][:, None]).long()
    valid_toks = (data["token_mask"][:, 1:].float() * data["sample_mask"][:, None]).sum()
    elapsed = 0.0
    for step in range(warmup + steps):
        start = time.perf_counter()
        logits = model(input_ids=data["input_ids"], attention_mask=mask).logits
        loss, _ = loss_fn(logits, data, data["sample_mask"].sum(), valid_toks)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss.detach())
        if step >= warmup:
            elapsed += time.perf_counter() - start
    return elapsed / steps


def worker_loop(model_dir: Path, data: BatchedDataDict[Any], steps: int, warmup: int, lr: float) -> float:
    """Seconds per optimiser step of `DTensorPolicyWorker.train` (one step per call)."""
    batch = data.size
    worker = DTensorPolicyWorker(
        {
            "model_name": str(model_dir),
            "max_total_sequence_length": data["input_ids"].shape[1],
            "train_global_batch_size": batch,
            "train_micro_batch_size": batch,
            "optimizer": {"name": "adamw", "kwargs": {"lr": lr}},
            "max_grad_norm": 1.0,
            "reference_model": False,
        }
    )
    elapsed = 0.0
    for step in range(warmup + steps):
        start = time.perf_counter()
        worker.train(data, NLLLoss(), gbs=batch, mbs=batch)
        if step >= warmup:
            elapsed += time.perf_counter() - start
    return elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    # One thread by default: on a shared 2-core machine, two threads per process make both
    # timings swing with whatever else runs; pass 0 for torch's own choice.
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir, model_dir = Path(tmp) / "tokenizer", Path(tmp) / "model"
        tokenizer = build_tokenizer(arithmetic_corpus(), 1024, tokenizer_dir)
        build_tiny_causal_lm(
            tokenizer_dir,
            model_dir,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=max(args.hidden // 64, 1),
            num_kv_heads=max(args.hidden // 128, 1),
            intermediate_size=args.hidden * 3,
            max_position_embeddings=max(args.seq, 512),
        )
        data = make_batch(len(tokenizer), args.batch, args.seq)
        tokens = int(data["input_lengths"].sum())
        # Interleave the two so machine-load drift hits both alike.
        plain_times, worker_times = [], []
        for _ in range(2):
            plain_times.append(plain_loop(model_dir, data, args.steps, args.warmup, 1e-4))
            worker_times.append(worker_loop(model_dir, data, args.steps, args.warmup, 1e-4))
        plain_tps = tokens / min(plain_times)
        worker_tps = tokens / min(worker_times)
        params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(model_dir)).parameters())
        print(
            f"model: {params / 1e6:.2f}M params (hidden {args.hidden}, {args.layers} layers), "
            f"batch {args.batch} x {args.seq} ({tokens} real tokens), threads {torch.get_num_threads()}"
        )
        print(f"plain PyTorch loop : {plain_tps:10.0f} tokens/s")
        print(f"DTensorPolicyWorker: {worker_tps:10.0f} tokens/s")
        print(f"ratio (worker / plain): {worker_tps / plain_tps:.3f}")


if __name__ == "__main__":
    main()
