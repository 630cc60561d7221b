"""The snapshot store of recurrent states (kvql/engine/cache/state_snapshots.py): keyed by salt and tokens,
the deepest prefix found, least recently used first out of its byte budget, copies handed out."""

from __future__ import annotations

from kvql.engine.cache.state_snapshots import StateSnapshots


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
