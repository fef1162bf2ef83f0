"""Task formats -> tokenised message logs.

Three record formats, one processor each:

- prompt / answer (math and other verifiable tasks): the prompt becomes the conversation the
  policy answers in RL; the answer goes to the environment as `extra_env_info["ground_truth"]`.
- SFT: `prompt` / `completion` or OpenAI `messages` (with assistant `tool_calls` and `tool`
  turns, optional per-record `tools`); only assistant messages are trained on.
- preference: `prompt` / `chosen` / `rejected`, for DPO and reward models.

Records longer than `max_seq_length` tokens are filtered or truncated (with
`loss_multiplier = 0`, so they are carried but not trained on); `process_records` counts both.
"""

from __future__ import annotations

import enum
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

from pydantic import Field, field_validator

from rl_algos.data.chat import MessageLog, tokenize_conversation
from rl_algos.data.errors import DataError
from rl_core.config import RLConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class OverlongPolicy(enum.StrEnum):
    """What happens to a record longer than `max_seq_length` tokens."""

    FILTER = "filter"  # dropped from the dataset (counted)
    TRUNCATE = "truncate"  # cut to max_seq_length, kept with loss_multiplier 0 (counted)


class PromptFormat(RLConfig):
    """How a prompt string becomes the opening of a conversation, and the length limit."""

    system_prompt: str | None = None
    prompt_template: str | None = Field(
        default=None,
        description="format string with one '{}' for the prompt; write literal braces as '{{' and '}}'",
    )
    max_seq_length: int | None = Field(default=None, ge=1)
    overlong: OverlongPolicy = OverlongPolicy.FILTER

    @field_validator("prompt_template")
    @classmethod
    def _one_placeholder(cls, template: str | None) -> str | None:
        if template is None:
            return None
        try:
            fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
        except ValueError as exc:
            raise ValueError(f"prompt_template {template!r} is not a valid format string: {exc}") from None
        if fields != [""]:
            raise ValueError(
                f"prompt_template {template!r} must contain exactly one '{{}}' placeholder (found {len(fields)} "
                "fields; write literal braces as '{{' and '}}', e.g. '\\\\boxed{{}}')"
            )
        return template

    def user_content(self, prompt: str) -> str:
        return self.prompt_template.format(prompt) if self.prompt_template is not None else prompt


class SFTFormat(PromptFormat):
    """SFT processing: the prompt format plus which assistant turns are trained on."""

    train_on: Literal["all_assistant", "last_assistant"] = "all_assistant"


@dataclass
class DatumSpec:
    """One processed sample: a message log plus what the algorithm and environment need."""

    message_log: MessageLog
    length: int  # total tokens in message_log
    extra_env_info: dict[str, Any]
    loss_multiplier: float  # 0 for truncated samples (kept, never trained on)
    idx: int  # position of the record in the dataset
    task_name: str
    truncated: bool = False


@dataclass
class PreferenceDatum:
    """A prompt with a chosen and a rejected continuation (both full message logs)."""

    chosen: MessageLog
    rejected: MessageLog
    length_chosen: int
    length_rejected: int
    loss_multiplier: float
    idx: int
    task_name: str = "preference"
    truncated: bool = False


DatumT = TypeVar("DatumT", DatumSpec, PreferenceDatum)
DatumT_co = TypeVar("DatumT_co", DatumSpec, PreferenceDatum, covariant=True)


class RecordProcessor(Protocol[DatumT_co]):
    """Turns one record into a datum, or None when the record is filtered as too long."""

    required_columns: tuple[str, ...]

    def __call__(self, record: Mapping[str, Any], idx: int) -> DatumT_co | None: ...


@dataclass
class ProcessedDataset(Generic[DatumT]):
    """The processed records, with how many were filtered or truncated for length."""

    datums: list[DatumT]
    num_records: int
    num_filtered: int
    num_truncated: int

    def __len__(self) -> int:
        return len(self.datums)

    def __getitem__(self, index: int) -> DatumT:
        return self.datums[index]

    def summary(self) -> dict[str, int]:
        return {
            "num_records": self.num_records,
            "num_kept": len(self.datums),
            "num_filtered_overlong": self.num_filtered,
            "num_truncated_overlong": self.num_truncated,
        }


def process_records(
    records: Sequence[Mapping[str, Any]], processor: Callable[[Mapping[str, Any], int], DatumT | None]
) -> ProcessedDataset[DatumT]:
    """Process every record up front (so a bad one stops the run before training)."""
    datums: list[DatumT] = []
    filtered = 0
    for idx, record in enumerate(records):
        datum = processor(record, idx)
        if datum is None:
            filtered += 1
        else:
            datums.append(datum)
    if not datums:
        raise DataError(
            f"no records left after processing: all {len(records)} were longer than max_seq_length and filtered"
            if records
            else "the dataset has no records"
        )
    truncated = sum(1 for d in datums if d.truncated)
    return ProcessedDataset(datums, num_records=len(records), num_filtered=filtered, num_truncated=truncated)


