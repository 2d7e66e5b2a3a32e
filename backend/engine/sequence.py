"""Runtime state of one request inside the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from backend.cache.radix import encode_tokens, lora_namespace
from backend.engine.beam import BeamGroup
from backend.engine.guided import GuideState
from backend.engine.request import Request, RequestMetrics, RequestOutput
from backend.engine.sampling import RepeatedNgrams, TokenCounts
from backend.engine.speculative import NgramIndex, Prediction


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens [0, num_computed) have KV in `page_table` and linear states in `run_slot`.

    page_table[:num_tree_pages] belong to the prefix store (their path is locked in
    `locked_nodes`); the rest are private to this sequence and freed when it leaves.
    `pending_states` maps a token position to a checkpoint slot this sequence holds (states
    saved after that many tokens) that is not yet inserted into the store.
    """

    request: Request
    tokens: list[int]
    num_prompt_tokens: int
    arrival: float = field(default_factory=time.perf_counter)
    # The wall clock at arrival: the metrics' times are this plus monotonic differences (an
    # offset taken once per process goes stale when the system clock is stepped).
    arrival_wall_ns: int = field(default_factory=lambda: time.time_ns())
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    run_slot: int | None = None
    page_table: list[int] = field(default_factory=list)
    anchor_blocks: list[int] = field(default_factory=list)
    num_tree_pages: int = 0
    locked_nodes: list = field(default_factory=list)
    pending_states: dict[int, int] = field(default_factory=dict)
    capture_positions: set[int] = field(default_factory=set)
    live_position: int | None = None
    adapter: int = 0  # the LoRA adapter's index in the model (0: none)
    generator: torch.Generator | None = None
    cached_tokens: int = 0
    replayed_anchors: int = 0
    recomputed_tokens: int = 0
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    last_token_time: float | None = None
    # KV pages allocated for it: for tokens it computes, and to receive cached data (pages
    # a lower tier loaded back onto the device, pages copied for forked beams); a beam
    # search counts them on its leader (`owner`).
    pages_new: int = 0
    pages_loaded: int = 0
    draft_tokens: int = 0  # speculative draft tokens verified for it
    # Request.return_context_logits: the prompt chunks' logits so far, until delivered
    context_rows: list[torch.Tensor] | None = field(default=None, repr=False)
    # Request.return_prompt_log_probs: per prompt chunk, its positions' (log probability of
    # the next prompt token, likeliest tokens, the token's rank), until delivered
    prompt_scores: list[tuple[list[float], list[list[tuple[int, float]]], list[int]]] | None = \
        field(default=None, repr=False)
    prefix_inserted: bool = False
    admission_deferrals: int = 0  # steps it stayed queued for its SSD reads
    prefill_waits: int = 0  # steps it stayed queued for a running prefill of its prefix
    # Whole pages its prompt shares with running prefills' prompts, by sequence (while queued).
    shared_pages: dict = field(default_factory=dict, repr=False)
    token_counts: TokenCounts | None = None  # for penalties, built on first use
    repeated_ngrams: RepeatedNgrams | None = field(default=None, repr=False)  # likewise, for
    # no_repeat_ngram_size
    cum_log_prob: float = 0.0  # of the tokens output so far (with return_log_probs)
    guide: GuideState | None = None  # where a guided request is in its grammar
    ngram_index: NgramIndex | None = field(default=None, repr=False)  # speculative drafts
    prediction: Prediction | None = field(default=None, repr=False)  # Request.prediction's
    draft_kept: int = 0  # speculative draft tokens kept ...
    draft_rejections: int = 0  # ... and drafts cut short by a rejected token
    beam: BeamGroup | None = field(default=None, repr=False)  # beam search: its request's beams
    _key: tuple[int, bytes] | None = field(default=None, repr=False)

    @property
    def wants_context_logits(self) -> bool:
        """Its prompt's logits are still to be computed (asked for, no output yet)."""
        return self.request.needs_prompt_logits and self.first_token_time is None

    @property
    def salt(self) -> str:
        """Its prefix-cache namespace: the request's cache_salt, and its LoRA adapter."""
        return lora_namespace(self.request.cache_salt, self.request.lora_name)

    def prefix_key(self) -> bytes:
        """`encode_tokens(tokens[:-1])`, what the prefix store matches for it (at least one
        token is recomputed); encoded once per token count, not on each look-up."""
        if self._key is None or self._key[0] != len(self.tokens):
            self._key = (len(self.tokens), encode_tokens(self.tokens[:-1]))
        return self._key[1]

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def owner(self) -> Sequence:
        """The sequence a request's counts go to: its beam search's leader, else itself."""
        return self if self.beam is None else self.beam.leader

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    def counts(self, vocab_size: int) -> TokenCounts:
        """The penalties' view of the tokens so far (prompt and generated), up to date."""
        if self.token_counts is None:
            self.token_counts = TokenCounts(vocab_size, self.num_prompt_tokens)
        return self.token_counts.update(self.tokens)

    def repeat_bans(self) -> set[int]:
        """The tokens that would repeat one of its n-grams next (no_repeat_ngram_size; an
        empty set when off)."""
        n = self.request.sampling.no_repeat_ngram_size
        if not n:
            return set()
        if self.repeated_ngrams is None:
            self.repeated_ngrams = RepeatedNgrams(n)
        return self.repeated_ngrams.update(self.tokens).banned(self.tokens)

    def output(self, new_ids: list[int], finished: bool = False, reason: str | None = None,
               error: str | None = None) -> RequestOutput:
        ttft = None
        if self.first_token_time is not None:
            ttft = self.first_token_time - self.arrival
        return RequestOutput(
            request_id=self.request_id, new_token_ids=new_ids, finished=finished,
            finish_reason=reason, num_input_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens, cached_tokens=self.cached_tokens,
            replayed_anchors=self.replayed_anchors, recomputed_tokens=self.recomputed_tokens,
            error=error, ttft_s=ttft,
        )

    def metrics(self, page_size: int) -> RequestMetrics:
        """Its request's metrics so far (the engine attaches them to each output it delivers
        when asked: after the step's drafts were settled); pages reused: those its last
        admission found in the store (any tier)."""
        def wall_ns(t: float | None) -> int:
            return 0 if t is None else self.arrival_wall_ns + round((t - self.arrival) * 1e9)

        return RequestMetrics(
            arrival_time_ns=self.arrival_wall_ns,
            first_scheduled_time_ns=wall_ns(self.first_scheduled_time),
            first_token_time_ns=wall_ns(self.first_token_time),
            last_token_time_ns=wall_ns(self.last_token_time),
            kv_cache_reused_blocks=self.cached_tokens // page_size,
            kv_cache_alloc_new_blocks=self.pages_new,
            kv_cache_alloc_total_blocks=self.pages_new + self.pages_loaded,
            total_draft_tokens=self.draft_tokens,
            total_accepted_draft_tokens=self.draft_kept,
        )
