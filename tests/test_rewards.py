"""Rewards on real-looking and adversarial completions."""

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ess_jax.rewards import (
    REWARDS,
    evaluate_countdown,
    extract_final_number,
    get_reward,
    truncate_at_eos,
)

GSM8K = {"task": "gsm8k", "answer": "72"}
MATH_HALF = {"task": "math", "answer": "\\frac{1}{2}"}


def test_registry_and_unknown_name():
    assert set(REWARDS) >= {"addition", "sort", "countdown", "gsm8k", "math", "format"}
    assert get_reward("gsm8k") is REWARDS["gsm8k"]
    with pytest.raises(ValueError, match="valid:.*addition"):
        get_reward("nope")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("46<eos>garbage", "46"),
        ("a</s>b<eos>c", "a"),
        ("x<|endoftext|>y<|im_end|>z", "x"),
        ("<eos>46", ""),
        ("no marker", "no marker"),
    ],
)
def test_truncate_at_eos_cuts_at_earliest_marker(text, expected):
    assert truncate_at_eos(text) == expected


@pytest.mark.parametrize(
    "completion, score",
    [
        ("46", 1.0),
        (" 46\n", 1.0),
        ("46<eos>", 1.0),
        ("47", 0.0),
        ("046", 0.0),
        ("4 6", 0.0),
        ("", 0.0),
        ("<eos>46", 0.0),
        ("46 46", 0.0),
        ("\u0034\u0036\u200b", 0.0),
    ],
)
def test_addition_exact_match(completion, score):
    assert get_reward("addition")(completion, {"answer": "46"}) == score


@pytest.mark.parametrize(
    "completion, score",
    [
        ("1 2 2 3", 1.0),
        ("1  2 2 3 ", 1.0),
        ("1 2 3", 0.0),
        ("3 2 2 1", 0.0),
        ("1 2 2 3 4", 0.0),
        ("", 0.0),
        ("<eos>1 2 2 3", 0.0),
        ("1 2 2 3<eos> 4", 1.0),
        ("1223", 0.0),
    ],
)
def test_sort_exact_match(completion, score):
    assert get_reward("sort")(completion, {"answer": "1 2 2 3"}) == score


COUNTDOWN = {"numbers": [3, 5, 7], "target": 22}


@pytest.mark.parametrize(
    "completion, score",
    [
        ("3*5+7", 1.0),
        ("7+5*3", 1.0),  # any expression reaching the target, not just the reference
        ("(7 + 5 * 3)", 1.0),
        ("3*5+7=22", 1.0),
        ("3*5+7=23", 0.0),  # a wrong claimed result
        ("3*5+7<eos>", 1.0),
        ("<eos>3*5+7", 0.0),
        ("3*5+7+0", 0.0),  # 0 is not one of the numbers
        ("3*5+7*1", 0.0),
        ("22", 0.0),  # the target itself is not a given number
        ("3*5+5+2", 0.0),  # 5 used twice, 2 not given
        ("(3*5+7", 0.0),
        ("3*5+7)", 0.0),
        ("3**5", 0.0),
        ("7/(5-5)", 0.0),  # division by zero, and 5 twice
        ("__import__('os')", 0.0),
        ("", 0.0),
        ("3 5 7", 0.0),
        ("-3*5+7", 0.0),  # no unary minus
        ("(" * 40 + "3" + ")" * 40, 0.0),  # nesting limit, no RecursionError
        ("3" * 300, 0.0),  # length limit
    ],
)
def test_countdown(completion, score):
    assert get_reward("countdown")(completion, COUNTDOWN) == score


def test_countdown_is_exact_rational():
    # 7/3*3 is exactly 7 with Fractions (floats would give 7.000000000000001 or similar).
    assert get_reward("countdown")("7/3*3+1", {"numbers": [7, 3, 3, 1], "target": 8}) == 1.0
    value, used = evaluate_countdown("(1+2)*3/4")
    assert value == pytest.approx(2.25) and used == [1, 2, 3, 4]
    assert get_reward("countdown")("8/3", {"numbers": [8, 3], "target": 2}) == 0.0


@pytest.mark.parametrize(
    "completion, score",
    [
        ("She sells 48/2 = 24 clips in May, so 48+24 = 72 in total.\n#### 72", 1.0),
        ("#### 72.0", 1.0),
        ("#### 72.00 dollars", 1.0),
        ("The answer is $72.", 1.0),  # last-number fallback
        ("so she earned 72", 1.0),
        ("#### +72", 1.0),
        ("#### 72<eos>#### 5", 1.0),
        ("#### 5<eos>#### 72", 0.0),  # the right answer only after EOS
        ("72<|im_end|>", 1.0),
        ("#### 720", 0.0),
        ("#### -72", 0.0),
        ("#### 72.5", 0.0),
        ("#### 7,2", 0.0),  # not a thousands separator: the first number is 7
        ("72 is wrong, #### 71", 0.0),  # '####' wins over the last number
        ("", 0.0),
        ("I don't know", 0.0),
        ("#### \u2212", 0.0),
        ("\u0000\ufffd####%%%", 0.0),
    ],
)
def test_gsm8k_on_completions(completion, score):
    assert get_reward("gsm8k")(completion, GSM8K) == score


