"""A stand-in for the target's DraftPool in step-loop tests: always the one draft client given."""

from __future__ import annotations


class FixedPool:
    """``DraftPool``'s face to the step loop and its metrics (streams, poll, prune, close, refused, hidden_bytes) over
    one client, none refused."""

    def __init__(self, client):
        self.client, self.refused = client, {}

    def hidden_bytes(self) -> dict[str, int]:
        return self.client.hidden_bytes_by_plane() if hasattr(self.client, "hidden_bytes_by_plane") else {}

    async def poll(self):
        return self.client

    async def streams(self):
        return [self.client] if self.client is not None else []

    async def prune(self):
        pass

    async def close(self):
        pass


class NewsByParts:
    """For a draft-client stand-in with ``verified``, ``release`` and ``send``: ``DraftClient.news``
    (a step's verdicts, released sequences and requests, in that order) made of those three."""

    incarnation = 0  # the draft process's start: not said
    lora = ""  # the adapter its head was trained against: none (the base model)

    @property
    def serial(self) -> int:
        """Tells this stand-in's stream from every other (``DraftClient.serial``)."""
        return id(self)

    def news(self, verdicts, released, requests):
        self.verified(verdicts)
        self.release(released)
        return self.send(requests) if requests else {}
