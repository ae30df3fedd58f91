"""``tandem train-draft``: a draft head for a target model, trained on the target's own replies.

Heads (``--head``): ``eagle3`` (the default), ``medusa`` and ``mlp`` (IBM's MLP speculator); see
:mod:`workers.draft.eagle` and :mod:`workers.draft.spec_heads`.

Stages, each resumable (an interrupted run picks up where it stopped):
1. data — prompts (:mod:`.prompts`), replies and hidden states (:mod:`.data`) in shards under
   ``OUT/data/{train,eval}``; the eval prompts come from another seed than the training ones. The
   hidden states are the ones the head reads (EAGLE-3: three layers; Medusa and MLP: the last).
   ``--data-from DIR`` takes the conversations another run generated (any head), or a token corpus
   (:mod:`.corpus`, made by ``python -m workers.draft.train.gen_tokens``: its first shards covering
   ``eval_prompts`` conversations are the eval split, the rest train), and only recomputes the
   hidden states, with one teacher-forced forward per conversation;
2. vocabulary — the ``draft_vocab`` most frequent reply tokens (EAGLE-3's reduced LM head, Medusa's
   token map; the MLP speculator keeps the whole vocabulary, as its layout has no map);
3. training — EAGLE-3: training-time test over ``steps`` unrolled steps (:mod:`.ttt`); Medusa and MLP:
   ``steps`` heads / stages, teacher-forced (:mod:`.spec_heads`); AdamW with warm-up and cosine
   decay, gradient clipping; a checkpoint (``OUT/train_state.pt``) every ``save_every`` optimizer
   steps and at the end of each epoch;
4. evaluation on the held-out split (top-1 per step, greedy acceptance length at γ = ``steps``) and
   the head written to ``OUT`` (EAGLE-3: the ``speculators`` layout, :mod:`.checkpoint`; Medusa and
   MLP: vLLM's layouts, :func:`workers.draft.spec_heads.save_spec_head`).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...engine.config import ModelConfig
from ..eagle import Eagle3Head, load_eagle, load_target_parts
from ..spec_heads import save_spec_head
from .checkpoint import head_config, save_eagle3
from .corpus import is_corpus, read_manifest, shard_paths
from .data import SampleMaker, eagle3_layers, load_samples, rehidden_shards, write_shards
from .prompts import STYLES, local_prompts, mixed_conversation
from .spec_heads import build_medusa, build_mlp, spec_head_forward
from .ttt import coverage_curve, draft_vocabulary, size_for_coverage, ttt_forward

HEADS = ("eagle3", "medusa", "mlp")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    target: str
    out: str
    prompts: int = 2000
    eval_prompts: int = 64
    prompt_files: tuple[str, ...] = ()
    max_tokens: int = 256
    max_len: int = 1024
    temperature: float = 0.0
    gen_batch: int = 32
    shard_size: int = 64
    draft_vocab: int = 8192
    steps: int = 3
    epochs: int = 2
    lr: float = 5e-4
    warmup: int = 50
    batch_tokens: int = 4096
    grad_clip: float = 0.5
    save_every: int = 100
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None
    dtype: str = "float16"
    head: str = "eagle3"
    data_from: str | None = None  # another run's OUT: reuse its conversations, recompute hidden states
    inner_dim: int = 0  # MLP speculator: its state width (0: the target's hidden size)
    head_layers: int = 1  # Medusa: residual blocks per head
    styles: tuple[str, ...] = ("templates",)  # prompt generators, taken in turn (prompts.STYLES)
    init_from: str | None = None  # an EAGLE-3 head to start from (fine-tuning) instead of a fresh one
    vocab_coverage: float = 0.0  # > 0: draft vocabulary = the smallest (≤ draft_vocab) covering this share of eval replies
    eval_every_epoch: bool = False  # evaluate on the held-out split after every epoch (metrics["per_epoch"])

    def __post_init__(self):
        if self.head not in HEADS:
            raise ValueError(f"--head must be one of {', '.join(HEADS)}, got {self.head!r}")
        bad = [s for s in self.styles if s not in STYLES]
        if bad or not self.styles:
            raise ValueError(f"--styles must be a comma list of {', '.join(STYLES)}, got {','.join(self.styles)!r}")
        if self.init_from is not None:
            if self.head != "eagle3":
                raise ValueError("--init-from starts from an EAGLE-3 head: it needs --head eagle3")
            if not (Path(self.init_from) / "config.json").exists():
                raise ValueError(f"--init-from {self.init_from}: no config.json there (an EAGLE-3 head directory)")
        if self.inner_dim < 0 or self.head_layers < 1:
            raise ValueError("--inner-dim must be >= 0 and --head-layers >= 1")
        if self.head == "mlp" and self.steps < 2:
            raise ValueError("--head mlp ties its stages' weights: --steps must be >= 2")
        if self.data_from is not None and not (Path(self.data_from) / "data" / "train").is_dir() \
                and not is_corpus(self.data_from):
            raise ValueError(f"--data-from {self.data_from}: neither data/train shards (an earlier train-draft --out) "
                             f"nor a token corpus (manifest.json) there")
        if not Path(self.target).is_dir() or not (Path(self.target) / "config.json").exists():
            raise ValueError(f"target {self.target!r} is not a model directory with a config.json")
        for name in ("prompts", "max_tokens", "gen_batch", "shard_size", "draft_vocab", "steps", "epochs",
                     "batch_tokens", "save_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.eval_prompts < 0 or self.lr <= 0 or self.temperature < 0:
            raise ValueError("--eval-prompts must be >= 0, --lr > 0 and --temperature >= 0")
        if not 0 <= self.vocab_coverage <= 1:
            raise ValueError(f"--vocab-coverage must be in [0, 1] (0: off), got {self.vocab_coverage}")
        if self.vocab_coverage and self.eval_prompts == 0:
            raise ValueError("--vocab-coverage sizes the draft vocabulary on the eval split: it needs --eval-prompts > 0")
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"--dtype must be float16, bfloat16 or float32, got {self.dtype}")


def check_target(path: str | Path, head: str = "eagle3") -> ModelConfig:
    """The target's config; ValueError (one line) for a target the head cannot be trained for."""
    cfg = ModelConfig.from_dir(path)  # raises for unsupported architectures
    if head != "eagle3":
        return cfg  # Medusa and MLP read the last hidden state of any model our engine runs
    eagle3_layers(cfg.num_layers)
    if cfg.model_type == "gemma3_text":  # not tried: its scaled embeddings and norms differ from the head's
        raise ValueError(f"EAGLE-3 training does not support {cfg.model_type} targets yet ({path})")
    return cfg


