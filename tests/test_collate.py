"""Tests for rlcore.data.collate with the built-in character tokenizer.

Expected ids are looked up one character at a time in the vocabulary, a different path
from the chat template + tokenizer that the code under test runs.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from rlcore.data.collate import decode_responses, encode_prompts, encode_responses, prompt_batch
from rlcore.data.schema import make_row


def char_ids(tok, text: str) -> list[int]:
    return [tok.convert_tokens_to_ids(c) for c in text]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_prompts_are_chat_templated_and_left_padded(tiny_tokenizer):
    tok = tiny_tokenizer
    ids, mask = encode_prompts(tok, [user("1+2="), user("10+20=")], 12, "src")
    special = tok.convert_tokens_to_ids
    row0 = [tok.bos_token_id, special("<|user|>")] + char_ids(tok, "1+2=") + [special("<|assistant|>")]
    row1 = [tok.bos_token_id, special("<|user|>")] + char_ids(tok, "10+20=") + [special("<|assistant|>")]
    pad = tok.pad_token_id
    assert ids.tolist() == [[pad] * 5 + row0, [pad] * 3 + row1]
    assert mask.tolist() == [[0] * 5 + [1] * 7, [0] * 3 + [1] * 9]
    assert ids.dtype == torch.long and mask.dtype == torch.long


def test_prompt_of_exactly_max_length_fits(tiny_tokenizer):
    ids, mask = encode_prompts(tiny_tokenizer, [user("1+2=")], 7, "src")
    assert mask.tolist() == [[1] * 7]


def test_too_long_prompt_names_the_row_and_the_key(tiny_tokenizer):
    with pytest.raises(ValueError) as info:
        encode_prompts(tiny_tokenizer, [user("1+2="), user("123456789+1=")], 12, "data/rl.parquet")
    msg = str(info.value)
    assert "data/rl.parquet" in msg and "row 1" in msg and "task.max_prompt_length" in msg
    assert "15 tokens" in msg and "12" in msg  # 3 template tokens + 12 characters


def test_responses_get_eos_and_are_right_padded(tiny_tokenizer):
    tok = tiny_tokenizer
    ids, mask = encode_responses(tok, ["42", "7"], 5, "src")
    eos, pad = tok.eos_token_id, tok.pad_token_id
    assert ids.tolist() == [char_ids(tok, "42") + [eos, pad, pad], char_ids(tok, "7") + [eos, pad, pad, pad]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]


def test_too_long_response_counts_the_eos(tiny_tokenizer):
    encode_responses(tiny_tokenizer, ["1234"], 5, "src")  # 4 chars + EOS fit exactly
    with pytest.raises(ValueError, match=r"row 0: response is 6 tokens with EOS; task.max_response_length is 5"):
        encode_responses(tiny_tokenizer, ["12345"], 5, "src")


def test_decode_round_trip_stops_at_the_mask(tiny_tokenizer):
    texts = ["42", "the sum is 9", " a b "]
    ids, mask = encode_responses(tiny_tokenizer, texts, 16, "src")
    assert decode_responses(tiny_tokenizer, ids, mask) == texts
    # Tokens after the mask (what a generator might leave there) are not decoded.
    ids[0, 3:] = torch.tensor(char_ids(tiny_tokenizer, "x" * 13))
    assert decode_responses(tiny_tokenizer, ids, mask)[0] == "42"


class _Spy:
    """A tokenizer's Rust backend that counts its ``decode_batch`` calls."""

    def __init__(self, backend, calls: list):
        self.backend, self.calls = backend, calls

    def decode_batch(self, *args, **kwargs):
        self.calls.append(len(args[0]))
        return self.backend.decode_batch(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.backend, name)


@pytest.mark.parametrize("clean_up", [False, True])
def test_decode_is_each_rows_own_decode_of_its_masked_tokens(tiny_tokenizer, clean_up, monkeypatch):
    """Any ids (special tokens among them) under masks with holes (a tool loop's observations): each text is what
    the tokenizer's own ``decode`` gives that row's masked tokens (written out here token by token). A plain fast
    tokenizer goes through one ``decode_batch`` of its backend; one that cleans up spaces, row by row."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tiny_tokenizer), (64, 12), generator=gen)
    mask = torch.randint(0, 2, (64, 12), generator=gen)
    mask[0] = 0  # an empty response
    special = set(tiny_tokenizer.all_special_ids)
    expected = ["".join(tiny_tokenizer.convert_ids_to_tokens([t for t, k in zip(r, m) if k and t not in special]))
                for r, m in zip(ids.tolist(), mask.tolist())]
    calls: list[int] = []
    backend = tiny_tokenizer.backend_tokenizer
    monkeypatch.setattr(type(tiny_tokenizer), "backend_tokenizer", property(lambda self: _Spy(backend, calls)))
    monkeypatch.setattr(tiny_tokenizer, "clean_up_tokenization_spaces", clean_up)
    assert decode_responses(tiny_tokenizer, ids, mask) == expected
    assert calls == ([] if clean_up else [64])
    assert expected[0] == "" and len(set(expected)) > 50


def test_a_tokenizer_whose_class_changes_decode_keeps_its_own_text(tiny_model_dir, tiny_tokenizer):
    """A fast tokenizer class that maps the decoded text (as CPM's does) is decoded its own way, not by the backend."""

    class Shouting(type(tiny_tokenizer)):
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    texts = ["the sum is 9", "ab"]
    ids, mask = encode_responses(tiny_tokenizer, texts, 16, "src")
    assert decode_responses(Shouting.from_pretrained(tiny_model_dir), ids, mask) == ["THE SUM IS 9", "AB"]


def test_prompt_batch_carries_reward_fields(tiny_tokenizer):
    rows = [make_row(data_source="arith", prompt_text=q, ability="math", ground_truth=a, split="rl", index=i,
                     question=q, answer=a) for i, (q, a) in enumerate([("1+1=", "2"), ("3+4=", "7")])]
    batch = prompt_batch(pd.DataFrame(rows), tiny_tokenizer, 10, "src")
    assert len(batch) == 2
    assert batch["ground_truth"].tolist() == ["2", "7"]
    assert batch["uid"].tolist() == ["rl-0", "rl-1"]
    assert batch["data_source"].tolist() == ["arith", "arith"]
    assert batch["prompt_mask"].sum(1).tolist() == [7, 7]
