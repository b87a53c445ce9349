"""Tests for rlcore.protocol.Batch: splitting, gathering, repeating and joining rows, and pickling."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import torch

from rlcore.protocol import Batch


def make_batch(n: int = 6) -> Batch:
    """Row i holds x = [i, 10 i], y = i / 2, a string name and a dict (kept as an object)."""
    return Batch(
        {"x": torch.stack([torch.arange(n), 10 * torch.arange(n)], dim=1), "y": torch.arange(n) / 2},
        {"name": [f"row{i}" for i in range(n)], "info": [{"i": i} for i in range(n)]},
    )


def rows(batch: Batch) -> list[tuple]:
    """Every field of every row, as plain python, for order-sensitive comparison."""
    return [
        (batch["x"][i].tolist(), float(batch["y"][i]), batch["name"][i], dict(batch["info"][i]))
        for i in range(len(batch))
    ]


def test_chunk_gives_contiguous_equal_pieces_and_concat_restores_the_batch():
    batch = make_batch(6)
    pieces = batch.chunk(3)
    assert [len(p) for p in pieces] == [2, 2, 2]
    assert [p["name"].tolist() for p in pieces] == [["row0", "row1"], ["row2", "row3"], ["row4", "row5"]]
    back = Batch.concat(pieces)
    assert rows(back) == rows(batch)
    # Non-tensor rows stay python objects (a dict is not flattened into an array).
    assert back["info"].dtype == object and back["info"][4] == {"i": 4}


def test_chunk_refuses_a_size_that_does_not_divide():
    with pytest.raises(ValueError, match="7 into 2"):
        make_batch(7).chunk(2)


def test_split_keeps_a_short_last_piece():
    pieces = make_batch(5).split(2)
    assert [p["name"].tolist() for p in pieces] == [["row0", "row1"], ["row2", "row3"], ["row4"]]


def test_pad_to_multiple_appends_copies_of_the_first_rows_and_says_how_many():
    padded, pad = make_batch(5).pad_to_multiple(4)  # 5 -> 8: rows 0, 1, 2 again
    assert pad == 3 and len(padded) == 8
    assert padded["name"].tolist() == ["row0", "row1", "row2", "row3", "row4", "row0", "row1", "row2"]
    assert padded["x"][5:].tolist() == [[0, 0], [1, 10], [2, 20]]
    assert rows(padded.slice(0, len(padded) - pad)) == rows(make_batch(5))
    short, pad = make_batch(2).pad_to_multiple(7)  # fewer rows than the padding: it cycles through them
    assert pad == 5 and short["name"].tolist() == ["row0", "row1", "row0", "row1", "row0", "row1", "row0"]
    same = make_batch(6)
    unchanged, pad = same.pad_to_multiple(3)
    assert unchanged is same and pad == 0
    assert len(Batch().pad_to_multiple(4)[0]) == 0


def test_repeat_keeps_groups_together():
    batch = make_batch(2).repeat(3)
    assert batch["name"].tolist() == ["row0"] * 3 + ["row1"] * 3
    assert batch["x"].tolist() == [[0, 0]] * 3 + [[1, 10]] * 3
    assert batch["y"].tolist() == [0.0, 0.0, 0.0, 0.5, 0.5, 0.5]


def test_select_any_order_with_repeats():
    batch = make_batch(4)
    picked = batch.select([3, 0, 3])
    assert rows(picked) == [rows(batch)[3], rows(batch)[0], rows(batch)[3]]
    # Works with numpy and tensor indices alike.
    assert rows(batch.select(np.array([2, 1]))) == rows(batch.select(torch.tensor([2, 1])))


def test_union_joins_fields_and_refuses_a_conflicting_tensor():
    a = make_batch(3)
    b = Batch({"reward": torch.tensor([1.0, 0.0, 1.0]), "y": a["y"].clone()}, {"uid": ["u0", "u1", "u2"]})
    both = a.union(b)
    assert set(both.tensors) == {"x", "y", "reward"} and set(both.non_tensors) == {"name", "info", "uid"}
    assert both["reward"].tolist() == [1.0, 0.0, 1.0] and both["uid"].tolist() == ["u0", "u1", "u2"]
    clash = Batch({"y": torch.tensor([9.0, 9.0, 9.0])})
    with pytest.raises(ValueError, match="'y'"):
        a.union(clash)


def test_union_refuses_a_conflicting_non_tensor_field():
    # The docstring's promise covers every field: silently taking the other batch's uids
    # would regroup responses under the wrong prompts.
    a = make_batch(2)
    same = Batch(non_tensors={"name": ["row0", "row1"]})
    assert a.union(same)["name"].tolist() == ["row0", "row1"]
    with pytest.raises(ValueError, match="'name'"):
        a.union(Batch(non_tensors={"name": ["row1", "row0"]}))


def test_union_refuses_different_sizes():
    with pytest.raises(ValueError, match="size 3 and 2"):
        make_batch(3).union(make_batch(2))


@pytest.mark.parametrize(
    "tensors, non_tensors",
    [
        ({"a": torch.zeros(3), "b": torch.zeros(2)}, {}),
        ({"a": torch.zeros(3)}, {"n": ["x", "y"]}),
    ],
)
def test_fields_of_different_lengths_are_refused(tensors, non_tensors):
    with pytest.raises(ValueError, match="disagree on batch size"):
        Batch(tensors, non_tensors)


def test_only_keeps_the_named_tensors_it_has():
    batch = make_batch(3)
    picked = batch.only("y", "absent")
    assert list(picked.tensors) == ["y"] and not picked.non_tensors and picked["y"].tolist() == [0.0, 0.5, 1.0]


def test_missing_field_names_the_available_ones():
    with pytest.raises(KeyError, match="'nope'.*name"):
        make_batch(2)["nope"]


# ------------------------------------------------------------------ pickling (how Batches cross Ray)
def mixed_batch() -> Batch:
    return Batch(
        {"mask": torch.tensor([[True, False], [True, True], [False, False]]),
         "ids": torch.tensor([[1, 2], [3, 4], [5, 6]]),
         "logp": torch.tensor([[-0.5, -1.5], [-2.0, 0.0], [-0.25, -3.0]]),
         "half": torch.tensor([[0.5, 1.0], [2.0, 3.0], [4.0, 8.0]], dtype=torch.bfloat16),
         "param": torch.ones(3, 2, requires_grad=True)},
        {"name": ["a", "b", "c"], "info": [{"i": 0}, {"i": 1}, {"i": 2}]},
    )


def round_trip(batch: Batch) -> tuple[Batch, list[bytes]]:
    """Pickle protocol 5 as Ray uses it: out-of-band buffers, handed back read-only (Ray's object store).
    Returns the rebuilt batch and the out-of-band buffers' bytes."""
    buffers = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    raw = [bytes(b.raw()) for b in buffers]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.from_numpy warns on a read-only array
        return pickle.loads(data, buffers=[memoryview(r) for r in raw]), raw


def test_pickle_round_trip_keeps_dtypes_values_and_non_tensors():
    batch = mixed_batch()
    back, raw = round_trip(batch)
    assert list(back.tensors) == list(batch.tensors)
    for k, v in batch.tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v.detach()), k
    assert back["param"].requires_grad
    assert back["name"].tolist() == ["a", "b", "c"] and back["info"][2] == {"i": 2}
    assert len(raw) == 3  # bool, int64 and float32 travel out-of-band; bfloat16 and the grad tensor do not


def test_unpickled_tensors_are_writable_and_do_not_share_the_received_buffers():
    back, raw = round_trip(mixed_batch())
    before = [bytearray(r) for r in raw]  # copies
    for k in ("mask", "ids", "logp"):
        back[k].zero_()
        assert not back[k].any(), k
    assert [bytearray(r) for r in raw] == before


def test_a_pickled_chunk_carries_only_its_rows():
    big = Batch({"x": torch.zeros(1000, 100)})
    piece = big.chunk(10)[0]
    assert len(pickle.dumps(piece)) < 0.2 * len(pickle.dumps(big))


def test_replace_overwrites_and_adds_tensors_and_keeps_the_rest():
    a = make_batch(3)
    b = a.replace(y=torch.zeros_like(a["y"]), w=torch.ones(3))
    assert torch.equal(b["y"], torch.zeros_like(a["y"])) and b["w"].tolist() == [1.0, 1.0, 1.0]
    assert torch.equal(b["x"], a["x"]) and set(b.non_tensors) == set(a.non_tensors)
    assert not torch.equal(a["y"], b["y"])  # the original is unchanged
    with pytest.raises(ValueError, match="'w' has 2 rows, the batch 3"):
        a.replace(w=torch.ones(2))
