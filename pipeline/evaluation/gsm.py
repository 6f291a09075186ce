"""GSM8K answer checking (lm-eval's strict-match `#### N`), shared by the on-policy and RL rewards."""

from __future__ import annotations

import re

ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")


def _normalise(number: str) -> str:
    """Strip whitespace, thousands commas, '$' and a trailing '.' from a number string."""
    return number.strip().replace(",", "").replace("$", "").rstrip(".")


def extract_answer(text: str) -> str | None:
    """The normalised number after the last `#### ` marker in `text`, or None if there is none."""
    matches = ANSWER_RE.findall(text)
    value = _normalise(matches[-1]) if matches else ""
    return value or None


def is_correct(text: str, answer: str) -> bool:
    """Whether `text`'s `#### N` answer matches `answer` (a bare number or a full GSM8K solution)."""
    got = extract_answer(text)
    want = extract_answer(answer) if "####" in answer else _normalise(answer)
    if got is None or not want:
        return False
    try:
        return float(got) == float(want)
    except ValueError:
        return got == want
