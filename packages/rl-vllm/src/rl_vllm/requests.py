"""Turning a `GenerationInput` batch into vLLM requests and vLLM outputs into a `GenerationOutput`.

Shared by the synchronous and the asynchronous engine. Prompts go in as token ids (never text),
one request per row with its own token budget and stop strings; outputs come back as the
sampled token ids, the sampled tokens' log-probs and whether the length limit cut them.

Stopping matches the Hugging Face backend (`rl_dtensor.sampling`): a row stops at the model's
eos or a configured stop token, when its generated text contains a stop string (the token that
completes it is kept), or at its budget `min(max_new_tokens, max_total_sequence_length -
prompt length)`; only the budget marks it `truncated`. A row whose prompt already fills the
context generates nothing and is `truncated`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rl_vllm.config import VllmConfig

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams


@dataclass(frozen=True)
class PromptRequest:
    """One row of the batch: its prompt, token budget and stop strings."""

    token_ids: list[int]
    max_new_tokens: int
    stop_strings: list[str]


@dataclass(frozen=True)
class Completion:
    """What vLLM generated for one row."""

    token_ids: list[int]
    logprobs: list[float]
    truncated: bool


def merged_stop_strings(configured: Sequence[str] | None, per_sample: Sequence[str] | None) -> list[str]:
    merged = list(configured or [])
    merged.extend(s for s in (per_sample or []) if s not in merged)
    return merged


def prompt_requests(data: Mapping[str, Any], cfg: VllmConfig) -> list[PromptRequest]:
    """One `PromptRequest` per row of right-padded `input_ids` / `input_lengths`."""
    input_ids = data["input_ids"]
    lengths = [int(n) for n in data["input_lengths"]]
    if input_ids.ndim != 2 or input_ids.shape[0] != len(lengths):
        raise ValueError(
            f"input_ids must be [B, T] with one input_lengths entry per row; got input_ids "
            f"{tuple(input_ids.shape)} and {len(lengths)} lengths"
        )
    per_sample_stops = data.get("stop_strings")
    if per_sample_stops is not None and len(per_sample_stops) != len(lengths):
        raise ValueError(f"stop_strings has {len(per_sample_stops)} entries for a batch of {len(lengths)}")
    limit = cfg.max_total_sequence_length
    requests = []
    for row, length in enumerate(lengths):
        if length < 1 or length > input_ids.shape[1]:
            raise ValueError(
                f"input_lengths[{row}] = {length} is outside [1, {input_ids.shape[1]}] (the width of input_ids)"
            )
        if length > limit:
            raise ValueError(
                f"prompt at index {row} has {length} tokens, more than max_total_sequence_length={limit}"
            )
        budget = limit - length
        if cfg.max_new_tokens is not None:
            budget = min(budget, cfg.max_new_tokens)
        stops = merged_stop_strings(cfg.stop_strings, per_sample_stops[row] if per_sample_stops else None)
        requests.append(PromptRequest(input_ids[row, :length].tolist(), budget, stops))
    return requests


def sampling_params(
    cfg: VllmConfig, request: PromptRequest, greedy: bool, final_output_only: bool = False
) -> SamplingParams:
    """vLLM sampling parameters for one row; asks for the sampled token's log-prob only."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kwargs: dict[str, Any] = {}
    if final_output_only:
        kwargs["output_kind"] = RequestOutputKind.FINAL_ONLY
    return SamplingParams(
        temperature=0.0 if greedy else cfg.temperature,
        top_p=1.0 if greedy else cfg.top_p,
        top_k=0 if greedy or not cfg.top_k else cfg.top_k,
        max_tokens=request.max_new_tokens,
        stop_token_ids=list(cfg.stop_token_ids or []),
        stop=request.stop_strings or None,
        include_stop_str_in_output=True,
        # Stop strings are matched on the decoded text; nothing else needs it.
        detokenize=bool(request.stop_strings),
        skip_special_tokens=False,
        logprobs=0,
        **kwargs,
    )


def completion_from_output(output: RequestOutput) -> Completion:
    """Generated ids, their log-probs and the truncation flag of a finished request."""
    (sample,) = output.outputs
    token_ids = list(sample.token_ids)
    if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
        raise RuntimeError(
            f"vLLM returned {0 if sample.logprobs is None else len(sample.logprobs)} log-prob entries for "
            f"{len(token_ids)} generated tokens of request {output.request_id}"
        )
    # With logprobs=0 each position holds the sampled token (plus nothing else).
    logprobs = [float(step[token].logprob) for token, step in zip(token_ids, sample.logprobs)]
    return Completion(token_ids, logprobs, sample.finish_reason == "length")


# The result of a row with no room to generate (vLLM needs max_tokens >= 1).
NO_ROOM_TO_GENERATE = Completion([], [], truncated=True)


def assemble_output(
    requests: Sequence[PromptRequest], completions: Sequence[Completion], pad_token_id: int, width: int
) -> dict[str, torch.Tensor]:
    """The `GenerationOutput` fields (see `rl_core.interfaces.specs`); `width` is the minimum
    width of `output_ids` (the input width, so an empty batch keeps its shape)."""
    batch = len(requests)
    prompt_lengths = torch.tensor([len(r.token_ids) for r in requests], dtype=torch.long)
    generation_lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.long)
    total = prompt_lengths + generation_lengths
    width = max([width, *total.tolist()])
    output_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros((batch, width), dtype=torch.float32)
    for row, (request, completion) in enumerate(zip(requests, completions)):
        start, end = len(request.token_ids), int(total[row])
        output_ids[row, :start] = torch.tensor(request.token_ids, dtype=torch.long)
        output_ids[row, start:end] = torch.tensor(completion.token_ids, dtype=torch.long)
        logprobs[row, start:end] = torch.tensor(completion.logprobs, dtype=torch.float32)
    return {
        "output_ids": output_ids,
        "logprobs": logprobs,
        "generation_lengths": generation_lengths,
        "unpadded_sequence_lengths": total,
        "truncated": torch.tensor([c.truncated for c in completions], dtype=torch.bool),
    }
