"""Single-turn math environment: reward 1 when the final answer equals the ground truth."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from rl_core.interfaces import EnvironmentInterface, EnvironmentReturn, MessageLog
from rl_envs.base import (
    EnvConfig,
    batch_message_logs,
    batch_rewards,
    check_batch,
    last_assistant_text,
    make_return,
    mean,
    required_field,
    response_length,
    validate_config,
)
from rl_envs.math_grader import (
    ExtractionMode,
    GroundTruthError,
    MathGrade,
    extract_answer,
    grade_response,
    verify_answer,
)
from rl_envs.pool import TaskError, TaskTimeout, WorkerPool

logger = logging.getLogger(__name__)


class MathEnvConfig(EnvConfig):
    num_workers: int = Field(default=2, ge=1, description="verifier processes working on a batch in parallel")
    extraction: ExtractionMode = Field(
        default="auto", description="auto: boxed, ####, 'answer is', last number"
    )
    verify_timeout_s: int = Field(default=5, ge=1, description="math_verify's own per-comparison timeout")
    sample_timeout_s: float = Field(
        default=20.0, gt=0, description="hard limit per sample; the worker is killed"
    )


class MathVerifier:
    """Grades in a `WorkerPool`, so a verification that hangs is killed after
    ``sample_timeout_s`` (reward 0) without stalling the batch or the caller."""

    def __init__(self, num_workers: int, verify_timeout_s: int, sample_timeout_s: float) -> None:
        self.verify_timeout_s = verify_timeout_s
        self.sample_timeout_s = sample_timeout_s
        self.pool = WorkerPool(num_workers, preload=("rl_envs.math_grader:warm_up",))

    def _outcomes(self, fn: Any, arg_tuples: list[tuple[Any, ...]]) -> list[Any]:
        """Results in order; None where the sample timed out or its worker failed."""
        outcomes: list[Any] = []
        for i, outcome in enumerate(self.pool.map(fn, arg_tuples, self.sample_timeout_s)):
            if isinstance(outcome, TaskTimeout):
                logger.warning("math: sample %d exceeded %.1f s; reward 0", i, outcome.timeout_s)
                outcome = None
            elif isinstance(outcome, TaskError):
                if outcome.message.startswith(GroundTruthError.__name__):
                    raise GroundTruthError(f"sample {i}: {outcome.message.partition(': ')[2]}")
                logger.error("math: grading sample %d failed (%s); reward 0", i, outcome.message)
                outcome = None
            outcomes.append(outcome)
        return outcomes

    def grade_responses(
        self, responses: list[str], ground_truths: list[str], extraction: ExtractionMode
    ) -> list[MathGrade]:
        """Extract the final answer of each full response and check it."""
        args = [(r, gt, extraction, self.verify_timeout_s) for r, gt in zip(responses, ground_truths)]
        grades = []
        for response, outcome in zip(responses, self._outcomes(grade_response, args)):
            if outcome is None:
                answer = extract_answer(response, extraction)
                outcome = MathGrade(0.0, False, answer is None, answer)
            grades.append(outcome)
        return grades

    def check_answers(self, answers: list[str], ground_truths: list[str]) -> list[bool]:
        """Whether each already-isolated answer equals its ground truth."""
        args = [(a, gt, self.verify_timeout_s) for a, gt in zip(answers, ground_truths)]
        return [bool(outcome) for outcome in self._outcomes(verify_answer, args)]

    def shutdown(self) -> None:
        self.pool.shutdown()


class MathEnvironment(EnvironmentInterface):
    """Grades the last assistant message against ``metadata[i]["ground_truth"]`` (reward 1/0)."""

    config_class = MathEnvConfig
    name = "math"

    def __init__(self, config: MathEnvConfig | Mapping[str, Any] | None = None) -> None:
        self.config = validate_config(MathEnvConfig, config, "env.math")
        cfg = self.config
        self.verifier = MathVerifier(cfg.num_workers, cfg.verify_timeout_s, cfg.sample_timeout_s)

    def grade(self, responses: list[str], ground_truths: list[str]) -> list[MathGrade]:
        return self.verifier.grade_responses(responses, ground_truths, self.config.extraction)

    def step(self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        check_batch(message_log_batch, metadata, self.name)
        responses = [last_assistant_text(log) for log in message_log_batch]
        truths = [str(required_field(m, "ground_truth", i, self.name)) for i, m in enumerate(metadata)]
        grades = self.grade(responses, truths)
        n = len(grades)
        return make_return(
            observations=[
                {"role": "environment", "content": "correct" if g.correct else "incorrect"} for g in grades
            ],
            metadata=[None] * n,
            next_stop_strings=[None] * n,
            rewards=[g.reward for g in grades],
            terminateds=[True] * n,
            answers=[g.answer for g in grades],
        )

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        """Metrics of a finished rollout batch (keys ``rewards``, optional ``message_log``).

        accuracy: mean of the 0/1 rewards; format_error_rate: share of responses with no
        extractable answer; mean_response_length: tokens (characters without token ids).
        """
        rewards = batch_rewards(batch)
        metrics: dict[str, Any] = {"accuracy": float(rewards.mean()) if rewards.numel() else 0.0}
        logs = batch_message_logs(batch)
        if logs is not None:
            texts = [last_assistant_text(log) for log in logs]
            missing = [extract_answer(t, self.config.extraction) is None for t in texts]
            metrics["format_error_rate"] = mean([float(m) for m in missing])
            metrics["mean_response_length"] = mean([float(response_length(log)) for log in logs])
        return batch, metrics

    def shutdown(self) -> None:
        self.verifier.shutdown()
