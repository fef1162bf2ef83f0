"""The built-in arithmetic task: deterministic problems with difficulty levels.

A problem is an integer expression, asked as `What is 23 + 48?` with the answer `71`. Levels:

1. `a + b`, one-digit numbers.
2. `a + b` or `a - b`, two-digit numbers.
3. three numbers with `+`, `-` and at least one `*` (precedence matters, no parentheses).
4. three or four numbers with `+`, `-`, `*` and parentheses that matter (`(8 + 2) * 11`,
   `9 - (8 - 4)`).

Every intermediate value and the answer are non-negative, so answers are plain digit strings.

Splits never overlap: a problem belongs to the validation split when a hash of its expression
falls below `validation_fraction`, whatever seed generated it, so no training seed can produce a
validation problem. Validation problems are distinct; training problems may repeat (level 1
has only 100 problems in all).

The worked solution used for the supervised warm start rewrites the expression one operation
at a time and ends with `The answer is N.`; the math environment's extractors ("answer is X",
the last number) both read N from it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator

from rl_algos.data.errors import DataError
from rl_core.config import RLConfig

Split = Literal["train", "validation"]
# The instruction the default GRPO recipe appends to each prompt (its math environment rewards
# only answers written this way); in the tokenizer corpus so it tokenises compactly.
BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."
OPERATORS: tuple[str, ...] = ("+", "-", "*")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2}


@dataclass(frozen=True)
class Num:
    value: int


@dataclass(frozen=True)
class BinOp:
    op: str
    left: Expr
    right: Expr


Expr = Num | BinOp


def evaluate(expr: Expr) -> int:
    if isinstance(expr, Num):
        return expr.value
    left, right = evaluate(expr.left), evaluate(expr.right)
    if expr.op == "+":
        return left + right
    if expr.op == "-":
        return left - right
    return left * right


def render(expr: Expr) -> str:
    """Infix text with only the parentheses needed to parse back to this same tree: a left
    operand of equal precedence needs none (operators are left-associative), a right one does."""
    if isinstance(expr, Num):
        return str(expr.value)

    def operand(child: Expr, is_right: bool) -> str:
        text = render(child)
        if isinstance(child, BinOp):
            child_prec, prec = _PRECEDENCE[child.op], _PRECEDENCE[expr.op]
            if child_prec < prec or (is_right and child_prec == prec):
                return f"({text})"
        return text

    return f"{operand(expr.left, False)} {expr.op} {operand(expr.right, True)}"


def reduce_once(expr: Expr) -> Expr:
    """Evaluate the operation that comes first in evaluation order (the first operation whose
    operands are both numbers, in post-order), leaving the rest of the tree as it is."""
    if isinstance(expr, Num):
        return expr
    if isinstance(expr.left, Num) and isinstance(expr.right, Num):
        return Num(evaluate(expr))
    if isinstance(expr.left, BinOp):
        return BinOp(expr.op, reduce_once(expr.left), expr.right)
    return BinOp(expr.op, expr.left, reduce_once(expr.right))


def worked_steps(expr: Expr) -> list[str]:
    """The expression after each reduction: `["(3 + 4) * 5", "7 * 5", "35"]`."""
    steps = [render(expr)]
    while isinstance(expr, BinOp):
        expr = reduce_once(expr)
        steps.append(render(expr))
    return steps


@dataclass(frozen=True)
class LevelSpec:
    min_operands: int
    max_operands: int
    low: int  # operand range, inclusive
    high: int
    operators: tuple[str, ...]
    parentheses: bool  # True: every problem has parentheses; False: none has
    required_operator: str | None = None


LEVELS: dict[int, LevelSpec] = {
    1: LevelSpec(2, 2, 0, 9, ("+",), parentheses=False),
    2: LevelSpec(2, 2, 10, 99, ("+", "-"), parentheses=False),
    3: LevelSpec(3, 3, 2, 12, OPERATORS, parentheses=False, required_operator="*"),
    4: LevelSpec(3, 4, 2, 12, OPERATORS, parentheses=True),
}


@dataclass(frozen=True)
class ArithmeticProblem:
    expression: str
    answer: int
    level: int
    tree: Expr

    @property
    def prompt(self) -> str:
        return f"What is {self.expression}?"

    def solution(self, boxed: bool = False) -> str:
        """A short worked answer: `(3 + 4) * 5 = 7 * 5 = 35. The answer is 35.` (with `boxed`:
        `... The answer is \\boxed{35}.`, the form math verifiers look for first)."""
        answer = f"\\boxed{{{self.answer}}}" if boxed else str(self.answer)
        return f"{' = '.join(worked_steps(self.tree))}. The answer is {answer}."

    def to_record(self) -> dict[str, str | int]:
        """The prompt/answer record the math environment verifies."""
        return {"prompt": self.prompt, "answer": str(self.answer), "level": self.level}

    def to_sft_record(self, boxed: bool = False) -> dict[str, str | int]:
        """The prompt/completion record of the supervised warm start: the worked solution, its
        final answer written `\\boxed{N}` when `boxed`."""
        return {"prompt": self.prompt, "completion": self.solution(boxed), "level": self.level}

    def wrong_answer(self) -> int:
        """A deterministic wrong answer near the right one (non-negative, never equal to it)."""
        return self.answer + 1 + self.answer % 3

    def wrong_solution(self) -> str:
        """The worked solution with its last step and answer replaced by `wrong_answer`."""
        wrong = self.wrong_answer()
        steps = worked_steps(self.tree)[:-1]
        return f"{' = '.join([*steps, str(wrong)])}. The answer is {wrong}."

    def to_preference_record(self) -> dict[str, str | int]:
        """The prompt/chosen/rejected record of preference training (DPO, reward models):
        the right worked solution is preferred to the same steps ending in a wrong answer."""
        return {
            "prompt": self.prompt,
            "chosen": self.solution(),
            "rejected": self.wrong_solution(),
            "level": self.level,
        }


def split_of(expression: str, validation_fraction: float) -> Split:
    """Which split an expression belongs to: a stable hash, independent of any seed."""
    bucket = int.from_bytes(hashlib.sha256(expression.encode()).digest()[:8], "big") / 2.0**64
    return "validation" if bucket < validation_fraction else "train"


def generate_problems(
    num_problems: int,
    *,
    split: Split = "train",
    levels: Sequence[int] = (1, 2),
    seed: int = 0,
    validation_fraction: float = 0.1,
) -> list[ArithmeticProblem]:
    """`num_problems` problems of `split`, each of a level drawn uniformly from `levels`.

    Deterministic in its arguments. Validation problems are distinct: once a level has no
    unseen validation problem left (level 1 has about ten), the others fill the rest; when
    none has, it is a `DataError`.
    """
    for level in levels:
        if level not in LEVELS:
            raise DataError(f"unknown arithmetic level {level}; levels are {sorted(LEVELS)}")
    if not levels:
        raise DataError("arithmetic: give at least one level")
    if not 0.0 < validation_fraction < 1.0:
        raise DataError(f"arithmetic: validation_fraction must be in (0, 1), got {validation_fraction}")
    rng = random.Random(f"rl-arithmetic/{split}/{seed}")
    seen: set[str] = set()  # validation expressions so far (validation problems are distinct)
    pool = list(levels)
    problems: list[ArithmeticProblem] = []
    while len(problems) < num_problems:
        if not pool:
            raise DataError(
                f"arithmetic: found only {len(problems)} distinct {split} problems of levels {list(levels)} "
                f"(asked for {num_problems}); add harder levels or raise validation_fraction"
            )
        level = rng.choice(pool)
        problem = _draw(rng, level, split, validation_fraction, seen)
        if problem is None:
            # This level has (almost surely) no unseen problem of this split left.
            pool = [other for other in pool if other != level]
            continue
        if split == "validation":
            seen.add(problem.expression)
        problems.append(problem)
    return problems


_MAX_DRAWS_PER_PROBLEM = 2000


def _draw(
    rng: random.Random, level: int, split: Split, validation_fraction: float, seen: set[str]
) -> ArithmeticProblem | None:
    for _ in range(_MAX_DRAWS_PER_PROBLEM):
        tree = _sample_tree(rng, LEVELS[level])
        if tree is None:
            continue
        expression = render(tree)
        if split_of(expression, validation_fraction) == split and expression not in seen:
            return ArithmeticProblem(expression, evaluate(tree), level, tree)
    return None


def _sample_tree(rng: random.Random, spec: LevelSpec) -> Expr | None:
    """A random expression of the level, or None when the draw breaks one of its rules
    (the caller draws again; rejection keeps every rule exact)."""
    num_operands = rng.randint(spec.min_operands, spec.max_operands)
    tree = _random_tree(rng, spec, num_operands)
    if not _all_values_non_negative(tree):
        return None
    if spec.required_operator is not None and spec.required_operator not in _operators_in(tree):
        return None
    if spec.parentheses:
        return tree if _has_meaningful_parentheses(tree) else None
    return None if "(" in render(tree) else tree


def _random_tree(rng: random.Random, spec: LevelSpec, num_operands: int) -> Expr:
    if num_operands == 1:
        return Num(rng.randint(spec.low, spec.high))
    left_size = rng.randint(1, num_operands - 1)
    return BinOp(
        rng.choice(spec.operators),
        _random_tree(rng, spec, left_size),
        _random_tree(rng, spec, num_operands - left_size),
    )


def _all_values_non_negative(expr: Expr) -> bool:
    if isinstance(expr, Num):
        return expr.value >= 0
    return (
        _all_values_non_negative(expr.left) and _all_values_non_negative(expr.right) and evaluate(expr) >= 0
    )


def _has_meaningful_parentheses(expr: Expr) -> bool:
    """Whether some parentheses change the value's structure: a sum inside a product, or a sum
    or difference subtracted (`9 - (8 - 4)`); not merely regrouping `6 * (11 * 6)`."""
    if isinstance(expr, Num):
        return False
    for child, is_right in ((expr.left, False), (expr.right, True)):
        if isinstance(child, BinOp) and (
            _PRECEDENCE[child.op] < _PRECEDENCE[expr.op]
            or (is_right and expr.op == "-" and _PRECEDENCE[child.op] == 1)
        ):
            return True
    return _has_meaningful_parentheses(expr.left) or _has_meaningful_parentheses(expr.right)


def _operators_in(expr: Expr) -> set[str]:
    if isinstance(expr, Num):
        return set()
    return {expr.op} | _operators_in(expr.left) | _operators_in(expr.right)


class ArithmeticDatasetSpec(RLConfig):
    """The built-in arithmetic task as a dataset (see `generate_problems`)."""

    source: Literal["arithmetic"] = "arithmetic"
    split: Split = "train"
    num_samples: int = Field(default=1024, ge=1)
    levels: list[int] = Field(default_factory=lambda: [1, 2])
    seed: int = 0
    validation_fraction: float = Field(default=0.1, gt=0.0, lt=1.0)
    format: Literal["prompt_answer", "sft", "preference"] = "prompt_answer"
    # SFT format: the share of worked solutions that write the final answer as \boxed{N}
    # (a corpus that follows an answer-format convention only some of the time, as real
    # SFT data often does).
    boxed_answer_fraction: float = Field(default=0.0, ge=0.0, le=1.0)

    @field_validator("levels")
    @classmethod
    def _known_levels(cls, levels: list[int]) -> list[int]:
        unknown = [level for level in levels if level not in LEVELS]
        if unknown or not levels:
            raise ValueError(f"levels must be a non-empty list drawn from {sorted(LEVELS)}, got {levels}")
        return levels


def arithmetic_records(spec: ArithmeticDatasetSpec) -> list[dict[str, str | int]]:
    """Records of the task: `{prompt, answer, level}`, `{prompt, completion, level}` for SFT or
    `{prompt, chosen, rejected, level}` for preference training."""
    problems = generate_problems(
        spec.num_samples,
        split=spec.split,
        levels=spec.levels,
        seed=spec.seed,
        validation_fraction=spec.validation_fraction,
    )
    if spec.format == "sft":
        # Which records are boxed depends only on (seed, position), not on the problems drawn.
        style = random.Random(f"rl-arithmetic/answer-style/{spec.seed}")
        return [p.to_sft_record(boxed=style.random() < spec.boxed_answer_fraction) for p in problems]
    if spec.format == "preference":
        return [p.to_preference_record() for p in problems]
    return [p.to_record() for p in problems]


def arithmetic_corpus(
    num_problems: int = 2000, *, levels: Sequence[int] = tuple(LEVELS), seed: int = 0
) -> Iterator[str]:
    """Text for training the tiny tokenizer: every symbol the task uses, then prompts (with the
    boxed-answer instruction) and worked solutions of training problems in both answer styles,
    so their words, numbers and `\\boxed{}` get compact tokens.
    Digits tokenise one by one only if the tokenizer's pre-tokenizer splits them
    (`tokenizers.pre_tokenizers.Digits(individual_digits=True)`)."""
    yield " ".join([*"0123456789", *OPERATORS, "(", ")", "=", "?", "."])
    for problem in generate_problems(num_problems, split="train", levels=levels, seed=seed):
        yield f"{problem.prompt} {BOXED_INSTRUCTION}"
        yield problem.solution()
        yield problem.solution(boxed=True)
