"""Structured outputs stay lossless under speculation: with a JSON-schema grammar, greedy output with
drafts (chains and trees, drafts that know nothing of the grammar) equals plain decoding token for
token (float32, CPU), and sampled output follows the schema too.

A tiny random model over SmolLM2's real vocabulary, so that the grammar sees real tokens.
"""

from __future__ import annotations

import json

import pytest

from runtime.errors import InvalidRequest
from runtime.messages import SamplingParams, StructuredOutput
from tests.support.tiny_models import tiny_hf_model
from tests.unit.workers.engine.test_spec_engine import run_spec
from workers.demo_model import demo_tokenizer_dir
from workers.draft.draft_model import DraftModelProposer
from workers.draft.ngram import NgramProposer
from workers.engine.engine import Engine, EngineConfig
from workers.engine.grammar import GrammarBackend
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit

VOCAB = 49152
EOS = 2
CFG = EngineConfig(block_size=4, num_blocks=1024, max_num_seqs=8, max_num_batched_tokens=256)
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                             "maxItems": 3}},
          "required": ["name", "age", "ok", "tags"], "additionalProperties": False}
STRUCTURED = StructuredOutput(json_schema=json.dumps(SCHEMA))
GREEDY = SamplingParams(temperature=0, max_tokens=64, structured=STRUCTURED)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tokenizers import Tokenizer

    target_dir, draft_dir = tmp_path_factory.mktemp("gtarget"), tmp_path_factory.mktemp("gdraft")
    tiny_hf_model("llama", target_dir, seed=1, vocab=VOCAB, layers=1)
    tiny_hf_model("llama", draft_dir, seed=2, vocab=VOCAB, layers=1)
    try:
        tokenizer_file = demo_tokenizer_dir() / "tokenizer.json"
    except FileNotFoundError:  # a machine without the demo model's package (the GPU check)
        pytest.skip("SmolLM2's tokenizer is not installed")
    tok = Tokenizer.from_file(str(tokenizer_file))
    prompts = {f"r{i}": tok.encode(f"Describe person number {i} as JSON.").ids for i in range(4)}
    return load_model(target_dir), draft_dir, GrammarBackend(str(tokenizer_file), VOCAB, [EOS]), tok, prompts


@pytest.fixture(scope="module")
def greedy_plain(setup):
    """Plain decoding under the grammar (what every speculative run must reproduce)."""
    model, _, grammars, tok, prompts = setup
    want = Engine(model, CFG, eos_token_ids=(EOS,), grammars=grammars).generate(prompts, GREEDY)
    check_schema(tok, want)
    return want


def check_schema(tok, outputs: dict[str, list[int]]) -> None:
    for ids in outputs.values():
        assert ids[-1] == EOS, tok.decode(ids)  # the grammar finished: the only way out is EOS
        assert follows_schema(json.loads(tok.decode(ids[:-1]))), tok.decode(ids)


def follows_schema(obj) -> bool:
    """Whether ``obj`` is valid under :data:`SCHEMA`, written out (the GPU check has no jsonschema)."""
    props = SCHEMA["properties"]
    return (isinstance(obj, dict) and set(obj) == set(SCHEMA["required"])
            and isinstance(obj["name"], str) and len(obj["name"]) <= props["name"]["maxLength"]
            and type(obj["age"]) is int and 0 <= obj["age"] <= 120 and type(obj["ok"]) is bool
            and isinstance(obj["tags"], list) and len(obj["tags"]) <= props["tags"]["maxItems"]
            and all(t in props["tags"]["items"]["enum"] for t in obj["tags"]))


@pytest.mark.parametrize("method", ["ngram", "draft_model", "self_draft_tree"])
def test_greedy_speculation_under_a_grammar_equals_plain_decoding(setup, greedy_plain, method):
    model, draft_dir, grammars, tok, prompts = setup
    proposer = {"ngram": lambda: NgramProposer(1, 3),
                "draft_model": lambda: DraftModelProposer(load_model(draft_dir), num_blocks=512, block_size=4),
                "self_draft_tree": lambda: DraftModelProposer(model, num_blocks=512, block_size=4, tree_topk=3,
                                                              tree_depth=3)}[method]()
    engine = Engine(model, CFG, eos_token_ids=(EOS,), grammars=grammars, num_speculative_tokens=4)
    assert run_spec(engine, proposer, prompts, GREEDY) == greedy_plain
    assert engine.counters[""].num_drafts > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_sampled_speculation_under_a_grammar_follows_the_schema(setup):
    model, draft_dir, grammars, tok, prompts = setup
    engine = Engine(model, CFG, eos_token_ids=(EOS,), grammars=grammars, num_speculative_tokens=3)
    proposer = DraftModelProposer(load_model(draft_dir), num_blocks=512, block_size=4)  # samples its drafts
    params = {rid: SamplingParams(temperature=0.7, seed=i, max_tokens=64, structured=STRUCTURED)
              for i, rid in enumerate(prompts)}
    out = {rid: [] for rid in prompts}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params[rid])
    while engine.has_work():
        inputs = engine.draft_inputs()
        for rid, delta in engine.step({o.seq_id: o for o in proposer.propose(inputs)}):
            out[rid].extend(delta.token_ids)
        proposer.verified(engine.take_verdicts())
        proposer.release(engine.take_released())
    check_schema(tok, out)
    assert engine.counters[""].num_drafts > 0


