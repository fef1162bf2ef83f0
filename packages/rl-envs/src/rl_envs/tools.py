"""Multi-turn tool use: the model calls tools until it gives a final answer, which is verified.

Protocol (one assistant turn):

* ``<tool_call>{"name": "calculator", "arguments": {"expression": "3*(4+5)"}}</tool_call>``
  (one or more): each call is executed and the results come back as one ``tool`` message;
* ``<answer>27</answer>``: the episode ends; reward 1 when the answer equals
  ``metadata["ground_truth"]`` (math equivalence, as in the math environment), else 0.

Malformed JSON, an unknown tool or bad arguments produce an error observation (the episode
goes on); a turn with neither a call nor an answer gets a reminder of the format. After
``max_turns`` assistant turns without an answer the episode ends with reward 0.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
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
    validate_config,
)
from rl_envs.calculator import CalculatorError, calculate
from rl_envs.math import MathVerifier
from rl_envs.sandbox import Sandbox, SandboxConfig

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
STOP_STRINGS = ["</tool_call>", "</answer>"]
AVAILABLE_TOOLS = ("calculator", "python")

TOOL_DESCRIPTIONS: dict[str, dict[str, Any]] = {
    "calculator": {
        "description": "Evaluate an arithmetic expression (+ - * / // % ** ^, sqrt, log, sin, pi, ...).",
        "arguments": {"expression": "string"},
    },
    "python": {
        "description": "Run a Python program in a sandbox (no network, no files kept); returns its stdout.",
        "arguments": {"code": "string"},
    },
}


class ToolCallError(ValueError):
    pass


class ToolEnvConfig(EnvConfig):
    tools: list[str] = Field(
        default_factory=lambda: list(AVAILABLE_TOOLS), description="tools the model may call"
    )
    max_turns: int = Field(default=6, ge=1, description="assistant turns before the episode ends unanswered")
    max_calls_per_turn: int = Field(
        default=4, ge=1, description="tool calls executed per turn (the rest are refused)"
    )
    max_tool_output_chars: int = Field(
        default=2000, ge=100, description="tool results are cut to this length"
    )
    num_workers: int = Field(
        default=2, ge=1, description="answer-verification processes and parallel tool runs"
    )
    verify_timeout_s: int = Field(default=5, ge=1)
    sample_timeout_s: float = Field(default=20.0, gt=0)
    sandbox: SandboxConfig = Field(default_factory=lambda: SandboxConfig())


def tools_prompt(tools: list[str] | tuple[str, ...] = AVAILABLE_TOOLS) -> str:
    """Instructions for the system/user prompt describing the protocol and the tools."""
    specs = json.dumps({name: TOOL_DESCRIPTIONS[name] for name in tools}, indent=1)
    return (
        "You can call tools. To call one, write "
        '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call> and wait for the result. '
        f"Available tools:\n{specs}\nWhen you know the final answer, write <answer>...</answer>."
    )


def parse_tool_call(raw: str) -> tuple[str, dict[str, Any]]:
    try:
        call = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ToolCallError(f"invalid JSON in <tool_call>: {exc.msg} at position {exc.pos}") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError(
            'a tool call must be a JSON object with a string "name" and an "arguments" object'
        )
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some chat formats nest the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ToolCallError('"arguments" is a string that is not a JSON object') from None
    if not isinstance(arguments, dict):
        raise ToolCallError('"arguments" must be a JSON object')
    return call["name"], arguments


class ToolEnvironment(EnvironmentInterface):
    """Executes tool calls and verifies final answers; see the module docstring.

    Initial metadata: ``{"ground_truth": ...}``; the returned metadata adds ``turn``.
    """

    config_class = ToolEnvConfig
    name = "tools"

    def __init__(self, config: ToolEnvConfig | Mapping[str, Any] | None = None) -> None:
        self.config = validate_config(ToolEnvConfig, config, "env.tools")
        unknown = sorted(set(self.config.tools) - set(AVAILABLE_TOOLS))
        if unknown:
            raise ValueError(f"env.tools.tools: unknown tools {unknown}; available: {list(AVAILABLE_TOOLS)}")
        cfg = self.config
        self.verifier = MathVerifier(cfg.num_workers, cfg.verify_timeout_s, cfg.sample_timeout_s)
        self.sandbox = Sandbox(cfg.sandbox) if "python" in cfg.tools else None
        self._executor = ThreadPoolExecutor(max_workers=cfg.num_workers, thread_name_prefix="tool-env")
        self._tools: dict[str, Callable[[dict[str, Any]], str]] = {
            "calculator": self._calculator,
            "python": self._python,
        }

    # ----------------------------------------------------------------- tools
    @staticmethod
    def _string_argument(arguments: dict[str, Any], key: str, tool: str) -> str:
        value = arguments.get(key)
        if not isinstance(value, str):
            raise ToolCallError(
                f'{tool} needs a string argument "{key}", got arguments {json.dumps(arguments)[:200]}'
            )
        return value

    def _calculator(self, arguments: dict[str, Any]) -> str:
        expression = self._string_argument(arguments, "expression", "calculator")
        try:
            return str(calculate(expression))
        except CalculatorError as exc:
            raise ToolCallError(f"calculator: {exc}") from None

    def _python(self, arguments: dict[str, Any]) -> str:
        code = self._string_argument(arguments, "code", "python")
        assert self.sandbox is not None
        result = self.sandbox.run_python(code)
        if result.timed_out:
            return f"{result.stdout}\n[timed out]"
        if result.exit_code != 0:
            tail = result.stderr.strip().splitlines()[-1:] or [
                f"exit code {result.exit_code}, signal {result.signal}"
            ]
            return f"{result.stdout}\n[error] {tail[0]}"
        return result.stdout

    def execute(self, raw_call: str) -> str:
        """Result text of one ``<tool_call>`` body; errors are returned as text, never raised."""
        try:
            name, arguments = parse_tool_call(raw_call.strip())
            if name not in self.config.tools:
                raise ToolCallError(f"unknown tool {name!r}; available tools: {self.config.tools}")
            output = self._tools[name](arguments)
        except ToolCallError as exc:
            return f"Error: {exc}"
        limit = self.config.max_tool_output_chars
        return output if len(output) <= limit else output[:limit] + f"\n[output cut at {limit} characters]"

    # ----------------------------------------------------------------- turns
    def step(self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        check_batch(message_log_batch, metadata, self.name)
        cfg = self.config
        n = len(metadata)
        observations: list[dict[str, str]] = [{"role": "tool", "content": ""} for _ in range(n)]
        rewards = [0.0] * n
        done = [False] * n
        answers: list[str | None] = [None] * n
        turns = []
        to_verify: list[int] = []
        pending = {}
        for i, (log, meta) in enumerate(zip(message_log_batch, metadata)):
            if not isinstance(meta, Mapping) or "ground_truth" not in meta:
                raise ValueError(f"tools.step: metadata[{i}] needs a 'ground_truth', got {meta!r}")
            turn = int(meta.get("turn", 0)) + 1
            turns.append(turn)
            text = last_assistant_text(log)
            answer_tags = _ANSWER.findall(text)
            calls = _TOOL_CALL.findall(text)
            if answer_tags:
                answers[i] = answer_tags[-1].strip()
                to_verify.append(i)
            elif calls:
                pending[i] = [self._executor.submit(self.execute, c) for c in calls[: cfg.max_calls_per_turn]]
            else:
                observations[i] = {
                    "role": "tool",
                    "content": "Error: no <tool_call> or <answer> found. "
                    'Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call> '
                    "or give the final answer as <answer>...</answer>.",
                }
        for i, futures in pending.items():
            results = [f.result() for f in futures]
            extra = len(_TOOL_CALL.findall(last_assistant_text(message_log_batch[i]))) - len(futures)
            if extra > 0:
                results.append(f"Error: only {cfg.max_calls_per_turn} tool calls per turn; {extra} ignored")
            observations[i] = {"role": "tool", "content": "\n".join(results)}
        if to_verify:
            verdicts = self.verifier.check_answers(
                [answers[i] or "" for i in to_verify], [str(metadata[i]["ground_truth"]) for i in to_verify]
            )
            for i, correct in zip(to_verify, verdicts):
                rewards[i] = 1.0 if correct else 0.0
                done[i] = True
                observations[i] = {"role": "environment", "content": "correct" if correct else "incorrect"}
        for i in range(n):
            if not done[i] and turns[i] >= cfg.max_turns:
                done[i] = True
                observations[i] = {
                    "role": observations[i]["role"],
                    "content": f"{observations[i]['content']}\nOut of turns ({cfg.max_turns}) without an answer.",
                }
        return make_return(
            observations=observations,
            metadata=[None if done[i] else {**metadata[i], "turn": turns[i]} for i in range(n)],
            next_stop_strings=[None if d else list(STOP_STRINGS) for d in done],
            rewards=rewards,
            terminateds=done,
            answers=answers,
        )

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        """accuracy (mean reward); with ``message_log``: mean_tool_calls and answered_rate."""
        rewards = batch_rewards(batch)
        metrics: dict[str, Any] = {"accuracy": float(rewards.mean()) if rewards.numel() else 0.0}
        logs = batch_message_logs(batch)
        if logs is not None:
            assistant = [
                [str(m.get("content") or "") for m in log if m.get("role") == "assistant"] for log in logs
            ]
            metrics["mean_tool_calls"] = mean(
                [float(sum(len(_TOOL_CALL.findall(t)) for t in a)) for a in assistant]
            )
            metrics["answered_rate"] = mean([float(any(_ANSWER.search(t) for t in a)) for a in assistant])
        return batch, metrics

    def shutdown(self) -> None:
        self.verifier.shutdown()
        self._executor.shutdown(wait=False, cancel_futures=True)
