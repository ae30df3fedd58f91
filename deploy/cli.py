"""The ``tandem`` command: ``tandem up`` (local stack) and ``tandem ray up`` (Ray actors).

Usage: tandem up [--mock] [--targets N] [--drafts M | --draft-kinds suffix:1,eagle3:2] [--http-port 8000]
                 [--planner --planner-args '--itl-p90 50ms'] ...
       tandem ray up --address auto --etcd http://HOST:2379 --nats nats://HOST:4222 [--mock] ...
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys

from deploy.draft_kinds import parse_draft_kinds
from deploy.stack import DRAFT_DTYPES, DRAFT_METHODS, ROUTER_MODES, StackConfig
from frontend.flags import API_KEY, FRONTEND_FLAGS
from runtime.config import DEFAULT_NAMESPACE, EnvParser, apply_env_defaults, flag_env
from runtime.flags import SERVED_MODEL_NAME, first_name
from runtime.service import check_log_level
from workers.speculation.spec_config import PASSED_AS_FLAGS, speculative_config
from workers.target.flags import ENGINE_FLAGS

log = logging.getLogger(__name__)


def add_stack_args(parser: argparse.ArgumentParser) -> None:
    """Flags describing the stack, shared by ``up`` and ``ray up`` (other tools script against these)."""
    parser.add_argument("--model", default=None, help="model directory (default: the bundled SmolLM2-135M demo)")
    SERVED_MODEL_NAME.add(parser)
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="vLLM's speculative config, e.g. '{\"method\": \"eagle3\", \"model\": \"HEAD\", "
                             "\"num_speculative_tokens\": 3}': method and model set --draft-method and --draft-model, "
                             "num_speculative_tokens, eagle_topk and num_steps the flags of those names; every other "
                             "key (the one schema of docs/speculative.md) goes to the target and draft workers as "
                             "given; an unknown key is an error")
    parser.add_argument("--draft-method", choices=DRAFT_METHODS, default=None,
                        help="how draft workers propose tokens (default: eagle3 with the bundled head for the "
                             "demo model, ngram for any other model)")
    parser.add_argument("--draft-model", default=None,
                        help="draft model, or head directory for eagle3 / eagle / medusa / mlp_speculator "
                             "(default for eagle3 on the demo model: the bundled head)")
    parser.add_argument("--num-speculative-tokens", "--speculative-num-draft-tokens", type=int, default=None,
                        help="tokens proposed per round (γ; a tree's node budget)")
    parser.add_argument("--speculative-eagle-topk", type=int, default=None,
                        help="draft trees (every draft method): children per node and depth; 1: chains (the default)")
    parser.add_argument("--speculative-num-steps", type=int, default=None,
                        help="draft trees: depth, the draft steps per proposal (default: as deep as the budget)")
    parser.add_argument("--draft-device", default="auto",
                        help="where draft workers run a model-based draft (eagle3, eagle, draft_model, medusa, "
                             "mlp_speculator): auto, cpu, cuda or cuda:N (default auto: the GPU when one is visible)")
    parser.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default="auto",
                        help="the draft's dtype (default auto: bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--targets", type=int, default=1, help="target workers (default 1)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks each target worker's model is split over, one process per device (default 1; "
                             "with ray up, also set --gpus-per-worker)")
    parser.add_argument("--no-load-aware-speculation", action="store_true",
                        help="targets draft every request's adaptive γ whatever the load (default: per-step "
                             "budgets from each target's measured step costs, down to none when drafting does not pay)")
    parser.add_argument("--drafts", type=int, default=None,
                        help="draft workers (default 1 for a real model, 0 with --mock or --draft-method none)")
    parser.add_argument("--draft-kinds", default=None, metavar="KINDS",
                        help="draft workers of several kinds side by side, instead of --drafts, --draft-method and "
                             "--draft-model: METHOD[=PATH][:COUNT], comma-separated, e.g. suffix:1,eagle3=HEAD:2 "
                             "(COUNT default 1; eagle3 without a path: the bundled head of the demo model); each "
                             "worker gets its kind's method and path and the --speculative-config keys that apply to "
                             "it; a planner adds the kind furthest below its share of the pool, the first among equals")
    parser.add_argument("--router-mode", choices=ROUTER_MODES, default="kv", help="routing (default kv)")
    parser.add_argument("--standalone-router", action="store_true",
                        help="run the router as its own process (python -m router) instead of inside the frontend")
    parser.add_argument("--http-port", "--port", type=int, default=8000,
                        help="frontend HTTP port (default 8000; 0: any free)")
    parser.add_argument("--host", default="127.0.0.1", help="frontend bind address (default 127.0.0.1)")
    parser.add_argument("--mock", action="store_true", help="mock target workers (no model, no drafts)")
    parser.add_argument("--mock-token-latency-ms", type=float, default=None,
                        help="mock worker time per generated token (0: as fast as possible)")
    parser.add_argument("--mock-token-latency-per-running-ms", type=float, default=None,
                        help="mock worker extra time per token for each other request it runs (load-dependent ITL)")
    parser.add_argument("--prefill-workers", type=int, default=0,
                        help="prefill workers (workers.target --role prefill); the targets then run --role decode")
    parser.add_argument("--planner", action="store_true",
                        help="run python -m planner beside the stack: it resizes the prefill, target and draft pools "
                             "to the SLA given in --planner-args through this launcher (docs/planner.md)")
    parser.add_argument("--planner-args", default="",
                        help="flags for python -m planner, one string, e.g. \"--itl-p90 50ms --max-targets 4\" "
                             "(it needs an SLA: --itl-p90 and/or --ttft-p90)")
    parser.add_argument("--namespace", default=None, help="Tandem namespace (env TANDEM_NAMESPACE, default tandem)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds a stopping worker may drain")
    parser.add_argument("--log-level", default="INFO", help="log level of tandem and its children")
    for flag in ENGINE_FLAGS:
        flag.add_passthrough(parser, "the target and prefill workers")
    for flag in FRONTEND_FLAGS:
        flag.add_passthrough(parser, "the frontend")


def planner_args(args: argparse.Namespace) -> tuple[str, ...]:
    """``--planner-args`` split like a shell would, checked by the planner's own parser and config."""
    try:
        argv = tuple(shlex.split(args.planner_args or ""))
    except ValueError as exc:
        raise ValueError(f"--planner-args: {exc}") from None
    if not args.planner:
        return argv
    from planner.__main__ import build_parser as planner_parser, k8s_deployments, planner_config

    parser = planner_parser()

    def refuse(message: str):
        raise ValueError(f"--planner-args: {message}")

    parser.error = refuse
    planned = parser.parse_args(["--connector", "launcher", *argv])
    try:
        planner_config(planned)
        k8s_deployments(planned)
    except ValueError as exc:
        raise ValueError(f"--planner-args: {exc}") from None
    return argv


