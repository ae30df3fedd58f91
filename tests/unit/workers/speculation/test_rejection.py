"""Rejection sampling is lossless: χ² goodness of fit of emitted tokens against the target alone.

Each test runs N independent sequences as one batch through repeated speculative rounds. Position j
of every sequence has its own target distribution P[j] and draft distribution Q[j], so the tokens a
sequence emits at output positions 0, 1, 2, ... must be distributed as P[0], P[1], P[2], ... no
matter how rounds split them. A sampler with a 2% error is rejected by the same test (see
``test_the_test_catches_a_two_percent_error``).
"""

from __future__ import annotations

import pytest
import torch

from workers.speculation.rejection import PAD, random_inputs, rejection_sample, sparse_to_dense

pytestmark = pytest.mark.unit

N = 20_000
POSITIONS = 4  # output positions checked per sequence
P_MIN = 1e-4  # seeded, so each test is deterministic; the threshold only sets its strictness


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson χ² test of observed counts against expected probabilities (bins with tiny mass pooled)."""
    n = counts.sum()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def random_dists(count: int, vocab: int, gen: torch.Generator, sharpness: float = 1.0) -> torch.Tensor:
    logits = torch.randn(count, vocab, generator=gen, dtype=torch.float64) * sharpness
    return torch.softmax(logits, -1).float()


def simulate(P, Q, gamma: int, with_probs: bool, gen: torch.Generator, sampler=rejection_sample) -> torch.Tensor:
    """Emitted tokens [N, POSITIONS] of N sequences run through speculative rounds."""
    length, vocab = P.shape
    out = torch.full((N, POSITIONS), PAD, dtype=torch.long)
    emitted = torch.zeros(N, dtype=torch.long)
    while int(emitted.min()) < POSITIONS:
        idx = (emitted[:, None] + torch.arange(gamma + 1)[None, :]).clamp(max=length - 1)  # [N, G+1]
        target = P[idx]  # [N, G+1, V]
        draft_dist = Q[idx[:, :gamma]]  # [N, G, V]
        drafts = torch.multinomial(draft_dist.reshape(-1, vocab), 1, generator=gen).view(N, gamma)
        if not with_probs:
            draft_dist = None
        uniforms = torch.empty(N, gamma).uniform_(generator=gen)
        exps = torch.empty(N, vocab).exponential_(generator=gen)
        tokens, accepted = sampler(target, drafts, draft_dist, torch.full((N,), gamma), torch.zeros(N, dtype=torch.bool), uniforms, exps)
        for k in range(gamma + 1):
            write = (k <= accepted) & (emitted + k < POSITIONS)
            rows = write.nonzero().squeeze(-1)
            out[rows, emitted[rows] + k] = tokens[rows, k]
        emitted = emitted + accepted + 1
    return out


def assert_lossless(out: torch.Tensor, P: torch.Tensor) -> None:
    vocab = P.shape[1]
    for j in range(POSITIONS):
        counts = torch.bincount(out[:, j], minlength=vocab)
        p = chi2_pvalue(counts, P[j])
        assert p > P_MIN, f"position {j}: χ² p-value {p:.2e}"


@pytest.mark.parametrize("vocab", [2, 13, 64])
@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("with_probs", [True, False])
def test_emitted_tokens_follow_the_target_distribution(vocab, gamma, with_probs):
    gen = torch.Generator().manual_seed(1000 * vocab + 10 * gamma + with_probs)
    length = POSITIONS + gamma + 1
    P = random_dists(length, vocab, gen, sharpness=1.5)
    # A draft that is close to the target (as a real one is) but wrong in places.
    Q = 0.6 * P + 0.4 * random_dists(length, vocab, gen, sharpness=1.5)
    assert_lossless(simulate(P, Q, gamma, with_probs, gen), P)


def test_the_test_catches_a_two_percent_error():
    """A sampler that leaks 2% of the draft distribution into its output fails the same χ² check."""
    gen = torch.Generator().manual_seed(7)
    vocab, gamma = 13, 3
    P = random_dists(POSITIONS + gamma + 1, vocab, gen, sharpness=1.5)
    Q = random_dists(POSITIONS + gamma + 1, vocab, gen, sharpness=1.5)

    def biased(target, *args):
        return rejection_sample(0.98 * target + 0.02 * Q[: target.shape[1]].expand_as(target), *args)

    out = simulate(P, Q, gamma, True, gen, sampler=biased)
    pvalues = [chi2_pvalue(torch.bincount(out[:, j], minlength=vocab), P[j]) for j in range(POSITIONS)]
    assert min(pvalues) < P_MIN


def test_greedy_accepts_exactly_the_matching_prefix_then_emits_argmax():
    vocab = 10
    target = torch.zeros(2, 4, vocab)
    for b, argmaxes in enumerate([[3, 4, 5, 6], [1, 2, 3, 4]]):
        for i, t in enumerate(argmaxes):
            target[b, i, t] = 0.9
            target[b, i, (t + 1) % vocab] = 0.1
    drafts = torch.tensor([[3, 4, 5], [1, 9, 3]])
    tokens, accepted = rejection_sample(target, drafts, None, torch.tensor([3, 3]), torch.tensor([True, True]),
                                        torch.zeros(2, 3), torch.ones(2, vocab))
    assert accepted.tolist() == [3, 1]
    assert tokens.tolist() == [[3, 4, 5, 6], [1, 2, PAD, PAD]]


def test_per_row_gamma_and_gamma_zero():
    vocab = 5
    target = torch.softmax(torch.randn(3, 3, vocab, generator=torch.Generator().manual_seed(0)), -1)
    drafts = torch.tensor([[target[0, 0].argmax(), target[0, 1].argmax()], [target[1, 0].argmax(), PAD], [PAD, PAD]])
    tokens, accepted = rejection_sample(target, drafts, None, torch.tensor([2, 1, 0]), torch.ones(3, dtype=torch.bool),
                                        torch.zeros(3, 2), torch.ones(3, vocab))
    assert accepted.tolist() == [2, 1, 0]
    assert tokens[2].tolist() == [int(target[2, 0].argmax()), PAD, PAD]
    assert tokens[1, 1] == target[1, 1].argmax() and tokens[1, 2] == PAD


def test_sparse_to_dense():
    dense = sparse_to_dense(torch.tensor([[2, 0, -1]]), torch.tensor([[0.7, 0.3, 0.0]]), 4)
    assert dense.tolist() == [[pytest.approx(0.3), 0.0, pytest.approx(0.7), 0.0]]


def test_random_inputs_are_reproducible_per_row_seed():
    a = random_inputs(2, 3, 7, [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)])
    b = random_inputs(2, 3, 7, [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)])
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0][0], a[0][1])
