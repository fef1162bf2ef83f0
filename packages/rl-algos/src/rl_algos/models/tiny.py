"""Tiny, locally built language models for tests, examples and CPU runs.

No model hub is reachable from our machines, so every model the test-suite and the default
CPU recipe use is built here: a byte-level BPE tokenizer trained on a small corpus with
`tokenizers`, and a randomly initialised Hugging Face causal LM (Qwen2 or Llama architecture)
sized to that tokenizer. Both are saved with `save_pretrained`, so every backend loads them with
the ordinary `from_pretrained` code path.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|im_end|>"
IM_START_TOKEN = "<|im_start|>"
END_OF_TEXT_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, END_OF_TEXT_TOKEN)

# ChatML-style: every turn is `<|im_start|>{role}\n{content}<|im_end|>\n`; an assistant turn ends
# with the eos token, so generation stops where a turn ends.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

Architecture = Literal["qwen2", "llama"]


def arithmetic_corpus(num_lines: int = 2000, seed: int = 0) -> list[str]:
    """A small deterministic English + arithmetic corpus to train the tiny tokenizer on."""
    rng = random.Random(seed)
    templates = (
        "What is {a} + {b}? The answer is {s}.",
        "Compute {a} plus {b}. Answer: {s}",
        "If you have {a} apples and get {b} more, you have {s} apples.",
        "Q: {a} + {b} = ? A: {s}",
    )
    lines = []
    for _ in range(num_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        lines.append(rng.choice(templates).format(a=a, b=b, s=a + b))
    return lines


def build_tokenizer(
    corpus: Iterable[str],
    vocab_size: int,
    out_dir: str | Path,
    chat_template: str | None = None,
    split_digits: bool = False,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `corpus` and save it to `out_dir`.

    The vocabulary holds the 256 byte symbols, the special tokens (pad, bos, eos = `<|im_end|>`,
    `<|im_start|>`, `<|endoftext|>`) and merges learnt from the corpus, up to `vocab_size`
    entries (fewer when the corpus has no more merges to offer). Every string is encodable.
    With `split_digits` every digit is its own token (no merges across digits), which makes
    arithmetic learnable digit by digit for a tiny model.
    """
    minimum = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level tokenizer needs at least {minimum} entries "
            f"(256 byte symbols + {len(SPECIAL_TOKENS)} special tokens)"
        )
    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, END_OF_TEXT_TOKEN],
        chat_template=chat_template if chat_template is not None else DEFAULT_CHAT_TEMPLATE,
    )
    wrapped.padding_side = "right"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out)
    return wrapped


def build_tiny_causal_lm(
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    arch: Architecture = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """Save a randomly initialised causal LM sized to the tokenizer in `tokenizer_dir`.

    `out_dir` receives the weights (safetensors), the config and a copy of the tokenizer, so
    `AutoModelForCausalLM.from_pretrained(out_dir)` and `AutoTokenizer.from_pretrained(out_dir)`
    both work. The weights depend only on the arguments (`seed` fixes the initialisation).
    """
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}")
    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    config: Qwen2Config | LlamaConfig
    if arch == "qwen2":
        config = Qwen2Config(**common)
    elif arch == "llama":
        config = LlamaConfig(**common)
    else:
        raise ValueError(f"unknown architecture {arch!r}; expected one of 'qwen2', 'llama'")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
