"""The chain-of-thought math agent: prompts, answer extraction, grading and reward.

Pure stdlib on purpose: the grader decides the reward of every sample, so it must be cheap to
import anywhere (sampler, filter, browser, tests) and exact. Answers are compared as numbers
(`fractions.Fraction`), never as strings or substrings — the graders this replaces read
`\\boxed{1,234}` as 1, called "18.0" wrong against "18" and gave "20" credit against "200".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

DEFAULT_TASK_TEMPLATE = (
    "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
)

REWARD_CORRECT = 1.0
REWARD_WRONG = 0.0
# No parsable answer and cut-at-max-tokens share the lowest reward: both are worse than a wrong
# number, and rewarding truncation like a wrong answer teaches the model to ramble.
REWARD_INVALID = -1.0

EXTRACTORS = ("strict", "lenient")

# ---------------------------------------------------------------------------------------------
# Number grammar shared by extraction and normalisation. ASCII digits only: `\d` would also
# accept Arabic-Indic and other Unicode digits.

# "1,234,567" only as a whole thousands group (so "1,2345" is 1 and 2345, not 12345); then a
# plain integer; optional decimal part that needs digits, so "3." at a sentence end reads 3.
# A grouped number never starts right after "digit,": else each group of a 1 MB "1,111,111,..."
# would start a new match that re-reads the rest of the run (quadratic).
_NUM = r"(?:(?:(?<![0-9],)[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)"
_FRAC_CMD = r"\\[dt]?frac"
_LATEX_FRAC = rf"{_FRAC_CMD}\s*(?:\{{[^{{}}]*\}}|[0-9])\s*(?:\{{[^{{}}]*\}}|[0-9])"
# A number must not start inside another one ("1.2.3", "12" in "312"); a minus is a sign only
# when it does not follow a digit, letter or closing bracket: "3-4" is a range, "x-5" a hyphen.
_START = r"(?<![0-9.])"
_MINUS = r"(?<![0-9A-Za-z)\]}])-"
_SIGN = rf"(?:{_MINUS})?"
# In an answer a minus may stand apart from its number: "- 5", "-\$ 5" and "-\,5" once the
# dollar and the space command are gone, and "-(5)".
_SCAN_RE = re.compile(
    rf"{_START}(?P<sign>{_MINUS}\s*(?:\(\s*)?)?(?P<num>{_NUM})(?:\s*/\s*(?P<den>{_NUM}))?"
)
# What the lenient extractor returns as the raw answer: a number, a/b, or a LaTeX fraction.
_TOKEN = rf"{_START}{_SIGN}(?:{_LATEX_FRAC}|{_NUM}(?:\s*/\s*{_NUM})?)"
_TOKEN_RE = re.compile(_TOKEN)

# Markup allowed between "answer is" / "####" and the number: "is: $1,234", "is **18**", "is \(5\)".
_GAP = r"(?:\s|\*|:|\\?\$|\\\(|\\\[|\{)*"
# "#### 72" only when the number ends the line: "#### 1. Compute the total" is a markdown heading.
_HASHES_RE = re.compile(rf"####{_GAP}(?P<ans>{_TOKEN})(?=[\s*.$}}\\)\]]*(?:\n|$))")
# "The answer is 5 + 3 = 8": the whole chain is the raw answer, read like a box (the number after
# the last "="). Same line only, so "is 5\n+ 3 more" stays 5.
_OP = r"(?:[-+*×·÷x]|\\times|\\cdot|\\div)"
_CHAIN = rf"{_TOKEN}(?:[ \t]*(?:{_OP}|=)[ \t]*{_TOKEN})*"
_ANSWER_IS_RE = re.compile(
    rf"\banswer(?:\s*\*\*)?\s*(?:is|was|:|=){_GAP}(?P<ans>{_CHAIN})", re.IGNORECASE
)
_BOXED_RE = re.compile(r"\\boxed\s*\{")
_BRACE_RE = re.compile(r"\\.|[{}]", re.DOTALL)  # an escaped char, or a brace that counts

# Unicode minus signs and dashes a model writes for "-" (en dash included: "–5" means -5; a range
# "3–4" still reads as 3 and 4 because a minus after a digit is not a sign).
_MINUS_TRANS = str.maketrans({"\u2212": "-", "\u2013": "-", "\ufe63": "-", "\uff0d": "-"})

# Normalisation (applied in this order in `normalize_answer`).
_LATEX_COMMA_RE = re.compile(r"\{,\}")  # 1{,}234 is LaTeX for 1,234
# Thin / no-break spaces as thousands separators ("18\,000"), only before a full 3-digit group;
# a plain space is NOT merged: "3 4" stays two numbers.
_THIN_SEP_RE = re.compile(r"(?<=[0-9])(?:\\,|\\!|\\ |~|\u2009|\u202f|\u00a0)(?=[0-9]{3}(?![0-9]))")
_FRAC_RE = re.compile(
    rf"(?:(?<![0-9.])(?P<whole>-?[0-9]+)\s*|(?P<neg>{_MINUS})\s*)?{_FRAC_CMD}\s*"
    r"(?:\{(?P<a>[^{}]*)\}|(?P<a1>[0-9]))\s*(?:\{(?P<b>[^{}]*)\}|(?P<b1>[0-9]))"
)
_PLAIN_RE = re.compile(rf"\s*(?P<sign>-\s*)?(?P<num>{_NUM})(?:\s*/\s*(?P<den>{_NUM}))?\s*")
_DOLLAR_PERCENT_RE = re.compile(r"\\?[$%]")  # GSM8k gold never uses %: "18%" means 18
# The exponent's size is checked in `_power`: 10^6 is an answer, 10^99999 a denial of service.
# `(?:\{\s*)?`, not `\{?\s*`: two `\s*` in a row backtrack quadratically over a run of spaces.
_EXP = r"\s*\^\s*(?:\{\s*)?(?P<e>-?[0-9]+)\s*\}?"
_SCI_RE = re.compile(rf"(?<![0-9.])(?P<m>{_NUM})\s*(?:\\times|\\cdot|×|\*|x)\s*10{_EXP}")
_POW_RE = re.compile(rf"(?<![0-9.])(?P<b>{_NUM}){_EXP}")
_UNIT_POW_RE = re.compile(r"\^\s*(?:\{\s*)?-?[0-9]+\s*\}?")  # cm^2: the 2 is not the answer
_COMMAND_RE = re.compile(r"\\[A-Za-z]+|\\[^A-Za-z0-9]|\\")  # \text, \mbox, \left, \, \( ...
_NOISE_RE = re.compile(r"[{}*]")  # braces left by \text{...}, markdown bold
_APPROX_RE = re.compile(r"\\approx|\u2248")  # "55/3 \approx 18.33": the value stated last
_REMARK_RE = re.compile(r"\([^()]*\)")  # "18 (2 left)": a remark after the answer
_DIGIT_RE = re.compile(r"[0-9]")

# Longest number read (digits) and largest power computed: no GSM8k answer comes near, and
# Python refuses int <-> str past 4,300 digits (ValueError), so model text past this is unreadable.
_MAX_DIGITS = 300
# A raw answer longer than this is a ramble or a repetition loop, not a number: unreadable
# without parsing, so a 1 MB box costs one brace scan instead of a dozen regex passes.
_MAX_ANSWER_CHARS = 10_000

# GSM8k gold solutions: calculator annotations and the final "#### N" line.
_CALC_RE = re.compile(r"<<[^<>]*>>")
_GOLD_RE = re.compile(r"####\s*(?P<ans>[^\n]*)")
_GOLD_LINE_RE = re.compile(r"^[ \t]*####[^\n]*$", re.MULTILINE)


# ---------------------------------------------------------------------------------------------
# Prompts


def build_messages(
    question: str,
    *,
    system_prompt: str | None = None,
    task_template: str = DEFAULT_TASK_TEMPLATE,
    few_shot: list[tuple[str, str]] = (),
) -> list[dict]:
    """Chat messages for one problem: [system], (user, assistant) per few-shot example, user."""
    messages: list[dict] = []
    # Some chat templates choke on (or silently inject text around) an empty system turn.
    if system_prompt and system_prompt.strip():
        messages.append({"role": "system", "content": system_prompt})
    for shot_question, shot_solution in few_shot:
        messages.append({"role": "user", "content": task_template.format(question=shot_question)})
        messages.append({"role": "assistant", "content": shot_solution})
    messages.append({"role": "user", "content": task_template.format(question=question)})
    return messages


def parse_gold(gsm8k_answer: str) -> str:
    """The gold number after the last `#### ` of a GSM8k answer, commas removed."""
    found = _GOLD_RE.findall(gsm8k_answer)
    if not found:
        raise ValueError(f"no '#### <answer>' line in GSM8k answer: {gsm8k_answer[-80:]!r}")
    return found[-1].strip().replace(",", "")


def format_gold_solution(gsm8k_answer: str) -> str:
    """A GSM8k `answer` rewritten in the agent's format (no <<calc>> notes, final \\boxed{N})."""
    gold = parse_gold(gsm8k_answer)
    body = _GOLD_LINE_RE.sub("", _CALC_RE.sub("", gsm8k_answer)).rstrip()
    final = f"The final answer is \\boxed{{{gold}}}."
    return f"{body}\n{final}" if body else final


