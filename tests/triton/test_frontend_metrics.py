"""The frontend's Prometheus exposition (`backend/openai_api/metrics.py`) without a server:
histogram buckets (a value on a bound counts in that bucket), label escaping, and the router's
per-replica families; read back by the same parser the served tests use."""

from __future__ import annotations

from backend.openai_api.metrics import FrontendMetrics, Histogram
from client.metrics import parse


def test_a_histogram_is_cumulative_and_a_value_on_a_bound_is_in_its_bucket():
    h = Histogram((0.1, 1.0))
    for v in (0.1, 0.5, 1.0, 3.0, 0.0):
        h.observe(v)
    lines = h.lines("x", 'endpoint="/a"')
    assert lines == ['x_bucket{endpoint="/a",le="0.1"} 2', 'x_bucket{endpoint="/a",le="1.0"} 4',
                     'x_bucket{endpoint="/a",le="+Inf"} 5', 'x_sum{endpoint="/a"} 4.6',
                     'x_count{endpoint="/a"} 5']


def test_the_exposition_holds_every_family_and_escapes_labels():
    m = FrontendMetrics()
    m.started("/v1/completions")
    m.answered("/v1/completions", 0.05, 0.3, {"prompt_tokens": 7, "completion_tokens": 4,
                                              "prompt_tokens_details": {"cached_tokens": 3}})
    m.finished("/v1/completions", 200, 0.4)
    m.finished("/v1/models", 200, None)
    samples = parse(m.text([{"url": 'h"1:8001', "routed": 2, "inflight": 0, "up": False,
                              "failures": 1, "pages": 9}]))
    p = "suffixreplay_frontend_"
    c = ("endpoint", "/v1/completions")

    def get(name, *labels):
        [v] = [v for (n, ls), v in samples.items() if n == p + name and set(labels) <= ls]
        return v

    assert get("requests_total", c, ("status", "200")) == 1
    assert get("requests_total", ("endpoint", "/v1/models")) == 1
    assert get("requests_running", c) == 0
    assert (get("prompt_tokens_total", c), get("generation_tokens_total", c),
            get("cached_prompt_tokens_total", c)) == (7, 4, 3)
    assert abs(get("time_per_output_token_seconds_sum", c) - 0.1) < 1e-12  # 0.3 s / 3
    assert get("time_to_first_token_seconds_bucket", c, ("le", "0.06")) == 1
    assert get("time_to_first_token_seconds_bucket", c, ("le", "0.04")) == 0
    assert get("e2e_request_latency_seconds_count", c) == 1
    replica = ("url", 'h\\"1:8001')
    assert get("router_up", replica) == 0 and get("router_failures_total", replica) == 1
    assert get("router_requests_total", ("replica", "0")) == 2
    assert get("router_announced_pages", replica) == 9
