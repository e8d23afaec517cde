"""Countdown reward: a safely parsed arithmetic expression that reaches the target.

The completion must be an expression over + - * / and parentheses whose numbers
are a sub-multiset of the example's `numbers` (each used at most once) and whose
exact rational value equals `target`. An optional trailing "=<target>" is allowed.
No eval(): a small recursive-descent parser over Fractions, so "1/3*3" is exact
and nothing but arithmetic can run.
"""

import re
from collections import Counter
from fractions import Fraction

from ess_jax.rewards.eos import truncate_at_eos

_MAX_CHARS = 256  # longer completions are wrong by construction for this task
_MAX_DEPTH = 32  # parenthesis nesting; keeps the recursion bounded
_TOKEN_RE = re.compile(r"\s*(?:(\d+)|(.))")


class _ParseError(ValueError):
    pass


def _tokenize(text: str) -> list[str | int]:
    tokens: list[str | int] = []
    for number, symbol in _TOKEN_RE.findall(text):
        if number:
            tokens.append(int(number))
        elif symbol in "+-*/()":
            tokens.append(symbol)
        elif not symbol.isspace():
            raise _ParseError(f"unexpected character {symbol!r}")
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)*; term := factor (('*'|'/') factor)*;
    factor := NUMBER | '(' expr ')'."""

    def __init__(self, tokens: list[str | int]):
        self.tokens = tokens
        self.pos = 0
        self.numbers: list[int] = []

    def _peek(self) -> str | int | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def parse(self) -> Fraction:
        value = self._expr(0)
        if self.pos != len(self.tokens):
            raise _ParseError("trailing tokens")
        return value

    def _expr(self, depth: int) -> Fraction:
        value = self._term(depth)
        while self._peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self._term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def _term(self, depth: int) -> Fraction:
        value = self._factor(depth)
        while self._peek() in ("*", "/"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self._factor(depth)
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise _ParseError("division by zero")
            else:
                value = value / rhs
        return value

    def _factor(self, depth: int) -> Fraction:
        tok = self._peek()
        self.pos += 1
        if isinstance(tok, int):
            self.numbers.append(tok)
            return Fraction(tok)
        if tok == "(":
            if depth >= _MAX_DEPTH:
                raise _ParseError("nesting too deep")
            value = self._expr(depth + 1)
            if self._peek() != ")":
                raise _ParseError("unbalanced parenthesis")
            self.pos += 1
            return value
        raise _ParseError(f"expected a number or '(', got {tok!r}")


def evaluate_countdown(expression: str) -> tuple[Fraction, list[int]]:
    """Exact value of `expression` and the numbers it uses; ValueError if not arithmetic."""
    if len(expression) > _MAX_CHARS:
        raise _ParseError("expression too long")
    parser = _Parser(_tokenize(expression))
    return parser.parse(), parser.numbers


def countdown_reward(completion: str, example: dict) -> float:
    """1.0 iff the completion reaches `example["target"]` using each number at most once."""
    text = truncate_at_eos(completion).strip()
    target = int(example["target"])
    if "=" in text:  # "3*5+7=22": the claimed result must be the target itself
        text, _, claimed = text.partition("=")
        if claimed.strip() != str(target):
            return 0.0
    if not text.strip():
        return 0.0
    try:
        value, used = evaluate_countdown(text)
    except _ParseError:
        return 0.0
    # Checking the multiset after evaluating is safe: with no power operator and
    # _MAX_CHARS characters, no intermediate value can get big.
    if Counter(used) - Counter(int(n) for n in example["numbers"]):
        return 0.0
    return float(value == target)
