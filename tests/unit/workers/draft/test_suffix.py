"""Suffix decoding's proposer: the request's own tree, the global tree of earlier outputs, speculation
length following the match, trees, eviction and the memory bound."""

from __future__ import annotations

import random

import pytest

from workers.draft.drafter import DraftInput, VerifyResult
from workers.draft.suffix import SuffixConfig, SuffixProposer
from workers.speculation.payloads import ROOT

pytestmark = pytest.mark.unit

TEMPLATE = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]  # an output every request repeats


def serve(p: SuffixProposer, seq_id: str, prompt: list[int], output: list[int], gamma: int = 4) -> list[list[int]]:
    """Run one request to the end, the target emitting ``output`` one token per round whatever was
    proposed; the proposals made along the way."""
    proposals = []
    [out] = p.propose([DraftInput(seq_id, 0, prompt + output[:1], gamma)])
    proposals.append(out.token_ids)
    for rnd, token in enumerate(output[1:], start=1):
        p.verified([VerifyResult(seq_id, rnd - 1, 0, [token])])
        [out] = p.propose([DraftInput(seq_id, rnd, [], gamma)])
        proposals.append(out.token_ids)
    p.release([seq_id])
    return proposals


def test_the_request_tree_finds_continuations_in_the_prompt():
    p = SuffixProposer()
    [out] = p.propose([DraftInput("s", 0, [1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 3)])
    assert out.token_ids == [4, 5, 6] and out.distributions == [] and not out.is_tree
    assert p.won == {"request": 1, "global": 0}
    p.release(["s"])
    assert len(p) == 0


def test_earlier_outputs_predict_a_new_request_through_the_global_tree():
    p = SuffixProposer()
    first = serve(p, "a", [1, 2, 3, 7, 8], TEMPLATE)
    assert not any(first)  # nothing to go on: a new prompt, an empty global tree
    # Another prompt with the same tail (a chat template's assistant header), the same output.
    second = serve(p, "b", [4, 5, 6, 7, 8], TEMPLATE)
    assert second[0] == TEMPLATE[1:4]  # matched "7 8 50": as many tokens as matched, at most γ
    assert all(prop == TEMPLATE[i + 1 : i + 5] for i, prop in enumerate(second[1:-4], start=1))
    assert p.won["global"] > 0 and len(p) == 0
    assert len(p.cache) == 2 and p.cache.tokens(0) == [1, 2, 3, 7, 8] + TEMPLATE  # the prompt's tail, the output


def test_outputs_enter_the_global_tree_when_their_request_ends():
    p = SuffixProposer()
    p.propose([DraftInput("a", 0, [1, 2, 3, 4], 4)])
    p.verified([VerifyResult("a", 0, 0, [5, 6, 7])])
    [b] = p.propose([DraftInput("b", 0, [9, 3, 4], 4)])
    assert len(p.cache) == 0 and b.token_ids == []  # "a" is still in flight: its tokens are its own
    p.release(["a"])
    assert p.cache.tokens(0) == [1, 2, 3, 4, 5, 6, 7]
    p.verified([VerifyResult("b", 0, 0, [5])])
    [b] = p.propose([DraftInput("b", 1, [], 4)])
    assert b.token_ids == [6, 7]
    p.propose([DraftInput("c", 0, [1, 2], 4)])
    p.release(["c"])  # nothing generated after the first call: no output to keep
    assert len(p.cache) == 1


def test_speculation_length_follows_the_match_length():
    p = SuffixProposer(SuffixConfig(spec_factor=1.0))
    history = list(range(100, 130))
    p.propose([DraftInput("s", 0, history + [1] + history[:1], 8)])
    lengths = []
    for rnd, token in enumerate(history[1:10], start=1):  # the match grows by one token a round
        p.verified([VerifyResult("s", rnd - 1, 0, [token])])
        [out] = p.propose([DraftInput("s", rnd, [], 8)])
        lengths.append(len(out.token_ids))
    assert lengths == [2, 3, 4, 5, 6, 7, 8, 8, 8]  # min(γ, match length)
    half = SuffixProposer(SuffixConfig(spec_factor=0.5))
    [out] = half.propose([DraftInput("t", 0, history + [1] + history[:6], 8)])
    assert out.token_ids == history[6:9]  # 6 tokens matched: 3 proposed


def test_trees_from_the_most_frequent_branches_and_chains_on_request():
    p = SuffixProposer(SuffixConfig(tree_topk=2))
    prompt = [7, 8, 1, 2, 3, 4, 6, 8, 1, 2, 3, 4, 5, 8, 1, 2, 5, 6, 4, 8, 1, 2]
    [tree] = p.propose([DraftInput("s", 0, prompt, 4)])
    # "8 1 2" matched (3 tokens: 3 nodes): 3 twice (then 4, then 6 or 5), 5 once
    assert tree.token_ids == [3, 4, 5] and tree.parents == [ROOT, 0, ROOT]
    [chain] = p.propose([DraftInput("s", 1, [], 4, tree_topk=1)])
    assert chain.token_ids == [3, 4, 5] and not chain.is_tree  # after "3 4": 6 or 5, the latest first
    [none] = p.propose([DraftInput("s", 2, [], 0)])
    assert none.token_ids == []
    # The longest match wins over a more frequent shorter one: "2 5 6 4 8 1 2 ..." is seen once.
    p.verified([VerifyResult("s", 2, 0, [5, 6, 4, 8, 1, 2])])
    [tree] = p.propose([DraftInput("s", 3, [], 4)])
    assert tree.token_ids == [5, 6, 4, 8] and not tree.is_tree


def test_oldest_outputs_are_evicted_past_the_output_cap():
    p = SuffixProposer(SuffixConfig(max_cached_outputs=2))
    for i in range(3):
        serve(p, f"r{i}", [i], [10 + i] * 3)
    assert len(p.cache) == 2 and p.evicted == 1
    assert p.cache.count([10]) == 0 and p.cache.count([12, 12]) == 2  # r0's output is gone
    off = SuffixProposer(SuffixConfig(max_cached_outputs=0))
    serve(off, "r", [1], TEMPLATE)
    assert len(off.cache) == 0 and not any(serve(off, "q", [1], TEMPLATE)[1:2])


@pytest.mark.parametrize("seed", range(3))
def test_the_global_tree_stays_within_its_node_cap(seed):
    rng = random.Random(seed)
    cap = 400
    p = SuffixProposer(SuffixConfig(max_depth=8, max_cached_nodes=cap))
    live: dict[str, int] = {}
    for step in range(300):
        if len(live) < 6 and rng.random() < 0.3:  # a new request
            sid = f"s{step}"
            live[sid] = 0
            p.propose([DraftInput(sid, 0, [rng.randrange(20) for _ in range(rng.randrange(1, 12))], 4)])
        elif live:
            sid = rng.choice(sorted(live))
            p.verified([VerifyResult(sid, live[sid], 0, [rng.randrange(20) for _ in range(rng.randrange(1, 5))])])
            live[sid] += 1
            if rng.random() < 0.1:
                p.release([sid])
                del live[sid]
            else:
                p.propose([DraftInput(sid, live[sid], [], 4)])
        assert p.cache.num_nodes <= cap
    assert p.evicted > 0
    # What stays is exactly the suffixes of the outputs kept: removal left nothing behind.
    kept = [p.cache.tokens(k) for k in list(p.cache._seqs)]
    assert p.cache.num_tokens == sum(map(len, kept))
    p.release(sorted(live))
    for k in list(p.cache._seqs):
        p.cache.remove(k)
    assert p.cache.num_nodes == 0


def test_bad_settings_raise():
    for bad in ({"max_depth": 1}, {"spec_factor": 0}, {"min_token_prob": 1.5}, {"max_cached_nodes": -1},
                {"tree_topk": 0}):
        with pytest.raises(ValueError):
            SuffixConfig(**bad)


def test_the_draft_worker_builds_it_from_its_flags():
    from workers.draft.__main__ import draft_config, make_proposer, parse_args

    spec = ('{"suffix_decoding_max_tree_depth": 16, "suffix_decoding_max_spec_factor": 2, '
            '"suffix_decoding_max_cached_nodes": 5000, "eagle_topk": 3}')
    p = make_proposer(draft_config(parse_args(["--method", "suffix", "--speculative-config", spec])))
    assert isinstance(p, SuffixProposer) and p.caps.method == "suffix"
    cfg = p.config
    assert (cfg.max_depth, cfg.spec_factor, cfg.max_cached_nodes, cfg.tree_topk) == (16, 2.0, 5000, 3)
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob"):
        draft_config(parse_args(["--method", "suffix", "--speculative-config",
                                 '{"suffix_decoding_min_token_prob": 2}']))


def test_proposals_carry_the_trees_estimate_of_reaching_each_token():
    """Confidence: the product of conditional frequencies along the path times the reliability of the
    match each token extends, so a repeated output is proposed with confidence near 1 and a path seen
    half the time with half as much; staged chains carry it too."""
    from workers.draft.drafter import Branch
    from workers.draft.suffix import match_reliability as r

    p = SuffixProposer()
    serve(p, "a", [1, 2, 3, 7, 8], TEMPLATE)
    [out] = p.propose([DraftInput("b", 0, [4, 5, 6, 7, 8] + TEMPLATE[:3], 4)])
    # matched "7 8 50 51 52": five tokens, then six, seven, eight
    reach = [r(5), r(5) * r(6), r(5) * r(6) * r(7), r(5) * r(6) * r(7) * r(8)]
    assert out.token_ids == TEMPLATE[3:7] and out.confidence == pytest.approx(reach)
    serve(p, "c", [1, 2, 3, 7, 8], TEMPLATE[:5] + [99, 98, 97, 96, 95])  # the same start, then another way
    [out] = p.propose([DraftInput("d", 0, [4, 5, 6, 7, 8] + TEMPLATE[:3], 4)])
    assert out.token_ids[:2] == TEMPLATE[3:5] and out.confidence[:2] == pytest.approx(reach[:2])
    assert out.confidence[2] == pytest.approx(0.5 * reach[2])  # after TEMPLATE[4]: 59 … once, 99 … once
    p.commit("e", [4, 5, 6, 7, 8] + TEMPLATE[:3])
    [chain] = p.draft([Branch("e", (), 2, 0)])
    assert chain.tokens == TEMPLATE[3:5] and chain.confidence == pytest.approx(reach[:2])


def test_match_reliability_grows_with_the_match():
    """A continuation after a one-token match is a guess, after a long one near certain (the agent
    replay's measured acceptance: 17 % after 1 token, 44 % after 2, 92 % after 4 to 7, 99 % after 16)."""
    from workers.draft.suffix import match_reliability as r

    assert r(0) == 0.0 and r(1) == pytest.approx(0.2) and r(2) == pytest.approx(0.5)
    assert all(r(m) < r(m + 1) < 1.0 for m in range(1, 40))
    assert r(4) >= 0.8 and r(16) >= 0.98


def test_a_short_match_claims_little_and_a_long_one_near_certainty():
    """The same tree and the same unique continuation: claimed by the length of the match it follows.
    The target's calibration bins claims, so copying (long matches) and guessing (short ones) are
    told apart instead of both arriving as confidence 1."""
    p = SuffixProposer(SuffixConfig(spec_factor=8.0))
    passage = list(range(100, 140))  # text the session saw once (a file the agent wrote, say)
    [short] = p.propose([DraftInput("s", 0, [7, 8, 9] + passage + [1, 2, 100], 4)])
    assert short.token_ids == passage[1:5]  # matched "100" alone
    assert short.confidence[0] == pytest.approx(0.2) and short.confidence[-1] < 0.1
    [long] = p.propose([DraftInput("l", 0, [7, 8, 9] + passage + [1, 2] + passage[:20], 4)])
    assert long.token_ids == passage[20:24]  # matched 16 or more tokens: copying
    assert min(long.confidence) > 0.9


def test_the_sessions_own_long_match_wins_over_a_frequent_short_one_elsewhere():
    """Agent loops: the request's prompt holds the session's earlier turns, outputs and tool results.
    A long match there, even with a split continuation, beats a short match that unrelated earlier
    outputs (the global tree) continue the same way every time; by frequency alone the global
    tree's chain (probability 1 all along) would have won."""
    p = SuffixProposer(SuffixConfig(max_depth=12, spec_factor=8.0))  # matches of up to 8 tokens
    for i in range(3):  # unrelated outputs: after 60 always 70 71 72 73
        serve(p, f"other{i}", [1, 2], [60, 70, 71, 72, 73, 74])
    won = dict(p.won)
    own = [10, 11, 12, 13, 14, 15, 16, 60, 80, 81, 5, 10, 11, 12, 13, 14, 15, 16, 60, 80, 82, 5]
    [out] = p.propose([DraftInput("s", 0, own + [10, 11, 12, 13, 14, 15, 16, 60], 4)])
    assert out.token_ids[0] == 80 and p.won == {"request": won["request"] + 1, "global": won["global"]}


def test_tree_proposals_carry_the_match_reliability_by_depth():
    from workers.draft.suffix import match_reliability as r

    p = SuffixProposer(SuffixConfig(spec_factor=8.0))
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 7, 8, 1, 2, 3, 4]  # after "1 2 3 4": 5 6 once, 7 8 once
    [out] = p.propose([DraftInput("t", 0, prompt, 4, tree_topk=2, tree_depth=2)])
    assert out.is_tree
    by_depth = {}
    for token, parent in zip(out.token_ids, out.parents):
        by_depth[token] = 1 if parent == ROOT else by_depth[out.token_ids[parent]] + 1
    for token, c in zip(out.token_ids, out.confidence):
        want = 0.5 * r(4) * (r(5) if by_depth[token] == 2 else 1.0)
        assert c == pytest.approx(want)
