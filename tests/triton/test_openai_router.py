"""KV-aware routing in the OpenAI frontend (`backend/openai_api/router.py`): the choice rule on
indexes fed by hand, the index following a publisher (replay at start, gaps, restarts), and two
real tritonservers behind one frontend: every turn of a conversation goes to the replica that
cached the turns before it, so each one is served from the cache, where sending requests in
turn would miss half the time."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

import openai
import pytest

from backend.cache.events import KvEventLog, KvEventPublisher, page_hash
from backend.cache.radix import RadixTree, encode_tokens
from backend.openai_api.router import Router
from client.kv_events import Message
from client.metrics import scrape as scrape_url
from client.metrics import value
from tests.triton.conftest import LLM_MODELS, LLM_PARAMS, free_ports, launch
from tests.triton.llm_helpers import running_frontend, wait_until

PAGE = 64


def _message(seq: int, events: list) -> Message:
    return Message(seq, time.time(), events)


def _stored(ids: list[int], salt: str = "") -> list:
    hashes, parent = [], None
    for i in range(0, len(ids) - PAGE + 1, PAGE):
        parent = page_hash(parent, salt, encode_tokens(ids[i:i + PAGE]))
        hashes.append(parent)
    return ["BlockStored", hashes, None, ids[:len(hashes) * PAGE], PAGE, None, "device"]


def test_the_longest_cached_prefix_wins_and_ties_go_to_the_least_busy():
    router = Router(3)  # indexes fed by hand: two replicas with events, one without
    for r in router.replicas[:2]:
        r.events = True
    a, b = list(range(1, 257)), list(range(300, 556))
    router.replicas[0].apply(_message(0, [_stored(a[:128])]))  # two pages of a
    router.replicas[1].apply(_message(0, [_stored(a[:192]), _stored(b)]))  # three of a, all of b
    assert router.cached_tokens(1, a) == 192 and router.cached_tokens(0, a) == 128
    assert router.pick(a) == 1 and router.pick(b) == 1
    assert router.cached_tokens(1, a, salt="other") == 0  # another namespace
    router.replicas[1].apply(_message(1, [["BlockRemoved", _stored(a[:192])[1][1:], None]]))
    assert router.cached_tokens(1, a) == 64 and router.pick(a) == 0
    # nothing cached anywhere: the least busy (replica 1 has 2 in flight, 0 has 1)
    fresh = list(range(1000, 1100))
    assert router.pick(fresh) == 2
    for replica in (1, 1, 0, 2):
        router.done(replica)
    assert sorted(router.pick(fresh) for _ in range(3)) == [0, 1, 2]  # in turn
    router.replicas[1].apply(_message(2, [["AllBlocksCleared"]]))
    assert router.cached_tokens(1, b) == 0


def test_a_prompt_that_ends_on_a_page_boundary_scores_the_pages_it_can_hit():
    """The server computes a prompt's last token always, so a prompt of exactly two pages
    hits one (`cached_tokens` 64) on a replica that holds both: a replica holding the first
    page only is as good, and the less busy one gets it (the router counted both pages and
    sent it to the busy replica for nothing)."""
    router = Router(2)
    for r in router.replicas:
        r.events = True
    a = list(range(1, 129))  # two whole pages
    router.replicas[0].apply(_message(0, [_stored(a)]))
    router.replicas[1].apply(_message(0, [_stored(a[:64])]))
    for _ in range(3):
        router.pick(list(range(500, 600)))  # nothing cached: in turn, 0 first
    assert [r.inflight for r in router.replicas] == [2, 1]
    assert router.pick(a) == 1
    assert router.pick(a + [7]) == 0  # one token more: both pages count


@pytest.mark.parametrize("settings, bad", [(dict(max_imbalance=-1), "max-imbalance"),
                                           (dict(down_s=float("nan")), "down-s"),
                                           (dict(down_s=-2.0), "down-s")])
def test_router_settings_out_of_range_are_refused(settings, bad):
    """max_imbalance -1 failed every pick (no replica open); down_s nan never let a failed
    replica back."""
    with pytest.raises(ValueError, match=bad):
        Router(2, **settings)
    from backend.openai_api.server import parse_args

    option = {"max_imbalance": "--router-max-imbalance", "down_s": "--router-down-s"}
    [(name, value)] = settings.items()
    with pytest.raises(SystemExit):
        parse_args(["--model-repository", "model_repo", option[name], str(value)])


def test_a_busy_replica_is_passed_over_past_the_imbalance_limit():
    router = Router(2, max_imbalance=2)
    router.replicas[0].events = True
    hot = list(range(1, 129))
    router.replicas[0].apply(_message(0, [_stored(hot)]))
    assert [router.pick(hot) for _ in range(4)] == [0, 0, 0, 1]  # 3 in flight vs 0: over 2
    assert router.pick(hot) == 0  # 3 vs 1: within 2 again
    for _ in range(4):
        router.done(0)
    assert router.pick(hot) == 0


def test_an_unreachable_replica_is_passed_over_until_its_time_is_up():
    router = Router(3, down_s=0.3)
    for r in router.replicas:
        r.events = True
    ids = list(range(1, 129))
    router.replicas[1].apply(_message(0, [_stored(ids)]))
    assert router.pick(ids) == 1
    router.done(1)
    router.failed(1)  # the best replica is down: the next best, then in turn
    assert sorted(router.pick(ids) for _ in range(4)) == [0, 0, 2, 2]
    for replica in (0, 0, 2, 2):
        router.done(replica)
    assert router.pick(ids, exclude=[0]) == 2  # a retry: not the one it tried
    router.done(2)
    stats = router.stats()
    assert not stats[1]["up"] and stats[1]["failures"] == 1 and stats[0]["up"]
    router.failed(0)
    router.failed(2)
    assert router.pick(ids) == 1  # every replica down: the best one all the same
    router.done(1)
    with pytest.raises(ValueError, match="excluded"):
        router.pick(ids, exclude=[0, 1, 2])
    time.sleep(0.35)
    assert all(r["up"] for r in router.stats()) and router.pick(ids) == 1


def test_the_index_follows_a_publisher_from_its_replay():
    """Pages announced before the router came are read from the replay; a restarted
    publisher (sequence numbers from 0, AllBlocksCleared) empties the index."""
    log = KvEventLog()
    pub, replay = (f"tcp://127.0.0.1:{p}" for p in free_ports(2))
    publisher = KvEventPublisher(log, pub, replay)
    ids = list(range(7, 7 + 2 * PAGE))
    tree = RadixTree(PAGE)  # two pages join the tree before the router starts
    tree.events = log
    first = tree.add_child(tree.root("", create=True), encode_tokens(ids[:PAGE]))
    tree.add_child(first, encode_tokens(ids[PAGE:]))
    publisher.flush()
    time.sleep(0.2)
    router = Router(1, [f"{pub},{replay}"])
    try:
        wait_until(lambda: router.cached_tokens(0, ids) == 2 * PAGE, 10, "the replayed pages")
        publisher.close()  # the replica restarts: its AllBlocksCleared may go unheard (the
        log = KvEventLog()  # subscriber reconnects), its next message is numbered 1
        publisher = KvEventPublisher(log, pub, replay)
        time.sleep(0.5)  # the subscriber reconnects
        tree = RadixTree(PAGE)
        tree.events = log
        other = list(range(500, 500 + PAGE))
        tree.add_child(tree.root("", create=True), encode_tokens(other))
        publisher.flush()
        wait_until(lambda: router.cached_tokens(0, other) == PAGE, 10, "the restart's page")
        assert router.cached_tokens(0, ids) == 0  # the old pages are forgotten
    finally:
        router.close()
        publisher.close()


def _tree(log: KvEventLog) -> RadixTree:
    tree = RadixTree(PAGE)
    tree.events = log
    return tree


def _add(tree: RadixTree, ids: list[int]) -> None:
    node = tree.root("", create=True)
    for start in range(0, len(ids) - PAGE + 1, PAGE):
        node = tree.add_child(node, encode_tokens(ids[start:start + PAGE]))


@pytest.mark.parametrize("case", ["no_block_size", "null_hashes", "two_frames"])
def test_a_message_that_does_not_apply_leaves_the_router_reading_on(case):
    """A message that decoded but could not apply (a BlockStored without block_size, a
    BlockRemoved without hashes, two frames instead of three) stopped the replica's router
    thread for good, its index half-applied; now the index starts over and reading goes on."""
    import msgpack
    import zmq

    (port,) = free_ports(1)
    context = zmq.Context()
    sock = context.socket(zmq.PUB)
    sock.bind(f"tcp://127.0.0.1:{port}")
    router = Router(1, [f"tcp://127.0.0.1:{port}"])
    ids = list(range(3, 3 + PAGE))
    try:
        time.sleep(0.5)  # the subscription reaches the PUB socket
        bad = {"no_block_size": {"type": "BlockStored", "block_hashes": [11, 12]},
               "null_hashes": {"type": "BlockRemoved"}}.get(case)
        seq = (0).to_bytes(8, "big")
        sock.send_multipart([b"kv-events", seq] if bad is None else
                            [b"kv-events", seq, msgpack.packb([time.time(), [bad]])])
        good = {"type": "BlockStored", "block_hashes": _stored(ids)[1],
                "parent_block_hash": None, "token_ids": ids, "block_size": PAGE,
                "lora_id": None, "medium": "GPU"}
        sock.send_multipart([b"kv-events", (1).to_bytes(8, "big"),
                             msgpack.packb([time.time(), [good]])])
        wait_until(lambda: router.cached_tokens(0, ids) == PAGE, 10, "the next message")
        assert router.stats()[0]["pages"] == 1  # (none of the bad message's hashes)
        assert router._threads[0].is_alive() and router.stats()[0]["following"]
    finally:
        router.close()
        sock.close()
        context.term()


def test_a_replica_that_comes_up_after_the_replay_wait_is_followed():
    """The first replay's wait ran out (a replica still loading its model: 10 s here, 0.3 s
    in this test) and the router's thread for it ended; it goes on to the live messages."""
    import threading

    from client.kv_events import KvEventSubscriber

    pub, replay = (f"tcp://127.0.0.1:{p}" for p in free_ports(2))
    subscriber = KvEventSubscriber(pub, replay)
    subscriber.replay_timeout_s = 0.3
    log, started = KvEventLog(), []
    ids = list(range(9, 9 + PAGE))
    _add(_tree(log), ids)
    starter = threading.Timer(1.0, lambda: started.append(KvEventPublisher(log, pub, replay)))
    starter.start()
    try:
        for message in subscriber.follow(idle_s=10):
            stored = [e for e in message.events if e[0] == "BlockStored"]
            if stored:
                assert stored[0][1] == _stored(ids)[1]
                break
        else:
            raise AssertionError("no BlockStored within 10 s")
    finally:
        starter.join()
        subscriber.close()
        for publisher in started:
            publisher.close()


