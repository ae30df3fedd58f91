"""The prompt bank is seeded, varied and apart from the hand-written sets; the token corpus the
target's replies go into resumes shard by shard, and ``tandem train-draft --data-from`` trains on it."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.unit.workers.draft.test_train import _quiet, tiny_target  # noqa: F401 (a fixture)
from workers.draft.train.bank import KINDS, bank_conversation, kind_of
from workers.draft.train.corpus import check_manifest, read_shard, shard_path, shard_paths
from workers.draft.train.gen_tokens import GenConfig, build_engine, generate
from workers.draft.train.trainer import TrainConfig, train
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit

PROMPTS = Path(__file__).resolve().parents[4] / "bench" / "prompts"
HAND_WRITTEN = ("natural_chat.jsonl", "natural_chat_2.jsonl")


def _user_turns(conv: dict) -> list[str]:
    return [m["content"] for m in conv.get("messages", conv.get("writer", [])) if m["role"] == "user"]


def _grams(text: str, n: int = 4) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_the_bank_is_seeded_and_varied():
    convs = [bank_conversation(0, i) for i in range(3000)]
    assert convs[:50] == [bank_conversation(0, i) for i in range(50)]
    assert convs[:50] != [bank_conversation(1, i) for i in range(50)]
    kinds = Counter(kind_of(0, i) for i in range(3000))
    assert set(kinds) == {k for k, _ in KINDS}
    first = [_user_turns(c)[0] for c in convs if "messages" in c]
    assert len(set(first)) >= 0.95 * len(first)  # compositional: almost no repeats
    assert sum(c["messages"][0]["role"] == "system" for c in convs if "messages" in c) > 0.15 * len(first)
    assert sum(bool(c["follow_ups"]) for c in convs) > 0.2 * len(convs)
    assert any(len(c["follow_ups"]) == 2 for c in convs)
    assert any(m["role"] == "assistant" for c in convs if "messages" in c for m in c["messages"])  # earlier turns
    assert sum("writer" in c for c in convs) > 0.03 * len(convs)  # self-instruct
    assert any(t != t.lower() for t in first) and any(t == t.lower() for t in first)  # voices
    assert any("```" in t or "def " in t for t in first) and any("JSON" in t for t in first)


def test_no_hand_written_prompt_is_in_the_bank():
    """Neither hand-written set, nor a close paraphrase: no bank user turn shares half of a held-out
    prompt's word 4-grams (the sets' own prompts are apart from each other too)."""
    held, sets = {}, []
    for name in HAND_WRITTEN:
        sets.append({t for line in (PROMPTS / name).read_text().splitlines() for t in _user_turns(json.loads(line))})
        held.update((text, _grams(text)) for text in sets[-1])
    assert len(held) >= 100 and not sets[0] & sets[1]
    seen = {}
    for i in range(6000):
        for text in _user_turns(bank_conversation(0, i)):
            assert text not in held
            seen[text] = _grams(text)
    for text, grams in held.items():
        for other, other_grams in seen.items():
            assert len(grams & other_grams) < max(2, 0.5 * len(grams)), (text, other)


def test_corpus_shards_resume_and_train_a_head(tiny_target, tmp_path):  # noqa: F811
    out = tmp_path / "corpus"
    cfg = GenConfig(target=str(tiny_target), out=str(out), shard_size=3, max_shards=3, batch=4, max_tokens=6,
                    max_len=256, sampled_fraction=0.5)
    model = load_model(tiny_target, max_positions=256)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    totals = generate(cfg, build_engine(model, cfg.batch, cfg.max_len), tok, model.cfg.vocab_size)
    assert totals["shards"] == 3 and [p.name for p in shard_paths(out)] == [f"shard_{k:05d}.npz" for k in range(3)]
    shards = {k: read_shard(shard_path(out, k)) for k in range(3)}
    for k, convs in shards.items():
        assert all(k * 3 <= c.index < (k + 1) * 3 for c in convs)
        for c in convs:
            first = c.mask.index(True)
            assert first > 0 and sum(c.mask) >= 2  # a prompt, then the target's reply tokens
            assert all(0 <= t < model.cfg.vocab_size for t in c.tokens)
    assert sum(len(v) for v in shards.values()) >= 6
    with np.load(shard_path(out, 0)) as z:
        assert z["tokens"].dtype == np.uint16 and "hidden" not in z

    # killed mid-shard: a stale temporary file, shard 1 missing; the rerun makes shard 1 only
    before = shard_path(out, 0).stat().st_mtime_ns
    shard_path(out, 1).unlink()
    (out / "shard_00001.npz.tmp").write_bytes(b"partial")
    again = generate(replace(cfg, max_shards=1, batch=2), build_engine(model, 2, 256), tok,
                     model.cfg.vocab_size)
    assert again["shards"] == 1 and shard_path(out, 0).stat().st_mtime_ns == before
    assert [c.index for c in read_shard(shard_path(out, 1))] == [c.index for c in shards[1]]
    assert not list(out.glob("*.tmp"))
    with pytest.raises(ValueError, match="max_tokens"):
        check_manifest(out, replace(cfg, max_tokens=7).manifest(model.cfg.vocab_size))

    # train-draft on the corpus: hidden states recomputed, shard 0 held out for evaluation
    head = tmp_path / "head"
    metrics = train(TrainConfig(target=str(tiny_target), out=str(head), data_from=str(out), eval_prompts=2,
                                max_len=256, draft_vocab=512, steps=2, epochs=1, batch_tokens=256, warmup=1,
                                threads=1, dtype="float32"), progress=_quiet)
    assert metrics["eval_sequences"] == len(shards[0]) and metrics["acceptance_length"] is not None
    assert metrics["train_sequences"] == len(shards[1]) + len(shards[2])
    assert (head / "data" / "train" / "shard_00002.pt").exists() and (head / "config.json").exists()
