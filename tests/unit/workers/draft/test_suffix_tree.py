"""The suffix index behind suffix decoding, against brute force: counts, matching, frequency
scoring, removal and the node count that bounds its memory."""

from __future__ import annotations

import random

import pytest

from workers.draft.suffix_tree import ROOT_NODE, SuffixTree
from workers.speculation.payloads import ROOT

pytestmark = pytest.mark.unit


def substrings(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """Occurrences of every substring of at most ``depth`` tokens."""
    out: dict[tuple[int, ...], int] = {}
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(i + depth, len(s)) + 1):
                out[tuple(s[i:j])] = out.get(tuple(s[i:j]), 0) + 1
    return out


def assert_counts(tree: SuffixTree, seqs: list[list[int]]) -> None:
    want = substrings(seqs, tree.max_depth)
    assert tree.num_nodes == len(want)  # one node per distinct substring: the memory bound is exact
    for path, n in want.items():
        assert tree.count(list(path)) == n, path
    assert tree.num_tokens == sum(map(len, seqs))


@pytest.mark.parametrize("seed", range(4))
def test_counts_equal_brute_force_however_sequences_grow(seed):
    rng = random.Random(seed)
    tree = SuffixTree(max_depth=5)
    seqs: dict[int, list[int]] = {}
    for step in range(60):
        key = rng.randrange(6)
        chunk = [rng.randrange(3) for _ in range(rng.randrange(0, 4))]
        if key not in seqs:
            tree.add(key, chunk)
            seqs[key] = list(chunk)
        else:
            tree.extend(key, chunk)
            seqs[key] += chunk
        if step % 10 == 9:
            assert_counts(tree, list(seqs.values()))
            assert tree.count([7]) == 0 and tree.count([0] * 6) == 0  # absent, and longer than the depth


@pytest.mark.parametrize("seed", range(4))
def test_removal_restores_the_tree_of_the_others_and_frees_nodes(seed):
    rng = random.Random(seed)
    tree = SuffixTree(max_depth=4)
    seqs = {k: [rng.randrange(3) for _ in range(rng.randrange(1, 30))] for k in range(8)}
    for k, s in seqs.items():
        tree.add(k, s[:5])
        tree.extend(k, s[5:])
    tree.close(3)  # closed sequences are removed like open ones
    size = len(tree._count)
    for k in rng.sample(sorted(seqs), len(seqs)):
        tree.remove(k)
        del seqs[k]
        assert_counts(tree, list(seqs.values()))
    assert tree.num_nodes == 0 and len(tree) == 0
    for k in range(8):  # freed nodes are reused: the arrays do not grow
        tree.add(k, [rng.randrange(3) for _ in range(10)])
    assert len(tree._count) <= size


def test_match_finds_the_longest_suffix_with_a_continuation():
    tree = SuffixTree(max_depth=8)
    tree.add("a", [1, 2, 3, 4, 5])
    tree.add("b", [9, 3, 4, 7])
    node, length = tree.match([0, 2, 3, 4], max_len=8)
    assert length == 3 and tree.chain(node, 4, 0.0)[0] == [5]  # "2 3 4" continues only with 5
    node, length = tree.match([0, 2, 3, 4], max_len=2)
    assert length == 2 and tree.chain(node, 4, 0.0)[0] == [7]  # "3 4": 5 or 7, once each; the latest wins
    assert tree.match([6, 5], 8) == (ROOT_NODE, 0)  # 5 ends its sequence: no continuation anywhere
    # The sequence's own latest suffix is in the tree without a continuation: matching skips it.
    own = SuffixTree(max_depth=8)
    own.add(0, [1, 2, 3, 9, 1, 2, 3])
    node, length = own.match(own.tokens(0), 8)
    assert length == 3 and own.chain(node, 3, 0.0)[0] == [9, 1, 2]


def test_chains_follow_the_most_frequent_continuation_with_its_probability():
    tree = SuffixTree(max_depth=6)
    for key, seq in enumerate([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 3, 8]]):
        tree.add(key, seq)
    node, _ = tree.match([1, 2], 6)
    tokens, probs = tree.chain(node, 5, 0.0)
    assert tokens == [3, 4] and probs == pytest.approx([3 / 4, 3 / 4 * 2 / 3])
    assert tree.chain(node, 5, 0.6)[0] == [3]  # 0.5 < 0.6: cut
    assert tree.chain(node, 1, 0.0)[0] == [3]
    # Equal counts: the most recently seen continuation first.
    tie = SuffixTree(max_depth=4)
    tie.add(0, [7, 1, 7, 2, 7, 3])
    node, _ = tie.match([7], 4)
    assert tie.chain(node, 1, 0.0) == ([3], [pytest.approx(1 / 3)])


def test_trees_are_best_first_with_parents_before_children():
    tree = SuffixTree(max_depth=6)
    for key, seq in enumerate([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7]]):
        tree.add(key, seq)
    node, _ = tree.match([1, 2], 6)
    tokens, parents, probs = tree.tree(node, 10, topk=2, max_depth=3, min_prob=0.0)
    # 3 (3/4), 4 (3/4·2/3), 6 (1/4), 5 (3/4·1/3), 7 (1/4)
    assert tokens == [3, 4, 6, 5, 7] and parents == [ROOT, 0, ROOT, 0, 2]
    assert probs == pytest.approx([0.75, 0.5, 0.25, 0.25, 0.25])
    assert tree.tree(node, 10, topk=1, max_depth=3, min_prob=0.0)[:2] == ([3, 4], [ROOT, 0])
    assert tree.tree(node, 2, topk=2, max_depth=3, min_prob=0.0)[:2] == ([3, 4], [ROOT, 0])  # the node budget
    assert tree.tree(node, 10, topk=2, max_depth=1, min_prob=0.0)[:2] == ([3, 6], [ROOT, ROOT])  # the depth
    assert tree.tree(node, 10, topk=2, max_depth=3, min_prob=0.3)[:2] == ([3, 4], [ROOT, 0])  # the floor


def test_bad_values_and_misuse_raise():
    with pytest.raises(ValueError):
        SuffixTree(max_depth=1)
    tree = SuffixTree(max_depth=4)
    tree.add(0, [1, 2])
    with pytest.raises(KeyError):
        tree.add(0, [3])
    tree.close(0)
    with pytest.raises(ValueError):
        tree.extend(0, [3])
