"""Draft worker: serves proposals to target workers over gRPC; registers as component ``draft``.

Usage: python -m workers.draft --method ngram --grpc-port 0
       python -m workers.draft --method eagle3 --eagle-model HEAD --target-model TARGET --device cuda
       (etcd / NATS / namespace from --etcd/--nats/--namespace or TANDEM_ETCD/TANDEM_NATS/TANDEM_NAMESPACE)
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from workers.openmp import configure_waiting, torch_thread

configure_waiting(spin=False)  # before torch loads: its idle intra-op threads sleep (see workers.openmp)

import grpc
from prometheus_client import REGISTRY

from proto import spec_pb2_grpc
from runtime import Runtime
from runtime.config import EnvParser, add_runtime_args, apply_env_defaults, config_from_args
from runtime.messages import ModelCard
from runtime.errors import StartupError
from runtime.flags import SERVED_MODEL_NAME, first_name
from runtime.service import check_log_level, exit_on_bad_config, run_service
from runtime.tls import ServerTls

from .config import DTYPES, TENSOR_METHODS, DraftConfig
from .methods import BENCH_METHODS, METHODS
from .metrics import DraftCollector
from .ngram import NgramProposer
from .drafter import Drafter
from .service import DraftService

log = logging.getLogger("workers.draft")


def build_parser() -> argparse.ArgumentParser:
    parser = EnvParser(prog="python -m workers.draft", description="Tandem draft worker")
    add_runtime_args(parser)
    parser.add_argument("--draft-method", "--method", dest="method", choices=(*METHODS, *BENCH_METHODS), default="ngram",
                        help="draft method")
    SERVED_MODEL_NAME.add(parser, "--model-name", dest="model_name", default=[""],
                          help="served model name of the targets this draft serves ('' = any; of several, the "
                               "first, the one targets register under)")
    parser.add_argument("--grpc-host", default="127.0.0.1", help="address the gRPC server binds")
    parser.add_argument("--grpc-port", type=int, default=0, help="0: any free port")
    parser.add_argument("--advertise-host", default=None,
                        help="host targets should dial (default: --grpc-host; set it when listening on 0.0.0.0)")
    parser.add_argument("--draft-model", default=None, help="draft LM directory or .gguf (method draft_model)")
    parser.add_argument("--eagle-model", "--head-model", dest="eagle_model", default=None,
                        help="draft head directory (methods eagle3, eagle, medusa, mlp_speculator)")
    parser.add_argument("--target-model", default=None,
                        help="the target's model directory: heads use its config, embedding and LM head "
                             "(methods eagle3, eagle, medusa, mlp_speculator)")
    parser.add_argument("--device", default="auto",
                        help="where a model-based draft (eagle3, eagle, draft_model, medusa, mlp_speculator) runs: "
                             "auto, cpu, cuda or cuda:N; auto = cuda if a GPU is visible. ngram and suffix ignore it")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="the draft's weights and compute dtype; auto = bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run an EAGLE head's chain steps eagerly on CUDA instead of replaying CUDA graphs")
    parser.add_argument("--num-blocks", type=int, default=2048, help="draft KV cache blocks (draft_model, eagle)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per draft KV cache block")
    parser.add_argument("--no-overlap", action="store_true", help="do not draft ahead while the target verifies")
    parser.add_argument("--stage-alternatives", type=int, default=1,
                        help="pipelined seam (ngram, suffix, oracle, eagle, eagle3): bonus-token guesses staged per rejected depth "
                             "(0: only the branch where everything is accepted, a rolling tail)")
    parser.add_argument("--eagle-pipelined", action="store_true",
                        help="eagle, eagle3: stage branches for the pipelined seam (off by default: on an H200 the "
                             "served demo's staged EAGLE-3 head had no proposal in time for any of 1,325 steps and "
                             "cost the target 0.9 ms a step; without it an EAGLE head serves the synchronous seam)")
    parser.add_argument("--oracle-file", default=None,
                        help="benchmarks only (method oracle): JSON list of reference token sequences")
    parser.add_argument("--oracle-error-rate", type=float, default=0.0, help="method oracle: wrong-token probability")
    parser.add_argument("--oracle-vocab-size", type=int, default=49152, help="method oracle: vocabulary for wrong tokens")
    parser.add_argument("--oracle-token-cost-ms", type=float, default=0.0,
                        help="method oracle: emulated cost of drafting one token (a sleep, as on a separate device)")
    parser.add_argument("--ngram-min", type=int, default=1, help="method ngram: shortest n-gram to match")
    parser.add_argument("--ngram-max", type=int, default=4, help="method ngram: longest n-gram to match")
    parser.add_argument("--suffix-max-depth", type=int, default=24,
                        help="method suffix: tokens per suffix-tree path (the longest match plus what may follow it)")
    parser.add_argument("--suffix-spec-factor", type=float, default=1.0,
                        help="method suffix: tokens proposed per matched token (bounded by the target's γ)")
    parser.add_argument("--suffix-min-token-prob", type=float, default=0.1,
                        help="method suffix: stop a proposal once its estimated probability falls below this")
    parser.add_argument("--suffix-max-cached-outputs", type=int, default=10_000,
                        help="method suffix: finished outputs kept in the global tree, oldest evicted first (0: none)")
    parser.add_argument("--suffix-max-cached-nodes", type=int, default=500_000,
                        help="method suffix: node cap of the global tree (about 300 B each; oldest outputs evicted first)")
    parser.add_argument("--num-speculative-tokens", "--max-speculative-tokens", dest="max_speculative_tokens", type=int,
                        default=16, help="most draft tokens per proposal (a target asking for more gets this many)")
    parser.add_argument("--speculative-eagle-topk", type=int, default=1,
                        help="draft trees (every method but oracle): children per node and depth; 1 drafts chains. "
                             "Targets may ask per request")
    parser.add_argument("--speculative-num-steps", type=int, default=0,
                        help="draft trees: depth (draft steps per proposal); 0: as deep as the node budget")
    parser.add_argument("--online-distill", action="store_true",
                        help="method eagle3: train the head on the traffic it serves, in a background process, and "
                             "swap in candidates that accept more on held-back recent traffic (docs/speculative.md)")
    parser.add_argument("--distill-share", type=float, default=0.5,
                        help="--online-distill: share of its time the trainer may compute, in (0, 1]")
    parser.add_argument("--distill-threads", type=int, default=1, help="--online-distill: the trainer's torch threads")
    parser.add_argument("--distill-buffer-tokens", type=int, default=65536,
                        help="--online-distill: tokens of recent traffic kept for training (oldest dropped first)")
    parser.add_argument("--distill-min-tokens", type=int, default=2048,
                        help="--online-distill: training starts once this many tokens were recorded")
    parser.add_argument("--distill-lr", type=float, default=1e-4, help="--online-distill: AdamW learning rate")
    parser.add_argument("--distill-eval-every", type=int, default=20,
                        help="--online-distill: optimizer steps between evaluations of the candidate")
    parser.add_argument("--distill-min-gain", type=float, default=0.02,
                        help="--online-distill: held-back acceptance length a candidate must add to be swapped in")
    parser.add_argument("--distill-dir", default=None,
                        help="--online-distill: write every accepted head here (speculators layout, LATEST names "
                             "the newest)")
    parser.add_argument("--distill-follow", default=None,
                        help="method eagle3: serve each head another worker's --distill-dir receives (polled every 5 s)")
    parser.add_argument("--grpc-tls-cert", default=None, help="serve gRPC over TLS with this PEM certificate")
    parser.add_argument("--grpc-tls-key", default=None, help="the certificate's PEM key")
    parser.add_argument("--grpc-tls-client-ca", default=None,
                        help="mutual TLS: targets must present a certificate signed by this CA")
    parser.add_argument("--drain-timeout", type=float, default=5.0, help="seconds open streams get on SIGTERM")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    return apply_env_defaults(parser)


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def draft_config(args: argparse.Namespace) -> DraftConfig:
    """The worker's :class:`DraftConfig` from its flags (``ValueError`` for a bad combination)."""
    return DraftConfig(
        method=args.method, model_name=first_name(args.model_name) or "", device=args.device, dtype=args.dtype,
        grpc_host=args.grpc_host, grpc_port=args.grpc_port, advertise_host=args.advertise_host,
        draft_model=args.draft_model, eagle_model=args.eagle_model, target_model=args.target_model,
        num_blocks=args.num_blocks, block_size=args.block_size, overlap=not args.no_overlap,
        stage_alternatives=args.stage_alternatives, eagle_pipelined=args.eagle_pipelined,
        cuda_graphs=not args.no_cuda_graphs,
        oracle_file=args.oracle_file, oracle_error_rate=args.oracle_error_rate, oracle_vocab_size=args.oracle_vocab_size,
        oracle_token_cost_ms=args.oracle_token_cost_ms, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
        suffix_max_depth=args.suffix_max_depth, suffix_spec_factor=args.suffix_spec_factor,
        suffix_min_token_prob=args.suffix_min_token_prob, suffix_max_cached_outputs=args.suffix_max_cached_outputs,
        suffix_max_cached_nodes=args.suffix_max_cached_nodes, max_speculative_tokens=args.max_speculative_tokens,
        tree_topk=args.speculative_eagle_topk, tree_depth=args.speculative_num_steps,
        online_distill=args.online_distill, distill_share=args.distill_share, distill_threads=args.distill_threads,
        distill_buffer_tokens=args.distill_buffer_tokens, distill_min_tokens=args.distill_min_tokens,
        distill_lr=args.distill_lr, distill_eval_every=args.distill_eval_every, distill_min_gain=args.distill_min_gain,
        distill_dir=args.distill_dir, distill_follow=args.distill_follow, grpc_tls_cert=args.grpc_tls_cert,
        grpc_tls_key=args.grpc_tls_key, grpc_tls_client_ca=args.grpc_tls_client_ca, drain_timeout=args.drain_timeout)


