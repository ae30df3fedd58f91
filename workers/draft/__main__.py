"""Draft worker: serves proposals to target workers over gRPC; registers as component ``draft``.

Usage: python -m workers.draft --draft-method ngram --grpc-port 0
       python -m workers.draft --draft-method eagle3 --eagle-model HEAD --target-model TARGET --device cuda
       python -m workers.draft --speculative-config '{"method": "ngram", "prompt_lookup_max": 3}'
       (etcd / NATS / namespace from --etcd/--nats/--namespace or TANDEM_ETCD/TANDEM_NATS/TANDEM_NAMESPACE)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from workers.openmp import configure_waiting, torch_thread

configure_waiting(spin=False)  # before torch loads: its idle intra-op threads sleep (see workers.openmp)

import grpc
from prometheus_client import REGISTRY

from proto import spec_pb2_grpc
from runtime import Runtime
from runtime.config import EnvParser, add_runtime_args, apply_env_defaults, config_from_args, flag_env
from runtime.messages import ModelCard
from runtime.errors import StartupError
from runtime.flags import SERVED_MODEL_NAME, first_name
from runtime.service import check_log_level, exit_on_bad_config, run_service
from runtime.tls import ServerTls

from workers.speculation.methods import BENCH_METHODS, HEAD_METHODS, METHODS
from workers.speculation.spec_config import SPECULATIVE_CONFIG_HELP, speculative_config

from .config import (DISTILL_CONFIG_HELP, DISTILL_FLAG, DTYPES, TENSOR_METHODS, DraftConfig, GrpcSettings,
                     distill_settings)
from .metrics import DraftCollector
from .ngram import NgramProposer
from .drafter import Drafter
from .service import DraftService

log = logging.getLogger("workers.draft")
PROG = "python -m workers.draft"


SPEC = "--speculative-config"
# Flags the draft worker had until issue #55 folded them into --speculative-config and --distill-config,
# each with where its setting went: an old command line fails with one line giving the way forward
# (EnvParser.retire), not argparse's bare "unrecognized arguments".
RETIRED_FLAGS = {
    "--ngram-min": f"{SPEC} '{{\"prompt_lookup_min\": N}}'",
    "--ngram-max": f"{SPEC} '{{\"prompt_lookup_max\": N}}'",
    "--suffix-max-depth": f"{SPEC} '{{\"suffix_decoding_max_tree_depth\": N}}'",
    "--suffix-spec-factor": f"{SPEC} '{{\"suffix_decoding_max_spec_factor\": X}}'",
    "--suffix-min-token-prob": f"{SPEC} '{{\"suffix_decoding_min_token_prob\": P}}'",
    "--suffix-max-cached-outputs": f"{SPEC} '{{\"suffix_decoding_max_cached_requests\": N}}'",
    "--suffix-max-cached-nodes": f"{SPEC} '{{\"suffix_decoding_max_cached_nodes\": N}}'",
    "--oracle-file": f"{SPEC} '{{\"oracle_file\": \"PATH\"}}'",
    "--oracle-error-rate": f"{SPEC} '{{\"oracle_error_rate\": P}}'",
    "--oracle-vocab-size": f"{SPEC} '{{\"oracle_vocab_size\": N}}'",
    "--oracle-token-cost-ms": f"{SPEC} '{{\"oracle_token_cost_ms\": MS}}'",
    "--num-speculative-tokens": f"{SPEC} '{{\"max_num_speculative_tokens\": N}}' (the most a target may ask "
                                "of this draft; γ itself is the target's)",
    "--max-speculative-tokens": f"{SPEC} '{{\"max_num_speculative_tokens\": N}}'",
    "--speculative-eagle-topk": f"{SPEC} '{{\"eagle_topk\": K}}'",
    "--speculative-num-steps": f"{SPEC} '{{\"num_steps\": N}}'",
    "--no-overlap": f"{SPEC} '{{\"overlap\": false}}'",
    "--stage-alternatives": f"{SPEC} '{{\"stage_alternatives\": N}}'",
    "--eagle-pipelined": f"{SPEC} '{{\"eagle_pipelined\": true}}'",
    **{f"--distill-{key.replace('_', '-')}": f"{DISTILL_FLAG} '{{\"{key}\": {value}}}'" for key, value in (
        ("share", "X"), ("threads", "N"), ("buffer_tokens", "N"), ("min_tokens", "N"), ("lr", "X"),
        ("eval_every", "N"), ("min_gain", "X"), ("dir", '"DIR"'), ("follow", '"DIR"'))},
}


def build_parser() -> argparse.ArgumentParser:
    parser = EnvParser(prog=PROG, description="Tandem draft worker")
    add_runtime_args(parser)
    parser.retire({flag: f"use {where}" for flag, where in RETIRED_FLAGS.items()})
    parser.add_argument("--draft-method", "--method", dest="method", choices=(*METHODS, *BENCH_METHODS), default=None,
                        help=f"draft method (default: {SPEC}'s 'method', else ngram)")
    SERVED_MODEL_NAME.add(parser, "--model-name", dest="model_name", default=[""],
                          help="served model name of the targets this draft serves ('' = any; of several, the "
                               "first, the one targets register under)")
    parser.add_argument("--grpc-host", default="127.0.0.1", help="address the gRPC server binds")
    parser.add_argument("--grpc-port", type=int, default=0, help="0: any free port")
    parser.add_argument("--advertise-host", default=None,
                        help="host targets should dial (default: --grpc-host; set it when listening on 0.0.0.0)")
    parser.add_argument("--draft-model", default=None,
                        help=f"draft LM directory or .gguf (method draft_model; or {SPEC}'s 'model')")
    parser.add_argument("--eagle-model", "--head-model", dest="eagle_model", default=None,
                        help=f"draft head directory (methods eagle3, eagle, medusa, mlp_speculator; or {SPEC}'s "
                             "'model')")
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
    parser.add_argument("--num-blocks", type=int, default=2048,
                        help="draft KV cache blocks (draft_model, eagle, eagle3)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per draft KV cache block")
    parser.add_argument(SPEC, dest="speculative_config", default=None, metavar="JSON", help=SPECULATIVE_CONFIG_HELP)
    parser.add_argument("--online-distill", action="store_true",
                        help="method eagle3: train the head on the traffic it serves, in a background process, and "
                             f"swap in candidates that accept more on held-back recent traffic ({DISTILL_FLAG} tunes "
                             "it; docs/speculative.md)")
    parser.add_argument(DISTILL_FLAG, dest="distill_config", default=None, metavar="JSON", help=DISTILL_CONFIG_HELP)
    parser.add_argument("--grpc-tls-cert", default=None, help="serve gRPC over TLS with this PEM certificate")
    parser.add_argument("--grpc-tls-key", default=None, help="the certificate's PEM key")
    parser.add_argument("--grpc-tls-client-ca", default=None,
                        help="mutual TLS: targets must present a certificate signed by this CA")
    parser.add_argument("--drain-timeout", type=float, default=5.0, help="seconds open streams get on SIGTERM")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    return apply_env_defaults(parser)


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _one(flag: str, value, key: str, spec_value):
    """A flag and a ``--speculative-config`` key for one setting: either alone sets it; both must agree."""
    if value is not None and spec_value is not None and value != spec_value:
        raise ValueError(f"{flag} {value} disagrees with {SPEC}'s {key!r} {spec_value!r}")
    return value if value is not None else spec_value


def draft_config(args: argparse.Namespace) -> DraftConfig:
    """The worker's :class:`DraftConfig` from its flags (``ValueError``, one line, for a bad combination)."""
    spec = speculative_config(args.speculative_config, flag_env(SPEC))
    # the method from the flag or the key; neither: vLLM's guess from 'model' (spec.draft_method), else ngram
    method = _one("--draft-method", args.method, "method", spec.method) or spec.draft_method or "ngram"
    if spec.method_problem(method):
        raise ValueError(f"{SPEC}: {spec.method_problem(method)}")
    draft_model, eagle_model = args.draft_model, args.eagle_model
    if spec.model is not None:
        if method in HEAD_METHODS:
            flag_given, eagle_model = eagle_model, _one("--eagle-model", eagle_model, "model", spec.model)
        elif method == "draft_model":
            flag_given, draft_model = draft_model, _one("--draft-model", draft_model, "model", spec.model)
        else:
            raise ValueError(f"{SPEC}'s 'model' is a draft model or head: method {method} takes none")
        if flag_given is None and not os.path.exists(spec.model):  # (a flag's path DraftConfig checks)
            raise ValueError(f"{SPEC}'s 'model' {spec.model} does not exist")
    return DraftConfig(
        method=method, model_name=first_name(args.model_name) or "", device=args.device, dtype=args.dtype,
        draft_model=draft_model, eagle_model=eagle_model, target_model=args.target_model,
        num_blocks=args.num_blocks, block_size=args.block_size, cuda_graphs=not args.no_cuda_graphs, spec=spec,
        grpc=GrpcSettings(host=args.grpc_host, port=args.grpc_port, advertise_host=args.advertise_host,
                          tls_cert=args.grpc_tls_cert, tls_key=args.grpc_tls_key,
                          tls_client_ca=args.grpc_tls_client_ca),
        online_distill=args.online_distill, distill=distill_settings(args.distill_config, flag_env(DISTILL_FLAG)),
        drain_timeout=args.drain_timeout)


