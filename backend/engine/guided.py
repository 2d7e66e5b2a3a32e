"""Guided decoding: outputs that follow a JSON schema, any JSON, a regular expression or an EBNF
grammar (TensorRT-LLM's `guided_decoding_guide_type` values `json_schema`, `json`, `regex`,
`ebnf_grammar`, `structural_tag`: free text with tagged JSON sections, as tool calls are),
through XGrammar, as TensorRT-LLM, vLLM and SGLang do.

`GrammarBackend` (one per engine) compiles a request's guide against the model's vocabulary,
once per distinct guide (XGrammar's compiler caches them); a compile error is a ValueError
that quotes XGrammar's message. `GuideState` (one per sequence) follows the tokens generated
so far and holds the tokens allowed next (XGrammar's packed bitmask), which `sampling.sample`
applies to the row of logits before any choice.

Rules:
- Special tokens (chat markers, padding) are never allowed inside a guided output; the end id
  is allowed exactly where the grammar may end.
- JSON guides hold the whitespace the engine's `guided_json_whitespace` allows (default
  "compact": one line, as json.dumps writes it).
- The output ends ("stop") as soon as the grammar allows no token but the end: the
  grammar is complete, so the end token would be forced. The request's end id, when it has
  one, is the grammar's stop token; with end_id -1 (no end token) the grammar's end is still
  where the output stops.
- The guide outranks min_tokens and bad words: they remove tokens only where the grammar
  leaves another choice (a guided output may end before min_tokens: "eos", its end not
  output). An output the grammar completes on the last token max_tokens allows is "stop".
- A token the grammar forces (the only one it allows) is taken, not drawn, so a seeded
  request's tokens are the same with or without jump-forward, log probabilities or logits;
  jump-forward appends forced runs up to the next position whose state the cache saves.
- An end id the grammar needs as text (XGrammar then takes it as the grammar's end only) can
  leave no token to follow: the request fails with a message naming it.
- A guide whose grammar allows no output at all (an empty-string regex) is rejected.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from backend.tokenizer import Tokenizer

GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag")
ANY_JSON = '{"type": ["object", "array"]}'  # `json`: any object or array
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True)
class Guide:
    """What a request's output must follow: `kind` in GUIDE_TYPES and its text (a JSON schema,
    a regular expression, an EBNF grammar whose start rule is `root`, a structural tag's JSON;
    none for `json`)."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GUIDE_TYPES:
            raise ValueError(f"guided_decoding_guide_type must be one of "
                             f"{', '.join(GUIDE_TYPES)}, got {self.kind!r}")
        if self.kind != "json" and not self.text.strip():
            raise ValueError(f"guided_decoding_guide_type {self.kind!r} needs a "
                             "guided_decoding_guide (the schema, regex or grammar), got none")


def structural_tag(text: str) -> str:
    """A structural tag in XGrammar's form ({"type": "structural_tag", "format": ...}); the
    older form of OpenAI-style servers ({"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}: free text until a trigger, then a tagged JSON object of that schema)
    is rewritten into it. Anything else is passed on for XGrammar to judge."""
    try:
        tag = json.loads(text)
    except ValueError:
        return text
    if not isinstance(tag, dict) or "format" in tag or \
            not isinstance(tag.get("structures"), list):
        return text
    tags = [{"begin": s.get("begin", ""), "end": s.get("end", ""),
             "content": {"type": "json_schema", "json_schema": s.get("schema", {})}}
            for s in tag["structures"] if isinstance(s, dict)]
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": tag.get("triggers", []), "tags": tags}})


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise ValueError("guided decoding needs the xgrammar package (pip install xgrammar), "
                         f"which this server lacks: {exc}") from None
    return xgrammar


def _message(exc: Exception) -> str:
    """XGrammar's error text without its timestamp and C++ source location."""
    text = str(exc).strip()
    return _XGRAMMAR_PREFIX.sub("", text.splitlines()[0] if text else repr(exc))


class GrammarBackend:
    """Compiles guides for one tokenizer and vocabulary size (the model's logits width)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 json_whitespace: str = "compact") -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        if json_whitespace == "compact":
            self.json_options: dict[str, Any] = {"any_whitespace": False}
        elif json_whitespace == "any":
            self.json_options = {}
        else:
            self.json_options = {"max_whitespace_cnt": int(json_whitespace)}
        specials = set(tokenizer.special_tokens)
        inner = tokenizer.tok
        # Special tokens are given as empty strings: XGrammar then never matches them
        # against the grammar's text (their names would otherwise spell literal text).
        vocab = []
        for token_id in range(min(vocab_size, tokenizer.vocab_size)):
            token = inner.id_to_token(token_id)
            vocab.append("" if token is None or token in specials else token)
        self.special_ids = [i for i, t in enumerate(vocab) if t == ""]
        eos = tokenizer.eos_token_id
        vocab_type, prefix_space = _vocab_metadata(xgr, tokenizer)
        info = xgr.TokenizerInfo(vocab, vocab_type, vocab_size=vocab_size,
                                 stop_token_ids=[eos] if eos is not None else None,
                                 add_prefix_space=prefix_space)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self.lock = threading.Lock()  # submit() runs on the callers' threads

    def compile(self, guide: Guide) -> Any:
        """The compiled grammar; ValueError with XGrammar's message for a bad guide."""
        try:
            with self.lock:
                if guide.kind == "json":  # an object or an array, any content
                    return self.compiler.compile_json_schema(
                        ANY_JSON, strict_mode=False, **self.json_options)
                if guide.kind == "json_schema":
                    return self.compiler.compile_json_schema(guide.text, **self.json_options)
                if guide.kind == "regex":
                    return self.compiler.compile_regex(guide.text)
                if guide.kind == "structural_tag":
                    return self.compiler.compile_structural_tag(structural_tag(guide.text))
                return self.compiler.compile_grammar(guide.text)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"guided_decoding_guide is not a valid {guide.kind}: "
                             f"{_message(exc)}") from None

    def state(self, guide: Guide, end_id: int | None) -> GuideState:
        """A fresh matcher for one sequence (ValueError if the guide allows no output)."""
        state = GuideState(self, self.compile(guide), end_id)
        if not state.continues:
            raise ValueError(f"guided_decoding_guide allows only an empty output ({guide.kind})")
        return state


