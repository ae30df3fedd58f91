"""Placement of sequences on a target's draft streams (workers/target/placement.py): balance, the
router's hint, a stream that ends, one that backs off, and fit across draft kinds."""

from __future__ import annotations

from workers.engine.speculator import Speculator
from workers.target.commands import DraftContext
from workers.target.placement import EXPLORE_BELOW, FIT_STEPS, Placement


def stream(draft: str, serial: int, *, ask: bool = True, method: str = "ngram", pipelined: bool = True) -> DraftContext:
    return DraftContext(draft, (), "float32", ask, pipelined, stream=serial, method=method)


def speculator(n: int, hints: dict[int, str] | None = None) -> Speculator:
    spec = Speculator(vocab_size=100, num_speculative_tokens=4)
    for i in range(n):
        spec.add(f"s{i}", None, None, None, (hints or {}).get(i, ""))
    return spec


def held(spec: Speculator) -> dict[str, int]:
    out: dict[str, int] = {}
    for st in spec.states.values():
        draft = spec.draft_of(st)
        out[draft] = out.get(draft, 0) + 1
    return out


def test_new_sequences_split_evenly_and_a_hint_is_honoured():
    spec, placement = speculator(9, hints={0: "b", 1: "b", 2: "b"}), Placement()
    streams = (stream("a", 1), stream("b", 2), stream("c", 3))
    placement.sync(spec, streams)
    placement.place(spec, list(spec.states), streams)
    assert [spec.draft_of(spec.states[f"s{i}"]) for i in range(3)] == ["b", "b", "b"]
    assert held(spec) == {"a": 3, "b": 3, "c": 3}
    # a hint to a draft this target does not stream to is no placement
    spec.add("x", None, None, None, "gone")
    placement.place(spec, ["x"], streams)
    assert spec.draft_of(spec.states["x"]) in {"a", "b", "c"}


def test_one_stream_places_nothing_and_every_sequence_speculates_with_it():
    spec, placement = speculator(3), Placement()
    streams = (stream("a", 1),)
    placement.sync(spec, streams)
    placement.place(spec, list(spec.states), streams)
    assert spec.draft_id == "a" and all(st.draft is None for st in spec.states.values())


def test_a_stream_that_ends_takes_only_its_sequences_and_they_are_told_afresh_elsewhere():
    spec, placement = speculator(4), Placement()
    both = (stream("a", 1), stream("b", 2))
    placement.sync(spec, both)
    placement.place(spec, list(spec.states), both)
    for st in spec.states.values():
        st.told = 10  # each draft heard its sequences
    on_a = {rid for rid, st in spec.states.items() if spec.draft_of(st) == "a"}
    assert len(on_a) == 2
    spec.forget("s0" if "s0" in on_a else "s1")  # one of a's finishes: a is owed a release ...
    placement.sync(spec, (stream("b", 2),))  # ... but a's stream is gone
    assert spec.released == []  # nothing goes to the dead draft
    moved = [rid for rid in on_a if rid in spec.states]
    assert all(spec.states[rid].told == 0 for rid in moved)  # the survivor hears them from the start
    assert all(spec.states[rid].told == 10 for rid in spec.states if rid not in on_a)  # the others untouched
    assert all(spec.draft_of(st) == "b" for st in spec.states.values())
    assert placement.moved == len(moved)


def test_a_new_stream_to_the_same_draft_worker_starts_its_sequences_afresh():
    spec, placement = speculator(2), Placement()
    placement.sync(spec, (stream("a", 1),))
    for st in spec.states.values():
        st.told = 5
    placement.sync(spec, (stream("a", 7),))  # reopened (a new incarnation, say)
    assert all(st.told == 0 for st in spec.states.values())


def test_a_backed_off_stream_hands_its_sequences_to_one_that_asks_and_is_told_to_forget_them():
    spec, placement = speculator(4), Placement()
    both = (stream("a", 1), stream("b", 2))
    placement.sync(spec, both)
    placement.place(spec, list(spec.states), both)
    for st in spec.states.values():
        st.told = 3
    on_a = sorted(rid for rid, st in spec.states.items() if spec.draft_of(st) == "a")
    backed_off = (stream("a", 1, ask=False), stream("b", 2))
    placement.sync(spec, backed_off)
    placement.place(spec, list(spec.states), backed_off)
    assert all(spec.draft_of(st) == "b" for st in spec.states.values())
    assert sorted(spec.released) == on_a and {spec.released_from[r] for r in on_a} == {"a"}


def test_the_primary_changing_keeps_the_old_ones_sequences_with_it_by_name():
    spec, placement = speculator(2), Placement()
    placement.sync(spec, (stream("a", 1),))
    for st in spec.states.values():
        st.told = 4
    placement.sync(spec, (stream("b", 2), stream("a", 1)))  # a better-ranked draft appeared first
    assert spec.draft_id == "b"
    assert all(spec.draft_of(st) == "a" and st.told == 4 for st in spec.states.values())


def fit(spec: Speculator, rid: str, draft: str, steps: int, accepted: int) -> None:
    spec.states[rid].fit[draft] = [steps, accepted]


def two_kinds(sequences: int = 1):
    """A suffix draft and an EAGLE-3 head, ``sequences`` added and ``s0`` placed: (spec, placement, the streams,
    the draft it was placed on)."""
    spec, placement = speculator(sequences), Placement()
    kinds = (stream("sfx", 1, method="suffix"), stream("eagle", 2, method="eagle3"))
    placement.sync(spec, kinds)
    placement.place(spec, ["s0"], kinds)
    return spec, placement, kinds, spec.draft_of(spec.states["s0"])


