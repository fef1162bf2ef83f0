"""The data layer shared by every algorithm: loading records, turning them into tokenised
message logs, collating batches, a resumable data loader and the built-in arithmetic task."""

from rl_algos.data.arithmetic import (
    LEVELS,
    ArithmeticDatasetSpec,
    ArithmeticProblem,
    arithmetic_corpus,
    arithmetic_records,
    generate_problems,
)
from rl_algos.data.chat import (
    CHATML_TOOLS_TEMPLATE,
    ChatTemplateError,
    MessageLog,
    render_chat,
    tokenize_conversation,
    tokenize_observation,
)
from rl_algos.data.collate import (
    append_generated_message,
    append_observation,
    collate_datums,
    collate_message_logs,
    collate_preference,
    flatten_message_log,
    is_trainable,
    split_by_messages,
)
from rl_algos.data.dataloader import DATALOADER_STATE_FILE, IndexableDataset, StatefulDataLoader
from rl_algos.data.errors import DataError
from rl_algos.data.loading import AnyDatasetSpec, DatasetSpec, load_records
from rl_algos.data.processors import (
    DatumSpec,
    OverlongPolicy,
    PreferenceDatum,
    PreferenceProcessor,
    ProcessedDataset,
    PromptAnswerProcessor,
    PromptFormat,
    PromptProcessor,
    SFTFormat,
    SFTProcessor,
    process_records,
)

__all__ = [
    "CHATML_TOOLS_TEMPLATE",
    "DATALOADER_STATE_FILE",
    "LEVELS",
    "AnyDatasetSpec",
    "ArithmeticDatasetSpec",
    "ArithmeticProblem",
    "ChatTemplateError",
    "DataError",
    "DatasetSpec",
    "DatumSpec",
    "IndexableDataset",
    "MessageLog",
    "OverlongPolicy",
    "PreferenceDatum",
    "PreferenceProcessor",
    "ProcessedDataset",
    "PromptAnswerProcessor",
    "PromptFormat",
    "PromptProcessor",
    "SFTFormat",
    "SFTProcessor",
    "StatefulDataLoader",
    "append_generated_message",
    "append_observation",
    "arithmetic_corpus",
    "arithmetic_records",
    "collate_datums",
    "collate_message_logs",
    "collate_preference",
    "flatten_message_log",
    "generate_problems",
    "is_trainable",
    "load_records",
    "process_records",
    "render_chat",
    "split_by_messages",
    "tokenize_conversation",
    "tokenize_observation",
]
