"""The draft worker's configuration: one frozen, nested config built from its flags, checked once.

:class:`DraftConfig` holds what the worker's own flags say (method, models, placement, the gRPC
server) and three typed groups: ``spec`` (:class:`~workers.speculation.spec_config.SpeculativeConfig`,
``--speculative-config``: the method's knobs, the proposal cap, the seam's, the benchmark oracle's),
``grpc`` (:class:`GrpcSettings`) and ``distill`` (:class:`DistillSettings`, ``--distill-config``).

``device`` and ``dtype`` place a model-based draft (EAGLE/EAGLE-3 heads, a draft LM, Medusa and
MLP speculator heads): ``auto`` puts it on CUDA when a GPU is visible, in bfloat16 there and
float32 on the CPU. Methods without tensors (ngram, suffix, oracle) accept both and ignore them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from pydantic import Field

from runtime.settings import Group, parse_group
from workers.speculation.methods import BENCH_METHODS, DTYPES, METHODS
from workers.speculation.spec_config import FLAG as SPEC_FLAG
from workers.speculation.spec_config import SpeculativeConfig

TENSOR_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator")  # methods with a model to place


def check_device_name(spec: str) -> None:
    """``ValueError`` unless ``spec`` is auto, cpu, cuda or cuda:N."""
    if spec in ("auto", "cpu", "cuda") or (spec.startswith("cuda:") and spec[5:].isdigit()):
        return
    raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {spec!r}")


def resolve_device(spec: str) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` -> the device; ``ValueError`` for a malformed name or a
    CUDA device that is not there (a clear start-up error, not a traceback from the first tensor)."""
    check_device_name(spec)
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {spec}: CUDA is not available here (no GPU visible to torch, or a CPU-only "
                         "torch build); use --device cpu or auto")
    index = spec.partition(":")[2]
    if index and int(index) >= torch.cuda.device_count():
        raise ValueError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return torch.device(spec)


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA, float32 elsewhere; otherwise the named dtype."""
    if spec not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {spec!r}")
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, spec)


DISTILL_FLAG = "--distill-config"


class DistillSettings(Group):
    """``--distill-config``'s keys: online distillation's knobs (they tune ``--online-distill``) and
    ``follow``, which works alone."""

    share: float = Field(0.5, gt=0, le=1)  # of its time the trainer may compute
    threads: int = Field(1, ge=1)  # the trainer's torch threads
    buffer_tokens: int = Field(65536, ge=1)  # tokens of recent traffic kept for training (oldest dropped first)
    min_tokens: int = Field(2048, ge=0)  # training starts once this many tokens were recorded
    lr: float = Field(1e-4, gt=0)  # AdamW learning rate
    eval_every: int = Field(20, ge=1)  # optimizer steps between evaluations of the candidate
    min_gain: float = Field(0.02, ge=0)  # held-back acceptance length a candidate must add to be swapped in
    dir: str | None = None  # write every accepted head here (speculators layout, LATEST names the newest)
    follow: str | None = None  # serve each head another worker's 'dir' receives (polled every 5 s)

    @property
    def training_keys(self) -> list[str]:
        """The keys given that tune training (all but ``follow``)."""
        return sorted(self.model_fields_set - {"follow"})


DISTILL_CONFIG_HELP = (
    "online distillation as JSON (or @FILE): share (of its time the trainer computes, (0, 1], 0.5), threads "
    "(its torch threads, 1), buffer_tokens (recent traffic kept, 65536), min_tokens (recorded before training "
    "starts, 2048), lr (AdamW, 1e-4), eval_every (steps between evaluations, 20), min_gain (held-back "
    "acceptance length a candidate must add, 0.02), dir (write every accepted head here; LATEST names the "
    "newest) -- these tune --online-distill; and follow (method eagle3: serve each head another worker's "
    "'dir' receives, polled every 5 s; works without --online-distill)")


@dataclass(frozen=True)
class GrpcSettings:
    """The gRPC server targets dial: where it listens, what it advertises, its TLS."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    advertise_host: str | None = None  # what targets dial (default: host)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # mutual TLS: targets present a certificate signed by this CA

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--grpc-port must be in 0..65535, got {self.port}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def tls_given(self) -> bool:
        return bool(self.tls_cert or self.tls_key or self.tls_client_ca)


