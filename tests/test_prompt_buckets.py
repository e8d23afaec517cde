"""Prompts longer than the largest `data.buckets` width: refused when the run is built (before
the SFT warm start and checkpoint 0), naming the prompt and the bucket, or left out with
`data.drop_long_prompts` (train and held-out), with the stream otherwise unchanged."""

import logging

import numpy as np
import pytest

from configs import quickstart
from ess_jax.config.schema import ConfigError
from ess_jax.data import PromptBatcher, PromptTooLongError, char_tokenizer
from ess_jax.rl import experiment, train

LONG = "1+" * 20 + "1="  # 42 characters + <bos>: 43 tokens


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def _examples(n: int, long_at=()) -> list[dict]:
    return [
        {"prompt": LONG if i in long_at else f"{i % 90 + 10}+1=", "answer": str(i % 90 + 11)}
        for i in range(n)
    ]


def _config(**overrides):
    c = quickstart.get_config("tiny")
    c.update_from_flattened_dict({"data.buckets": (8, 16), "data.prompts_per_step": 4, **overrides})
    return c


def test_batcher_refuses_at_construction_naming_the_prompt(tok):
    """Catches a length check left in `__next__`: the run fails only when the long prompt's
    batch comes up (after SFT and checkpoint 0, and again on every resume)."""
    with pytest.raises(PromptTooLongError, match=r"example 5 \(prompt '1\+1\+1.*43 tokens.*16"):
        PromptBatcher(_examples(12, long_at=(5, 9)), tok, 4, buckets=(8, 16))


def test_drop_long_leaves_them_out_and_keeps_indices(tok):
    """Catches dropped prompts still drawn (a batch of the long prompt), indices that point into
    the filtered list instead of the data set, or a stream that skips fitting prompts."""
    examples = _examples(12, long_at=(5, 9))
    b = PromptBatcher(examples, tok, 5, buckets=(8, 16), shuffle=False, drop_long=True)
    assert b.dropped == [5, 9]
    seen = np.concatenate([next(b)["indices"] for _ in range(2)])
    assert list(seen) == [0, 1, 2, 3, 4, 6, 7, 8, 10, 11]
    batch = next(b)  # epoch 2 restarts over the 10 kept
    assert [ex["prompt"] for ex in batch["examples"]] == [examples[i]["prompt"] for i in range(5)]
    assert batch["prompt_tokens"].shape == (5, 8)


def test_experiment_names_the_field_and_the_way_out(tok, caplog):
    """Catches the error surfacing as a bare ValueError traceback instead of one line naming
    config.data.buckets and data.drop_long_prompts; and a silent drop (no count logged)."""
    want = r"config\.data\.buckets: train prompts: example 3 .*data\.drop_long_prompts=True"
    with pytest.raises(ConfigError, match=want):
        experiment.train_batcher(_config(), _examples(8, long_at=(3,)), tok)
    with caplog.at_level(logging.WARNING):
        b = experiment.train_batcher(
            _config(**{"data.drop_long_prompts": True}), _examples(8, long_at=(3,)), tok
        )
    assert b.dropped == [3] and "left out 1 of 8 train prompts" in caplog.text


def test_heldout_checks_the_examples_eval_uses(tok):
    """Catches a held-out prompt that fails only at the first eval (after SFT), and a check of
    unused held-out examples that would refuse a run eval never reaches them in."""
    test = _examples(8, long_at=(6,))
    with pytest.raises(ConfigError, match=r"held-out prompts: example 6"):
        experiment.heldout_examples(_config(**{"eval.num_examples": 0}), test, tok)
    assert experiment.heldout_examples(_config(**{"eval.num_examples": 4}), test, tok) is test
    kept = experiment.heldout_examples(_config(**{"data.drop_long_prompts": True}), test, tok)
    assert [ex["prompt"] for ex in kept] == [ex["prompt"] for i, ex in enumerate(test) if i != 6]


def test_a_character_the_tokenizer_cannot_encode_names_the_task_example_and_character(tok):
    """Catches a train or held-out prompt with characters the tokenizer can only map to <unk>
    reported under config.data.prompts_per_step (the field of the other ValueErrors here):
    it must name the task, the split's example, the characters and model.source."""
    examples = _examples(8)
    examples[5] = {"prompt": "What is 12+$3?", "answer": "15"}
    tail = "cannot encode: 'W', '$'; use a model whose tokenizer covers the task's text"
    for split, call in (
        ("train", lambda: experiment.train_batcher(_config(), examples, tok)),
        ("held-out", lambda: experiment.heldout_examples(_config(), examples, tok)),
    ):
        with pytest.raises(ConfigError) as e:
            call()
        assert str(e.value) == (
            f"config.task: addition: {split} example 5 (prompt 'What is 12+$3?') has characters "
            f"the tokenizer of model.source='embedded' {tail}"
        )


def test_run_refuses_before_sft_and_checkpoint_0(tmp_path, monkeypatch):
    """Catches the check placed after the SFT warm start or the first checkpoint (the refused run
    must leave no checkpoint behind to resume into the same error)."""
    monkeypatch.setattr(train.Run, "sft", lambda self: pytest.fail("SFT ran"))
    want = r"data\.buckets: train prompts: example 0 \(prompt '\d\d\+\d\d='\) has 7 tokens, more"
    with pytest.raises(ConfigError, match=want + " than the largest bucket 6"):
        train.Run(_config(**{"data.buckets": (6,)}), str(tmp_path / "w"))
    assert not (tmp_path / "w" / "checkpoints").exists()
