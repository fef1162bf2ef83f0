"""Task formats -> message logs: exact assistant-only masks, tool calls, length limits, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import PreTrainedTokenizerFast

from rl_algos.data import (
    CHATML_TOOLS_TEMPLATE,
    ChatTemplateError,
    DataError,
    OverlongPolicy,
    PreferenceProcessor,
    PromptAnswerProcessor,
    PromptFormat,
    SFTFormat,
    SFTProcessor,
    arithmetic_corpus,
    collate_datums,
    collate_preference,
    process_records,
    tokenize_conversation,
)
from rl_algos.models.tiny import DEFAULT_CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer

CONVERSATION_WORDS = [
    "You are a careful assistant. Think step by step.",
    "What is the weather in Paris? It is sunny. Call the tool get_weather with city Paris.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}} <tool_call> </tool_call> tool_call_id',
]


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    """No merges at all: every ASCII character is one token and every special token is one, so
    token positions can be counted by hand."""
    out = tmp_path_factory.mktemp("byte_tokenizer")
    minimum = 256 + len(SPECIAL_TOKENS)
    return build_tokenizer(["abc"], vocab_size=minimum, out_dir=out, chat_template=CHATML_TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    """A trained BPE (many merges), as real models have."""
    out = tmp_path_factory.mktemp("bpe_tokenizer")
    corpus = [*arithmetic_corpus(300, seed=1), *CONVERSATION_WORDS * 20]
    return build_tokenizer(corpus, vocab_size=600, out_dir=out, chat_template=CHATML_TOOLS_TEMPLATE)


def char_positions_to_tokens(text: str, spans: list[tuple[int, int]]) -> list[int]:
    """Independent reference for the byte tokenizer: token index of each character in the
    [start, end) spans, counting every special-token string as a single token."""
    special = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    token_of_char: list[int] = []
    position, token = 0, 0
    while position < len(text):
        match = special.match(text, position)
        width = match.end() - position if match else 1
        token_of_char.extend([token] * width)
        position += width
        token += 1
    return sorted({token_of_char[c] for start, end in spans for c in range(start, end)})


SFT_CONVERSATION = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "3+4?"},
    {"role": "assistant", "content": "7"},
]


def test_assistant_only_mask_hand_counted(byte_tokenizer: PreTrainedTokenizerFast) -> None:
    datum = SFTProcessor(byte_tokenizer, SFTFormat())({"messages": SFT_CONVERSATION}, idx=0)
    assert datum is not None
    batch = collate_datums([datum], pad_token_id=byte_tokenizer.pad_token_id)
    # <|im_start|>system\nS<|im_end|>\n                      tokens  0-10
    # <|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n  11-33 (the header goes with the prompt)
    # 4<|im_end|>\n                                            34-36 trained
    # <|im_start|>user\n3+4?<|im_end|>\n<|im_start|>assistant\n  37-59
    # 7<|im_end|>\n                                            60-62 trained
    assert batch["input_lengths"].tolist() == [63]
    assert batch["token_mask"][0].nonzero().flatten().tolist() == [34, 35, 36, 60, 61, 62]
    assert [m["token_ids"].numel() for m in datum.message_log] == [11, 23, 3, 23, 3]
    assert byte_tokenizer.decode(batch["input_ids"][0, 34:37]) == "4<|im_end|>\n"

    last_only = SFTProcessor(byte_tokenizer, SFTFormat(train_on="last_assistant"))(
        {"messages": SFT_CONVERSATION}, 0
    )
    assert last_only is not None
    mask = collate_datums([last_only], byte_tokenizer.pad_token_id)["token_mask"][0]
    assert mask.nonzero().flatten().tolist() == [60, 61, 62]


def test_prompt_completion_sft_matches_messages_format(byte_tokenizer: PreTrainedTokenizerFast) -> None:
    fmt = SFTFormat(system_prompt="S")
    from_pair = SFTProcessor(byte_tokenizer, fmt)({"prompt": "2+2?", "completion": "4"}, 0)
    from_messages = SFTProcessor(byte_tokenizer, SFTFormat())({"messages": SFT_CONVERSATION[:3]}, 0)
    assert from_pair is not None and from_messages is not None
    a = collate_datums([from_pair], 0)
    b = collate_datums([from_messages], 0)
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert a["token_mask"][0].nonzero().flatten().tolist() == [34, 35, 36]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
]


def test_openai_messages_with_tool_calls(byte_tokenizer: PreTrainedTokenizerFast) -> None:
    record = {"messages": TOOL_CONVERSATION, "tools": TOOLS}
    datum = SFTProcessor(byte_tokenizer, SFTFormat())(record, idx=4)
    assert datum is not None
    assert [m["role"] for m in datum.message_log] == ["system", "user", "assistant", "tool", "assistant"]
    assert [m.get("trainable", False) for m in datum.message_log] == [False, False, True, False, True]
    assert datum.message_log[2]["tool_calls"] == TOOL_CONVERSATION[2]["tool_calls"]

    text = byte_tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, tokenize=False)
    call_body = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    )
    answer_body = "It is sunny.<|im_end|>\n"
    assert text.count(call_body) == 1 and text.endswith(answer_body)
    spans = [
        (text.index(call_body), text.index(call_body) + len(call_body)),
        (len(text) - len(answer_body), len(text)),
    ]

    batch = collate_datums([datum], pad_token_id=byte_tokenizer.pad_token_id)
    length = int(batch["input_lengths"][0])
    expected_ids = byte_tokenizer.apply_chat_template(
        TOOL_CONVERSATION, tools=TOOLS, tokenize=True, return_dict=False
    )
    assert batch["input_ids"][0, :length].tolist() == list(expected_ids)
    assert batch["token_mask"][0].nonzero().flatten().tolist() == char_positions_to_tokens(text, spans)
    assert "get_weather" in byte_tokenizer.decode(
        datum.message_log[0]["token_ids"]
    )  # tools in the system turn


@pytest.mark.parametrize(
    ("messages", "tools", "generation_prompt"),
    [
        (SFT_CONVERSATION, None, False),
        (TOOL_CONVERSATION, TOOLS, False),
        (TOOL_CONVERSATION[:4], TOOLS, True),
        ([{"role": "user", "content": "What is 12 + 30?"}], None, True),
    ],
)
def test_per_message_tokens_concatenate_to_the_whole_template(
    bpe_tokenizer: PreTrainedTokenizerFast,
    messages: list[dict],
    tools: list[dict] | None,
    generation_prompt: bool,
) -> None:
    log = tokenize_conversation(bpe_tokenizer, messages, tools=tools, add_generation_prompt=generation_prompt)
    whole = bpe_tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
    )
    assert torch.cat([m["token_ids"] for m in log]).tolist() == list(whole)
    assert len(whole) < len(
        bpe_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    )  # merges happen


def test_template_that_rewrites_earlier_text_is_rejected(bpe_tokenizer: PreTrainedTokenizerFast) -> None:
    counting = "{{ messages | length }} turns{% for m in messages %}|{{ m['content'] }}{% endfor %}"
    tokenizer = bpe_tokenizer.__class__(
        tokenizer_object=bpe_tokenizer.backend_tokenizer, chat_template=counting
    )
    with pytest.raises(ChatTemplateError, match=r"not prefix-stable at message 1 \(role 'assistant'\)"):
        tokenize_conversation(tokenizer, SFT_CONVERSATION[1:3])


def test_template_joining_messages_inside_a_token_is_rejected(bpe_tokenizer: PreTrainedTokenizerFast) -> None:
    glued = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer = bpe_tokenizer.__class__(tokenizer_object=bpe_tokenizer.backend_tokenizer, chat_template=glued)
    word = "What"  # one token in the trained vocabulary (every prompt starts with it), split in two here
    assert len(tokenizer(word, add_special_tokens=False)["input_ids"]) == 1
    messages = [{"role": "user", "content": word[:2]}, {"role": "assistant", "content": word[2:]}]
    with pytest.raises(ChatTemplateError, match="differs from tokenising it whole at token 0"):
        tokenize_conversation(tokenizer, messages)


def test_prompt_answer_processor(byte_tokenizer: PreTrainedTokenizerFast) -> None:
    fmt = PromptFormat(system_prompt="S", prompt_template="Q: {} Put it in \\boxed{{}}.")
    datum = PromptAnswerProcessor(byte_tokenizer, fmt)({"prompt": "1+2?", "answer": 3}, idx=7)
    assert datum is not None
    assert [m["role"] for m in datum.message_log] == ["system", "user"]
    assert datum.message_log[1]["content"] == "Q: 1+2? Put it in \\boxed{}."
    user_text = byte_tokenizer.decode(datum.message_log[1]["token_ids"])
    assert user_text == "<|im_start|>user\nQ: 1+2? Put it in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    assert datum.extra_env_info == {"ground_truth": "3"}
    assert (datum.task_name, datum.idx, datum.loss_multiplier, datum.truncated) == ("math", 7, 1.0, False)
    # one token per character, except the 3 special tokens: "<|im_start|>" x2, "<|im_end|>" x1
    user_tokens = len(user_text) - 2 * (len("<|im_start|>") - 1) - (len("<|im_end|>") - 1)
    assert datum.length == sum(m["token_ids"].numel() for m in datum.message_log) == 11 + user_tokens == 57
    batch = collate_datums([datum], 0)
    assert batch["token_mask"].sum().item() == 0  # a prompt has nothing to train on
    assert batch["extra_env_info"] == [{"ground_truth": "3"}]


def test_prompt_template_needs_exactly_one_placeholder() -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        PromptFormat(prompt_template="{} and {}")
    with pytest.raises(ValidationError, match="exactly one"):
        PromptFormat(prompt_template="Solve it and write \\boxed{}: {}")


@pytest.mark.parametrize("policy", [OverlongPolicy.FILTER, OverlongPolicy.TRUNCATE])
def test_overlong_samples_are_filtered_or_truncated_and_counted(
    byte_tokenizer: PreTrainedTokenizerFast, policy: OverlongPolicy
) -> None:
    records = [{"prompt": "1+1?", "completion": "2"}, {"prompt": "x" * 40, "completion": "y"}]
    records.append({"prompt": "2+2?", "completion": "4"})
    limit = 30  # the short records have 12 + 11 + 3 = 26 tokens, the long one 62
    dataset = process_records(
        records, SFTProcessor(byte_tokenizer, SFTFormat(max_seq_length=limit, overlong=policy))
    )
    if policy is OverlongPolicy.FILTER:
        assert [d.idx for d in dataset.datums] == [0, 2]
        assert dataset.summary() == {
            "num_records": 3,
            "num_kept": 2,
            "num_filtered_overlong": 1,
            "num_truncated_overlong": 0,
        }
    else:
        assert [d.idx for d in dataset.datums] == [0, 1, 2]
        assert (dataset.num_filtered, dataset.num_truncated) == (0, 1)
        long = dataset[1]
        assert (long.length, long.loss_multiplier, long.truncated) == (limit, 0.0, True)
        assert [m["role"] for m in long.message_log] == ["user"]  # cut inside the prompt
        batch = collate_datums(dataset.datums, 0)
        assert batch["sample_mask"].tolist() == [1.0, 0.0, 1.0]
        assert batch["input_lengths"].tolist() == [26, limit, 26]


def test_everything_filtered_is_an_error(byte_tokenizer: PreTrainedTokenizerFast) -> None:
    processor = SFTProcessor(byte_tokenizer, SFTFormat(max_seq_length=5))
    with pytest.raises(DataError, match="all 1 were longer than max_seq_length"):
        process_records([{"prompt": "hello", "completion": "hi"}], processor)


def test_preference_pairs(byte_tokenizer: PreTrainedTokenizerFast) -> None:
    processor = PreferenceProcessor(byte_tokenizer, PromptFormat())
    records = [
        {"prompt": "2+2?", "chosen": "4", "rejected": "5!"},
        {
            "prompt": [{"role": "user", "content": "hi"}],
            "chosen": [{"role": "assistant", "content": "hello"}],
            "rejected": {"role": "assistant", "content": "go"},
        },
    ]
    dataset = process_records(records, processor)
    first = dataset[0]
    prompt_tokens = first.chosen[0]["token_ids"]
    assert torch.equal(first.rejected[0]["token_ids"], prompt_tokens)
    assert (first.length_chosen, first.length_rejected) == (len(prompt_tokens) + 3, len(prompt_tokens) + 4)

    batch = collate_preference(dataset.datums, pad_token_id=byte_tokenizer.pad_token_id)
    assert batch["is_chosen"].tolist() == [True, False, True, False]
    assert batch["idx"].tolist() == [0, 0, 1, 1]
    assert batch["sample_mask"].tolist() == [1.0] * 4
    n = len(prompt_tokens)  # 23: "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert n == 23
    assert batch["token_mask"][0].nonzero().flatten().tolist() == [n, n + 1, n + 2]  # "4<|im_end|>\n"
    assert batch["token_mask"][1].nonzero().flatten().tolist() == [n, n + 1, n + 2, n + 3]  # "5!<|im_end|>\n"
    assert byte_tokenizer.decode(batch["input_ids"][2][batch["token_mask"][2].bool()]) == "hello<|im_end|>\n"
    assert byte_tokenizer.decode(batch["input_ids"][3][batch["token_mask"][3].bool()]) == "go<|im_end|>\n"


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            {"text": "x"},
            "record 3: an SFT record needs 'messages' or both 'prompt' and 'completion' (columns: text",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}, {"content": "b"}]},
            "record 3: 'messages' message 1 has no 'role'",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}]},
            "record 3: the conversation has no assistant message",
        ),
        ({"messages": "hello"}, "record 3: 'messages' must be a non-empty list of messages, got str 'hello'"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ["b"]}]},
            "record 3: 'messages' message 1: 'content' must be a string, got list",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}
                ]
            },
            "record 3: 'messages' message 0: tool call 0 ('f') has no 'arguments'",
        ),
        ({"prompt": "a", "completion": 5}, "record 3: 'completion' must be a string, got int"),
    ],
)
def test_sft_record_errors(byte_tokenizer: PreTrainedTokenizerFast, record: dict, message: str) -> None:
    with pytest.raises(DataError) as info:
        SFTProcessor(byte_tokenizer, SFTFormat())(record, idx=3)
    assert message in str(info.value)


def test_answer_must_be_text_or_number(byte_tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(DataError, match=r"record 2: 'answer' must be a string or a number, got list \[1\]"):
        PromptAnswerProcessor(byte_tokenizer, PromptFormat())({"prompt": "p", "answer": [1]}, idx=2)


def test_tool_arguments_as_dict_render_as_json(byte_tokenizer: PreTrainedTokenizerFast) -> None:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [*TOOL_CONVERSATION[:2], {"role": "assistant", "content": "Checking.", "tool_calls": [call]}]
    log = tokenize_conversation(byte_tokenizer, messages, tools=TOOLS)
    text = byte_tokenizer.decode(log[2]["token_ids"])
    body = text.removeprefix("Checking.\n<tool_call>\n").removesuffix("\n</tool_call><|im_end|>\n")
    assert json.loads(body) == {"name": "get_weather", "arguments": {"city": "Paris"}}


def test_default_tiny_template_needs_no_special_casing(tmp_path: Path) -> None:
    # The tiny model's own ChatML template gives the same message logs as the tools template.
    tokenizer = build_tokenizer(
        ["abc"], vocab_size=261, out_dir=tmp_path, chat_template=DEFAULT_CHAT_TEMPLATE
    )
    plain = tokenize_conversation(tokenizer, SFT_CONVERSATION)
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    tools = tokenize_conversation(tokenizer, SFT_CONVERSATION)
    assert [m["token_ids"].tolist() for m in plain] == [m["token_ids"].tolist() for m in tools]


def test_processor_called_on_a_record_without_its_columns(byte_tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(DataError, match=r"record 5 has no column 'rejected' \(columns: chosen, prompt;"):
        PreferenceProcessor(byte_tokenizer, PromptFormat())({"prompt": "p", "chosen": "c"}, idx=5)