def make_proposer(cfg: DraftConfig) -> Drafter:
    """The drafter ``cfg`` asks for, a model-based one on ``cfg``'s device in its dtype."""
    if cfg.method == "ngram":
        return NgramProposer(cfg.ngram_min, cfg.ngram_max, cfg.tree_topk)
    if cfg.method == "suffix":
        from .suffix import SuffixConfig, SuffixProposer

        try:
            return SuffixProposer(SuffixConfig(cfg.suffix_max_depth, cfg.suffix_spec_factor, cfg.suffix_min_token_prob,
                                               cfg.suffix_max_cached_outputs, cfg.suffix_max_cached_nodes,
                                               cfg.tree_topk, cfg.tree_depth))
        except ValueError as exc:
            raise SystemExit(f"--method suffix: {exc}") from None
    if cfg.method == "oracle":
        from .oracle import OracleProposer

        if not cfg.oracle_file:
            raise SystemExit("--method oracle needs --oracle-file")
        return OracleProposer.from_file(cfg.oracle_file, cfg.oracle_error_rate, cfg.oracle_vocab_size,
                                        token_cost_s=cfg.oracle_token_cost_ms / 1000)
    device, dtype = cfg.torch_device, cfg.torch_dtype
    if cfg.method == "draft_model":
        if not cfg.draft_model:
            raise SystemExit("--method draft_model needs --draft-model PATH")
        from ..engine.weights import load_model
        from .draft_model import DraftModelProposer

        return DraftModelProposer(load_model(cfg.draft_model, dtype=dtype, device=device), cfg.num_blocks,
                                  cfg.block_size, tree_topk=cfg.tree_topk, tree_depth=cfg.tree_depth)
    if cfg.method in ("eagle", "eagle3"):  # the head's config says which EAGLE it is
        if not cfg.eagle_model or not cfg.target_model:
            raise SystemExit(f"--method {cfg.method} needs --eagle-model PATH and --target-model PATH")
        from .eagle import load_eagle, load_target_parts, place_head
        from .eagle_proposer import EagleProposer

        embed, lm_head, target_cfg = load_target_parts(cfg.target_model)
        head, layers = load_eagle(cfg.eagle_model, embed, lm_head, target_cfg, target_cfg.max_position_embeddings)
        return EagleProposer(place_head(head, device, dtype), layers, cfg.num_blocks, cfg.block_size,
                             tree_topk=cfg.tree_topk, tree_depth=cfg.tree_depth,
                             cuda_graphs=cfg.cuda_graphs and device.type == "cuda", staging=cfg.eagle_pipelined)
    if cfg.method in ("medusa", "mlp_speculator"):
        if not cfg.eagle_model or not cfg.target_model:
            raise SystemExit(f"--method {cfg.method} needs --head-model PATH and --target-model PATH")
        from .eagle import load_target_parts
        from .head_proposer import HeadProposer
        from .spec_heads import head_kind, load_spec_head

        kind = head_kind(cfg.eagle_model)
        if kind != cfg.method:
            raise SystemExit(f"--method {cfg.method}: {cfg.eagle_model} holds "
                             f"{'a ' + kind + ' head' if kind else 'no Medusa or MLP speculator head'}")
        _, lm_head, target_cfg = load_target_parts(cfg.target_model)
        try:
            head = load_spec_head(cfg.eagle_model, target_cfg.hidden_size, target_cfg.vocab_size, lm_head)
        except ValueError as exc:
            raise SystemExit(f"--method {cfg.method}: {exc}") from None
        return HeadProposer(head.to(device=device, dtype=dtype), target_cfg.num_layers, tree_topk=cfg.tree_topk,
                            tree_depth=cfg.tree_depth)
    raise ValueError(f"unknown draft method {cfg.method!r}")