def distill_settings(text: str | dict | None, env: str | None = None) -> DistillSettings:
    """``--distill-config``'s value (JSON, ``@PATH``, a dict or None; ``env``: ``TANDEM_DISTILL_CONFIG``,
    whose keys apply beneath it) as :class:`DistillSettings`."""
    return parse_group(DistillSettings, DISTILL_FLAG, text, env)


@dataclass(frozen=True)
class DraftConfig:
    """Everything the draft service needs besides the runtime flags (etcd, NATS, namespace)."""

    method: str = "ngram"
    model_name: str = ""  # served model name of the targets it serves ('' = any)
    device: str = "auto"
    dtype: str = "auto"
    draft_model: str | None = None  # the draft LM (draft_model)
    eagle_model: str | None = None  # the head's directory (eagle, eagle3, medusa, mlp_speculator)
    target_model: str | None = None  # the target's checkpoint (the heads read its embedding and LM head)
    num_blocks: int = 2048  # draft KV cache (draft_model, eagle, eagle3)
    block_size: int = 16
    cuda_graphs: bool = True  # replay EAGLE head steps as CUDA graphs (on CUDA only)
    spec: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # --speculative-config
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    online_distill: bool = False  # --online-distill: train the head on the traffic it serves
    distill: DistillSettings = field(default_factory=DistillSettings)  # --distill-config
    drain_timeout: float = 5.0  # seconds open streams get on SIGTERM

    def __post_init__(self):
        if self.method not in (*METHODS, *BENCH_METHODS):
            raise ValueError(f"unknown draft method {self.method!r}")
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError("--num-blocks and --block-size must be positive")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        check_device_name(self.device)
        if self.method in TENSOR_METHODS:
            resolve_device(self.device)  # raises for a device that is not there
        for flag, path in (("--draft-model", self.draft_model), ("--eagle-model", self.eagle_model),
                           ("--target-model", self.target_model),
                           (f"{SPEC_FLAG}'s 'oracle_file'", self.spec.oracle_file),
                           (f"{DISTILL_FLAG}'s 'follow'", self.distill.follow)):
            if path and not os.path.exists(path):
                raise ValueError(f"{flag} {path} does not exist")
        if (self.online_distill or self.distill.follow) and self.method != "eagle3":
            raise ValueError(f"--online-distill and {DISTILL_FLAG}'s 'follow' train or take EAGLE-3 heads: they "
                             "need --draft-method eagle3")
        if self.distill.training_keys and not self.online_distill:
            keys = ", ".join(repr(k) for k in self.distill.training_keys)
            verb = "tunes" if len(self.distill.training_keys) == 1 else "tune"
            raise ValueError(f"{DISTILL_FLAG}'s {keys} {verb} --online-distill: give --online-distill too")
        if self.online_distill:
            self.distill_config()  # raises for out-of-range values

    @property
    def tree_topk(self) -> int:
        """Draft trees: children per node (``eagle_topk``; unset: 1, chains). Targets may ask per request."""
        return self.spec.eagle_topk or 1

    @property
    def tree_depth(self) -> int:
        """Draft trees: depth (``num_steps``; unset: 0, as deep as the node budget)."""
        return self.spec.num_steps or 0

    @property
    def torch_device(self) -> torch.device:
        """Where a model-based draft runs (``device`` resolved)."""
        return resolve_device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype a model-based draft computes in (``dtype`` resolved for :attr:`torch_device`)."""
        return resolve_dtype(self.dtype, self.torch_device)

    def distill_config(self, device: str = "cpu"):
        """Online distillation's settings, training on ``device`` (the head's)."""
        from .online import DistillConfig

        d = self.distill
        return DistillConfig(head_dir=self.eagle_model, target_dir=self.target_model,
                             buffer_tokens=d.buffer_tokens, min_tokens=d.min_tokens, lr=d.lr,
                             eval_every=d.eval_every, min_gain=d.min_gain, share=d.share, threads=d.threads,
                             out_dir=d.dir, device=device)
