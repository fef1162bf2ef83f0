"""The SFT loss counts assistant tokens only: on hand-built conversations the trained positions are
exactly those of the assistant turns in the rendered text, and the loss equals the mean negative
log-likelihood over those positions computed by hand from a plain forward pass."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_algos.data.collate import collate_datums
from rl_algos.data.processors import SFTFormat, SFTProcessor
from rl_algos.losses import NLLLossFn
from rl_algos.sft import SFTMasterConfig
from rl_algos.training import training_fields


def rendered_positions(tokenizer: Any, text: str, trained_spans: list[tuple[int, int]]) -> list[int]:
    """Token positions of `text` whose characters fall inside the given character spans."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [
        i
        for i, (start, end) in enumerate(encoded["offset_mapping"])
        if any(lo <= start and end <= hi for lo, hi in trained_spans) and end > start
    ]


def hand_nll(model_dir: Path, batch: Any, positions: list[list[int]]) -> float:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
    # The token at position t is predicted by the logits at t - 1.
    terms = [-float(logprobs[row, t - 1, ids[row, t]]) for row, ts in enumerate(positions) for t in ts]
    return sum(terms) / len(terms)


def loss_of(model_dir: Path, batch: Any) -> tuple[float, dict[str, Any]]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    mask = (torch.arange(batch["input_ids"].shape[1])[None, :] < batch["input_lengths"][:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=mask).logits
    valid = (batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]).sum()
    loss, metrics = NLLLossFn()(logits, training_fields(batch), batch["sample_mask"].sum(), valid)
    return float(loss), metrics


def test_prompt_tokens_are_masked_out_of_the_sft_loss(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    processor = SFTProcessor(tokenizer, SFTFormat(system_prompt="Be brief."))
    datum = processor({"prompt": "What is 2 + 3?", "completion": "The answer is 5."}, 0)
    assert datum is not None
    batch = collate_datums([datum], int(tokenizer.pad_token_id))

    text = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\nThe answer is 5.<|im_end|>\n"
    )
    # Trained: the completion, its end-of-turn token and the template's newline after it.
    start = text.index("The answer is 5.")
    expected = rendered_positions(tokenizer, text, [(start, len(text))])
    assert batch["input_ids"][0].tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    trained = torch.nonzero(batch["token_mask"][0]).flatten().tolist()
    assert trained == expected
    assert trained == list(range(trained[0], int(batch["input_lengths"][0])))
    assert tokenizer.decode(batch["input_ids"][0, trained[0] :]) == "The answer is 5.<|im_end|>\n"

    loss, metrics = loss_of(tiny_model_dir, batch)
    assert metrics["num_valid_tokens"] == len(expected)
    assert loss == pytest.approx(hand_nll(tiny_model_dir, batch, [expected]), rel=1e-5)


def test_multi_turn_tool_conversation_trains_assistant_turns_only(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    messages = [
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "Calling the adder."},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ]
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    spans = []
    for content in ("Calling the adder.", "It is 5."):
        begin = text.index(content)
        spans.append((begin, text.index("<|im_start|>", begin) if content != "It is 5." else len(text)))

    rows = []
    for train_on, trained_spans in (("all_assistant", spans), ("last_assistant", spans[1:])):
        datum = SFTProcessor(tokenizer, SFTFormat(train_on=train_on))({"messages": messages}, 0)
        assert datum is not None
        batch = collate_datums([datum], int(tokenizer.pad_token_id))
        trained = torch.nonzero(batch["token_mask"][0]).flatten().tolist()
        assert trained == rendered_positions(tokenizer, text, trained_spans), train_on
        rows.append((batch, trained))

    # Both rows in one batch: the loss is the mean over the trained tokens of the whole batch.
    (_, first_pos), (_, second_pos) = rows
    both = collate_datums(
        [
            SFTProcessor(tokenizer, SFTFormat())({"messages": messages}, 0),  # type: ignore[list-item]
            SFTProcessor(tokenizer, SFTFormat(train_on="last_assistant"))({"messages": messages}, 1),  # type: ignore[list-item]
        ],
        int(tokenizer.pad_token_id),
    )
    loss, metrics = loss_of(tiny_model_dir, both)
    assert metrics["num_valid_tokens"] == len(first_pos) + len(second_pos)
    assert loss == pytest.approx(hand_nll(tiny_model_dir, both, [first_pos, second_pos]), rel=1e-5)


def test_sft_recipe_rejects_arithmetic_data_in_the_wrong_format() -> None:
    from rl_algos.cli import packaged_recipe
    from rl_core.config import ConfigError, load_validated_config

    with pytest.raises(
        ConfigError, match=re.escape("data.train: SFT needs the task's worked solutions; set format: sft")
    ):
        load_validated_config(
            packaged_recipe("sft_tiny_cpu.yaml"), SFTMasterConfig, ["data.train.format=prompt_answer"]
        )