@pytest.mark.parametrize(
    "gold, completion, score",
    [
        ("-5", "#### \u22125", 1.0),  # unicode minus sign
        ("-5", "#### \uff0d5", 1.0),  # fullwidth hyphen-minus
        ("5", "#### \u22125", 0.0),
        ("1,234,567", "#### 1234567", 1.0),
        ("1234567", "the total is 1,234,567 apples", 1.0),
        ("-1000", "#### -1,000.0", 1.0),
        ("0", "#### -0", 1.0),
        ("#### 18", "Janet makes 9 * 2 = 18 dollars.\n#### 18", 1.0),  # raw gold with '####'
    ],
)
def test_gsm8k_signs_commas_decimals(gold, completion, score):
    assert get_reward("gsm8k")(completion, {"answer": gold}) == score


def test_gsm8k_huge_numbers_compare_exactly():
    big = "9" * 5000  # past int()'s 4300-digit limit, far past float range
    assert get_reward("gsm8k")(f"#### {big}", {"answer": big}) == 1.0
    assert get_reward("gsm8k")(f"#### {big[:-1]}8", {"answer": big}) == 0.0
    assert get_reward("gsm8k")("#### 1e400", {"answer": "1"}) == 0.0
    assert get_reward("gsm8k")("#### 1e400000000000", {"answer": "1"}) == 0.0
    assert get_reward("gsm8k")("#### 1.5e3", {"answer": "1500"}) == 1.0
    assert get_reward("gsm8k")("I bought 2eggs", {"answer": "2"}) == 1.0
    # Differ only past float precision: must not compare equal.
    assert (
        get_reward("gsm8k")("#### 12345678901234567891", {"answer": "12345678901234567890"}) == 0.0
    )


@given(st.integers(min_value=-(10**30), max_value=10**30))
def test_gsm8k_roundtrips_any_integer(n):
    with_commas = f"{n:,}"
    assert get_reward("gsm8k")(f"so #### {with_commas}", {"answer": str(n)}) == 1.0
    assert extract_final_number(f"x = {n}.") == n


def test_gsm8k_rejects_gold_without_number():
    with pytest.raises(ValueError, match="no numeric answer"):
        get_reward("gsm8k")("#### 1", {"answer": "none"})


@pytest.mark.parametrize(
    "gold, completion, score",
    [
        ("\\frac{1}{2}", "We get $x = \\boxed{\\frac12}$.", 1.0),
        ("\\frac{1}{2}", "The answer is \\boxed{0.5}", 1.0),
        ("\\frac{1}{2}", "\\boxed{1/2}", 1.0),
        ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", 0.0),
        ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}<eos>\\boxed{\\frac{1}{2}}", 0.0),
        ("\\frac{1}{2}", "\\boxed{\\frac{1}{2}}<|im_end|>\\boxed{3}", 1.0),
        ("2\\sqrt{3}", "so $\\boxed{\\sqrt{12}}$", 1.0),
        ("x^2+1", "\\boxed{1 + x^2}", 1.0),
        ("-5", "\\boxed{\u22125}", 1.0),  # unicode minus
        ("5", "\\boxed{\u22125}", 0.0),
        ("10000000000000000000000000000001", "\\boxed{10000000000000000000000000000001}", 1.0),
        ("10000000000000000000000000000001", "\\boxed{10000000000000000000000000000000}", 0.0),
        ("5", "", 0.0),
        ("5", "   ", 0.0),
        ("5", "}}}{{{ \\boxed{ $$ \\frac{", 0.0),
        ("5", "\\boxed{\\text{no idea}}", 0.0),
    ],
)
def test_math_equivalence(gold, completion, score):
    assert get_reward("math")(completion, {"task": "math", "answer": gold}) == score


def test_math_reward_works_off_the_main_thread():
    # math-verify's signal-based timeout raises off the main thread unless disabled.
    results, errors = [], []

    def worker():
        try:
            results.append(get_reward("math")("\\boxed{\\frac{2}{4}}", MATH_HALF))
        except Exception as e:  # noqa: BLE001 - the test reports any failure
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert errors == [] and results == [1.0]


@pytest.mark.parametrize(
    "example, completion, score",
    [
        (GSM8K, "reasoning...\n#### 72", 1.0),
        (GSM8K, "#### \u221272", 1.0),
        (GSM8K, "the answer is 72", 0.0),
        (GSM8K, "<eos>#### 72", 0.0),
        (MATH_HALF, "so \\boxed{\\frac{1}{2}}", 1.0),
        (MATH_HALF, "so \\boxed{\\frac{1}{2}", 0.0),  # unclosed
        (MATH_HALF, "} \\boxed{ {x} \\boxed{5}", 1.0),  # the inner one closes
        (MATH_HALF, "\\boxed{ {x} \\boxed{5", 0.0),
        (MATH_HALF, "\\boxed{}", 1.0),
        ({"task": "deepscaler", "answer": "3"}, "\\boxed{7}", 1.0),  # format only, not value
        ({"task": "addition", "answer": "46"}, "46", 1.0),
        ({"task": "addition", "answer": "46"}, "46\n47", 0.0),
        ({"task": "addition", "answer": "46"}, "", 0.0),
    ],
)
def test_format_reward(example, completion, score):
    assert get_reward("format")(completion, example) == score


@pytest.mark.parametrize(
    "junk",
    ["1,234," * 40_000, "9" * 200_000, "#### " * 40_000, "-." * 100_000, "\\boxed{" * 30_000],
)
def test_gsm8k_long_adversarial_strings_are_fast(junk):
    import time

    start = time.perf_counter()
    get_reward("gsm8k")(junk, GSM8K)
    get_reward("format")(junk, GSM8K)
    get_reward("format")(junk, MATH_HALF)
    assert time.perf_counter() - start < 2.0
