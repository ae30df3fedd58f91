"""The engine on a GPU: a random-weight Llama-3.1-8B-shaped model against its physical limit and
against transformers' ``generate`` on the same weights, in one run.

Usage (on a CUDA machine; ``bench/gpu_check.sh`` runs it with the GPU tests):
    python bench/gpu_bench.py [--layers 32] [--batches 1,16,64] [--async-scheduling] [--out DIR]

Model: hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336, vocab 128256, bf16
(≈ 16 GB), weights drawn on the device from a seeded normal (no checkpoint can travel here).
Measured, each with the same prompts (random ids, ``--prompt-len`` tokens):

- HBM bandwidth: a device-to-device copy of 2 GiB (bytes read + written / time).
- Decode tokens/s at each batch size: engine steps (scheduling, CUDA-graph replay, sampling,
  token bookkeeping) once every request has its first token, i.e. what a served step costs.
- Roofline: bytes a decode step must move (every weight except the embedding table, plus each
  sequence's KV cache read and its new KV written) / measured bandwidth → the most tokens/s the
  memory system allows; decode efficiency = measured / roofline. With ``--async-scheduling`` each
  batch size is measured twice on the same engine, synchronous and then with async scheduling (step
  N+1 launched before step N's tokens reach the host), rows marked in the "async" column.
- Verify: one target step over γ+1 = 5 tokens per sequence against a 1-token decode step, both
  replayed from CUDA graphs (model runner level, host preparation included; graph replay alone too).
- An EAGLE-3 head shaped for this model (fc 3·4096 → 4096, one decoder layer over 8192-wide
  input, 32000-token draft vocabulary): one drafting step against the target's decode step (c).
- transformers ``generate`` (bf16, SDPA): its default (dynamic cache) and ``cache_implementation=
  "static"`` (which it compiles), decode-phase tokens/s = B·(N−1) / (t(N new) − t(1 new)).
Results go to ``--out`` as gpu_bench.json and gpu_bench.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from workers.engine.config import ModelConfig, RopeConfig  # noqa: E402

GAMMA = 4


def llama8b_config(layers: int) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=layers, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       max_position_embeddings=131072,
                       rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=8192))


def random_model(cfg: ModelConfig, max_positions: int, seed: int = 0):
    from workers.engine.model import DecoderModel

    with torch.device("meta"):
        model = DecoderModel(cfg, max_positions, fused=True)
    model.to_empty(device="cuda")
    model.to(torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.reset_buffers()
    return model.eval()


def weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: all but the embedding table (it gathers B rows)."""
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed or tied)


def measure_bandwidth(gib: float = 2.0, iters: int = 20) -> float:
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / seconds  # read + write