class PromptAnswerProcessor:
    """prompt + answer -> the prompt conversation (ending in the assistant header) and
    `extra_env_info = {"ground_truth": answer}` for the verifying environment."""

    required_columns = ("prompt", "answer")

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, fmt: PromptFormat, task_name: str = "math"
    ) -> None:
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.task_name = task_name

    def __call__(self, record: Mapping[str, Any], idx: int) -> DatumSpec | None:
        _require_columns(record, self.required_columns, idx)
        messages = prompt_messages(record["prompt"], self.fmt, idx)
        ground_truth = _answer_text(record["answer"], idx)
        log = tokenize_conversation(self.tokenizer, messages, add_generation_prompt=True)
        return _datum(log, {"ground_truth": ground_truth}, idx, self.task_name, self.fmt)


class PromptProcessor:
    """prompt -> the prompt conversation (ending in the assistant header), for tasks that only
    generate from prompts (on-policy distillation); other columns are ignored."""

    required_columns = ("prompt",)

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, fmt: PromptFormat, task_name: str = "prompt"
    ) -> None:
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.task_name = task_name

    def __call__(self, record: Mapping[str, Any], idx: int) -> DatumSpec | None:
        _require_columns(record, self.required_columns, idx)
        messages = prompt_messages(record["prompt"], self.fmt, idx)
        log = tokenize_conversation(self.tokenizer, messages, add_generation_prompt=True)
        return _datum(log, {}, idx, self.task_name, self.fmt)


class SFTProcessor:
    """prompt/completion or OpenAI-messages records -> message logs with trainable assistant turns."""

    required_columns: tuple[str, ...] = ()  # `messages`, or `prompt` and `completion`: checked per record

    def __init__(self, tokenizer: PreTrainedTokenizerBase, fmt: SFTFormat, task_name: str = "sft") -> None:
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.task_name = task_name

    def __call__(self, record: Mapping[str, Any], idx: int) -> DatumSpec | None:
        if "messages" in record:
            messages = prompt_messages(record["messages"], self.fmt, idx, column="messages", allow_text=False)
        elif "prompt" in record and "completion" in record:
            completion = record["completion"]
            if not isinstance(completion, str):
                raise DataError(
                    f"record {idx}: 'completion' must be a string, got {type(completion).__name__}"
                )
            messages = [
                *prompt_messages(record["prompt"], self.fmt, idx),
                {"role": "assistant", "content": completion},
            ]
        else:
            raise DataError(
                f"record {idx}: an SFT record needs 'messages' or both 'prompt' and 'completion' "
                f"(columns: {', '.join(sorted(record))}; rename columns with column_mapping)"
            )
        tools = _tools(record, idx)
        log = tokenize_conversation(self.tokenizer, messages, tools=tools)
        assistant = [i for i, m in enumerate(log) if m["role"] == "assistant"]
        if not assistant:
            raise DataError(f"record {idx}: the conversation has no assistant message to train on")
        trained = assistant if self.fmt.train_on == "all_assistant" else assistant[-1:]
        for i in trained:
            log[i]["trainable"] = True
        return _datum(log, {}, idx, self.task_name, self.fmt)


class PreferenceProcessor:
    """prompt / chosen / rejected -> two message logs sharing the prompt; the responses'
    assistant turns are trainable. Each of the three may be a string or a list of messages."""

    required_columns = ("prompt", "chosen", "rejected")

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, fmt: PromptFormat, task_name: str = "preference"
    ) -> None:
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.task_name = task_name

    def __call__(self, record: Mapping[str, Any], idx: int) -> PreferenceDatum | None:
        _require_columns(record, self.required_columns, idx)
        prompt = prompt_messages(record["prompt"], self.fmt, idx)
        chosen = self._response_log(prompt, record["chosen"], "chosen", idx)
        rejected = self._response_log(prompt, record["rejected"], "rejected", idx)
        fitted = fit_length([chosen, rejected], self.fmt)
        if fitted is None:
            return None
        (chosen, rejected), truncated = fitted
        return PreferenceDatum(
            chosen=chosen,
            rejected=rejected,
            length_chosen=message_log_length(chosen),
            length_rejected=message_log_length(rejected),
            loss_multiplier=0.0 if truncated else 1.0,
            idx=idx,
            task_name=self.task_name,
            truncated=truncated,
        )

    def _response_log(self, prompt: list[dict[str, Any]], response: Any, column: str, idx: int) -> MessageLog:
        if isinstance(response, str):
            turns: list[dict[str, Any]] = [{"role": "assistant", "content": response}]
        elif isinstance(response, Mapping):
            turns = validate_messages([response], idx, column)
        else:
            turns = validate_messages(response, idx, column)
        if not any(t["role"] == "assistant" for t in turns):
            raise DataError(f"record {idx}: '{column}' has no assistant message")
        log = tokenize_conversation(self.tokenizer, [*prompt, *turns])
        for message in log[len(prompt) :]:
            if message["role"] == "assistant":
                message["trainable"] = True
        return log


