"""Pieces more than one benchmark builds the same way."""

from __future__ import annotations


def random_decoder(vocab: int = 256, max_positions: int = 512):
    """A tiny random Llama-shaped ``DecoderModel`` (2 layers of 64, weights N(0, 0.2), seed 0), in
    eval mode: a forward pass cheap enough that what the engine does around it shows."""
    import torch

    from workers.engine.config import ModelConfig
    from workers.engine.model import DecoderModel

    torch.manual_seed(0)
    cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=max_positions)
    model = DecoderModel(cfg, max_positions)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.reset_buffers()
    return model.eval()


async def wait_for_instances(http, model: str, count: int, timeout: float, interval: float = 0.2,
                             why=lambda: "") -> None:
    """Wait until the frontend behind ``http`` (an ``httpx.AsyncClient``) lists ``count`` instances of
    ``model`` on ``/v1/models``; ``TimeoutError`` (with ``why()``, e.g. the workers' logs) past ``timeout``."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while True:
        models = {m["id"]: m["instances"] for m in (await http.get("/v1/models")).json()["data"]}
        if models.get(model, 0) >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the frontend never saw {count} instances of {model}\n{why()}")
        await asyncio.sleep(interval)
