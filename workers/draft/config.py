"""The draft worker's configuration: one frozen dataclass built from its flags, checked once.

``device`` and ``dtype`` place a model-based draft (EAGLE/EAGLE-3 heads, a draft LM, Medusa and
MLP speculator heads): ``auto`` puts it on CUDA when a GPU is visible, in bfloat16 there and
float32 on the CPU. Methods without tensors (ngram, suffix, oracle) accept both and ignore them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .methods import BENCH_METHODS, DTYPES, METHODS

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


@dataclass(frozen=True)
class DraftConfig:
    """Everything the draft service needs besides the runtime flags (etcd, NATS, namespace)."""

    method: str = "ngram"
    model_name: str = ""  # served model name of the targets it serves ('' = any)
    device: str = "auto"
    dtype: str = "auto"
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 0
    advertise_host: str | None = None
    draft_model: str | None = None
    eagle_model: str | None = None  # the head's directory (eagle, eagle3, medusa, mlp_speculator)
    target_model: str | None = None
    num_blocks: int = 2048
    block_size: int = 16
    overlap: bool = True  # draft ahead while the target verifies (methods that can)
    stage_alternatives: int = 1  # pipelined seam: guessed bonus tokens per rejected position, beside the draft's own
    cuda_graphs: bool = True  # replay EAGLE head steps as CUDA graphs (on CUDA only)
    oracle_file: str | None = None
    oracle_error_rate: float = 0.0
    oracle_vocab_size: int = 49152
    oracle_token_cost_ms: float = 0.0
    ngram_min: int = 1
    ngram_max: int = 4
    suffix_max_depth: int = 24
    suffix_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    suffix_max_cached_outputs: int = 10_000
    suffix_max_cached_nodes: int = 500_000
    max_speculative_tokens: int = 16
    tree_topk: int = 1
    tree_depth: int = 0
    eagle_pipelined: bool = False  # an EAGLE head stages for the pipelined seam (else: the synchronous seam)
    online_distill: bool = False
    distill_share: float = 0.5
    distill_threads: int = 1
    distill_buffer_tokens: int = 65536
    distill_min_tokens: int = 2048
    distill_lr: float = 1e-4
    distill_eval_every: int = 20
    distill_min_gain: float = 0.02
    distill_dir: str | None = None
    distill_follow: str | None = None
    grpc_tls_cert: str | None = None
    grpc_tls_key: str | None = None
    grpc_tls_client_ca: str | None = None
    drain_timeout: float = 5.0

    def __post_init__(self):
        if self.stage_alternatives < 0:
            raise ValueError(f"--stage-alternatives must be >= 0, got {self.stage_alternatives}")
        if self.method not in (*METHODS, *BENCH_METHODS):
            raise ValueError(f"unknown draft method {self.method!r}")
        if self.tree_topk < 1 or self.tree_depth < 0:
            raise ValueError("--speculative-eagle-topk must be >= 1 and --speculative-num-steps >= 0")
        if self.num_blocks <= 0 or self.block_size <= 0 or self.max_speculative_tokens <= 0:
            raise ValueError("--num-blocks, --block-size and --num-speculative-tokens must be positive")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        check_device_name(self.device)
        if self.method in TENSOR_METHODS:
            resolve_device(self.device)  # raises for a device that is not there
        for flag, path in (("--draft-model", self.draft_model), ("--eagle-model", self.eagle_model),
                           ("--target-model", self.target_model), ("--oracle-file", self.oracle_file)):
            if path and not os.path.exists(path):
                raise ValueError(f"{flag} {path} does not exist")
        if (self.online_distill or self.distill_follow) and self.method != "eagle3":
            raise ValueError("--online-distill and --distill-follow train or take EAGLE-3 heads: they need --method eagle3")
        if self.distill_dir and not self.online_distill:
            raise ValueError("--distill-dir is where --online-distill writes heads: give --online-distill too")
        if self.online_distill:
            self.distill_config()  # raises for out-of-range values

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

        return DistillConfig(head_dir=self.eagle_model, target_dir=self.target_model,
                             buffer_tokens=self.distill_buffer_tokens, min_tokens=self.distill_min_tokens,
                             lr=self.distill_lr, eval_every=self.distill_eval_every, min_gain=self.distill_min_gain,
                             share=self.distill_share, threads=self.distill_threads, out_dir=self.distill_dir,
                             device=device)
