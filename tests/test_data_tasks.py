"""Synthetic tasks: deterministic, disjoint, prefix-stable splits; references score 1."""

import json

import pytest

from ess_jax.data import TASKS, get_task
from ess_jax.data.tasks import _split_of
from ess_jax.rewards import get_reward

NAMES = sorted(TASKS)


def _canonical(task, example):
    """The split key a task hashes: reorderings of a problem share it."""
    if task.name == "addition":
        return tuple(sorted((example["a"], example["b"])))
    if task.name == "sort":
        return tuple(sorted(example["numbers"]))
    return tuple(sorted(example["numbers"])), example["target"]


@pytest.mark.parametrize("name", NAMES)
def test_splits_are_deterministic(name):
    a = get_task(name).examples("train", 300)
    b = get_task(name).examples("train", 300)
    assert a == b
    assert get_task(name, seed=1).examples("train", 300) != a


@pytest.mark.parametrize("name", NAMES)
def test_splits_are_disjoint_even_up_to_reordering(name):
    task = get_task(name)
    train, test = task.examples("train"), task.examples("test")
    assert len(train) == task.train_size and len(test) == task.test_size
    assert not {ex["prompt"] for ex in train} & {ex["prompt"] for ex in test}
    assert not {_canonical(task, ex) for ex in train} & {_canonical(task, ex) for ex in test}
    # And across seeds: the partition of the problem space does not depend on the seed.
    other = get_task(name, seed=7).examples("test")
    assert not {_canonical(task, ex) for ex in train} & {_canonical(task, ex) for ex in other}


@pytest.mark.parametrize("name", NAMES)
def test_no_duplicate_prompts_and_prefix_stability(name):
    task = get_task(name)
    many = task.examples("train", 500)
    assert len({ex["prompt"] for ex in many}) == 500
    assert task.examples("train", 50) == many[:50]


@pytest.mark.parametrize("name", NAMES)
def test_reference_scores_one_and_corruption_zero(name):
    task = get_task(name)
    reward = get_reward(task.reward)
    examples = task.examples("train", 200) + task.examples("test", 50)
    for ex in examples:
        assert reward(ex["answer"], ex) == 1.0, ex
        assert reward(ex["demonstration"], ex) == 1.0, ex
        assert reward(ex["demonstration"] + "<eos>junk", ex) == 1.0, ex
        assert reward("<eos>" + ex["demonstration"], ex) == 0.0, ex
        assert reward(ex["answer"] + "1", ex) == 0.0, ex  # one extra digit
        assert reward("", ex) == 0.0, ex


def test_corrupted_answers_score_zero():
    add = get_task("addition").examples("test", 30)
    for ex in add:
        assert get_reward("addition")(str(int(ex["answer"]) + 1), ex) == 0.0
    srt = get_task("sort").examples("test", 30)
    for ex in srt:
        assert get_reward("sort")(" ".join(reversed(ex["answer"].split())) + " 0", ex) == 0.0
    cd = get_task("countdown").examples("test", 30)
    for ex in cd:
        assert get_reward("countdown")(f"{ex['answer']}+1", ex) == 0.0
        assert get_reward("countdown")(f"({ex['answer']})*{ex['numbers'][0]}", ex) == 0.0


def test_examples_fields_and_json_serialisable():
    for name in NAMES:
        for ex in get_task(name).examples("train", 20):
            assert ex["task"] == name
            assert {"prompt", "answer", "demonstration"} <= set(ex)
            json.dumps(ex)
    ex = get_task("addition").examples("train", 1)[0]
    assert ex["prompt"] == f"{ex['a']}+{ex['b']}=" and ex["answer"] == str(ex["a"] + ex["b"])
    ex = get_task("sort").examples("train", 1)[0]
    assert ex["prompt"].startswith("sort ") and ex["prompt"].endswith(":")
    ex = get_task("countdown").examples("train", 1)[0]
    assert ex["prompt"] == f"make {ex['target']} from {' '.join(map(str, ex['numbers']))}:"


