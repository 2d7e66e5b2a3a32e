"""Token sampling in plain PyTorch: logit bias, repetition / presence / frequency penalties,
temperature, top-k, top-p, per-request seeds, min_tokens, bad words; log probabilities; plus
the stop rules the engine applies after each sampled token.

Rules (TensorRT-LLM semantics where it has them):
- The logits are changed in this order before any choice, greedy included: `logit_bias` is
  added (TensorRT-LLM's embedding bias); the repetition penalty p divides a positive logit by p
  and multiplies a negative one by p for every id in the prompt or the generated tokens (as
  TensorRT-LLM and transformers' RepetitionPenaltyLogitsProcessor do); the presence penalty is
  subtracted once and the frequency penalty once per occurrence for every id among the
  generated tokens only (OpenAI's and vLLM's definition; the prompt does not count).
- Greedy (argmax) when `top_k == 1` or `temperature == 0`; otherwise logits / temperature,
  then top-k, then top-p (nucleus: the smallest set of most likely tokens whose probability
  reaches top_p; the most likely token is always kept), then min-p (tokens whose probability
  is below min_p times the most likely token's go, as vLLM's and SGLang's min_p: a ratio, so
  the same before or after top-k / top-p), then one draw.
- A request with a seed owns a `torch.Generator` seeded once (`make_generator`) and used for
  every one of its draws, so the same seed and prompt give the same tokens whatever else shares
  the batch. Without a seed the draw uses the global generator.
- Before `min_tokens` tokens were generated the end id cannot be drawn (its logit is masked)
  and stop words do not end the request (`finish_reason` ignores them).
- Bad words are never produced: a one-token bad word is always masked; a longer one has its
  last token masked whenever the generated tokens end with all its other tokens.
- `no_repeat_ngram_size` n: a token is masked where it would complete an n-gram the sequence
  (prompt and generated tokens, as transformers' NoRepeatNGramLogitsProcessor reads it)
  already holds (`RepeatedNgrams`, kept per sequence and updated with its new tokens).
- A guided request (`backend/engine/guided.py`) can only draw the tokens its grammar allows
  next, and one with `allowed_token_ids` (vLLM's) only those tokens; min_tokens, bad words and
  repeated n-grams then remove tokens only where the grammar or the allowed set leaves another
  choice (where they would leave none, its choices stand).
- A row the rules leave without any token (bad words or repeated n-grams covering the
  vocabulary; a bias or penalty so extreme that the logits leave the float range: NaN bans a
  token, +inf counts as the largest float) falls back to the rules without the bias and
  penalties, then to the model's own logits: one request's values never fail the batch.
- Stop words are matched against the generated tokens only (never the prompt); the matched
  tokens stay in the output, as TensorRT-LLM returns them.
- Log probabilities (`scored_log_probs`: the chosen token's and the likeliest alternatives) are
  the model's: the log-softmax of its raw logits, before bias, penalties, masks and
  temperature (vLLM's default and TensorRT-LLM's PyTorch backend's "raw" mode), so they score
  the text, whatever sampled it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Protocol

import torch

from backend.engine.request import SamplingParams

MIN_TEMPERATURE = 1e-6


class TokenMask(Protocol):
    def apply(self, row: torch.Tensor) -> None: ...


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator: seeded once at admission, None for unseeded requests."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class TokenCounts:
    """One request's tokens as the penalties see them: which ids its prompt holds
    (`in_prompt` [V] bool) and how often it generated each id (`generated` [V] int32). Kept in
    step with the request's growing token list by `update`, which counts only the new ones."""

    def __init__(self, vocab_size: int, num_prompt_tokens: int) -> None:
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool)
        self.generated = torch.zeros(vocab_size, dtype=torch.int32)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_counted = 0

    def update(self, tokens: Sequence[int]) -> TokenCounts:
        """Counts `tokens[num_counted:]` (prompt first, then generated); returns self. A list
        shorter than what was counted is counted again from the start."""
        if len(tokens) < self.num_counted:
            self.in_prompt.zero_()
            self.generated.zero_()
            self.num_counted = 0
        new = list(tokens[self.num_counted:])
        if new:
            ids = torch.tensor(new, dtype=torch.long)
            split = min(max(0, self.num_prompt_tokens - self.num_counted), len(new))
            self.in_prompt[ids[:split]] = True
            self.generated.index_add_(0, ids[split:],
                                      torch.ones(len(new) - split, dtype=torch.int32))
            self.num_counted = len(tokens)
        return self