def layers_read(cfg: TrainConfig, target_cfg: ModelConfig) -> list[int]:
    """The target layers whose hidden states the head reads (L: after the final norm)."""
    return eagle3_layers(target_cfg.num_layers) if cfg.head == "eagle3" else [target_cfg.num_layers]


def make_data(cfg: TrainConfig, progress) -> tuple[list[Path], list[Path]]:
    from transformers import AutoTokenizer

    from ...engine.weights import load_model

    out = Path(cfg.out) / "data"
    target_cfg = check_target(cfg.target, cfg.head)
    layers = layers_read(cfg, target_cfg)
    _check_layers(out, layers, target_cfg.hidden_size)
    if cfg.data_from is not None:
        pairs = _corpus_pairs(cfg, out) if is_corpus(cfg.data_from) else \
            {split: [(p, out / split / p.name) for p in sorted((Path(cfg.data_from) / "data" / split).glob("shard_*.pt"))]
             for split in ("train", "eval")}
        if not pairs["train"]:
            raise ValueError(f"--data-from {cfg.data_from}: no training shards there")
        todo = [(src, dst) for split in pairs.values() for src, dst in split if not dst.exists()]
    else:
        train_convs = [mixed_conversation(cfg.seed, i, cfg.styles) for i in range(cfg.prompts)] + \
            local_prompts(list(cfg.prompt_files))
        eval_convs = [mixed_conversation(cfg.seed + 1_000_003, i, cfg.styles) for i in range(cfg.eval_prompts)]
        shard = cfg.shard_size
        todo = [p for p in _shard_names(out / "train", len(train_convs), shard) +
                _shard_names(out / "eval", len(eval_convs), shard) if not p.exists()]
    if todo:  # with everything on disk already, no model is needed
        model = load_model(cfg.target, device=cfg.device, max_positions=cfg.max_len)
        tokenizer = AutoTokenizer.from_pretrained(cfg.target)
        maker = SampleMaker(model, tokenizer, layers, max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                            batch=cfg.gen_batch, max_len=cfg.max_len, seed=cfg.seed)
    if cfg.data_from is not None:
        if todo:
            bar = progress(total=len(todo), desc="hidden states", unit="shard")
            rehidden_shards(maker, todo, bar)
            bar.close()
        return [dst for _, dst in pairs["train"]], [dst for _, dst in pairs["eval"]]
    if todo:
        bar = progress(total=len(train_convs) + len(eval_convs), desc="generating", unit="conv")
        write_shards(maker, eval_convs, out / "eval", shard, bar)  # first: a cut-short run can still evaluate
        write_shards(maker, train_convs, out / "train", shard, bar)
        bar.close()
    return _shard_names(out / "train", len(train_convs), shard), _shard_names(out / "eval", len(eval_convs), shard)