def start_distillation(cfg: DraftConfig, proposer: Drafter, service: DraftService) -> list:
    """Online distillation and/or following another worker's heads, as the flags ask; returns what
    to stop at shutdown. New weights reach the drafter through the service's queue."""
    loop = asyncio.get_running_loop()

    def on_swap(state) -> None:  # from a background thread
        loop.call_soon_threadsafe(service.swap_weights, state)

    started = []
    if not proposer.caps.distillable:
        if cfg.online_distill or cfg.distill_follow:
            raise StartupError(f"--online-distill / --distill-follow: {cfg.eagle_model} is not an EAGLE-3 head")
        return started
    if cfg.online_distill:
        from .online import Distiller

        # the trainer computes where the head serves (float32 master weights there, whatever the serving dtype)
        distiller = Distiller(cfg.distill_config(str(proposer.device)), on_swap)
        proposer.recorder = distiller.recorder
        service.distiller = distiller
        distiller.start()
        started.append(distiller)
    if cfg.distill_follow:
        from .online import Follower

        follower = Follower(cfg.distill_follow, lambda path: followed_weights(proposer, path, cfg.target_model),
                            on_swap)
        follower.start()
        started.append(follower)
    return started


def followed_weights(proposer, path, target_model: str) -> dict:
    """The trainable weights of the head at ``path``, if it fits the serving one (same projection and
    draft vocabulary: a head trained online from the same start)."""
    import torch

    from .eagle import load_eagle, load_target_parts
    from .online import trainable_state

    head = proposer.head
    embed, lm_head, target_cfg = load_target_parts(target_model)
    new, _ = load_eagle(path, embed, lm_head, target_cfg, target_cfg.max_position_embeddings)
    serving_fc = head.fc.weight.float().cpu()  # in the serving dtype: compare the new one rounded alike
    if not torch.equal(new.d2t.cpu(), head.d2t.cpu()) or not torch.allclose(
            new.fc.weight.to(head.fc.weight.dtype).float().cpu(), serving_fc):
        raise ValueError("its draft vocabulary or projection differs from the serving head's (not trained from it)")
    return trainable_state(new)


