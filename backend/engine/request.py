"""What a client asks for and what the engine streams back."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backend.cache.retention import RetentionConfig
from backend.engine.guided import Guide

MAX_TOKENS_LIMIT = 1 << 20  # anything larger is a client bug, not a long generation
MAX_BEAM_WIDTH = 64
MAX_TOP_LOG_PROBS = 20  # alternatives a position may return (OpenAI's and vLLM's limit)
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


def _integer(name: str, value: Any) -> None:
    """ValueError unless `value` is an integer (numpy's too; not a bool, not a float that
    happens to be whole: those pass range checks and fail the batch's step later)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _real(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Decoding controls (TensorRT-LLM names). top_k = 1 or temperature = 0 is greedy.

    Penalties (neutral: 1 / 0 / 0) and `logit_bias` (token id, added value) change the logits
    before anything else, greedy included (`backend/engine/sampling.py` states the order);
    `no_repeat_ngram_size` n > 0 never draws a token that would repeat an n-gram of the
    sequence so far, prompt included (transformers' and TensorRT-LLM's parameter);
    `return_log_probs` asks for each generated token's log probability under the model;
    `top_log_probs` = N > 0 also asks for the N likeliest tokens at each generated position
    with theirs (the same raw distribution; it implies return_log_probs);
    `guide` constrains the output to a JSON schema, JSON, a regex or a grammar
    (`backend/engine/guided.py`); `allowed_token_ids` (vLLM's; empty: every token) to
    those tokens. `beam_width` > 1 is beam search (`backend/engine/beam.py`:
    deterministic, so temperature and seed do not apply; top_k / top_p must stay neutral),
    ranking finished beams by their summed log probability over generated length **
    `length_penalty`; `early_stopping` ends it once `beam_width` beams finished (else when
    no running beam can beat the finished ones, as transformers' default).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0
    min_p: float = 0.0  # 0: off; else tokens below min_p x the likeliest one's probability go
    seed: int | None = None
    end_id: int | None = None
    stop_words: tuple[tuple[int, ...], ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()  # empty: every token may be drawn
    no_repeat_ngram_size: int = 0  # 0: off; n: no n-gram of the tokens so far is repeated
    return_log_probs: bool = False
    top_log_probs: int = 0
    guide: Guide | None = None
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False

    def __post_init__(self) -> None:
        for name in ("max_tokens", "min_tokens", "top_k", "no_repeat_ngram_size",
                     "top_log_probs", "beam_width"):
            _integer(name, getattr(self, name))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "length_penalty"):
            _real(name, getattr(self, name))
        if self.end_id is not None:
            _integer("end_id", self.end_id)
        if self.seed is not None:
            _integer("seed", self.seed)
            if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
                raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got "
                                 f"{self.seed}")
        for name in ("stop_words", "bad_words"):
            for word in getattr(self, name):
                for token in word:
                    _integer(f"{name} token ids", token)
        for token in self.allowed_token_ids:
            _integer("allowed_token_ids", token)
        for token, value in self.logit_bias:
            _integer("logit_bias token ids", token)
            _real("logit_bias values", value)
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(
                f"max_tokens must be in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens}"
            )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("stop_words", "bad_words"):
            if any(len(w) == 0 for w in getattr(self, name)):
                raise ValueError(f"{name} contains an empty word")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be finite and > 0, got "
                             f"{self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if self.no_repeat_ngram_size < 0:
            raise ValueError(f"no_repeat_ngram_size must be >= 0, got "
                             f"{self.no_repeat_ngram_size}")
        ids = [token for token, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            raise ValueError("logit_bias names a token id twice")
        if not all(math.isfinite(value) for _, value in self.logit_bias):
            raise ValueError("logit_bias holds a value that is not finite")
        if len(set(self.allowed_token_ids)) != len(self.allowed_token_ids):
            raise ValueError("allowed_token_ids names a token id twice")
        if self.allowed_token_ids and self.guide is not None:
            raise ValueError("allowed_token_ids and guided decoding do not combine: put the "
                             "tokens in the guide")
        if not 0 <= self.top_log_probs <= MAX_TOP_LOG_PROBS:
            raise ValueError(f"top_log_probs must be in [0, {MAX_TOP_LOG_PROBS}], got "
                             f"{self.top_log_probs}")
        if self.top_log_probs and not self.return_log_probs:
            object.__setattr__(self, "return_log_probs", True)
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got "
                             f"{self.beam_width}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")
        if self.beam_width > 1:
            if self.top_k != 0 or self.top_p != 1.0 or self.min_p != 0.0:
                raise ValueError(f"top_k={self.top_k} / top_p={self.top_p} / min_p="
                                 f"{self.min_p} do not apply to beam search (beam_width > 1): "
                                 "leave them at 0 / 1 / 0")
            if self.guide is not None:
                raise ValueError("guided decoding with beam search (beam_width > 1) is not "
                                 "supported")
            if self.top_log_probs:
                raise ValueError("top_log_probs with beam search (beam_width > 1) is not "
                                 "supported")

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (a penalty is not neutral)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def greedy(self) -> bool:
        return self.top_k == 1 or self.temperature == 0


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str = ""
    session_id: str | None = None
    # Called from the engine thread with each step's output; must not block.
    on_output: Callable[[RequestOutput], None] | None = None
    # Attach the logits that chose the first token (quality measurements, tests).
    return_first_logits: bool = False
    # Attach `RequestMetrics` (times, KV pages, speculative counts) to every output.
    return_perf_metrics: bool = False
    # Attach the raw logits that chose each generated token (TensorRT-LLM's
    # return_generation_logits); guided tokens are then drawn one a step (no jump-forward).
    return_generation_logits: bool = False
    # Attach the raw logits at every prompt position ([P, V], TensorRT-LLM's
    # return_context_logits) to the first output. The cache has no logits for the pages it
    # serves, so such a request computes its whole prompt (its pages still join the store).
    return_context_logits: bool = False
    # Attach the log probability of each prompt token after the first under the model (and,
    # with sampling.top_log_probs = N, the N likeliest tokens at its position) to the first
    # output: what scoring a text needs (vLLM's prompt_logprobs, OpenAI's echo with
    # logprobs). Computed from each prompt chunk's logits as it runs, so only the scores are
    # kept; like context logits, the whole prompt is computed.
    return_prompt_log_probs: bool = False
    # How long the store should keep the pages this request leaves behind (TensorRT-LLM's
    # KvCacheRetentionConfig; `backend/cache/retention.py`); None: the default priority.
    retention: RetentionConfig | None = None
    # Scheduling priority, vLLM's convention: lower runs first (default 0). A waiting request
    # goes ahead of those with a higher value and takes the slot (or pages) of a running one
    # with a higher value; equal ones keep the schedule policy's order.
    priority: int = 0
    # The LoRA adapter it runs on (a name the engine loaded, `Engine.load_lora`); None: the
    # base model. Its prefixes are cached apart from the base model's and other adapters'.
    lora_name: str | None = None
    # Beam search (beam_width > 1): an output at every step, before the final one, whose
    # `beams` are the running beams so far, best first (TensorRT-LLM streams beams so);
    # without it the final output is the only one.
    stream_beams: bool = False
    # The output it is expected to hold, as token ids (OpenAI's predicted outputs,
    # TensorRT-LLM's draft_input_ids): drafts verified as speculative decoding verifies its
    # own (`speculative.Prediction`), on the eager executor, whatever the engine's
    # speculative method. Only the time changes: the tokens are the model's.
    prediction: list[int] | None = None
    # When it must end (time.monotonic() seconds; TensorRT-LLM's allotted_time_ms, made
    # absolute at arrival so the sequences of one client request share it): a request still
    # waiting or running then ends with finish_reason "timed_out", keeping what it generated
    # (a beam search: its beams so far). Checked between steps, so it may run one step over.
    deadline: float | None = None

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether every prompt position's logits are computed (no prefix match)."""
        return self.return_context_logits or self.return_prompt_log_probs


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    # "stop" | "length" | "eos" | "cancelled" | "timed_out" | "error"
    finish_reason: str | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix store
    replayed_anchors: int = 0  # anchors replayed to rebuild linear states
    recomputed_tokens: int = 0  # prompt tokens prefilled
    error: str | None = None
    ttft_s: float | None = None  # set on the first output
    first_logits: Any = None  # [V] fp32 tensor, only with Request.return_first_logits
    # With Request.return_generation_logits: [len(new_token_ids), V] fp32, the model's raw
    # logits that chose each of new_token_ids (before bias, penalties and temperature).
    generation_logits: Any = None
    # With Request.return_context_logits, on the first output: [num_input_tokens, V] fp32.
    context_logits: Any = None
    # With SamplingParams.return_log_probs: the log probability of each of new_token_ids under
    # the model (its raw logits' log-softmax), and their sum over all tokens generated so far.
    log_probs: list[float] = field(default_factory=list)
    cum_log_prob: float = 0.0
    # With SamplingParams.top_log_probs = N: for each of new_token_ids, the N likeliest
    # tokens at its position as (token id, log probability), likeliest first.
    top_log_probs: list[list[tuple[int, float]]] = field(default_factory=list)
    # With Request.return_prompt_log_probs, on the first output: the log probability of each
    # prompt token after the first (num_input_tokens - 1 values) and, with top_log_probs,
    # the likeliest tokens at each of those positions, and each of those tokens' rank at its
    # position (1: the likeliest; vLLM's `rank`).
    prompt_log_probs: list[float] | None = None
    prompt_top_log_probs: list[list[tuple[int, float]]] | None = None
    prompt_log_prob_ranks: list[int] | None = None
    # Beam search (beam_width > 1): the finished beams, best first, in the request's final
    # output (new_token_ids / log_probs / cum_log_prob are the best beam's); with
    # Request.stream_beams, the running beams so far in each output before it (no
    # new_token_ids, finish_reason "" on each beam).
    beams: list[BeamOutput] | None = None
    # With Request.return_perf_metrics: the request's metrics so far.
    metrics: RequestMetrics | None = None


@dataclass
class RequestMetrics:
    """One request's performance metrics, as TensorRT-LLM's `return_perf_metrics` reports
    them. Times are nanoseconds on the wall clock (`time.time_ns()` at the request's arrival
    plus monotonic differences, so differences are exact); 0 where the event has not happened yet.
    KV pages ("blocks"): `reused` came from the prefix store (any tier) at the request's
    last admission; `new` were allocated for tokens it computed (drafts and pages for
    restarts after preemption included); `total` adds the pages allocated to receive cached
    data: pages the store's lower tiers (DRAM, SSD) loaded back onto the device for it and
    pages copied for its forked beams."""

    arrival_time_ns: int = 0
    first_scheduled_time_ns: int = 0
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0
    kv_cache_reused_blocks: int = 0
    kv_cache_alloc_new_blocks: int = 0
    kv_cache_alloc_total_blocks: int = 0
    total_draft_tokens: int = 0
    total_accepted_draft_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified speculative draft tokens (0 when none was verified)."""
        if self.total_draft_tokens == 0:
            return 0.0
        return self.total_accepted_draft_tokens / self.total_draft_tokens


@dataclass
class BeamOutput:
    """One finished beam: its generated ids (an end id not included), the model's log
    probability of each (with return_log_probs) and their sum, its score (the summed
    log probabilities beam search ranked by, over generated length ** length_penalty) and
    why it ended."""

    token_ids: list[int]
    log_probs: list[float]
    cum_log_prob: float
    score: float
    finish_reason: str
    logits: Any = None  # [len(token_ids), V] fp32 with Request.return_generation_logits