# ---------------------------------------------------------------------------------------------
# Extraction


def _box_content(text: str, start: int) -> str | None:
    """Content of the brace group opened just before `start`; None if it never closes."""
    depth = 1
    # A regex walks from brace to brace: a 1 MB box costs a C scan, not a Python loop per char.
    for m in _BRACE_RE.finditer(text, start):
        ch = m.group()
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start : m.start()].strip()
        # else an escaped char: \{ or \} does not open or close a group
    return None


def extract_strict(text: str) -> str | None:
    """Content of the last non-empty \\boxed{...}; None if there is none or it is unbalanced."""
    # Walk boxes from the end, so a repetition loop of thousands of boxes costs one scan, not n.
    for m in reversed(list(_BOXED_RE.finditer(text))):
        content = _box_content(text, m.end())
        # Empty boxes are skipped: a model echoing the instruction "within \boxed{}" has not
        # answered. An unclosed last box is no answer: the model never finished writing it.
        if content != "":
            return content
    return None


def _last_match(pattern: re.Pattern, text: str) -> re.Match | None:
    """Last match of `pattern` in `text`, without holding every match in a list."""
    m = None
    for m in pattern.finditer(text):
        pass
    return m


def extract_lenient(text: str) -> str | None:
    """Strict, else the last `#### N` or "the (final) answer is N" (whichever comes later; in
    "answer is 5 + 3 = 8" the whole chain), else the last number in the text."""
    strict = extract_strict(text)
    return strict if strict is not None else _extract_unboxed(text)