def server_tls(cfg: DraftConfig) -> ServerTls | None:
    """TLS for the gRPC server from the flags (None: plaintext); ValueError for a half-given pair."""
    if not (cfg.grpc_tls_cert or cfg.grpc_tls_key or cfg.grpc_tls_client_ca):
        return None
    if not (cfg.grpc_tls_cert and cfg.grpc_tls_key):
        raise ValueError("--grpc-tls-cert and --grpc-tls-key go together")
    tls = ServerTls(cfg.grpc_tls_cert, cfg.grpc_tls_key, cfg.grpc_tls_client_ca)
    tls.credentials()  # the files exist and read
    return tls


async def amain(args: argparse.Namespace, cfg: DraftConfig) -> None:
    tls = server_tls(cfg)
    torch_work = torch_thread("draft-torch")  # loads the draft where it proposes: one OpenMP team
    try:
        proposer = await asyncio.get_running_loop().run_in_executor(torch_work, make_proposer, cfg)
    except (ValueError, OSError) as exc:  # a checkpoint that does not load: one line, not a traceback
        raise StartupError(f"--method {cfg.method}: cannot load the draft: {exc}") from None
    if cfg.method in TENSOR_METHODS:
        log.info("draft %s on %s in %s", cfg.method, proposer.device, str(cfg.torch_dtype).removeprefix("torch."))
    config = config_from_args(args, drain_timeout=cfg.drain_timeout)
    async with Runtime.connect(config) as rt:
        service = DraftService(proposer, rt.instance_id, cfg.max_speculative_tokens, overlap=cfg.overlap,
                               alternatives=cfg.stage_alternatives, executor=torch_work)
        REGISTRY.register(DraftCollector(service, cfg.model_name or "draft", cfg.method))
        await service.start()
        distilling = start_distillation(cfg, proposer, service)
        # gRPC sets SO_REUSEPORT by default: a second server could then bind a port already in use
        # (asked-for or picked by port 0, grpc/grpc#10755) and targets would reach the wrong process.
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                          ("grpc.max_send_message_length", 64 << 20),
                                          ("grpc.so_reuseport", 0)])
        spec_pb2_grpc.add_DraftServiceServicer_to_server(service, server)
        listen = f"{cfg.grpc_host}:{cfg.grpc_port}"
        try:
            port = server.add_secure_port(listen, tls.credentials()) if tls else server.add_insecure_port(listen)
        except RuntimeError as exc:
            raise SystemExit(f"draft worker: cannot listen for gRPC on {listen} (address in use?)") from exc
        await server.start()
        address = f"{cfg.advertise_host or cfg.grpc_host}:{port}"
        await rt.register_model(ModelCard(name=cfg.model_name or "draft", role="draft", spec_method=cfg.method,
                                          num_speculative_tokens=cfg.max_speculative_tokens))
        # Discovery carries the gRPC address; targets never reach a draft worker over NATS.
        await rt.register("draft", "speculate", role="draft", model=cfg.model_name, grpc_address=address)
        log.info("draft worker %s ready: method %s, gRPC on %s", rt.instance_id, cfg.method, address)
        await rt.wait_for_shutdown()
        await server.stop(grace=cfg.drain_timeout)
        for part in distilling:
            await asyncio.to_thread(part.stop)
        await service.stop()


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg: list[DraftConfig] = []
    exit_on_bad_config("python -m workers.draft", lambda: cfg.append(draft_config(args)),
                       lambda: server_tls(cfg[0]),
                       lambda: check_log_level(args.log_level),
                       lambda: config_from_args(args, drain_timeout=args.drain_timeout))
    run_service(lambda: amain(args, cfg[0]), args.log_level)


if __name__ == "__main__":
    main()
