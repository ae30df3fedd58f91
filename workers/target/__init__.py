"""The target worker: serves ``target.generate`` with the model engine and verifies drafts.

``step_loop`` drives the engine (:mod:`workers.engine`, whose one step serves plain and speculative
batches) from one asyncio task, every engine call on one executor thread; ``draft_client`` is the
gRPC stream to a draft worker, its handshake checks, and the pool that picks one; ``draft_watch``
decides how long to wait for proposals and when to back a draft off; ``worker`` is the request
handler and the event publishers; ``metrics`` its Prometheus collector; ``__main__`` the service.
"""