def _extract_unboxed(text: str) -> str | None:
    """Lenient answer of a text that holds no closed, non-empty box."""
    text = text.translate(_MINUS_TRANS)
    # The statement written last wins: "#### 5 ... wait, the answer is 6" means 6.
    found = [m for m in (_last_match(_HASHES_RE, text), _last_match(_ANSWER_IS_RE, text)) if m]
    if found:
        return max(found, key=lambda m: m.start()).group("ans").strip()
    last = _last_match(_TOKEN_RE, text)
    return last.group().strip() if last else None


# ---------------------------------------------------------------------------------------------
# Normalisation and comparison


def _plain_fraction(s: str) -> Fraction | None:
    """Exact value of a string that is just a (signed) number or a/b; else None."""
    m = _PLAIN_RE.fullmatch(s)
    if not m:
        return None
    return _value(m.group("sign"), m.group("num"), m.group("den"))


def _value(sign: str | None, num: str, den: str | None) -> Fraction | None:
    """Fraction for sign + num [/ den]; None for a zero denominator."""
    value = _num(num)
    if den is not None:
        d = _num(den)
        if d == 0:
            return None
        value /= d
    return -value if sign else value


def _frac_sub(m: re.Match) -> str:
    """\\frac{a}{b} (or the mixed number 2\\frac{1}{2}) -> 'p/q' text the scanner reads."""
    a = _plain_fraction(m.group("a") if m.group("a") is not None else m.group("a1"))
    b = _plain_fraction(m.group("b") if m.group("b") is not None else m.group("b1"))
    whole = m.group("whole")
    if a is None or b is None or b == 0:
        # \frac{x}{2} is not a number; do not let its 2 stand in for one. A number before it
        # stays: in '60 \frac{km}{h}' the fraction is a unit, not the fraction part of 60.
        return f" {whole or ''} nan "
    value = a / b
    if whole is not None:
        w = _num(whole)
        value = w - value if whole.startswith("-") else w + value
    elif m.group("neg"):
        value = -value
    # Padded on the left too: "3.\frac12" must not become "3.1/2".
    return f" {_as_text(value)}"


