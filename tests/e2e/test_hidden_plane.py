"""A 2,000-token prompt served with an EAGLE-3 head on a target of hidden size 2,816, real target
and draft processes over gRPC: the prompt's hidden states (three layers: 67.6 MB as inline float32
tensors, past gRPC's 64 MiB message limit, which broke the draft stream and with it all
speculation) reach the draft on the data plane, and greedy output equals the target's own plain
decoding of the same prompt.

The target's ring is smaller than the prompt's rows (45 MB in the target's layout): that block goes
as chunked rows on the gRPC stream (the plane of a draft on another host), the decode steps' rows
through the shared-memory ring, so one run crosses both planes and the fallback between them."""

from __future__ import annotations

import asyncio
import json

import pytest
from tests.support.flags import speculative
import torch
from safetensors.torch import save_file

from runtime.messages import GenerateRequest, SamplingParams, TokenDelta
from runtime.request_plane import collect

pytestmark = pytest.mark.e2e

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 2816, 512, 22, 2, 256
PROMPT = 2000
STEPS = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A random 2-layer Llama of hidden size 2,816 and a random EAGLE-3 head reading its layers 1, 1, 2."""
    import transformers as tf

    target = tmp_path_factory.mktemp("wide-target")
    cfg = tf.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=4096,
                         initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(3)
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(target)
    head = tmp_path_factory.mktemp("wide-eagle3")
    gen = torch.Generator().manual_seed(4)

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.02

    d = HIDDEN // HEADS
    p = "midlayer"
    state = {"fc.weight": w(HIDDEN, 3 * HIDDEN), "norm.weight": torch.ones(HIDDEN),
             "lm_head.weight": w(VOCAB, HIDDEN), "d2t": torch.zeros(VOCAB, dtype=torch.long),
             "t2d": torch.ones(VOCAB, dtype=torch.bool), f"{p}.hidden_norm.weight": torch.ones(HIDDEN),
             f"{p}.input_layernorm.weight": torch.ones(HIDDEN), f"{p}.post_attention_layernorm.weight": torch.ones(HIDDEN),
             f"{p}.self_attn.q_proj.weight": w(HEADS * d, 2 * HIDDEN), f"{p}.self_attn.k_proj.weight": w(KV_HEADS * d, 2 * HIDDEN),
             f"{p}.self_attn.v_proj.weight": w(KV_HEADS * d, 2 * HIDDEN), f"{p}.self_attn.o_proj.weight": w(HIDDEN, HEADS * d),
             f"{p}.mlp.gate_proj.weight": w(INTER, HIDDEN), f"{p}.mlp.up_proj.weight": w(INTER, HIDDEN),
             f"{p}.mlp.down_proj.weight": w(HIDDEN, INTER)}
    save_file(state, str(head / "model.safetensors"))
    (head / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": INTER, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "draft_vocab_size": VOCAB, "target_hidden_size": HIDDEN,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}}))
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()
    return target, head, prompt


async def test_a_2000_token_prompt_is_speculated_on_with_an_eagle3_head_of_hidden_size_2816(rt, spawn, models):
    target, head, prompt = models
    assert (PROMPT - 1) * 3 * HIDDEN * 4 > 64 << 20  # inline, the prompt's rows alone pass gRPC's limit
    target_proc = spawn("workers.target", "--model", str(target), "--served-model-name", "wide", "--block-size", "16",
          "--num-blocks", "160", "--max-model-len", "2304", "--num-speculative-tokens", "3",
          "--lease-ttl", "3",
          # the synchronous seam: this random head is rarely right about the token the target commits
          # while a staged proposal is on its way, so the pipelined seam would verify none of its drafts
          # (this test is about the rows reaching the draft: a draft lacking them proposes nothing)
          *speculative(hidden_layers="1,2", hidden_ring_mib=16, propose_min_wait=2, propose_timeout=30,
                       load_aware=False, adaptive=False, seam="sync"), name="target")
    spawn("workers.draft", "--method", "eagle3", "--head-model", str(head), "--target-model", str(target),
          "--served-model-name", "wide", "--block-size", "16", "--num-blocks", "256", "--lease-ttl", "3",
          name="draft")
    client = await rt.client("target", "generate")
    [inst] = await client.wait_for_instances(1, timeout=120)
    await (await rt.client("draft", "speculate")).wait_for_instances(1, timeout=120)
    # a short request first: the target has opened its stream to the draft before the long one comes
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for _ in range(60):
        out = await collect(await client.call(inst.instance_id, GenerateRequest(prompt[:16], short), TokenDelta))
        if out[-1].usage.spec is not None and out[-1].usage.spec.num_drafts > 0:
            break
    else:
        pytest.fail("the target never speculated with the draft worker")
    greedy = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    out = await asyncio.wait_for(collect(await client.call(inst.instance_id, GenerateRequest(prompt, greedy),
                                                           TokenDelta)), 300)
    plain = await asyncio.wait_for(collect(await client.call(inst.instance_id, GenerateRequest(
        prompt, greedy, num_speculative_tokens=0), TokenDelta)), 300)
    assert [t for d in out for t in d.token_ids] == [t for d in plain for t in d.token_ids]
    assert plain[-1].usage.spec is None or plain[-1].usage.spec.num_drafts == 0
    spec = out[-1].usage.spec
    # the draft had every one of the prompt's rows: it drafted (a draft lacking them proposes nothing)
    assert spec is not None and spec.num_draft_tokens > 0, spec
    logs = target_proc.logs()
    assert "hidden states on plane shm" in logs and "streaming it" in logs  # both planes served