def make_proposer(cfg: DraftConfig) -> Drafter:
    """The drafter ``cfg`` asks for, a model-based one on ``cfg``'s device in its dtype."""
    if cfg.method == "ngram":
        return NgramProposer(cfg.spec.prompt_lookup_min, cfg.spec.prompt_lookup_max, cfg.tree_topk)
    if cfg.method == "suffix":
        from .suffix import SuffixConfig, SuffixProposer

        try:
            spec = cfg.spec
            return SuffixProposer(SuffixConfig(
                spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_spec_factor,
                spec.suffix_decoding_min_token_prob, spec.suffix_decoding_max_cached_requests,
                spec.suffix_decoding_max_cached_nodes, cfg.tree_topk, cfg.tree_depth))
        except ValueError as exc:
            raise SystemExit(f"--method suffix: {exc}") from None
    if cfg.method == "oracle":
        from .oracle import OracleProposer

        spec = cfg.spec
        if not spec.oracle_file:
            raise SystemExit(f"--method oracle needs {SPEC} '{{\"oracle_file\": PATH}}'")
        return OracleProposer.from_file(spec.oracle_file, spec.oracle_error_rate, spec.oracle_vocab_size,
                                        token_cost_s=spec.oracle_token_cost_ms / 1000)
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
                             cuda_graphs=cfg.cuda_graphs and device.type == "cuda", staging=cfg.spec.eagle_pipelined)
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
        if cfg.online_distill or cfg.distill.follow:
            raise StartupError(f"--online-distill / {DISTILL_FLAG}'s 'follow': {cfg.eagle_model} is not an EAGLE-3 "
                               "head")
        return started
    if cfg.online_distill:
        from .online import Distiller

        # the trainer computes where the head serves (float32 master weights there, whatever the serving dtype)
        distiller = Distiller(cfg.distill_config(str(proposer.device)), on_swap)
        proposer.recorder = distiller.recorder
        service.distiller = distiller
        distiller.start()
        started.append(distiller)
    if cfg.distill.follow:
        from .online import Follower

        follower = Follower(cfg.distill.follow, lambda path: followed_weights(proposer, path, cfg.target_model),
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
    grpc_cfg = cfg.grpc
    if not grpc_cfg.tls_given:
        return None
    if not (grpc_cfg.tls_cert and grpc_cfg.tls_key):
        raise ValueError("--grpc-tls-cert and --grpc-tls-key go together")
    tls = ServerTls(grpc_cfg.tls_cert, grpc_cfg.tls_key, grpc_cfg.tls_client_ca)
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
        service = DraftService(proposer, rt.instance_id, cfg.spec.max_num_speculative_tokens,
                               overlap=cfg.spec.overlap, alternatives=cfg.spec.stage_alternatives, executor=torch_work,
                               incarnation=rt.incarnation, lora=cfg.spec.draft_lora)
        REGISTRY.register(DraftCollector(service, cfg.model_name or "draft", cfg.method))
        await service.start()
        distilling = start_distillation(cfg, proposer, service)
        # gRPC sets SO_REUSEPORT by default: a second server could then bind a port already in use
        # (asked-for or picked by port 0, grpc/grpc#10755) and targets would reach the wrong process.
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                          ("grpc.max_send_message_length", 64 << 20),
                                          ("grpc.so_reuseport", 0)])
        spec_pb2_grpc.add_DraftServiceServicer_to_server(service, server)
        listen = cfg.grpc.address
        try:
            port = server.add_secure_port(listen, tls.credentials()) if tls else server.add_insecure_port(listen)
        except RuntimeError as exc:
            raise SystemExit(f"draft worker: cannot listen for gRPC on {listen} (address in use?)") from exc
        await server.start()
        address = f"{cfg.grpc.advertise_host or cfg.grpc.host}:{port}"
        await rt.register_model(ModelCard(name=cfg.model_name or "draft", role="draft", spec_method=cfg.method,
                                          num_speculative_tokens=cfg.spec.max_num_speculative_tokens))
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
    exit_on_bad_config(PROG, lambda: cfg.append(draft_config(args)),
                       lambda: server_tls(cfg[0]),
                       lambda: check_log_level(args.log_level),
                       lambda: config_from_args(args, drain_timeout=args.drain_timeout))
    run_service(lambda: amain(args, cfg[0]), args.log_level)


if __name__ == "__main__":
    main()