def cuda_time(fn, iters: int, warmup: int = 3) -> float:
    """Mean seconds per call of ``fn``, wall clock with the device synchronised at both ends."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / iters


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen).tolist()


# ---------------------------------------------------------------------------------------- ours


def start_decoding(engine, batch: int, prompt_len: int, steps: int, vocab: int) -> list[str]:
    """Add ``batch`` greedy requests and step until every one has its first token; returns their ids."""
    from runtime.messages import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid, p in zip(ids, prompts(batch, prompt_len, vocab, seed=batch)):
        engine.add_request(rid, p, params)
    started = {rid: False for rid in ids}
    while not all(started.values()):  # prefill (eager, chunked) until every request has its first token
        for rid, _ in engine.step():
            started[rid] = True
    for _ in range(3):  # warm-up decode steps
        engine.step()
    torch.cuda.synchronize()
    return ids


def decode_throughput(engine, batch: int, prompt_len: int, steps: int, vocab: int,
                      async_scheduling: bool = False) -> dict:
    engine.async_scheduling = async_scheduling  # read at every step; the engine is idle here
    ids = start_decoding(engine, batch, prompt_len, steps, vocab)
    replays = engine.runner.graphs.replays
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    graphed = engine.runner.graphs.replays - replays
    for rid in ids:
        engine.abort(rid)
    engine.flush()  # the last step left pending (async scheduling): its aborted sequences drop their tokens
    engine.async_scheduling = False
    return {"batch": batch, "step_ms": 1e3 * seconds / steps, "tokens_per_s": batch * steps / seconds,
            "graphed_steps": graphed, "steps": steps, "mean_context": prompt_len + 4 + steps / 2,
            "async": async_scheduling}


def profile_steps(engine, batch: int, prompt_len: int, steps: int, vocab: int) -> str:
    """cProfile of ``steps`` engine decode steps (host time per function; waits on the GPU show up
    in the call that synchronises)."""
    import cProfile
    import io
    import pstats

    ids = start_decoding(engine, batch, prompt_len, steps, vocab)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    for rid in ids:
        engine.abort(rid)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return f"## batch {batch}, {steps} decode steps\n{text.getvalue()}"


def verify_cost(engine, batch: int, context: int, iters: int = 30) -> dict:
    """Runner-level decode (1 token) vs verify (γ+1 tokens) steps for ``batch`` sequences of ``context`` tokens."""
    runner = engine.runner
    bs = engine.config.block_size
    per_seq = -(-(context + GAMMA + 1) // bs)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    decode = [([5], context, t) for t in tables]
    verify = [([5] * (GAMMA + 1), context, t) for t in tables]
    t_decode = cuda_time(lambda: runner.forward(decode, [1] * batch), iters)
    t_verify = cuda_time(lambda: runner.forward(verify, [GAMMA + 1] * batch), iters)
    graphs = runner.graphs
    replay = {}
    for q in (1, GAMMA + 1):
        shape = graphs.shape_for(decode if q == 1 else verify, [q] * batch, ())
        g = graphs.graphs[shape].graph
        replay[q] = cuda_time(g.replay, iters)
    return {"batch": batch, "context": context, "decode_ms": 1e3 * t_decode, "verify_ms": 1e3 * t_verify,
            "ratio": t_verify / t_decode, "decode_replay_ms": 1e3 * replay[1],
            "verify_replay_ms": 1e3 * replay[GAMMA + 1], "replay_ratio": replay[GAMMA + 1] / replay[1]}


def padding_cost(engine, batch: int, context: int, iters: int = 30) -> list[dict]:
    """Graph replay of a verify step of q < γ+1 tokens per sequence: in a graph captured for exactly
    q against padded to the γ+1 graph (what the engine does by default: it captures 1 and γ+1 only).
    Adaptive γ and load-aware budgets produce every q in between."""
    graphs = engine.runner.graphs
    bucket = next(b for b in graphs.buckets if b >= batch)
    padded = cuda_time(graphs._graph(bucket, GAMMA + 1, ()).graph.replay, iters)
    rows = []
    for q in range(2, GAMMA + 1):
        exact = cuda_time(graphs._graph(bucket, q, ()).graph.replay, iters)  # captured on first use
        rows.append({"batch": batch, "q": q, "exact_ms": 1e3 * exact, "padded_ms": 1e3 * padded,
                     "padded_over_exact": padded / exact})
    return rows


def eagle3_step(target_cfg: ModelConfig, batch: int, context: int, iters: int = 30) -> dict:
    """One EAGLE-3 drafting step (midlayer + draft LM head → target-vocab logits), eager and graphed."""
    from dataclasses import replace

    from workers.draft.eagle import Eagle3Head
    from workers.engine.attention import AttentionMetadata, allocate_kv_cache
    from workers.engine.layers import RotaryEmbedding
    from workers.engine.triton_attention import paged_attention_triton

    cfg = replace(target_cfg, num_layers=1)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.device("meta"):
        head = Eagle3Head(cfg, embed, 4096, target_cfg.hidden_size, 32000, target_cfg.vocab_size, False)
    head.to_empty(device="cuda")
    head.to(torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)
    head.d2t.zero_()
    fresh = RotaryEmbedding(cfg.rope, cfg.head_dim, 4096)
    head.rotary.cos, head.rotary.sin = fresh.cos.cuda(), fresh.sin.cuda()
    head.midlayer.self_attn.attention_fn = paged_attention_triton
    bs = 16
    per_seq = -(-(context + 1) // bs)
    kv = allocate_kv_cache(1, batch * per_seq + 1, bs, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    ids = torch.full((batch,), 7, device="cuda")
    feats = torch.randn(batch, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    pos = torch.full((batch,), context, device="cuda")

    @torch.inference_mode()
    def eager():
        meta = AttentionMetadata.build([1] * batch, [context + 1] * batch, tables, bs, "cuda")
        out = head(ids, feats, pos, meta, kv)
        return head.logits(out).argmax(-1)

    t_eager = cuda_time(eager, iters)
    meta = AttentionMetadata.build([1] * batch, [context + 1] * batch, tables, bs, "cuda")
    static = AttentionMetadata.static(meta.slot_mapping, meta.block_tables, meta.token_seq, meta.token_pos, bs)
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                head.logits(head(ids, feats, pos, static, kv)).argmax(-1)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            head.logits(head(ids, feats, pos, static, kv)).argmax(-1)
    t_graph = cuda_time(graph.replay, iters)
    params = sum(p.numel() for p in head.parameters())
    return {"batch": batch, "eager_ms": 1e3 * t_eager, "graph_ms": 1e3 * t_graph, "params_m": params / 1e6}


# ---------------------------------------------------------------------------------------- transformers


def hf_model(ours, cfg: ModelConfig):
    """transformers' Llama on the same weights (bf16, SDPA attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = cfg.rope
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                         max_position_embeddings=cfg.max_position_embeddings,
                         rope_scaling={"rope_type": "llama3", "factor": rope.factor,
                                       "low_freq_factor": rope.low_freq_factor,
                                       "high_freq_factor": rope.high_freq_factor,
                                       "original_max_position_embeddings": rope.original_max_position_embeddings},
                         rope_theta=rope.theta, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, attn_implementation="sdpa")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            hf = LlamaForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(default)
    hf.to_empty(device="cuda")
    with torch.device("cuda"):  # its inv_freq buffer was left empty by to_empty: rebuild it
        hf.model.rotary_emb = LlamaRotaryEmbedding(hf_cfg)
    q, kv = cfg.q_size, cfg.kv_size
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(ours.model.embed_tokens.weight)
        hf.model.norm.weight.copy_(ours.model.norm.weight)
        hf.lm_head.weight.copy_(ours.lm_head.weight)
        for mine, theirs in zip(ours.model.layers, hf.model.layers):
            qkv = mine.self_attn.qkv_proj.weight
            theirs.self_attn.q_proj.weight.copy_(qkv[:q])
            theirs.self_attn.k_proj.weight.copy_(qkv[q : q + kv])
            theirs.self_attn.v_proj.weight.copy_(qkv[q + kv :])
            theirs.self_attn.o_proj.weight.copy_(mine.self_attn.o_proj.weight)
            gate, up = mine.mlp.gate_up_proj.weight.chunk(2, dim=0)
            theirs.mlp.gate_proj.weight.copy_(gate)
            theirs.mlp.up_proj.weight.copy_(up)
            theirs.mlp.down_proj.weight.copy_(mine.mlp.down_proj.weight)
            theirs.input_layernorm.weight.copy_(mine.input_layernorm.weight)
            theirs.post_attention_layernorm.weight.copy_(mine.post_attention_layernorm.weight)
    return hf.eval()