def _vocab_metadata(xgr: Any, tokenizer: Tokenizer) -> tuple[Any, bool]:
    """How the vocabulary's strings spell bytes (GPT-2 byte-level as Qwen's and ours,
    SentencePiece byte fallback with <0x0A> tokens and "▁" spaces, or raw text) and whether
    the tokenizer adds a prefix space: XGrammar's own reading of the tokenizer.json (what its
    `from_huggingface` does), else the decoder's type."""
    try:
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.tok.to_str())
        return meta["vocab_type"], bool(meta["add_prefix_space"])
    except Exception:  # a private helper: fall back on the decoder's name
        text = repr(tokenizer.tok.decoder)
        if "ByteLevel" in text:
            return xgr.VocabType.BYTE_LEVEL, False
        if "ByteFallback" in text:
            return xgr.VocabType.BYTE_FALLBACK, False
        return xgr.VocabType.RAW, False


def pack_bits(mask: np.ndarray) -> np.ndarray:
    """[V] bool -> [ceil(V / 32)] int32 words, bit j of word w = token 32 w + j (XGrammar's
    bitmask layout, little-endian)."""
    V = mask.shape[0]
    padded = np.zeros((V + 31) // 32 * 32, dtype=bool)
    padded[:V] = mask
    return np.packbits(padded, bitorder="little").view("<i4")


def unpack_bits(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """The inverse of `pack_bits`: [W] int32 -> [vocab_size] bool."""
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size].view(bool)


class GuideState:
    """One sequence's position in its grammar. `words` holds the tokens it may produce next
    (packed in XGrammar's layout, special tokens already cleared), `allowed` unpacks them
    ([V] bool), `apply` masks a row of logits with them; `continues` is False once the grammar
    allows nothing but its end; `forced` is the token it must produce next when there is
    exactly one (jump-forward), else None."""

    def __init__(self, backend: GrammarBackend, compiled: Any, end_id: int | None) -> None:
        xgr = _xgrammar()
        V = backend.vocab_size
        self.end_id = end_id if end_id is not None and 0 <= end_id < V else None
        if self.end_id is not None:
            self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[self.end_id])
        else:  # no end token: the grammar's end is where the output stops
            self.matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        self.bitmask = xgr.allocate_token_bitmask(1, V)
        self.words = self.bitmask[0].numpy()  # the same memory
        self.vocab_size = V
        stop = np.zeros(V, dtype=bool)
        stop[[t for t in self.matcher.stop_token_ids if 0 <= t < V]] = True
        never = np.zeros(V, dtype=bool)
        never[backend.special_ids] = True
        never &= ~stop
        if self.end_id is None:
            never |= stop
        self.keep = pack_bits(~never)  # cleared from every mask
        self.not_stop = pack_bits(~stop)
        self._refresh()

    @property
    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens allowed next."""
        return torch.from_numpy(unpack_bits(self.words, self.vocab_size))

    def apply(self, row: torch.Tensor) -> None:
        """-inf, in place, on a row of logits [V] for every token not allowed next."""
        row.masked_fill_(~self.allowed.to(row.device), float("-inf"))

    def accept(self, token: int) -> None:
        """Moves past `token` (sampled from `allowed`); ValueError if the grammar rejects it
        or allows no token after it, not even its end (a dead end: e.g. the request's end id
        is a token the grammar needs as text, which XGrammar then takes as its end only)."""
        if not self.matcher.accept_token(int(token)):
            raise ValueError(f"token {token} does not follow the guide")
        self._refresh()
        if self.words.any() or self.matcher.is_terminated():
            return
        raise ValueError("the guide allows no token after this one, not even its end"
                         + (f" (end_id {self.end_id} is a token the grammar may need as "
                            "text: it is only the grammar's end)"
                            if self.end_id is not None else ""))

    def _refresh(self) -> None:
        # With an end id, terminated = it took that token; without one XGrammar reports a
        # complete grammar as terminated, and the mask still says whether it may go on.
        if self.end_id is not None and self.matcher.is_terminated():
            self.words[:] = 0
            self.continues = False
            self.forced = None
            return
        self.matcher.fill_next_token_bitmask(self.bitmask)
        np.bitwise_and(self.words, self.keep, out=self.words)
        self.continues = bool(np.bitwise_and(self.words, self.not_stop).any())
        self.forced = self._single_token()

    def _single_token(self) -> int | None:
        """The token, when the mask allows exactly one (and it is not the end)."""
        nonzero = np.flatnonzero(self.words)
        if len(nonzero) != 1:
            return None
        word = int(self.words[nonzero[0]]) & 0xFFFFFFFF
        if word & (word - 1):
            return None
        token = 32 * int(nonzero[0]) + word.bit_length() - 1
        return None if self.end_id is not None and token == self.end_id else token
