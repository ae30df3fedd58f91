"""The draft worker: proposes tokens to target workers over a bidirectional gRPC stream.

``service`` is the gRPC service (one stream per target, proposals batched across streams);
``proposer`` is the protocol every method implements; the methods are ``ngram``, ``draft_model``,
``eagle`` / ``eagle_proposer`` (EAGLE-1 and EAGLE-3 heads; ``eagle_staging``: their staged
branches for the pipelined seam) and ``oracle`` (benchmarks).
"""
