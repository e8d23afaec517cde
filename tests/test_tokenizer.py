"""Tokenizers: char-level round trips, HF save/load, chat templates, padding side."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ess_jax.data import (
    DEFAULT_ALPHABET,
    TASKS,
    char_tokenizer,
    decode_completion,
    encode_completion,
    encode_prompt,
    get_task,
    load_tokenizer,
)

# A template in the shape of real ones (ChatML-like), over characters the char tokenizer has.
TINY_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def test_special_token_ids(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.padding_side == "left"
    assert len(tok) == 4 + len(DEFAULT_ALPHABET)


def test_one_token_per_character(tok):
    ids = tok("sort 3 1 2:", add_special_tokens=False)["input_ids"]
    assert len(ids) == len("sort 3 1 2:")
    assert tok.convert_ids_to_tokens(ids) == list("sort 3 1 2:")


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=DEFAULT_ALPHABET, max_size=40))
def test_encode_decode_round_trip(text):
    tok = char_tokenizer()
    ids = encode_prompt(tok, text)
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids[1:]) == text


def test_every_task_prompt_and_answer_is_encodable(tok):
    for name in TASKS:
        for ex in get_task(name).examples("train", 200):
            for text in (ex["prompt"], ex["demonstration"]):
                ids = tok(text, add_special_tokens=False)["input_ids"]
                assert tok.unk_token_id not in ids and len(ids) == len(text)


def test_unknown_characters_are_an_error(tok):
    with pytest.raises(ValueError, match="cannot encode"):
        encode_prompt(tok, "12+34=\u00e9")
    with pytest.raises(ValueError, match="cannot encode"):
        encode_completion(tok, "Z")


def test_custom_alphabet_and_bad_alphabet():
    tok = char_tokenizer("01+=")
    assert len(tok) == 8
    assert encode_prompt(tok, "10+1=") == [1, 5, 4, 6, 5, 7]
    with pytest.raises(ValueError, match="unique"):
        char_tokenizer("0012")


def test_save_and_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok")
    assert loaded.padding_side == "left"
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    for text in ["12+34=", "sort 9 1 0 0:", "make 22 from 3 5 7:"]:
        assert encode_prompt(loaded, text) == encode_prompt(tok, text)
        assert loaded.decode(encode_prompt(loaded, text), skip_special_tokens=True) == text
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")


def test_batch_padding_is_on_the_left(tok):
    out = tok(["1", "123"], padding=True)
    assert out["input_ids"][0][:2] == [tok.pad_token_id] * 2
    assert out["attention_mask"][0] == [0, 0, 1, 1]


def test_chat_template_applied_when_present(tmp_path):
    tok = char_tokenizer()
    plain = encode_prompt(tok, "12+34=")
    tok.chat_template = TINY_TEMPLATE
    tok.save_pretrained(tmp_path / "chat")
    chat = load_tokenizer(tmp_path / "chat")
    assert chat.chat_template == TINY_TEMPLATE
    ids = encode_prompt(chat, "12+34=")  # auto: the template is used
    assert chat.decode(ids) == "<user>12+34=\n<assistant>"
    assert encode_prompt(chat, "12+34=", use_chat_template=True) == ids
    assert encode_prompt(chat, "12+34=", use_chat_template=False) == plain
    with_system = encode_prompt(chat, "1+1=", system_prompt="add")
    assert chat.decode(with_system) == "<system>add\n<user>1+1=\n<assistant>"


def test_chat_template_required_but_missing(tok):
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(tok, "1+1=", use_chat_template=True)


def test_decode_completion_cuts_at_eos_and_drops_pads(tok):
    ids = tok("46", add_special_tokens=False)["input_ids"]
    after = tok("99", add_special_tokens=False)["input_ids"]
    assert decode_completion(tok, ids + [tok.eos_token_id] + after) == "46"
    assert decode_completion(tok, ids + [tok.pad_token_id] * 3) == "46"
    assert decode_completion(tok, [tok.eos_token_id] + ids) == ""
    assert encode_completion(tok, "46") == ids + [tok.eos_token_id]
