"""Target worker service: the model engine behind ``target.generate``.

Usage: python -m workers.target --model PATH [--served-model-name NAME] [--tensor-parallel-size N] [--num-blocks N]
       (etcd / NATS / namespace from --etcd/--nats/--namespace or TANDEM_ETCD/TANDEM_NATS/TANDEM_NAMESPACE)

With ``--tensor-parallel-size N`` this process is rank 0 of N: it starts ranks 1..N-1
(:mod:`workers.engine.followers`), runs the engine and alone talks to etcd, NATS and draft workers.
A rank that dies takes the worker down: its open requests fail with ``EngineFailed`` (the frontend
moves them to another target), it deregisters at once and exits with status 1.
"""

from __future__ import annotations

from workers.openmp import configure_waiting, torch_thread

configure_waiting()  # before torch loads: how its idle intra-op threads wait (see workers.openmp)

import argparse
import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import msgspec
from prometheus_client import REGISTRY

from runtime import Runtime
from runtime.config import EnvParser, add_runtime_args, apply_env_defaults, config_from_args, triton_interpret
from runtime.events import TOPIC_KV_DUMP
from runtime.flags import SERVED_MODEL_NAME
from runtime.messages import GenerateRequest, KvDumpRequest, KvRelease, LoraAdmin, ModelCard
from runtime.names import kv_release_topic
from runtime.service import check_log_level, exit_on_bad_config, run_service
from workers.engine.build import build_engine
from workers.target.flags import DTYPES, ENGINE_FLAGS, gpu_memory_utilization_ignored, max_loras
from workers.target.metrics import TargetCollector

log = logging.getLogger("workers.target")


