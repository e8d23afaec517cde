"""Batching: bucketed left-padded prompts, exact resume, grouping, SFT masks."""

import json

import numpy as np
import pytest

from ess_jax.data import PromptBatcher, char_tokenizer, get_task, repeat_for_group, sft_batches


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def examples():
    return get_task("sort", length=3).examples("train", 37) + get_task(
        "addition", digits=4
    ).examples("train", 13)


def _batches(batcher, n):
    return [next(batcher) for _ in range(n)]


def _same(a, b):
    np.testing.assert_array_equal(a["prompt_tokens"], b["prompt_tokens"])
    np.testing.assert_array_equal(a["prompt_mask"], b["prompt_mask"])
    assert a["examples"] == b["examples"]


def test_shapes_left_padding_and_mask(tok, examples):
    b = PromptBatcher(examples, tok, batch_size=8, buckets=(8, 16, 32))
    for _ in range(10):
        batch = next(b)
        tokens, mask = batch["prompt_tokens"], batch["prompt_mask"]
        assert tokens.dtype == np.int32 and mask.dtype == bool and tokens.shape == mask.shape
        lengths = [len(ex["prompt"]) + 1 for ex in batch["examples"]]  # + <bos>
        P = tokens.shape[1]
        assert P == min(x for x in (8, 16, 32) if x >= max(lengths))
        for row, m, ex, n in zip(tokens, mask, batch["examples"], lengths):
            assert not m[: P - n].any() and m[P - n :].all()  # pads first, then the prompt
            assert (row[: P - n] == tok.pad_token_id).all()
            assert row[P - n] == tok.bos_token_id  # the prompt ends flush at the right edge
            assert tok.decode(row[m], skip_special_tokens=True) == ex["prompt"]


def test_epochs_cover_each_example_once_and_reshuffle(tok, examples):
    b = PromptBatcher(examples, tok, batch_size=10)
    epoch0 = np.concatenate([next(b)["indices"] for _ in range(5)])
    epoch1 = np.concatenate([next(b)["indices"] for _ in range(5)])
    assert sorted(epoch0) == sorted(epoch1) == list(range(50))
    assert not np.array_equal(epoch0, epoch1)
    unshuffled = PromptBatcher(examples, tok, batch_size=10, shuffle=False)
    assert list(next(unshuffled)["indices"]) == list(range(10))


def test_remainder_dropped_so_shapes_stay_fixed(tok, examples):
    b = PromptBatcher(examples, tok, batch_size=16)  # 50 = 3 * 16 + 2
    for _ in range(7):
        assert next(b)["prompt_tokens"].shape[0] == 16
    assert b.state()["epoch"] == 2


@pytest.mark.parametrize("stop_after", [0, 2, 3, 5, 11])
def test_resume_equals_uninterrupted(tok, examples, stop_after):
    ref = _batches(PromptBatcher(examples, tok, batch_size=12, seed=3), 14)
    first = PromptBatcher(examples, tok, batch_size=12, seed=3)
    _batches(first, stop_after)
    state = json.loads(json.dumps(first.state()))  # goes through a checkpoint as JSON
    assert {"epoch", "position", "seed"} <= set(state)
    resumed = PromptBatcher(examples, tok, batch_size=12, seed=999)  # seed comes from the state
    resumed.restore(state)
    for want, got in zip(ref[stop_after:], _batches(resumed, 14 - stop_after)):
        _same(want, got)


def test_restore_rejects_a_different_dataset(tok, examples):
    state = PromptBatcher(examples, tok, batch_size=4).state()
    with pytest.raises(ValueError, match="num_examples"):
        PromptBatcher(examples[:20], tok, batch_size=4).restore(state)


def test_too_few_examples_is_an_error_not_a_hang(tok, examples):
    with pytest.raises(ValueError, match="fewer than batch_size"):
        PromptBatcher(examples[:3], tok, batch_size=4)
    with pytest.raises(ValueError, match="fewer than batch_size"):
        sft_batches(examples[:3], tok, batch_size=4, seq_len=32, seed=0)


def test_prompt_longer_than_largest_bucket(tok, examples):
    """A long prompt fails when the batcher is built, not when its batch comes up."""
    long = examples[:3] + [{"prompt": "1+" * 20 + "1=", "answer": "21"}]
    with pytest.raises(
        ValueError, match=r"example 3 \(prompt '1\+1\+.*more than the largest bucket 16"
    ):
        PromptBatcher(long, tok, batch_size=4, buckets=(8, 16), shuffle=False)


def test_repeat_for_group(tok, examples):
    batch = next(PromptBatcher(examples, tok, batch_size=3))
    G = 4
    grouped = repeat_for_group(batch, G)
    assert grouped["prompt_tokens"].shape == (3 * G, batch["prompt_tokens"].shape[1])
    for i in range(3):
        for g in range(G):
            np.testing.assert_array_equal(
                grouped["prompt_tokens"][i * G + g], batch["prompt_tokens"][i]
            )
            assert grouped["examples"][i * G + g] is batch["examples"][i]
    assert repeat_for_group([1, 2], 2) == [1, 1, 2, 2]
    with pytest.raises(ValueError):
        repeat_for_group([1], 0)


def test_sft_batches_tokens_and_loss_mask(tok, examples):
    it = sft_batches(examples, tok, batch_size=5, seq_len=24, seed=1)
    for _ in range(12):
        batch = next(it)
        tokens, loss_mask, token_mask = batch["tokens"], batch["loss_mask"], batch["token_mask"]
        assert tokens.shape == loss_mask.shape == (5, 24) and tokens.dtype == np.int32
        for row, lm, tm, i in zip(tokens, loss_mask, token_mask, batch["indices"]):
            ex = examples[i]
            n_prompt, n_demo = len(ex["prompt"]) + 1, len(ex["demonstration"]) + 1  # bos, eos
            n = n_prompt + n_demo
            assert row[0] == tok.bos_token_id and (row[n:] == tok.pad_token_id).all()
            assert tok.decode(row[1:n_prompt]) == ex["prompt"]
            assert tok.decode(row[lm]) == ex["demonstration"] + "<eos>"  # completion + eos only
            assert not lm[:n_prompt].any() and lm[n_prompt:n].all() and not lm[n:].any()
            assert tm[:n].all() and not tm[n:].any()


def test_sft_resume_and_length_check(tok, examples):
    it = sft_batches(examples, tok, 5, 24, seed=2)
    ref = [next(it)["tokens"] for _ in range(15)]
    it2 = sft_batches(examples, tok, 5, 24, seed=2)
    [next(it2) for _ in range(6)]
    it3 = sft_batches(examples, tok, 5, 24, seed=0)
    it3.restore(json.loads(json.dumps(it2.state())))
    for want in ref[6:]:
        np.testing.assert_array_equal(next(it3)["tokens"], want)
    with pytest.raises(ValueError, match="more than seq_len=8"):
        sft_batches(examples, tok, 5, 8, seed=0)
