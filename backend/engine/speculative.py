"""Speculative decoding's draft side: n-gram prompt lookup (vLLM's `ngram`, TensorRT-LLM's
prompt lookup, SGLang's n-gram drafts), suffix decoding (vLLM's `suffix`, after
SuffixDecoding / Arctic Inference) and a request's own predicted output (`Prediction`:
OpenAI's predicted outputs, TensorRT-LLM's `draft_input_ids`), no draft model.

`ngram`: the last tokens of a sequence (at least `min_n`) are looked up among its earlier
tokens, prompt and output alike; the tokens that followed the longest such match (up to
`max_n` tokens long; the most recent among equals) are the draft. Outputs that quote their
context (RAG answers, code edits, summaries, JSON fields copied from a document) or repeat
themselves get drafts the model then accepts.

`suffix`: the same look-up, and also one in what earlier requests generated (`SuffixCorpus`:
each finished request's output, after its prompt's last tokens, counted per context of
`min_n`..`max_n` tokens; a bounded number of tokens, the oldest requests forgotten first;
separate per cache namespace, so one tenant's outputs never draft, or time, another's). From
the longest context that matches, the draft follows the most frequent continuation token by
token while it keeps at least MIN_SUFFIX_SHARE of the counts. The deeper of the two matches
drafts (the sequence's own on a tie). Agent loops, where tool calls and their JSON recur from
request to request, and repeated chat answers get drafts their prompts alone do not hold.

The engine verifies a draft of k tokens in one step of k + 1 tokens (`scheduler.py`): the
token sampled at each position is kept while it equals the draft's, so the output is the
one the model would have sampled token by token (greedy: the same tokens; sampled: drawn
from the same distribution, a draft token kept with exactly its probability).

A verification step costs more than a decode step, by how much depends on the hardware, the
batch and the draft length (a GPU's small-batch decode is bound by reading the weights:
extra tokens are nearly free; a CPU's is bound by operator calls at one row and by
arithmetic at eight). `DraftPolicy` measures it: the drafts of a step are cut to the length
that gives the most expected tokens per second, from each sequence's record of kept drafts
and the measured step times.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque

SPECULATIVE_METHODS = ("none", "ngram", "suffix")
# Candidate positions of the `min_n`-token key examined per draft (the most recent first):
# bounds a draft's cost on long repetitive contexts.
MAX_CANDIDATES = 32
# suffix: a draft goes on while its next token took at least this share of the counts after
# its context (SuffixDecoding's minimum token probability).
MIN_SUFFIX_SHARE = 0.1


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
        return self.lookup(tokens, max_n, k)[0]

    def lookup(self, tokens: list[int], max_n: int, k: int) -> tuple[list[int], int]:
        """`propose`'s draft and the length of the match it follows (0: none)."""
        n, L = self.n, len(tokens)
        if k <= 0 or L <= n:
            return [], 0
        self.update(tokens)
        found = self.positions.get(tuple(tokens[L - n:]))
        if not found:
            return [], 0
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
        return draft, best_len


