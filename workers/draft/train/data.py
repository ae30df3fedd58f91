"""Self-distillation data for a draft head: the target answers prompts, and its own forward pass
gives the hidden states the head learns from.

For each conversation the target generates a reply with our engine (continuous batching, greedy
or at ``temperature``); conversations with a follow-up get a second turn after the target's own
first answer. Then one teacher-forced forward of the whole token sequence through the same model
returns the hidden states of the layers the head reads (EAGLE-3: low, middle, high; Medusa and MLP:
the last, after the final norm). A sample is ``tokens [T]`` (long), ``mask [T]`` (bool: tokens the
target generated, where the loss applies) and ``hidden [T, n·H]`` (float16, n layers). Samples are
written in shards of ``shard_size`` conversations (``shard_00000.pt``, ...); a shard already on disk is not made again, so an interrupted run resumes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from runtime.messages import SamplingParams

from ...engine.engine import Engine, EngineConfig
from ...engine.model import DecoderModel
from ...engine.model_runner import ModelRunner
from .corpus import shard_samples
from .prompts import clean_user_turn

log = logging.getLogger(__name__)


def eagle3_layers(num_layers: int) -> list[int]:
    """The target layers EAGLE-3 reads by default (vLLM's and speculators' (2, L//2, L-3)), in our
    numbering: k = the input of decoder layer k."""
    if num_layers < 4:
        raise ValueError(f"EAGLE-3 needs a target with at least 4 layers, this one has {num_layers}")
    return [2, num_layers // 2, num_layers - 3]


class SampleMaker:
    """Generates replies and hidden states with one target model (CPU or CUDA)."""

    def __init__(self, model: DecoderModel, tokenizer, layers: list[int], *, max_tokens: int = 256,
                 temperature: float = 0.0, batch: int = 32, max_len: int = 1024, seed: int = 0):
        self.model = model
        self.tokenizer = tokenizer
        self.layers = list(layers)
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.max_len = max_len
        self.seed = seed
        # room for every generating sequence at full length (at least 512 MiB)
        kv_bytes = max(512 << 20, batch * -(-max_len // 16) * ModelRunner.bytes_per_block(model, 16))
        self.engine = Engine(model, EngineConfig(block_size=16, max_num_seqs=batch, max_num_batched_tokens=2048,
                                                 max_model_len=max_len, kv_cache_bytes=kv_bytes,
                                                 enable_prefix_caching=True))
        # the teacher-forced pass gets a cache of its own: the engine's blocks hold its prefix cache
        self._runner = ModelRunner(model, -(-max_len // 16), 16)

    def _template(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _generate(self, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
        params = {}
        for i, rid in enumerate(prompts):
            budget = min(self.max_tokens, self.max_len - len(prompts[rid]) - 1)
            params[rid] = SamplingParams(temperature=self.temperature, max_tokens=max(budget, 0),
                                         seed=None if self.temperature == 0 else self.seed + i)
        return self.engine.generate({r: p for r, p in prompts.items() if params[r].max_tokens > 0}, params)

    def write_user_turns(self, conversations: list[dict]) -> list[dict]:
        """Self-instruct: conversations given as ``writer`` messages get their user turn written by
        the target (sampled at temperature 0.8, top-p 0.95, seeded by ``writer_seed``); an unusable one is
        dropped. Others pass through."""
        asks = {str(i): self._template(c["writer"]) for i, c in enumerate(conversations) if "writer" in c}
        params = {rid: SamplingParams(temperature=0.8, top_p=0.95, max_tokens=96, seed=conversations[int(rid)]["writer_seed"])
                  for rid in asks}
        written = self.engine.generate(asks, params) if asks else {}
        out = []
        for i, conv in enumerate(conversations):
            if "writer" not in conv:
                out.append(conv)
                continue
            text = clean_user_turn(self.tokenizer.decode(written[str(i)], skip_special_tokens=True))
            if text is not None:
                out.append({"messages": [{"role": "user", "content": text}], "follow_up": conv.get("follow_up")})
        return out

    def make(self, conversations: list[dict]) -> list[dict]:
        """Samples for ``conversations`` (see :mod:`workers.draft.train.prompts`)."""
        conversations = self.write_user_turns(conversations)
        first = {}
        for i, conv in enumerate(conversations):
            ids = self._template(conv["messages"])
            if len(ids) < self.max_len - 8:
                first[str(i)] = ids
        replies = self._generate(first)
        seqs: dict[str, tuple[list[int], list[bool]]] = {}
        second = {}
        for rid, reply in replies.items():
            conv = conversations[int(rid)]
            tokens, mask = first[rid] + reply, [False] * len(first[rid]) + [True] * len(reply)
            seqs[rid] = (tokens, mask)
            if conv.get("follow_up"):
                text = self.tokenizer.decode(reply, skip_special_tokens=True)
                messages = conv["messages"] + [{"role": "assistant", "content": text},
                                               {"role": "user", "content": conv["follow_up"]}]
                ids = self._template(messages)
                if len(ids) < self.max_len - 8:
                    second[rid] = ids
        for rid, reply in self._generate(second).items():
            ids = second[rid]
            seqs[rid] = (ids + reply, turn_mask(ids, seqs[rid]) + [True] * len(reply))
        return [self.hidden(tokens, mask) for tokens, mask in seqs.values() if sum(mask) >= 2]

    @torch.inference_mode()
    def hidden(self, tokens: list[int], mask: list[bool]) -> dict:
        """One teacher-forced forward over ``tokens``: the sample with its hidden states."""
        runner: ModelRunner = self._runner
        blocks = list(range(-(-len(tokens) // runner.block_size)))
        out = runner.forward([(tokens, 0, blocks)], [0], tuple(self.layers))
        hidden = torch.cat([out.hidden[k] for k in self.layers], dim=-1)  # [T, 3H]
        return {"tokens": torch.tensor(tokens, dtype=torch.long), "mask": torch.tensor(mask, dtype=torch.bool),
                "hidden": hidden.to(torch.float16).cpu()}


def turn_mask(ids: list[int], first: tuple[list[int], list[bool]]) -> list[bool]:
    """Loss mask over a later turn's prompt ``ids``: the earlier turns' mask where their tokens
    ``first`` appear unchanged, False after."""
    tokens, mask = first
    n = 0
    while n < min(len(ids), len(tokens)) and ids[n] == tokens[n]:
        n += 1
    return mask[:n] + [False] * (len(ids) - n)


def write_shards(maker: SampleMaker, conversations: list[dict], out_dir: Path, shard_size: int,
                 progress=None) -> list[Path]:
    """Make every shard of ``conversations`` not already in ``out_dir``; returns all shard paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for start in range(0, len(conversations), shard_size):
        path = out_dir / f"shard_{start // shard_size:05d}.pt"
        paths.append(path)
        chunk = conversations[start : start + shard_size]
        if not path.exists():
            samples = maker.make(chunk)
            tmp = path.with_suffix(".tmp")
            torch.save(samples, tmp)
            tmp.replace(path)  # a shard is either whole on disk or absent
        if progress is not None:
            progress.update(len(chunk))
    return paths


def conversations_in(path: Path) -> list[dict]:
    """A shard's samples, ``tokens`` and ``mask`` at least: a ``.pt`` shard of an earlier run, or a
    ``.npz`` shard of a token corpus (:mod:`workers.draft.train.corpus`, no hidden states)."""
    if path.suffix == ".npz":
        return shard_samples(path)
    return torch.load(path, weights_only=True)


def rehidden_shards(maker: SampleMaker, pairs: list[tuple[Path, Path]], progress=None) -> None:
    """For each (source, destination) shard pair: the source's conversations (tokens and loss mask,
    from an earlier run or a token corpus, :func:`conversations_in`) with the hidden states of
    ``maker``'s layers, written to the destination unless it is there already (resumable like
    :func:`write_shards`)."""
    for src, dst in pairs:
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            samples = [maker.hidden(s["tokens"].tolist(), s["mask"].tolist()) for s in conversations_in(src)]
            tmp = dst.with_suffix(".tmp")
            torch.save(samples, tmp)
            tmp.replace(dst)
        if progress is not None:
            progress.update(1)


def load_samples(paths: list[Path]) -> Iterator[dict]:
    for path in paths:
        yield from torch.load(path, weights_only=True)