def test_structured_requests_a_worker_cannot_serve_are_refused(setup):
    model, _, grammars, _, _ = setup
    with pytest.raises(InvalidRequest) as info:
        Engine(model, CFG, eos_token_ids=(EOS,)).validate([1, 2], SamplingParams(structured=STRUCTURED))
    assert info.value.field == "response_format"
    engine = Engine(model, CFG, eos_token_ids=(EOS,), grammars=grammars)
    for bad, field in ((dict(ignore_eos=True), "ignore_eos"), (dict(min_tokens=2), "min_tokens")):
        with pytest.raises(InvalidRequest) as info:
            engine.validate([1, 2], SamplingParams(structured=STRUCTURED, **bad))
        assert info.value.field == field
    # a migrated request resumes the grammar where it stopped; outputs that break it are refused
    with pytest.raises(InvalidRequest) as info:
        engine.add_request("bad", [1, 2], SamplingParams(structured=STRUCTURED), output_ids=[100, 101])
    assert info.value.field == "output_ids"


# --------------------------------------------------------------------------- sampling: χ² against the exact marginals

TINY_CHARS = "abcdefgh{}\":, 0123456789xyz[]"  # token i + 1 is character i; token 0 is EOS
TINY_VOCAB = 32
TINY_PROMPT = [9, 10, 11, 12, 1, 2]
REGEX = StructuredOutput(regex="[a-h]{1,3}")


def tiny_tokenizer(path) -> str:
    """A byte-level tokenizer.json of single characters, so that a 32-token model can follow a grammar."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    byte_char = {b: chr(b) for b in printable}
    byte_char.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in printable)})
    vocab = {"<eos>": 0} | {byte_char[ord(c)]: i + 1 for i, c in enumerate(TINY_CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(path))
    return str(path)


def allowed_ids(grammars: GrammarBackend, prefix: list[int]) -> list[int]:
    g = grammars.grammar(REGEX)
    assert g.accept(prefix)
    row = grammars.new_masks(1)[0]
    g.fill(row)
    return [t for t in range(TINY_VOCAB) if (int(row[t >> 5]) >> (t & 31)) & 1]


def test_sampled_speculation_under_a_grammar_has_the_masked_target_marginals(tmp_path):
    """The first token comes from prefill, the second from the first verify step. Under the grammar
    alone its exact marginal is Σ_x1 p(x1) p(x2 | x1), each p the target's distribution masked to what
    the grammar allows there; a sampling draft model that knows nothing of the grammar proposes."""
    import torch
    import transformers

    from tests.unit.workers.speculation.test_rejection import chi2_pvalue

    tiny_hf_model("llama", tmp_path / "t", seed=21, vocab=TINY_VOCAB, layers=2)
    tiny_hf_model("llama", tmp_path / "d", seed=22, vocab=TINY_VOCAB, layers=1)
    grammars = GrammarBackend(tiny_tokenizer(tmp_path / "tokenizer.json"), TINY_VOCAB, [0])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "t").eval()

    def masked(logits, ids):  # the target's distribution restricted to ``ids``
        out = torch.full_like(logits, float("-inf"))
        out[ids] = logits[ids]
        return out.softmax(-1).double()

    first = allowed_ids(grammars, [])
    with torch.inference_mode():
        p1 = masked(hf(torch.tensor([TINY_PROMPT])).logits[0, -1], first)
        rows = hf(torch.tensor([TINY_PROMPT + [x] for x in first])).logits[:, -1]
    p2 = sum(p1[x] * masked(rows[i], allowed_ids(grammars, [x])) for i, x in enumerate(first))

    cfg = EngineConfig(block_size=4, num_blocks=4096, max_num_seqs=256, max_num_batched_tokens=4096)
    engine = Engine(load_model(tmp_path / "t"), cfg, eos_token_ids=(0,), grammars=grammars,
                        num_speculative_tokens=2)
    proposer = DraftModelProposer(load_model(tmp_path / "d"), num_blocks=4096, block_size=4, max_support=16)
    torch.manual_seed(4321)
    params = SamplingParams(temperature=1.0, max_tokens=3, structured=REGEX)
    firsts, seconds, n = [], [], 1250
    for start in range(0, n, 250):
        out = run_spec(engine, proposer, {str(i): TINY_PROMPT for i in range(start, start + 250)}, params)
        firsts += [t[0] for t in out.values()]
        seconds += [t[1] for t in out.values()]
    assert chi2_pvalue(torch.bincount(torch.tensor(firsts), minlength=TINY_VOCAB), p1) > 1e-4
    assert chi2_pvalue(torch.bincount(torch.tensor(seconds), minlength=TINY_VOCAB), p2) > 1e-4
    counters = engine.counters[""]
    assert counters.num_drafts >= n  # the second token of every request went through a verify step
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens  # accepted and rejected drafts
