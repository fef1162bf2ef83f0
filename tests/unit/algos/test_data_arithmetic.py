"""The built-in arithmetic task: determinism, difficulty levels, disjoint splits, correct answers."""

from __future__ import annotations

import random
import re

import pytest
from pydantic import ValidationError

from rl_algos.data import (
    ArithmeticDatasetSpec,
    DataError,
    arithmetic_corpus,
    arithmetic_records,
    generate_problems,
)
from rl_algos.data.arithmetic import split_of

NUMBER = re.compile(r"\d+")


def test_deterministic_in_its_arguments() -> None:
    a = generate_problems(200, levels=[1, 2, 3, 4], seed=3)
    b = generate_problems(200, levels=[1, 2, 3, 4], seed=3)
    c = generate_problems(200, levels=[1, 2, 3, 4], seed=4)
    assert [p.to_record() for p in a] == [p.to_record() for p in b]
    assert [p.expression for p in a] != [p.expression for p in c]


@pytest.mark.parametrize("split", ["train", "validation"])
def test_answers_are_correct(split: str) -> None:
    for problem in generate_problems(400, split=split, levels=[1, 2, 3, 4], seed=0):  # type: ignore[arg-type]
        record = problem.to_record()
        assert record["prompt"] == f"What is {problem.expression}?"
        value = eval(problem.expression)  # independent reference: Python's own precedence rules
        assert record["answer"] == str(value) and value >= 0


def test_difficulty_levels() -> None:
    for p in generate_problems(300, levels=[1], seed=1):
        a, op, b = p.expression.split(" ")
        assert op == "+" and 0 <= int(a) <= 9 and 0 <= int(b) <= 9
    ops = set()
    for p in generate_problems(300, levels=[2], seed=1):
        a, op, b = p.expression.split(" ")
        ops.add(op)
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
    assert ops == {"+", "-"}
    for p in generate_problems(300, levels=[3], seed=1):
        assert len(NUMBER.findall(p.expression)) == 3
        assert "*" in p.expression and "(" not in p.expression
    assert not parentheses_matter("6 * (11 * 6)") and parentheses_matter("9 - (8 - 4)")
    counts = set()
    for p in generate_problems(300, levels=[4], seed=1):
        counts.add(len(NUMBER.findall(p.expression)))
        assert "(" in p.expression
        assert parentheses_matter(p.expression), p.expression
    assert counts == {3, 4}
    mixed = generate_problems(400, levels=[1, 2, 3, 4], seed=2)
    shares = {level: sum(p.level == level for p in mixed) / len(mixed) for level in (1, 2, 3, 4)}
    assert all(0.18 < share < 0.32 for share in shares.values()), shares


def parentheses_matter(expression: str) -> bool:
    """Whether dropping the parentheses changes the function the expression computes: with
    generic (large random) numbers in place of the actual ones, the values differ. Pure
    regrouping such as `6 * (11 * 6)` computes the same function and does not count; actual
    numbers can coincide by chance (`(7 - 7 + 7) * 6`), generic ones do not."""
    rng = random.Random(expression)
    generic = NUMBER.sub(lambda _: str(rng.randint(10**6, 10**7)), expression)
    return eval(generic) != eval(generic.replace("(", "").replace(")", ""))


def test_splits_never_overlap() -> None:
    validation = generate_problems(300, split="validation", levels=[1, 2, 3, 4], seed=0)
    train = [
        p
        for seed in (0, 1, 2)
        for p in generate_problems(3000, split="train", levels=[1, 2, 3, 4], seed=seed)
    ]
    val_expressions = {p.expression for p in validation}
    assert len(val_expressions) == 300  # distinct
    assert val_expressions.isdisjoint(p.expression for p in train)
    assert all(split_of(p.expression, 0.1) == "validation" for p in validation)
    assert all(split_of(p.expression, 0.1) == "train" for p in train)
    # another validation seed draws from the same held-out pool
    other = generate_problems(300, split="validation", levels=[1, 2, 3, 4], seed=9)
    assert {p.expression for p in other}.isdisjoint(p.expression for p in train)


