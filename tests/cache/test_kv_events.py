"""KV cache events (`backend/cache/events.py`): the prefix tree's pages joining and leaving as
BlockStored / BlockRemoved events with chained hashes, and the ZeroMQ publisher that sends them
(sequence numbers, the AllBlocksCleared a starting server sends, the replay of missed ones)."""

from __future__ import annotations

import socket
import time

import msgpack
import pytest
from cache_helpers import cache_tokens, make_store, pages

from backend.cache.events import KvEventLog, KvEventPublisher, page_hash
from backend.cache.radix import encode_tokens, lora_namespace
from client.kv_events import KvEventSubscriber


def _store(**overrides):
    store = make_store(**overrides)
    store.tree.events = KvEventLog()
    return store


def _hashes(tokens: list[int], salt: str = "", size: int = 4) -> list[int]:
    out, parent = [], None
    for i in range(0, len(tokens) - size + 1, size):
        parent = page_hash(parent, salt, encode_tokens(tokens[i:i + size]))
        out.append(parent)
    return out


def test_pages_joining_a_path_are_one_stored_event_with_their_parent():
    store = _store()
    cache_tokens(store, pages(1, 2, 3))
    [first] = store.tree.events.take()
    assert first == ["BlockStored", _hashes(pages(1, 2, 3)), None, pages(1, 2, 3), 4, None,
                     "GPU"]
    # a branch after page 2: one new page whose parent is page 2's hash
    cache_tokens(store, pages(1, 2, 7))
    [branch] = store.tree.events.take()
    assert branch[1] == _hashes(pages(1, 2, 7))[2:] and branch[2] == _hashes(pages(1, 2))[1]
    assert branch[3] == pages(7)
    assert store.tree.events.take() == []  # taken once
    # the same pages again: nothing new
    cache_tokens(store, pages(1, 2, 3))
    assert store.tree.events.take() == []


def test_a_salt_is_its_own_namespace_and_partial_pages_are_not_pages():
    store = _store()
    cache_tokens(store, pages(1, 2) + [9, 9], salt="tenant-a")
    cache_tokens(store, pages(1, 2))
    salted, plain = store.tree.events.take()
    assert salted[1] == _hashes(pages(1, 2), "tenant-a") and plain[1] == _hashes(pages(1, 2))
    assert not set(salted[1]) & set(plain[1])
    assert salted[3] == pages(1, 2)  # the trailing 2 tokens are no page


def test_evicted_pages_are_removed_and_the_log_forgets_them():
    store = _store(num_kv_pages=4)
    cache_tokens(store, pages(1, 2, 3))
    store.tree.events.take()
    cache_tokens(store, pages(5, 6))  # 5 pages do not fit in 4: two of the first go
    stored, removed = None, []
    for event in store.tree.events.take():
        if event[0] == "BlockStored":
            stored = event
        else:
            removed += event[1]
    assert stored[1] == _hashes(pages(5, 6))
    assert removed == _hashes(pages(1, 2, 3))[2:]  # one page, the leaf
    # every hash the log still knows is a page in the tree
    alive = {store.tree.events.hash_of(n) for n in store.tree.iter_nodes()}
    assert alive == set(_hashes(pages(1, 2))) | set(_hashes(pages(5, 6)))


def test_a_lora_adapters_pages_carry_its_name():
    """Pages cached under a LoRA adapter (its namespace: cache_salt + the adapter) are
    announced with vLLM's lora_name; their hashes differ from the base model's pages."""
    store = _store()
    cache_tokens(store, pages(1, 2), salt=lora_namespace("", "tutor"))
    cache_tokens(store, pages(1, 2))
    tuned, plain = store.tree.events.take()
    assert len(tuned) == 8 and tuned[7] == "tutor" and len(plain) == 7
    assert tuned[1] == _hashes(pages(1, 2), lora_namespace("", "tutor"))
    assert not set(tuned[1]) & set(plain[1])


