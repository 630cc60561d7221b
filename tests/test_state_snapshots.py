"""The snapshot store of recurrent states (kvql/engine/cache/state_snapshots.py): keyed by salt and tokens,
the deepest prefix found, least recently used first out of its byte budget, copies handed out; a damaged file
of them loads none."""

from __future__ import annotations

import pytest
import torch

from kvql.engine.cache.state_snapshots import FILE, StateSnapshots, write


class State:
    def __init__(self, nbytes: int, tag: str):
        self.nbytes, self.tag = nbytes, tag

    def clone(self):
        return State(self.nbytes, self.tag + "'")


def test_the_deepest_prefix_with_a_snapshot_of_the_same_salt_and_tokens():
    s = StateSnapshots(budget=100)
    tokens = list(range(20))
    s.put(None, tokens[:5], State(10, "a"))
    s.put(None, tokens[:12], State(10, "b"))
    s.put("tenant", tokens[:15], State(10, "c"))
    s.put(None, [9] * 18, State(10, "d"))  # the same length as no prefix of `tokens`
    assert s.deepest(None, tokens, 19) == 12 and s.deepest(None, tokens, 11) == 5 and s.deepest(None, tokens, 4) == 0
    assert s.deepest("tenant", tokens, 19) == 15 and s.deepest("other", tokens, 19) == 0
    got = s.get(None, tokens[:12])
    assert got.tag == "b'" and s.hits == 1  # a copy: the store keeps its own


def test_the_least_recently_used_go_first_and_the_budget_holds():
    s = StateSnapshots(budget=30)
    for i in range(3):
        s.put(None, [i], State(10, str(i)))
    s.get(None, [0])  # now the most recently used
    s.put(None, [3], State(10, "3"))
    assert s.bytes == 30 and len(s) == 3
    assert [s.deepest(None, [i], 1) for i in range(4)] == [1, 0, 1, 1]  # [1] went
    s.put(None, [4], State(31, "too big"))  # larger than the whole budget: not kept, nothing evicted for it
    assert len(s) == 3 and s.deepest(None, [4], 1) == 0
    s.clear()
    assert (len(s), s.bytes, s.deepest(None, [0], 1)) == (0, 0, 0)


class Encoded(State):
    def encode(self):
        return {"tag": self.tag}, {"x": torch.full((self.nbytes // 4,), 1.0)}


def decode(description, tensors):
    return Encoded(tensors["x"].numel() * 4, description["tag"])


@pytest.mark.parametrize("damage", ["truncated", "cut after the header length", "garbage", "another model's"])
def test_a_damaged_snapshots_file_loads_nothing_and_raises_only_value_error(tmp_path, damage):
    s = StateSnapshots(budget=1000)
    for i in range(3):
        s.put(None, [i, i], Encoded(40, str(i)))
    assert write(tmp_path, "digest", s.encoded()) == 3
    path = tmp_path / FILE
    raw = path.read_bytes()
    path.write_bytes({"truncated": raw[:-5], "cut after the header length": raw[:9], "garbage": bytes(len(raw)) + b"x",
                      "another model's": raw}[damage])
    fresh = StateSnapshots(budget=1000)
    with pytest.raises(ValueError):
        fresh.load(tmp_path, "other digest" if damage == "another model's" else "digest", decode)
    assert len(fresh) == 0 and fresh.bytes == 0
    path.write_bytes(raw)
    assert fresh.load(tmp_path, "digest", decode) == 3 and fresh.get(None, [1, 1]).tag == "1'"
