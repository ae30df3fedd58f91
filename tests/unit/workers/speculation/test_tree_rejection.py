"""Tree rejection sampling is lossless: χ² goodness of fit of the emitted sequence against the target alone.

The target is a function of the token prefix: prefix -> distribution, stored in a table keyed by a code of
the prefix, so two tree nodes with the same prefix (duplicate siblings) see the same distribution, as a
real target would. Each of N rows is one independent trial: a fresh tree is drafted by really sampling
its tokens from the draft distributions the sampler is told about, the sampler runs once, and the row is
then continued with the target alone up to a fixed length. The joint histogram of those tokens must match
the autoregressive probabilities of the target. A sampler with a 2% error in its final token fails the
same check (``test_the_test_catches_a_two_percent_error``).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.unit.workers.speculation.test_rejection import chi2_pvalue, random_dists as _random_dists
from workers.speculation.payloads import PAD
from workers.speculation.rejection import random_inputs, rejection_sample
from workers.speculation.tree import parent_nodes
from workers.speculation.tree_rejection import child_table, tree_rejection_sample

pytestmark = pytest.mark.unit

N = 200_000  # rows (trials) per χ² test
P_MIN = 1e-3  # seeded, so each test is deterministic; the threshold only sets its strictness


def children(parents: list[int]) -> list[list[int]]:
    """Per node (0 = root, i + 1 = token i): its child token indices, in the order tried."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[p + 1].append(i)
    return out


