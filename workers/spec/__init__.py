"""Speculative decoding: rejection sampling, proposers (n-gram, draft model, EAGLE), draft worker."""