def test_fit_tries_the_other_kind_when_the_first_gains_little_and_keeps_the_better():
    spec, placement, kinds, first = two_kinds()
    other = "eagle" if first == "sfx" else "sfx"
    st = spec.states["s0"]
    st.told = 30
    fit(spec, "s0", first, FIT_STEPS - 1, 0)
    placement.place(spec, ["s0"], kinds)
    assert spec.draft_of(st) == first  # not judged yet
    fit(spec, "s0", first, FIT_STEPS, int(EXPLORE_BELOW * 4 * FIT_STEPS) - 1)  # under the bar
    placement.place(spec, ["s0"], kinds)
    assert spec.draft_of(st) == other and st.told == 0 and not st.settled
    fit(spec, "s0", other, FIT_STEPS, 0)  # the other kind does worse still
    placement.place(spec, ["s0"], kinds)
    assert spec.draft_of(st) == first and st.settled and placement.refits == 2
    fit(spec, "s0", first, 10 * FIT_STEPS, 0)
    placement.place(spec, ["s0"], kinds)
    assert spec.draft_of(st) == first  # settled: it stays


def test_a_draft_that_serves_a_sequence_well_keeps_it_and_one_kind_never_explores():
    spec, placement, kinds, draft = two_kinds(2)
    fit(spec, "s0", draft, FIT_STEPS, 3 * FIT_STEPS)
    placement.place(spec, ["s0"], kinds)
    assert spec.draft_of(spec.states["s0"]) == draft and spec.states["s0"].settled
    same = (stream("a", 3), stream("b", 4))
    placement.sync(spec, same)
    placement.place(spec, ["s1"], same)
    d1 = spec.draft_of(spec.states["s1"])
    fit(spec, "s1", d1, 5 * FIT_STEPS, 0)
    placement.place(spec, ["s1"], same)
    assert spec.draft_of(spec.states["s1"]) == d1 and placement.refits == 0


def test_fit_counts_steps_where_the_draft_gave_nothing():
    spec = speculator(1)
    st = spec.states["s0"]
    spec.draft_id = "d"
    st.why_plain = "no_proposal"
    spec.count_plain(type("Seq", (), {"request_id": "s0"})())
    st.why_plain = "load"  # the plan's choice, not the draft's failing
    spec.count_plain(type("Seq", (), {"request_id": "s0"})())
    assert st.fit == {"d": [1, 0]}


def test_an_adapters_requests_go_to_the_head_trained_against_it_and_others_to_the_base_heads():
    spec, placement = Speculator(vocab_size=100, num_speculative_tokens=4), Placement()
    for i in range(4):
        spec.add(f"sql{i}", None, None, None, lora="sql")
        spec.add(f"base{i}", None, None, None)
    spec.add("chat", None, None, None, lora="chat")  # no head for its adapter: a base head
    heads = (stream("base-a", 1, method="eagle3"), stream("base-b", 2, method="eagle3"),
             DraftContext("sql-head", (), "float32", True, True, stream=3, method="eagle3", lora="sql"))
    placement.sync(spec, heads)
    placement.place(spec, list(spec.states), heads)
    on = {rid: spec.draft_of(st) for rid, st in spec.states.items()}
    assert all(on[f"sql{i}"] == "sql-head" for i in range(4))
    assert all(on[f"base{i}"] in ("base-a", "base-b") for i in range(4)) and on["chat"] in ("base-a", "base-b")
    # the adapter's head backed off: its requests go to the base heads meanwhile
    spec.add("sql9", None, None, None, lora="sql")
    backed_off = heads[:2] + (DraftContext("sql-head", (), "float32", False, True, stream=3, lora="sql"),)
    placement.place(spec, ["sql9"], backed_off)
    assert spec.draft_of(spec.states["sql9"]) in ("base-a", "base-b")


def test_a_sequence_on_a_draft_outside_its_adapters_set_is_judged_by_nothing_and_stays():
    spec, placement = Speculator(vocab_size=100, num_speculative_tokens=4), Placement()
    spec.add("s", None, None, None, lora="sql")
    base = (stream("base", 1, method="suffix"), stream("other", 2, method="eagle3"))
    placement.sync(spec, base)
    placement.place(spec, ["s"], base)  # no head for "sql": a base draft
    first = spec.draft_of(spec.states["s"])
    spec.states["s"].told = 20
    fit(spec, "s", first, FIT_STEPS, 0)
    heads = base + (DraftContext("sql-head", (), "float32", True, True, stream=3, method="eagle3", lora="sql"),
                    DraftContext("sql-suffix", (), "float32", True, True, stream=4, method="suffix", lora="sql"))
    placement.sync(spec, heads)
    placement.place(spec, ["s"], heads)  # its adapter's drafts appeared: the fit does not judge a base draft
    assert spec.draft_of(spec.states["s"]) == first


def test_new_sequences_start_on_the_kind_that_gained_settled_sequences_most():
    spec, placement, kinds, first = two_kinds()
    fit(spec, "s0", first, FIT_STEPS, 3 * FIT_STEPS)  # it served this sequence well: it settles there
    placement.place(spec, ["s0"], kinds)
    assert spec.states["s0"].settled
    for i in range(1, 4):
        spec.add(f"s{i}", None, None, None)
    placement.place(spec, ["s1", "s2", "s3"], kinds)
    assert all(spec.draft_of(spec.states[f"s{i}"]) == first for i in range(1, 4))  # not split by load