def random_dists(count: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    return _random_dists(count, vocab, gen, sharpness=1.5)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Ops on [N, small] tensors gain nothing from threads, and lose a lot when the cores are busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sample(dist: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row of dist [B, V] (inverse CDF)."""
    u = torch.rand(dist.shape[0], 1, generator=gen, dtype=torch.float64)
    return (u > dist.double().cumsum(-1)).sum(-1).clamp(max=dist.shape[-1] - 1)


def max_depth(parents: list[int]) -> int:
    depth = [0]  # per node, the root first
    for p in parents:
        depth.append(depth[p + 1] + 1)
    return max(depth)


def full_tree(branching: list[int]) -> list[int]:
    """Parents of the tree with branching[d] children under every node at depth d, breadth first."""
    parents, level = [], [-1]
    for width in branching:
        nxt = []
        for p in level:
            for _ in range(width):
                parents.append(p)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents


# An EAGLE-like irregular tree: 3 root children, the first with 2 children, the second with 1; depth 3.
IRREGULAR = [-1, -1, -1, 0, 0, 1, 3, 3, 5]


class PrefixModel:
    """Target (P) and draft (Q) distributions as functions of the prefix, keyed by code(prefix) % size."""

    def __init__(self, vocab: int, gen: torch.Generator, size: int = 4099):
        self.vocab, self.size = vocab, size
        self.P = random_dists(size, vocab, gen)
        # A draft close to the target (as a real one is) but wrong in places.
        self.Q = 0.5 * self.P + 0.5 * random_dists(size, vocab, gen)

    def extend(self, code: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return code * (self.vocab + 1) + token + 1  # distinct for distinct prefixes (the empty prefix is 0)

    def p(self, code: torch.Tensor) -> torch.Tensor:
        return self.P[code % self.size]

    def q(self, code: torch.Tensor) -> torch.Tensor:
        return self.Q[code % self.size]

    def sequence_probs(self, length: int) -> torch.Tensor:
        """[V**length] probability of every token sequence under the target alone (lexicographic order)."""
        out = []
        for seq in itertools.product(range(self.vocab), repeat=length):
            prob, code = 1.0, torch.tensor(0)
            for t in seq:
                prob *= float(self.p(code)[t])
                code = self.extend(code, torch.tensor(t))
            out.append(prob)
        return torch.tensor(out, dtype=torch.float64)


def draft_tree(model: PrefixModel, parents: list[int], method: str, rows: int, gen: torch.Generator):
    """Draft one tree per row by sampling its tokens; rows keep a random prefix of the tree (half all of it).

    method: "iid" (siblings drawn with replacement from q), "without" (each sibling from q minus the
    earlier ones, renormalized) or "topk" (the k most likely tokens of q, no distributions sent).
    Returns (target_probs [B, N+1, V], draft_tokens [B, N], parent_nodes [B, N], draft_probs [B, N, V] | None).
    """
    num, vocab = len(parents), model.vocab
    codes = torch.zeros(rows, num + 1, dtype=torch.long)  # prefix code of each node (root: empty prefix)
    tokens = torch.zeros(rows, num, dtype=torch.long)
    qs = torch.zeros(rows, num, vocab)
    batch = torch.arange(rows)
    for node, kids in enumerate(children(parents)):
        if not kids:
            continue
        q = model.q(codes[:, node])  # [B, V]
        top = q.topk(len(kids), -1).indices
        for j, i in enumerate(kids):
            if method == "topk":
                x = top[:, j]
                q_j = torch.nn.functional.one_hot(x, vocab).float()
            else:
                q_j = q / q.sum(-1, keepdim=True)
                x = sample(q_j, gen)
                if method == "without":
                    q = q.clone()
                    q[batch, x] = 0.0
            tokens[:, i], qs[:, i] = x, q_j
            codes[:, i + 1] = model.extend(codes[:, node], x)
    keep = torch.where(torch.rand(rows, generator=gen) < 0.5, num, torch.randint(0, num + 1, (rows,), generator=gen))
    pad = torch.arange(num)[None, :] >= keep[:, None]
    parent = parent_nodes([parents], num).expand(rows, num).masked_fill(pad, -1)
    return model.p(codes), tokens.masked_fill(pad, PAD), parent, None if method == "topk" else qs


def run_trials(model, parents, method, gen, sampler=tree_rejection_sample, rows=N) -> torch.Tensor:
    """[rows, D+1] tokens: what each row's one verify step emitted, continued with the target alone."""
    target, tokens, parent, qs = draft_tree(model, parents, method, rows, gen)
    uniforms = torch.rand(rows, len(parents), generator=gen)
    exponentials = torch.empty(rows, model.vocab).exponential_(generator=gen)
    greedy = torch.zeros(rows, dtype=torch.bool)
    emitted, _, accepted = sampler(target, tokens, parent, qs, greedy, uniforms, exponentials)
    length = max_depth(parents) + 1
    out = torch.zeros(rows, length, dtype=torch.long)
    code = torch.zeros(rows, dtype=torch.long)
    for j in range(length):
        fresh = sample(model.p(code), gen)
        out[:, j] = torch.where(j <= accepted, emitted[:, min(j, emitted.shape[1] - 1)], fresh)
        code = model.extend(code, out[:, j])
    return out


def joint_pvalue(out: torch.Tensor, model: PrefixModel) -> float:
    vocab, length = model.vocab, out.shape[1]
    cell = (out * vocab ** torch.arange(length - 1, -1, -1)).sum(-1)
    return chi2_pvalue(torch.bincount(cell, minlength=vocab**length), model.sequence_probs(length))


SHAPES = {
    "depth1-b4": full_tree([4]),
    "depth2-b3x2": full_tree([3, 2]),
    "depth3-b2x2x2": full_tree([2, 2, 2]),
    "depth3-irregular": IRREGULAR,
}


def joint_case(shape: str, seed: int) -> tuple[list[int], PrefixModel, int, torch.Generator]:
    """Tree, model and rows of one joint test: V = 4, or V = 3 and twice the rows at depth 3 (81 cells)."""
    parents = SHAPES[shape]
    deep = max_depth(parents) >= 3
    gen = torch.Generator().manual_seed(seed)
    return parents, PrefixModel(3 if deep else 4, gen), 2 * N if deep else N, gen


@pytest.mark.parametrize("method", ["iid", "without", "topk"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_emitted_sequence_follows_the_target(method, shape):
    """Joint distribution of the first D+1 tokens: i.i.d. siblings, without replacement, and top-k one-hot."""
    parents, model, rows, gen = joint_case(shape, sum(map(ord, method + shape)))
    p = joint_pvalue(run_trials(model, parents, method, gen, rows=rows), model)
    assert p > P_MIN, f"χ² p-value {p:.2e}"


@pytest.mark.parametrize(("vocab", "branching"), [(4, [2, 2]), (8, [4, 2]), (32, [3])])
@pytest.mark.parametrize("method", ["iid", "without", "topk"])
def test_first_token_follows_the_target(vocab, branching, method):
    """Marginal of the first emitted token over larger vocabularies."""
    gen = torch.Generator().manual_seed(sum(map(ord, f"{method}-{vocab}")))
    model = PrefixModel(vocab, gen)
    out = run_trials(model, full_tree(branching), method, gen, rows=N // 2)
    p = chi2_pvalue(torch.bincount(out[:, 0], minlength=vocab), model.p(torch.tensor(0)))
    assert p > P_MIN, f"χ² p-value {p:.2e}"


def test_iid_siblings_do_repeat_tokens():
    """The i.i.d. χ² cases really exercise duplicate siblings (same prefix, same target distribution)."""
    gen = torch.Generator().manual_seed(0)
    _, tokens, parent, _ = draft_tree(PrefixModel(4, gen), full_tree([4]), "iid", 10_000, gen)
    full = (parent >= 0).all(-1)
    repeats = (tokens[:, :, None] == tokens[:, None, :]).sum((-1, -2)) > 4  # more equal pairs than the diagonal
    assert repeats[full].float().mean() > 0.5


@pytest.mark.parametrize(("shape", "method"), [("depth1-b4", "iid"), ("depth2-b3x2", "topk"),
                                             ("depth3-irregular", "without")])
def test_the_test_catches_a_two_percent_error(shape, method):
    """A sampler whose final token comes 2% of the time from a wrong distribution fails the same χ² check.

    The leak is applied to the correct sampler's output, so the error is exactly "final token ~ 0.98 r + 0.02 w".
    """
    parents, model, rows, gen = joint_case(shape, 7)
    wrong = random_dists(1, model.vocab, gen)[0]

    def leaky(*args):
        tokens, path, accepted = tree_rejection_sample(*args)
        batch = torch.arange(tokens.shape[0])
        leak = torch.rand(tokens.shape[0], generator=gen) < 0.02
        mixed = torch.where(leak, sample(wrong.expand(len(batch), -1), gen), tokens[batch, accepted])
        tokens[batch, accepted] = mixed
        return tokens, path, accepted

    p = joint_pvalue(run_trials(model, parents, method, gen, sampler=leaky, rows=rows), model)
    assert p < P_MIN, f"χ² p-value {p:.2e}"


@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("longest", [5, 3])
def test_a_chain_is_the_chain_sampler(with_probs, longest):
    """One child per node: the same tokens and acceptances as rejection_sample, bit for bit, greedy rows mixed in."""
    gen = torch.Generator().manual_seed(longest + 10 * with_probs)
    batch, gamma, vocab = 4000, 5, 6
    target = random_dists(batch * (gamma + 1), vocab, gen).view(batch, gamma + 1, vocab)
    q = 0.5 * target[:, :gamma] + 0.5 * random_dists(batch * gamma, vocab, gen).view(batch, gamma, vocab)
    drafts = sample(q.reshape(-1, vocab), gen).view(batch, gamma)
    greedy = torch.rand(batch, generator=gen) < 0.5
    # Greedy rows mostly propose the target's argmax, so they too get deep into the chain.
    follow = greedy[:, None] & (torch.rand(batch, gamma, generator=gen) < 0.8)
    drafts = torch.where(follow, target[:, :gamma].argmax(-1), drafts)
    num_draft = torch.randint(0, longest + 1, (batch,), generator=gen)
    pad = torch.arange(gamma)[None, :] >= num_draft[:, None]
    drafts = drafts.masked_fill(pad, PAD)
    parent = torch.arange(gamma).expand(batch, gamma).masked_fill(pad, -1)  # node i + 1 follows node i
    uniforms, exponentials = random_inputs(batch, gamma, vocab, [gen] * batch)
    draft_probs = q if with_probs else None

    chain, chain_accepted = rejection_sample(target, drafts, draft_probs, num_draft, greedy, uniforms, exponentials)
    tokens, path, accepted = tree_rejection_sample(target, drafts, parent, draft_probs, greedy, uniforms, exponentials)

    assert tokens.shape == (batch, longest + 1) and path.shape == (batch, longest)
    assert torch.equal(accepted, chain_accepted)
    assert torch.equal(tokens, chain[:, : longest + 1]) and (chain[:, longest + 1 :] == PAD).all()
    steps = torch.arange(longest).expand(batch, longest)
    assert torch.equal(path, steps.masked_fill(steps >= accepted[:, None], PAD))
    for rows in (greedy, ~greedy):  # both kinds of row both stop early and run to the end
        assert (accepted[rows] < num_draft[rows]).any() and (accepted[rows] == num_draft[rows]).any()
        assert (accepted[rows] >= 2).any()


def one_hot_dists(argmaxes: list[int], vocab: int) -> torch.Tensor:
    """[len, V]: 0.6 on each argmax, the rest spread evenly."""
    out = torch.full((len(argmaxes), vocab), 0.4 / (vocab - 1))
    out[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 0.6
    return out


def test_greedy_follows_the_argmax_through_later_siblings():
    """Greedy rows accept the first child equal to the argmax (3rd sibling, then 2nd, then 3rd); q is ignored."""
    vocab = 10
    parents = [-1, -1, -1, 2, 2, 0, 4, 4, 4]  # node 3 (token 2) -> node 5 (token 4) -> node 9 (token 8)
    drafts = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9],
                           [1, 2, 3, 4, 5, 6, 7, 8, 9],
                           [3, 2, 3, 4, 5, 6, 7, 8, 9]])  # duplicate of the argmax: the first one wins
    #                      node: 0  1  2  3  4  5  6  7  8  9
    argmaxes = torch.tensor([[3, 0, 0, 5, 0, 9, 0, 0, 0, 0],
                             [3, 0, 0, 5, 0, 4, 0, 0, 0, 0],  # node 5's argmax is none of its children
                             [3, 7, 0, 5, 0, 9, 0, 0, 0, 0]])
    target = torch.stack([one_hot_dists(row.tolist(), vocab) for row in argmaxes])
    # Draft distributions and uniforms that reject every token of a sampled row (u q(x) = 0.999 > p(x)).
    draft_probs = torch.nn.functional.one_hot(drafts, vocab).float()
    args = (parent_nodes([parents] * 3, 9), draft_probs)
    draws = (torch.full((3, 9), 0.999), torch.ones(3, vocab))
    tokens, path, accepted = tree_rejection_sample(target, drafts, *args, torch.ones(3, dtype=torch.bool), *draws)
    assert accepted.tolist() == [3, 2, 1]
    assert path.tolist() == [[2, 4, 8], [2, 4, PAD], [0, PAD, PAD]]
    assert tokens.tolist() == [[3, 5, 9, 0], [3, 5, 4, PAD], [3, 7, PAD, PAD]]
    _, _, sampled = tree_rejection_sample(target, drafts, *args, torch.zeros(3, dtype=torch.bool), *draws)
    assert sampled.tolist() == [0, 0, 0]


def test_rows_without_drafts_emit_one_token_of_the_root():
    vocab = 5
    gen = torch.Generator().manual_seed(3)
    target = random_dists(4 * 4, vocab, gen).view(4, 4, vocab)
    drafts = torch.tensor([[0, 1, 2], [PAD, PAD, PAD], [PAD, PAD, PAD], [3, 4, PAD]])
    parent = parent_nodes([[-1, 0, 0], [], [], [-1, -1]], 3)
    greedy = torch.tensor([False, False, True, False])
    uniforms, exponentials = random_inputs(4, 3, vocab, [gen] * 4)
    tokens, path, accepted = tree_rejection_sample(target, drafts, parent, None, greedy, uniforms, exponentials)
    assert tokens.shape == (4, 3) and accepted[1:3].tolist() == [0, 0] and (path[1:3] == PAD).all()
    assert tokens[1].tolist() == [int((target[1, 0] / exponentials[1]).argmax()), PAD, PAD]
    assert tokens[2].tolist() == [int(target[2, 0].argmax()), PAD, PAD]

    # A batch with no drafts at all emits one token per row.
    for width in (0, 3):
        none = torch.full((4, width), PAD)
        tokens, path, accepted = tree_rejection_sample(target, none, none, None, greedy, uniforms[:, :width],
                                                       exponentials)
        assert tokens.shape == (4, 1) and path.shape == (4, 0) and (accepted == 0).all()
        race = (target[:, 0] / exponentials).argmax(-1)
        assert torch.equal(tokens[:, 0], torch.where(greedy, target[:, 0].argmax(-1), race))


def test_a_token_the_residual_excludes_is_never_accepted():
    """r(x) = 0 rejects x whatever u and q(x); q(x) = 0 < r(x) accepts it (min(1, r/q) = 1)."""
    vocab, rows = 4, 1000
    gen = torch.Generator().manual_seed(5)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    target = p.expand(rows, 3, vocab)
    parent = parent_nodes([[-1, -1]], 2).expand(rows, 2)
    exponentials = torch.empty(rows, vocab).exponential_(generator=gen)
    u = torch.tensor([0.99, 0.0]).expand(rows, 2)

    # One-hot siblings [0, 0]: the first is rejected (0.99 ≥ 0.5), after which r(0) = 0 rejects the second too.
    tokens, _, accepted = tree_rejection_sample(target, torch.tensor([[0, 0]]).expand(rows, 2), parent, None,
                                                torch.zeros(rows, dtype=torch.bool), u, exponentials)
    assert (accepted == 0).all() and (tokens[:, 0] != 0).all() and (tokens[:, 0] != 3).all()
    assert set(tokens[:, 0].tolist()) == {1, 2}

    # q = p and a token with p = q = 0: rejected without a NaN; r − q = 0 keeps r = p for the final token.
    q = p.expand(rows, 2, vocab)
    tokens, _, accepted = tree_rejection_sample(target, torch.tensor([[3, 3]]).expand(rows, 2), parent, q,
                                                torch.zeros(rows, dtype=torch.bool), u * 0, exponentials)
    assert (accepted == 0).all() and torch.equal(tokens[:, 0], (p / exponentials).argmax(-1))

    # q(x) = 0 < r(x): min(1, r/q) = 1 accepts, as rejection_sample does (the draft could not have drawn x).
    q = torch.tensor([0.0, 0.5, 0.5, 0.0]).expand(rows, 2, vocab)
    tokens, _, accepted = tree_rejection_sample(target, torch.tensor([[0, 1]]).expand(rows, 2), parent, q,
                                                torch.zeros(rows, dtype=torch.bool), u, exponentials)
    assert (accepted == 1).all() and (tokens[:, 0] == 0).all()


def test_child_table():
    children_of, depth = child_table(parent_nodes([[-1, -1, 0, 1, 0], [-1, 0]], 5))
    assert children_of.tolist() == [[[1, 2], [3, 5], [4, -1], [-1, -1], [-1, -1], [-1, -1]],
                                    [[1, -1], [2, -1], [-1, -1], [-1, -1], [-1, -1], [-1, -1]]]
    assert depth.tolist() == [[0, 1, 1, 2, 2, 2], [0, 1, 2, 0, 0, 0]]
