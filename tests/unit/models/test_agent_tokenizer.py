"""The xrd-tiny tokenizer: fits the tiny model, round-trips ASCII, saves and loads."""
import json
import string

import pytest
from hypothesis import given, settings, strategies as st

from neon_hpc.models.tokenizer import FILE_NAME, Tokenizer, TokenizerError, load_tokenizer


def test_vocabulary_fits_the_tiny_model_and_names_its_specials():
    tok = load_tokenizer("xrd-tiny")
    assert tok.vocab_size <= 256
    assert (tok.pad_id, tok.eos_id) == (0, 1)
    for tag in ("<tool_call>", "</tool_call>", "<answer>", "</answer>", "<|assistant|>", "<|tool|>"):
        assert tok.decode([tok.token_id(tag)]) == tag


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", ""), max_size=80))
def test_ascii_text_round_trips(text):
    tok = load_tokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_task_words_and_peak_positions_are_single_tokens():
    tok = load_tokenizer()
    assert len(tok.encode("25")) == 1 and len(tok.encode("90")) == 1
    assert len(tok.encode("Ti")) == 1
    assert tok.encode("<answer>") == [tok.token_id("<answer>")]
    # special tags typed as text by a user are not specials when not allowed
    assert tok.token_id("<answer>") not in tok.encode("<answer>", allow_special=False)


def test_other_characters_become_unk():
    tok = load_tokenizer()
    assert tok.encode("é\r") == [tok.unk_id, tok.unk_id]


def test_save_and_load_round_trip(tmp_path):
    tok = load_tokenizer()
    path = tok.save(tmp_path)
    assert path.name == FILE_NAME
    again = load_tokenizer(str(tmp_path))
    assert again.tokens == tok.tokens and again.name == "xrd-tiny"
    assert Tokenizer.load(path).encode("peaks 25 38") == tok.encode("peaks 25 38")


def test_bad_files_are_refused_with_the_path(tmp_path):
    (tmp_path / FILE_NAME).write_text(json.dumps({"format": "other"}))
    with pytest.raises(TokenizerError, match=str(tmp_path)):
        Tokenizer.load(tmp_path)
    with pytest.raises(TokenizerError, match="no tokenizer file"):
        Tokenizer.load(tmp_path / "missing")
    with pytest.raises(TokenizerError, match="unknown tokenizer"):
        load_tokenizer("no-such-tokenizer")
