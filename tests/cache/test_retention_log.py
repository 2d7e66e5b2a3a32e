"""Retention priorities across a warm restart: logged beside the SSD chunks as requests set
them, given back to the restored pages for the rest of their durations; a line that does not
parse is skipped, a page that left every tier is forgotten."""

from __future__ import annotations

import time

from tier_helpers import make_tiered, pages, run_request

from backend.cache.retention import DEFAULT_PRIORITY
from backend.cache.retention_log import FILE_NAME, RetentionLog


def test_a_restored_page_keeps_the_priority_a_request_gave_it(tmp_path):
    store, tiers = make_tiered(tmp_path, num_kv_pages=8, host_pages=4)
    path, _ = run_request(store, tiers, pages(1, 2, 3, 4))
    store.retain(path, [(90, None), (60, 3600.0), (80, 0.05), (DEFAULT_PRIORITY, None)])
    tiers.close()
    time.sleep(0.1)  # the third page's priority has expired by the restart
    with open(tmp_path / FILE_NAME, "a") as f:
        f.write("not a line\n" + "ab" * 16 + " 100 -\n")  # junk; a page no chunk holds

    store2, tiers2 = make_tiered(tmp_path, num_kv_pages=8, host_pages=4)
    assert tiers2.retention_log.skipped == 1
    assert len(tiers2.retention_log.entries) == 2  # the lines of chunks found (not expired)
    nodes = store2.match_prefix(pages(1, 2, 3, 4)).nodes
    assert [n.priority for n in nodes] == [90, 60, DEFAULT_PRIORITY, DEFAULT_PRIORITY]
    assert [n.priority_set for n in nodes] == [True, True, False, False]
    assert nodes[0].priority_until is None
    left = nodes[1].priority_until - store2.evictor.clock()
    assert 3500 < left <= 3600
    assert tiers2.stats.restored_priorities == 2
    # the restored priorities order eviction as before: the default page goes first
    assert store2.evictor.priority_of(nodes[0]) == 90
    tiers2.assert_invariants()
    # pages that leave every tier are forgotten: nothing comes back after a reset
    store2.reset()
    assert tiers2.retention_log.entries == {}
    tiers2.close()
    assert RetentionLog(tmp_path).entries == {}
    assert (tmp_path / FILE_NAME).read_text() == ""


def test_the_log_is_rewritten_when_it_grows(tmp_path, monkeypatch):
    import backend.cache.retention_log as module

    monkeypatch.setattr(module, "COMPACT_MIN_LINES", 8)
    log = RetentionLog(tmp_path)
    key = bytes(range(16))
    for priority in range(40, 60):  # one page raised again and again
        log.record(key, priority, None)
    lines = (tmp_path / FILE_NAME).read_text().splitlines()
    assert len(lines) < 8 and lines[-1] == f"{key.hex()} 59 -"
    assert RetentionLog(tmp_path).lookup(key) == (59, None)
    log.record(key, 70, time.time() - 1)  # already expired: nothing, 59 holds
    assert log.lookup(key) == (59, None) == RetentionLog(tmp_path).lookup(key)
    log.record(key, DEFAULT_PRIORITY, None)  # the page left every tier: forgotten
    assert log.lookup(key) is None and RetentionLog(tmp_path).lookup(key) is None


def test_a_shorter_raise_ends_and_the_longer_grant_holds_again_after_a_restart(tmp_path):
    """A page at 50 for 100 s, raised to 60 for 1 s by another request: the log kept only
    the last line, so a restart 2 s later found the page at the default."""
    now = [1000.0]
    log = RetentionLog(tmp_path, clock=lambda: now[0])
    key = bytes(range(16))
    log.record(key, 50, 1100.0)
    log.record(key, 60, 1001.0)
    log.record(key, 40, 1050.0)  # outdone by the 50: nothing to log
    assert log.grants(key) == [(60, 1.0), (50, 100.0)]
    now[0] = 1002.0
    restarted = RetentionLog(tmp_path, clock=lambda: now[0])
    assert restarted.lookup(key) == (50, 98.0) and restarted.grants(key) == [(50, 98.0)]


def test_without_an_ssd_tier_nothing_is_logged(tmp_path):
    store, tiers = make_tiered(None, num_kv_pages=8, host_pages=4)
    path, _ = run_request(store, tiers, pages(1, 2))
    store.retain(path, [(90, None), (90, None)])
    assert tiers.retention_log is None and not (tmp_path / FILE_NAME).exists()
    tiers.close()


def test_a_log_that_cannot_be_written_is_forgotten_not_raised(tmp_path, monkeypatch, caplog):
    """The SSD directory removed (or the disk full) under a running engine: appends and
    rewrites fail, the log warns once and counts them, and the priorities still hold in this
    process (a restart may forget them, as it may forget a chunk)."""
    import backend.cache.retention_log as module

    monkeypatch.setattr(module, "COMPACT_MIN_LINES", 4)
    directory = tmp_path / "ssd"
    directory.mkdir()
    log = RetentionLog(directory)
    key = bytes(range(16))
    log.record(key, 80, None)
    directory.joinpath(FILE_NAME).unlink()
    directory.rmdir()
    with caplog.at_level("WARNING", logger=module.__name__):
        for priority in range(81, 90):  # appends fail; past 4 lines a rewrite is tried too
            log.record(key, priority, None)
    assert log.write_errors == 9
    assert log.lookup(key) == (89, None)
    assert len([r for r in caplog.records if "retention log" in r.message]) == 1
    directory.mkdir()  # writable again: the next change is logged
    log.record(key, 95, None)
    assert RetentionLog(directory).lookup(key) == (95, None)
