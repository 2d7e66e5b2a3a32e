"""Random operation sequences against a reference model of the prefix store.

The reference is the set of cached page prefixes `(salt, tokens[:k * page_size])` plus the
lock count of each; eviction is the policy's choice, so the model only checks what any
correct choice must satisfy: evicted pages were unlocked leaves (no surviving extension).
"""

from __future__ import annotations

from collections import Counter

from cache_helpers import cache_tokens
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from backend.cache import CacheConfig, PrefixStore
from backend.cache.radix import normalize_salt

PAGE = 2
Prefix = tuple[str, tuple[int, ...]]

token_seqs = st.lists(st.integers(0, 2), max_size=10)
salts = st.sampled_from([None, "", "tenant"])


def _prefixes(tokens, salt) -> list[Prefix]:
    salt = normalize_salt(salt)
    return [(salt, tuple(tokens[: k * PAGE])) for k in range(1, len(tokens) // PAGE + 1)]


def _tree_contents(store: PrefixStore) -> tuple[set[Prefix], set[Prefix]]:
    """Every cached page prefix, and those carrying a state."""
    pages, states = set(), set()
    for node in store.tree.iter_nodes():
        prefix = (node.salt, tuple(t for n in node.path() for t in n.tokens))
        pages.add(prefix)
        if node.state_slot is not None:
            states.add(prefix)
    return pages, states


class StoreMachine(RuleBasedStateMachine):
    policy = "suffixreplay"

    @initialize(window=st.integers(0, 2))
    def setup(self, window):
        self.store = PrefixStore(
            CacheConfig(
                page_size=PAGE,
                policy=self.policy,
                anchor_density=0.5,
                checkpoint_interval=4,
                num_kv_pages=10,
                num_checkpoint_slots=3,
                lookahead_window=window,
            )
        )
        self.pages: set[Prefix] = set()
        self.states: set[Prefix] = set()
        self.locks: Counter[Prefix] = Counter()
        self.handles: list[tuple[list, list[Prefix]]] = []

    def _sync(self, expected_new: set[Prefix] = frozenset()) -> None:
        pages, states = _tree_contents(self.store)
        assert expected_new <= pages, "an inserted page is missing"
        assert pages - self.pages <= expected_new, "a page appeared from nowhere"
        for salt, tokens in self.pages - pages:
            assert self.locks[(salt, tokens)] == 0, "a locked page was evicted"
            assert not any(
                s == salt and t[: len(tokens)] == tokens and len(t) > len(tokens) for s, t in pages
            ), "a page with a surviving child was evicted"
        self.pages, self.states = pages, states

    def _expected_match(self, tokens, salt) -> int:
        cached = sum(1 for p in _prefixes(tokens, salt) if p in self.pages)
        if self.policy == "none":
            return 0
        if self.policy == "checkpoint":
            with_state = [
                k + 1 for k, p in enumerate(_prefixes(tokens, salt)[:cached]) if p in self.states
            ]
            return max(with_state, default=0)
        return cached

    @rule(tokens=token_seqs, salt=salts)
    def insert(self, tokens, salt):
        result = cache_tokens(self.store, tokens, salt)
        if result is None:
            assert not self.store.evictable_leaves(), "allocation failed with pages evictable"
            self._sync()
        else:
            self._sync(set(_prefixes(tokens, salt)) if self.policy != "none" else set())

    @rule(tokens=token_seqs, salt=salts)
    def match(self, tokens, salt):
        expected = self._expected_match(tokens, salt)
        result = self.store.match_prefix(tokens, salt)
        assert result.num_matched_pages == expected
        assert result.num_matched_tokens == expected * PAGE
        assert [n.tokens for n in result.nodes] == [
            tuple(tokens[i * PAGE : (i + 1) * PAGE]) for i in range(expected)
        ]
        assert len(result.kv_pages) == expected
        if self.policy == "suffixreplay":
            assert len(result.anchor_blocks) == expected

    @rule(tokens=token_seqs, salt=salts)
    def lock(self, tokens, salt):
        result = self.store.match_prefix(tokens, salt)
        self.store.lock(result.nodes)
        prefixes = _prefixes(tokens, salt)[: result.num_matched_pages]
        self.locks.update(prefixes)
        self.handles.append((result.nodes, prefixes))

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def unlock(self, data):
        nodes, prefixes = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        self.store.unlock(nodes)
        self.locks.subtract(prefixes)

    @rule(num=st.integers(0, 6))
    def evict(self, num):
        evicted = self.store.evict(num)
        assert evicted <= num
        if evicted < num:
            assert not self.store.evictable_leaves()
        self._sync()

    @rule(num=st.integers(0, 3))
    def evict_checkpoints(self, num):
        # Every checkpoint is evictable, also on a locked path (read only at admission).
        assert self.store.evict_checkpoints(num) == min(num, len(self.states))
        self._sync()

    @rule(num=st.integers(0, 10))
    def alloc_and_free(self, num):
        alloc = self.store.alloc_pages(num)
        if alloc is None:
            assert not self.store.evictable_leaves()
        else:
            assert len(alloc.kv_pages) == num
            self.store.assert_invariants()  # held ids are accounted for
            self.store.free_pages(alloc.kv_pages, alloc.anchor_blocks)
        self._sync()

    @rule(waiting=st.lists(st.tuples(token_seqs, salts), max_size=3))
    def protect(self, waiting):
        self.store.protect(waiting)

    @invariant()
    def invariants_hold(self):
        if hasattr(self, "store"):
            self.store.assert_invariants()


class CheckpointStoreMachine(StoreMachine):
    policy = "checkpoint"


class NoCacheStoreMachine(StoreMachine):
    policy = "none"


_settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestSuffixReplayStore = StoreMachine.TestCase
TestSuffixReplayStore.settings = _settings
TestCheckpointStore = CheckpointStoreMachine.TestCase
TestCheckpointStore.settings = _settings
TestNoCacheStore = NoCacheStoreMachine.TestCase
TestNoCacheStore.settings = settings(max_examples=15, stateful_step_count=20, deadline=None)