@pytest.mark.parametrize("with_replay", [True, False])
def test_a_restart_whose_numbers_caught_up_empties_the_index(with_replay):
    """A replica restarts and sends as many messages before the router's subscriber
    reconnects as it had before: the numbers go on as if nothing happened and its old pages
    stayed indexed for good. The dropped connection now makes the subscriber check: with a
    replay endpoint, the replay's end names another server start (the index is rebuilt from
    the new one's kept messages); without, the next message is a gap (the index starts
    over)."""
    pub, replay = (f"tcp://127.0.0.1:{p}" for p in free_ports(2))
    replay = replay if with_replay else ""
    old, new, later = ([k] * PAGE for k in (1, 2, 4))
    log = KvEventLog()
    publisher = KvEventPublisher(log, pub, replay)  # 0: AllBlocksCleared
    router = Router(1, [f"{pub},{replay}" if replay else pub])
    try:
        time.sleep(0.5)
        _add(_tree(log), old)
        publisher.flush()  # 1: old
        wait_until(lambda: router.cached_tokens(0, old) == PAGE, 10, "the first page")
        publisher.close()
        log = KvEventLog()
        publisher = KvEventPublisher(log, pub, replay)  # 0: AllBlocksCleared, unheard
        tree = _tree(log)
        _add(tree, new)
        publisher.flush()  # 1: new, most likely unheard (the subscriber reconnects)
        time.sleep(1.0)
        _add(tree, later)
        publisher.flush()  # 2: what the router expects next from the old server
        wait_until(lambda: router.cached_tokens(0, later) == PAGE, 10, "the restart's page")
        assert router.cached_tokens(0, old) == 0
        if with_replay:  # (replayed from the new server's kept messages)
            assert router.cached_tokens(0, new) == PAGE
    finally:
        router.close()
        publisher.close()


