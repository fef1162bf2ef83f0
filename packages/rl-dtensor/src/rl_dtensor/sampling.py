"""Batched autoregressive sampling with a KV cache, returning the sampled tokens' log-probs.

One implementation serves the standalone `HFGenerationWorker` and generation inside the
policy worker (with the policy's own, possibly FSDP/TP-sharded, model).

Log-probs: the returned log-prob of a token is taken from the temperature-scaled *full*
distribution `log_softmax(logits / temperature)`, the same quantity the policy's
`get_logprobs` computes, so with top-k = top-p = off it is exactly the log-prob of the
distribution sampled from. With top-k / top-p the sampler draws from the renormalised truncated
distribution but still reports the full-distribution log-prob (as NeMo RL does with vLLM); the
RL losses then compare like with like. Greedy decoding reports the same quantity.

Stopping: a sample stops at a stop token (the tokenizer's eos plus `stop_token_ids`), when its
decoded generated text contains a stop string (the token that completes it is kept), or when it
reaches `max_new_tokens` or the total length limit; only the last two mark it `truncated`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from rl_core.policy.config import SamplingConfig

AllDone = Callable[[bool], bool]
"""Given whether this process's batch is finished, whether every process's is.

Processes whose model forwards are collective (FSDP all-gathers, TP) must run the same number
of forward steps, so they keep stepping (on finished rows) until all agree to stop."""


@dataclass(frozen=True)
class SamplingLimits:
    max_total_length: int
    max_new_tokens: int | None
    stop_token_ids: frozenset[int]


def filter_logits(scaled_logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf (the top token always stays)."""
    logits = scaled_logits
    vocab = logits.shape[-1]
    if top_k is not None and 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _left_pad(
    input_ids: torch.Tensor, lengths: torch.Tensor, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompts -> left-padded prompts and their attention mask."""
    batch, _ = input_ids.shape
    width = int(lengths.max())
    out = torch.full((batch, width), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
    mask = torch.zeros((batch, width), dtype=torch.long, device=input_ids.device)
    for row in range(batch):
        length = int(lengths[row])
        out[row, width - length :] = input_ids[row, :length]
        mask[row, width - length :] = 1
    return out, mask


class _StopChecker:
    """Per-sample stop strings, checked on the decoded generated text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_strings: Sequence[Sequence[str]]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings

    def hit(self, row: int, generated: list[int]) -> bool:
        strings = self.stop_strings[row]
        if not strings:
            return False
        text = self.tokenizer.decode(generated, skip_special_tokens=False)
        return any(s in text for s in strings)


def merged_stop_strings(
    batch_size: int, configured: Sequence[str] | None, per_sample: Sequence[Sequence[str] | None] | None
) -> list[list[str]]:
    if per_sample is not None and len(per_sample) != batch_size:
        raise ValueError(f"stop_strings has {len(per_sample)} entries for a batch of {batch_size}")
    merged = []
    for row in range(batch_size):
        strings = list(configured or [])
        extra = per_sample[row] if per_sample is not None else None
        strings.extend(s for s in (extra or []) if s not in strings)
        merged.append(strings)
    return merged


@torch.no_grad()
def generate_batch(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    sampling: SamplingConfig,
    max_total_length: int,
    greedy: bool = False,
    stop_strings: Sequence[Sequence[str] | None] | None = None,
    generator: torch.Generator | None = None,
    all_done: AllDone | None = None,
) -> dict[str, torch.Tensor]:
    """Generate continuations of the right-padded prompts `input_ids [B, T]`.

    Returns the `GenerationOutput` fields (see `rl_core.interfaces.specs`) on CPU.
    """
    device = input_ids.device
    batch = input_ids.shape[0]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if batch == 0:
        if all_done is not None:
            # Nothing to generate here, but this process must take part in every collective
            # forward step: run a 1-token prompt that is finished from the start.
            idle_prompt = torch.full((1, 1), pad_id, dtype=torch.long, device=device)
            idle_length = torch.ones(1, dtype=torch.long, device=device)
            generate_batch(
                model, tokenizer, idle_prompt, idle_length, sampling, 1, greedy, None, generator, all_done
            )
        return _assemble(input_ids, input_lengths, [], [], torch.zeros(0, dtype=torch.bool), pad_id)
    lengths = input_lengths.to(device=device, dtype=torch.long)
    too_long = (lengths > max_total_length).nonzero()
    if too_long.numel():
        row = int(too_long[0, 0])
        raise ValueError(
            f"prompt at index {row} has {int(lengths[row])} tokens, more than max_total_sequence_length="
            f"{max_total_length}"
        )
    if bool((lengths < 1).any()):
        raise ValueError("every prompt needs at least one token (input_lengths >= 1)")
    stop_ids = set(sampling.stop_token_ids or [])
    if tokenizer.eos_token_id is not None:
        stop_ids.add(int(tokenizer.eos_token_id))
    budget = max_total_length - lengths
    if sampling.max_new_tokens is not None:
        budget = budget.clamp(max=sampling.max_new_tokens)
    checker = _StopChecker(tokenizer, merged_stop_strings(batch, sampling.stop_strings, stop_strings))

    prompt, attention_mask = _left_pad(input_ids, lengths, pad_id)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    generated: list[list[int]] = [[] for _ in range(batch)]
    token_logprobs: list[list[float]] = [[] for _ in range(batch)]
    done = budget <= 0
    truncated = budget <= 0
    step_ids, step_positions = prompt, positions
    while True:
        if not bool(done.all()) or all_done is not None:
            out = model(
                input_ids=step_ids,
                attention_mask=attention_mask,
                position_ids=step_positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.past_key_values
            scaled = out.logits[:, -1].float() / sampling.temperature
            logprobs = torch.log_softmax(scaled, dim=-1)
            if greedy:
                tokens = scaled.argmax(dim=-1)
            else:
                probs = torch.softmax(filter_logits(scaled, sampling.top_k, sampling.top_p), dim=-1)
                tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            picked = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
            tokens = torch.where(done, torch.full_like(tokens, pad_id), tokens)
            token_list, picked_list = tokens.tolist(), picked.tolist()
            for row in (~done).nonzero().flatten().tolist():
                token = token_list[row]
                generated[row].append(token)
                token_logprobs[row].append(picked_list[row])
                if token in stop_ids or checker.hit(row, generated[row]):
                    done[row] = True
                elif len(generated[row]) >= int(budget[row]):
                    done[row] = True
                    truncated[row] = True
            step_ids = tokens[:, None]
            step_positions = step_positions[:, -1:] + 1
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 1))], dim=-1)
        local_done = bool(done.all())
        if all_done is None:
            if local_done:
                break
        elif all_done(local_done):
            break
    return _assemble(input_ids, lengths, generated, token_logprobs, truncated, pad_id)


def _assemble(
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    generated: list[list[int]],
    token_logprobs: list[list[float]],
    truncated: torch.Tensor,
    pad_id: int,
) -> dict[str, torch.Tensor]:
    batch = input_ids.shape[0]
    prompt_lengths = lengths.cpu()
    generation_lengths = torch.tensor([len(g) for g in generated], dtype=torch.long)
    total = prompt_lengths + generation_lengths
    width = int(total.max()) if batch else 0
    output_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    logprobs = torch.zeros((batch, width), dtype=torch.float32)
    prompts = input_ids.cpu()
    for row in range(batch):
        start = int(prompt_lengths[row])
        output_ids[row, :start] = prompts[row, :start]
        output_ids[row, start : int(total[row])] = torch.tensor(generated[row], dtype=torch.long)
        logprobs[row, start : int(total[row])] = torch.tensor(token_logprobs[row], dtype=torch.float32)
    return {
        "output_ids": output_ids,
        "logprobs": logprobs,
        "generation_lengths": generation_lengths,
        "unpadded_sequence_lengths": total,
        "truncated": truncated.cpu(),
    }
