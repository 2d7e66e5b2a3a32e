"""On-disk format of one SSD chunk (one page: its KV and its anchor block).

    [header, padded to a multiple of 4 KiB][KV section, padded][anchor section, padded]

Header (little-endian), then the layout text and the page's token ids, then an xxh3-64 of
everything before it:
    magic 8s | version u32 | header_len u32 | fingerprint 16s | salt_hash 16s |
    prefix_hash 16s | parent_hash 16s | depth u32 | page_size u32 | kv_len u64 |
    anchor_len u64 | payload_xxh3 u64 | layout_len u32 | tokens_len u32
fingerprint = xxh3-128 of the model fingerprint; salt_hash = xxh3-128 of the cache salt (the
salt itself never reaches the disk); prefix_hash chains the page's tokens onto its parent's
hash (`parent_hash`, the salt hash for a first page), so it names the page *and* its whole
prefix. payload_xxh3 covers the unpadded KV bytes then the unpadded anchor bytes.

A chunk that fails any check raises `ChunkError(reason)`; callers turn it into a miss.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import NamedTuple

import xxhash

from backend.cache.page_io import PageLayout, align_up
from backend.cache.tier_stats import BAD_HEADER, FOREIGN, LAYOUT, SALT, TOKENS, TORN

MAGIC = b"PCRKVPG\x00"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<8sII16s16s16s16sIIQQQII")
_CHECK = struct.Struct("<Q")
HASH_BYTES = 16


class ChunkError(Exception):
    """A chunk that must not be served; `reason` is one of the `tier_stats` reject names."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def hash128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def salt_hash(salt: str) -> bytes:
    return hash128(b"salt\x00" + salt.encode())


def prefix_hash(parent_hash: bytes, page_key: bytes) -> bytes:
    """Chained hash of a page (its int32 token bytes) after the prefix `parent_hash` names."""
    return hash128(parent_hash + page_key)


def fingerprint_hash(model_fingerprint: str) -> bytes:
    return hash128(b"model\x00" + model_fingerprint.encode())


def payload_checksum(buffers: Iterable[memoryview]) -> int:
    h = xxhash.xxh3_64()
    for buf in buffers:
        h.update(buf)
    return h.intdigest()


class ChunkHeader(NamedTuple):
    fingerprint: bytes
    salt_hash: bytes
    prefix_hash: bytes
    parent_hash: bytes
    depth: int
    page_size: int
    kv_len: int
    anchor_len: int
    payload_xxh3: int
    layout: str
    tokens: bytes  # the page's token ids as int32 bytes (= its radix key)
    header_len: int = 0

    @property
    def payload_len(self) -> int:
        """Padded KV + anchor sections, as stored."""
        return align_up(self.kv_len) + align_up(self.anchor_len)

    @property
    def file_len(self) -> int:
        return self.header_len + self.payload_len


def header_len(layout: PageLayout) -> int:
    """Bytes of the (padded) header of a chunk of this layout."""
    return header_len_of(layout.describe(), layout.page_size)


def header_len_of(layout_text: str, page_size: int) -> int:
    """Bytes of the (padded) header of a chunk whose layout reads `layout_text` (also the
    checkpoint-state files of `state_tier.py`, which describe a state, not a page)."""
    return align_up(_FIXED.size + len(layout_text.encode()) + page_size * 4 + _CHECK.size)


def pack_header(h: ChunkHeader) -> bytes:
    """The padded header bytes (`header_len` of the chunk's layout)."""
    layout = h.layout.encode()
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, h.header_len, h.fingerprint, h.salt_hash, h.prefix_hash,
        h.parent_hash, h.depth, h.page_size, h.kv_len, h.anchor_len, h.payload_xxh3,
        len(layout), len(h.tokens),
    )  # fmt: skip
    body = fixed + layout + h.tokens
    body += _CHECK.pack(xxhash.xxh3_64_intdigest(body))
    if len(body) > h.header_len:
        raise ValueError(f"header needs {len(body)} bytes, header_len is {h.header_len}")
    return body + bytes(h.header_len - len(body))


def unpack_header(data: bytes | memoryview) -> ChunkHeader:
    """Parses and self-checks a header (magic, version, checksum, internal consistency)."""
    data = bytes(data)
    if len(data) < _FIXED.size:
        raise ChunkError(TORN, f"{len(data)} header bytes")
    fields = _FIXED.unpack_from(data)
    magic, version, hlen = fields[:3]
    if magic != MAGIC:
        raise ChunkError(BAD_HEADER, "bad magic")
    if version != FORMAT_VERSION:
        raise ChunkError(BAD_HEADER, f"format version {version}, expected {FORMAT_VERSION}")
    layout_len, tokens_len = fields[12], fields[13]
    end = _FIXED.size + layout_len + tokens_len
    if end + _CHECK.size > min(len(data), hlen):
        raise ChunkError(TORN if len(data) < hlen else BAD_HEADER, "header fields overflow")
    (stored,) = _CHECK.unpack_from(data, end)
    if stored != xxhash.xxh3_64_intdigest(data[:end]):
        raise ChunkError(BAD_HEADER, "header checksum")
    layout = data[_FIXED.size : _FIXED.size + layout_len].decode(errors="replace")
    tokens = data[_FIXED.size + layout_len : end]
    h = ChunkHeader(*fields[3:12], layout, tokens, hlen)
    if h.prefix_hash != prefix_hash(h.parent_hash, h.tokens):
        raise ChunkError(BAD_HEADER, "prefix hash does not match the stored tokens")
    return h


class Expected(NamedTuple):
    """What a chunk must say to be served for a given tree node."""

    fingerprint: bytes
    salt_hash: bytes
    prefix_hash: bytes
    tokens: bytes
    layout: str
    kv_len: int
    anchor_len: int


def check_header(h: ChunkHeader, want: Expected) -> None:
    """Raises ChunkError unless `h` belongs to this model, salt, page and layout."""
    if h.fingerprint != want.fingerprint:
        raise ChunkError(FOREIGN)
    if (h.layout, h.kv_len, h.anchor_len) != (want.layout, want.kv_len, want.anchor_len):
        raise ChunkError(LAYOUT)
    if h.salt_hash != want.salt_hash:
        raise ChunkError(SALT)
    if h.prefix_hash != want.prefix_hash or h.tokens != want.tokens:
        raise ChunkError(TOKENS)