class SuffixCorpus:
    """What earlier requests generated, for `suffix` drafts: for each context of
    `min_n`..`max_n` tokens (within a cache namespace), how often each token followed it.
    `add` counts a finished request's tokens in; past `max_tokens` tokens held, the oldest
    requests' counts are taken out again."""

    def __init__(self, min_n: int, max_n: int, max_tokens: int) -> None:
        if not 1 <= min_n <= max_n or max_tokens < 1:
            raise ValueError(f"SuffixCorpus needs 1 <= min_n <= max_n and max_tokens >= 1, got "
                             f"{min_n} / {max_n} / {max_tokens}")
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        self.counts: dict[tuple[str, tuple[int, ...]], dict[int, int]] = {}
        self.requests: deque[tuple[str, list[int]]] = deque()
        self.num_tokens = 0

    def add(self, namespace: str, tokens: list[int]) -> None:
        tokens = list(tokens[-self.max_tokens:])
        if len(tokens) <= self.min_n:
            return
        self._count(namespace, tokens, 1)
        self.requests.append((namespace, tokens))
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens:
            old_namespace, old = self.requests.popleft()
            self._count(old_namespace, old, -1)
            self.num_tokens -= len(old)

    def forget(self, namespaces: set[str] | None = None) -> None:
        """Takes out the requests of `namespaces` (None: every request)."""
        kept: deque[tuple[str, list[int]]] = deque()
        for namespace, tokens in self.requests:
            if namespaces is None or namespace in namespaces:
                self._count(namespace, tokens, -1)
                self.num_tokens -= len(tokens)
            else:
                kept.append((namespace, tokens))
        self.requests = kept

    def _count(self, namespace: str, tokens: list[int], delta: int) -> None:
        counts = self.counts
        for m in range(self.min_n, self.max_n + 1):
            for i in range(m, len(tokens)):
                key = (namespace, tuple(tokens[i - m:i]))
                followers = counts.get(key)
                if followers is None:
                    followers = counts[key] = {}
                left = followers.get(tokens[i], 0) + delta
                if left > 0:
                    followers[tokens[i]] = left
                else:
                    followers.pop(tokens[i], None)
                    if not followers:
                        del counts[key]

    def lookup(self, namespace: str, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens continuing `tokens`: from the longest context (max_n down to min_n
        tokens) the corpus holds, its most frequent follower (the first counted among
        equals), while that follower holds MIN_SUFFIX_SHARE of the counts; and the length of
        the first context matched (0: none)."""
        context = list(tokens[-self.max_n:])
        draft: list[int] = []
        matched = 0
        for _ in range(k):
            followers = None
            for m in range(min(self.max_n, len(context)), self.min_n - 1, -1):
                followers = self.counts.get((namespace, tuple(context[-m:])))
                if followers:
                    break
            if not followers:
                break
            matched = matched or m
            token, count = max(followers.items(), key=lambda item: item[1])
            if count < MIN_SUFFIX_SHARE * sum(followers.values()):
                break
            draft.append(token)
            context.append(token)
        return draft, (matched if draft else 0)


class NgramDrafter:
    """Drafts for the engine's sequences (one `NgramIndex` each, kept on the sequence); with a
    `corpus` (`suffix`), also from earlier requests' outputs, which `learn` adds."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int,
                 corpus: SuffixCorpus | None = None) -> None:
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n
        self.corpus = corpus
        self.corpus_drafts = 0  # drafts that came from the corpus

    def propose(self, seq, limit: int) -> list[int]:
        """A draft of at most min(num_tokens, limit) tokens to follow `seq.tokens`."""
        k = min(self.num_tokens, limit)
        if k <= 0:
            return []
        if seq.ngram_index is None:
            seq.ngram_index = NgramIndex(self.min_n)
        draft, matched = seq.ngram_index.lookup(seq.tokens, self.max_n, k)
        if self.corpus is not None:
            shared, deeper = self.corpus.lookup(seq.salt, seq.tokens, k)
            if deeper > matched:
                self.corpus_drafts += 1
                return shared
        return draft

    def learn(self, seq) -> None:
        """A finished sequence's output (after its prompt's last max_n tokens) joins the
        corpus of its namespace."""
        if self.corpus is not None and seq.num_output_tokens > 0:
            start = max(0, seq.num_prompt_tokens - self.max_n)
            self.corpus.add(seq.salt, seq.tokens[start:])


class Prediction:
    """A request's predicted output as drafts, whatever the engine's speculative method: the
    tokens the prediction holds after the place the output is at in it. While the output is
    shorter than `n` tokens it must be the prediction's start; after that its last `n` tokens
    are looked up in the prediction: the first occurrence at or after where the output would
    be had it followed the prediction since the last place found, else the last occurrence;
    so the drafts find the prediction again after the output leaves it (an edit) and rejoins
    it. The output is the model's whatever the prediction holds."""

    def __init__(self, tokens: list[int], n: int) -> None:
        self.tokens = list(tokens)
        self.n = n
        self.index = NgramIndex(n)
        self.index.update(self.tokens)
        self.at = 0  # the prediction's position the output was last found to continue at
        self.at_output = 0  # ... and the output's length then

    def propose(self, output: list[int], k: int) -> list[int]:
        """Up to k predicted tokens to follow `output` (the generated tokens so far)."""
        m = len(output)
        if k <= 0 or not self.tokens:
            return []
        if m < self.n:
            at = m if self.tokens[:m] == list(output) else -1
        else:
            found = self.index.positions.get(tuple(output[m - self.n:]), [])
            later = bisect.bisect_left(found, self.at + m - self.at_output)
            at = found[later] if later < len(found) else (found[-1] if found else -1)
        if at < 0:
            return []
        self.at, self.at_output = at, m
        return self.tokens[at:at + k]


