"""Speculative decoding's draft side: n-gram prompt lookup (vLLM's `ngram`, TensorRT-LLM's
prompt lookup, SGLang's n-gram drafts), no draft model.

The last tokens of a sequence (at least `min_n`) are looked up among its earlier tokens,
prompt and output alike; the tokens that followed the longest such match (up to `max_n`
tokens long; the most recent among equals) are the draft. Outputs that quote their context
(RAG answers, code edits, summaries, JSON fields copied from a document) or repeat
themselves get drafts the model then accepts.

The engine verifies a draft of k tokens in one step of k + 1 tokens (`scheduler.py`): the
token sampled at each position is kept while it equals the draft's, so the output is the
one the model would have sampled token by token (greedy: the same tokens; sampled: drawn
from the same distribution, a draft token kept with exactly its probability).
"""

from __future__ import annotations

SPECULATIVE_METHODS = ("none", "ngram")
# Candidate positions of the `min_n`-token key examined per draft (the most recent first):
# bounds a draft's cost on long repetitive contexts.
MAX_CANDIDATES = 32


class NgramIndex:
    """Where each `min_n`-gram of one sequence's tokens occurs: key -> the positions that
    follow it (append-only, built incrementally as the sequence grows)."""

    def __init__(self, min_n: int) -> None:
        self.n = min_n
        self.positions: dict[tuple[int, ...], list[int]] = {}
        self.indexed = min_n  # positions < indexed are in the index (or before the first key)

    def update(self, tokens: list[int]) -> None:
        """Indexes position i (the key tokens[i - n:i] is followed by tokens[i]) for every
        token added since the last update."""
        n, table = self.n, self.positions
        for i in range(self.indexed, len(tokens)):
            table.setdefault(tuple(tokens[i - n:i]), []).append(i)
        self.indexed = max(self.indexed, len(tokens))

    def propose(self, tokens: list[int], max_n: int, k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier match (>= n tokens, at most
        max_n) of the sequence's last tokens; [] without one."""
        n, L = self.n, len(tokens)
        if k <= 0 or L <= n:
            return []
        self.update(tokens)
        found = self.positions.get(tuple(tokens[L - n:]))
        if not found:
            return []
        best, best_len = -1, 0
        for i in reversed(found[-MAX_CANDIDATES:]):  # i < L: a token follows the match
            m = n
            while m < max_n and i - m - 1 >= 0 and tokens[i - m - 1] == tokens[L - m - 1]:
                m += 1
            if m > best_len:
                best, best_len = i, m
                if m == max_n:
                    break
        # A match close to the end runs into the sequence itself: the draft continues it
        # (a periodic output: each token repeats the one a period before).
        draft: list[int] = []
        for p in range(best, best + k):
            draft.append(tokens[p] if p < L else draft[p - L])
        return draft


class NgramDrafter:
    """Drafts for the engine's sequences (one `NgramIndex` each, kept on the sequence)."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n

    def propose(self, seq, limit: int) -> list[int]:
        """A draft of at most min(num_tokens, limit) tokens to follow `seq.tokens`."""
        k = min(self.num_tokens, limit)
        if k <= 0:
            return []
        if seq.ngram_index is None:
            seq.ngram_index = NgramIndex(self.min_n)
        return seq.ngram_index.propose(seq.tokens, self.max_n, k)
