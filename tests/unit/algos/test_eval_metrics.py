"""pass@k against the closed form and a brute-force enumeration of k-subsets; cons@k's majority
vote on hand-made cases; aggregation over prompts; the eval section's validation; the table."""

from __future__ import annotations

import itertools
import math
import re

import pytest
from pydantic import ValidationError

from rl_algos.eval import (
    EvalConfig,
    EvalMasterConfig,
    PromptOutcome,
    aggregate,
    cons_at_k,
    format_table,
    majority_answer,
    pass_at_k,
)


def closed_form(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def brute_force(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n answers (the first c correct) that contain a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_equals_closed_form_and_enumeration(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            expected = brute_force(n, c, k)
            assert closed_form(n, c, k) == pytest.approx(expected, abs=1e-12)
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_hand_made_cases() -> None:
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(16, 3, 4) == pytest.approx(1 - 715 / 1820)  # C(13,4) / C(16,4)
    # n - c < k: every k-subset holds a correct answer.
    assert pass_at_k(5, 3, 3) == 1.0
    # Large n stays exact where the binomials are astronomically large.
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    assert pass_at_k(1000, 500, 100) == pytest.approx(closed_form(1000, 500, 100), abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass@k: need"):
        pass_at_k(n, c, k)


def test_majority_vote() -> None:
    assert majority_answer(["3", "4", "4", "3 "]) == 0  # tie 2-2: the answer seen first wins
    assert majority_answer(["3", "4", "4"]) == 1
    assert majority_answer([None, "", "7"]) == 2  # samples without an answer do not vote
    assert majority_answer([None, None]) is None


def test_cons_at_k_counts_the_majority_answer_of_the_first_k() -> None:
    answers = ["5", "6", "6", "5", "5"]
    correct = [True, False, False, True, True]
    assert cons_at_k(answers, correct, 1) == 1.0
    assert cons_at_k(answers, correct, 3) == 0.0  # "6" wins among the first three
    assert cons_at_k(answers, correct, 4) == 1.0  # tie, "5" seen first
    assert cons_at_k(answers, correct, 5) == 1.0
    assert cons_at_k([None, None], [False, False], 2) == 0.0
    with pytest.raises(ValueError, match="cons@k: need 1 <= k <= 2"):
        cons_at_k(["1", "2"], [True, False], 3)


def test_aggregate_averages_over_prompts() -> None:
    outcomes = [
        PromptOutcome(0, "a", "1", [1.0, 0.0, 0.0, 1.0], ["1", "2", "2", "1"]),
        PromptOutcome(1, "b", "9", [0.0, 0.0, 0.0, 0.0], ["3", None, "4", "3"]),
        PromptOutcome(2, "c", "5", [1.0, 1.0, 1.0, 0.0], ["5", "5", "5", "6"]),
    ]
    metrics = aggregate(outcomes, [1, 2, 4])
    assert metrics["pass@1"] == pytest.approx((0.5 + 0.0 + 0.75) / 3)
    assert metrics["pass@2"] == pytest.approx((closed_form(4, 2, 2) + 0.0 + 1.0) / 3)
    assert metrics["pass@4"] == pytest.approx(2 / 3)
    assert metrics["cons@1"] == pytest.approx(2 / 3)
    assert metrics["cons@2"] == pytest.approx(2 / 3)  # prompt 0: tie "1"/"2", "1" first
    assert metrics["cons@4"] == pytest.approx(2 / 3)
    assert metrics["mean_reward"] == pytest.approx(5 / 12)
    assert metrics["no_answer_rate"] == pytest.approx(1 / 12)


def test_eval_section_checks_k_and_greedy() -> None:
    with pytest.raises(ValidationError, match=r"pass_k must be .* num_tests_per_prompt=4\], got \[1, 8\]"):
        EvalConfig(num_tests_per_prompt=4, pass_k=[1, 8])
    with pytest.raises(ValidationError, match="greedy decoding gives 4 identical answers"):
        EvalConfig(num_tests_per_prompt=4, pass_k=[1], greedy=True)
    with pytest.raises(
        ValidationError, match=re.escape("data.task_name is 'code' but the env section configures")
    ):
        EvalMasterConfig.model_validate(
            {"model": {"model_name": "m", "max_total_sequence_length": 64}, "data": {"task_name": "code"}}
        )


def test_table_lists_every_metric() -> None:
    table = format_table({"pass@1": 0.25, "cons@4": 0.5}, "model on data")
    lines = table.splitlines()
    assert lines[0] == "model on data"
    assert any(line.split() == ["pass@1", "0.2500"] for line in lines)
    assert any(line.split() == ["cons@4", "0.5000"] for line in lines)
