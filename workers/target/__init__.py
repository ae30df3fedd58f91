"""The target worker: serves ``target.generate`` with the model engine.

``engine_loop`` runs the synchronous engine in its own thread and bridges it to asyncio;
``worker`` is the request handler and the event publishers; ``__main__`` is the service.
"""