def test_a_reset_removes_every_unheld_page_and_keeps_a_held_path():
    """`PrefixStore.reset`: pages no request holds leave the tree (each a BlockRemoved), a
    locked path stays whole, a checkpoint-policy store's states go with their pages; one
    namespace's reset leaves the others."""
    store = _store(policy="checkpoint", checkpoint_interval=4)
    cache_tokens(store, pages(1, 2, 3))
    cache_tokens(store, pages(1, 2, 7))
    cache_tokens(store, pages(4, 5), salt="tenant-a")
    held = store.tree.walk(encode_tokens(pages(1, 2, 3)), None)
    store.lock(held)
    store.tree.events.take()
    assert store.reset("", every_salt=False) == (1, 3)  # page 7 goes; 1, 2, 3 are held
    [removed] = store.tree.events.take()
    assert removed[0] == "BlockRemoved" and removed[1] == _hashes(pages(1, 2, 7))[2:]
    assert store.match_prefix(pages(4, 5), "tenant-a").num_matched_pages == 2
    store.assert_invariants()
    store.unlock(held)
    assert store.reset() == (5, 0)
    assert store.num_cached_pages == 0 and store.kv_pool.num_free == store.kv_pool.capacity
    assert store.state_pool.num_free == store.state_pool.capacity
    assert sorted(h for e in store.tree.events.take() for h in e[1]) == sorted(
        _hashes(pages(1, 2, 3)) + _hashes(pages(4, 5), "tenant-a"))
    store.assert_invariants()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def publisher():
    store = _store()
    pub, replay = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    subscriber = KvEventSubscriber(pub, replay)
    events = KvEventPublisher(store.tree.events, pub, replay, buffer_steps=2)
    time.sleep(0.5)  # the subscription reaches the PUB socket (ZeroMQ's slow joiner)
    yield store, events, subscriber
    events.close()
    subscriber.close()


def _next(subscriber: KvEventSubscriber):
    message = subscriber.receive(5.0)
    assert message is not None and message.ts > 0, "no kv-events message within 5 s"
    return message


def test_the_publisher_numbers_its_messages_and_replays_the_kept_ones(publisher):
    store, events, subscriber = publisher
    # The first message (AllBlocksCleared) may have gone before the subscription arrived.
    cache_tokens(store, pages(1, 2))
    events.flush()
    message = _next(subscriber)
    while message.events[0][0] != "BlockStored":
        message = _next(subscriber)
    seq, [stored] = message.seq, message.events
    assert stored[1] == _hashes(pages(1, 2))
    store.evict(10)
    cache_tokens(store, pages(3))
    events.flush()
    message = _next(subscriber)
    removed, stored_again = message.events
    assert message.seq == seq + 1
    assert removed == ["BlockRemoved", list(reversed(_hashes(pages(1, 2)))), None]
    assert stored == ["BlockStored", _hashes(pages(1, 2)), None, pages(1, 2), 4, None, "GPU",
                      None]  # every field, in FIELDS' order
    assert stored_again[1] == _hashes(pages(3))
    # replay from 0: only the last 2 messages are kept (buffer_steps=2)
    assert [(m.seq, m.events) for m in subscriber.replay(0)] == [
        (seq, [stored]), (seq + 1, [removed, stored_again])]
    assert events.num_sent == seq + 2


def test_a_starting_publisher_first_says_all_blocks_cleared(publisher):
    _, _, subscriber = publisher
    [first] = subscriber.replay(0)
    assert (first.seq, first.events) == (0, [["AllBlocksCleared"]])


