"""Structured outputs on CUDA: the bitmask unpacked on the device masks exactly what the CPU path
masks, and greedy speculation under a grammar (the fused Triton rejection sampler for chains)
equals plain decoding. Skipped without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.messages import SamplingParams, StructuredOutput
from tests.support.tiny_models import tiny_hf_model
from tests.unit.workers.engine.test_spec_engine import run_spec
from workers.engine.engine import EngineConfig
from workers.engine.sampling import apply_token_bitmask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "n", "tags"], "additionalProperties": False}


def test_cuda_bitmask_equals_the_cpu_path():
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, (VOCAB + 31) // 32), dtype=torch.int32, generator=gen)
    logits = torch.randn(7, VOCAB, generator=gen)
    cpu = apply_token_bitmask(logits.clone(), bitmask, rows=[6, 0, 2, 3, 5])
    cuda = apply_token_bitmask(logits.cuda(), bitmask, rows=[6, 0, 2, 3, 5])
    assert torch.equal(cuda.cpu(), cpu)
    assert torch.equal(apply_token_bitmask(logits[:5].cuda(), bitmask).cpu(), apply_token_bitmask(logits[:5].clone(), bitmask))


def test_greedy_speculation_under_a_grammar_on_cuda(tmp_path):
    from tokenizers import Tokenizer

    from workers.demo_model import demo_tokenizer_dir
    from workers.draft.draft_model import DraftModelProposer
    from workers.engine.engine import Engine
    from workers.engine.grammar import GrammarBackend
    from workers.engine.weights import load_model

    try:
        tokenizer_file = demo_tokenizer_dir() / "tokenizer.json"
    except FileNotFoundError:
        pytest.skip("SmolLM2's tokenizer is not here")
    tiny_hf_model("llama", tmp_path / "t", seed=1, vocab=VOCAB, layers=2)
    tiny_hf_model("llama", tmp_path / "d", seed=2, vocab=VOCAB, layers=1)
    tok = Tokenizer.from_file(str(tokenizer_file))
    grammars = GrammarBackend(str(tokenizer_file), VOCAB, [2])
    prompts = {f"r{i}": tok.encode(f"Record number {i} as JSON:").ids for i in range(8)}
    params = SamplingParams(temperature=0, max_tokens=64, structured=StructuredOutput(json_schema=json.dumps(SCHEMA)))
    cfg = EngineConfig(block_size=16, num_blocks=256, max_num_seqs=8)
    model = load_model(tmp_path / "t", device="cuda", dtype=torch.float32, fused=True)
    want = Engine(model, cfg, eos_token_ids=(2,), grammars=grammars).generate(prompts, params)
    for ids in want.values():
        assert ids[-1] == 2 and json.loads(tok.decode(ids[:-1]))
    for tree in (0, 3):  # chains (the Triton sampler), then trees
        engine = Engine(model, cfg, eos_token_ids=(2,), grammars=grammars, num_speculative_tokens=4)
        draft = load_model(tmp_path / "d", device="cuda", dtype=torch.float32, fused=True)
        proposer = DraftModelProposer(draft, num_blocks=256, block_size=16, tree_topk=tree or 1, tree_depth=tree or 0)
        assert run_spec(engine, proposer, prompts, params) == want
