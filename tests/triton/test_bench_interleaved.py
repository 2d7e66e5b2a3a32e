"""The benchmark suite's interleaved runner against two real servers (the branching
workloads' TTFT keys are measured this way)."""

from __future__ import annotations

from client.bench.run_suite import _counters, _metrics_delta
from client.bench.suite import run_served_interleaved, summarize
from client.bench.workloads import BenchRequest, Workload
from tests.triton.conftest import LLM_MODELS, LLM_PARAMS
from tests.triton.llm_helpers import long_prompt


def test_interleaved_requests_reach_every_server_in_turn(triton_server):
    servers = {}
    for policy in ("suffixreplay", "checkpoint"):  # the servers test_generate also uses
        params = {"hybrid_llm": {**LLM_PARAMS["hybrid_llm"], "cache_policy": policy}}
        servers[policy] = triton_server(LLM_MODELS, params).urls
    urls = {p: u.grpc for p, u in servers.items()}
    before = {p: _counters(u.metrics) for p, u in servers.items()}
    trunk = list(long_prompt("Interleaved trunk", 300).encode())
    branch = trunk[:128] + list(long_prompt(" another turn", 60).encode())
    wl = Workload("interleave", [BenchRequest(rid, p, 2, tag, salt="interleave")
                                 for rid, p, tag in (("t", trunk, "first"),
                                                     ("b", branch, "branch"),
                                                     ("t2", trunk + [10, 65], "turn"))])
    records = run_served_interleaved(urls, wl)
    for recs in records.values():
        assert [r.rid for r in recs] == ["t", "b", "t2"]
        assert all(r.error is None and r.output_tokens == 2 for r in recs)
    # Request i reaches both servers before request i + 1 reaches either; who goes first
    # rotates.
    pairs = list(zip(records["suffixreplay"], records["checkpoint"]))
    for (a, b), (c, d) in zip(pairs, pairs[1:]):
        assert max(a.last, b.last) <= min(c.submitted, d.submitted)
    firsts = ["suffixreplay" if a.submitted < b.submitted else "checkpoint" for a, b in pairs]
    assert firsts == ["suffixreplay", "checkpoint", "suffixreplay"]
    # Each server kept its own cache: the branch at 128 hits under suffix replay only.
    hits = {p: recs[1].cached_tokens for p, recs in records.items()}
    assert hits == {"suffixreplay": 128, "checkpoint": 0}
    # What the suite reads from each server's metrics (labelled with the model and version):
    # the workload's recomputed tokens, and the pages and bytes the server holds after it.
    for policy, recs in records.items():
        stats = _metrics_delta(before[policy], _counters(servers[policy].metrics))
        summary = summarize(recs, stats, 1.0)
        assert summary["recomputed_tokens"] == summary["prompt_tokens"] - summary["cached_tokens"]
        assert summary["cached_pages"] >= len(trunk) // 64
        memory = summary["memory_bytes"]
        assert memory["device_kv"] > 0 and memory["device_states"] > 0
        assert (memory["device_anchors"] > 0) == (policy == "suffixreplay")
