"""Helpers of the SFT / DPO / RM / distillation / eval tests: tiny models with an arithmetic
tokenizer, recipes loaded the way `rl` loads them, and reading the logged metrics."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from rl_algos.cli import packaged_recipe
from rl_algos.data.arithmetic import arithmetic_corpus
from rl_algos.models.tiny import build_tiny_causal_lm, build_tokenizer
from rl_core.config import load_validated_config
from rl_core.logging import read_metrics_jsonl

M = TypeVar("M", bound=BaseModel)


def build_arithmetic_tokenizer(out_dir: Path) -> Path:
    """One token per digit, merges learnt from the arithmetic task's text (as the recipes' base model)."""
    build_tokenizer(arithmetic_corpus(500, levels=[1, 2]), 320, out_dir, split_digits=True)
    return out_dir


def build_model(tokenizer_dir: Path, out_dir: Path, **sizes: Any) -> Path:
    """A randomly initialised tiny Qwen2 sized to the tokenizer (hidden 64, 2 layers by default)."""
    sizes.setdefault("hidden_size", 64)
    sizes.setdefault("intermediate_size", 2 * sizes["hidden_size"])
    sizes.setdefault("max_position_embeddings", 128)
    return build_tiny_causal_lm(tokenizer_dir, out_dir, **sizes)


def load_recipe(name: str, schema: type[M], overrides: Sequence[str]) -> M:
    """A packaged recipe with command-line style overrides, validated like `rl` does."""
    return load_validated_config(packaged_recipe(name), schema, list(overrides))


def run_overrides(
    tmp_path: Path, model_dir: Path, tag: str = "run", drop_base_model: bool = True
) -> list[str]:
    """Overrides that point a tiny recipe at a local model and keep its outputs under tmp_path."""
    return [
        *(["~base_model"] if drop_base_model else []),
        f"policy.model_name={model_dir}",
        f"logger.log_dir={tmp_path / tag / 'logs'}",
        "logger.console=false",
        f"checkpointing.checkpoint_dir={tmp_path / 'checkpoints'}",
        "cluster.cpus_per_worker=1",
    ]


def metrics_by_step(log_dir: Path, prefix: str) -> dict[int, dict[str, Any]]:
    """`{step: {name: value}}` of the metrics logged under `prefix` (names without the prefix)."""
    out: dict[int, dict[str, Any]] = {}
    for record in read_metrics_jsonl(log_dir / "metrics.jsonl"):
        if record["prefix"] != prefix:
            continue
        values = {key.removeprefix(f"{prefix}/"): value for key, value in record.items()}
        out.setdefault(int(record["step"]), {}).update(values)
    return out


def drop_checkpoints_after(checkpoint_dir: Path, step: int) -> None:
    """Delete every `step_N` with N > step, as if the run had been cut off after `step`."""
    for path in checkpoint_dir.iterdir():
        if path.name.startswith("step_") and int(path.name.removeprefix("step_")) > step:
            shutil.rmtree(path)


def training_info(checkpoint: Path) -> dict[str, Any]:
    info: dict[str, Any] = json.loads((checkpoint / "training_info.json").read_text())
    return info


# Per-step values that depend on wall time, not on the computation.
TIMING_PREFIXES = ("timing/", "throughput/")


def assert_same_step_metrics(first: dict[str, Any], second: dict[str, Any], rel: float = 1e-5) -> None:
    """The numeric metrics of one step of two runs agree (timings excluded)."""
    import pytest

    keys = sorted(
        key
        for key, value in first.items()
        if isinstance(value, int | float)
        and not key.startswith(TIMING_PREFIXES)
        and key not in ("step", "time")
    )
    assert keys, "no metrics to compare"
    for key in keys:
        assert key in second, f"{key} missing from the resumed run"
        assert second[key] == pytest.approx(first[key], rel=rel, abs=1e-7), key


def write_style_preferences(path: Path, num_pairs: int, split: str, seed: int) -> Path:
    """A synthetic preference set: arithmetic prompts, a direct answer preferred to a refusal."""
    from rl_algos.data.arithmetic import generate_problems

    problems = generate_problems(num_pairs, split=split, levels=[1, 2], seed=seed)  # type: ignore[arg-type]
    records = [
        {"prompt": p.prompt, "chosen": f"The answer is {p.answer}.", "rejected": "I do not know."}
        for p in problems
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def sft_in_process(model_dir: Path, out_dir: Path, steps: int, seed: int = 0, lr: float = 3e-3) -> Path:
    """A plain PyTorch SFT loop (no Ray) on the arithmetic task's worked solutions: a cheap way
    to get a model that answers sensibly (a teacher, a model to evaluate)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_algos.data.arithmetic import generate_problems
    from rl_algos.data.collate import collate_datums
    from rl_algos.data.processors import SFTFormat, SFTProcessor, process_records
    from rl_algos.losses import NLLLossFn

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    problems = generate_problems(1024, levels=[1], seed=seed, validation_fraction=0.2)
    data = process_records([p.to_sft_record() for p in problems], SFTProcessor(tokenizer, SFTFormat()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    loss_fn = NLLLossFn()
    model.train()
    for _ in range(steps):
        rows = torch.randint(0, len(data), (32,), generator=generator).tolist()
        batch = collate_datums([data[i] for i in rows], int(tokenizer.pad_token_id))
        mask = (torch.arange(batch["input_ids"].shape[1])[None, :] < batch["input_lengths"][:, None]).long()
        logits = model(input_ids=batch["input_ids"], attention_mask=mask).logits
        loss, _ = loss_fn(logits, batch, 32, batch["token_mask"][:, 1:].sum())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
