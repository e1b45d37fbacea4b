"""The character tokenizer: one token per character, BOS on encode, left padding, save/load round trip."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from steadyrl.models.tokenizer import BOS_TOKEN, CHARSET, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN, build_char_tokenizer


def test_one_token_per_character_with_bos() -> None:
    tok = build_char_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == len(CHARSET) + 4 == 100
    text = "12+-3= x~\n9"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.convert_ids_to_tokens(ids[1:]) == list(text)
    assert tok.eos_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token) == (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)


def test_digits_are_single_tokens_and_unknowns_are_unk() -> None:
    tok = build_char_tokenizer()
    assert len({tok.convert_tokens_to_ids(d) for d in "0123456789"}) == 10
    assert tok("é", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]
    # Special-token text in a prompt stays characters: text cannot forge an EOS.
    assert tok("<eos>", add_special_tokens=False)["input_ids"] == tok.convert_tokens_to_ids(list("<eos>"))


def test_left_padding() -> None:
    enc = build_char_tokenizer()(["1+1=", "123+456="], padding=True)
    assert enc["input_ids"][0][:4] == [0, 0, 0, 0] and enc["attention_mask"][0][:5] == [0, 0, 0, 0, 1]


def test_save_and_autotokenizer_round_trip(tmp_path: Path) -> None:
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    texts = ["12+3=", "a b\nc", "<pad>"]
    assert loaded(texts, padding=True)["input_ids"] == tok(texts, padding=True)["input_ids"]
    assert loaded.padding_side == "left" and len(loaded) == len(tok)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 0)