# A step time's estimate: the median of its last COST_WINDOW measurements (interference from
# other processes only ever adds time: a median forgets it); the first measurement of each is
# left out (a new shape's first step builds its kernels).
COST_WINDOW = 9
# Every so many decisions the longest drafts go out whatever the estimates say, so that a
# step time measured on a bad moment (other processes, a cold cache) is measured again.
REPROBE_EVERY = 64
# How many rejections' worth of the engine's record a sequence's own record starts from.
PRIOR_DRAFTS = 2
# Drafts go out only where their expected tokens per second beat a step without them by this
# factor: the estimates are noisy (step times on shared cores, acceptance from few drafts),
# and a draft that only breaks even costs the stash, the position-by-position sampling and
# the rewinds for nothing.
MIN_GAIN = 1.1


class DraftPolicy:
    """How many draft tokens a step verifies (one cap for every row: a step costs what its
    longest row costs, shorter rows are padded to it).

    A sequence keeps each draft token with an estimated probability p (`accept_rate`: its
    kept tokens over kept tokens and rejections, drafts being kept in runs that end at a
    rejection, starting from the engine's rate), so a draft of d tokens gives
    1 + p + ... + p^d tokens in expectation; a row without a draft gives one. The cap d
    maximises the expected tokens of the step over its estimated time (no drafts unless
    they beat a step without them by MIN_GAIN). A step's time is estimated for its number
    of rows and 1 + d tokens a row: the median of its recent measured steps (steps of
    decoding rows only), and where a length was never measured, the time of one token a row
    (so it is tried, then known). Until a step of one token a row was measured at this
    number of rows, there are no drafts."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.times: dict[tuple[int, int], deque[float]] = {}
        self.decisions = 0
        self.kept = self.rejections = 0  # over every sequence

    def settled(self, seq, kept: int, rejected: bool) -> None:
        """A draft of `seq` was verified: `kept` tokens kept, then one `rejected` (or not)."""
        seq.draft_kept += kept
        seq.draft_rejections += rejected
        self.kept += kept
        self.rejections += rejected

    def accept_rate(self, seq) -> float:
        """The estimated probability that the sequence's next draft token is kept (after
        the ones before it): kept over kept and rejections, the sequence's own added to
        PRIOR_DRAFTS rejections at the engine's rate (itself from one kept, one rejected)."""
        p = (self.kept + 1) / (self.kept + self.rejections + 2)
        kept = seq.draft_kept + PRIOR_DRAFTS * p / (1 - p)
        return kept / (kept + seq.draft_rejections + PRIOR_DRAFTS)

    @staticmethod
    def _bucket(rows: int) -> int:
        return 1 << max(rows - 1, 0).bit_length()

    def estimate(self, rows: int, tokens: int) -> float | None:
        times = self.times.get((self._bucket(rows), tokens))
        return statistics.median(times) if times else None

    def record(self, rows: int, tokens: int, seconds: float) -> None:
        """A step of `rows` decoding rows, the longest `tokens` tokens, took `seconds`."""
        key = (self._bucket(rows), tokens)
        if key not in self.times:
            self.times[key] = deque(maxlen=COST_WINDOW)  # the first one left out
        else:
            self.times[key].append(seconds)

    def choose(self, rows: int, drafts: list[tuple[int, float]]) -> int:
        """The cap for a step of `rows` rows, `drafts` (proposal length, p) of those with a
        proposal."""
        longest = min(self.max_tokens, max(n for n, _ in drafts))
        self.decisions += 1
        base = self.estimate(rows, 1)
        if base is None:
            return 0  # a step without drafts first: what every draft is measured against
        if self.decisions % REPROBE_EVERY == 0:
            return longest
        best, best_rate = 0, MIN_GAIN * rows / base
        for d in range(1, longest + 1):
            seconds = self.estimate(rows, 1 + d) or base
            tokens = rows - len(drafts) + sum(expected_tokens(p, min(d, n)) for n, p in drafts)
            if tokens / seconds > best_rate:
                best, best_rate = d, tokens / seconds
        return best


def expected_tokens(p: float, d: int) -> float:
    """1 + p + ... + p^d: the tokens a step gives a row with a draft of d tokens each kept
    (after the ones before it) with probability p."""
    if p >= 1.0:
        return d + 1.0
    return (1.0 - math.pow(p, d + 1)) / (1.0 - p)
