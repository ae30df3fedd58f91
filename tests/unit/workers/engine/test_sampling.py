"""Sampling maths: greedy, top-k/top-p masks, χ² goodness of fit, seeded reproducibility."""

import pytest
import torch

from workers.engine.sampling import argmax_rows, apply_top_k_top_p, logprobs_of, sample, temper

pytestmark = pytest.mark.unit

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])


def _expected(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The target distribution written out by hand: temperature, keep top-k, keep the nucleus."""
    p = (LOGITS / temperature).softmax(-1)
    keep = torch.zeros(6, dtype=torch.bool)
    keep[: top_k or 6] = True  # LOGITS is sorted, so the top-k are the first k
    q = torch.where(keep, p, 0.0)
    q = q / q.sum()
    mass = 0.0
    for i in range(6):  # smallest prefix whose mass reaches top_p
        if mass >= top_p:
            keep[i] = False
        mass += float(q[i])
    q = torch.where(keep, q, 0.0)
    return q / q.sum()


def test_greedy_is_argmax_and_needs_no_rng():
    logits = torch.randn(5, 50)
    out = sample(logits, [True] * 5, [None] * 5)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_top_k_top_p_mask():
    masked = apply_top_k_top_p(LOGITS[None].clone(), torch.tensor([3]), torch.tensor([1.0]))
    assert torch.isfinite(masked[0]).tolist() == [True, True, True, False, False, False]
    masked = apply_top_k_top_p(LOGITS[None].clone(), torch.tensor([0]), torch.tensor([0.01]))
    assert torch.isfinite(masked[0]).tolist() == [True] + [False] * 5  # the top token always stays


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8), (1.0, 5, 0.9)])
def test_sampler_matches_target_distribution_chi_square(temperature, top_k, top_p):
    n = 20000
    torch.manual_seed(1234)
    logits = LOGITS.repeat(n, 1)
    scores = temper(logits, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p))
    tokens = sample(scores, [False] * n, [None] * n)
    observed = torch.bincount(tokens, minlength=6).double()
    expected = _expected(temperature, top_k, top_p).double() * n
    support = expected > 0
    assert observed[~support].sum() == 0  # nothing outside top-k / nucleus
    chi2 = float(((observed[support] - expected[support]) ** 2 / expected[support]).sum())
    dof = int(support.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(chi2 / 2)))
    assert p_value > 1e-3, (chi2, dof, observed.tolist(), expected.tolist())


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(4, 100)
    temp, k, p = torch.ones(4), torch.zeros(4, dtype=torch.long), torch.ones(4)

    def run(rows):
        gens = [torch.Generator().manual_seed(7) for _ in rows]
        return [sample(temper(logits[rows], temp[rows], k[rows], p[rows]), [False] * len(rows), gens).tolist()
                for _ in range(3)]

    alone = run([2])
    together = run([0, 1, 2, 3])
    assert [draw[0] for draw in alone] == [draw[2] for draw in together]


def test_min_p_keeps_tokens_near_the_top():
    scores = temper(LOGITS[None], torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1), torch.tensor([0.3]))
    p = LOGITS.softmax(-1)
    assert torch.isfinite(scores[0]).tolist() == (p >= 0.3 * p.max()).tolist()


def test_logprobs():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    chosen, top_ids, top_vals = logprobs_of(logits, torch.tensor([1]), 2)
    assert chosen.item() == pytest.approx(torch.log(torch.tensor(0.25)).item())
    assert top_ids.tolist()[0][0] == 0 and top_vals.shape == (1, 2)


def test_argmax_rows_is_torchs_argmax_exactly():
    gen = torch.Generator().manual_seed(0)
    vocab = 49152
    x = torch.randn(6, vocab, generator=gen)
    x[0, 100] = x[0, 9000] = 50.0  # a tie across blocks: the first
    x[1, 130] = x[1, 140] = 50.0  # a tie within a block: the first
    x[2, 5000] = x[2, 7000] = float("nan")  # NaN counts as the maximum, the first one
    x[3] = float("-inf")  # a row all forbidden: index 0, as torch says
    x[4] = 0.0
    x[4, 77] = -0.0  # signed zeros are equal
    x[5, -1] = 60.0  # the very last token
    for scores in (x, x[1:3], torch.randn(9, vocab, generator=gen), x.t().contiguous().t()):  # the last not contiguous
        assert torch.equal(argmax_rows(scores), scores.argmax(-1))
    assert torch.equal(argmax_rows(x[:1]), x[:1].argmax(-1))  # one row, and an odd vocabulary: torch's own
    odd = torch.randn(4, 1000, generator=gen)
    assert torch.equal(argmax_rows(odd), odd.argmax(-1))
