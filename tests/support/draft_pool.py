"""A stand-in for the target's DraftPool in step-loop tests: always the one draft client given."""

from __future__ import annotations


class FixedPool:
    """``DraftPool``'s face to the step loop (poll, prune, close) over one client, none refused."""

    def __init__(self, client):
        self.client, self.refused = client, {}

    async def poll(self):
        return self.client

    async def prune(self):
        pass

    async def close(self):
        pass
