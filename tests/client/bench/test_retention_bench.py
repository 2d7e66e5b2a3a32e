"""The retention benchmark, short, through three real servers: the agent's system prompt,
sent with a retention priority or a session id, is still cached at each call after the
one-off prompts between calls; sent plainly, the one-offs pushed it out."""

from __future__ import annotations

from client.bench import retention


def test_retained_and_session_calls_hit_where_plain_ones_miss(tmp_path):
    summary = retention.main(["--system-tokens", "256", "--question-tokens", "32",
                              "--rounds", "3", "--one-offs", "2", "--max-tokens", "4",
                              "--max-cached-pages", "6", "--out", str(tmp_path / "summary.json")])
    calls = {how: summary["results"][how]["calls"] for how in retention.SYSTEMS}
    # 289-token prompts: the system prompt's 4 pages (256 tokens) come from the cache.
    assert calls["retain"]["cached_fraction"] == calls["session"]["cached_fraction"] \
        == round(256 / 289, 3), calls
    assert calls["lru"]["cached_fraction"] == 0.0, calls  # 8 pages of one-offs in a cache of 6
    assert all(summary["results"][h]["one_offs"]["ttft_mean_ms"] > 0 for h in retention.SYSTEMS)
    assert set(summary["call_ttft_speedup_vs_lru"]) == {"retain", "session"}
    assert (tmp_path / "retention.png").stat().st_size > 0
