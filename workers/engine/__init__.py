"""The model engine shared by target and draft workers.

Layers, bottom up: ``config`` (model shape from a Hugging Face config.json) → ``weights`` (local
safetensors or GGUF) → ``layers`` / ``attention`` / ``model`` (a torch Llama-family decoder over a
flat batch of tokens with a paged KV cache) → ``block_manager`` (paged cache bookkeeping, prefix
caching, KV events) → ``sampling`` (pure tensor functions) → ``scheduler`` / ``engine`` (continuous
batching); ``build`` makes a target's engine from its service config (device, dtype, tensor
parallelism, weights). Nothing here knows about NATS or etcd; the worker packages wire it to the runtime.
"""
