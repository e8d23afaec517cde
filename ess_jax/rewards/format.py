"""Optional format reward: is the final answer written where the task's verifier looks?

Kept separate from correctness so a config can add it with a small weight (or not).
The expected format follows `example["task"]`: "#### <number>" for gsm8k, a
closed \\boxed{...} for math / deepscaler, and a single non-empty line otherwise
(the synthetic tasks).
"""

import re

from ess_jax.rewards.eos import truncate_at_eos

_HASH_ANSWER_RE = re.compile(r"####\s*[-+\u2212]?[\d.,]*\d")
_BOXED_TASKS = ("math", "deepscaler")
_BRACE_RE = re.compile(r"\\boxed\{|[{}]")


def has_closed_boxed(text: str) -> bool:
    """True if some \\boxed{ in `text` has its matching closing brace (one linear pass)."""
    boxed_depths: list[int] = []  # brace depth right after each still-open \boxed{
    depth = 0
    for match in _BRACE_RE.finditer(text):
        if match.group() == "}":
            if boxed_depths and boxed_depths[-1] == depth:
                return True
            depth -= 1
        else:
            depth += 1
            if match.group() != "{":
                boxed_depths.append(depth)
    return False


def format_reward(completion: str, example: dict) -> float:
    """1.0 iff the completion (before EOS) carries its answer in the task's format."""
    text = truncate_at_eos(completion).strip()
    task = example.get("task", "")
    if task == "gsm8k":
        return float(_HASH_ANSWER_RE.search(text) is not None)
    if task in _BOXED_TASKS:
        return float(has_closed_boxed(text))
    return float(bool(text) and "\n" not in text)
