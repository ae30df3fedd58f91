"""Test helpers for the frontend's request path in process: the demo tokenizer and a completion
service over a registry of model cards (no NATS: the tests call it directly)."""

from __future__ import annotations


def demo_tokenizer():
    """The demo model's tokenizer, as the frontend loads it."""
    from frontend.tokenizer import Tokenizer
    from workers.demo_model import demo_tokenizer_dir

    return Tokenizer.load(str(demo_tokenizer_dir()))


def completion_service(tokenizer, context_length: int, **cards):
    """A :class:`frontend.serving.CompletionService` whose registry holds model ``m`` (served by instance
    ``a``, eos token 2, ``context_length``) and ``cards`` (key -> ModelCard), loading ``tokenizer``."""
    from frontend.metrics import FrontendMetrics
    from frontend.models import ModelRegistry
    from frontend.serving import CompletionService
    from runtime.messages import ModelCard

    registry = ModelRegistry(loader=lambda path, template, eos: tokenizer, preload=False)
    card = ModelCard("m", tokenizer_path="/tok", context_length=context_length, eos_token_ids=[2], instance_id="a")
    registry.update({"k": card, **cards})
    return CompletionService(registry, None, FrontendMetrics(), max_n=4)
