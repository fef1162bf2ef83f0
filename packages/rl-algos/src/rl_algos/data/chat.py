"""Turning conversations into message logs with exact per-message token ids.

A message log is a list of `{role, content, token_ids}` dicts (DESIGN.md §3) whose token ids,
concatenated, are the model's input sequence. Training masks are built per message (only
assistant tokens are trained on), so each message's token ids must be exactly the tokens the
chat template gives that message inside the whole conversation.

How the split is made: the template renders growing prefixes of the conversation, and each
message gets the text its prefix adds. The assistant header (the generation prompt, e.g.
`<|im_start|>assistant\\n`) is rendered with the message *before* an assistant message, because
at generation time it is part of the prompt; an assistant message therefore holds its content,
its end-of-turn token and whatever the template writes after that token (ChatML's `\\n`).
That trailing glue is deterministic and never reached at generation time (generation stops at
the end-of-turn token), so training on it is harmless; in multi-turn rollouts the generated
message ends at the end-of-turn token and the glue opens the next observation instead
(`tokenize_observation`). The flattened sequence is the same either way.

Caveats, checked rather than assumed:
- The template must be prefix-stable: rendering the first k messages (with the generation
  prompt when message k is an assistant turn) must be a prefix of rendering all of them.
  Templates that rewrite earlier turns depending on later ones (e.g. dropping the reasoning of
  earlier assistant turns) fail this with a `ChatTemplateError` naming the message.
- Each message's text is tokenised on its own; `verify=True` checks that the concatenation
  equals the template applied to the whole conversation (`apply_chat_template(tokenize=True)`).
  ChatML and Llama-style templates put message boundaries at special tokens or newlines, where
  byte-level BPE never merges across, so they pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from rl_algos.data.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]
MessageLog = list[Message]

# Roles that chat templates do not know, rendered as one they do.
DEFAULT_ROLE_ALIASES: Mapping[str, str] = {"environment": "user"}

# Keys a message log carries for training; never shown to the chat template.
_INTERNAL_KEYS = frozenset({"token_ids", "generation_logprobs", "trainable"})

# ChatML with OpenAI-style tools: the tools are listed in the system turn, an assistant turn's
# tool calls follow its content as `<tool_call>{json}</tool_call>` blocks, tool results are
# `tool` turns. Without tools it renders exactly like plain ChatML
# (`<|im_start|>{role}\n{content}<|im_end|>\n` per message).
CHATML_TOOLS_TEMPLATE = (
    "{%- set ns = namespace(start=0) -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] + '\\n\\n' -}}{%- set ns.start = 1 -%}"
    "{%- endif -%}"
    '{{- \'You can call these tools; to call one, write <tool_call>{"name": ..., "arguments": ...}</tool_call>.\\n<tools>\' -}}'
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages[ns.start:] -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] -%}{{- message['content'] -}}{%- endif -%}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- if message['content'] or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
    "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class ChatTemplateError(DataError):
    """The chat template cannot give exact per-message token ids for a conversation."""


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    verify: bool = True,
    role_aliases: Mapping[str, str] = DEFAULT_ROLE_ALIASES,
) -> MessageLog:
    """A message log for `messages`: each message's fields plus its `token_ids` (int64, 1-D).

    `add_generation_prompt` appends the assistant header to the last message (for prompts the
    model is to answer). `content: None` (an assistant turn with only tool calls) becomes "".
    """
    if not messages:
        raise DataError("cannot tokenise an empty conversation")
    views = [_template_view(message, role_aliases) for message in messages]
    segments: list[str] = []
    rendered = ""
    for i in range(len(views)):
        last = i == len(views) - 1
        with_header = add_generation_prompt if last else views[i + 1]["role"] == "assistant"
        text = render_chat(tokenizer, views[: i + 1], add_generation_prompt=with_header, tools=tools)
        if not text.startswith(rendered):
            raise ChatTemplateError(
                f"chat template is not prefix-stable at message {i} (role '{views[i]['role']}'): rendering the "
                f"conversation up to it rewrites earlier text ({_first_difference(rendered, text)}); per-message "
                "token ids (and so an exact assistant mask) need a template that only appends"
            )
        segments.append(text[len(rendered) :])
        rendered = text

    token_ids = [encode_text(tokenizer, segment) for segment in segments]
    if verify:
        _verify_concatenation(tokenizer, views, token_ids, add_generation_prompt, tools)
    log: MessageLog = []
    for message, ids in zip(messages, token_ids, strict=True):
        entry = {key: value for key, value in message.items() if key not in _INTERNAL_KEYS}
        entry["content"] = message.get("content") or ""
        entry["token_ids"] = torch.tensor(ids, dtype=torch.long)
        log.append(entry)
    return log


def tokenize_observation(
    tokenizer: PreTrainedTokenizerBase,
    message_log: Sequence[Mapping[str, Any]],
    observation: Mapping[str, Any],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    role_aliases: Mapping[str, str] = DEFAULT_ROLE_ALIASES,
) -> torch.Tensor:
    """The token ids that append `observation` (an environment, tool or user turn) to a rollout.

    The ids are whatever the chat template writes after the tokens already in `message_log`
    (whose last message is usually a generated assistant turn ending at the end-of-turn token):
    the template's glue after that turn, the observation's turn, and — with
    `add_generation_prompt` — the next assistant header. When the generated text differs from
    what the template would render for it (a template that trims content, say), the glue cannot
    be recovered and the observation's own turn is appended as the template renders it after
    the conversation.
    """
    history = [_template_view(message, role_aliases) for message in message_log]
    views = [*history, _template_view(observation, role_aliases)]
    full = render_chat(tokenizer, views, add_generation_prompt=add_generation_prompt, tools=tools)
    flat = [int(t) for message in message_log for t in message["token_ids"].tolist()]
    so_far = str(tokenizer.decode(flat, skip_special_tokens=False, clean_up_tokenization_spaces=False))
    if full.startswith(so_far):
        return torch.tensor(encode_text(tokenizer, full[len(so_far) :]), dtype=torch.long)
    history_text = render_chat(tokenizer, history, add_generation_prompt=False, tools=tools)
    if not full.startswith(history_text):
        raise ChatTemplateError(
            f"chat template is not prefix-stable when appending a '{views[-1]['role']}' turn "
            f"({_first_difference(history_text, full)})"
        )
    return torch.tensor(encode_text(tokenizer, full[len(history_text) :]), dtype=torch.long)


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The chat template's text for `messages` (as given: no aliasing, no key filtering)."""
    if tokenizer.chat_template is None:
        raise ChatTemplateError(f"tokenizer {type(tokenizer).__name__} has no chat template")
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except Exception as exc:  # jinja raises its own types (and templates call raise_exception)
        roles = ", ".join(str(m.get("role")) for m in messages)
        raise ChatTemplateError(
            f"chat template failed on a conversation with roles [{roles}]: {exc}"
        ) from None
    if not isinstance(text, str):
        raise ChatTemplateError(f"chat template rendered {type(text).__name__}, expected text")
    return text


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of `text` exactly as written (special-token strings become special tokens;
    no BOS/EOS added — chat templates write those themselves)."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _template_view(message: Mapping[str, Any], role_aliases: Mapping[str, str]) -> dict[str, Any]:
    if "role" not in message:
        raise DataError(f"message has no 'role' (keys: {', '.join(sorted(message))})")
    view = {key: value for key, value in message.items() if key not in _INTERNAL_KEYS}
    view["role"] = role_aliases.get(message["role"], message["role"])
    view["content"] = message.get("content") or ""
    return view


def _verify_concatenation(
    tokenizer: PreTrainedTokenizerBase,
    views: list[dict[str, Any]],
    token_ids: list[list[int]],
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None,
) -> None:
    whole = tokenizer.apply_chat_template(
        views,
        tools=[dict(t) for t in tools] if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
    )
    concatenated = [t for ids in token_ids for t in ids]
    if concatenated == list(whole):
        return
    position = next(
        (p for p, (a, b) in enumerate(zip(concatenated, whole)) if a != b), min(len(concatenated), len(whole))
    )
    ends = [sum(len(ids) for ids in token_ids[: i + 1]) for i in range(len(token_ids))]
    message = next((i for i, end in enumerate(ends) if position < end), len(ends) - 1)
    raise ChatTemplateError(
        f"tokenising the conversation message by message differs from tokenising it whole at token {position} "
        f"(message {message}, role '{views[message]['role']}'): the template joins two messages inside one token, "
        f"so per-message token ids cannot be exact ({len(concatenated)} vs {len(whole)} tokens)"
    )


def _first_difference(before: str, after: str) -> str:
    position = next(
        (i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after))
    )
    return f"at character {position}: {before[position : position + 30]!r} became {after[position : position + 30]!r}"
