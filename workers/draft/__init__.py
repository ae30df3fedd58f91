"""Draft worker: proposes tokens to target workers over a bidirectional gRPC stream."""