def test_difficulty_dials():
    for ex in get_task("addition", digits=5).examples("train", 50):
        assert len(str(ex["a"])) == len(str(ex["b"])) == 5
    big = get_task("addition", digits=30).examples("train", 5)  # past int64
    assert all(int(ex["answer"]) == ex["a"] + ex["b"] for ex in big)
    for ex in get_task("sort", length=7, max_value=3).examples("train", 50):
        assert len(ex["numbers"]) == 7 and max(ex["numbers"]) <= 3
    cd = get_task("countdown", num_numbers=5, max_value=20, min_target=10, max_target=50)
    for ex in cd.examples("train", 50):
        assert len(ex["numbers"]) == 5 and 10 <= ex["target"] <= 50
        assert all(1 <= n <= 20 for n in ex["numbers"])


def test_small_spaces_default_size_is_what_exists_explicit_n_errors():
    task = get_task("addition", digits=1)  # 100 ordered pairs in all
    train, test = task.examples("train"), task.examples("test")
    assert len(train) + len(test) == 100
    with pytest.raises(ValueError, match="found only"):
        task.examples("train", 1000)


def test_errors():
    with pytest.raises(ValueError, match="valid:.*addition.*countdown.*sort"):
        get_task("multiplication")
    with pytest.raises(ValueError, match="unknown options.*lenght"):
        get_task("sort", lenght=3)
    with pytest.raises(ValueError, match="split"):
        get_task("sort").examples("validation")
    with pytest.raises(ValueError):
        get_task("addition", digits=0)
    with pytest.raises(ValueError):
        get_task("countdown", min_target=10, max_target=5)


def test_split_assignment_is_pinned():
    # A change here silently moves problems between train and test of saved runs.
    keys = [f"{a}+{b}" for a in range(10, 40) for b in range(a, 40)]
    test_keys = [k for k in keys if _split_of("addition", k, 0.1) == "test"]
    assert len(test_keys) == 51
    assert test_keys[:5] == ["10+26", "10+29", "10+38", "11+12", "11+16"]


def test_addition_words_same_problems_and_splits_as_plain():
    words, plain = get_task("addition", words=True), get_task("addition")
    for split in ("train", "test"):
        w, p = words.examples(split, 150), plain.examples(split, 150)
        assert w == words.examples(split, 150)  # deterministic
        assert [(e["a"], e["b"], e["answer"]) for e in w] == [
            (e["a"], e["b"], e["answer"]) for e in p
        ]
    # The split key ignores the phrasing: every words problem lands where the plain one does.
    for split in ("train", "test"):
        for ex in words.examples(split, 100):
            key = f"{min(ex['a'], ex['b'])}+{max(ex['a'], ex['b'])}"
            assert _split_of("addition", key, words.test_fraction) == split
    assert {(e["a"], e["b"]) for e in words.examples("test")} == {
        (e["a"], e["b"]) for e in plain.examples("test")
    }
    prompts = [e["prompt"] for e in words.examples("train", 200)]
    for phrase in ("buys", "morning", "box", "basket", "friend"):  # every template in use
        assert any(phrase in p for p in prompts), phrase
    ex = words.examples("train", 1)[0]
    assert f"{ex['a']}" in ex["prompt"] and f"{ex['b']}" in ex["prompt"]
    assert ex["prompt"].endswith("?") and "+" not in ex["prompt"]
    assert get_task("addition", words=True, seed=3).examples("train", 50) != words.examples(
        "train", 50
    )


def test_addition_words_reward_scores_the_final_number():
    task = get_task("addition", digits=2, words=True)
    assert task.reward == "gsm8k" and get_task("addition").reward == "addition"
    reward = get_reward(task.reward)
    for ex in task.examples("train", 100) + task.examples("test", 30):
        a, b, s = ex["a"], ex["b"], int(ex["answer"])
        assert ex["demonstration"] == f"{a} + {b} = {s}. The answer is {s}."
        assert reward(ex["demonstration"], ex) == 1.0, ex
        assert reward(ex["demonstration"] + "<|im_end|>junk 7", ex) == 1.0, ex
        assert reward(f"{a} + {b} = {s + 1}. The answer is {s + 1}.", ex) == 0.0, ex
        assert reward("I do not know.", ex) == 0.0, ex
