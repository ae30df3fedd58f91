"""Grammar masks: bitmask application, the next-token mask, and the masks of a verify step (chains
and trees, with a draft token the grammar forbids), on SmolLM2's real tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.errors import InvalidRequest
from runtime.messages import StructuredOutput
from tests.support.tokenizer_files import VERSIONS, converted_as
from workers.demo_model import demo_tokenizer_dir
from workers.engine.grammar import GrammarBackend
from workers.engine.sampling import apply_token_bitmask

pytestmark = pytest.mark.unit

VOCAB = 49152
EOS = 2
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
          "required": ["city", "n"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["canonical", *VERSIONS])
def tokenizer_file(request, tmp_path_factory) -> str:
    """The demo tokenizer as this checkout writes it, and as each recorded transformers version's GGUF
    conversion wrote it (4.57 and 5.17: a Sequence decoder llguidance misread as literal text)."""
    try:
        canonical = demo_tokenizer_dir()
    except FileNotFoundError:  # a machine without the demo model's package (the GPU check)
        pytest.skip("SmolLM2's tokenizer is not installed")
    if request.param == "canonical":
        return str(canonical / "tokenizer.json")
    return str(converted_as(canonical, request.param, tmp_path_factory.mktemp("tok")) / "tokenizer.json")


@pytest.fixture(scope="module")
def backend(tokenizer_file) -> GrammarBackend:
    return GrammarBackend(tokenizer_file, VOCAB, [EOS])


@pytest.fixture(scope="module")
def tok(tokenizer_file):
    """Encodes text into the tokens a model would write: without the BOS that the 4.57 conversion's
    post-processor adds."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_file)
    tokenizer.post_processor = None
    return tokenizer


def allowed(row: torch.Tensor) -> set[int]:
    return {t for t in range(VOCAB) if (int(row[t >> 5]) >> (t & 31)) & 1}


def schema_grammar(backend):
    return backend.grammar(StructuredOutput(json_schema=json.dumps(SCHEMA)))


def test_apply_token_bitmask_forbids_exactly_the_zero_bits():
    vocab, gen = 100, torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)  # bit 31 set in some
    logits = torch.randn(3, vocab, generator=gen)
    out = apply_token_bitmask(logits.clone(), bitmask)
    for r in range(3):
        for t in range(vocab):
            bit = (int(bitmask[r, t >> 5]) >> (t & 31)) & 1
            assert (out[r, t] == float("-inf")) == (bit == 0)
            if bit:
                assert out[r, t] == logits[r, t]
    # masks for some rows only: the others are untouched
    part = apply_token_bitmask(logits.clone(), bitmask[:2], rows=[2, 0])
    assert torch.equal(part[1], logits[1])
    assert torch.equal(part[2], logits[2].masked_fill(out[0] == float("-inf"), float("-inf")))
    assert torch.equal(part[0], logits[0].masked_fill(out[1] == float("-inf"), float("-inf")))


def test_next_token_masks_follow_the_committed_tokens(backend, tok):
    g = schema_grammar(backend)
    row = backend.new_masks(1)[0]
    g.fill(row)
    assert allowed(row) == set(tok.encode('{"').ids)  # compact JSON: the object opens with {"
    text = '{"city": "Oslo", "n": 7}'
    ids = tok.encode(text).ids
    assert g.accept(ids)
    g.fill(row)
    assert EOS in allowed(row)  # the object may end here (more digits of n are fine too)
    assert not g.accept(tok.encode("x").ids)  # a letter after the number is refused


def test_verify_masks_of_a_chain_match_stepwise_masks(backend, tok):
    prefix = tok.encode('{"city": "').ids
    drafts = tok.encode('Rome", "n": 12').ids
    g = schema_grammar(backend)
    assert g.accept(prefix)
    rows = backend.new_masks(len(drafts) + 1)
    assert g.fill_draft(rows, drafts) == list(range(len(drafts)))  # every draft is worth verifying
    ref = schema_grammar(backend)
    ref.accept(prefix)
    one = backend.new_masks(1)[0]
    for i in range(len(drafts) + 1):  # row i: the mask after the first i drafts
        ref.fill(one)
        assert torch.equal(rows[i], one), i
        if i < len(drafts):
            ref.accept([drafts[i]])
    g.fill(one)  # the drafts did not move the request's own matcher
    assert torch.equal(rows[0], one)


