"""Collation into padded batches, flatten/split of message logs, multi-turn rollout appends."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from rl_algos.data import (
    CHATML_TOOLS_TEMPLATE,
    PromptAnswerProcessor,
    PromptFormat,
    append_generated_message,
    append_observation,
    arithmetic_corpus,
    collate_datums,
    collate_message_logs,
    flatten_message_log,
    split_by_messages,
    tokenize_conversation,
)
from rl_algos.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    corpus = [*arithmetic_corpus(300, seed=2), "Wrong, try again. Correct! Let me check."] * 2
    out = tmp_path_factory.mktemp("tokenizer")
    return build_tokenizer(corpus, vocab_size=500, out_dir=out, chat_template=CHATML_TOOLS_TEMPLATE)


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def make_log(tokenizer: PreTrainedTokenizerFast, prompt: str, answer: str | None) -> list[dict]:
    messages = [{"role": "user", "content": prompt}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    log = tokenize_conversation(tokenizer, messages, add_generation_prompt=answer is None)
    for message in log:
        if message["role"] == "assistant":
            message["trainable"] = True
    return log


def test_collate_pads_right_and_masks_trainable_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    logs = [
        make_log(tokenizer, "What is 2 + 3?", "2 + 3 = 5. The answer is 5."),
        make_log(tokenizer, "What is 12 + 30?", None),
        make_log(tokenizer, "What is 7 * 8 + 1?", "7 * 8 + 1 = 56 + 1 = 57. The answer is 57."),
    ]
    pad = tokenizer.pad_token_id
    batch = collate_message_logs(logs, pad_token_id=pad)

    # Reference: a plain loop over messages and positions.
    lengths = [sum(m["token_ids"].numel() for m in log) for log in logs]
    width = max(lengths)
    assert batch["input_ids"].shape == (3, width) and batch["input_ids"].dtype == torch.long
    assert batch["input_lengths"].tolist() == lengths
    for row, log in enumerate(logs):
        position = 0
        for message in log:
            for token in message["token_ids"].tolist():
                assert batch["input_ids"][row, position] == token
                expected = 1.0 if message["role"] == "assistant" else 0.0
                assert batch["token_mask"][row, position] == expected
                position += 1
        assert batch["input_ids"][row, position:].tolist() == [pad] * (width - position)
        assert batch["token_mask"][row, position:].sum() == 0
    assert "generation_logprobs" not in batch


def test_flatten_and_split_round_trip(tokenizer: PreTrainedTokenizerFast) -> None:
    log = make_log(tokenizer, "What is 2 + 3?", "5")
    append_observation(log, tokenizer, {"role": "environment", "content": "Correct!"})
    flat = flatten_message_log(log)
    assert flat.tolist() == [t for m in log for t in m["token_ids"].tolist()]
    pieces = split_by_messages(torch.cat([flat, torch.tensor([-1, -1])]), log)  # trailing padding ignored
    assert [p.tolist() for p in pieces] == [m["token_ids"].tolist() for m in log]
    mask_pieces = split_by_messages(flatten_message_log(log, "token_mask"), log)
    assert [bool(p.all()) if p.numel() else False for p in mask_pieces] == [False, True, False]
    # a per-token field some messages lack is zero-filled
    assert flatten_message_log(log, "generation_logprobs").abs().sum() == 0


def test_multi_turn_rollout_appends_keep_the_template_layout(tokenizer: PreTrainedTokenizerFast) -> None:
    datum = PromptAnswerProcessor(tokenizer, PromptFormat())({"prompt": "What is 2 + 3?", "answer": "5"}, 0)
    assert datum is not None
    log = datum.message_log
    first = encode(tokenizer, "It is 6.<|im_end|>")  # generation stops at the end-of-turn token
    first_logprobs = -torch.arange(1, first.numel() + 1, dtype=torch.float32) / 10
    append_generated_message(log, tokenizer, first, first_logprobs)
    observation = append_observation(log, tokenizer, {"role": "environment", "content": "Wrong, try again."})
    # the template's newline after the turn opens the observation, which ends with the next header
    assert tokenizer.decode(observation["token_ids"]) == (
        "\n<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert log[-1]["role"] == "environment"  # rendered as a user turn, logged as what it is

    conversation = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "It is 6."},
        {"role": "user", "content": "Wrong, try again."},
    ]
    expected = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert flatten_message_log(log).tolist() == list(expected)

    # A second answer, cut off before its end-of-turn token: the glue then closes the turn.
    second = encode(tokenizer, "The answer is 5")
    second_logprobs = torch.full((second.numel(),), -0.5)
    append_generated_message(log, tokenizer, second, second_logprobs)
    append_observation(log, tokenizer, {"role": "user", "content": "Correct!"}, add_generation_prompt=False)
    conversation += [
        {"role": "assistant", "content": "The answer is 5"},
        {"role": "user", "content": "Correct!"},
    ]
    expected = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
    assert flatten_message_log(log).tolist() == list(expected)

    batch = collate_datums([datum], pad_token_id=tokenizer.pad_token_id)
    prompt_len = log[0]["token_ids"].numel()
    obs_len = log[2]["token_ids"].numel()
    first_span = range(prompt_len, prompt_len + first.numel())
    second_start = prompt_len + first.numel() + obs_len
    second_span = range(second_start, second_start + second.numel())
    assert batch["token_mask"][0].nonzero().flatten().tolist() == [*first_span, *second_span]
    assert torch.equal(batch["generation_logprobs"][0, first_span.start : first_span.stop], first_logprobs)
    assert torch.equal(batch["generation_logprobs"][0, second_span.start : second_span.stop], second_logprobs)
    assert batch["generation_logprobs"][0].count_nonzero() == first.numel() + second.numel()
    assert log[1]["content"] == "It is 6." and log[3]["content"] == "The answer is 5"


def test_observation_after_text_the_template_rewrites(tokenizer: PreTrainedTokenizerFast) -> None:
    # A template that trims content cannot reproduce the generated text, so the observation's
    # own turn is appended as the template renders it after the conversation.
    trimming = CHATML_TOOLS_TEMPLATE.replace(
        "{{- message['content'] -}}", "{{- message['content'] | trim -}}"
    )
    tokenizer = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, chat_template=trimming)
    log = tokenize_conversation(
        tokenizer, [{"role": "user", "content": "What is 1 + 1?"}], add_generation_prompt=True
    )
    append_generated_message(
        log, tokenizer, encode(tokenizer, "  2"), torch.zeros(encode(tokenizer, "  2").numel())
    )
    observation = append_observation(log, tokenizer, {"role": "environment", "content": "Correct!"})
    assert (
        tokenizer.decode(observation["token_ids"])
        == "<|im_start|>user\nCorrect!<|im_end|>\n<|im_start|>assistant\n"
    )


def test_generated_message_needs_matching_logprobs(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match="3 generated tokens but 2 logprobs"):
        append_generated_message([], tokenizer, torch.tensor([5, 6, 7]), torch.zeros(2))


def test_collate_datums_carries_the_sample_fields(tokenizer: PreTrainedTokenizerFast) -> None:
    processor = PromptAnswerProcessor(tokenizer, PromptFormat(), task_name="arith")
    datums = [processor({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}, idx=10 + i) for i in range(3)]
    batch = collate_datums([d for d in datums if d is not None], pad_token_id=tokenizer.pad_token_id)
    assert batch.size == 3
    assert batch["idx"].tolist() == [10, 11, 12]
    assert batch["sample_mask"].tolist() == [1.0, 1.0, 1.0]
    assert batch["task_name"] == ["arith"] * 3
    assert [e["ground_truth"] for e in batch["extra_env_info"]] == ["1", "2", "3"]
    assert batch["length"].tolist() == batch["input_lengths"].tolist()
    # a batch shards like any BatchedDataDict
    assert batch.slice(1, 3)["idx"].tolist() == [11, 12]


def test_pipeline_from_records_to_resumable_batches(tokenizer: PreTrainedTokenizerFast, tmp_path) -> None:
    from functools import partial

    from rl_algos.data import ArithmeticDatasetSpec, StatefulDataLoader, load_records, process_records

    processor = PromptAnswerProcessor(tokenizer, PromptFormat(max_seq_length=64))
    records = load_records(ArithmeticDatasetSpec(num_samples=10, levels=[1, 2]), processor.required_columns)
    dataset = process_records(records, processor)
    collate = partial(collate_datums, pad_token_id=tokenizer.pad_token_id)
    loader = StatefulDataLoader(dataset, batch_size=4, collate_fn=collate, seed=1)
    first = next(iter(loader))
    loader.save(tmp_path)
    expected_next = next(iter(loader))
    resumed = StatefulDataLoader(dataset, batch_size=4, collate_fn=collate, seed=1)
    resumed.load(tmp_path)
    again = next(iter(resumed))
    assert again["idx"].tolist() == expected_next["idx"].tolist()
    assert torch.equal(again["input_ids"], expected_next["input_ids"])
    assert sorted(first["idx"].tolist() + again["idx"].tolist()) == sorted(loader.epoch_order(0)[:8])
    for row, idx in enumerate(again["idx"].tolist()):
        assert again["extra_env_info"][row]["ground_truth"] == records[idx]["answer"]
