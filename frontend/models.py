"""The models this frontend can serve, kept live from the model cards in etcd.

Every target worker publishes one card per model it serves, on its own lease; a model exists
while at least one card for it does. A LoRA adapter is a model too: its card names its ``parent``
(the base model its workers serve), and only the instances that published it hold it. Tokenizers are loaded once per (directory, chat template),
in a thread, and the load starts as soon as a model appears so the first request rarely waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from runtime import NoInstances
from runtime.messages import ModelCard

from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

Loader = Callable[[str, str, tuple[int, ...]], Tokenizer]

# A model that just lost its last card answers 503 + Retry-After for this long, not 404: the cards come
# back when workers re-register (etcd restarted with its data wiped, a brief lease loss, a rolling restart).
GONE_GRACE_S = 30.0


class UnknownModel(Exception):
    """No live worker serves a model of this name."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(f"The model '{name}' does not exist")


@dataclass(frozen=True)
class ServedModel:
    """A model as the frontend sees it: its card (from the first instance) and when it appeared.
    ``name`` is what clients call it: the card's name or one of its aliases (``--served-model-name a
    b``); workers are found and asked by :attr:`served_as`, the card's name."""

    name: str
    card: ModelCard
    created: int
    num_instances: int
    instance_ids: frozenset[str] = frozenset()  # the instances that published this card

    @property
    def parent(self) -> str:
        """The base model of a LoRA adapter ("" for a base model)."""
        return self.card.parent

    @property
    def served_as(self) -> str:
        return self.card.name


class ModelRegistry:
    """Target models from a live ``{key: ModelCard}`` view, with their tokenizers."""

    def __init__(self, loader: Loader = Tokenizer.load, preload: bool = True,
                 on_load: Callable[[Tokenizer], None] | None = None):
        self._loader = loader
        self._on_load = on_load  # called with each tokenizer once it is loaded
        self._preload = preload
        self._models: dict[str, ServedModel] = {}
        self._first_seen: dict[str, int] = {}
        self._gone: dict[str, float] = {}  # name -> when its last card went (monotonic)
        self._tokenizers: dict[tuple, asyncio.Future[Tokenizer]] = {}
        self._background: set[asyncio.Task] = set()
        self._changed: asyncio.Event | None = None  # set (and replaced) at every update while someone waits

    def update(self, cards: Mapping[str, ModelCard]) -> None:
        """Replace the model set from all current cards (a snapshot listener)."""
        by_name: dict[str, list[ModelCard]] = {}
        for card in cards.values():
            if card.role == "target":
                for name in dict.fromkeys((card.name, *card.aliases)):
                    by_name.setdefault(name, []).append(card)
        now = int(time.time())
        models = {}
        for name, group in by_name.items():
            group.sort(key=lambda c: c.instance_id)
            created = self._first_seen.setdefault(name, now)
            models[name] = ServedModel(name, group[0], created, len(group), frozenset(c.instance_id for c in group))
        for name in models.keys() - self._models.keys():
            log.info("model %s appeared (%d instances)", name, models[name].num_instances)
            if self._preload:
                self._start_load(models[name].card)
        for name in self._models.keys() - models.keys():
            log.info("model %s is gone: no worker serves it", name)
            self._first_seen.pop(name, None)
            parent = self._models[name].parent
            if not (parent and parent in models):  # an adapter unloaded from live workers is gone for good
                self._gone[name] = time.monotonic()
        for name in models:
            self._gone.pop(name, None)
        self._models = models
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def list(self) -> list[ServedModel]:
        return sorted(self._models.values(), key=lambda m: m.name)

    def get(self, name: str) -> ServedModel:
        model = self._models.get(name)
        if model is None:
            if self.recently_gone(name):
                raise NoInstances("target", "generate", name)  # 503 + Retry-After: it was just here
            raise UnknownModel(name)
        return model

    def recently_gone(self, name: str) -> bool:
        """Whether ``name`` lost its last card within :data:`GONE_GRACE_S`: its workers are likely
        restarting, and a request may wait for them."""
        gone = self._gone.get(name)
        return gone is not None and time.monotonic() - gone < GONE_GRACE_S

    async def wait_for(self, name: str, timeout: float) -> ServedModel:
        """:meth:`get`, waiting up to ``timeout`` seconds for a model that was just here to come back
        (its worker restarting); raises what :meth:`get` raises once the wait is over."""
        deadline = time.monotonic() + timeout
        while name not in self._models and self.recently_gone(name):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                break
        return self.get(name)

    def route(self, model: ServedModel) -> tuple[str, str, frozenset[str]]:
        """(model the workers serve, LoRA adapter or "", instances to leave out) for a request to
        ``model``: an adapter's request goes to its parent's instances that hold the adapter."""
        if not model.parent:
            return model.served_as, "", frozenset()
        base = self._models.get(model.parent)
        others = base.instance_ids - model.instance_ids if base is not None else frozenset()
        return model.parent, model.served_as, others

    async def tokenizer(self, model: ServedModel, timeout: float) -> Tokenizer:
        """The model's tokenizer, loading it on first use; raises ``TokenizerLoadError``."""
        future = self._start_load(model.card)
        if future.done():
            return future.result()
        return await asyncio.wait_for(asyncio.shield(future), timeout)

    def _start_load(self, card: ModelCard) -> asyncio.Future[Tokenizer]:
        key = (card.tokenizer_path, card.chat_template, tuple(card.eos_token_ids))
        future = self._tokenizers.get(key)
        if future is not None:
            return future
        loop = asyncio.get_running_loop()
        future = self._tokenizers[key] = loop.create_future()
        task = asyncio.create_task(self._load(key, future), name=f"tokenizer {card.tokenizer_path}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return future

    async def _load(self, key: tuple, future: asyncio.Future[Tokenizer]) -> None:
        try:
            tokenizer = await asyncio.to_thread(self._loader, *key)
        except Exception as exc:
            log.error("%s", exc)
            self._tokenizers.pop(key, None)  # a later request tries again
            future.set_exception(exc)
            future.exception()  # retrieved: nobody may be waiting
            return
        future.set_result(tokenizer)
        if self._on_load is not None:
            self._on_load(tokenizer)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