def test_pages_restored_from_ssd_are_announced_again_with_their_hashes(tmp_path):
    """A warm restart: the restarted server's log announces the SSD pages a request reaches,
    under the hashes they had before, with medium "STORAGE"."""
    from tier_helpers import PAGE, make_tiered, run_request
    from tier_helpers import pages as big_pages

    store, tiers = make_tiered(tmp_path, num_kv_pages=8, host_pages=4)
    store.tree.events = KvEventLog()
    run_request(store, tiers, big_pages(1, 2, 3))
    [before] = store.tree.events.take()
    assert before[6] == "GPU" and before[4] == PAGE
    tiers.close()
    store2, tiers2 = make_tiered(tmp_path, num_kv_pages=8, host_pages=4)
    store2.tree.events = KvEventLog()
    store2.match_prefix(big_pages(1, 2, 3))  # restores the namespace
    [after] = store2.tree.events.take()
    assert after[1] == before[1] and after[3] == before[3] and after[6] == "STORAGE"
    tiers2.close()


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_the_wire_carries_vllms_map_encoding_or_on_request_its_older_arrays(encoding):
    """What a consumer with vLLM's msgspec types reads: the batch an array [ts, events]; each
    event a map tagged by "type" with vLLM's field names (the default), or the positional
    array of vLLM before it switched (`kv_events_encoding: array`)."""
    import zmq

    store = _store()
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    events = KvEventPublisher(store.tree.events, endpoint, encoding=encoding)
    try:
        time.sleep(0.5)  # the slow joiner
        cache_tokens(store, pages(1, 2))
        store.evict(10)
        events.flush()
        while True:
            topic, seq, payload = sub.recv_multipart()
            batch = msgpack.unpackb(payload)
            if batch[1][0] not in ({"type": "AllBlocksCleared"}, ["AllBlocksCleared"]):
                break
        assert topic == b"kv-events" and len(batch) == 2 and isinstance(batch[0], float)
        stored, removed = batch[1]
        hashes = _hashes(pages(1, 2))
        if encoding == "map":
            assert stored == {"type": "BlockStored", "block_hashes": hashes,
                              "parent_block_hash": None, "token_ids": pages(1, 2),
                              "block_size": 4, "lora_id": None, "medium": "GPU",
                              "lora_name": None}
            assert removed == {"type": "BlockRemoved", "block_hashes": hashes[::-1],
                               "medium": None}
        else:
            assert stored == ["BlockStored", hashes, None, pages(1, 2), 4, None, "GPU"]
            assert removed == ["BlockRemoved", hashes[::-1], None]
    finally:
        events.close()
        sub.close()
        context.term()


def test_events_decode_from_either_encoding_and_bad_ones_are_refused():
    from backend.cache.events import decode_event

    newer = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": 4,
             "token_ids": [1, 2], "block_size": 2, "medium": "CPU", "group_idx": 0,
             "extra_keys": None}  # fields a newer vLLM adds are ignored; missing ones None
    assert decode_event(newer) == ["BlockStored", [5], 4, [1, 2], 2, None, "CPU", None]
    assert decode_event(["BlockStored", [5], 4, [1, 2], 2, None]) == \
        ["BlockStored", [5], 4, [1, 2], 2, None, None, None]  # vLLM's oldest: 6 fields
    assert decode_event({"type": "AllBlocksCleared"}) == ["AllBlocksCleared"]
    for bad in ({"type": "BlockMoved"}, ["BlockMoved", 1], 7, [], {"block_hashes": [1]},
                # what would half-apply to a router's index, or stop its thread
                {"type": "BlockStored", "block_hashes": [1, 2]},  # no block_size
                {"type": "BlockRemoved"}, {"type": "BlockRemoved", "block_hashes": "ab"},
                ["BlockStored", [1], None, [1, 2], 0], ["BlockStored", [1.5], None, [1], 1],
                ["BlockStored", [1], "p", [1], 1], ["BlockStored", [1], None, None, 1],
                [[1]], {"type": ["x"]}, [{}]):  # (unhashable tags: ValueError, not TypeError)
        with pytest.raises(ValueError):
            decode_event(bad)


