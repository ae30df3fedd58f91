"""The OpenAI-compatible HTTP frontend: ``python -m frontend --http-port 8000``.

Modules: :mod:`frontend.app` (routes, the :class:`~frontend.app.Frontend` object), :mod:`frontend.asgi`
(the ASGI transport: bodies in, event streams out, the completion routes' fast path),
:mod:`frontend.protocol` (request schemas and validation), :mod:`frontend.serving` (one request:
preprocess, dispatch, answer), :mod:`frontend.dispatch` (routing and migration to another worker),
:mod:`frontend.output` / :mod:`frontend.detokenize` (text, stop strings, logprobs),
:mod:`frontend.responses` (response bodies and SSE chunks), :mod:`frontend.streaming` (merging
choices, client disconnects), :mod:`frontend.models` / :mod:`frontend.tokenizer` (models from
etcd cards, tokenizers and chat templates), :mod:`frontend.errors` (errors as HTTP answers),
:mod:`frontend.metrics` (Prometheus), :mod:`frontend.server` (uvicorn), :mod:`frontend.config`.
See docs/frontend.md.
"""
