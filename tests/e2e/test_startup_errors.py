"""Start-up failures of every service are one line, exit non-zero and, where waiting cannot help (a
missing path, a bad value, a refused connection, an untrusted certificate), come within 5 s. Real
processes, real etcd and nats-server (TLS ones with certificates made here by openssl)."""

from __future__ import annotations

import json

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runtime.config import importable_env
from tests.support.servers import EtcdServer, NatsServer, env_for, free_port
from tests.support.pki import make_pki

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def start(module: str, *args: str, env: dict) -> tuple[int, list[str], float]:
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", module, *args], env=importable_env(env), capture_output=True,
                          text=True, timeout=60, cwd=ROOT, check=False)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return done.returncode, lines, time.monotonic() - began


def one_line_quick(result: tuple[int, list[str], float], *expected: str) -> str:
    code, lines, seconds = result
    assert code != 0, lines
    assert len(lines) == 1, "\n".join(lines)
    assert "Traceback" not in lines[0] and "usage:" not in lines[0]
    for text in expected:
        assert text in lines[0], lines[0]
    # before any connection or model load: seconds on a quiet machine (importing torch is most of it);
    # the bound allows a loaded one, and still fails a start that waits on a server or a timeout
    assert seconds < 15, f"{seconds:.1f}s: {lines[0]}"
    return lines[0]


@pytest.fixture
def env(servers):
    return env_for(*servers, "startup")