class _TooBig(ValueError):
    """A number or power past `_MAX_DIGITS`: the whole answer is unreadable."""


def _num(s: str) -> Fraction:
    """Fraction of a `_NUM` match ('1,234.5')."""
    if len(s) > _MAX_DIGITS:
        raise _TooBig(s[:20])
    return Fraction(s.replace(",", ""))


def _power(base: Fraction, exp_text: str) -> Fraction:
    """base ** exp, refused when the result would pass `_MAX_DIGITS` digits."""
    if len(exp_text) > 4:  # before int(): the exponent itself may be 1 MB of digits
        raise _TooBig(exp_text[:20])
    exp = int(exp_text)
    size = max(len(str(abs(base.numerator))), len(str(base.denominator)))
    if abs(exp) * size > _MAX_DIGITS:
        raise _TooBig(f"^{exp}")
    return base**exp


def _pow_sub(m: re.Match) -> str:
    """'b^e' -> its value; 0^-1 is no number."""
    base = _num(m.group("b"))
    if base == 0 and m.group("e").startswith("-"):
        return " nan "
    return _as_text(_power(base, m.group("e")))


def _sci_sub(m: re.Match) -> str:
    """'2.5 \\times 10^3' -> its value."""
    return _as_text(_num(m.group("m")) * _power(Fraction(10), m.group("e")))


def _as_text(value: Fraction) -> str:
    """A value written back as 'p/q ' for the number scanner; no left pad so '-' stays its sign."""
    return f"{value} "


def normalize_answer(raw: str) -> Fraction | None:
    """Exact number in a raw answer ('\\$1,234.50', '\\frac{1}{2}', '18 apples', 'x = 18'); None
    if it holds none or is unreadable.

    The answer is the number after the last `=` ('5 + 3 = 8' is 8). Expressions are not
    evaluated: when another number follows it there, outside a parenthesised remark ('18 (2
    left)' is 18), the answer is an expression or a list of alternatives ('3 \\times 18',
    '19 \\text{ or } 18', '17-18') and unreadable, never credited by one of its operands.
    Powers ('10^6', '2.5 \\times 10^3') and fractions are numbers, not expressions. A number
    longer than `_MAX_DIGITS`, or a power that would be, makes the answer unreadable."""
    if raw is None or len(raw) > _MAX_ANSWER_CHARS:
        return None
    try:
        return _read_number(raw)
    except ValueError:
        # _TooBig, and a safety net: model text must never stop a stage with an exception.
        return None


def _read_number(raw: str) -> Fraction | None:
    s = raw.translate(_MINUS_TRANS)
    s = _LATEX_COMMA_RE.sub(",", s)
    s = _THIN_SEP_RE.sub("", s)
    # Innermost \frac first; repeat for \frac{\frac{1}{2}}{3}.
    for _ in range(5):
        s, n = _FRAC_RE.subn(_frac_sub, s)
        if not n:
            break
    s = _DOLLAR_PERCENT_RE.sub("", s)  # removed, not spaced, so '-$5' keeps its sign
    # 2.5 \times 10^3 and 10^6 are evaluated, else their exponent would read as a second number.
    s = _SCI_RE.sub(_sci_sub, s)
    s = _POW_RE.sub(_pow_sub, s)
    s = _UNIT_POW_RE.sub(" ", s)
    s = _APPROX_RE.sub("=", s)
    s = _COMMAND_RE.sub(" ", s)
    s = _NOISE_RE.sub(" ", s)
    tail = s.rpartition("=")[2]
    m = _SCAN_RE.search(tail)
    if not m:
        return None
    if _DIGIT_RE.search(_REMARK_RE.sub(" ", tail[m.end() :])):
        return None  # an expression or alternatives: '3 x 18', '19 or 18', '17-18'
    return _value(m.group("sign"), m.group("num"), m.group("den"))