@dataclass(frozen=True)
class TargetConfig:
    """Everything the target service needs besides the runtime flags."""

    model: str
    served_model_name: str
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    kv_cache_gb: float = 1.0
    dtype: str = "auto"
    device: str = "auto"
    threads: int | None = None
    attention: str = "auto"
    enable_prefix_caching: bool = True
    load_interval: float = 0.5
    num_speculative_tokens: int = 4
    propose_timeout: float = 2.0
    adaptive_speculation: bool = True
    cuda_graphs: bool = True
    tree_topk: int = 0  # 0: the draft worker's setting
    tree_depth: int = 0
    load_aware: bool = True
    hidden_layers: str = "auto"  # offered to draft workers: auto, none, or a comma list
    propose_min_wait: float = 0.02  # the least a round of proposals is waited for
    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 60.0  # the most seconds a collective waits for another rank
    role: str = "aggregated"  # aggregated, prefill or decode (prefill/decode disaggregation)
    kv_transfer_timeout: float = 5.0  # decode: the most seconds a KV pull may take before prefilling here
    kv_handoff_ttl: float = 30.0  # prefill: seconds handed-off blocks wait for their decode worker
    async_scheduling: bool = False  # launch each plain step before the previous one's tokens reach the host
    spec_seam: str = "pipelined"  # pipelined (where the draft stages and proposals are chains) or sync
    served_model_aliases: tuple[str, ...] = ()  # more names clients may pass as "model" (the card lists them)
    gpu_memory_utilization: float | None = None  # CUDA: the device share this worker may use (None: kv_cache_gb)
    hidden_plane: str = "auto"  # how hidden states reach drafts: auto, shm, stream or inline
    hidden_ring_mib: int = 64  # the shared-memory ring per draft stream (plane shm)
    draft_lane: str = "auto"  # auto: a draft stream's messages on a Unix socket when the draft is on this host; off
    # KV tiers below the device pool (workers/engine/kv_tiers.py): host GiB (0: off), disk dir and GiB
    kv_offload_host_gb: float = 0.0
    kv_offload_disk_dir: str | None = None
    kv_offload_disk_gb: float = 16.0
    max_loras: int = 0  # LoRA adapter slots in a batch (0: no adapters; the flag's default: one per lora_modules)
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) adapters loaded at start
    gguf_quantized: bool = False  # a .gguf model's Q4_1 projections stay in the file's blocks
    enable_expert_parallel: bool = False  # a mixture of experts' experts sharded over the tensor-parallel ranks
    scheduling_policy: str = "fcfs"  # vLLM's: fcfs, or priority (each request's priority field, lower first)

    def __post_init__(self):
        if not Path(self.model).exists():
            raise ValueError(f"--model {self.model} does not exist")
        if not self.served_model_name:
            raise ValueError("the served model name must not be empty")
        if any(not name for name in self.served_model_aliases):
            raise ValueError("the served model names must not be empty")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"--max-num-seqs must be positive, got {self.max_num_seqs}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"--scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"--max-model-len must be positive, got {self.max_model_len}")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"--device must be auto, cpu or cuda[:N], got {self.device}")
        if self.attention not in ("auto", "torch", "triton"):
            raise ValueError(f"--attention must be auto, torch or triton, got {self.attention}")
        if self.attention == "triton" and self.device == "cpu" and not triton_interpret():
            raise ValueError("--attention triton needs --device cuda (or TRITON_INTERPRET=1 to run it slowly on CPU)")
        if self.kv_cache_gb <= 0 or self.load_interval <= 0:
            raise ValueError("--kv-cache-gb and --load-interval must be positive")
        if self.threads is not None and self.threads <= 0:
            raise ValueError("--threads must be positive")
        if not 0 < self.propose_min_wait <= self.propose_timeout:
            raise ValueError("--propose-min-wait must be positive and at most --propose-timeout")
        if self.num_speculative_tokens < 0 or self.propose_timeout <= 0:
            raise ValueError("--num-speculative-tokens must be >= 0 and --propose-timeout positive")
        if self.tree_topk < 0 or self.tree_depth < 0:
            raise ValueError("--speculative-eagle-topk and --speculative-num-steps must be >= 0")
        if self.tensor_parallel_size < 1 or self.tensor_parallel_timeout <= 0:
            raise ValueError("--tensor-parallel-size must be >= 1 and --tensor-parallel-timeout positive")
        self._check_shardable()
        if self.role not in ("aggregated", "prefill", "decode"):
            raise ValueError(f"--role must be aggregated, prefill or decode, got {self.role!r}")
        if self.role != "aggregated" and self.tensor_parallel_size > 1:
            raise ValueError("--role prefill/decode does not combine with --tensor-parallel-size > 1 yet")
        if self.kv_transfer_timeout <= 0 or self.kv_handoff_ttl <= 0:
            raise ValueError("--kv-transfer-timeout and --kv-handoff-ttl must be positive")
        if self.role != "aggregated" and self.kv_transfer_timeout >= self.kv_handoff_ttl:
            raise ValueError("--kv-transfer-timeout must be shorter than --kv-handoff-ttl (a pull must end before "
                             "the prefill worker may reuse the blocks)")
        if self.kv_offload_host_gb < 0 or self.kv_offload_disk_gb <= 0:
            raise ValueError("--kv-offload-host-gb must be >= 0 and --kv-offload-disk-gb positive")
        if self.kv_offload_disk_dir and not self.kv_offload_host_gb:
            raise ValueError("--kv-offload-disk-dir needs a host tier (--kv-offload-host-gb > 0): disk blocks load "
                             "through it")
        if self.kv_offload_host_gb and (self.tensor_parallel_size > 1 or not self.enable_prefix_caching):
            raise ValueError("--kv-offload-host-gb needs prefix caching and no tensor parallelism")
        if self.spec_seam not in ("sync", "pipelined"):
            raise ValueError(f"--spec-seam must be sync or pipelined, got {self.spec_seam!r}")
        if self.hidden_plane not in ("auto", "shm", "stream", "inline"):
            raise ValueError(f"--hidden-plane must be auto, shm, stream or inline, got {self.hidden_plane!r}")
        if self.draft_lane not in ("auto", "off"):
            raise ValueError(f"--draft-lane must be auto or off, got {self.draft_lane!r}")
        if self.hidden_ring_mib < 1:
            raise ValueError(f"--hidden-ring-mib must be at least 1, got {self.hidden_ring_mib}")
        if self.max_loras < 0 or self.max_lora_rank <= 0:
            raise ValueError("--max-loras must be >= 0 and --max-lora-rank positive")
        if self.gguf_quantized and (not self.model.endswith(".gguf") or self.tensor_parallel_size > 1):
            raise ValueError("--gguf-quantized needs a .gguf --model and --tensor-parallel-size 1")
        if self.lora_modules and not self.max_loras:
            raise ValueError("--lora-modules needs adapter slots: leave out --max-loras 0 (one slot per adapter is "
                             "the default) or give --max-loras N")
        if self.max_loras and (self.tensor_parallel_size > 1 or self.role != "aggregated"):
            raise ValueError("LoRA adapters (--max-loras, --lora-modules) do not combine with "
                             "--tensor-parallel-size > 1 or --role prefill/decode yet")
        for name, path in self.lora_modules:
            if not name or not (Path(path) / "adapter_config.json").is_file():
                raise ValueError(f"--lora-modules {name}={path}: no adapter_config.json there")
        if self.hidden_layers not in ("auto", "none"):
            try:
                [int(x) for x in self.hidden_layers.split(",")]
            except ValueError:
                raise ValueError(f"--hidden-layers must be auto, none or a comma list of layers, "
                                 f"got {self.hidden_layers!r}") from None


    def _check_shardable(self) -> None:
        """The model is one the engine serves (its config.json parses: family, rope, experts' router),
        and its heads, sizes and experts split over the ranks (a model directory's config; a GGUF file
        is checked when it loads)."""
        from workers.engine.config import ModelConfig
        from workers.engine.parallel import split_heads, split_range

        if not (Path(self.model) / "config.json").exists():
            return
        cfg = ModelConfig.from_dir(self.model)
        size = self.tensor_parallel_size
        for rank in range(size if size > 1 else 0):
            split_heads(cfg.num_heads, cfg.num_kv_heads, rank, size)
            split_range(cfg.intermediate_size, rank, size)
            if cfg.moe is not None and self.enable_expert_parallel:
                cfg.moe.local_experts(rank, size)
            elif cfg.moe is not None:
                split_range(cfg.moe.intermediate_size, rank, size)


