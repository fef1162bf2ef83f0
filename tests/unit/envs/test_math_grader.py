"""Answer extraction and math equivalence (math_verify) on a table of forms and near-misses."""

from __future__ import annotations

import pytest

from rl_envs.math_grader import extract_answer, extract_boxed, grade_response, verify_answer

# (model's answer, ground truth): must be judged equal.
EQUIVALENT = [
    ("\\frac{1}{2}", "0.5"),
    ("1/2", "\\frac12"),
    ("0.5", "\\dfrac{1}{2}"),
    ("3/6", "1/2"),
    ("\\frac{2}{4}", "\\frac{1}{2}"),
    ("0.1", "\\frac{1}{10}"),
    ("1.50", "\\frac{3}{2}"),
    ("-\\frac{3}{2}", "-1.5"),
    ("\\frac{3}{4}", "0.75"),
    ("0.333333", "\\frac{1}{3}"),
    ("5.0", "5"),
    ("1,000", "1000"),
    ("-0", "0"),
    ("50\\%", "0.5"),
    ("50%", "\\frac{1}{2}"),
    ("0.25", "25\\%"),
    ("100\\%", "1"),
    ("12.5\\%", "\\frac{1}{8}"),
    ("[1,2)", "[1, 2)"),
    ("(-\\infty, 3]", "(-\\infty,3]"),
    ("\\left(1, 2\\right]", "(1,2]"),
    ("\\{1,2\\}", "\\{2,1\\}"),
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"),
    ("2\\sqrt{3}", "\\sqrt{12}"),
    ("\\sqrt{16}", "4"),
    ("2^{10}", "1024"),
    ("10^{3}", "1000"),
    ("\\frac{\\pi}{2}", "\\pi/2"),
    ("\\pi", "\\pi"),
    ("\\infty", "\\infty"),
    ("x=3", "3"),
    ("2x+1", "1+2x"),
    ("(x-1)(x+1)", "x^2-1"),
    ("a+b", "b+a"),
    ("\\sin^2 x + \\cos^2 x", "1"),
    ("\\cos(0)", "1"),
    ("12\\text{ cm}", "12"),
    ("\\$12", "12"),
    ("\\text{Yes}", "yes"),
]

# (model's answer, ground truth): close but wrong; must be judged different.
NEAR_MISSES = [
    ("0.333", "\\frac{1}{3}"),
    ("\\pi", "3.14"),
    ("-3", "3"),
    ("5.01", "5"),
    ("1001", "1000"),
    ("0.5", "5"),
    ("12", "21"),
    ("10", "100"),
    ("\\frac{1}{2}", "\\frac{1}{3}"),
    ("\\frac{3}{2}", "\\frac{2}{3}"),
    ("51\\%", "0.5"),
    ("(1,2)", "(1,2]"),
    ("[1,2]", "[1,2)"),
    ("\\{1,2\\}", "\\{1,2,3\\}"),
    ("x=4", "3"),
    ("\\sqrt{3}", "\\sqrt{2}"),
    ("\\frac{\\pi}{3}", "\\frac{\\pi}{2}"),
    ("e", "2.7"),
    ("-\\infty", "\\infty"),
    ("x^2+1", "x^2-1"),
    ("2x", "2y"),
    ("2^{10}", "1000"),
]


def test_table_has_at_least_60_cases() -> None:
    assert len(EQUIVALENT) + len(NEAR_MISSES) >= 60


@pytest.mark.parametrize(("answer", "truth"), EQUIVALENT)
def test_equivalent_forms_match(answer: str, truth: str) -> None:
    assert verify_answer(answer, truth) is True


@pytest.mark.parametrize(("answer", "truth"), NEAR_MISSES)
def test_near_misses_do_not_match(answer: str, truth: str) -> None:
    assert verify_answer(answer, truth) is False


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("so the result is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),
        ("first \\boxed{1}, corrected: \\boxed{2}", "2"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 5 is it", "5"),
        ("Janet has 3 + 4 = 7 eggs.\n#### 7", "7"),
        ("#### 1,000\n", "1,000"),
        ("Therefore the answer is 3.5.", "3.5"),
        ("Final answer: $\\frac{3}{4}$", "\\frac{3}{4}"),
        ("The answer is \\(x = 2\\)\nDone", "x = 2"),
        ("I tried 3 and then 5", "5"),
        ("so we get 12, which is even", "12"),
        ("a loss of -2.5 units", "-2.5"),
        ("it is 40%", "40%"),
    ],
)
def test_extract_answer(response: str, expected: str) -> None:
    assert extract_answer(response) == expected


@pytest.mark.parametrize("response", ["", "   \n", "no numbers at all", "\\boxed{}"])
def test_nothing_to_extract(response: str) -> None:
    assert extract_answer(response) is None


def test_boxed_mode_requires_a_box() -> None:
    assert extract_answer("The answer is 4", mode="boxed") is None
    assert extract_answer("so \\boxed{4}", mode="boxed") == "4"
    # An unbalanced box is not a box; auto mode falls back to the last number.
    assert extract_boxed("\\boxed{\\frac{1}{2}") is None
    assert extract_answer("\\boxed{\\frac{1}{2}", mode="boxed") is None
    assert extract_answer("\\boxed{\\frac{1}{2}") == "2"


@pytest.mark.parametrize(
    ("response", "truth", "reward", "format_error"),
    [
        ("We get \\boxed{\\frac{6}{8}}", "0.75", 1.0, False),
        ("We get \\boxed{0.76}", "0.75", 0.0, False),
        ("#### 42", "42", 1.0, False),
        ("The answer is 50%.", "1/2", 1.0, False),
        ("", "3", 0.0, True),
        ("I don't know.", "3", 0.0, True),
        ("\\boxed{}}}{{", "3", 0.0, True),
        ("\\boxed{\\frac{}{}}", "3", 0.0, False),  # extracted, but not a number: wrong, not malformed
        ("x" * 5000 + " 3", "3", 1.0, False),
    ],
)
def test_grade_response(response: str, truth: str, reward: float, format_error: bool) -> None:
    grade = grade_response(response, truth)
    assert grade.reward == reward
    assert grade.format_error is format_error


def test_unparsable_ground_truth_is_a_data_error() -> None:
    with pytest.raises(ValueError, match="ground truth"):
        verify_answer("3", "}{")
