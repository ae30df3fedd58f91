"""Real LoRA adapters for tests and benches: trained with ``peft`` on a small causal LM, in seconds.

Each adapter is fitted to its own toy task (continue a sequence by a fixed token map), so that its
greedy outputs visibly differ from the base model's and from every other adapter's. Nothing is
downloaded; the adapter is saved in PEFT's format (adapter_config.json + adapter_model.safetensors).
"""

from __future__ import annotations

from pathlib import Path

import torch


def train_lora(base_dir: Path, out_dir: Path, *, seed: int, rank: int = 8, alpha: int = 16,
               targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"),
               steps: int = 40, lr: float = 2e-2, use_rslora: bool = False, seq_len: int = 24, batch: int = 16,
               rank_pattern: dict | None = None, alpha_pattern: dict | None = None) -> Path:
    """Train a LoRA adapter on ``base_dir`` (a Hugging Face causal LM) and save it to ``out_dir``.

    The task: token t is followed by ``(a·t + b) mod V`` with (a, b) drawn from ``seed``. A few
    dozen Adam steps move the adapter well away from zero (PEFT starts B at zero)."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    gen = torch.Generator().manual_seed(seed)
    base = tf.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    vocab = base.config.vocab_size
    a = int(torch.randint(1, vocab - 1, (1,), generator=gen)) | 1
    b = int(torch.randint(0, vocab, (1,), generator=gen))
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM", use_rslora=use_rslora, rank_pattern=rank_pattern or {},
                        alpha_pattern=alpha_pattern or {})
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    model.train()
    optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matmuls: more threads only wait on each other on a busy machine
    try:
        _fit(model, optim, vocab, a, b, steps, batch, seq_len, gen)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.save_pretrained(str(out_dir))
    return out_dir


def _fit(model, optim, vocab: int, a: int, b: int, steps: int, batch: int, seq_len: int, gen) -> None:
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        seq = [start]
        for _ in range(seq_len - 1):
            seq.append((seq[-1] * a + b) % vocab)
        ids = torch.cat(seq, dim=1)
        loss = model(input_ids=ids, labels=ids).loss
        optim.zero_grad()
        loss.backward()
        optim.step()


def merged_reference(base_dir: Path, adapter_dir: Path):
    """transformers' model with the PEFT adapter merged into its weights (PEFT's own merge), eval."""
    import transformers as tf
    from peft import PeftModel

    base = tf.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()
