"""deploy/docker-compose.yml against the compose-spec schema (and `docker compose config` where the
CLI has the plugin), Prometheus scraping every component, the Grafana dashboard, yamllint, compose-lint."""

from __future__ import annotations

import copy
import importlib.resources
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
TANDEM_SERVICES = {"frontend", "router", "target", "draft", "mock", "prefill", "decode"}
# the module each service runs, where it is not the service's name (prefill and decode are target workers)
RUNS = {"prefill": "target", "decode": "target"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def compose_validator():
    # The compose-spec schema as vendored by the check-jsonschema package (a test dependency).
    text = (importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text()
    schema = json.loads(text)
    return jsonschema.validators.validator_for(schema)(schema)


def test_compose_file_is_valid_against_the_compose_spec(compose, compose_validator):
    errors = [f"{list(e.path)}: {e.message}" for e in compose_validator.iter_errors(compose)]
    assert not errors


def test_compose_schema_rejects_a_broken_file(compose, compose_validator):
    broken = copy.deepcopy(compose)
    broken["services"]["etcd"]["healthcheck"]["intervall"] = "5s"
    assert not compose_validator.is_valid(broken)


@pytest.mark.skipif(
    shutil.which("docker") is None
    or subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0,
    reason="the docker CLI with the compose plugin is not installed here (the schema test covers the file)",
)
def test_docker_compose_config_accepts_every_profile():
    for profile in ("tandem", "mock", "disagg"):
        out = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "--profile", profile, "config", "--quiet"],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "GRAFANA_ADMIN_PASSWORD": "test-only"})
        assert out.returncode == 0, out.stderr


def test_infra_is_pinned_healthchecked_and_persistent(compose):
    services = compose["services"]
    for name in ("etcd", "nats", "prometheus", "grafana"):
        svc = services[name]
        image, _, tag = svc["image"].rpartition(":")
        assert image and tag and tag != "latest", name
        assert svc["healthcheck"]["test"], name
        assert "profiles" not in svc, f"{name} belongs to the default (infra) stack"
    for name in ("etcd", "prometheus", "grafana"):
        assert any(v.split(":")[0] in compose["volumes"] for v in services[name]["volumes"]), name


def test_nats_is_core_nats_without_jetstream(compose):
    # No Tandem code uses JetStream (request/reply and pub/sub only): nothing to persist.
    nats = compose["services"]["nats"]
    words = " ".join(nats["command"]).split()
    assert not {"--jetstream", "-js", "--js"} & set(words) and not any("store_dir" in w for w in words)
    assert "js-enabled" not in " ".join(nats["healthcheck"]["test"])
    assert "volumes" not in nats and "nats-data" not in compose["volumes"]


def test_tandem_services_are_profiled_built_from_the_dockerfile_and_gpu_where_needed(compose):
    services = compose["services"]
    for name in TANDEM_SERVICES:
        svc = services[name]
        assert svc["profiles"], name
        assert svc["build"]["context"] == ".." and (COMPOSE.parent / svc["build"]["context"] / svc["build"]["dockerfile"]).exists()
        assert svc["command"][0] == RUNS.get(name, name)
        assert svc["depends_on"]["etcd"]["condition"] == "service_healthy"
        assert svc["environment"]["TANDEM_ETCD"] == "http://etcd:2379"
        assert svc["stop_grace_period"] == "35s"  # the 30 s drain plus a margin
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        assert bool(devices) == (name in ("target", "draft", "prefill", "decode")), name
        if devices:
            assert devices[0]["capabilities"] == ["gpu"]
    assert {"tandem"} <= set(services["target"]["profiles"]) and "mock" in services["frontend"]["profiles"]


def test_the_frontend_mounts_what_the_workers_mount(compose):
    # The frontend loads the tokenizer from the local path in a worker's model card.
    services = compose["services"]
    frontend = set(services["frontend"]["volumes"])
    for name in ("target", "draft", "mock", "prefill", "decode"):
        assert set(services[name]["volumes"]) <= frontend, name


def test_drafts_register_a_routable_grpc_address(compose):
    draft = compose["services"]["draft"]
    assert draft["environment"]["TANDEM_DRAFT_GRPC_HOST"] == "auto"
    assert draft["environment"]["TANDEM_ETCD"] == "http://etcd:2379"  # the shared environment is kept


def test_prometheus_scrapes_every_component(compose):
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    ports = {"frontend": 8000, "router": 8001, "target": 9100, "draft": 9100, "mock": 9100}
    for name, port in ports.items():
        [sd] = jobs[name]["dns_sd_configs"]
        assert sd["names"] == [name] and sd["port"] == port
        command = " ".join(compose["services"][name]["command"])
        assert str(port) in command, f"{name} does not serve on the port Prometheus scrapes"
        assert "0.0.0.0" in command, f"{name} binds only its own loopback: Prometheus cannot reach it"


