"""The grader decides every reward, so it is tested case by case against realistic completions,
including each bug of the graders it replaces (TapeAgents' GSM8k answer extraction)."""

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
    # A number or power too big to be an answer is unreadable, never a crash
    # (Python refuses int <-> str past 4,300 digits).
    pytest.param(r"\boxed{" + "9" * 44 + "^{99}}", "18", "9" * 44 + "^{99}", "9" * 44 + "^{99}",
                 False, False, id="huge-power-unreadable"),
    pytest.param(r"\boxed{2^{99999}}", "18", "2^{99999}", "2^{99999}", False, False,
                 id="huge-exponent-unreadable"),
    pytest.param(r"\boxed{" + "1" * 5000 + "}", "18", "1" * 5000, "1" * 5000, False, False,
                 id="5000-digit-number-unreadable"),
    pytest.param("The answer is " + "7" * 5000, "7", None, "7" * 5000, False, False,
                 id="5000-digit-number-lenient"),
    pytest.param(r"\boxed{\frac{" + "3" * 400 + "}{3}}", "18", r"\frac{" + "3" * 400 + "}{3}",
                 r"\frac{" + "3" * 400 + "}{3}", False, False, id="huge-fraction-unreadable"),
    pytest.param(r"\boxed{10^{100}}", "18", "10^{100}", "10^{100}", False, False,
                 id="big-power-still-a-number"),
    # A minus apart from its number is still its sign.
    pytest.param(r"\boxed{- 5}", "-5", "- 5", "- 5", True, True, id="minus-space"),
    pytest.param(r"\boxed{- 5}", "5", "- 5", "- 5", False, False, id="minus-space-is-not-plus"),
    pytest.param(r"\boxed{-\$ 5}", "-5", r"-\$ 5", r"-\$ 5", True, True, id="minus-dollar-space"),
    pytest.param(r"\boxed{-\,5}", "-5", r"-\,5", r"-\,5", True, True, id="minus-thin-space"),
    pytest.param(r"\boxed{-(5)}", "-5", "-(5)", "-(5)", True, True, id="minus-parenthesis"),
    pytest.param(r"\boxed{-\left(5\right)}", "-5", r"-\left(5\right)", r"-\left(5\right)",
                 True, True, id="minus-left-right"),
    pytest.param(r"\boxed{(-5)}", "-5", "(-5)", "(-5)", True, True, id="parenthesised-negative"),
    # A box holding an expression or alternatives is unreadable (not evaluated), never
    # credited by its last operand; a result after "=" is read.
    pytest.param(r"\boxed{3 \times 18}", "18", r"3 \times 18", r"3 \times 18", False, False,
                 id="product-not-credited"),
    pytest.param(r"\boxed{3 \times 18}", "54", r"3 \times 18", r"3 \times 18", False, False,
                 id="product-not-evaluated"),
    pytest.param(r"\boxed{10 + 18}", "18", "10 + 18", "10 + 18", False, False,
                 id="sum-not-credited"),
    pytest.param(r"\boxed{19 \text{ or } 18}", "18", r"19 \text{ or } 18", r"19 \text{ or } 18",
                 False, False, id="alternatives-not-credited"),
    pytest.param(r"\boxed{17-18}", "18", "17-18", "17-18", False, False, id="range-not-credited"),
    pytest.param(r"\boxed{18, 19}", "19", "18, 19", "18, 19", False, False, id="list-not-credited"),
    pytest.param(r"\boxed{x = 3 + 15}", "18", "x = 3 + 15", "x = 3 + 15", False, False,
                 id="expression-after-equals-not-credited"),
    pytest.param(r"\boxed{3 \times 6 = 18}", "18", r"3 \times 6 = 18", r"3 \times 6 = 18", True,
                 True, id="expression-with-result"),
    pytest.param(r"\boxed{18 \text{ (2 left)}}", "18", r"18 \text{ (2 left)}",
                 r"18 \text{ (2 left)}", True, True, id="parenthesised-remark"),
    pytest.param(r"\boxed{60 \frac{km}{h}}", "60", r"60 \frac{km}{h}", r"60 \frac{km}{h}", True,
                 True, id="frac-unit"),
    pytest.param(r"\boxed{\frac{55}{3} \approx 18}", "18", r"\frac{55}{3} \approx 18",
                 r"\frac{55}{3} \approx 18", True, True, id="approx-reads-stated-value"),
    # Lenient reads the number after the last "=", and the statement written last.
    pytest.param("48 + 24 = 72, so the answer is 48 + 24 = 72.", "72", None, "48 + 24 = 72",
                 False, True, id="answer-is-chain"),
    pytest.param("48 + 24 = 72, so the answer is 48 + 24 = 72.", "48", None, "48 + 24 = 72",
                 False, False, id="answer-is-chain-not-first-operand"),
    pytest.param(r"the answer is 2 \times 3 = 6 apples", "6", None, r"2 \times 3 = 6", False, True,
                 id="answer-is-latex-chain"),
    pytest.param("The answer is 3 + 15, I think.", "3", None, "3 + 15", False, False,
                 id="answer-is-expression-unreadable"),
    pytest.param("The answer is 18\n+ 2 more would be 20 but no.", "18", None, "18", False, True,
                 id="answer-is-chain-stays-on-its-line"),
    pytest.param("#### 5\nWait, that is wrong. The answer is 18.", "18", None, "18", False, True,
                 id="answer-is-after-hashes-wins"),
    pytest.param("The answer is 5.\nNo: recount.\n#### 18", "18", None, "18", False, True,
                 id="hashes-after-answer-is-wins"),
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
    ("1 234", None),  # a plain space is ambiguous: never merged, and two numbers are no answer
    ("3-4", None),  # a range (not 3 and -4): no single answer
    ("(-5)", Fraction(-5)),
    (r"\$1,234.50", Fraction(2469, 2)),
    ("12,345,678", Fraction(12345678)),
    ("1,2345", None),  # not a thousands group: the list 1, 2345
    ("5 + 3 = 8", Fraction(8)),
    ("x = 5 = 2 + 3", None),
    ("- 5", Fraction(-5)),
    ("-(5)", Fraction(-5)),
    ("18 (2 left)", Fraction(18)),
    ("18 (since 6 * 3 = 18)", Fraction(18)),
    ("9" * 301, None),
    ("9" * 300, Fraction(int("9" * 300))),
    ("2^{-3}", Fraction(1, 8)),
    ("0^{-1}", None),
    (r"\frac{1}{2}^{9999}", None),
    ("1" * 20000, None),
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
    # What was extracted is still reported (the browser shows it), but `correct` agrees with the
    # reward, and the accuracy metrics count the tape as not correct (test_gather_tapes).
    assert (g.strict, g.correct_strict, g.correct_lenient, g.correct) == ("18", True, True, False)


