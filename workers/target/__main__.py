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
from pathlib import Path

import msgspec
from prometheus_client import REGISTRY

from runtime import Runtime
from runtime.config import EnvParser, add_runtime_args, apply_env_defaults, config_from_args, flag_env, load_interval
from runtime.events import TOPIC_KV_DUMP
from runtime.flags import SERVED_MODEL_NAME
from runtime.messages import GenerateRequest, KvDumpRequest, KvRelease, LoraAdmin, ModelCard
from runtime.names import kv_release_topic
from runtime.service import check_log_level, exit_on_bad_config, run_service
from runtime.settings import build, parse_group
from workers.engine.build import build_engine
from workers.engine.target_config import KvOffload, KvTransfer, Lora, TargetConfig
from workers.speculation.spec_config import SPECULATIVE_CONFIG_HELP, SpeculativeConfig, speculative_config
from workers.target.flags import ENGINE_FLAGS, gpu_memory_utilization_ignored, max_loras
from workers.target.metrics import TargetCollector

log = logging.getLogger("workers.target")


def _spec_key(key: str, value: str = "N") -> str:
    return f"use --speculative-config '{{\"{key}\": {value}}}'"


# flags this worker had, and where each setting went (``python -m workers.target --spec-seam sync``
# exits with one line saying so)
RETIRED_FLAGS = {
    "--speculative-eagle-topk": _spec_key("eagle_topk"), "--speculative-num-steps": _spec_key("num_steps"),
    "--no-load-aware-speculation": _spec_key("load_aware", "false"),
    "--load-aware-speculation": "load-aware budgets are the default (--speculative-config's load_aware)",
    "--no-adaptive-speculation": _spec_key("adaptive", "false"), "--spec-seam": _spec_key("seam", '"sync"'),
    "--propose-timeout": _spec_key("propose_timeout", "SECONDS"),
    "--propose-min-wait": _spec_key("propose_min_wait", "SECONDS"),
    "--hidden-layers": _spec_key("hidden_layers", '"auto"'), "--hidden-plane": _spec_key("hidden_plane", '"shm"'),
    "--draft-lane": _spec_key("draft_lane", '"off"'), "--hidden-ring-mib": _spec_key("hidden_ring_mib"),
    "--draft-tls-ca": _spec_key("draft_tls_ca", '"PATH"'), "--draft-tls-cert": _spec_key("draft_tls_cert", '"PATH"'),
    "--draft-tls-key": _spec_key("draft_tls_key", '"PATH"'),
    "--kv-offload-host-gb": "use --kv-offload-config '{\"host_gb\": N}'",
    "--kv-offload-disk-dir": "use --kv-offload-config '{\"host_gb\": N, \"disk_dir\": \"PATH\"}'",
    "--kv-offload-disk-gb": "use --kv-offload-config '{\"disk_gb\": N}'",
    "--kv-transfer-timeout": "use --kv-transfer-config '{\"transfer_timeout\": SECONDS}'",
    "--kv-handoff-ttl": "use --kv-transfer-config '{\"handoff_ttl\": SECONDS}'",
}
# retired too, but its variable is where the setting went: not refused
LOAD_INTERVAL_RETIRED = {"--load-interval": "set TANDEM_LOAD_INTERVAL=SECONDS"}


def build_parser() -> argparse.ArgumentParser:
    parser = EnvParser(prog="python -m workers.target", description="Tandem target worker")
    parser.retire(RETIRED_FLAGS)
    parser.retire(LOAD_INTERVAL_RETIRED, env=False)
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
    parser.add_argument("--num-speculative-tokens", "--speculative-num-draft-tokens", type=int, default=None,
                        help="γ: draft tokens verified per step when a draft worker is available (a chain's length, "
                             "a tree's node budget; 0 disables; default 4); --speculative-config's "
                             "num_speculative_tokens, as vLLM's flag")
    parser.add_argument("--speculative-config", default=None, metavar="JSON", help=SPECULATIVE_CONFIG_HELP)
    parser.add_argument("--role", default="aggregated", choices=["aggregated", "prefill", "decode"],
                        help="prefill/decode disaggregation: aggregated (prefill and decode here), prefill (serve "
                             "prefill.generate: compute prompts and hand their KV to decode workers), or decode "
                             "(serve target.generate and pull handed-off prompts' KV with NIXL)")
    parser.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                        help="disaggregation's timings as JSON (or @FILE): transfer_timeout (decode: the most seconds "
                             "a KV pull may take before the request prefills here; 5), handoff_ttl (prefill: seconds "
                             "handed-off KV blocks wait for their decode worker before they are freed; 30)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds open requests get on SIGTERM")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    return apply_env_defaults(parser)


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


