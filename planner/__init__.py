"""The planner: sizes the prefill, target and draft pools to latency SLAs from the signals the
workers, frontends and router already publish; the draft pool follows its own load.

Layers: ``config`` (flags as one frozen dataclass), ``estimate`` (windowed percentiles, the load
fit), ``policy`` (pure decision rules), ``signals`` (NATS events, etcd discovery, ``/metrics``
scrapes), ``connectors`` (who enacts a decision: a Tandem launcher, Kubernetes, or nobody),
``planner`` (one tick: observe, decide, enact, report). See docs/planner.md.
"""