def test_grafana_is_provisioned_with_the_tandem_dashboard():
    prov = DEPLOY / "grafana" / "provisioning"
    [ds] = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert ds["url"] == "http://prometheus:9090" and ds["uid"] == "prometheus"
    provider = yaml.safe_load((prov / "dashboards" / "tandem.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "tandem.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for metric in ("tandem_frontend_requests_total", "tandem_frontend_time_to_first_token_seconds_bucket",
                   "tandem_frontend_inter_token_latency_seconds_bucket", "tandem_spec_decode_num_drafts_total",
                   "tandem_spec_decode_num_draft_tokens_total", "tandem_spec_decode_num_accepted_tokens_total",
                   "tandem_spec_decode_num_accepted_tokens_per_pos_total", "tandem_frontend_cached_prompt_tokens_total",
                   'job="draft"'):
        assert metric in exprs, metric
    # one dashboard for compose and k8s: a data source variable, and every series scoped by namespace
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource", "namespace"]
    assert all(t["datasource"]["uid"] == "${datasource}" for p in dash["panels"] for t in p["targets"])
    selectors = re.findall(r"\b(?:tandem_[a-z_]+|up)\{[^}]*\}", exprs)
    assert selectors and all('namespace=~"$namespace"' in s for s in selectors)
    assert not re.search(r"\b(?:tandem_[a-z_]+|up)(?![a-z_{])", exprs)  # no unscoped series
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    assert "sum by (target)" in exprs and "sum by (draft)" in exprs  # the router's labels (router/metrics.py)
    for word in ("request rate", "first token", "inter-token", "acceptance rate", "mean accepted length",
                 "kv cache hit", "target workers", "draft workers"):
        assert word in titles, word
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_only_the_frontend_and_grafana_are_published_and_grafana_has_no_default_password():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, svc in services.items():
        for port in svc.get("ports", []):
            if name in ("frontend", "grafana"):  # bind address and port from the environment, loopback by default
                assert port.startswith("${") and ":-127.0.0.1}" in port, (name, port)
            else:
                assert port.startswith("127.0.0.1:"), (name, port)
    password = services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert password.startswith("${GRAFANA_ADMIN_PASSWORD:?"), password  # compose refuses to start without one


def test_dashboard_queries_are_valid_promql():
    import promql_parser  # the test extra: a missing one fails, never skips
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "tandem.json").read_text())
    for panel in dash["panels"]:
        for target in panel["targets"]:
            # Grafana fills in $__rate_interval before Prometheus sees the query.
            promql_parser.parse(target["expr"].replace("$__rate_interval", "1m"))
    with pytest.raises(ValueError):
        promql_parser.parse("sum by (target (rate(x[1m]))")


def test_yaml_is_lint_clean():
    config = YamlLintConfig(file=str(ROOT / ".yamllint"))
    files = sorted([*ROOT.joinpath("k8s").rglob("*.yaml"), *DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.yaml")])
    assert len(files) > 20
    problems = [f"{f.relative_to(ROOT)}:{p.line}: {p.message}" for f in files
                for p in linter.run(f.read_text(), config, str(f))]
    assert not problems


def test_compose_lint_finds_nothing_high_and_would_catch_a_literal_password(tmp_path):
    """compose-lint (OWASP / CIS Docker Benchmark rules, in the test extra) on the file as it is, and on a
    copy with Grafana's password written in, as the file had it before."""
    import compose_lint  # noqa: F401 (the test extra: a missing one fails, never skips)

    def lint(path: Path) -> list[dict]:
        out = subprocess.run([sys.executable, "-m", "compose_lint", "check", "--format", "json", "--no-env",
                              "--fail-on", "high", str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode in (0, 1), out.stderr
        return [f for f in json.loads(out.stdout)["findings"] if not f["suppressed"]]

    findings = lint(COMPOSE)
    assert not [f for f in findings if f["severity"] in ("high", "critical")], findings
    assert not [f for f in findings if f["rule_id"] == "CL-0003"]  # no-new-privileges everywhere
    compose = yaml.safe_load(COMPOSE.read_text())
    compose["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] = "admin"
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(yaml.safe_dump(compose))
    assert any(f["severity"] == "high" and f["service"] == "grafana" for f in lint(broken))


def _interpolate(value, env: dict[str, str]):
    """Compose's ``${VAR:-default}`` (nested defaults too) and ``${VAR}`` in every string of a parsed
    file (compose interpolates after parsing: an empty result stays a string)."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value
    pattern = re.compile(r"\$\{(\w+)(?::-([^${}]*))?\}")
    while True:
        new = pattern.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)
        if new == value:
            return new
        value = new


@pytest.mark.parametrize("dotenv, want", [
    ({"TANDEM_DRAFT_METHOD": "draft_model", "TANDEM_DRAFT_MODEL": "MODELS/llama-1b"},
     {"method": "draft_model", "draft_model": "MODELS/llama-1b"}),
    ({"TANDEM_DRAFT_METHOD": "eagle3", "TANDEM_EAGLE_MODEL": "MODELS/eagle3", "TANDEM_MODEL": "MODELS/llama-8b"},
     {"method": "eagle3", "eagle_model": "MODELS/eagle3", "target_model": "MODELS/llama-8b"}),
    ({}, {"method": "ngram", "draft_model": None, "eagle_model": None}),
])
def test_the_draft_service_takes_its_models_from_dotenv(dotenv, want, monkeypatch, tmp_path):
    # deploy/.env fills the compose file only: what a model-based draft loads must reach the container,
    # through its command or its environment, or draft_model and eagle3 exit at start.
    from workers.draft.__main__ import build_parser, draft_config

    # The config checks the device (no GPU here) and that the model directories exist.
    for name in ("llama-1b", "eagle3", "llama-8b"):
        (tmp_path / name).mkdir()
    dotenv = {k: v.replace("MODELS", str(tmp_path)) for k, v in dotenv.items()} | {"TANDEM_DRAFT_DEVICE": "cpu"}
    want = {k: v.replace("MODELS", str(tmp_path)) if isinstance(v, str) and k != "method" else v for k, v in want.items()}
    service = _interpolate(yaml.safe_load(COMPOSE.read_text())["services"]["draft"], dotenv)
    for name in [k for k in os.environ if k.startswith("TANDEM_")]:
        monkeypatch.delenv(name)
    for name, value in service["environment"].items():
        monkeypatch.setenv(name, str(value))
    cfg = draft_config(build_parser().parse_args(service["command"][1:]))
    assert {k: getattr(cfg, k) for k in want} == want
