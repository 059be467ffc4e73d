"""Pull the final answer out of a completion or a reference (GSM8K ``#### n``, ``\\boxed{}``, numbers)."""

from __future__ import annotations

import math
import re
from fractions import Fraction

_NUM_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_ANSWER_IS_RE = re.compile(r"answer(?:\s+is)?\s*[:=]?\s*(.+)", re.IGNORECASE)


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def extract_after_hashes(text: str) -> str | None:
    """GSM8K style: the text after the last ``####`` up to the end of that line."""
    pos = text.rfind("####")
    if pos < 0:
        return None
    rest = text[pos + 4:].strip()
    return rest.splitlines()[0].strip() if rest else ""


def last_number(text: str) -> str | None:
    found = _NUM_RE.findall(text)
    return found[-1] if found else None


def parse_exact(s: str | None) -> Fraction | None:
    """``"1,234"``, ``"$5"``, ``"-3.5"``, ``"3/4"``, ``"\\frac{3}{4}"``, ``"50%"`` → the exact rational
    value (no float rounding, so 20-digit integers stay exact); None if it is not a finite number."""
    if s is None:
        return None
    s = s.strip().strip("$").strip()
    s = s.replace("\\!", "").replace("\\,", "").replace("\\%", "%")
    frac = re.fullmatch(r"(-?)\\d?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s)
    if frac:
        try:
            val = Fraction(frac.group(2)) / Fraction(frac.group(3))
        except (ValueError, ZeroDivisionError):
            return None
        return -val if frac.group(1) else val
    s = s.rstrip(".").rstrip("%").replace(",", "")
    if re.fullmatch(r"-?\d+/\d+", s):
        a, b = s.split("/")
        return Fraction(int(a), int(b)) if int(b) != 0 else None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        pass
    try:  # forms Fraction refuses but float reads ("1_000", " 5 ")
        val = float(s)
    except ValueError:
        return None
    return Fraction(val) if math.isfinite(val) else None


def parse_number(s: str | None) -> float | None:
    """:func:`parse_exact` as a float."""
    val = parse_exact(s)
    return None if val is None else float(val)


def reference_answer(answer: str) -> str:
    """The gold answer text: after ``####`` (GSM8K), inside ``\\boxed{}``, or the whole string."""
    for fn in (extract_after_hashes, extract_boxed):
        got = fn(answer)
        if got:
            return got
    return answer.strip()


def final_answer_text(completion: str) -> str | None:
    """What the completion commits to: ``\\boxed{}``, then ``####``, then ``answer is ...``."""
    for fn in (extract_boxed, extract_after_hashes):
        got = fn(completion)
        if got:
            return got
    m = None
    for m in _ANSWER_IS_RE.finditer(completion):
        pass
    if m is not None:
        # `.` matches form feeds and Unicode line separators that strip()/splitlines() treat as whitespace and
        # line breaks, so the captured text can split into no lines at all.
        lines = m.group(1).strip().splitlines()
        return lines[0].strip() if lines else None
    return None


def final_value(completion: str) -> Fraction | None:
    """The completion's numeric answer, exactly: the marked answer if any, else its last number."""
    marked = final_answer_text(completion)
    if marked is not None:
        val = parse_exact(marked)
        if val is None:
            val = parse_exact(last_number(marked))
        return val
    return parse_exact(last_number(completion))


def final_number(completion: str) -> float | None:
    """:func:`final_value` as a float."""
    val = final_value(completion)
    return None if val is None else float(val)