def answers_match(pred_raw: str | None, gold: str) -> bool:
    """True when both parse to the same exact number ('18.0' == '18', '0.5' == '1/2')."""
    return _same(normalize_answer(pred_raw), normalize_answer(gold))


def _same(pred: Fraction | None, want: Fraction | None) -> bool:
    return pred is not None and want is not None and pred == want


# ---------------------------------------------------------------------------------------------
# Grading


@dataclass(frozen=True)
class Grade:
    strict: str | None  # raw strict extraction (last \boxed{} content)
    lenient: str | None  # raw lenient extraction
    format: bool  # has a \boxed{} answer (strict is not None)
    correct_strict: bool  # the strict answer equals gold (even in a completion cut at max tokens)
    correct_lenient: bool  # the lenient answer equals gold (idem)
    correct: bool  # reward == +1: right under `reward_extractor` and not cut at max tokens
    reward: float  # +1 correct, 0 wrong, -1 no parsable answer or cut at max tokens
    reason: str  # short human text for the browser


def _short(s: str, limit: int = 40) -> str:
    """One-line, length-capped rendering of a raw answer for `Grade.reason`."""
    s = " ".join(s.split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def grade(
    completion: str, gold: str, finish_reason: str = "stop", reward_extractor: str = "strict"
) -> Grade:
    """Grade one completion against the gold number; reward under `reward_extractor`.

    How a raw answer reads is `normalize_answer`'s rule: the number after the last `=`; a box
    holding an expression or alternatives is unreadable (not evaluated). No text raises: an
    answer that cannot be read, however long or odd, is graded -1 "unreadable".

    A completion cut at max tokens (`finish_reason == "length"`) gets reward -1 and `correct`
    False even with a right box. `correct_strict` / `correct_lenient` still say whether the
    extracted answer equals gold (the browser shows it); the accuracy metrics (`stats`,
    `evaluate`, the loop) count a cut completion as not correct, so accuracy and reward agree.
    """
    if reward_extractor not in EXTRACTORS:
        raise ValueError(f"reward_extractor must be one of {EXTRACTORS}, got {reward_extractor!r}")
    strict = extract_strict(completion)
    # extract_lenient, without scanning the boxes a second time.
    lenient = strict if strict is not None else _extract_unboxed(completion)
    # Each raw answer is read once (lenient is the strict box whenever there is one).
    strict_value = normalize_answer(strict)
    lenient_value = strict_value if lenient == strict else normalize_answer(lenient)
    want = normalize_answer(gold)
    correct_strict = _same(strict_value, want)
    correct_lenient = _same(lenient_value, want)
    chosen = strict if reward_extractor == "strict" else lenient
    chosen_value = strict_value if reward_extractor == "strict" else lenient_value
    cut = finish_reason == "length"
    correct = (correct_strict if reward_extractor == "strict" else correct_lenient) and not cut

    if cut:
        # Even a right box counts as a failure: the model did not finish its answer.
        reward, reason = REWARD_INVALID, "cut at max tokens"
    elif chosen is None:
        reward = REWARD_INVALID
        reason = "no \\boxed{} answer" if reward_extractor == "strict" else "no answer found"
    elif chosen_value is None:
        reward, reason = REWARD_INVALID, f"unreadable answer: {_short(chosen)}"
    elif correct:
        reward, reason = REWARD_CORRECT, f"correct ({reward_extractor})"
    else:
        reward, reason = REWARD_WRONG, f"wrong: {_short(chosen)} != {gold}"
    return Grade(
        strict=strict,
        lenient=lenient,
        format=strict is not None,
        correct_strict=correct_strict,
        correct_lenient=correct_lenient,
        correct=correct,
        reward=reward,
        reason=reason,
    )
