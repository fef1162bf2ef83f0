"""Independent references for the vLLM tests: a plain Hugging Face model in this process,
decoding greedily by recomputing the whole sequence each step (no KV cache, no batching)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rl_core.data import BatchedDataDict


def load_model(model_dir: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model


@torch.no_grad()
def greedy_continuation(
    model: torch.nn.Module, prompt: list[int], max_new_tokens: int, stop_ids: set[int]
) -> list[int]:
    """Argmax decoding of one prompt until a stop id (kept) or `max_new_tokens`."""
    sequence = list(prompt)
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        logits = model(input_ids=torch.tensor([sequence])).logits[0, -1]
        token = int(logits.argmax())
        generated.append(token)
        sequence.append(token)
        if token in stop_ids:
            break
    return generated


@torch.no_grad()
def sequence_logprobs(model: torch.nn.Module, sequence: list[int], temperature: float) -> list[float]:
    """log p(token t | tokens < t) under softmax(logits / temperature), for t = 1 .. len - 1."""
    logits = model(input_ids=torch.tensor([sequence])).logits[0, :-1].float() / temperature
    picked = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(sequence[1:])[:, None])
    return [float(v) for v in picked.squeeze(-1)]


def generated_rows(out: BatchedDataDict) -> list[list[int]]:
    """The generated token ids of each row of a `GenerationOutput`."""
    rows = []
    for row in range(out.size):
        end = int(out["unpadded_sequence_lengths"][row])
        start = end - int(out["generation_lengths"][row])
        rows.append(out["output_ids"][row, start:end].tolist())
    return rows


def generated_mask(out: BatchedDataDict) -> torch.Tensor:
    """[B, T] True on the generated positions of a `GenerationOutput`."""
    positions = torch.arange(out["output_ids"].shape[1])[None, :]
    end = out["unpadded_sequence_lengths"][:, None]
    start = end - out["generation_lengths"][:, None]
    return (positions >= start) & (positions < end)


def token_mult_prob_error(
    generation_logprobs: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor
) -> float:
    """Mean over `mask` of exp(|log p_gen - log p|) (the GRPO health metric)."""
    return float(torch.exp((generation_logprobs - logprobs).abs())[mask].mean())


def right_padded(prompts: list[list[int]], pad_token_id: int) -> BatchedDataDict:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, : len(prompt)] = torch.tensor(prompt)
    return BatchedDataDict(input_ids=input_ids, input_lengths=torch.tensor([len(p) for p in prompts]))