def test_grade_huge_number_is_unreadable_not_a_crash():
    g = grade(r"\boxed{" + "9" * 44 + "^{99}}", "18")
    assert (g.format, g.reward, g.correct) == (True, -1.0, False)
    assert g.reason.startswith("unreadable answer")


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


# Fragments a model (or a broken decoder) strings together: LaTeX, markdown, signs, operators,
# brackets, long digit runs, the phrases the extractors look for, and non-ASCII junk.
_JUNK = ["\\boxed{", "}", "{", "\\frac", "\\dfrac{", "^", "^{", "-", "\u2212", "- (", "=",
         "\\approx", "(", ")", "\\text{", "\\times", "\\,", "\\$", "$", "%", "*", "**", ":", ".",
         ",", "/", " ", "\n", "\t", "#### ", "The answer is ", "answer: ", "x", "10", "0", "3",
         "1,234", "9" * 60, "1" * 5000, "\\", "\\left(", "\u00a0", "\u202f", "\u0663",
         "\U0001F600", "\ud800", "\x00", "\u00d7", "<<", ">>", "nan", "inf", "1e5", "0x1F"]


def test_grade_never_raises_on_junk():
    import random

    rng = random.Random(13)
    for _ in range(1000):
        text = "".join(rng.choice(_JUNK) for _ in range(rng.randint(0, 30)))
        for extractor in ("strict", "lenient"):
            g = grade(text, rng.choice(["18", "-5", "0.5", "1234", text]),
                      finish_reason=rng.choice(["stop", "length"]), reward_extractor=extractor)
            assert g.reward in (-1.0, 0.0, 1.0)
        normalize_answer(text)


# 1 MB of one fragment each: a regex that backtracks catastrophically on any of them would take
# hours here; linear ones take well under a second per grade.
_MEGABYTE_UNITS = ["1,111", "1", " ", "- ", "-(", "\\frac{", "{", "10^{ ", "1^", "1.1", "####",
                   "\\boxed{}", "(", "1=", "1 x ", "\\", "\\times 10^", "1 / ", "The answer is **",
                   "answer is 1 + ", "#### 1 *", "2\\frac{1}{", "1\\,"]


@pytest.mark.parametrize("unit", _MEGABYTE_UNITS)
def test_grade_is_linear_on_a_megabyte(unit):
    import time

    body = unit * (1_000_000 // len(unit))
    start = time.perf_counter()
    for text in (body, "\\boxed{" + body + "}"):
        grade(text, "1", reward_extractor="lenient")
    normalize_answer(body[:10_000])  # the longest answer read; longer ones are unreadable
    # Generous for a loaded 2-core machine; quadratic behaviour would be >1000x over.
    assert time.perf_counter() - start < 20


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
