"""``tandem train-draft`` recipe options: the draft vocabulary sized from coverage of the eval split
(``--vocab-coverage``) and held-out evaluation after every epoch (``--eval-every-epoch``)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.workers.draft.test_train import _quiet, tiny_target  # noqa: F401  (fixture)
from workers.draft.eagle import load_eagle, load_target_parts
from workers.draft.train.trainer import TrainConfig, train
from workers.draft.train.ttt import coverage_curve, coverage_order, draft_vocabulary, size_for_coverage

pytestmark = pytest.mark.unit


def test_coverage_follows_the_draft_vocabulary_order():
    counts = torch.tensor([5, 0, 9, 5, 1, 0, 0, 3])
    assert coverage_order(counts)[:5].tolist() == [2, 0, 3, 7, 4]  # ties: lower id first, as draft_vocabulary
    ids, _, _ = draft_vocabulary(counts, 3)
    assert ids.tolist() == sorted(coverage_order(counts)[:3].tolist())
    held = torch.tensor([1, 0, 6, 1, 0, 2, 0, 0])  # 10 held-out tokens; id 5 never seen in training
    curve = coverage_curve(counts, held, [1, 2, 3, 8])
    assert curve == pytest.approx({1: 0.6, 2: 0.7, 3: 0.8, 8: 1.0})
    assert size_for_coverage(counts, held, 0.7, cap=8, multiple=1) == 2
    assert size_for_coverage(counts, held, 0.75, cap=8, multiple=1) == 3
    assert size_for_coverage(counts, held, 0.75, cap=8, multiple=4) == 4  # rounded up to the multiple
    assert size_for_coverage(counts, held, 0.75, cap=2, multiple=1) == 2  # never above the cap
    # id 5 was never seen in training: it comes after every seen token, then by id (1, 5, 6)
    assert size_for_coverage(counts, held, 0.95, cap=8, multiple=1) == 7
    with pytest.raises(ValueError):
        size_for_coverage(counts, held, 0.0, cap=8)
    with pytest.raises(ValueError):
        size_for_coverage(counts, torch.zeros(8, dtype=torch.long), 0.5, cap=8)


def test_vocab_coverage_and_per_epoch_evaluation(tiny_target, tmp_path):  # noqa: F811
    common = dict(target=str(tiny_target), prompts=6, eval_prompts=2, max_tokens=12, max_len=256, shard_size=4,
                  draft_vocab=4096, steps=3, epochs=2, batch_tokens=256, warmup=1, save_every=2, threads=1,
                  dtype="float32")
    with pytest.raises(ValueError, match="--vocab-coverage"):
        TrainConfig(out=str(tmp_path / "x"), vocab_coverage=1.5, **common)
    with pytest.raises(ValueError, match="--vocab-coverage"):
        TrainConfig(out=str(tmp_path / "x"), vocab_coverage=0.9, **{**common, "eval_prompts": 0})
    # without the flags: the draft vocabulary as asked, no per-epoch entries, the coverage curve reported
    plain = train(TrainConfig(out=str(tmp_path / "p"), **{**common, "epochs": 1}), progress=_quiet)
    assert plain["draft_vocab"] == 4096 and plain["per_epoch"] == []
    want = plain["eval_coverage"]["2048"]  # the tiny target's random replies: a share reached by 2,048 tokens
    assert 0 < want <= plain["eval_coverage"]["4096"]
    m = train(TrainConfig(out=str(tmp_path / "h"), data_from=str(tmp_path / "p"), vocab_coverage=want,
                          eval_every_epoch=True, **common), progress=_quiet)
    # the smallest multiple of 64 reaching that share of the eval replies
    assert m["draft_vocab"] % 64 == 0 and m["draft_vocab"] <= 2048
    assert m["eval_coverage"][str(m["draft_vocab"])] >= want
    embed, lm_head, target_cfg = load_target_parts(tiny_target)
    head, _ = load_eagle(tmp_path / "h", embed, lm_head, target_cfg, 256)
    assert head.lm_head.weight.shape[0] == m["draft_vocab"]
    # one held-out evaluation per epoch; the last equals the final metrics
    assert [e["epoch"] for e in m["per_epoch"]] == [1, 2]
    assert m["per_epoch"][-1]["acceptance_length"] == pytest.approx(m["acceptance_length"])
    assert len(m["per_epoch"][0]["top1_per_step"]) == 3
    assert json.loads((tmp_path / "h" / "per_epoch.json").read_text()) == m["per_epoch"]