class RepeatedNgrams:
    """One sequence's n-grams (no_repeat_ngram_size n), to ban the tokens that would repeat
    one: for each (n - 1)-gram of its tokens, the tokens that followed it. `update` indexes
    the n-grams its growing token list added since the last call (a shorter list starts
    over); `banned` the tokens that would complete one after its current last n - 1."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"no_repeat_ngram_size must be >= 1, got {n}")
        self.n = n
        self.followers: dict[tuple[int, ...], set[int]] = {}
        self.num_indexed = 0

    def update(self, tokens: Sequence[int]) -> RepeatedNgrams:
        if len(tokens) < self.num_indexed:
            self.followers.clear()
            self.num_indexed = 0
        n = self.n
        for end in range(max(self.num_indexed, n - 1), len(tokens)):
            key = tuple(tokens[end - n + 1:end])
            self.followers.setdefault(key, set()).add(tokens[end])
        self.num_indexed = len(tokens)
        return self

    def banned(self, tokens: Sequence[int]) -> set[int]:
        if len(tokens) < self.n - 1:
            return set()
        key = tuple(tokens[len(tokens) - self.n + 1:]) if self.n > 1 else ()
        return self.followers.get(key, set())


def adjust_logits(row: torch.Tensor, params: SamplingParams, counts: TokenCounts | None) -> None:
    """In place on one row of logits [V] (float32): the logit bias, then the penalties (which
    need `counts` when any is not neutral)."""
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        row.index_add_(0, ids, torch.tensor([v for _, v in params.logit_bias], dtype=row.dtype))
    if not params.penalized:
        return
    if counts is None:
        raise ValueError("penalties need the request's token counts")
    if params.repetition_penalty != 1.0:
        seen = counts.in_prompt | (counts.generated > 0)
        values = row[seen]
        p = params.repetition_penalty
        row[seen] = torch.where(values > 0, values / p, values * p)
    if params.presence_penalty or params.frequency_penalty:
        generated = counts.generated.to(row.dtype)
        row -= (params.frequency_penalty * generated
                + params.presence_penalty * (generated > 0).to(row.dtype))


def scored_log_probs(logits: torch.Tensor, tokens: torch.Tensor, top: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One log-softmax of the raw `logits` [B, V]: the log probability of `tokens` [B] ([B]
    fp32) and each row's `top` likeliest tokens, likeliest first (ids [B, top] int64 and
    their log probabilities [B, top] fp32)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    chosen = log_probs.gather(1, tokens.view(-1, 1).to(log_probs.device)).view(-1)
    values, ids = torch.topk(log_probs, top, dim=-1)
    return chosen, ids, values


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    output_lens: Sequence[int],
    histories: Sequence[Sequence[int]] | None = None,
    counts: Sequence[TokenCounts | None] | None = None,
    masks: Sequence[TokenMask | None] | None = None,
    repeats: Sequence[Collection[int]] | None = None,
) -> torch.Tensor:
    """Next token per row.

    logits: [B, V] (any float dtype); params, generators, output_lens: one per row, output_lens
    counting the tokens generated so far; histories: the generated ids per row (needed only for
    multi-token bad words); counts: each row's `TokenCounts`, up to date (needed only for rows
    with penalties); masks: per row, None or what a guide allows next (at least one token):
    an object whose `apply(row)` sets the other tokens' logits to -inf (`GuideState`);
    repeats: per row, the tokens that would repeat one of its n-grams (`RepeatedNgrams`).
    Returns LongTensor [B] on the logits' device.
    """
    B, V = logits.shape
    if not len(params) == len(generators) == len(output_lens) == B:
        raise ValueError(
            f"sample got {B} rows of logits but {len(params)} params, {len(generators)} "
            f"generators and {len(output_lens)} output_lens"
        )
    if histories is not None and len(histories) != B:
        raise ValueError(f"sample got {B} rows of logits but {len(histories)} histories")
    if counts is not None and len(counts) != B:
        raise ValueError(f"sample got {B} rows of logits but {len(counts)} token counts")
    if masks is not None and len(masks) != B:
        raise ValueError(f"sample got {B} rows of logits but {len(masks)} masks")
    if repeats is not None and len(repeats) != B:
        raise ValueError(f"sample got {B} rows of logits but {len(repeats)} repeat bans")
    raw, logits = logits, logits.float().clone()
    for i, p in enumerate(params):
        row = logits[i]
        adjust_logits(row, p, counts[i] if counts is not None else None)
        history = histories[i] if histories is not None else ()
        banned = repeats[i] if repeats is not None else ()
        mask = masks[i] if masks is not None else None
        if mask is not None:
            mask.apply(row)
        mask_constrained(row, p, output_lens[i], history, banned,
                         constrained=mask is not None)
        if p.logit_bias or p.penalized:
            settle(row)
    # Rows the rules left without a token (an extreme bias or penalty; bad words or
    # no_repeat_ngram_size banning every token): the rules without the bias and penalties,
    # then the model's own logits, so that one request's values never fail its batch.
    for i in torch.nonzero(~torch.isfinite(logits).any(dim=-1)).flatten().tolist():
        row, p, mask = logits[i], params[i], masks[i] if masks is not None else None
        row.copy_(raw[i])
        if mask is not None:
            mask.apply(row)
        mask_constrained(row, p, output_lens[i], histories[i] if histories is not None else (),
                         repeats[i] if repeats is not None else (),
                         constrained=mask is not None)
        if not settle(row):
            row.copy_(raw[i])
    next_ids = torch.empty(B, dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        next_ids[greedy] = logits[greedy].argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        probs, order = filtered_probs(logits[sampled], [params[i] for i in sampled])
        for row, i in enumerate(sampled):
            pick = torch.multinomial(probs[row], 1, generator=generators[i])  # index into order
            next_ids[i] = order[row, pick[0]]
    return next_ids


def adjusted_log_probs(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_lens: Sequence[int],
    histories: Sequence[Sequence[int]],
    counts: Sequence[TokenCounts | None] | None = None,
    repeats: Sequence[Collection[int]] | None = None,
) -> torch.Tensor:
    """Beam search's scores: the log-softmax [B, V] (fp32) of logits [B, V] after the logit
    bias, the penalties, min_tokens, bad words and repeated n-grams (as `sample` changes
    them; no temperature, top-k or top-p)."""
    raw, logits = logits, logits.float().clone()
    for i, p in enumerate(params):
        adjust_logits(logits[i], p, counts[i] if counts is not None else None)
        mask_constrained(logits[i], p, output_lens[i], histories[i],
                         repeats[i] if repeats is not None else ())
        if (p.logit_bias or p.penalized) and not settle(logits[i]):
            logits[i] = raw[i]
    return torch.log_softmax(logits, dim=-1)


def settle(row: torch.Tensor) -> bool:
    """In place on one row of adjusted logits [V] (float32): extreme biases and penalties
    (finite, as accepted) can push logits past the float range. A NaN (inf - inf) bans its
    token and +inf becomes the largest float (still the likeliest, and softmax stays
    defined). False where no token is left (the caller falls back to the model's logits):
    one request's values never fail the step its batch shares."""
    torch.nan_to_num_(row, nan=-math.inf, posinf=torch.finfo(row.dtype).max, neginf=-math.inf)
    return bool(torch.isfinite(row).any())


def mask_constrained(row: torch.Tensor, params: SamplingParams, output_len: int,
                     history: Sequence[int], repeats: Collection[int] = (),
                     constrained: bool = False) -> None:
    """In place on one row of logits [V]: -inf outside `allowed_token_ids`, then
    `mask_banned`'s bans, except where those would leave no token: the row is then as the
    allowed set (or a guide's mask already applied: `constrained`) left it."""
    if params.allowed_token_ids:
        ids = torch.tensor(params.allowed_token_ids, dtype=torch.long)
        kept = row[ids]
        row.fill_(float("-inf"))
        row[ids] = kept
        constrained = True
    if not constrained:
        mask_banned(row, params, output_len, history, repeats)
        return
    if params.bad_words or repeats or (params.end_id is not None
                                       and output_len < params.min_tokens):
        before = row.clone()
        mask_banned(row, params, output_len, history, repeats)
        if not bool(torch.isfinite(row).any()):  # the grammar's / allowed set's choices stand
            row.copy_(before)


def mask_banned(
    row: torch.Tensor, params: SamplingParams, output_len: int, history: Sequence[int],
    repeats: Collection[int] = (),
) -> None:
    """In place on one row of logits [V]: -inf for the end id before min_tokens, bad words
    and the tokens that would repeat an n-gram (`repeats`)."""
    V = row.shape[0]
    if repeats:
        ids = [t for t in repeats if 0 <= t < V]
        row[torch.tensor(ids, dtype=torch.long)] = float("-inf")
    if params.end_id is not None and output_len < params.min_tokens and 0 <= params.end_id < V:
        row[params.end_id] = float("-inf")
    for word in params.bad_words:
        if len(word) == 1 or _ends_with(history, word[:-1]):
            if 0 <= word[-1] < V:
                row[word[-1]] = float("-inf")


def filtered_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k, top-p and min-p over rows of logits [N, V].

    Returns (probs [N, V] over tokens sorted by decreasing logit, order [N, V]: the token id of
    each sorted position). Filtered tokens have probability 0.
    """
    N, V = logits.shape
    device = logits.device
    # A tiny temperature must not overflow logits / temperature into inf - inf = nan.
    temperature = torch.tensor([max(p.temperature, MIN_TEMPERATURE) for p in params], device=device)
    temperature = temperature.unsqueeze(1)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=device)
    # top_p = 1 keeps everything; rounding in the cumulative sum must not drop the tail.
    top_p = torch.tensor([p.top_p if p.top_p < 1 else 2.0 for p in params], device=device)
    top_p = top_p.unsqueeze(1)
    # stable: equal logits keep id order, so the kept set matches argmax's tie-breaking.
    # (logits near the float range, as `settle` leaves extreme biases, stay finite)
    scaled = torch.nan_to_num(logits / temperature, nan=-math.inf,
                              posinf=torch.finfo(logits.dtype).max, neginf=-math.inf)
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    ranks = torch.arange(V, device=device).expand(N, V)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens before it already reach top_p (the first one always stays,
    # also where a top_p below float32's range reads as 0).
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill((mass_before >= top_p) & (ranks > 0), 0.0)
    min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
    probs = probs.masked_fill(probs < min_p * probs[:, :1], 0.0)  # column 0: the likeliest
    return probs / probs.sum(dim=-1, keepdim=True), order


def match_stop(output_ids: Sequence[int], stop_words: Sequence[Sequence[int]]) -> bool:
    """True when the generated ids end with one of the stop words."""
    return any(_ends_with(output_ids, word) for word in stop_words if word)


def finish_reason(output_ids: Sequence[int], params: SamplingParams) -> str | None:
    """Why a request ends after its latest token ("eos", "stop", "length"), or None to go on.

    `output_ids` are the generated ids only. end_id and stop words count from min_tokens on.
    """
    num_output = len(output_ids)
    if num_output >= params.min_tokens and num_output > 0:
        if params.end_id is not None and output_ids[-1] == params.end_id:
            return "eos"
        if match_stop(output_ids, params.stop_words):
            return "stop"
    if num_output >= params.max_tokens:
        return "length"
    return None


def _ends_with(ids: Sequence[int], suffix: Sequence[int]) -> bool:
    n = len(suffix)
    if n == 0:
        return True
    return len(ids) >= n and list(ids[-n:]) == list(suffix)
