"""Streaming detokenization: turn token ids into text piece by piece without breaking characters.

One character may span several tokens (a byte tokenizer spends up to 4 tokens on one UTF-8
character; byte-level BPE splits rare characters too). Decoding each new token on its own would
emit U+FFFD halves, so both helpers here decode a short window that ends at the newest token
and emit only the *stable* part of its text:

- text that ends in U+FFFD is held back: an unfinished multi-byte character decodes to U+FFFD
  until its last byte arrives (a genuinely invalid byte is only delayed, never lost);
- the window starts a few tokens back so that tokenizers whose decoding depends on the left
  context (e.g. SentencePiece dropping a leading space) produce the same text as a full decode.

`IncrementalDecoder` keeps that state for one stream (in-process engine, clients).
`decode_delta` is the stateless form used by the Triton postprocessing model: the caller passes
the tail of what was already streamed (`prefix_ids`) beside the new ids. On text it is exact
for valid UTF-8 without U+FFFD of its own. A text cannot tell an unfinished character from a
real U+FFFD, nor a window that starts inside a character from invalid bytes, so held-back real
U+FFFD longer than the window, hidden special tokens inside the window, and invalid bytes
(e.g. under allowed_token_ids of lone lead and continuation bytes) can change the number of
U+FFFD against a full decode. `bytes_delta` is exact where the tokenizer's text is the UTF-8 of
its tokens' bytes joined (byte-level BPE, the byte tokenizer): it works on the bytes, starts the
window at the first byte that begins a character and holds back only an unfinished UTF-8
sequence (at most 3 bytes), so any output streams as it decodes whole, as long as that
sequence's first byte lies inside the window.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Byte tokens need at least 4 ids of context (the longest UTF-8 character); 8 leaves room for
# tokenizers whose decoder looks further back.
DEFAULT_CONTEXT_LEN = 8

DecodeFn = Callable[..., str]  # decode(ids, skip_special_tokens=...) -> str


def trim_incomplete(text: str) -> str:
    """`text` without its trailing run of U+FFFD (a character that may still be completed)."""
    return text.rstrip(REPLACEMENT_CHAR)


def decode_delta(
    decode: DecodeFn,
    prefix_ids: Sequence[int],
    new_ids: Sequence[int],
    final: bool = True,
    skip_special_tokens: bool = True,
) -> str:
    """Text that `new_ids` add after `prefix_ids`, whose stable text was already emitted.

    With `final=False` an unfinished character at the end is held back; the next call (whose
    prefix then includes those ids) emits it. `final=True` emits everything, U+FFFD included.
    """
    shown = trim_incomplete(decode(list(prefix_ids), skip_special_tokens=skip_special_tokens))
    text = decode([*prefix_ids, *new_ids], skip_special_tokens=skip_special_tokens)
    stable = text if final else trim_incomplete(text)
    return stable[len(shown) :] if len(stable) > len(shown) else ""


def bytes_delta(
    token_bytes: Callable[[int], bytes],
    prefix_ids: Sequence[int],
    new_ids: Sequence[int],
    final: bool = True,
) -> str:
    """`decode_delta` on the tokens' bytes (`token_bytes(id)`: b"" for a hidden token).

    The window starts past any leading UTF-8 continuation bytes (the rest of a character
    emitted before it): the decoder restarts at any other byte, so the text from there is the
    same as in a full decode. Of that window, everything but an unfinished trailing sequence
    was emitted: Python's incremental decoder, not final, holds back exactly that."""
    window = b"".join(map(token_bytes, prefix_ids))
    start = 0
    while start < len(window) and 0x80 <= window[start] < 0xC0:
        start += 1
    window = window[start:]
    shown = codecs.getincrementaldecoder("utf-8")("replace").decode(window, final=False)
    text = codecs.getincrementaldecoder("utf-8")("replace").decode(
        window + b"".join(map(token_bytes, new_ids)), final=final)
    return text[len(shown):]


class IncrementalDecoder:
    """Feed ids as they are generated; `push` returns only newly completed text.

    The concatenation of every `push` result and the final `flush` equals
    `decode(all_ids)` for byte-level tokenizers. Memory and work per step stay O(context_len):
    the window slides forward whenever no character is pending.
    """

    def __init__(
        self,
        decode: DecodeFn,
        skip_special_tokens: bool = True,
        context_len: int = DEFAULT_CONTEXT_LEN,
    ) -> None:
        if context_len < 1:
            raise ValueError(f"context_len must be >= 1, got {context_len}")
        self._decode = decode
        self._skip = skip_special_tokens
        self._context_len = context_len
        self._window: list[int] = []  # the most recent ids; their text starts the window
        self._num_shown = 0  # characters of decode(self._window) already returned

    def push(self, ids: int | Iterable[int]) -> str:
        """Add one id or several; return the text they complete (possibly empty)."""
        if isinstance(ids, int):
            self._window.append(ids)
        else:
            self._window.extend(int(i) for i in ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """End of stream: return whatever is held back (an unfinished character as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        text = self._decode(self._window, skip_special_tokens=self._skip)
        stable = text if final else trim_incomplete(text)
        delta = stable[self._num_shown :]
        # Never move backwards: a new unfinished character may hide an already shown U+FFFD.
        self._num_shown = max(self._num_shown, len(stable))
        if len(stable) == len(text):
            self._slide_window()
        return delta

    def _slide_window(self) -> None:
        if len(self._window) <= 2 * self._context_len:
            return
        tail = self._window[-self._context_len :]
        tail_text = self._decode(tail, skip_special_tokens=self._skip)
        # A cut inside a character would start the window with U+FFFD; slide later instead.
        if tail_text.startswith(REPLACEMENT_CHAR):
            return
        self._window = tail
        self._num_shown = len(tail_text)