def build_parser() -> argparse.ArgumentParser:
    parser = EnvParser(prog="python -m workers.target", description="Tandem target worker")
    add_runtime_args(parser)
    parser.add_argument("--model", default=None, help="model directory or .gguf file (default: the demo SmolLM2)")
    SERVED_MODEL_NAME.add(parser)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: from --kv-cache-gb)")
    for flag in ENGINE_FLAGS:
        flag.add(parser)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="most tokens in one forward pass")
    parser.add_argument("--device", default="auto", help="cpu, cuda or cuda:N; auto = cuda if a GPU is visible")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads per rank (default: all cores, divided among the ranks)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks (one process per device) one target worker's model is split over, Megatron-style; "
                             "on CUDA rank r uses the device after --device's by r (NCCL), on CPU all share it (gloo)")
    parser.add_argument("--tensor-parallel-timeout", type=float, default=60.0,
                        help="the most seconds a rank waits for the others in a collective before the worker goes "
                             "down (a dead rank is noticed at once)")
    parser.add_argument("--attention", default="auto",
                        help="kernels: torch, or triton (GPU: Triton paged attention and fused norm/rotary/SwiGLU); "
                             "auto = triton on CUDA, torch on CPU")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="on CUDA, run decode and verify steps eagerly instead of replaying CUDA graphs")
    parser.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt blocks")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="launch each plain decode step from the previous step's tokens on the device, before "
                             "they reach the host (host bookkeeping one step behind); steps with requests that have a "
                             "grammar or penalties or that a draft worker speculates for, and verify steps, stay "
                             "synchronous")
    parser.add_argument("--load-interval", type=float, default=0.5, help="seconds between load events")
    parser.add_argument("--num-speculative-tokens", "--speculative-num-draft-tokens", type=int, default=4,
                        help="γ: draft tokens verified per step when a draft worker is available (a chain's length, "
                             "a tree's node budget; 0 disables)")
    parser.add_argument("--speculative-eagle-topk", type=int, default=0,
                        help="draft trees: children per node and depth (1: chains; 0: the draft worker's setting)")
    parser.add_argument("--speculative-num-steps", type=int, default=0,
                        help="draft trees: depth, the draft steps per proposal (0: the draft worker's setting)")
    parser.add_argument("--no-load-aware-speculation", action="store_true",
                        help="draft every request's adaptive γ whatever the load (default: each step, give each "
                             "request the draft tokens that maximise expected tokens/s of the whole batch, from a "
                             "cost model of this worker's own steps, down to none under load)")
    parser.add_argument("--load-aware-speculation", action="store_true",
                        help="load-aware budgets (the default; kept for older command lines)")
    parser.add_argument("--no-adaptive-speculation", action="store_true",
                        help="always draft γ tokens (default: γ adapts per request to recent acceptance)")
    parser.add_argument("--spec-seam", default="pipelined", choices=["sync", "pipelined"],
                        help="the draft seam: pipelined (the draft streams proposals ahead, staged for the likely "
                             "outcomes of each round; a step uses what fits its committed tokens and waits for "
                             "nothing), where the draft worker stages (ngram, suffix, oracle; eagle and eagle3 with its "
                             "--eagle-pipelined) and "
                             "proposals are chains (not with --speculative-eagle-topk > 1); else, or with sync, each "
                             "step waits (within --propose-timeout) for the answer to the round it asked")
    parser.add_argument("--propose-timeout", type=float, default=2.0,
                        help="the most seconds to wait for a draft worker's proposals before decoding plainly (the "
                             "wait is three times this worker's own step time, at least 20 ms, within this bound)")
    parser.add_argument("--propose-min-wait", type=float, default=0.02,
                        help="the least seconds a round of proposals is waited for, however fast this worker's steps "
                             "(a loopback gRPC round trip on a busy host)")
    parser.add_argument("--hidden-layers", default="auto",
                        help="hidden-state layers offered to draft workers that read them (EAGLE, Medusa, MLP), kept "
                             "per KV slot: a comma list (0 = embeddings, L = after the final norm), none, or auto = "
                             "EAGLE-3's default layers (2, L/2, L-3) and L")
    parser.add_argument("--hidden-plane", default="auto", choices=["auto", "shm", "stream", "inline"],
                        help="how hidden states reach draft workers: written once per token in this worker's dtype "
                             "to a shared-memory ring (shm: a draft on this host), or sent as chunked rows on the gRPC "
                             "stream (stream: any host), the messages carrying descriptors; auto = shm where the "
                             "draft can map it, else stream; inline = as protobuf tensors in every message (in the "
                             "draft's dtype; for comparison)")
    parser.add_argument("--draft-lane", default="auto", choices=["auto", "off"],
                        help="auto = carry each draft stream's messages (step news, proposals) on a Unix-domain "
                             "socket the draft worker offers when it runs on this host (one system call per "
                             "message instead of gRPC's threads and wake-ups; the handshake stays on gRPC), else "
                             "on the gRPC stream; off = always the gRPC stream")
    parser.add_argument("--hidden-ring-mib", type=int, default=64,
                        help="size of the shared-memory ring of hidden states per draft stream (a batch that finds "
                             "no room in it is streamed instead)")
    parser.add_argument("--draft-tls-ca", default=None,
                        help="reach draft workers over TLS, trusting this CA (PEM; 'system' for the system roots)")
    parser.add_argument("--draft-tls-cert", default=None, help="mutual TLS: this target's certificate (PEM)")
    parser.add_argument("--draft-tls-key", default=None, help="mutual TLS: its key (PEM)")
    parser.add_argument("--role", default="aggregated", choices=["aggregated", "prefill", "decode"],
                        help="prefill/decode disaggregation: aggregated (prefill and decode here), prefill (serve "
                             "prefill.generate: compute prompts and hand their KV to decode workers), or decode "
                             "(serve target.generate and pull handed-off prompts' KV with NIXL)")
    parser.add_argument("--kv-transfer-timeout", type=float, default=5.0,
                        help="decode role: the most seconds a KV pull may take; past it the request prefills here")
    parser.add_argument("--kv-handoff-ttl", type=float, default=30.0,
                        help="prefill role: seconds handed-off KV blocks wait for their decode worker before they "
                             "are freed")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds open requests get on SIGTERM")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    return apply_env_defaults(parser)


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def target_config(args: argparse.Namespace, model: Path) -> TargetConfig:
    names = args.served_model_name or [model.stem if model.suffix == ".gguf" else model.name]
    adapters = tuple(lora_module(m) for m in args.lora_modules)
    return TargetConfig(str(model), names[0], args.block_size, args.num_blocks, args.max_num_seqs,
                        args.max_num_batched_tokens, args.max_model_len, args.kv_cache_gb, args.dtype, args.device,
                        args.threads, args.attention, not args.no_prefix_caching, args.load_interval,
                        args.num_speculative_tokens, args.propose_timeout, not args.no_adaptive_speculation,
                        not args.no_cuda_graphs, args.speculative_eagle_topk, args.speculative_num_steps,
                        not args.no_load_aware_speculation, args.hidden_layers, args.propose_min_wait,
                        args.tensor_parallel_size, args.tensor_parallel_timeout, args.role, args.kv_transfer_timeout,
                        args.kv_handoff_ttl, args.async_scheduling, args.spec_seam,
                        served_model_aliases=tuple(dict.fromkeys(n for n in names[1:] if n != names[0])),
                        gpu_memory_utilization=args.gpu_memory_utilization, hidden_plane=args.hidden_plane,
                        hidden_ring_mib=args.hidden_ring_mib, draft_lane=args.draft_lane,
                        kv_offload_host_gb=args.kv_offload_host_gb,
                        kv_offload_disk_dir=args.kv_offload_disk_dir, kv_offload_disk_gb=args.kv_offload_disk_gb,
                        max_loras=max_loras(args.max_loras, len(adapters)), max_lora_rank=args.max_lora_rank,
                        lora_modules=adapters,
                        gguf_quantized=args.gguf_quantized, enable_expert_parallel=args.enable_expert_parallel,
                        scheduling_policy=args.scheduling_policy)


