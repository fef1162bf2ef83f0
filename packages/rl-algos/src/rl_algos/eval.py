"""Evaluation of a model directory on a dataset: pass@k and cons@k over sampled answers.

Each prompt is answered `num_tests_per_prompt` (n) times; the environment of `data.task_name`
(math by default) scores every answer and extracts its final answer. Per prompt with c correct
answers among n:

- pass@k = 1 - C(n - c, k) / C(n, k), the unbiased estimator of the probability that at least
  one of k answers drawn without replacement is correct (Chen et al., 2021);
- cons@k: majority vote over the final answers of the first k samples (samples are i.i.d., so
  this estimates the probability that a k-sample vote is right); the vote counts extracted
  answers only, compared as stripped strings, ties go to the answer seen first, and the prompt
  counts as solved when the winning answer was scored correct.

Both are averaged over prompts. `run_eval` (what `rl eval` runs) prints a table and writes the
results, per-prompt outcomes included, to a JSON file.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from pydantic import Field, model_validator

from rl_algos.backends import HFGenerationConfig
from rl_algos.config import ClusterConfig, DatasetSection
from rl_algos.data.arithmetic import ArithmeticDatasetSpec
from rl_algos.data.loading import DatasetSpec
from rl_algos.data.processors import PromptFormat
from rl_core.config import RLConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rl_algos.data.processors import DatumSpec
    from rl_algos.evaluation import ScoringEnvironments
    from rl_core.interfaces import GenerationInterface


# --------------------------------------------------------------------------------- metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of the n answers, drawn without replacement,
    include a correct one. The ratio is computed as a product, which stays exact for large n."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    all_wrong = 1.0
    for i in range(k):
        all_wrong *= (n - c - i) / (n - i)
    return 1.0 - all_wrong


def majority_answer(answers: Sequence[str | None]) -> int | None:
    """Index of the first sample whose answer wins the vote (None if no sample has an answer)."""
    counts: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for index, answer in enumerate(answers):
        if answer is None or not answer.strip():
            continue
        key = answer.strip()
        counts[key] = counts.get(key, 0) + 1
        first_seen.setdefault(key, index)
    if not counts:
        return None
    winner = max(counts, key=lambda key: (counts[key], -first_seen[key]))
    return first_seen[winner]


def cons_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """1.0 when the majority answer of the first k samples was scored correct, else 0.0."""
    if len(answers) != len(correct):
        raise ValueError(f"cons@k: {len(answers)} answers but {len(correct)} correctness flags")
    if not 1 <= k <= len(answers):
        raise ValueError(f"cons@k: need 1 <= k <= {len(answers)} (samples), got k={k}")
    winner = majority_answer(answers[:k])
    return 1.0 if winner is not None and correct[winner] else 0.0


@dataclass
class PromptOutcome:
    """The n answers to one prompt."""

    idx: int
    prompt: str
    ground_truth: Any
    rewards: list[float]
    answers: list[str | None]
    responses: list[str] = field(default_factory=list)

    @property
    def correct(self) -> list[bool]:
        # Environments score a verified answer 1 (partial credit counts as not solved).
        return [reward >= 1.0 for reward in self.rewards]

    @property
    def num_correct(self) -> int:
        return sum(self.correct)

    def to_dict(self) -> dict[str, Any]:
        return {
            "idx": self.idx,
            "prompt": self.prompt,
            "ground_truth": self.ground_truth,
            "num_correct": self.num_correct,
            "rewards": self.rewards,
            "answers": self.answers,
            "responses": self.responses,
        }


def aggregate(outcomes: Sequence[PromptOutcome], ks: Sequence[int]) -> dict[str, float]:
    """pass@k and cons@k for each k, the mean reward and the share of answers without a final
    answer, averaged over prompts."""
    if not outcomes:
        raise ValueError("no prompts were evaluated")
    metrics: dict[str, float] = {}
    for k in ks:
        metrics[f"pass@{k}"] = sum(pass_at_k(len(o.rewards), o.num_correct, k) for o in outcomes) / len(
            outcomes
        )
    for k in ks:
        metrics[f"cons@{k}"] = sum(cons_at_k(o.answers, o.correct, k) for o in outcomes) / len(outcomes)
    rewards = [reward for o in outcomes for reward in o.rewards]
    metrics["mean_reward"] = sum(rewards) / len(rewards)
    metrics["no_answer_rate"] = sum(answer is None for o in outcomes for answer in o.answers) / len(rewards)
    return metrics


# ---------------------------------------------------------------------------------- config


class EvalConfig(RLConfig):
    """The `eval` section."""

    num_tests_per_prompt: int = Field(default=1, ge=1, description="answers sampled per prompt (n)")
    pass_k: list[int] = Field(default_factory=lambda: [1], description="the k of pass@k and cons@k")
    greedy: bool = False
    max_samples: int | None = Field(default=None, ge=1, description="evaluate the first N prompts")
    prompts_per_batch: int = Field(default=64, ge=1, description="prompts per generate call (x n answers)")
    max_rollout_turns: int = Field(default=1, ge=1)
    output_file: str = "results/eval/results.json"
    save_responses: bool = Field(default=True, description="keep every response text in the JSON file")

    @model_validator(mode="after")
    def _valid_k(self) -> Self:
        bad = [k for k in self.pass_k if not 1 <= k <= self.num_tests_per_prompt]
        if bad or not self.pass_k:
            raise ValueError(
                f"pass_k must be a non-empty list of k in [1, num_tests_per_prompt={self.num_tests_per_prompt}], "
                f"got {self.pass_k}"
            )
        if self.greedy and self.num_tests_per_prompt > 1:
            raise ValueError(
                f"greedy decoding gives {self.num_tests_per_prompt} identical answers per prompt; "
                "set num_tests_per_prompt: 1 or greedy: false"
            )
        return self


def _default_dataset() -> ArithmeticDatasetSpec:
    return ArithmeticDatasetSpec(split="validation", num_samples=200, levels=[2])


class EvalDataConfig(RLConfig):
    dataset: DatasetSection = Field(default_factory=_default_dataset)
    prompt: PromptFormat = Field(default_factory=PromptFormat)
    task_name: str = Field(default="math", description="the env section that scores the answers")

    @model_validator(mode="after")
    def _prompt_answer(self) -> Self:
        if isinstance(self.dataset, ArithmeticDatasetSpec) and self.dataset.format != "prompt_answer":
            raise ValueError(
                "data.dataset: evaluation needs prompt/answer records; set format: prompt_answer"
            )
        return self


def _default_env() -> dict[str, dict[str, Any] | None]:
    return {"math": None}


class EvalMasterConfig(RLConfig):
    """A whole evaluation recipe: the model (a Hugging Face directory and its sampling settings),
    the dataset, the scoring environment and where the workers run."""

    eval: EvalConfig = Field(default_factory=EvalConfig)
    model: HFGenerationConfig
    data: EvalDataConfig = Field(default_factory=EvalDataConfig)
    env: dict[str, dict[str, Any] | None] = Field(default_factory=_default_env)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="after")
    def _task_has_env(self) -> Self:
        if self.data.task_name not in self.env:
            raise ValueError(
                f"data.task_name is {self.data.task_name!r} but the env section configures {sorted(self.env)}"
            )
        return self


# -------------------------------------------------------------------------------- evaluate


@dataclass
class EvalResult:
    metrics: dict[str, float]
    outcomes: list[PromptOutcome]
    num_tests_per_prompt: int
    wall_time_s: float

    def to_dict(self, **header: Any) -> dict[str, Any]:
        return {
            **header,
            "num_prompts": len(self.outcomes),
            "num_tests_per_prompt": self.num_tests_per_prompt,
            "metrics": self.metrics,
            "wall_time_s": self.wall_time_s,
            "per_prompt": [outcome.to_dict() for outcome in self.outcomes],
        }


def evaluate(
    generation: GenerationInterface,
    tokenizer: PreTrainedTokenizerBase,
    datums: Sequence[DatumSpec],
    environments: ScoringEnvironments,
    cfg: EvalConfig,
    max_seq_len: int,
) -> EvalResult:
    """Answer every prompt n times with `generation`, score with `environments` (rewards after
    each environment's batch post-processing, as in training), aggregate."""
    from rl_algos.data.collate import collate_datums
    from rl_algos.evaluation import post_process_rewards
    from rl_algos.rollouts import run_multi_turn_rollout

    started = time.perf_counter()
    n = cfg.num_tests_per_prompt
    pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    outcomes: list[PromptOutcome] = []
    selected = list(datums[: cfg.max_samples])
    generation.prepare_for_generation()
    for first in range(0, len(selected), cfg.prompts_per_batch):
        chunk = selected[first : first + cfg.prompts_per_batch]
        batch = collate_datums(chunk, pad_token_id).repeat_interleave(n)
        rollout = run_multi_turn_rollout(
            generation,
            batch,
            tokenizer,
            environments,
            max_rollout_turns=cfg.max_rollout_turns,
            max_seq_len=max_seq_len,
            greedy=cfg.greedy,
        )
        rewards = post_process_rewards(environments, rollout.batch)[0].tolist()
        answers = list(rollout.batch["answers"])
        logs = rollout.batch["message_log"]
        for j, datum in enumerate(chunk):
            rows = range(j * n, (j + 1) * n)
            outcomes.append(
                PromptOutcome(
                    idx=datum.idx,
                    prompt=_last_user_text(datum.message_log),
                    ground_truth=datum.extra_env_info.get("ground_truth"),
                    rewards=[float(rewards[r]) for r in rows],
                    answers=[None if answers[r] is None else str(answers[r]) for r in rows],
                    responses=[_last_assistant_text(logs[r]) for r in rows] if cfg.save_responses else [],
                )
            )
    generation.finish_generation()
    return EvalResult(aggregate(outcomes, cfg.pass_k), outcomes, n, time.perf_counter() - started)


def _last_user_text(log: Sequence[dict[str, Any]]) -> str:
    return next((str(m["content"]) for m in reversed(log) if m["role"] == "user"), "")


def _last_assistant_text(log: Sequence[dict[str, Any]]) -> str:
    return next((str(m["content"]) for m in reversed(log) if m["role"] == "assistant"), "")


def _describe(dataset: DatasetSpec | ArithmeticDatasetSpec) -> str:
    if isinstance(dataset, ArithmeticDatasetSpec):
        return f"the arithmetic task ({dataset.split}, levels {dataset.levels})"
    return dataset.describe()


def format_table(metrics: dict[str, float], title: str) -> str:
    """A two-column text table of the metrics."""
    width = max(len("metric"), *(len(key) for key in metrics))
    rule = "-" * (width + 12)
    lines = [title, rule, f"{'metric':<{width}}  {'value':>8}", rule]
    lines += [f"{key:<{width}}  {value:>8.4f}" for key, value in metrics.items()]
    lines.append(rule)
    return "\n".join(lines)


def run_eval(cfg: EvalMasterConfig) -> EvalResult:
    """Evaluate `model` on `data` as configured, print the table, write the JSON file."""
    from rl_algos.backends import make_model_generation
    from rl_algos.data.loading import load_records
    from rl_algos.data.processors import PromptAnswerProcessor, process_records
    from rl_algos.training import ClusterSet, load_tokenizer
    from rl_envs.registry import create_environments
    from rl_envs.router import EnvironmentRouter

    records = load_records(cfg.data.dataset, ("prompt", "answer"))
    tokenizer = load_tokenizer(cfg.model.tokenizer_path, "model.model_name")
    datums = process_records(records, PromptAnswerProcessor(tokenizer, cfg.data.prompt, cfg.data.task_name))
    clusters = ClusterSet(cfg.cluster)
    environments: EnvironmentRouter | None = None
    generation: GenerationInterface | None = None
    try:
        environments = EnvironmentRouter(create_environments(cfg.env))
        generation = make_model_generation(
            clusters.make_policy_cluster("eval"), cfg.model, env_vars=clusters.env_vars
        )
        result = evaluate(
            generation, tokenizer, datums.datums, environments, cfg.eval, cfg.model.max_total_sequence_length
        )
    finally:
        for component in (generation, environments):
            if component is not None:
                component.shutdown()
        clusters.shutdown()
    description = _describe(cfg.data.dataset)
    title = (
        f"{cfg.model.model_name} on {description}: {len(result.outcomes)} prompts x "
        f"{result.num_tests_per_prompt} answers ({'greedy' if cfg.eval.greedy else 'sampled'})"
    )
    print(format_table(result.metrics, title), flush=True)
    output = Path(cfg.eval.output_file)
    output.parent.mkdir(parents=True, exist_ok=True)
    payload = result.to_dict(
        model=cfg.model.model_name,
        dataset=description,
        task_name=cfg.data.task_name,
        greedy=cfg.eval.greedy,
        config=cfg.to_dict(),
    )
    output.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    print(f"results: {output}", flush=True)
    return result


__all__ = [
    "EvalConfig",
    "EvalDataConfig",
    "EvalMasterConfig",
    "EvalResult",
    "PromptOutcome",
    "aggregate",
    "cons_at_k",
    "evaluate",
    "format_table",
    "majority_answer",
    "pass_at_k",
    "run_eval",
]
