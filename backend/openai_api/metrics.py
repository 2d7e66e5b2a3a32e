"""The OpenAI frontend's own Prometheus metrics (`GET /metrics` on its port).

Triton's metrics port describes the engine (`backend/triton/metrics.py`); these describe what
the frontend's clients see, gRPC hop, tokenization and routing included, as vLLM's OpenAI
server reports them:

- `suffixreplay_frontend_requests_total{endpoint, status}`: HTTP requests by route and status;
- `suffixreplay_frontend_requests_running{endpoint}`: generation requests being answered;
- `suffixreplay_frontend_time_to_first_token_seconds{endpoint}`: from the request's arrival to
  its first generated piece (text, reasoning or a tool call), a histogram;
- `suffixreplay_frontend_time_per_output_token_seconds{endpoint}`: the time after the first
  piece over the tokens after the first (requests of two or more tokens), a histogram;
- `suffixreplay_frontend_e2e_request_latency_seconds{endpoint}`: arrival to the last byte,
  a histogram (generation routes);
- `suffixreplay_frontend_{prompt,generation,cached_prompt}_tokens_total{endpoint}`: the
  tokens in the answers' `usage`;
- with several replicas, per replica (its index and URL): `..._router_requests_total`,
  `..._router_requests_inflight`, `..._router_up` (1, or 0 while it is passed over after a
  failure), `..._router_failures_total`, `..._router_announced_pages`.

Histograms carry cumulative `_bucket{le}` samples, `_sum` and `_count`, as Prometheus' text
format has them.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Sequence

PREFIX = "suffixreplay_frontend_"
GENERATION = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
# vLLM's buckets for the same quantities (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value
        self.sum += value

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip((*map(_number, self.bounds), "+Inf"), self.counts):
            total += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {total}')
        return out + [f"{name}_sum{{{labels}}} {self.sum!r}", f"{name}_count{{{labels}}} {total}"]


def _number(value: float) -> str:
    return repr(float(value))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class FrontendMetrics:
    """Counters and histograms the handlers feed (from the event loop; `text` may run
    anywhere: a lock guards both)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.running: dict[str, int] = defaultdict(int)
        self.tokens: dict[tuple[str, str], int] = defaultdict(int)  # (kind, endpoint)
        self.ttft: dict[str, Histogram] = {}
        self.tpot: dict[str, Histogram] = {}
        self.e2e: dict[str, Histogram] = {}

    def started(self, endpoint: str) -> None:
        with self._lock:
            self.running[endpoint] += 1

    def finished(self, endpoint: str, status: int, seconds: float | None) -> None:
        """A request answered (`seconds`: its latency, for generation routes)."""
        with self._lock:
            self.requests[(endpoint, status)] += 1
            if seconds is not None:
                self.running[endpoint] -= 1
                self._histogram(self.e2e, endpoint, E2E_BUCKETS).observe(seconds)

    def answered(self, endpoint: str, ttft: float | None, after_first: float,
                 usage: dict) -> None:
        """A generation's timings (`ttft`: None where nothing was generated) and `usage`."""
        with self._lock:
            prompt = usage.get("prompt_tokens", 0)
            generated = usage.get("completion_tokens", 0)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            self.tokens[("prompt", endpoint)] += prompt
            self.tokens[("generation", endpoint)] += generated
            self.tokens[("cached_prompt", endpoint)] += cached
            if ttft is not None:
                self._histogram(self.ttft, endpoint, TTFT_BUCKETS).observe(ttft)
                if generated > 1:
                    self._histogram(self.tpot, endpoint, TPOT_BUCKETS).observe(
                        after_first / (generated - 1))

    @staticmethod
    def _histogram(table: dict[str, Histogram], endpoint: str,
                   buckets: Sequence[float]) -> Histogram:
        if endpoint not in table:
            table[endpoint] = Histogram(buckets)
        return table[endpoint]

    def text(self, replicas: Sequence[dict] = ()) -> str:
        """The exposition (`replicas`: the router's `stats()` with each one's "url")."""
        lines: list[str] = []

        def family(name: str, kind: str, doc: str) -> str:
            lines.append(f"# HELP {PREFIX}{name} {doc}")
            lines.append(f"# TYPE {PREFIX}{name} {kind}")
            return PREFIX + name

        with self._lock:
            name = family("requests_total", "counter", "HTTP requests by route and status.")
            for (endpoint, status), n in sorted(self.requests.items()):
                lines.append(f'{name}{{endpoint="{_label(endpoint)}",status="{status}"}} {n}')
            name = family("requests_running", "gauge", "Generation requests being answered.")
            for endpoint in GENERATION:
                lines.append(f'{name}{{endpoint="{endpoint}"}} {self.running[endpoint]}')
            for kind, doc in (("prompt", "Prompt tokens."), ("generation", "Generated tokens."),
                              ("cached_prompt", "Prompt tokens served from the prefix cache.")):
                name = family(f"{kind}_tokens_total", "counter", doc)
                for endpoint in GENERATION:
                    lines.append(f'{name}{{endpoint="{endpoint}"}} '
                                 f"{self.tokens[(kind, endpoint)]}")
            for table, short, doc in (
                    (self.ttft, "time_to_first_token_seconds",
                     "Arrival to the first generated piece."),
                    (self.tpot, "time_per_output_token_seconds",
                     "Time after the first piece over the tokens after the first."),
                    (self.e2e, "e2e_request_latency_seconds", "Arrival to the last byte.")):
                name = family(short, "histogram", doc)
                for endpoint in sorted(table):
                    lines += table[endpoint].lines(name, f'endpoint="{endpoint}"')
        if replicas:
            for short, key, kind, doc in (
                    ("router_requests_total", "routed", "counter", "Requests sent to it."),
                    ("router_requests_inflight", "inflight", "gauge", "Its requests running."),
                    ("router_up", "up", "gauge", "0 while it is passed over after a failure."),
                    ("router_failures_total", "failures", "counter",
                     "Requests that could not reach it."),
                    ("router_announced_pages", "pages", "gauge",
                     "Pages its KV cache events announced.")):
                name = family(short, kind, doc)
                for i, replica in enumerate(replicas):
                    lines.append(f'{name}{{replica="{i}",url="{_label(replica["url"])}"}} '
                                 f"{int(replica[key])}")
        return "\n".join(lines) + "\n"