def speculation(args: argparse.Namespace) -> dict:
    """The speculation settings: the flags, with ``--speculative-config``'s keys read onto them (a key and
    its flag that disagree are an error); the keys without a flag of their own pass on to the workers."""
    spec = speculative_config(args.speculative_config, flag_env("--speculative-config"),
                              num_speculative_tokens=args.num_speculative_tokens,
                              eagle_topk=args.speculative_eagle_topk, num_steps=args.speculative_num_steps)
    out = dict(draft_method=args.draft_method, draft_model=args.draft_model)
    for name, flag, value in (("draft_method", "--draft-method", spec.draft_method),
                              ("draft_model", "--draft-model", spec.model)):
        if value is None:
            continue
        if out[name] is not None and out[name] != value:
            raise ValueError(f"{flag} {out[name]} disagrees with --speculative-config's {value!r}")
        out[name] = value
    given = spec.model_fields_set
    out.update(num_speculative_tokens=spec.num_speculative_tokens if "num_speculative_tokens" in given else None,
               speculative_eagle_topk=spec.eagle_topk, speculative_num_steps=spec.num_steps,
               speculative_keys=json.dumps({key: value for key, value in spec.model_dump(exclude_unset=True).items()
                                            if key not in (*PASSED_AS_FLAGS, "num_speculative_tokens", "eagle_topk",
                                                           "num_steps")}, sort_keys=True))
    return out


def passthrough(args: argparse.Namespace, flags) -> tuple[str, ...]:
    """The words that pass ``flags`` (shared definitions) on as this command was given them."""
    return tuple(word for flag in flags for word in flag.argv(getattr(args, flag.dest)))


