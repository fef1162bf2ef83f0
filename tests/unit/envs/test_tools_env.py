"""Tool use: the AST calculator, tool-call parsing, scripted episodes to success and failure."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rl_envs.calculator import CalculatorError, calculate
from rl_envs.tools import ToolEnvironment


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("3*(4+5)", 27),
        ("2^10", 1024),
        ("2**-1", 0.5),
        ("7/2", 3.5),
        ("7//2", 3),
        ("-(3-5) % 3", 2),
        ("sqrt(16) + abs(-2)", 6),
        ("round(pi, 3)", 3.142),
        ("log(e)", 1),
        ("factorial(5) / gcd(12, 18)", 20),
        ("0.1 + 0.2", 0.1 + 0.2),
        ("max(1, 2, 3) * min(4, 5)", 12),
    ],
)
def test_calculator_values(expression: str, value: float) -> None:
    assert calculate(expression) == pytest.approx(value)


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os').system('true')", "unsupported syntax"),
        ("().__class__", "unsupported syntax"),
        ("open('/etc/passwd')", "unknown function 'open'"),
        ("9**9**9", "exponent"),
        ("2**1000 * 2**1000 * 2**1000 * 2**1000 * 2**1000", "bits"),
        ("factorial(100000)", "factorial"),
        ("1/0", "ZeroDivisionError"),
        ("sqrt(-1)", "ValueError"),
        ("x + 1", "unknown name 'x'"),
        ("1 +", "syntax error"),
        ("", "non-empty"),
        ("1+" * 300 + "1", "longer than"),
        ("'a' * 3", "unsupported syntax"),
    ],
)
def test_calculator_refuses(expression: str, reason: str) -> None:
    with pytest.raises(CalculatorError, match=reason):
        calculate(expression)


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def env():
    e = ToolEnvironment({"max_turns": 4, "num_workers": 2, "sandbox": {"cpu_time_s": 1, "wall_time_s": 5}})
    yield e
    e.shutdown()


def play(env: ToolEnvironment, ground_truth: str, replies: list[str]):
    log: list[dict] = [{"role": "user", "content": "What is 3*(4+5)?", "token_ids": torch.arange(2)}]
    metadata: dict = {"ground_truth": ground_truth}
    turns = []
    for text in replies:
        log.append({"role": "assistant", "content": text, "token_ids": torch.arange(4)})
        ret = env.step([log], [metadata])
        observation = ret.observations[0]
        turns.append(
            (float(ret.rewards[0]), bool(ret.terminateds[0]), observation["role"], observation["content"])
        )
        log.append({**observation, "token_ids": torch.arange(1)})
        if ret.terminateds[0]:
            assert ret.metadata[0] is None
            break
        assert ret.next_stop_strings[0] == ["</tool_call>", "</answer>"]
        metadata = ret.metadata[0]
    return turns, log


def test_scripted_tool_calls_then_correct_answer(env: ToolEnvironment) -> None:
    replies = [
        "Let me compute. " + call("calculator", expression="3*(4+5)"),
        "Double-check in Python: " + call("python", code="print(3 * (4 + 5))\nprint(sum(range(10)))"),
        "Both agree. <answer>27</answer>",
    ]
    turns, log = play(env, "27", replies)
    assert turns[0] == (0.0, False, "tool", "27")
    assert turns[1][:3] == (0.0, False, "tool") and turns[1][3].split() == ["27", "45"]
    assert turns[2] == (1.0, True, "environment", "correct")
    _, metrics = env.global_post_process_and_metrics({"rewards": torch.tensor([1.0]), "message_log": [log]})
    assert metrics == {"accuracy": 1.0, "mean_tool_calls": 2.0, "answered_rate": 1.0}


def test_equivalent_final_answer_forms_are_accepted(env: ToolEnvironment) -> None:
    turns, _ = play(env, "0.5", ["<answer>\\frac{1}{2}</answer>"])
    assert turns == [(1.0, True, "environment", "correct")]


def test_wrong_answer_fails(env: ToolEnvironment) -> None:
    turns, _ = play(env, "27", [call("calculator", expression="3*4+5"), "<answer>17</answer>"])
    assert turns[0][3] == "17"
    assert turns[1] == (0.0, True, "environment", "incorrect")


def test_bad_calls_get_error_observations_not_crashes(env: ToolEnvironment) -> None:
    replies = [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"</tool_call>',
        call("browser", url="http://example.com"),
        call("calculator", expr="1+1") + call("python", code="import sys; sys.exit(3)"),
        "I am thinking.",
    ]
    turns, _ = play(env, "2", replies)
    assert [t[:3] for t in turns] == [(0.0, False, "tool")] * 3 + [(0.0, True, "tool")]
    assert turns[0][3].startswith("Error: invalid JSON in <tool_call>")
    assert turns[1][3] == "Error: unknown tool 'browser'; available tools: ['calculator', 'python']"
    first, second = turns[2][3].split("\n", 1)
    assert first.startswith('Error: calculator needs a string argument "expression"')
    assert "exit code 3" in second
    assert "no <tool_call> or <answer> found" in turns[3][3] and "Out of turns (4)" in turns[3][3]


def test_python_tool_runs_in_the_sandbox(env: ToolEnvironment, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RL_TEST_SECRET_TOKEN", "s3cr3t-value")
    code = "import os\nprint(os.environ.get('RL_TEST_SECRET_TOKEN'), os.path.exists('/etc/passwd'))"
    assert env.execute(json.dumps({"name": "python", "arguments": {"code": code}})) == "None False\n"
    loop = env.execute(json.dumps({"name": "python", "arguments": {"code": "while True: pass"}}))
    assert "timed out" in loop or "signal" in loop
    long = env.execute(json.dumps({"name": "python", "arguments": {"code": "print('z' * 10000)"}}))
    assert long.endswith("[output cut at 2000 characters]") and long.startswith("z" * 2000)


def test_unknown_configured_tool_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"env\.tools\.tools: unknown tools \['shell'\]"):
        ToolEnvironment({"tools": ["calculator", "shell"]})


def test_calculator_matches_python_arithmetic() -> None:
    for a in range(-3, 4):
        for b in range(1, 4):
            assert calculate(f"({a})*{b} - {b}**2 / {b}") == pytest.approx(a * b - b**2 / b)
            assert calculate(f"sqrt({b})") == pytest.approx(math.sqrt(b))
