"""Single-turn code environment: run the model's Python against test cases in the sandbox.

Test cases come in ``metadata[i]["tests"]``, a list of either
``{"input": "<stdin>", "output": "<expected stdout>"}`` (the program is run with that stdin and
its stdout compared line by line, trailing whitespace ignored) or
``{"assert": "assert add(1, 2) == 3"}`` (the statement is appended to the program; the test
passes when it runs to completion). Reward = fraction of tests passed.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
from rl_envs.sandbox import Sandbox, SandboxConfig, SandboxResult

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = ("", "python", "py", "python3")


class CodeEnvConfig(EnvConfig):
    num_workers: int = Field(default=4, ge=1, description="sandboxed runs in parallel")
    require_code_block: bool = Field(
        default=True, description="no ```python block -> format error (else: whole reply)"
    )
    sandbox: SandboxConfig = Field(default_factory=lambda: SandboxConfig())


def extract_code(text: str, require_code_block: bool = True) -> str | None:
    """The last fenced Python (or untagged) code block; None when there is none."""
    if not isinstance(text, str):
        return None
    blocks = [body for tag, body in _FENCE.findall(text) if tag.lower() in _PYTHON_TAGS]
    if blocks:
        return blocks[-1] if blocks[-1].strip() else None
    if not require_code_block and text.strip():
        return text
    return None


def _normalise_output(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


@dataclass(frozen=True)
class CodeTest:
    stdin: str | None = None
    expected_stdout: str | None = None
    assertion: str | None = None

    @staticmethod
    def parse(raw: Any, where: str) -> CodeTest:
        if isinstance(raw, Mapping):
            if "assert" in raw and isinstance(raw["assert"], str):
                return CodeTest(assertion=raw["assert"])
            if "input" in raw and "output" in raw:
                return CodeTest(stdin=str(raw["input"]), expected_stdout=str(raw["output"]))
        raise ValueError(
            f"{where}: a test must be {{'input': str, 'output': str}} or {{'assert': str}}, got {raw!r}"
        )


def build_program(code: str, test: CodeTest) -> tuple[str, str, str | None]:
    """(source, stdin, completion marker): an assert test must print the marker at the very end,
    so a program that exits early (``os._exit(0)``) before the assertions ran does not pass."""
    if test.assertion is None:
        return code, test.stdin or "", None
    marker = f"tests-completed-{secrets.token_hex(16)}"
    return f"{code}\n\n{test.assertion}\nprint({marker!r})\n", "", marker


def passed_test(test: CodeTest, result: SandboxResult, marker: str | None) -> bool:
    if not result.ok:
        return False
    if marker is not None:
        lines = _normalise_output(result.stdout)
        return bool(lines) and lines[-1] == marker
    return _normalise_output(result.stdout) == _normalise_output(test.expected_stdout or "")


class CodeEnvironment(EnvironmentInterface):
    """Reward = fraction of ``metadata[i]["tests"]`` the extracted program passes.

    Every test of every sample is a separate sandboxed run; up to ``num_workers`` run at a time.
    A sample that crashes, hangs, floods output or attacks the host only fails its own tests.
    """

    config_class = CodeEnvConfig
    name = "code"

    def __init__(self, config: CodeEnvConfig | Mapping[str, Any] | None = None) -> None:
        self.config = validate_config(CodeEnvConfig, config, "env.code")
        self.sandbox = Sandbox(self.config.sandbox)
        self._executor = ThreadPoolExecutor(
            max_workers=self.config.num_workers, thread_name_prefix="code-env"
        )

    def _run_test(self, code: str, test: CodeTest) -> bool:
        source, stdin, marker = build_program(code, test)
        return passed_test(test, self.sandbox.run_python(source, stdin), marker)

    def score(self, codes: Sequence[str | None], tests: Sequence[list[CodeTest]]) -> list[tuple[int, int]]:
        """(passed, total) per sample; a sample without code passes nothing."""
        jobs = [
            (i, self._executor.submit(self._run_test, code, test))
            for i, (code, sample_tests) in enumerate(zip(codes, tests))
            if code is not None
            for test in sample_tests
        ]
        passed = [0] * len(codes)
        for i, future in jobs:
            passed[i] += int(future.result())
        return [(p, len(t)) for p, t in zip(passed, tests)]

    def step(self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        check_batch(message_log_batch, metadata, self.name)
        tests = []
        for i, meta in enumerate(metadata):
            raw = required_field(meta, "tests", i, self.name)
            if not isinstance(raw, list) or not raw:
                raise ValueError(f"code.step: metadata[{i}]['tests'] must be a non-empty list, got {raw!r}")
            tests.append(
                [CodeTest.parse(t, f"code.step: metadata[{i}]['tests'][{j}]") for j, t in enumerate(raw)]
            )
        codes = [
            extract_code(last_assistant_text(log), self.config.require_code_block)
            for log in message_log_batch
        ]
        scores = self.score(codes, tests)
        n = len(scores)
        return make_return(
            observations=[
                {
                    "role": "environment",
                    "content": "no code block found" if code is None else f"passed {p}/{t} tests",
                }
                for code, (p, t) in zip(codes, scores)
            ],
            metadata=[None] * n,
            next_stop_strings=[None] * n,
            rewards=[p / t for p, t in scores],
            terminateds=[True] * n,
            answers=list(codes),
        )

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        """pass_rate: mean fraction of tests passed; all_passed_rate; format_error_rate;
        mean_response_length (when the batch has ``message_log``)."""
        rewards = batch_rewards(batch)
        metrics: dict[str, Any] = {
            "pass_rate": float(rewards.mean()) if rewards.numel() else 0.0,
            "all_passed_rate": float((rewards >= 1.0).float().mean()) if rewards.numel() else 0.0,
        }
        logs = batch_message_logs(batch)
        if logs is not None:
            codes = [extract_code(last_assistant_text(log), self.config.require_code_block) for log in logs]
            metrics["format_error_rate"] = mean([float(c is None) for c in codes])
            metrics["mean_response_length"] = mean([float(response_length(log)) for log in logs])
        return batch, metrics

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
