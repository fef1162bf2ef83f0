"""Shared helpers of the rl-dtensor tests: a token-level NLL loss, batches, independent
single-process references (plain Hugging Face model, plain PyTorch loop), and a launcher that
runs a function on N gloo ranks in spawned processes."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from rl_core.data import BatchedDataDict
from rl_core.interfaces import LossType

TESTS_DIR = str(Path(__file__).resolve().parent)


class NLLLoss:
    """Token-level negative log-likelihood with global normalisation (DESIGN.md §3).

    loss = -sum(logprob of each trained token) / global_valid_toks, where a token is trained
    on if token_mask[t] and sample_mask (position 0 predicts nothing).
    """

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
        loss = -(picked * mask).sum() / global_valid_toks
        return loss, {"num_valid_tokens": mask.sum().item(), "nll_sum": -(picked * mask).sum().item()}


def make_batch(
    vocab_size: int,
    lengths: list[int],
    prompt_lengths: list[int],
    sample_mask: list[float],
    width: int | None = None,
    seed: int = 0,
    pad_token_id: int = 0,
) -> BatchedDataDict[Any]:
    """A right-padded training batch; tokens t in [prompt_len, length) are trained on."""
    generator = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    width = width or max(lengths)
    input_ids = torch.randint(5, vocab_size, (batch, width), generator=generator)
    positions = torch.arange(width)[None, :]
    lens = torch.tensor(lengths)
    valid = positions < lens[:, None]
    input_ids = torch.where(valid, input_ids, torch.full_like(input_ids, pad_token_id))
    token_mask = (valid & (positions >= torch.tensor(prompt_lengths)[:, None])).long()
    return BatchedDataDict(
        input_ids=input_ids,
        input_lengths=lens,
        token_mask=token_mask,
        sample_mask=torch.tensor(sample_mask, dtype=torch.float32),
    )


def load_plain_model(model_dir: str | Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model


def plain_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, input_lengths: torch.Tensor
) -> torch.Tensor:
    """Logits of a plain HF forward with a padding mask (the independent reference)."""
    mask = (torch.arange(input_ids.shape[1])[None, :] < input_lengths[:, None]).long()
    return model(input_ids=input_ids, attention_mask=mask).logits


def plain_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, input_lengths: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """[B, T] log p(token t | < t) from a plain forward; 0 at t = 0 and past the length."""
    with torch.no_grad():
        logits = plain_logits(model, input_ids, input_lengths).float() / temperature
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    out = torch.nn.functional.pad(logprobs, (1, 0))
    valid = torch.arange(input_ids.shape[1])[None, :] < input_lengths[:, None]
    return torch.where(valid, out, torch.zeros_like(out))


def plain_sgd_step(
    model_dir: str | Path, batch: BatchedDataDict[Any], lr: float, max_grad_norm: float | None
) -> tuple[dict[str, torch.Tensor], float, float]:
    """One SGD step on the whole batch as one micro-batch, with a plain model and
    `torch.nn.utils.clip_grad_norm_`. Returns (new parameters, loss, grad norm before clipping)."""
    model = load_plain_model(model_dir)
    model.train()
    logits = plain_logits(model, batch["input_ids"], batch["input_lengths"])
    mask = batch["token_mask"][:, 1:].float() * batch["sample_mask"][:, None]
    loss, _ = NLLLoss()(logits, batch, batch["sample_mask"].sum(), mask.sum())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), max_grad_norm if max_grad_norm else float("inf")
    )
    with torch.no_grad():
        for param in model.parameters():
            param -= lr * param.grad
    return {n: p.detach().clone() for n, p in model.named_parameters()}, float(loss.detach()), float(norm)


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def policy_config(model_dir: str | Path, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_name": str(model_dir),
        "max_total_sequence_length": 64,
        "train_global_batch_size": 8,
        "train_micro_batch_size": 1,
        "logprob_batch_size": 3,
        "optimizer": {"name": "sgd", "kwargs": {"lr": 1.0}},
        "max_grad_norm": None,
        "seed": 1,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def full_params(worker: Any) -> dict[str, torch.Tensor]:
    """All parameters, unsharded (collective: every rank calls it; every rank gets them)."""
    return {name: t for bucket in worker.stream_weights(1 << 20) for name, t in bucket.items()}


def mean_token_mult_prob_error(
    generation_logprobs: torch.Tensor, train_logprobs: torch.Tensor, mask: torch.Tensor
) -> float:
    """Mean over generated tokens of exp(|gen - train|) (1.0 = identical)."""
    return float(torch.exp((generation_logprobs - train_logprobs).abs())[mask.bool()].mean())


# ------------------------------------------------------------------------ multi-process launcher


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, out_dir: str, args: tuple[Any, ...]
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        result: Any = {"ok": fn(*args)}
    except BaseException:
        result = {"error": traceback.format_exc()}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    import torch.distributed as dist

    if "ok" in result and dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600) -> list[Any]:
    """Run `fn(*args)` on `world_size` spawned processes forming a gloo group; per-rank results.

    `fn` must be importable (module level). A failure on any rank raises with its traceback.
    """
    context = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        processes = [
            context.Process(target=_rank_main, args=(fn, rank, world_size, port, out_dir, args))
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout_s)
        hung = [rank for rank, p in enumerate(processes) if p.is_alive()]
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        results = []
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.pt"
            if not path.exists():
                raise RuntimeError(f"rank {rank} wrote no result (hung ranks: {hung})")
            result = torch.load(path, weights_only=False)
            if "error" in result:
                raise RuntimeError(f"rank {rank} failed:\n{result['error']}")
            results.append(result["ok"])
        return results
