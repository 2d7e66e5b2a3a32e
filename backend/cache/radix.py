"""Radix tree of pages: one node per page of `page_size` tokens, one root per `cache_salt`.

A node's key is its page's token ids packed as int32 bytes (`page_size * 4` bytes); children
are a dict keyed by those bytes, so one step of a match is one dict lookup: the hash of a
256-byte slice, then a memcmp against the stored key (whose hash Python caches). That is
exact (no hash collisions to verify), about half the memory of a tuple of ints, and 1.3x
(token lists) to 4x (arrays / tensors) faster to match than tuple keys. The tree is pure
structure: which ids a node holds, eviction order and locking are the store's and the
policy's business.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

import numpy as np

from backend.cache.base import Tier
from backend.cache.retention import DEFAULT_PRIORITY

PageKey = bytes
TOKEN_BYTES = 4  # token ids are packed as native int32
_INT32 = np.iinfo(np.int32)


class PageNode:
    """One cached page.

    depth: page index in its sequence (the root is -1), so the page ends at token
        `(depth + 1) * page_size`.
    kv_page / anchor_block: device ids (None when not on the device); kv_location /
        anchor_location: the fastest tier holding a copy (None = no copy, e.g. anchors under
        the checkpoint policy).
    state_slot: checkpoint slot holding all linear states at the page end (checkpoint policy,
        or a live state under suffixreplay); state_access is its own LRU stamp;
        state_shadowed puts it before the unshadowed states of its priority
        (`Evictor.shadow_states`); state_uses counts the requests that resumed from it since
        it was saved (`Evictor.resumed_from`).
    lock_ref: number of running requests whose locked path contains this node.
    last_access: logical clock of the last match / insert through this node.
    protect_epoch: equals the store's epoch while a request in the look-ahead window needs it.
    priority / priority_until / priority_set: retention priority (`backend/cache/retention.py`),
        when it reverts to the default (the evictor's clock; None: never), and whether a
        request gave it (else it is the default that the next request's replaces).
    num_device_children: children whose KV is on the device (a device leaf has 0).
    tier_data: opaque per-node handle for the tier backend (e.g. DRAM slot, SSD file).
    """

    __slots__ = (
        "key",
        "parent",
        "children",
        "depth",
        "salt",
        "kv_page",
        "anchor_block",
        "kv_location",
        "anchor_location",
        "state_slot",
        "state_access",
        "state_shadowed",
        "state_uses",
        "lock_ref",
        "last_access",
        "protect_epoch",
        "priority",
        "priority_until",
        "priority_set",
        "priority_later",
        "num_device_children",
        "tier_data",
        "alive",
    )

    def __init__(self, key: PageKey, parent: PageNode | None, salt: str) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[PageKey, PageNode] = {}
        self.depth = -1 if parent is None else parent.depth + 1
        self.salt = salt
        self.kv_page: int | None = None
        self.anchor_block: int | None = None
        # The root stands for the empty prefix, which every request has "on the device".
        self.kv_location: Tier | None = Tier.DEVICE if parent is None else None
        self.anchor_location: Tier | None = None
        self.state_slot: int | None = None
        self.state_access = 0
        self.state_shadowed = False
        self.state_uses = 0
        self.lock_ref = 0
        self.last_access = 0
        self.protect_epoch = 0
        self.priority = DEFAULT_PRIORITY
        self.priority_until: float | None = None
        self.priority_set = False  # no request gave it one yet (or it expired)
        # Weaker grants that outlast the current one: (priority, until), taken in turn when
        # it ends (`Evictor.expire`)
        self.priority_later: list[tuple[int, float | None]] = []
        self.num_device_children = 0
        self.tier_data: Any = None
        self.alive = True

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def on_device(self) -> bool:
        return self.kv_location == Tier.DEVICE

    @property
    def tokens(self) -> tuple[int, ...]:
        """The page's token ids (decoded from the key)."""
        ids = array("i")
        ids.frombytes(self.key)
        return tuple(ids)

    def path(self) -> list[PageNode]:
        """Nodes from the root's child down to this node."""
        nodes: list[PageNode] = []
        node: PageNode | None = self
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    def __repr__(self) -> str:
        return (
            f"PageNode(depth={self.depth}, salt={self.salt!r}, kv={self.kv_page}, "
            f"lock={self.lock_ref}, t={self.last_access})"
        )


# A LoRA adapter's prefixes live in a namespace of their own: the request's cache_salt, this,
# the adapter's name (`backend/model/lora.py`).
LORA_SEP = "\x00lora:"


def lora_namespace(salt: str | None, adapter: str | None) -> str:
    """The namespace of a request's cache_salt under LoRA `adapter` (None: the salt; a salt
    of None is "", the default namespace, as everywhere)."""
    salt = normalize_salt(salt)
    return salt if adapter is None else f"{salt}{LORA_SEP}{adapter}"


def check_salt(salt: str | None) -> None:
    """ValueError for a client's cache_salt that could name another namespace: one holding
    the NUL that starts `LORA_SEP` ("s\\x00lora:a" would be adapter a's prefixes under salt
    s, served to a base-model request)."""
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a str, got {type(salt).__name__}")
    if salt:
        try:  # (a lone surrogate cannot be hashed into page ids or SSD chunk headers)
            salt.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("cache_salt must be valid Unicode text (it holds a lone "
                             "surrogate)") from None
    if salt and "\x00" in salt:
        raise ValueError("cache_salt must not contain NUL characters (\\x00)")


def lora_of(salt: str) -> str | None:
    """The LoRA adapter a namespace belongs to (None: the base model's)."""
    return salt.partition(LORA_SEP)[2] or None


def normalize_salt(salt: str | None) -> str:
    """`None` and `""` both name the default namespace."""
    if salt is None:
        return ""
    if not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a str or None, got {type(salt).__name__}")
    return salt


def encode_tokens(tokens: Any) -> bytes:
    """Packs token ids as int32 bytes: a list/tuple of ints, or a 1-D integer numpy array or
    CPU torch tensor (the fast path: no per-token Python work)."""
    if isinstance(tokens, bytes):
        return tokens
    if isinstance(tokens, (list, tuple)):
        try:
            return array("i", tokens).tobytes()
        except (OverflowError, TypeError) as e:
            raise ValueError(f"token ids must be int32 integers: {e}") from e
    ids = np.asarray(tokens)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"tokens must be 1-D integers, got shape {ids.shape} dtype {ids.dtype}")
    if ids.size and (ids.min() < _INT32.min or ids.max() > _INT32.max):
        raise ValueError(f"token ids must fit int32, got range [{ids.min()}, {ids.max()}]")
    return ids.astype(np.int32, copy=False).tobytes()


class RadixTree:
    """Pages keyed by their token tuples, one root per normalized salt."""

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.roots: dict[str, PageNode] = {}
        self.num_nodes = 0  # excluding roots
        self.events: Any = None  # a KvEventLog (`backend/cache/events.py`) told of every change

    def root(self, salt: str | None, create: bool = False) -> PageNode | None:
        salt = normalize_salt(salt)
        node = self.roots.get(salt)
        if node is None and create:
            node = self.roots[salt] = PageNode((), None, salt)
        return node

    @property
    def page_bytes(self) -> int:
        return self.page_size * TOKEN_BYTES

    def page_keys(self, key: bytes, num_pages: int | None = None) -> list[PageKey]:
        """Keys of the whole pages of encoded tokens (a trailing partial page is ignored)."""
        size = self.page_bytes
        full = len(key) // size
        n = full if num_pages is None else min(num_pages, full)
        return [key[i * size : (i + 1) * size] for i in range(n)]

    def walk(self, key: bytes, salt: str | None) -> list[PageNode]:
        """Longest path of existing nodes matching whole pages of the encoded tokens `key`
        (no side effects)."""
        node = self.roots.get(normalize_salt(salt))
        path: list[PageNode] = []
        if node is None:
            return path
        size = self.page_bytes
        for start in range(0, len(key) - size + 1, size):
            child = node.children.get(key[start : start + size])
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def add_child(self, parent: PageNode, key: PageKey) -> PageNode:
        if not isinstance(key, bytes) or len(key) != self.page_bytes:
            raise ValueError(
                f"page key must be {self.page_bytes} bytes (page_size={self.page_size} int32 "
                f"ids), got {type(key).__name__} of length {len(key)}"
            )
        if key in parent.children:
            raise ValueError(f"page already present under {parent!r}")
        child = PageNode(key, parent, parent.salt)
        parent.children[key] = child
        self.num_nodes += 1
        if self.events is not None:
            self.events.stored(child)
        return child

    def remove_leaf(self, node: PageNode) -> None:
        """Unlinks a childless node; a root whose last child goes is dropped too."""
        if node.parent is None or node.children:
            raise ValueError(f"only a non-root leaf can be removed, got {node!r}")
        parent = node.parent
        del parent.children[node.key]
        node.alive = False
        self.num_nodes -= 1
        if self.events is not None:
            self.events.removed(node)
        if parent.parent is None and not parent.children:
            del self.roots[parent.salt]
            parent.alive = False

    def iter_nodes(self) -> Iterator[PageNode]:
        """Every non-root node, parents before children."""
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
