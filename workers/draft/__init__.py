"""The draft worker: proposes tokens to target workers over a bidirectional gRPC stream.

``service`` is the gRPC service (one stream per target, proposals batched across streams);
``drafter`` is the one interface every method implements (commit, verdicts, release, draft the
branches asked for); ``stager`` drafts ahead for the pipelined seam. The methods are ``ngram``,
``suffix``, ``draft_model``, ``eagle_proposer`` (EAGLE-1 and EAGLE-3 heads; ``eagle_staging``: their
staged branches), ``head_proposer`` (Medusa, MLP speculator) and ``oracle`` (benchmarks).
"""