@pytest.mark.parametrize("module, args, expected", [
    ("workers.target", ["--model", "/nonexistent/model"], "--model /nonexistent/model does not exist"),
    ("workers.draft", ["--method", "draft_model", "--draft-model", "/nonexistent/draft"],
     "--draft-model /nonexistent/draft does not exist"),
    ("workers.draft", ["--method", "eagle3", "--eagle-model", "/nonexistent/head", "--target-model", "/nonexistent/t"],
     "/nonexistent/head does not exist"),
    ("workers.mock", ["--lease-ttl", "-1"], "lease_ttl must be at least 2 seconds"),
    ("frontend", ["--lease-ttl", "-1", "--http-port", "0"], "lease_ttl must be at least 2 seconds"),
    ("router", ["--lease-ttl", "-1"], "lease_ttl must be at least 2 seconds"),
    ("workers.target", ["--lease-ttl", "-5"], "lease_ttl must be at least 2 seconds"),
    ("workers.draft", ["--lease-ttl", "-5"], "lease_ttl must be at least 2 seconds"),
    ("workers.target", ["--dtype", "int3"], "argument --dtype: invalid choice: 'int3'"),
    ("workers.target", ["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: Input should be less than or equal to 1"),
    ("workers.target", ["--speculative-config", '{"seam": "staged"}'], "--speculative-config: 'seam' Input should be"),
    ("workers.target", ["--spec-seam", "sync"], "--spec-seam was retired: use --speculative-config '{\"seam\": \"sync\"}'"),
    ("workers.mock", ["--etcd-tls-ca", "/x"], "--etcd-tls-ca was retired: use --etcd-security"),
    ("frontend", ["--tool-call-parser", "qwen25"], ("invalid choice: 'qwen25'", "hermes", "mistral", "llama3_json")),
    ("deploy.cli", ["up", "--mock", "--dtype", "float32"], "--dtype applies to model targets, not --mock"),
    ("deploy.cli", ["up", "--speculative-config", '{"method": "eagle3", "model": "/h", "acceptance_method": "x"}'],
     "--speculative-config: 'acceptance_method' unknown key"),
    ("workers.draft", ["--method", "eagle3", "--device", "gpu"], "--device must be auto, cpu, cuda or cuda:N"),
    pytest.param("workers.draft", ["--method", "eagle3", "--device", "cuda"], "--device cuda: CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")),
    ("workers.mock", ["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    ("frontend", ["--router-mode", "nope"], "invalid choice: 'nope'"),
])
def test_bad_start_up_values_are_one_line(env, module, args, expected):
    one_line_quick(start(module, *args, env=env), *([expected] if isinstance(expected, str) else expected))


@pytest.mark.parametrize("module", ["workers.mock", "frontend", "router", "workers.draft", "deploy.cli"])
def test_an_unknown_tandem_log_level_is_one_line(env, module):
    args = ["up", "--mock"] if module == "deploy.cli" else []  # tandem up
    one_line_quick(start(module, *args, env={**env, "TANDEM_LOG_LEVEL": "LOUD"}), "unknown log level 'LOUD'")


@pytest.mark.parametrize("missing", ["nats", "etcd"])
def test_a_refused_connection_is_said_at_once(env, missing):
    dead = free_port()
    if missing == "nats":
        env = {**env, "TANDEM_NATS": f"nats://127.0.0.1:{dead}"}
    else:
        env = {**env, "TANDEM_ETCD": f"http://127.0.0.1:{dead}"}
    line = one_line_quick(start("workers.mock", env=env), "connection refused", f"127.0.0.1:{dead}")
    assert ("NATS" if missing == "nats" else "etcd") in line and "TimeoutError" not in line


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI missing")
def test_an_untrusted_certificate_is_said_at_once(servers, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pki, other = make_pki(tmp_path / "a"), make_pki(tmp_path / "b")
    etcd_server, nats_server = servers
    nats_tls = NatsServer("--tls", "--tlscert", pki["server_cert"], "--tlskey", pki["server_key"])
    etcd_tls = EtcdServer("--cert-file", pki["server_cert"], "--key-file", pki["server_key"], scheme="https")
    nats_tls.start()
    etcd_tls.start()
    try:
        env = env_for(etcd_server, nats_tls, "startup")
        line = one_line_quick(start("workers.mock", "--nats-security", json.dumps({"tls_ca": other["ca"]}), env=env),
                              "NATS", "certificate")
        assert "TimeoutError" not in line
        env = env_for(etcd_tls, nats_server, "startup")
        line = one_line_quick(start("workers.mock", "--etcd-security", json.dumps({"tls_ca": other["ca"]}), env=env),
                              "etcd", "certificate")
        assert "TimeoutError" not in line
    finally:
        nats_tls.cleanup()
        etcd_tls.cleanup()


def test_a_server_that_may_still_come_is_waited_for(env):
    """A timeout is no final cause: the service keeps trying until --connect-timeout, then says so."""
    code, lines, seconds = start("workers.mock", "--connect-timeout", "2",
                                 env={**env, "TANDEM_NATS": "nats://10.255.255.1:4222"})  # unroutable: no answer
    assert code == 1 and len(lines) == 1 and "cannot reach NATS" in lines[0] and "gave up after 2s" in lines[0], lines
    assert 1.5 < seconds < 15


def test_a_tokenizer_the_grammar_engine_misreads_stops_a_target(env, tmp_path):
    """Structured outputs on such a tokenizer would refuse valid text: the worker says so at start."""
    import json

    from tests.support.tokenizer_files import converted_as
    from tests.support.tiny_models import tiny_hf_model
    from workers.demo_model import demo_tokenizer_dir

    try:
        canonical = demo_tokenizer_dir()
    except FileNotFoundError:
        pytest.skip("SmolLM2's tokenizer is not installed")
    model = tmp_path / "model"
    tiny_hf_model("llama", model, vocab=49152, layers=1)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": 2}))
    tokenizer = json.loads((converted_as(canonical, "5.17.0", tmp_path / "tok") / "tokenizer.json").read_text())
    # a decoder step the grammar side does not know: llguidance reads the byte-level pieces as text
    tokenizer["decoder"]["decoders"].append({"type": "Strip", "content": " ", "start": 0, "stop": 0})
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    code, lines, _ = start("workers.target", "--model", str(model), "--device", "cpu", env=env)
    # after the model loads (its progress logged at INFO): one line that names the file
    assert code != 0 and not any("Traceback" in line for line in lines), "\n".join(lines)
    assert "grammar engine (llguidance) reads the tokens of" in lines[-1], "\n".join(lines)
    assert str(model / "tokenizer.json") in lines[-1]