def _datum(
    log: MessageLog, extra_env_info: dict[str, Any], idx: int, task_name: str, fmt: PromptFormat
) -> DatumSpec | None:
    fitted = fit_length([log], fmt)
    if fitted is None:
        return None
    (log,), truncated = fitted
    return DatumSpec(
        message_log=log,
        length=message_log_length(log),
        extra_env_info=extra_env_info,
        loss_multiplier=0.0 if truncated else 1.0,
        idx=idx,
        task_name=task_name,
        truncated=truncated,
    )


def prompt_messages(
    prompt: Any, fmt: PromptFormat, idx: int, column: str = "prompt", allow_text: bool = True
) -> list[dict[str, Any]]:
    """The opening of a conversation: a prompt string (formatted, after the optional system
    prompt) or a list of messages (the system prompt is added when it has none)."""
    if allow_text and isinstance(prompt, str):
        messages: list[dict[str, Any]] = [{"role": "user", "content": fmt.user_content(prompt)}]
    else:
        messages = validate_messages(prompt, idx, column)
    if fmt.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": fmt.system_prompt})
    return messages


def validate_messages(messages: Any, idx: int, column: str = "messages") -> list[dict[str, Any]]:
    """Check an OpenAI-format message list; errors name the record, column and message."""
    where = f"record {idx}: '{column}'"
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where} must be a non-empty list of messages, got {_describe(messages)}")
    checked: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        at = f"{where} message {i}"
        if not isinstance(message, Mapping):
            raise DataError(f"{at} must be an object with 'role' and 'content', got {_describe(message)}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise DataError(f"{at} has no 'role' string (keys: {', '.join(sorted(message))})")
        content = message.get("content")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise DataError(f"{at}: only assistant messages may have 'tool_calls' (role is '{role}')")
            _check_tool_calls(tool_calls, at)
        if content is None and not tool_calls:
            raise DataError(f"{at} (role '{role}') has no 'content'")
        if content is not None and not isinstance(content, str):
            raise DataError(f"{at}: 'content' must be a string, got {_describe(content)}")
        checked.append(dict(message))
    return checked


def _check_tool_calls(tool_calls: Any, at: str) -> None:
    if not isinstance(tool_calls, list) or not tool_calls:
        raise DataError(f"{at}: 'tool_calls' must be a non-empty list, got {_describe(tool_calls)}")
    for j, call in enumerate(tool_calls):
        function = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise DataError(f"{at}: tool call {j} has no function 'name'")
        if "arguments" not in function:
            raise DataError(f"{at}: tool call {j} ('{function['name']}') has no 'arguments'")


def _tools(record: Mapping[str, Any], idx: int) -> list[dict[str, Any]] | None:
    tools = record.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise DataError(
            f"record {idx}: 'tools' must be a list of tool schemas (objects), got {_describe(tools)}"
        )
    return [dict(t) for t in tools]


def _require_columns(record: Mapping[str, Any], columns: Sequence[str], idx: int) -> None:
    missing = [c for c in columns if c not in record]
    if missing:
        raise DataError(
            f"record {idx} has no column '{missing[0]}' (columns: {', '.join(sorted(record))}; "
            "rename columns with column_mapping)"
        )


def _answer_text(answer: Any, idx: int) -> str:
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise DataError(f"record {idx}: 'answer' must be a string or a number, got {_describe(answer)}")
    return str(answer)


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def message_log_length(log: MessageLog) -> int:
    return sum(int(m["token_ids"].numel()) for m in log)


def truncate_message_log(log: MessageLog, max_tokens: int) -> MessageLog:
    """The first `max_tokens` tokens of `log`: later messages dropped, the last one cut.
    Cut messages keep their (full) `content`; only `token_ids` (and per-token fields) shrink."""
    kept: MessageLog = []
    remaining = max_tokens
    for message in log:
        if remaining <= 0:
            break
        n = int(message["token_ids"].numel())
        if n <= remaining:
            kept.append(message)
        else:
            cut = dict(message)
            cut["token_ids"] = message["token_ids"][:remaining]
            if "generation_logprobs" in message:
                cut["generation_logprobs"] = message["generation_logprobs"][:remaining]
            kept.append(cut)
        remaining -= n
    return kept


def fit_length(logs: Sequence[MessageLog], fmt: PromptFormat) -> tuple[list[MessageLog], bool] | None:
    """Apply `fmt`'s length limit to the logs of one sample (a preference pair has two):
    `(logs, truncated)`, or None when the sample is filtered. One log over the limit decides
    for the whole sample, so a pair is never split."""
    limit = fmt.max_seq_length
    if limit is None or all(message_log_length(log) <= limit for log in logs):
        return list(logs), False
    if fmt.overlong is OverlongPolicy.FILTER:
        return None
    return [truncate_message_log(log, limit) for log in logs], True