# the groups' flags, for errors that name the flag a field came from
GROUP_FLAGS = {"spec": "--speculative-config", "kv_offload": "--kv-offload-config",
               "kv_transfer": "--kv-transfer-config", "lora": "--lora-modules", "enable_prefix_caching":
               "--no-prefix-caching", "cuda_graphs": "--no-cuda-graphs", "model": "--model"}


def target_config(args: argparse.Namespace, model: Path) -> TargetConfig:
    """The worker's config from its flags, built once (``ValueError``: one line naming the flag)."""
    names = args.served_model_name or [model.stem if model.suffix == ".gguf" else model.name]
    adapters = tuple(lora_module(m) for m in args.lora_modules)
    spec = speculative_config(args.speculative_config, flag_env("--speculative-config"),
                              num_speculative_tokens=args.num_speculative_tokens)
    return build(
        TargetConfig, flags=GROUP_FLAGS,
        model=str(model), served_model_name=names[0],
        served_model_aliases=tuple(dict.fromkeys(n for n in names[1:] if n != names[0])),
        block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_gb=args.kv_cache_gb,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, scheduling_policy=args.scheduling_policy,
        async_scheduling=args.async_scheduling, dtype=args.dtype, device=args.device, threads=args.threads,
        attention=args.attention, cuda_graphs=not args.no_cuda_graphs, gguf_quantized=args.gguf_quantized,
        tensor_parallel_size=args.tensor_parallel_size, tensor_parallel_timeout=args.tensor_parallel_timeout,
        enable_expert_parallel=args.enable_expert_parallel, load_interval=load_interval(), role=args.role,
        spec=spec, kv_offload=parse_group(KvOffload, "--kv-offload-config", args.kv_offload_config,
                                          flag_env("--kv-offload-config")),
        kv_transfer=parse_group(KvTransfer, "--kv-transfer-config", args.kv_transfer_config,
                                flag_env("--kv-transfer-config")),
        lora=build(Lora, "--lora-modules", max_loras=max_loras(args.max_loras, len(adapters)),
                   max_lora_rank=args.max_lora_rank, modules=adapters))


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

    if engine.hidden is None or cfg.spec.hidden_plane == "inline":
        return None
    return PlaneOffer(engine.hidden.hidden_size, dtype_name(engine.hidden.dtype), cfg.spec.hidden_plane,
                      cfg.spec.hidden_ring_mib << 20)


def client_tls(spec: SpeculativeConfig):
    """TLS towards draft workers from ``--speculative-config``'s draft_tls_* keys (None: plaintext)."""
    from runtime.tls import ClientTls

    if not spec.tls_given:
        return None
    tls = ClientTls(None if spec.draft_tls_ca == "system" else spec.draft_tls_ca, spec.draft_tls_cert,
                    spec.draft_tls_key)
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
        engine.handoffs.ttl = cfg.kv_transfer.handoff_ttl
        kv_agent = None
        if cfg.role != "aggregated":
            from workers.target.kv_transfer import KvAgent, kv_regions, layout_of

            kv_agent = KvAgent(f"tandem-{rt.instance_id}", kv_regions(engine), layout_of(engine, cfg.served_model_name))
            await rt.register_kv_agent(kv_agent.record(rt.instance_id))
        pool = receiver = None
        if cfg.role != "prefill":
            drafts = await rt.client("draft", "speculate")
            pool = DraftPool(rt.instance_id, cfg.served_model_name, engine.vocab_size, drafts.instances,
                             hidden_layers=engine.hidden_layers, tls=client_tls(cfg.spec),
                             pipelined=cfg.spec.seam == "pipelined" and cfg.spec.tree[0] <= 1, plane=plane_offer(engine, cfg),
                             lanes=cfg.spec.draft_lane == "auto", streams=cfg.spec.draft_streams)
        if cfg.role == "decode":
            from workers.target.disagg import DisaggStats, KvReceiver

            agents = await rt.kv_agents()
            receiver = KvReceiver(kv_agent, agents.values, rt.publish, DisaggStats(), cfg.kv_transfer.transfer_timeout)
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
            num_speculative_tokens=cfg.spec.num_speculative_tokens,
            structured_outputs=engine.grammars is not None,
        )

        async def on_adapter(name: str, loaded: bool) -> None:  # an adapter's card: the base's, renamed
            if loaded:
                await rt.register_model(msgspec.structs.replace(card, name=name, aliases=[], parent=cfg.served_model_name))
            else:
                await rt.unregister_model(name)

        worker = TargetWorker(engine, rt.instance_id, rt.publish, cfg.served_model_name, cfg.load_interval,
                              pool=pool, propose_timeout=cfg.spec.propose_timeout, propose_min_wait=cfg.spec.propose_min_wait,
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
    exit_on_bad_config("python -m workers.target", lambda: check_log_level(args.log_level),
                       lambda: config_from_args(args, drain_timeout=args.drain_timeout),
                       lambda: client_tls(target_config(args, model).spec))
    run_service(lambda: amain(args), args.log_level)


if __name__ == "__main__":
    main()