def lora_module(spec: str) -> tuple[str, str]:
    """``NAME=PATH`` of ``--lora-modules``."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes NAME=PATH, got {spec!r}")
    return name, path


def chat_template(model_dir: Path) -> str:
    """The chat template shipped with the model, if any."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    cfg = model_dir / "tokenizer_config.json"
    if cfg.exists():
        template = json.loads(cfg.read_text()).get("chat_template") or ""
        return template if isinstance(template, str) else ""
    return ""


def plane_offer(engine, cfg: TargetConfig):
    """The hidden-state planes this target offers its drafts (None: inline tensors only)."""
    from workers.speculation.convert import dtype_name
    from workers.speculation.hidden_plane import PlaneOffer

    if engine.hidden is None or cfg.hidden_plane == "inline":
        return None
    return PlaneOffer(engine.hidden.hidden_size, dtype_name(engine.hidden.dtype), cfg.hidden_plane,
                      cfg.hidden_ring_mib << 20)


def client_tls(args: argparse.Namespace):
    """TLS towards draft workers from the flags (None: plaintext)."""
    from runtime.tls import ClientTls

    if not (args.draft_tls_ca or args.draft_tls_cert or args.draft_tls_key):
        return None
    tls = ClientTls(None if args.draft_tls_ca == "system" else args.draft_tls_ca, args.draft_tls_cert,
                    args.draft_tls_key)
    tls.credentials()  # the files exist and read
    return tls


