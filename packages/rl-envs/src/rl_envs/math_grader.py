"""Final-answer extraction and equivalence checking for math responses.

`extract_answer` finds the answer span (last ``\\boxed{...}``, "#### X", "the answer is X",
else the last number); `verify_answer` decides equivalence with `math_verify` (symbolic and
numeric: fractions, decimals, LaTeX, percentages, intervals, sets, equations like ``x=3``).
These are pure functions; `MathEnvironment` runs them in worker processes under a hard timeout.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Literal

ExtractionMode = Literal["auto", "boxed"]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_GSM8K = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS = re.compile(
    r"(?:final\s+answer|answer)\s*(?:is|:|=)\s*:?\s*(.+?)(?=(?:\.\s|\.$|\n|$))", re.IGNORECASE | re.DOTALL
)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?%?|-?\.\d+%?")
_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
# Anything longer is not an answer a grader should spend time parsing.
MAX_ANSWER_CHARS = 1000


class GroundTruthError(ValueError):
    """The reference answer of a sample is not a parsable math expression (a data error)."""


@dataclass(frozen=True)
class MathGrade:
    reward: float
    correct: bool
    format_error: bool
    answer: str | None


def _braced(text: str, open_index: int) -> str | None:
    """Content of the brace group starting at ``text[open_index] == '{'`` (nesting-aware)."""
    depth = 0
    for i in range(open_index, len(text)):
        ch = text[i]
        # An escaped brace (\{ \} of a set) does not nest.
        if ch == "{" and (i == 0 or text[i - 1] != "\\"):
            depth += 1
        elif ch == "}" and (i == 0 or text[i - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : i]
    return None  # unbalanced


def extract_boxed(text: str) -> str | None:
    """Content of the last well-formed ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``)."""
    for match in reversed(list(_BOXED.finditer(text))):
        start = match.end()
        if start < len(text) and text[start] == "{":
            content = _braced(text, start)
            if content is not None:
                return content.strip()
        else:
            token = re.match(r"[^\s$]+", text[start:])
            if token:
                return token.group(0)
    return None


def _strip_delimiters(span: str) -> str:
    span = span.strip().rstrip(".").strip()
    for left, right in _DELIMITERS:
        if span.startswith(left) and span.endswith(right) and len(span) >= len(left) + len(right):
            span = span[len(left) : len(span) - len(right)].strip()
            break
    return span


def extract_answer(text: str, mode: ExtractionMode = "auto") -> str | None:
    """The final answer written in ``text``, or None when there is none (a format error).

    ``auto`` tries, in order: the last ``\\boxed{}``, the last "#### X" line, the last
    "answer is X" / "answer: X", the last number. ``boxed`` accepts only ``\\boxed{}``.
    """
    if not isinstance(text, str) or not text.strip():
        return None
    boxed = extract_boxed(text)
    if boxed is not None or mode == "boxed":
        return boxed or None
    hashes = _GSM8K.findall(text)
    if hashes:
        answer = _strip_delimiters(hashes[-1])
        if answer:
            return answer
    stated = _ANSWER_IS.findall(text)
    if stated:
        answer = _strip_delimiters(stated[-1])
        if answer:
            return answer
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1].replace(" ", "").rstrip(",")
    return None


def _parse(expression: str, timeout_s: int) -> list[object]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    # Wrapping in \boxed makes math_verify parse the span itself rather than hunt inside it.
    return list(
        parse(
            f"\\boxed{{{expression}}}",
            extraction_config=[LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
            parsing_timeout=timeout_s,
        )
    )


def verify_answer(answer: str, ground_truth: str, timeout_s: int = 5) -> bool:
    """Whether ``answer`` is mathematically equivalent to ``ground_truth``.

    ``timeout_s`` bounds math_verify's own (signal-based) timeouts; call it in a process's
    main thread, and under a hard timeout (`rl_envs.pool.WorkerPool`) for untrusted input.
    """
    from math_verify import verify

    if not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
        return False
    gold = _parse(ground_truth, timeout_s)
    if not gold:
        raise GroundTruthError(f"ground truth {ground_truth!r} could not be parsed as a math expression")
    predicted = _parse(answer, timeout_s)
    if not predicted:
        return False
    return bool(verify(gold, predicted, timeout_seconds=timeout_s))


def grade_response(
    response: str, ground_truth: str, mode: ExtractionMode = "auto", timeout_s: int = 5
) -> MathGrade:
    """Extract and verify; never raises for anything in ``response``."""
    answer = extract_answer(response, mode)
    if answer is None:
        return MathGrade(reward=0.0, correct=False, format_error=True, answer=None)
    correct = verify_answer(answer, ground_truth, timeout_s)
    return MathGrade(reward=1.0 if correct else 0.0, correct=correct, format_error=False, answer=answer)


def warm_up() -> None:
    """One verification, so math_verify's lazy imports happen before the first real sample."""
    verify_answer("\\frac{1}{2}", "0.5")


# math_verify logs a warning per timeout and per unparsable string; at RL batch sizes that is noise.
logging.getLogger("math_verify").setLevel(logging.ERROR)
