"""CodeEnvironment: code extraction, stdin/stdout and assert tests, reward = fraction passed."""

from __future__ import annotations

import pytest
import torch

from rl_envs.code import CodeEnvironment, extract_code


def reply(text: str) -> list[dict]:
    return [
        {"role": "user", "content": "write code", "token_ids": torch.arange(3)},
        {"role": "assistant", "content": text, "token_ids": torch.arange(len(text.split()))},
    ]


def fenced(code: str, tag: str = "python") -> str:
    return f"Here you go:\n```{tag}\n{code}\n```\nDone."


IO_TESTS = [
    {"input": "2 3\n", "output": "5\n"},
    {"input": "10 -4\n", "output": "6"},
    {"input": "0 0\n", "output": "0"},
]
ASSERT_TESTS = [{"assert": "assert add(2, 3) == 5"}, {"assert": "assert add(-1, 1) == 0"}]


@pytest.fixture(scope="module")
def env():
    e = CodeEnvironment({"num_workers": 4, "sandbox": {"cpu_time_s": 2, "wall_time_s": 4}})
    yield e
    e.shutdown()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (fenced("print(1)"), "print(1)\n"),
        (fenced("print(2)", tag="py"), "print(2)\n"),
        ("```\nprint(3)\n```", "print(3)\n"),
        (fenced("print(1)") + "\nbetter:\n" + fenced("print(4)"), "print(4)\n"),
        ("```bash\nls\n```", None),
        ("print(5)", None),
        ("", None),
        ("```python\n```", None),
    ],
)
def test_extract_code(text: str, expected: str | None) -> None:
    assert extract_code(text) == expected


def test_whole_reply_is_code_when_blocks_are_optional() -> None:
    assert extract_code("print(5)", require_code_block=False) == "print(5)"


def test_rewards_are_fractions_of_tests_passed(env: CodeEnvironment) -> None:
    samples = [
        (fenced("a, b = map(int, input().split())\nprint(a + b)"), IO_TESTS, 1.0),
        # Right only when b >= 0: passes 2 of 3.
        (fenced("a, b = map(int, input().split())\nprint(a + abs(b))"), IO_TESTS, 2 / 3),
        (fenced("def add(a, b):\n    return a + b"), ASSERT_TESTS, 1.0),
        # add(2, 3) = 2*3 + 1 = 7 and add(-1, 1) = -1: both wrong.
        (fenced("def add(a, b):\n    return a * b + (a == 2)"), ASSERT_TESTS, 0.0),
        # Exiting "successfully" before the assertions run must not pass them.
        (fenced("import os\nos._exit(0)\ndef add(a, b):\n    return 0"), ASSERT_TESTS, 0.0),
        (fenced("raise SystemExit(0)"), ASSERT_TESTS, 0.0),
        ("I cannot write code.", IO_TESTS, 0.0),
        (fenced("syntax error here ("), IO_TESTS, 0.0),
    ]
    logs = [reply(text) for text, _, _ in samples]
    ret = env.step(logs, [{"tests": tests} for _, tests, _ in samples])
    assert ret.rewards.tolist() == pytest.approx([expected for _, _, expected in samples])
    assert ret.terminateds.all()
    assert ret.observations[0]["content"] == "passed 3/3 tests"
    assert ret.observations[1]["content"] == "passed 2/3 tests"
    assert ret.observations[6]["content"] == "no code block found"
    assert ret.answers[6] is None and ret.answers[2] == "def add(a, b):\n    return a + b\n"

    _, metrics = env.global_post_process_and_metrics({"rewards": ret.rewards, "message_log": logs})
    rewards = [expected for _, _, expected in samples]
    assert metrics["pass_rate"] == pytest.approx(sum(rewards) / len(rewards))
    assert metrics["all_passed_rate"] == pytest.approx(2 / 8)
    assert metrics["format_error_rate"] == pytest.approx(1 / 8)


def test_output_comparison_ignores_trailing_whitespace_only(env: CodeEnvironment) -> None:
    tests = [{"input": "", "output": "a b\nc\n"}]
    ret = env.step(
        [reply(fenced("print('a b   ')\nprint('c')\nprint()")), reply(fenced("print('a  b')\nprint('c')"))],
        [{"tests": tests}, {"tests": tests}],
    )
    assert ret.rewards.tolist() == [1.0, 0.0]


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"test": []}, r"metadata\[0\] has no 'tests'"),
        ({"tests": []}, r"metadata\[0\]\['tests'\] must be a non-empty list"),
        ({"tests": [{"in": "1", "out": "1"}]}, r"metadata\[0\]\['tests'\]\[0\]: a test must be"),
    ],
)
def test_bad_test_specs_are_named(env: CodeEnvironment, metadata: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        env.step([reply(fenced("print(1)"))], [metadata])