async def amain(args: argparse.Namespace) -> None:
    from workers.target.worker import TargetWorker

    if args.model:
        model_path = Path(args.model)
    else:
        from workers.demo_model import demo_model_dir

        model_path = await asyncio.to_thread(demo_model_dir)
    cfg = target_config(args, model_path)
    runtime_config = config_from_args(args, drain_timeout=args.drain_timeout)
    async with Runtime.connect(runtime_config) as rt:
        from workers.target.draft_pool import DraftPool

        engine_executor = torch_thread("engine-step")  # built where it steps: one OpenMP team
        engine = await asyncio.get_running_loop().run_in_executor(engine_executor, build_engine, cfg, rt.instance_id)
        ignored = gpu_memory_utilization_ignored(cfg.gpu_memory_utilization, engine.runner.device.type, cfg.num_blocks)
        if ignored:
            log.warning("%s", ignored)
        followers = engine.runner.followers
        failed: list[str] = []
        if followers is not None:
            loop = asyncio.get_running_loop()

            def rank_failed(reason: str) -> None:  # on the event loop: deregister now, drain, exit 1
                if not failed:
                    log.error("tensor-parallel group failed (%s): taking this worker down", reason)
                failed.append(reason)
                rt.shutdown()

            followers.on_failure(lambda reason: loop.call_soon_threadsafe(rank_failed, reason))
        engine.handoffs.ttl = cfg.kv_handoff_ttl
        kv_agent = None
        if cfg.role != "aggregated":
            from workers.target.kv_transfer import KvAgent, kv_regions, layout_of

            kv_agent = KvAgent(f"tandem-{rt.instance_id}", kv_regions(engine), layout_of(engine, cfg.served_model_name))
            await rt.register_kv_agent(kv_agent.record(rt.instance_id))
        pool = receiver = None
        if cfg.role != "prefill":
            drafts = await rt.client("draft", "speculate")
            pool = DraftPool(rt.instance_id, cfg.served_model_name, engine.vocab_size, drafts.instances,
                             hidden_layers=engine.hidden_layers, tls=client_tls(args),
                             pipelined=cfg.spec_seam == "pipelined" and cfg.tree_topk <= 1, plane=plane_offer(engine, cfg),
                             lanes=cfg.draft_lane == "auto")
        if cfg.role == "decode":
            from workers.target.disagg import DisaggStats, KvReceiver

            agents = await rt.kv_agents()
            receiver = KvReceiver(kv_agent, agents.values, rt.publish, DisaggStats(), cfg.kv_transfer_timeout)
        model_dir = model_path.parent if model_path.suffix == ".gguf" else model_path
        card = ModelCard(
            name=cfg.served_model_name,
            aliases=list(cfg.served_model_aliases),
            role="prefill" if cfg.role == "prefill" else "target",
            tokenizer_path=str(model_dir),
            context_length=engine.max_model_len,
            kv_block_size=cfg.block_size,
            eos_token_ids=sorted(engine.eos_token_ids),
            chat_template=chat_template(model_dir),
            num_speculative_tokens=cfg.num_speculative_tokens,
            structured_outputs=engine.grammars is not None,
        )

        async def on_adapter(name: str, loaded: bool) -> None:  # an adapter's card: the base's, renamed
            if loaded:
                await rt.register_model(msgspec.structs.replace(card, name=name, aliases=[], parent=cfg.served_model_name))
            else:
                await rt.unregister_model(name)

        worker = TargetWorker(engine, rt.instance_id, rt.publish, cfg.served_model_name, cfg.load_interval,
                              pool=pool, propose_timeout=cfg.propose_timeout, propose_min_wait=cfg.propose_min_wait,
                              epoch=rt.started_at, role=cfg.role, receiver=receiver, on_adapter=on_adapter,
                              executor=engine_executor)
        await worker.start()
        rt.add_health_check(lambda: worker.healthy and not failed)
        REGISTRY.register(TargetCollector(worker, cfg.served_model_name, cfg.served_model_aliases))
        if cfg.role == "prefill":
            await rt.subscribe(kv_release_topic(rt.instance_id), KvRelease, worker.keeper.on_release)
        await rt.subscribe(TOPIC_KV_DUMP, KvDumpRequest, lambda req: asyncio.ensure_future(worker.on_dump_request(req)))
        await rt.register_model(card)
        if engine.lora is not None:
            for name in engine.lora.names:
                await on_adapter(name, True)
            await rt.serve("target", "lora", worker.lora_admin, LoraAdmin, role="target", model=cfg.served_model_name)
        # The instance record goes last: once it is visible, the model card is there too.
        if cfg.role == "prefill":
            await rt.serve("prefill", "generate", worker.prefill, GenerateRequest, role="prefill",
                           model=cfg.served_model_name)
        else:
            await rt.serve("target", "generate", worker.generate, GenerateRequest,
                           role="decode" if cfg.role == "decode" else "target", model=cfg.served_model_name)
        log.info("target worker %s ready (%s): model %s (%d blocks of %d)", rt.instance_id, cfg.role,
                 cfg.served_model_name, engine.blocks.num_blocks, cfg.block_size)
        await rt.wait_for_shutdown()
        # a failed group fails every step at once: the open requests end (and move) without a wait
        await worker.drain(args.drain_timeout)
        await worker.stop()
        if kv_agent is not None:
            kv_agent.close()
        if engine.tiers is not None:
            await asyncio.to_thread(engine.tiers.close)
        if followers is not None:
            await asyncio.to_thread(followers.close)
    if failed:
        raise SystemExit(1)


def main(argv=None) -> None:
    args = parse_args(argv)
    # without --model the demo model is fetched later, in the service: the other flags are checked
    # against a stand-in directory meanwhile
    model = Path(args.model) if args.model else Path(__file__).parent
    exit_on_bad_config("python -m workers.target", lambda: client_tls(args), lambda: check_log_level(args.log_level),
                       lambda: config_from_args(args, drain_timeout=args.drain_timeout),
                       lambda: target_config(args, model))
    run_service(lambda: amain(args), args.log_level)


if __name__ == "__main__":
    main()
