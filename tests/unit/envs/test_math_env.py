"""MathEnvironment: rewards, answers, metrics, hard per-sample timeout, bad input."""

from __future__ import annotations

import pytest
import torch

from rl_envs.math import MathEnvironment


def conversation(response: str, n_tokens: int) -> list[dict]:
    return [
        {"role": "user", "content": "question", "token_ids": torch.arange(4)},
        {"role": "assistant", "content": response, "token_ids": torch.arange(n_tokens)},
    ]


@pytest.fixture(scope="module")
def env():
    # math_verify's own timeout is set far above the hard one, so only a kill can stop a hang.
    e = MathEnvironment({"num_workers": 2, "verify_timeout_s": 60, "sample_timeout_s": 3.0})
    yield e
    e.shutdown()


CASES = [  # response, ground truth, reward, answer
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0, "\\frac{1}{2}"),
    ("The answer is 0.5.", "1/2", 1.0, "0.5"),
    ("#### 17", "18", 0.0, "17"),
    ("", "3", 0.0, None),
    ("I give up", "3", 0.0, None),
    ("x = \\boxed{[0, 1)}", "[0,1)", 1.0, "[0, 1)"),
]


def test_step_rewards_answers_and_metrics(env: MathEnvironment) -> None:
    logs = [conversation(r, n_tokens=3 + i) for i, (r, *_rest) in enumerate(CASES)]
    meta = [{"ground_truth": gt} for _, gt, _, _ in CASES]
    ret = env.step(logs, meta)
    assert ret.rewards.dtype == torch.float32
    assert ret.rewards.tolist() == [c[2] for c in CASES]
    assert ret.terminateds.tolist() == [True] * len(CASES)
    assert ret.answers == [c[3] for c in CASES]
    assert ret.metadata == [None] * len(CASES)
    assert [o["content"] for o in ret.observations] == ["correct" if c[2] else "incorrect" for c in CASES]

    _, metrics = env.global_post_process_and_metrics({"rewards": ret.rewards, "message_log": logs})
    assert metrics["accuracy"] == pytest.approx(3 / 6)
    assert metrics["format_error_rate"] == pytest.approx(2 / 6)  # "" and "I give up"
    assert metrics["mean_response_length"] == pytest.approx(sum(3 + i for i in range(6)) / 6)


def test_hanging_verification_is_killed_and_env_keeps_serving(env: MathEnvironment) -> None:
    restarts = env.verifier.pool.restarts
    logs = [conversation("\\boxed{2^{2^{40}}-1}", 1), conversation("\\boxed{4}", 1)]
    ret = env.step(logs, [{"ground_truth": "3"}, {"ground_truth": "4"}])
    assert ret.rewards.tolist() == [0.0, 1.0]
    assert ret.answers[0] == "2^{2^{40}}-1"
    assert env.verifier.pool.restarts == restarts + 1
    again = env.step([conversation("\\boxed{7}", 1)], [{"ground_truth": "7"}])
    assert again.rewards.tolist() == [1.0]


def test_missing_ground_truth_names_the_sample(env: MathEnvironment) -> None:
    with pytest.raises(ValueError, match=r"metadata\[1\] has no 'ground_truth'"):
        env.step([conversation("1", 1)] * 2, [{"ground_truth": "1"}, {"answer": "1"}])


def test_unparsable_ground_truth_names_the_sample(env: MathEnvironment) -> None:
    with pytest.raises(ValueError, match="sample 0"):
        env.step([conversation("\\boxed{1}", 1)], [{"ground_truth": "}{"}])


def test_config_errors_name_the_key() -> None:
    with pytest.raises(
        ValueError, match=r"(?s)env\.math .*unknown key 'num_worker' \(did you mean 'num_workers'\?\)"
    ):
        MathEnvironment({"num_worker": 2})
    with pytest.raises(
        ValueError, match=r"(?s)env\.math .*sample_timeout_s: input should be greater than 0 \(got -1\)"
    ):
        MathEnvironment({"sample_timeout_s": -1})
