"""Test support: real etcd / nats-server processes and a managed-process helper."""
