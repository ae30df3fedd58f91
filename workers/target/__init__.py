"""The target worker: serves ``target.generate`` with the model engine and verifies drafts.

``step_loop`` drives the engine from one asyncio task (proposals awaited with a deadline, the
engine step in one executor thread); ``spec_engine`` is the engine with draft verification;
``draft_client`` is the gRPC stream to a draft worker and the pool that picks one; ``worker`` is
the request handler and the event publishers; ``__main__`` is the service.
"""
