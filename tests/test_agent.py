"""The grader decides every reward, so it is tested case by case against realistic completions,
including each bug of the graders it replaces (DESIGN.md §8, STYLE.md Avoid 5)."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

from gsm8kctl.agent import (
    DEFAULT_TASK_TEMPLATE,
    Grade,
    answers_match,
    build_messages,
    extract_lenient,
    extract_strict,
    format_gold_solution,
    grade,
    normalize_answer,
    parse_gold,
)

GSM8K_TRAIN = Path("/work/shared/data/gsm8k/train.jsonl")
# The first record of GSM8k train, verbatim (also read from disk below when it is there).
NATALIA_ANSWER = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)

# ---------------------------------------------------------------------------------------------
# Completion table: (completion, gold, strict, lenient, correct_strict, correct_lenient)

EXTRACTION_CASES = [
    pytest.param(
        "Natalia sold 48/2 = 24 clips in May.\nAltogether 48 + 24 = 72.\n"
        r"The final answer is \boxed{72}.",
        "72", "72", "72", True, True, id="plain-box",
    ),
    # Peer bug: `-?\d+` read \boxed{1,234} as 1.
    pytest.param(r"The total is \boxed{1,234}.", "1234", "1,234", "1,234", True, True,
                 id="thousands-comma-in-box"),
    pytest.param(r"So she pays \boxed{\$1,234.50}.", "1234.5", r"\$1,234.50", r"\$1,234.50",
                 True, True, id="escaped-dollar-thousands-cents"),
    # Peer bug: "18.0" vs "18" compared as strings.
    pytest.param(r"Each box holds \boxed{18.0} apples.", "18", "18.0", "18.0", True, True,
                 id="decimal-zero-vs-int"),
    pytest.param(r"He earns \boxed{10.00} dollars.", "10", "10.00", "10.00", True, True,
                 id="ten-vs-ten-point-oh-oh"),
    # Peer bug: partial credit for substrings.
    pytest.param(r"The farm has \boxed{200} cows.", "20", "200", "200", False, False,
                 id="no-substring-credit-200-vs-20"),
    pytest.param(r"The farm has \boxed{20} cows.", "200", "20", "20", False, False,
                 id="no-substring-credit-20-vs-200"),
    pytest.param(r"Answer: \boxed{1}", "1234", "1", "1", False, False, id="one-is-not-1234"),
    # Nested braces.
    pytest.param(r"Half of it: \boxed{\frac{1}{2}}", "0.5", r"\frac{1}{2}", r"\frac{1}{2}",
                 True, True, id="nested-frac"),
    pytest.param(r"\boxed{\dfrac{3}{4}}", "0.75", r"\dfrac{3}{4}", r"\dfrac{3}{4}", True, True,
                 id="nested-dfrac"),
    pytest.param(r"\boxed{\text{18 apples}}", "18", r"\text{18 apples}", r"\text{18 apples}",
                 True, True, id="text-with-unit"),
    pytest.param(r"\boxed{\mbox{18}}", "18", r"\mbox{18}", r"\mbox{18}", True, True, id="mbox"),
    pytest.param(r"\boxed{{18}}", "18", "{18}", "{18}", True, True, id="double-braces"),
    pytest.param(r"Final: \boxed {18}", "18", "18", "18", True, True, id="space-before-brace"),
    # Multiple boxes: the last wins.
    pytest.param(r"First guess \boxed{5}, but recheck: 3 + 4 = 7, so \boxed{7}.", "7", "7", "7",
                 True, True, id="last-box-wins"),
    pytest.param(r"\boxed{7} ... wait, I made an error. \boxed{8}", "7", "8", "8", False, False,
                 id="last-box-wins-even-if-wrong"),
    # An echo of the instruction's empty box is not an answer.
    pytest.param(r"I will put it within \boxed{}. 6 * 7 = 42, so \boxed{42}. Format: \boxed{}",
                 "42", "42", "42", True, True, id="empty-boxes-skipped"),
    # Unbalanced last box (cut mid-answer).
    pytest.param(r"Total is 5 + 13 = 18, so \boxed{18", "18", None, "18", False, True,
                 id="unbalanced-box"),
    # No box at all: strict fails, lenient falls back.
    pytest.param("48 + 24 = 72 clips.\n#### 72", "72", None, "72", False, True, id="hashes"),
    pytest.param("So the total is\n#### 1,234\n", "1234", None, "1,234", False, True,
                 id="hashes-thousands"),
    pytest.param("#### -12", "-12", None, "-12", False, True, id="hashes-negative"),
    pytest.param("#### Step 1: add\n3 + 4 = 7 pages.", "7", None, "7", False, True,
                 id="markdown-heading-is-not-hashes"),
    pytest.param("#### 1. Count the apples\nThere are 9 apples.", "9", None, "9", False, True,
                 id="numbered-heading-is-not-hashes"),
    pytest.param("The answer is $1,234.", "1234", None, "1,234", False, True,
                 id="answer-is-dollar-thousands"),
    pytest.param("The final answer is: **$1,234**.", "1234", None, "1,234", False, True,
                 id="final-answer-is-colon-bold"),
    pytest.param("THE ANSWER IS 18", "18", None, "18", False, True, id="answer-is-uppercase"),
    pytest.param("So the answer is 18 apples, since 6 * 3 = 18 and 2 were eaten later.", "18",
                 None, "18", False, True, id="answer-is-beats-last-number"),
    pytest.param("**Answer:** 42", "42", None, "42", False, True, id="markdown-answer-colon"),
    pytest.param("The answer is not obvious. Working it out, 5 * 3 = 15.", "15", None, "15",
                 False, True, id="answer-is-without-number"),
    pytest.param(r"The final answer is \frac{3}{4}.", "0.75", None, r"\frac{3}{4}", False, True,
                 id="answer-is-latex-frac"),
    pytest.param("The final answer is 3.", "3", None, "3", False, True,
                 id="trailing-period-not-decimal"),
    # Unicode minus.
    pytest.param("The temperature fell, so the answer is \u22125.", "-5", None, "-5", False, True,
                 id="unicode-minus-lenient"),
    pytest.param("So \\boxed{\u22125} degrees.", "-5", "\u22125", "\u22125", True, True,
                 id="unicode-minus-in-box"),
    pytest.param(r"He is down \boxed{-5} dollars.", "-5", "-5", "-5", True, True,
                 id="negative-box"),
    pytest.param(r"He is down \boxed{-5} dollars.", "5", "-5", "-5", False, False,
                 id="sign-matters"),
    # Ranges: the hyphen after a digit is not a minus sign.
    pytest.param("It takes 3-4 hours", "4", None, "4", False, True, id="range-not-negative"),
    # Last number fallback.
    pytest.param("She had 5 apples and bought 3 more, 8 in total.", "8", None, "8", False, True,
                 id="last-number"),
    pytest.param("She earns $12 per hour; for 50 minutes that is $10.", "10", None, "10", False,
                 True, id="last-number-dollar-period"),
    pytest.param("The sum is 3.5.", "3.5", None, "3.5", False, True, id="last-number-decimal"),
    pytest.param("No idea, sorry.", "3", None, None, False, False, id="no-number"),
    pytest.param("", "3", None, None, False, False, id="empty-completion"),
    # Fractions vs decimals.
    pytest.param(r"\boxed{0.5}", "1/2", "0.5", "0.5", True, True, id="decimal-vs-fraction"),
    pytest.param(r"\boxed{.5}", "0.5", ".5", ".5", True, True, id="leading-dot"),
    pytest.param(r"\boxed{1/3}", "0.33", "1/3", "1/3", False, False, id="exact-not-rounded"),
    pytest.param(r"\boxed{2\frac{1}{2}}", "2.5", r"2\frac{1}{2}", r"2\frac{1}{2}", True, True,
                 id="mixed-number"),
    # Percent: GSM8k gold never carries %, "25%" means 25.
    pytest.param(r"The discount is \boxed{25\%}.", "25", r"25\%", r"25\%", True, True,
                 id="percent-latex"),
    pytest.param(r"\boxed{25%}", "25", "25%", "25%", True, True, id="percent-plain"),
    # Units.
    pytest.param(r"\boxed{18 \text{ cm}}", "18", r"18 \text{ cm}", r"18 \text{ cm}", True, True,
                 id="unit-cm"),
    pytest.param(r"\boxed{40 \text{ m}^2}", "40", r"40 \text{ m}^2", r"40 \text{ m}^2", True, True,
                 id="unit-with-exponent"),
    pytest.param(r"\boxed{\$18}", "18", r"\$18", r"\$18", True, True, id="escaped-dollar"),
    pytest.param(r"\boxed{18 dollars}", "18", "18 dollars", "18 dollars", True, True,
                 id="unit-dollars-word"),
    # Markdown bold and trailing punctuation inside the box.
    pytest.param(r"\boxed{**18**}", "18", "**18**", "**18**", True, True, id="bold-in-box"),
    pytest.param(r"\boxed{18.}", "18", "18.", "18.", True, True, id="trailing-dot-in-box"),
    pytest.param(r"\boxed{18!}", "18", "18!", "18!", True, True, id="trailing-bang-in-box"),
    # Expressions: the last number is the result.
    pytest.param(r"\boxed{x = 18}", "18", "x = 18", "x = 18", True, True, id="x-equals"),
    pytest.param(r"\boxed{5 + 3 = 8}", "8", "5 + 3 = 8", "5 + 3 = 8", True, True,
                 id="expression-last-number"),
    # Thousands separators that are not commas; spaces never merge numbers.
    pytest.param(r"\boxed{18\,000}", "18000", r"18\,000", r"18\,000", True, True,
                 id="thin-space-thousands"),
    pytest.param(r"\boxed{1{,}234}", "1234", "1{,}234", "1{,}234", True, True,
                 id="latex-comma-thousands"),
    pytest.param(r"\boxed{3 4}", "34", "3 4", "3 4", False, False, id="space-does-not-merge"),
    # A box that holds no number: strict finds it, but it is unreadable.
    pytest.param(r"\boxed{\text{not enough information}}", "5",
                 r"\text{not enough information}", r"\text{not enough information}",
                 False, False, id="box-without-number"),
    pytest.param(r"\boxed{10^6}", "1000000", "10^6", "10^6", True, True, id="power-of-ten"),
]


@pytest.mark.parametrize(
    "completion, gold, strict, lenient, correct_strict, correct_lenient", EXTRACTION_CASES
)
def test_extraction_and_grading(completion, gold, strict, lenient, correct_strict,
                                correct_lenient):
    assert extract_strict(completion) == strict
    assert extract_lenient(completion) == lenient
    g = grade(completion, gold)
    assert (g.strict, g.lenient) == (strict, lenient)
    assert g.format is (strict is not None)
    assert (g.correct_strict, g.correct_lenient) == (correct_strict, correct_lenient)
    assert g.correct is correct_strict
    assert grade(completion, gold, reward_extractor="lenient").correct is correct_lenient


# ---------------------------------------------------------------------------------------------
# normalize_answer table: raw -> exact value (None: no number)

NORMALIZE_CASES = [
    ("1,234", Fraction(1234)),
    ("$18", Fraction(18)),
    (r"\$18", Fraction(18)),
    ("18.00", Fraction(18)),
    ("18%", Fraction(18)),
    ("**18**", Fraction(18)),
    (r"\text{18 apples}", Fraction(18)),
    ("18 apples", Fraction(18)),
    ("-5", Fraction(-5)),
    ("\u22125", Fraction(-5)),
    ("-$5", Fraction(-5)),
    ("1/2", Fraction(1, 2)),
    (r"\frac{1}{2}", Fraction(1, 2)),
    (r"\dfrac{1}{2}", Fraction(1, 2)),
    (r"\dfrac12", Fraction(1, 2)),
    (r"-\frac{3}{4}", Fraction(-3, 4)),
    (r"\frac{-3}{4}", Fraction(-3, 4)),
    (r"\frac{\frac{1}{2}}{3}", Fraction(1, 6)),
    (r"\frac{x}{2}", None),
    ("0.5", Fraction(1, 2)),
    (".5", Fraction(1, 2)),
    ("18.", Fraction(18)),
    ("18!", Fraction(18)),
    ("18 cm", Fraction(18)),
    (r"\mbox{18}", Fraction(18)),
    ("{18}", Fraction(18)),
    ("x = 18", Fraction(18)),
    (r"18\,000", Fraction(18000)),
    ("18\u202f000", Fraction(18000)),
    ("1 234", Fraction(234)),  # a plain space is ambiguous: never merged
    ("3-4", Fraction(4)),  # a range, not 3 and -4
    ("(-5)", Fraction(-5)),
    (r"\$1,234.50", Fraction(2469, 2)),
    ("12,345,678", Fraction(12345678)),
    ("1,2345", Fraction(2345)),  # not a thousands group
    (r"2.5 \times 10^3", Fraction(2500)),
    ("5/0", None),
    ("", None),
    ("apples", None),
]


@pytest.mark.parametrize("raw, expected", NORMALIZE_CASES)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize(
    "pred, gold, expected",
    [
        ("18.0", "18", True),
        ("10.00", "10", True),
        ("0.5", "1/2", True),
        ("20", "200", False),
        ("200", "20", False),
        ("1,234", "1234", True),
        (None, "18", False),
        ("abc", "18", False),
        ("18", "abc", False),
    ],
)
def test_answers_match(pred, gold, expected):
    assert answers_match(pred, gold) is expected


# ---------------------------------------------------------------------------------------------
# Rewards and reasons


def test_grade_correct_reward_and_reason():
    g = grade(r"6 * 3 = 18, so \boxed{18}.", "18")
    assert g == Grade("18", "18", True, True, True, True, 1.0, "correct (strict)")


def test_grade_wrong_reward_and_reason():
    g = grade(r"\boxed{17}", "18")
    assert (g.reward, g.correct, g.reason) == (0.0, False, "wrong: 17 != 18")


def test_grade_no_box_is_minus_one_under_strict_but_scored_under_lenient():
    text = "48 + 24 = 72, so the answer is 72."
    strict = grade(text, "72")
    assert (strict.format, strict.reward, strict.reason) == (False, -1.0, "no \\boxed{} answer")
    lenient = grade(text, "72", reward_extractor="lenient")
    assert (lenient.correct, lenient.reward, lenient.reason) == (True, 1.0, "correct (lenient)")


def test_grade_no_number_under_lenient():
    g = grade("I cannot solve this.", "3", reward_extractor="lenient")
    assert (g.lenient, g.reward, g.reason) == (None, -1.0, "no answer found")


def test_grade_unreadable_box_is_minus_one():
    g = grade(r"\boxed{\text{unknown}}", "3")
    assert g.format is True
    assert g.reward == -1.0
    assert g.reason.startswith("unreadable answer")


def test_grade_length_cut_is_minus_one_even_with_a_right_box():
    g = grade(r"So far \boxed{18}, but let me double-check by recomputing 6 *", "18",
              finish_reason="length")
    assert g.reward == -1.0
    assert g.reason == "cut at max tokens"
    # What was extracted is still reported, for accuracy curves and the browser.
    assert (g.strict, g.correct_strict, g.correct) == ("18", True, True)


def test_grade_rejects_unknown_extractor():
    with pytest.raises(ValueError, match="reward_extractor"):
        grade(r"\boxed{1}", "1", reward_extractor="fuzzy")


def test_grade_is_fast_on_long_completions():
    # Regexes run on every sample; a long ramble must not backtrack catastrophically.
    text = ("The answer is " + "*" * 50 + " ") * 200 + "1 " * 5000 + ":" * 5000
    g = grade(text, "1", reward_extractor="lenient")
    assert g.lenient == "1"
    # A repetition loop of unclosed or empty boxes is scanned once, not once per box.
    assert extract_strict("\\boxed{" * 20000) is None
    assert extract_strict("\\boxed{}" * 20000 + "\\boxed{3}" + "\\boxed{}" * 20000) == "3"


# ---------------------------------------------------------------------------------------------
# Prompts


def test_default_template_renders_boxed_instruction():
    rendered = DEFAULT_TASK_TEMPLATE.format(question="What is 2+2?")
    assert rendered == (
        "What is 2+2?\nPlease reason step by step, and put your final answer within \\boxed{}."
    )


def test_build_messages_plain():
    assert build_messages("What is 2+2?") == [
        {"role": "user", "content": DEFAULT_TASK_TEMPLATE.format(question="What is 2+2?")}
    ]


@pytest.mark.parametrize("system_prompt", [None, "", "   "])
def test_build_messages_never_sends_an_empty_system_message(system_prompt):
    messages = build_messages("Q?", system_prompt=system_prompt)
    assert [m["role"] for m in messages] == ["user"]


def test_build_messages_few_shot_order_and_problem_last():
    messages = build_messages(
        "Final {question} with braces?",
        system_prompt="You are a careful math tutor.",
        task_template="Q: {question}",
        few_shot=[("1+1?", r"1+1=2. The final answer is \boxed{2}."),
                  ("2+3?", r"2+3=5. The final answer is \boxed{5}.")],
    )
    assert messages == [
        {"role": "system", "content": "You are a careful math tutor."},
        {"role": "user", "content": "Q: 1+1?"},
        {"role": "assistant", "content": r"1+1=2. The final answer is \boxed{2}."},
        {"role": "user", "content": "Q: 2+3?"},
        {"role": "assistant", "content": r"2+3=5. The final answer is \boxed{5}."},
        {"role": "user", "content": "Q: Final {question} with braces?"},
    ]


# ---------------------------------------------------------------------------------------------
# Gold answers


def _first_train_answer() -> str:
    if GSM8K_TRAIN.exists():
        with GSM8K_TRAIN.open() as f:
            return json.loads(f.readline())["answer"]
    return NATALIA_ANSWER


def test_format_gold_solution_on_real_gsm8k_answer():
    answer = _first_train_answer()
    assert answer == NATALIA_ANSWER
    assert format_gold_solution(answer) == (
        "Natalia sold 48/2 = 24 clips in May.\n"
        "Natalia sold 48+24 = 72 clips altogether in April and May.\n"
        "The final answer is \\boxed{72}."
    )
    # The gold solution must grade as correct under the strict extractor.
    assert grade(format_gold_solution(answer), parse_gold(answer)).reward == 1.0


def test_format_gold_solution_removes_commas_and_all_annotations():
    answer = "He pays 2 * $<<2*617=1234>>1,234 = $<<2*1234=2468>>2,468.\n#### 2,468"
    assert format_gold_solution(answer) == (
        "He pays 2 * $1,234 = $2,468.\nThe final answer is \\boxed{2468}."
    )


@pytest.mark.parametrize(
    "answer, gold",
    [
        (NATALIA_ANSWER, "72"),
        ("Some steps.\n#### 1,234", "1234"),
        ("He lost money.\n#### -47", "-47"),
        ("Half a pie.\n#### 0.5", "0.5"),
        ("#### 1,575,000", "1575000"),
    ],
)
def test_parse_gold(answer, gold):
    assert parse_gold(answer) == gold


def test_parse_gold_without_hashes_is_an_error():
    with pytest.raises(ValueError, match="####"):
        parse_gold("no final line here")
