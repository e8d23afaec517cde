"""GSM8K reward: the final number, by the '#### 42' convention or else the last number.

Numbers compare as exact Decimals, so 42.0 == 42, "1,234" == 1234, signs count,
and a 5000-digit number neither overflows a float nor trips int()'s digit limit.
"""

import re
from decimal import Decimal, InvalidOperation

from ess_jax.rewards.eos import truncate_at_eos

# Thousands separators only in groups of three, so "1,2,3" reads as three numbers;
# an exponent only when digits follow the e, so "1e3" is 1000 and "2eggs" is 2.
_NUMBER_RE = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")
# Unicode minus, small and fullwidth hyphen-minus: what LLMs and LaTeX converters emit.
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})


def _to_decimal(number: str) -> Decimal | None:
    try:
        return Decimal(number.replace(",", ""))
    except InvalidOperation:
        return None


def extract_final_number(text: str) -> Decimal | None:
    """The number after the last '####', else the last number in `text`, else None."""
    text = text.translate(_MINUS_SIGNS)
    _, marker, tail = text.rpartition("####")
    if marker:
        match = _NUMBER_RE.search(tail)
        if match:
            return _to_decimal(match.group())
    matches = _NUMBER_RE.findall(text)
    return _to_decimal(matches[-1]) if matches else None


def gsm8k_reward(completion: str, example: dict) -> float:
    """1.0 iff the completion's final number equals the reference's final number."""
    gold = extract_final_number(str(example["answer"]))
    if gold is None:
        raise ValueError(f"gsm8k example has no numeric answer: {example['answer']!r}")
    pred = extract_final_number(truncate_at_eos(completion))
    return float(pred is not None and pred == gold)