def stack_config(args: argparse.Namespace) -> StackConfig:
    names = args.served_model_name or []
    engine = passthrough(args, ENGINE_FLAGS)
    frontend = passthrough(args, [f for f in FRONTEND_FLAGS if f is not API_KEY])
    return StackConfig(
        model=args.model, served_model_name=first_name(names),
        served_model_aliases=tuple(n for n in dict.fromkeys(names[1:]) if n != first_name(names)),
        engine_args=engine, frontend_args=frontend, api_keys=tuple(args.api_key or ()), **speculation(args),
        draft_device=args.draft_device, draft_dtype=args.draft_dtype,
        load_aware=not args.no_load_aware_speculation, targets=args.targets,
        tensor_parallel_size=args.tensor_parallel_size, drafts=args.drafts, router_mode=args.router_mode,
        standalone_router=args.standalone_router, http_port=args.http_port, host=args.host, mock=args.mock,
        mock_token_latency_ms=args.mock_token_latency_ms,
        mock_token_latency_per_running_ms=args.mock_token_latency_per_running_ms,
        namespace=args.namespace or DEFAULT_NAMESPACE,
        drain_timeout=args.drain_timeout, prefill_workers=args.prefill_workers,
        planner=args.planner, planner_args=planner_args(args),
        draft_kinds=parse_draft_kinds(args.draft_kinds) if args.draft_kinds else (),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = EnvParser(prog="tandem", description="Run Tandem: speculative decoding across workers")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start the whole stack locally on 127.0.0.1")
    add_stack_args(up)
    up.add_argument("--etcd", default=None, help="use this etcd (URL) instead of starting one (default: start one)")
    up.add_argument("--nats", default=None, help="use this NATS server (URL) instead of starting one (default: start one)")
    up.add_argument("--etcd-port", type=int, default=0, help="port for the etcd it starts (default: free)")
    up.add_argument("--nats-port", type=int, default=0, help="port for the nats-server it starts (default: free)")
    up.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    up.add_argument("--allow-scaling", action="store_true",
                    help="serve launcher.scale, so a planner run elsewhere (python -m planner --connector launcher) "
                         "can resize this stack (--planner implies it)")

    train = sub.add_parser("train-draft", help="train a draft head (EAGLE-3, Medusa or MLP speculator) for a target model (self-distillation)")
    add_train_args(train)
    apply_env_defaults(train, prefix="TANDEM_TRAIN_")  # --device, --dtype, --seed mean other things here

    ray = sub.add_parser("ray", help="run Tandem on a Ray cluster")
    ray_sub = ray.add_subparsers(dest="ray_command", required=True)
    ray_up = ray_sub.add_parser("up", help="place the components as Ray actors")
    add_stack_args(ray_up)
    ray_up.add_argument("--address", default="auto", help="Ray cluster address (default auto)")
    ray_up.add_argument("--etcd", required=True,
                        help="etcd URL reachable from every Ray node (env TANDEM_ETCD)")
    ray_up.add_argument("--nats", required=True,
                        help="NATS URL reachable from every Ray node (env TANDEM_NATS)")
    ray_up.add_argument("--gpus-per-worker", type=float, default=1.0,
                        help="GPUs reserved per target/draft actor (real model; 0 for CPU clusters)")
    ray_up.add_argument("--cpus-per-component", type=float, default=1.0, help="CPUs reserved per actor")
    ray_up.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    return apply_env_defaults(parser)


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", nargs="?", default=None,
                   help="target model directory (config.json + safetensors + tokenizer); default: the demo model")
    p.add_argument("--out", required=True, help="output directory: the head, its data, checkpoints")
    p.add_argument("--head", default="eagle3", choices=["eagle3", "medusa", "mlp"],
                   help="draft head: eagle3 (speculators layout), medusa or mlp (IBM's MLP speculator; vLLM's layouts)")
    p.add_argument("--data-from", default=None,
                   help="reuse the conversations of an earlier --out (any head), or a token corpus made by "
                        "`python -m workers.draft.train.gen_tokens` (workers/draft/train/corpora/); only the hidden "
                        "states are recomputed")
    p.add_argument("--styles", default="templates",
                   help="prompt generators, comma-separated, taken in turn: templates (topic x task), chat (many "
                        "voices: casual, terse, maths, lists, role-play, rewriting, code), self-instruct (the target "
                        "writes the user turn)")
    p.add_argument("--init-from", default=None,
                   help="eagle3: start from this head's weights (fine-tuning) instead of a fresh head")
    p.add_argument("--inner-dim", type=int, default=0, help="mlp: state width (0: the target's hidden size)")
    p.add_argument("--head-layers", type=int, default=1, help="medusa: residual blocks per head")
    p.add_argument("--prompts", type=int, default=2000, help="generated training conversations")
    p.add_argument("--eval-prompts", type=int, default=64, help="held-out conversations (another seed)")
    p.add_argument("--prompt-file", action="append", default=[],
                   help="extra prompts: .jsonl (prompt/text/messages) or text (paragraphs); repeatable")
    p.add_argument("--max-tokens", type=int, default=256, help="reply length per turn")
    p.add_argument("--max-len", type=int, default=1024, help="longest conversation in tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the replies (0: greedy)")
    p.add_argument("--gen-batch", type=int, default=32, help="concurrent sequences while generating")
    p.add_argument("--shard-size", type=int, default=64, help="conversations per data shard")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="draft vocabulary (most frequent reply tokens; eagle3 and medusa)")
    p.add_argument("--vocab-coverage", type=float, default=0.0,
                   help="eagle3/medusa: size the draft vocabulary as the smallest (at most --draft-vocab, a multiple "
                        "of 64) whose tokens hold this share of the eval split's reply tokens (0: --draft-vocab as is)")
    p.add_argument("--eval-every-epoch", action="store_true",
                   help="evaluate on the held-out split after every epoch (OUT/per_epoch.json, metrics per_epoch)")
    p.add_argument("--steps", type=int, default=3,
                   help="eagle3: training-time-test steps; medusa: heads; mlp: stages (the head's default γ)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the training data")
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=50, help="warm-up optimizer steps")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per optimizer step")
    p.add_argument("--save-every", type=int, default=100, help="optimizer steps between checkpoints")
    p.add_argument("--seed", type=int, default=0, help="random seed for prompts and training")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--dtype", default="float16", help="dtype of the written head")
    p.add_argument("--log-level", default="info", help="log level")