def test_level_one_validation_pool_is_small_and_exhaustion_is_an_error() -> None:
    pool = {f"{a} + {b}" for a in range(10) for b in range(10) if split_of(f"{a} + {b}", 0.1) == "validation"}
    problems = generate_problems(len(pool), split="validation", levels=[1], seed=0)
    assert {p.expression for p in problems} == pool
    with pytest.raises(
        DataError, match=rf"found only {len(pool)} distinct validation problems of levels \[1\]"
    ):
        generate_problems(len(pool) + 1, split="validation", levels=[1], seed=0)
    # with another level in the mix, the rest is filled from it
    mixed = generate_problems(60, split="validation", levels=[1, 2], seed=0)
    assert sum(p.level == 1 for p in mixed) == len(pool)


def test_worked_solution_steps_are_equal_and_end_with_the_answer() -> None:
    for problem in generate_problems(200, levels=[1, 2, 3, 4], seed=5):
        solution = problem.solution()
        chain, final = solution.rsplit(". ", 1)
        assert final == f"The answer is {problem.answer}."
        steps = chain.split(" = ")
        assert steps[0] == problem.expression and steps[-1] == str(problem.answer)
        assert all(eval(step) == problem.answer for step in steps)
        assert len(steps) == problem.expression.count(" ") // 2 + 1  # one step per operation
        assert NUMBER.findall(solution)[-1] == str(problem.answer)  # the "last number" extractor agrees
    assert generate_problems(1, levels=[4], seed=0)[0].solution() == (
        "10 + 9 * (4 - 3) = 10 + 9 * 1 = 10 + 9 = 19. The answer is 19."
    )


def test_records_and_sft_view() -> None:
    spec = ArithmeticDatasetSpec(num_samples=5, levels=[3], seed=1, format="sft")
    records = arithmetic_records(spec)
    problems = generate_problems(5, levels=[3], seed=1)
    assert records == [{"prompt": p.prompt, "completion": p.solution(), "level": 3} for p in problems]
    with pytest.raises(ValidationError, match="levels must be a non-empty list drawn from"):
        ArithmeticDatasetSpec(levels=[5])


def test_sft_view_mixes_boxed_answers() -> None:
    spec = ArithmeticDatasetSpec(
        num_samples=400, levels=[3], seed=2, format="sft", boxed_answer_fraction=0.25
    )
    records = arithmetic_records(spec)
    problems = generate_problems(400, levels=[3], seed=2)
    boxed = [r["completion"] == p.solution(boxed=True) for r, p in zip(records, problems, strict=True)]
    plain = [r["completion"] == p.solution() for r, p in zip(records, problems, strict=True)]
    assert all(b != p for b, p in zip(boxed, plain, strict=True))  # each record is one or the other
    assert 0.18 < sum(boxed) / len(boxed) < 0.32
    assert problems[0].solution(boxed=True).endswith(f"The answer is \\boxed{{{problems[0].answer}}}.")
    # The same seed gives the same mix; the extremes give one style only.
    assert arithmetic_records(spec) == records
    never = spec.model_copy(update={"boxed_answer_fraction": 0.0})
    always = spec.model_copy(update={"boxed_answer_fraction": 1.0})
    assert not any("boxed" in str(r["completion"]) for r in arithmetic_records(never))
    assert all("boxed" in str(r["completion"]) for r in arithmetic_records(always))


def test_corpus_covers_every_symbol_of_the_task() -> None:
    corpus = list(arithmetic_corpus(50, seed=0))
    assert len(corpus) == 1 + 3 * 50
    text = "\n".join(corpus)
    for symbol in [*"0123456789", "+", "-", "*", "(", ")", "=", "?", "What is", "The answer is", "\\boxed{"]:
        assert symbol in text