def test_a_message_that_does_not_decode_is_a_gap():
    from client.kv_events import _message

    ok = _message((3).to_bytes(8, "big"), msgpack.packb(
        [1.5, [{"type": "BlockRemoved", "block_hashes": [9], "medium": None}]]))
    assert ok == (3, 1.5, [["BlockRemoved", [9], None]], False)
    for payload in (b"\xc1", msgpack.packb([1.5, [{"type": "Nope"}]]),
                    msgpack.packb(7)):
        message = _message((4).to_bytes(8, "big"), payload)
        assert message.seq == 4 and message.events == [] and message.gap


def test_bad_settings_are_errors_that_name_them():
    from backend.engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv_events_replay_endpoint needs kv_events_endpoint"):
        EngineConfig.from_params({"kv_events_replay_endpoint": "tcp://*:5558"})
    with pytest.raises(ValueError, match="kv_events_buffer_steps must be >= 1"):
        EngineConfig.from_params({"kv_events_endpoint": "tcp://*:5557",
                                  "kv_events_buffer_steps": "0"})
    with pytest.raises(ValueError, match="kv_events_encoding must be map or array"):
        EngineConfig.from_params({"kv_events_endpoint": "tcp://*:5557",
                                  "kv_events_encoding": "json"})
    with pytest.raises(ValueError, match="kv_events_encoding must be one of map, array"):
        KvEventPublisher(KvEventLog(), "tcp://127.0.0.1:1", encoding="json")
    with pytest.raises(ValueError, match="kv_events_endpoint 'nonsense' cannot be bound"):
        KvEventPublisher(KvEventLog(), "nonsense")
    port = _free_port()
    first = KvEventPublisher(KvEventLog(), f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(ValueError, match="kv_events_replay_endpoint .* cannot be bound"):
            KvEventPublisher(KvEventLog(), f"tcp://127.0.0.1:{_free_port()}",
                             f"tcp://127.0.0.1:{port}")  # in use
    finally:
        first.close()


def test_following_marks_the_message_after_lost_ones():
    """Without a replay endpoint a late subscriber cannot have the first messages: `follow`
    passes the first one it gets with `gap` set (an index should start over), then none."""
    store = _store()
    pub = f"tcp://127.0.0.1:{_free_port()}"
    events = KvEventPublisher(store.tree.events, pub)  # AllBlocksCleared goes to nobody
    time.sleep(0.3)
    subscriber = KvEventSubscriber(pub)
    try:
        time.sleep(0.5)  # the subscription reaches the PUB socket
        followed = subscriber.follow(idle_s=5)
        cache_tokens(store, pages(1))
        events.flush()
        first = next(followed)
        cache_tokens(store, pages(2))
        events.flush()
        second = next(followed)
        assert (first.seq, first.gap) == (1, True) and (second.seq, second.gap) == (2, False)
        assert second.events[0][1] == _hashes(pages(2))
    finally:
        events.close()
        subscriber.close()


def test_a_replay_of_many_large_messages_is_whole(tmp_path):
    """A ROUTER socket drops what passes its send limit (1000 messages) without a word: a
    replay of 1500 kept messages of 1024 tokens each lost its tail and end marker (the
    subscriber timed out; a router joining a busy replica stopped)."""
    from backend.cache.radix import RadixTree

    log = KvEventLog()
    pub, replay = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    events = KvEventPublisher(log, pub, replay)
    tree = RadixTree(64)
    tree.events = log
    subscriber = KvEventSubscriber(pub, replay)
    try:
        for i in range(1500):
            node = tree.root("", create=True)
            for start in range(0, 1024, 64):
                node = tree.add_child(node, encode_tokens([i] + [start // 64] * 63))
            events.flush()
        deadline = time.monotonic() + 60
        while events.num_sent < 1501 and time.monotonic() < deadline:
            time.sleep(0.05)
        seqs = [m.seq for m in subscriber.replay(0, timeout_s=10)]
        assert seqs == list(range(1501))
        assert subscriber.replayed_from == events.instance  # the end marker names the start
    finally:
        subscriber.close()
        events.close()
