"""The Triton rejection kernel gives exactly the torch function's outputs (CPU: TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_cpu import interpreted
from workers.speculation.rejection import rejection_sample



@pytest.fixture(scope="module")
def rejection_sample_triton():
    # Triton is a dependency on Linux: no skip. Its interpreter for this module's tests, not the session's.
    with interpreted("workers.speculation.triton_rejection") as [module]:
        yield module.rejection_sample_triton

pytestmark = pytest.mark.unit
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(batch, gamma, vocab, with_probs, seed):
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(batch, gamma + 1, vocab, generator=gen) * 2, -1)
    draft = torch.softmax(torch.randn(batch, gamma, vocab, generator=gen) * 2, -1) if gamma else torch.zeros(batch, 0, vocab)
    tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).view(batch, gamma) if gamma else torch.zeros(batch, 0, dtype=torch.long)
    # Some greedy rows draft the target's argmax so that acceptance paths are exercised.
    greedy = torch.arange(batch) % 3 == 0
    if gamma:
        tokens[greedy] = torch.where(torch.rand(int(greedy.sum()), gamma, generator=gen) < 0.7,
                                     target[greedy, :gamma].argmax(-1), tokens[greedy])
    num_draft = torch.randint(0, gamma + 1, (batch,), generator=gen)
    tokens = torch.where(torch.arange(gamma)[None, :] < num_draft[:, None], tokens, torch.full_like(tokens, -1))
    uniforms = torch.rand(batch, gamma, generator=gen)
    exps = torch.empty(batch, vocab).exponential_(generator=gen)
    args = (target, tokens, draft if with_probs else None, num_draft, greedy, uniforms, exps)
    return [a.to(DEVICE) if a is not None else None for a in args]


@pytest.mark.parametrize("gamma", [0, 1, 3, 5])
@pytest.mark.parametrize("vocab", [7, 50])
@pytest.mark.parametrize("with_probs", [True, False])
def test_kernel_matches_torch(gamma, vocab, with_probs, rejection_sample_triton):
    args = make_case(12, gamma, vocab, with_probs, seed=gamma * 100 + vocab)
    want_tokens, want_acc = rejection_sample(*args)
    got_tokens, got_acc = rejection_sample_triton(*args, block_v=16)
    assert torch.equal(got_acc.cpu(), want_acc.cpu())
    assert torch.equal(got_tokens.cpu(), want_tokens.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_matches_torch_at_real_vocab_size_on_gpu(rejection_sample_triton):
    args = make_case(64, 5, 49152, True, seed=1)
    want = rejection_sample(*args)
    got = rejection_sample_triton(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
