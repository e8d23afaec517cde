"""MATH-style reward: answer equivalence via math-verify (LaTeX, fractions, \\boxed{})."""

import threading

from ess_jax.rewards.eos import truncate_at_eos

# math-verify bounds sympy with signal.alarm, which only works on the main thread;
# off it (a reward thread pool) we pass no timeout rather than crash.
_TIMEOUT_S = 5


def _timeout() -> int | None:
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def math_reward(completion: str, example: dict) -> float:
    """1.0 iff the completion's final answer is mathematically equal to `example["answer"]`.

    The reference is read as if boxed (it is the bare answer: "\\frac{1}{2}", "5");
    the completion is searched the math-verify way: \\boxed{} first, then LaTeX, then
    plain expressions. Anything unparseable scores 0.
    """
    # Lazy import: sympy and latex2sympy take ~2 s to import, and only this reward needs them.
    from math_verify import parse, verify

    text = truncate_at_eos(completion)
    if not text.strip():
        return 0.0
    timeout = _timeout()
    gold = parse("\\boxed{" + str(example["answer"]) + "}", parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math example has an unparseable answer: {example['answer']!r}")
    pred = parse(text, parsing_timeout=timeout)
    if not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=timeout))