def hf_throughput(hf, batch: int, prompt_len: int, new_tokens: int, vocab: int, **generate_kw) -> dict:
    ids = torch.tensor(prompts(batch, prompt_len, vocab, seed=batch), device="cuda")
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0, **generate_kw)
        torch.cuda.synchronize()
        assert out.shape[1] == prompt_len + n
        return time.perf_counter() - started

    run(new_tokens)  # warm-up (and compilation, for the static cache)
    run(1)
    full, first = min(run(new_tokens) for _ in range(2)), min(run(1) for _ in range(2))
    return {"batch": batch, "tokens_per_s": batch * (new_tokens - 1) / (full - first),
            "step_ms": 1e3 * (full - first) / (new_tokens - 1)}


# ---------------------------------------------------------------------------------------- report


def markdown(res: dict) -> str:
    lines = [f"Device: {res['device']}; torch {res['torch']}, triton {res['triton']}, transformers {res['transformers']}",
             f"Model: Llama-3.1-8B shape, {res['layers']} layers, bf16, random weights; "
             f"weights read per step {res['weight_gb']:.2f} GB; measured copy bandwidth {res['bandwidth_gbs']:.0f} GB/s",
             f"CUDA graphs captured: {res['graphs']} in {res['capture_s']:.1f} s", "",
             "| batch | async | ours tok/s | step ms | roofline tok/s | of roofline | HF default tok/s "
             "| ours / HF default | HF static tok/s | ours / HF static |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in res["decode"]:
        b = row["batch"]
        hf_d = res["hf_default"].get(str(b), {}).get("tokens_per_s")
        hf_s = res["hf_static"].get(str(b), {}).get("tokens_per_s")
        fmt = lambda x: f"{x:.0f}" if x else "–"  # noqa: E731
        ratio = lambda x: f"{row['tokens_per_s'] / x:.2f}×" if x else "–"  # noqa: E731
        lines.append(f"| {b} | {'on' if row.get('async') else 'off'} | {row['tokens_per_s']:.0f} | {row['step_ms']:.2f} "
                     f"| {row['roofline_tokens_per_s']:.0f} "
                     f"| {row['of_roofline']:.2f} | {fmt(hf_d)} | {ratio(hf_d)} | {fmt(hf_s)} | {ratio(hf_s)} |")
    lines += ["", f"| batch | context | decode ms | verify γ+1={GAMMA + 1} ms | verify / decode "
              "| decode replay ms | verify replay ms | replay ratio |", "|---|---|---|---|---|---|---|---|"]
    for row in res["verify"]:
        lines.append(f"| {row['batch']} | {row['context']} | {row['decode_ms']:.2f} | {row['verify_ms']:.2f} "
                     f"| {row['ratio']:.3f} | {row['decode_replay_ms']:.2f} | {row['verify_replay_ms']:.2f} "
                     f"| {row['replay_ratio']:.3f} |")
    if res.get("padding"):
        lines += ["", f"| batch | verify q | graph for exactly q, ms | padded to the γ+1={GAMMA + 1} graph, ms "
                  "| padded / exact |", "|---|---|---|---|---|"]
        for row in res["padding"]:
            lines.append(f"| {row['batch']} | {row['q']} | {row['exact_ms']:.2f} | {row['padded_ms']:.2f} "
                         f"| {row['padded_over_exact']:.3f} |")
    lines += ["", "| batch | EAGLE-3 head eager ms | graphed ms | target decode ms | c (graphed / target) |",
              "|---|---|---|---|---|"]
    for row in res["eagle3"]:
        target = next((r["step_ms"] for r in res["decode"] if r["batch"] == row["batch"] and not r.get("async")),
                      None)
        c = f"{row['graph_ms'] / target:.3f}" if target else "–"
        lines.append(f"| {row['batch']} | {row['eager_ms']:.2f} | {row['graph_ms']:.2f} | "
                     f"{target:.2f} | {c} |" if target else f"| {row['batch']} | {row['eager_ms']:.2f} | "
                     f"{row['graph_ms']:.2f} | – | – |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per batch size")
    ap.add_argument("--hf-new-tokens", type=int, default=64)
    ap.add_argument("--no-hf-static", action="store_true", help="skip transformers' static cache (it compiles)")
    ap.add_argument("--profile", action="store_true", help="also write a host profile of decode steps (gpu_profile.txt)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="measure decode at each batch size with async scheduling too (same engine, after the "
                         "synchronous row)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_bench needs a CUDA GPU")
    import transformers
    import triton

    from workers.engine.engine import Engine, EngineConfig

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    cfg = llama8b_config(args.layers)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "transformers": transformers.__version__, "layers": args.layers, "decode": [], "verify": [],
                 "eagle3": [], "padding": [], "hf_default": {}, "hf_static": {}}

    def save() -> None:
        (out_dir / "gpu_bench.json").write_text(json.dumps(res, indent=1))
        if res["decode"]:
            (out_dir / "gpu_bench.md").write_text(markdown(res))

    res["bandwidth_gbs"] = measure_bandwidth() / 1e9
    print(f"copy bandwidth {res['bandwidth_gbs']:.0f} GB/s", flush=True)
    model = random_model(cfg, max_positions=4096)
    res["weight_gb"] = weight_bytes(model) / 1e9
    started = time.perf_counter()
    engine = Engine(model, EngineConfig(block_size=16, max_num_seqs=max(batches), max_num_batched_tokens=8192,
                                            max_model_len=2048, kv_cache_bytes=6 << 30),
                        eos_token_ids=(), num_speculative_tokens=GAMMA)
    res["capture_s"] = time.perf_counter() - started
    res["graphs"] = len(engine.runner.graphs.graphs)
    print(f"engine ready: {res['graphs']} graphs in {res['capture_s']:.1f}s", flush=True)
    kv_per_token = 2 * cfg.num_layers * cfg.kv_size * 2
    bw = res["bandwidth_gbs"] * 1e9
    for b in batches:
        for async_scheduling in (False, True) if args.async_scheduling else (False,):
            row = decode_throughput(engine, b, args.prompt_len, args.steps, cfg.vocab_size, async_scheduling)
            step_bytes = weight_bytes(model) + b * (row["mean_context"] + 1) * kv_per_token
            row["roofline_tokens_per_s"] = b / (step_bytes / bw)
            row["of_roofline"] = row["tokens_per_s"] / row["roofline_tokens_per_s"]
            res["decode"].append(row)
            print(json.dumps(row), flush=True)
            save()
    if args.profile:
        text = "\n".join(profile_steps(engine, b, args.prompt_len, args.steps, cfg.vocab_size)
                         for b in (batches[0], batches[-1]))
        (out_dir / "gpu_profile.txt").write_text(text)
    for b in batches:
        res["verify"].append(verify_cost(engine, b, args.prompt_len + args.steps // 2))
        print(json.dumps(res["verify"][-1]), flush=True)
    save()
    for b in batches:
        try:
            res["padding"] += padding_cost(engine, b, args.prompt_len + args.steps // 2)
            print(json.dumps(res["padding"][-GAMMA + 1:]), flush=True)
        except Exception as exc:  # a new measurement: record why, keep the rest of the report
            print(f"padding cost at batch {b} failed: {exc!r}", flush=True)
    save()
    for b in batches:
        res["eagle3"].append(eagle3_step(cfg, b, args.prompt_len + args.steps // 2))
        print(json.dumps(res["eagle3"][-1]), flush=True)
    save()
    hf = hf_model(model, cfg)
    del engine
    torch.cuda.empty_cache()
    for b in batches:
        res["hf_default"][str(b)] = hf_throughput(hf, b, args.prompt_len, args.hf_new_tokens, cfg.vocab_size)
        print("hf default", json.dumps(res["hf_default"][str(b)]), flush=True)
        save()
    if not args.no_hf_static:
        for b in batches:
            try:
                res["hf_static"][str(b)] = hf_throughput(hf, b, args.prompt_len, args.hf_new_tokens, cfg.vocab_size,
                                                         cache_implementation="static")
            except Exception as exc:  # record why, keep the rest of the report
                res["hf_static"][str(b)] = {"error": repr(exc)[:300]}
            print("hf static", json.dumps(res["hf_static"][str(b)]), flush=True)
            save()
    print(markdown(res))


if __name__ == "__main__":
    main()
