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