def test_a_forbidden_draft_token_is_masked_and_nothing_below_it_is_constrained(backend, tok):
    g = schema_grammar(backend)
    [opening], [closing], [key] = tok.encode('{"').ids, tok.encode("}").ids, tok.encode("city").ids
    drafts = [opening, closing, key]  # '{"' then '}': a key must follow, so '}' is forbidden
    rows = backend.new_masks(len(drafts) + 1)
    assert g.fill_draft(rows, drafts) == [0, 1]  # the forbidden draft is verified (rejected), not what follows
    assert opening in allowed(rows[0]) and key in allowed(rows[1])
    assert closing not in allowed(rows[1])  # the target gives the forbidden draft probability 0
    assert bool((rows[2:] == -1).all())  # rows under it are never used: unconstrained


def test_verify_masks_of_a_tree_follow_each_path(backend, tok):
    g = schema_grammar(backend)
    g.accept(tok.encode('{"city": "Oslo", "n": ').ids)
    one, two, x = tok.encode("1").ids[0], tok.encode("2").ids[0], tok.encode("x").ids[0]
    # root -> "1" -> "2"; root -> "x" (forbidden) -> "1"; root -> "2" -> "}"
    close = tok.encode("}").ids[0]
    tokens = [one, x, two, two, one, close]
    parents = [-1, -1, -1, 0, 1, 2]
    rows = backend.new_masks(len(tokens) + 1)
    assert g.fill_draft(rows, tokens, parents) == [0, 1, 2, 3, 5]  # not the child of the forbidden "x"
    ref = backend.new_masks(1)[0]

    def mask_after(path):
        m = schema_grammar(backend)
        m.accept(tok.encode('{"city": "Oslo", "n": ').ids + path)
        m.fill(ref)
        return ref.clone()

    assert torch.equal(rows[0], mask_after([]))
    assert torch.equal(rows[1], mask_after([one]))
    assert x not in allowed(rows[0]) and bool((rows[2] == -1).all()) and bool((rows[5] == -1).all())
    assert torch.equal(rows[3], mask_after([two]))
    assert torch.equal(rows[4], mask_after([one, two]))
    assert torch.equal(rows[6], mask_after([two, close])) and allowed(rows[6]) == {EOS}


def test_regex_and_choice_grammars(backend, tok):
    g = backend.grammar(StructuredOutput(choice=["yes", "no"]))
    row = backend.new_masks(1)[0]
    g.fill(row)
    assert tok.encode("yes").ids[0] in allowed(row) and tok.encode("maybe").ids[0] not in allowed(row)
    g = backend.grammar(StructuredOutput(regex=r"[0-9]{3}"))
    assert g.accept(tok.encode("123").ids)
    g.fill(row)
    assert allowed(row) == {EOS}


@pytest.mark.parametrize(("spec", "words"), [
    (StructuredOutput(json_schema='{"type": "wat"}'), "wat"),
    (StructuredOutput(json_schema="[1, 2]"), "object"),
    (StructuredOutput(regex="[a-"), "regex"),
    (StructuredOutput(json_schema='{"type": "object"}', regex="a"), "exactly one"),
])
def test_a_grammar_that_does_not_compile_is_an_invalid_request(backend, spec, words):
    with pytest.raises(InvalidRequest) as info:
        backend.grammar(spec)
    assert info.value.field == "response_format" and words in str(info.value)


def test_compiled_grammars_are_cached_and_requests_get_their_own_matcher(backend, tok):
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))
    a, b = backend.grammar(spec), backend.grammar(spec)
    a.accept(tok.encode('{"city"').ids)
    ra, rb = backend.new_masks(2)
    a.fill(ra)
    b.fill(rb)
    assert not torch.equal(ra, rb)  # b still expects the opening
