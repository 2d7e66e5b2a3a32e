"""The routing benchmark, short, through two real replicas and two frontend processes: with
the KV cache events every later turn finds its chat's pages; sent in turn, some turns land on
the replica that does not have them (the order of the chats is seeded, so this run's is fixed)."""

from __future__ import annotations

from client.bench import router


def test_kv_aware_routing_serves_later_turns_from_the_cache(tmp_path):
    summary = router.main(["--chats", "3", "--turns", "3", "--system-tokens", "256",
                           "--max-tokens", "4", "--out", str(tmp_path / "summary.json")])
    later = {s: summary["results"][s]["later_turns"] for s in router.SYSTEMS}
    assert later["kv_aware"]["requests"] == later["in_turn"]["requests"] == 6
    assert later["kv_aware"]["cached_fraction"] > later["in_turn"]["cached_fraction"], later
    assert later["kv_aware"]["cached_fraction"] > 0.7, later  # each turn's earlier pages
    assert summary["later_turn_ttft_speedup_kv_aware_vs_in_turn"] > 0
    assert (tmp_path / "router.png").stat().st_size > 0