def _corpus_pairs(cfg: TrainConfig, out: Path) -> dict[str, list[tuple[Path, Path]]]:
    """A token corpus's shards with the hidden-state shards they become: the first ones holding
    ``eval_prompts`` conversations evaluate (fixed as the corpus grows), the others train."""
    shards = shard_paths(Path(cfg.data_from))
    per_shard = read_manifest(cfg.data_from)["shard_size"]
    n_eval = min(-(-cfg.eval_prompts // per_shard), max(len(shards) - 1, 0))
    return {split: [(p, out / split / p.with_suffix(".pt").name) for p in part]
            for split, part in (("eval", shards[:n_eval]), ("train", shards[n_eval:]))}


def _check_layers(out: Path, layers: list[int], hidden_size: int) -> None:
    """Shards under ``out`` hold one head's hidden states: refuse to mix, record them for the next run."""
    marker = out / "layers.json"
    mismatch = f"{out} holds hidden states of other target layers than the {layers} this head reads: " \
               f"use another --out (and --data-from {out.parent} to reuse its conversations)"
    if marker.exists():
        if json.loads(marker.read_text()) != layers:
            raise ValueError(mismatch)
        return
    shards = sorted(out.glob("*/shard_*.pt"))
    if shards:  # made before the marker existed: check the width of their hidden states
        first = next(iter(torch.load(shards[0], weights_only=True)), None)
        if first is not None and first["hidden"].shape[-1] != len(layers) * hidden_size:
            raise ValueError(mismatch)
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(layers) + "\n")


def _shard_names(directory: Path, n: int, shard: int) -> list[Path]:
    return [directory / f"shard_{i:05d}.pt" for i in range(-(-n // shard))]


def build_head(target_cfg: ModelConfig, embed: torch.nn.Embedding, lm_head_weight: torch.Tensor,
               draft_ids: torch.Tensor, d2t: torch.Tensor, max_positions: int, seed: int) -> Eagle3Head:
    """A fresh head: one Llama layer shaped like the target's (:func:`.checkpoint.head_config`), LM
    head rows copied from the target's."""
    torch.manual_seed(seed)
    head = Eagle3Head(head_config(target_cfg), embed, max_positions, target_cfg.hidden_size,
                      len(draft_ids), target_cfg.vocab_size, norm_before_residual=True)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
        head.lm_head.weight.copy_(lm_head_weight[draft_ids])
        head.d2t.copy_(d2t)
    return head


def warm_start(head: Eagle3Head, start: Eagle3Head, draft_ids: torch.Tensor) -> None:
    """Copy ``start``'s weights into the fresh ``head``: every layer, and the LM-head rows of the draft
    tokens both vocabularies hold (a token new to the draft vocabulary keeps the target's row)."""
    ours = head.state_dict()
    for name, value in start.state_dict().items():
        if name in ours and not name.startswith(("lm_head.", "d2t", "t2d", "embed")) and ours[name].shape == value.shape:
            ours[name].copy_(value)
    start_ids = torch.arange(start.lm_head.weight.shape[0]) + start.d2t.long()
    row_of = {int(t): i for i, t in enumerate(start_ids)}
    with torch.no_grad():
        for i, t in enumerate(draft_ids.tolist()):
            if t in row_of:
                head.lm_head.weight[i].copy_(start.lm_head.weight[row_of[t]])


def _samples(paths: list[Path]) -> list[dict]:
    return [s for s in load_samples(paths) if s["mask"].sum() >= 2]


def _on(sample: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sample's (tokens, hidden as float32, mask) on ``device`` (samples stay on the host)."""
    return (sample["tokens"].to(device), sample["hidden"].to(device).float(), sample["mask"].to(device))


def evaluate(forward, samples: list[dict], steps: int) -> dict:
    """Held-out top-1 per step and greedy acceptance length; ``forward(sample)`` gives its StepStats."""
    correct, counted, chains, accepted = [0] * steps, [0] * steps, 0, 0
    with torch.no_grad():
        for s in samples:
            st = forward(s)
            for k in range(len(st.correct)):
                correct[k] += st.correct[k]
                counted[k] += st.counted[k]
            chains += st.chains
            accepted += st.accepted
    return {"chains": chains, "top1_per_step": [c / n if n else None for c, n in zip(correct, counted)],
            "acceptance_length": 1 + accepted / chains if chains else None, "gamma": steps}


def train(cfg: TrainConfig, progress=None) -> dict:
    """Run every stage; returns the held-out metrics (also written to OUT/metrics.json)."""
    if progress is None:
        from tqdm import tqdm as progress
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target_cfg = check_target(cfg.target, cfg.head)
    started = time.perf_counter()
    train_paths, eval_paths = make_data(cfg, progress)
    gen_s = time.perf_counter() - started
    embed, target_lm_head, _ = load_target_parts(cfg.target)  # the head reads the target's embedding, frozen
    embed.weight.requires_grad_(False)
    lm_head = target_lm_head.weight.detach()
    samples = _samples(train_paths)
    held = _samples(eval_paths)
    if not samples:
        raise ValueError("no training samples: every reply was empty")
    counts = torch.zeros(target_cfg.vocab_size, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s["tokens"][s["mask"]], minlength=target_cfg.vocab_size)
    start = None
    if cfg.init_from is not None:
        start, start_layers = load_eagle(cfg.init_from, embed, target_lm_head, target_cfg, cfg.max_len)
        if not isinstance(start, Eagle3Head) or start_layers != eagle3_layers(target_cfg.num_layers):
            raise ValueError(f"--init-from {cfg.init_from}: not an EAGLE-3 head over this target's layers "
                             f"{eagle3_layers(target_cfg.num_layers)}")
        # the new data's counts decide, but a token new to the draft vocabulary must be seen twice to
        # displace one the head already drafts (a small fine-tuning set sees many tokens once by chance)
        known = torch.zeros_like(counts)
        known[torch.arange(start.d2t.shape[0]) + start.d2t.long()] = 1
        counts = counts * 2 + known * 3
    held_counts = torch.zeros(target_cfg.vocab_size, dtype=torch.long)
    for s in held:
        held_counts += torch.bincount(s["tokens"][s["mask"]], minlength=target_cfg.vocab_size)
    vocab_size = cfg.draft_vocab
    if cfg.vocab_coverage and cfg.head != "mlp":
        if not held:
            raise ValueError("--vocab-coverage: the eval split is empty, nothing to size the draft vocabulary on")
        vocab_size = size_for_coverage(counts, held_counts, cfg.vocab_coverage, cfg.draft_vocab)
        log.info("draft vocabulary: %d tokens hold %.4f of the eval replies (asked %.4f, at most %d)", vocab_size,
                 coverage_curve(counts, held_counts, [vocab_size])[vocab_size], cfg.vocab_coverage, cfg.draft_vocab)
    sizes = sorted({1024, 2048, 4096, 8192, 16384, 32768, vocab_size} & set(range(1, target_cfg.vocab_size + 1)))
    eval_coverage = coverage_curve(counts, held_counts, sizes) if int(held_counts.sum()) else {}
    draft_ids, d2t, t2d = draft_vocabulary(counts, vocab_size)
    t2d_index = torch.full((target_cfg.vocab_size,), -1, dtype=torch.long)
    t2d_index[draft_ids] = torch.arange(len(draft_ids))
    H, V = target_cfg.hidden_size, target_cfg.vocab_size
    if cfg.head == "eagle3":
        head = build_head(target_cfg, embed, lm_head, draft_ids, d2t, cfg.max_len, cfg.seed)
        if start is not None:
            warm_start(head, start, draft_ids)
    elif cfg.head == "medusa":
        head = build_medusa(H, V, cfg.steps, cfg.head_layers, lm_head, draft_ids if len(draft_ids) < V else None)
    else:
        head = build_mlp(H, cfg.inner_dim or H, V, cfg.steps, embed.weight.detach(), cfg.seed)
    device = torch.device(cfg.device)  # the head trains where the data was generated
    head.to(device)
    embed.to(device)
    t2d_index = t2d_index.to(device)
    medusa_map = t2d_index if cfg.head == "medusa" and len(draft_ids) < V else None

    def forward(sample: dict):
        tokens, hidden, mask = _on(sample, device)
        if cfg.head == "eagle3":
            return ttt_forward(head, embed, tokens, hidden, mask, t2d_index, cfg.steps)
        return spec_head_forward(head, tokens, hidden, mask, medusa_map, cfg.steps)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    tokens_per_epoch = sum(int(s["tokens"].shape[0]) for s in samples)
    total_steps = max(1, cfg.epochs * math.ceil(tokens_per_epoch / cfg.batch_tokens))

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup) / max(1, total_steps - cfg.warmup))))

    state_path = Path(cfg.out) / "train_state.pt"
    step, epoch, position = 0, 0, 0
    if state_path.exists():
        state = torch.load(state_path, weights_only=False, map_location=device)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        step, epoch, position = state["step"], state["epoch"], state["position"]
        log.info("resuming training at epoch %d, sample %d (step %d)", epoch, position, step)

    def save_state() -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "epoch": epoch,
                    "position": position}, tmp)
        tmp.replace(state_path)

    train_started = time.perf_counter()
    per_epoch_path = Path(cfg.out) / "per_epoch.json"  # kept across a resumed run
    per_epoch = json.loads(per_epoch_path.read_text()) if state_path.exists() and per_epoch_path.exists() else []
    bar = progress(total=cfg.epochs * len(samples), initial=epoch * len(samples) + position, desc="training",
                   unit="seq")
    head.train()
    while epoch < cfg.epochs:
        order = list(range(len(samples)))
        random.Random(cfg.seed + epoch).shuffle(order)
        acc_tokens, running = 0, []
        optimizer.zero_grad(set_to_none=True)
        while position < len(order):
            s = samples[order[position]]
            st = forward(s)
            n = int(s["tokens"].shape[0])
            (st.loss * n / cfg.batch_tokens).backward()
            acc_tokens += n
            running.append(float(st.loss.detach()))
            position += 1
            bar.update(1)
            if acc_tokens >= cfg.batch_tokens or position == len(order):
                torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                acc_tokens = 0
                bar.set_postfix(loss=f"{sum(running[-50:]) / len(running[-50:]):.3f}", lr=f"{lr_at(step):.1e}")
                if step % cfg.save_every == 0:
                    save_state()
        epoch, position = epoch + 1, 0
        save_state()
        if cfg.eval_every_epoch and held:
            head.eval()
            m = evaluate(forward, held, cfg.steps)
            head.train()
            per_epoch.append({"epoch": epoch, "step": step, "acceptance_length": m["acceptance_length"],
                              "top1_per_step": m["top1_per_step"]})
            per_epoch_path.write_text(json.dumps(per_epoch, indent=2) + "\n")
            log.info("epoch %d: held-out acceptance length %.3f, top-1 per step %s", epoch,
                     m["acceptance_length"] or 0.0, [round(x, 3) if x is not None else None for x in m["top1_per_step"]])
    bar.close()
    head.eval()
    train_s = time.perf_counter() - train_started
    metrics = evaluate(forward, held, cfg.steps)
    metrics.update(head=cfg.head, train_tokens=tokens_per_epoch,
                   train_reply_tokens=int(sum(int(s["mask"].sum()) for s in samples)),
                   train_sequences=len(samples), eval_sequences=len(held), epochs=cfg.epochs,
                   generation_minutes=gen_s / 60, training_minutes=train_s / 60,
                   draft_vocab=V if cfg.head == "mlp" else len(draft_ids),
                   eval_coverage={str(k): v for k, v in eval_coverage.items()}, per_epoch=per_epoch,
                   parameters=sum(p.numel() for p in {id(p): p for p in head.parameters()}.values()),
                   config=asdict(cfg))
    extra = {"metrics": {k: metrics[k] for k in ("acceptance_length", "top1_per_step", "train_tokens",
                                                 "generation_minutes", "training_minutes")}}
    if cfg.head == "eagle3":
        save_eagle3(head, t2d, cfg.out, layers=eagle3_layers(target_cfg.num_layers), verifier=str(cfg.target),
                    num_speculative_tokens=cfg.steps, dtype=getattr(torch, cfg.dtype), extra=extra)
    else:
        save_spec_head(head.cpu(), cfg.out, dtype=getattr(torch, cfg.dtype), extra={**extra, "verifier": str(cfg.target)})
    (Path(cfg.out) / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log.info("held-out acceptance length %.2f at γ=%d; head written to %s",
             metrics["acceptance_length"] or 0.0, cfg.steps, cfg.out)
    return metrics
