"""KV cache events from the served model (`kv_events_endpoint`, `backend/cache/events.py`): a
router subscribed to a real tritonserver sees a prompt's pages with their token ids and hashes,
sees them leave when the cache (8 idle pages at most) needs room, and the pages it still
counts are exactly the ones the next request finds cached; a cache_salt is another namespace;
the replay socket resends what a late subscriber missed, starting with AllBlocksCleared."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from backend.cache.events import page_hash
from backend.cache.radix import encode_tokens
from backend.tokenizer import load_tokenizer
from client.generate import GenerateParams, generate_http
from client.kv_events import KvEventSubscriber
from tests.triton.conftest import DEFAULT_MODEL, LLM_MODELS, LLM_PARAMS, launch
from tests.triton.llm_helpers import idle_pool

PAGE = 64
ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Router:
    """What a KV-aware router keeps from one replica's events: its pages' hashes."""

    def __init__(self, subscriber: KvEventSubscriber) -> None:
        self.subscriber = subscriber
        self.pages: dict[int, list[int]] = {}  # hash -> token ids
        self.removed: set[int] = set()
        self.last_seq = -1

    def read(self, quiet_s: float = 1.0) -> None:
        """Applies messages until none came for `quiet_s`."""
        while (message := self.subscriber.receive(quiet_s)) is not None:
            assert message.seq == self.last_seq + 1 or self.last_seq == -1, "a message lost"
            self.last_seq = message.seq
            for event in message.events:
                if event[0] == "BlockStored":
                    hashes, tokens, size = event[1], event[3], event[4]
                    assert size == PAGE and len(tokens) == size * len(hashes)
                    for i, h in enumerate(hashes):
                        self.pages[h] = tokens[i * size:(i + 1) * size]
                elif event[0] == "BlockRemoved":
                    for h in event[1]:
                        assert h in self.pages, "a page removed that was never stored"
                        del self.pages[h]
                        self.removed.add(h)
                else:
                    assert event == ["AllBlocksCleared"]
                    self.pages.clear()

    def cached_tokens(self, ids: list[int], salt: str = "") -> int:
        """The prefix it expects the replica to find: pages announced and not removed."""
        parent, n = None, 0
        for i in range(0, len(ids) - PAGE + 1, PAGE):
            parent = page_hash(parent, salt, encode_tokens(ids[i:i + PAGE]))
            if parent not in self.pages:
                break
            n += PAGE
        return n


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pub, replay = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    params = {"hybrid_llm": {**LLM_PARAMS["hybrid_llm"], "max_cached_pages": "8",
                             "kv_events_endpoint": pub, "kv_events_replay_endpoint": replay}}
    server = launch(LLM_MODELS, params, tmp_path_factory.mktemp("kv-events"))
    subscriber = KvEventSubscriber(pub, replay)
    router = Router(subscriber)
    time.sleep(0.5)  # the subscription reaches the server's PUB socket
    tokenizer = load_tokenizer(Path(server.model_repository) / DEFAULT_MODEL)
    yield server, router, subscriber, (pub, replay), tokenizer
    server.stop()
    subscriber.close()


def _prompt(n: int) -> str:
    return (f"{uuid.uuid4().hex} " * (n // 33 + 1))[:n]


def _send(server, text: str, salt: str | None = None) -> int:
    counts = generate_http(server.urls.http, GenerateParams(
        text, max_tokens=4, top_k=1, cache_salt=salt)).counts
    idle_pool(server)
    return counts["cached_tokens"]


def test_a_router_sees_pages_come_and_go_as_the_cache_does(served):
    server, router, _, _, tokenizer = served
    first = _prompt(300)
    ids = tokenizer.encode(first, add_special_tokens=True)
    assert _send(server, first) == 0
    router.read()
    whole = len(ids) // PAGE * PAGE
    assert router.cached_tokens(ids) == whole >= 4 * PAGE  # every whole prompt page, in order
    assert ids[:PAGE] in router.pages.values()
    # three more prompts push the first one's pages out of the 8 the cache keeps
    others = [_prompt(300) for _ in range(3)]
    for text in others:
        _send(server, text)
    router.read()
    assert router.removed and router.cached_tokens(ids) < whole
    # what the router still counts is what the server finds, for every prompt
    for text in [first, *others]:
        router.read()
        expected = router.cached_tokens(tokenizer.encode(text, add_special_tokens=True))
        assert _send(server, text + " again?") == expected


def test_a_salted_prompt_is_its_own_namespace(served):
    server, router, _, _, tokenizer = served
    text = _prompt(200)
    ids = tokenizer.encode(text, add_special_tokens=True)
    _send(server, text, salt="tenant-a")
    router.read()
    assert router.cached_tokens(ids, "tenant-a") == len(ids) // PAGE * PAGE
    assert router.cached_tokens(ids) == 0  # the same tokens without the salt: other hashes


def test_the_replay_resends_from_the_start(served):
    _, router, subscriber, _, _ = served
    router.read()
    replayed = list(subscriber.replay(0))
    assert [m.seq for m in replayed] == list(range(router.last_seq + 1))  # all, in order
    assert replayed[0].events == [["AllBlocksCleared"]]


def test_the_cli_prints_the_events(served):
    server, router, _, (pub, replay), tokenizer = served
    router.read()
    text = _prompt(200)
    _send(server, text)
    first_page = page_hash(None, "", encode_tokens(tokenizer.encode(text)[:PAGE]))
    done = subprocess.run([sys.executable, "-m", "client", "kv-events", "--endpoint", pub,
                           "--replay", replay, "--from", "1", "--idle-s", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    router.read()
    assert [m["seq"] for m in lines] == list(range(1, router.last_seq + 1))
    assert first_page in [h for m in lines for e in m["events"] if e[0] == "BlockStored"
                          for h in e[1]] and lines[-1]["ts"] > 0
