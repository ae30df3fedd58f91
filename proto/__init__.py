"""The gRPC contract between draft and target workers: ``spec.proto`` and its generated modules.

Regenerate with ``python proto/generate.py``; ``tests/unit/proto`` fails when they are stale.
"""