def test_a_router_thread_that_fails_follows_again(monkeypatch):
    """Something unforeseen in following a replica's events ended its thread for the
    frontend's life (`/router` still said events: true); it follows again after a pause."""
    from client.kv_events import KvEventSubscriber

    calls = []
    follow = KvEventSubscriber.follow

    def failing_once(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("unforeseen")
        yield from follow(self, *args, **kwargs)

    monkeypatch.setattr(KvEventSubscriber, "follow", failing_once)
    pub, replay = (f"tcp://127.0.0.1:{p}" for p in free_ports(2))
    log = KvEventLog()
    publisher = KvEventPublisher(log, pub, replay)
    ids = list(range(20, 20 + PAGE))
    _add(_tree(log), ids)
    publisher.flush()
    router = Router(1, [f"{pub},{replay}"])
    try:
        wait_until(lambda: router.cached_tokens(0, ids) == PAGE, 10, "pages after the retry")
        assert len(calls) == 2 and router.stats()[0]["following"]
    finally:
        router.close()
        publisher.close()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two servers with KV cache events, each serving a LoRA adapter `tutor` beside the
    base model."""
    import torch
    from hf_oracle import make_lora_adapter
    from transformers import Qwen3_5ForCausalLM

    from tests.triton.conftest import DEFAULT_MODEL, MODEL_REPO

    hf = Qwen3_5ForCausalLM.from_pretrained(MODEL_REPO / DEFAULT_MODEL, dtype=torch.float32)
    adapter = make_lora_adapter(tmp_path_factory.mktemp("router-lora"), hf,
                                ("q_proj", "out_proj", "down_proj"), seed=3)
    servers, events = [], []
    for i in range(2):
        pub, replay = (f"tcp://127.0.0.1:{p}" for p in free_ports(2))
        params = {"hybrid_llm": {**LLM_PARAMS["hybrid_llm"], "kv_events_endpoint": pub,
                                 "kv_events_replay_endpoint": replay,
                                 "lora_adapters": f"tutor={adapter}"}}
        servers.append(launch(LLM_MODELS, params, tmp_path_factory.mktemp(f"replica{i}")))
        events.append(f"{pub},{replay}")
    yield servers, events
    for server in servers:
        server.stop()


@pytest.mark.parametrize("model", ["ensemble", "tutor"])
def test_each_turn_goes_where_the_conversation_is_cached(replicas, tmp_path, model):
    """On the base model and on a LoRA adapter (whose pages the replicas announce in the
    adapter's namespace, where the router looks them up)."""
    servers, events = replicas
    args = ["--triton-url", servers[1].urls.grpc]
    for spec in events:
        args += ["--kv-events", spec]
    with running_frontend(servers[0], tmp_path / "router.log", *args) as url:
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        chats = [[{"role": "system", "content": f"{uuid.uuid4().hex} " * 8}] for _ in range(3)]
        for turn in range(3):
            for messages in chats:
                messages.append({"role": "user", "content": f"Question {turn}?"})
                reply = sdk.chat.completions.create(model=model, messages=messages,
                                                    max_tokens=4, extra_body={"top_k": 1})
                messages.append({"role": "assistant",
                                 "content": reply.choices[0].message.content})
                cached = reply.usage.prompt_tokens_details.cached_tokens
                if turn == 0:
                    assert cached == 0
                else:  # the earlier turns' whole pages, on the replica that holds them
                    assert cached >= PAGE * 4, (turn, cached)
                time.sleep(0.3)  # the replica's events reach the router
        with urllib.request.urlopen(f"{url}/router") as resp:
            stats = json.loads(resp.read())
        routed = [r["routed"] for r in stats["replicas"]]
        assert sum(routed) == 9 and min(routed) >= 3  # the three chats spread over both
        assert all(r["events"] and r["pages"] > 0 for r in stats["replicas"])


def test_requests_routed_to_an_unreachable_replica_go_to_the_next(replicas, tmp_path):
    """A replica that is down (nothing listens on its port), first on the command line: the
    frontend starts from the other's configuration, is ready, and every request is answered;
    /router shows the down one with its failures."""
    servers, _ = replicas
    [dead] = free_ports(1)
    with running_frontend(servers[0], tmp_path / "failover.log", "--triton-url",
                          servers[0].urls.grpc, "--router-down-s", "60",
                          first_url=f"127.0.0.1:{dead}") as url:
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        for i in range(4):
            reply = sdk.completions.create(model="ensemble", prompt=f"{uuid.uuid4().hex} {i}",
                                           max_tokens=3, extra_body={"top_k": 1})
            assert reply.choices[0].finish_reason == "length"
        with urllib.request.urlopen(f"{url}/router") as resp:
            down, live = json.loads(resp.read())["replicas"]
        # the first tie went to the down replica, which failed once and was then passed over
        assert down["failures"] == 1 and not down["up"] and down["routed"] == 1
        assert live["up"] and live["failures"] == 0 and live["routed"] == 4
        assert down["inflight"] == live["inflight"] == 0
        metrics = scrape_url(url)  # the same on /metrics
        assert value(metrics, "suffixreplay_frontend_router_up", replica="0") == 0
        assert value(metrics, "suffixreplay_frontend_router_failures_total", replica="0") == 1
        assert value(metrics, "suffixreplay_frontend_router_requests_total",
                     replica="1", url=servers[0].urls.grpc) == 4
        assert value(metrics, "suffixreplay_frontend_requests_total",
                     endpoint="/v1/completions", status="200") == 4