def train_draft(args: argparse.Namespace) -> None:
    from workers.draft.train.trainer import TrainConfig, train

    target = args.target
    if target is None:
        from workers.demo_model import demo_model_dir

        target = str(demo_model_dir())
    try:
        config = TrainConfig(target=target, out=args.out, prompts=args.prompts, eval_prompts=args.eval_prompts,
                             prompt_files=tuple(args.prompt_file), max_tokens=args.max_tokens, max_len=args.max_len,
                             temperature=args.temperature, gen_batch=args.gen_batch, shard_size=args.shard_size,
                             draft_vocab=args.draft_vocab, steps=args.steps, epochs=args.epochs, lr=args.lr,
                             warmup=args.warmup, batch_tokens=args.batch_tokens, save_every=args.save_every,
                             seed=args.seed, device=args.device, threads=args.threads, dtype=args.dtype,
                             head=args.head, data_from=args.data_from, inner_dim=args.inner_dim,
                             head_layers=args.head_layers, init_from=args.init_from,
                             vocab_coverage=args.vocab_coverage, eval_every_epoch=args.eval_every_epoch,
                             styles=tuple(x.strip() for x in args.styles.split(",") if x.strip()))
        metrics = train(config)
    except ValueError as exc:
        sys.exit(f"tandem train-draft: error: {exc}")
    print(f"held-out acceptance length {metrics['acceptance_length']:.2f} at γ={metrics['gamma']}; "
          f"head written to {args.out}")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        level = check_log_level(args.log_level)
    except ValueError as exc:
        sys.exit(f"tandem: error: {exc}")
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s [tandem] %(levelname)s %(message)s")
    if args.command == "train-draft":
        train_draft(args)
        return
    try:
        config = stack_config(args)
    except ValueError as exc:
        sys.exit(f"tandem: error: {exc}")
    if args.command == "up":
        from deploy.launcher import LocalOptions, run_local

        try:
            options = LocalOptions(etcd_url=args.etcd, nats_url=args.nats, etcd_port=args.etcd_port,
                                   nats_port=args.nats_port, startup_timeout=args.startup_timeout,
                                   allow_scaling=args.allow_scaling)
        except ValueError as exc:
            sys.exit(f"tandem: error: {exc}")
        sys.exit(run_local(config, options))
    from deploy.ray_launcher import RayOptions, run_ray

    try:
        options = RayOptions(address=args.address, etcd_url=args.etcd, nats_url=args.nats,
                             gpus_per_worker=args.gpus_per_worker,
                             cpus_per_component=args.cpus_per_component, startup_timeout=args.startup_timeout)
    except ValueError as exc:
        sys.exit(f"tandem: error: {exc}")
    sys.exit(run_ray(config, options))


if __name__ == "__main__":
    main()
