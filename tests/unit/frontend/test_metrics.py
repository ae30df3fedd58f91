"""Frontend metrics: Dynamo's names carry the same samples as Tandem's; the queued gauge; ignored
fields counted with a bounded set of labels."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend.metrics import MAX_IGNORED_FIELD_LABELS, FrontendMetrics, RequestTimer

pytestmark = pytest.mark.unit


def samples(m: FrontendMetrics) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(m.render().decode()) for s in family.samples}


def test_dynamo_names_are_the_same_samples():
    m = FrontendMetrics()
    series = m.series("x")
    timer = RequestTimer(series, start=0.0)
    assert samples(m)[("dynamo_frontend_queued_requests", (("model", "x"),))] == 1
    timer.tokens(2)
    timer.tokens(3)
    timer.done()
    series.observe_tokens(7, 5, 0)
    got = samples(m)
    tandem = {(n.removeprefix("tandem_frontend_"), labels): v for (n, labels), v in got.items()
              if n.startswith("tandem_frontend_")}
    for stem in ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_duration_seconds",
                 "input_sequence_tokens", "output_sequence_tokens"):
        for suffix in ("_count", "_sum", "_bucket"):
            mine = {k: v for k, v in tandem.items() if k[0] == stem + suffix}
            assert mine and all(got[("dynamo_frontend_" + k[0], k[1])] == v for k, v in mine.items()), stem
    assert got[("dynamo_frontend_output_tokens_total", (("model", "x"),))] == 5
    assert got[("dynamo_frontend_queued_requests", (("model", "x"),))] == 0
    timer.unqueue()  # once only
    assert samples(m)[("tandem_frontend_queued_requests", (("model", "x"),))] == 0


def test_request_counters_in_both_label_sets():
    m = FrontendMetrics()
    m.observe_request("x", "chat", 200, stream=True)
    m.observe_request("x", "responses", 400)
    got = samples(m)
    assert got[("dynamo_frontend_requests_total", (("endpoint", "chat_completions"), ("model", "x"),
                                                    ("request_type", "stream"), ("status", "success")))] == 1
    assert got[("dynamo_frontend_requests_total", (("endpoint", "responses"), ("model", "x"),
                                                    ("request_type", "unary"), ("status", "error")))] == 1
    assert got[("tandem_frontend_requests_total", (("endpoint", "responses"), ("model", "x"), ("status", "400")))] == 1


def test_ignored_fields_have_a_bounded_label_set():
    m = FrontendMetrics()
    m.observe_ignored(["messages[0].refusal", "messages[3].refusal", "bad name!"])
    m.observe_ignored([f"f{i}" for i in range(MAX_IGNORED_FIELD_LABELS + 10)])
    got = {dict(k[1])["field"]: v for k, v in samples(m).items() if k[0] == "tandem_frontend_ignored_fields_total"}
    assert got["messages.refusal"] == 2 and len(got) == MAX_IGNORED_FIELD_LABELS + 1
    assert got["other"] == 1 + 11
