"""Config validation, names, and chained block hashes."""

from __future__ import annotations

import argparse
import json

import pytest

from runtime.config import SOURCE_ROOT, RuntimeConfig, add_runtime_args, config_from_args, importable_env, redact_url
from runtime.kv_hash import block_hash, block_hashes
from runtime.names import check_token, instance_key, model_key

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kwargs", [
    {"etcd_url": "localhost"},
    {"nats_url": "nats://127.0.0.1"},
    {"namespace": "a.b"},
    {"namespace": ""},
    {"lease_ttl": 1},
    {"ack_timeout": 0},
])
def test_bad_config_raises_value_error(kwargs):
    with pytest.raises(ValueError):
        RuntimeConfig(**kwargs)


def test_env_then_flags(monkeypatch):
    monkeypatch.setenv("TANDEM_ETCD", "http://10.0.0.1:2379")
    monkeypatch.setenv("TANDEM_NATS", "nats://10.0.0.2:4222")
    monkeypatch.setenv("TANDEM_NAMESPACE", "prod")
    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    cfg = config_from_args(parser.parse_args(["--namespace", "staging", "--lease-ttl", "5"]))
    assert (cfg.etcd_url, cfg.nats_url, cfg.namespace, cfg.lease_ttl) == (
        "http://10.0.0.1:2379", "nats://10.0.0.2:4222", "staging", 5)
    assert cfg.etcd_host_port == ("10.0.0.1", 2379)


def test_etcd_security_from_flags_env_and_url(monkeypatch, tmp_path):
    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    (tmp_path / "pw").write_text("from-file\n")
    monkeypatch.setenv("TANDEM_ETCD_USER", "svc")
    monkeypatch.setenv("TANDEM_ETCD_PASSWORD", "from-env")
    cfg = config_from_args(parser.parse_args(["--etcd-security", json.dumps({"tls_ca": str(ca)})]))
    sec = cfg.etcd_security()
    assert (sec.tls, sec.ca, sec.user, sec.password) == (True, str(ca), "svc", "from-env")
    assert "from-env" not in repr(cfg) and "from-env" not in repr(sec)
    cfg = config_from_args(parser.parse_args(["--etcd-security", json.dumps({"password": f"@{tmp_path / 'pw'}"})]))
    assert cfg.etcd_credentials == ("svc", "from-file")
    monkeypatch.setenv("TANDEM_ETCD_SECURITY", json.dumps({"user": "env-json"}))  # beneath the flag, key by key
    cfg = config_from_args(parser.parse_args(["--etcd-security", json.dumps({"password": "pw"})]))
    assert cfg.etcd_credentials == ("env-json", "pw")
    monkeypatch.delenv("TANDEM_ETCD_SECURITY")
    with pytest.raises(ValueError, match="--etcd-security: 'tls_cafile' unknown key"):
        config_from_args(parser.parse_args(["--etcd-security", '{"tls_cafile": "x"}']))
    monkeypatch.delenv("TANDEM_ETCD_USER")
    monkeypatch.delenv("TANDEM_ETCD_PASSWORD")
    cfg = RuntimeConfig(etcd_url="https://root:p%40ss@etcd:2379")
    assert cfg.etcd_credentials == ("root", "p@ss") and cfg.etcd_security().tls
    assert redact_url(cfg.etcd_url) == "https://***@etcd:2379"
    assert not RuntimeConfig().etcd_security().tls
    with pytest.raises(ValueError, match="go together"):
        RuntimeConfig(etcd_tls_cert=str(ca))
    with pytest.raises(ValueError, match="needs a password"):
        RuntimeConfig(etcd_user="root")
    with pytest.raises(ValueError, match="does not exist"):
        RuntimeConfig(etcd_tls_ca=str(tmp_path / "missing.pem"))


def test_a_child_environment_imports_this_checkout_first():
    root = str(SOURCE_ROOT)
    assert (SOURCE_ROOT / "runtime" / "config.py").exists()
    assert importable_env({"A": "1"}) == {"A": "1", "PYTHONPATH": root}
    assert importable_env({"PYTHONPATH": "/x:/y"})["PYTHONPATH"] == f"{root}:/x:/y"  # theirs kept, after it
    once = importable_env({"PYTHONPATH": "/x"})
    assert importable_env(once) == once  # not added twice (a Child of a child)


def test_names():
    assert instance_key("ns", "target", "generate", "abc") == "tandem/ns/instances/target/generate/abc"
    assert model_key("ns", "org/model", "abc") == "tandem/ns/models/org%2Fmodel/abc"
    with pytest.raises(ValueError):
        check_token("a.b", "component")


def test_block_hashes_chain_over_prefixes():
    a = block_hashes(list(range(40)), 16)
    b = block_hashes(list(range(32)) + [99] * 8, 16)
    assert len(a) == 2 and a == b  # only full blocks count; the partial third block is ignored
    c = block_hashes([0] + list(range(1, 40)), 16)
    assert c == a
    d = block_hashes([5] + list(range(1, 40)), 16)
    assert d[0] != a[0] and d[1] != a[1]  # a change in block 0 changes every later hash
    assert block_hash(a[0], list(range(16, 32))) == a[1]
    assert all(0 <= h < 2**63 for h in a)
    with pytest.raises(ValueError):
        block_hashes([1], 0)
