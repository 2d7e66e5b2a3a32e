"""Beam search: which continuations of a request's beams survive each step.

`BeamSearch` is the per-request bookkeeping, on plain tensors and lists (the scheduler runs
the beams as sequences and moves their KV and states, `Scheduler._beam_advance`). Its rules
are transformers' `generate(num_beams=W, do_sample=False)` (the oracle of its tests):
- a step scores every (beam, token) by the beam's summed log probability plus the token's
  (the log-softmax of the beam's logits after logit bias, penalties, min_tokens and bad words;
  the first step has one beam, the prompt) and keeps the 2W best candidates;
- a candidate that ends its beam (end id, stop word, max_tokens, the context limit) among the
  W best becomes a finished hypothesis scored sum / generated_length ** length_penalty
  (generated length counting the end id); the W best finished hypotheses are kept;
- the W best candidates that do not end are the next step's beams;
- it stops when no candidate goes on, when W hypotheses finished and either
  `early_stopping` is set or the best running beam, scored at its current length, cannot beat
  the worst of them (transformers' default heuristic; with it, no hypothesis is added after
  that point).
Temperature, top_k, top_p and seeds do not apply: beam search is deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from backend.engine.request import BeamOutput, SamplingParams
from backend.engine.sampling import finish_reason


def length_normalized(score: float, length: int, penalty: float) -> float:
    """A hypothesis' score: its summed log probabilities / length ** length_penalty (as
    transformers'). A divisor beyond the float range (an extreme length_penalty) counts as
    infinite or as the smallest float, so the score saturates (0 or -inf) instead of
    raising."""
    try:
        divisor = length ** penalty
    except OverflowError:
        divisor = math.inf
    return score / max(divisor, math.ulp(0.0))


@dataclass
class Hypothesis:
    tokens: list[int]  # generated ids, the end id included when it ended the beam
    log_probs: list[float]
    score: float
    reason: str
    logits: list[torch.Tensor] = field(default_factory=list)  # per token, when recorded


class BeamSearch:
    def __init__(self, params: SamplingParams, num_prompt_tokens: int,
                 max_context_len: int) -> None:
        self.params = params
        self.width = params.beam_width
        self.num_prompt_tokens = num_prompt_tokens
        self.max_context_len = max_context_len
        self.reset()

    def reset(self) -> None:
        """Back to the prompt (a preempted request starts its search again)."""
        self.scores: list[float] = [0.0]  # per running beam: summed log probabilities
        self.histories: list[list[int]] = [[]]  # per running beam: generated ids
        self.log_probs: list[list[float]] = [[]]  # ... and the model's log probability of each
        self.logits: list[list[torch.Tensor]] = [[]]  # ... and its raw logits, when recorded
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self.improvable = True
        self.done = False

    @property
    def num_generated(self) -> int:
        return len(self.histories[0]) if self.histories else 0

    def step(self, log_probs: torch.Tensor, raw: torch.Tensor | None = None,
             logits: torch.Tensor | None = None) -> list[tuple[int, int]]:
        """One step over the running beams' next-token log probabilities [n, V] (adjusted;
        `raw`: the model's own, recorded per token when the request returns them; `logits`:
        the model's raw logits [n, V], recorded per token likewise). Returns
        the next beams as (parent beam, token), best first; `done` says whether the search
        ended (then the result is `outputs()`)."""
        n, V = log_probs.shape
        if n != len(self.scores):
            raise ValueError(f"beam search has {len(self.scores)} beams, got {n} rows")
        W = self.width
        total = log_probs.float() + torch.tensor(self.scores, dtype=torch.float32)[:, None]
        top, index = torch.topk(total.flatten(), min(2 * W, n * V))
        length = self.num_generated + 1
        penalty = self.params.length_penalty

        def with_log_prob(parent: int, token: int) -> list[float]:
            """The parent's log probabilities and, where recorded, the token's."""
            own = [float(raw[parent, token])] if raw is not None else []
            return self.log_probs[parent] + own

        def with_logits(parent: int) -> list[torch.Tensor]:
            return self.logits[parent] + ([logits[parent]] if logits is not None else [])

        nxt: list[tuple[int, int, float]] = []
        added: list[Hypothesis] = []
        full = len(self.finished) == W and self.params.early_stopping
        for rank, (score, flat) in enumerate(zip(top.tolist(), index.tolist())):
            if score == -math.inf:
                break
            parent, token = divmod(flat, V)
            history = self.histories[parent] + [token]
            reason = finish_reason(history, self.params)
            if reason is None and self.num_prompt_tokens + length >= self.max_context_len:
                reason = "length"
            if reason is None:
                if len(nxt) < W:
                    nxt.append((parent, token, score))
                continue
            if rank < W and self.improvable and not full:
                added.append(Hypothesis(history, with_log_prob(parent, token),
                                        length_normalized(score, length, penalty), reason,
                                        with_logits(parent)))
        if added:
            merged = self.finished + added  # stable: on equal scores the earlier one stays
            self.finished = sorted(merged, key=lambda h: -h.score)[:W]
        self.histories = [self.histories[p] + [t] for p, t, _ in nxt]
        self.log_probs = [with_log_prob(p, t) for p, t, _ in nxt]
        self.logits = [with_logits(p) for p, _, _ in nxt]
        self.scores = [s for _, _, s in nxt]
        if len(self.finished) == W and nxt:
            best = length_normalized(self.scores[0], length, penalty)
            self.improvable = self.improvable and best > self.finished[-1].score
        self.done = (not nxt or not self.improvable
                     or (len(self.finished) == W and self.params.early_stopping))
        return [(p, t) for p, t, _ in nxt]

    def running(self) -> list[BeamOutput]:
        """The running beams so far, best first (what a streamed beam search sends at each
        step): their ids, log probabilities (where recorded), scores at their current length
        and finish_reason "". Their logits are not copied (the final outputs carry them)."""
        length, penalty = max(1, self.num_generated), self.params.length_penalty
        return [BeamOutput(list(h), list(lp), float(sum(lp)),
                           length_normalized(s, length, penalty), "")
                for h, lp, s in zip(self.histories, self.log_probs, self.scores)]

    def outputs(self) -> list[BeamOutput]:
        """The finished beams, best first (the running ones, as `length`, where none
        finished)."""
        hyps = self.finished or [
            Hypothesis(h, lp, length_normalized(s, max(1, len(h)), self.params.length_penalty),
                       "length", lg)
            for h, lp, s, lg in zip(self.histories, self.log_probs, self.scores, self.logits)]
        outs = []
        for h in hyps:
            tokens, lps, logits = h.tokens, h.log_probs, h.logits
            if h.reason == "eos":  # the end id is not output
                tokens = tokens[:-1]
                lps, logits = lps[:len(tokens)], logits[:len(tokens)]
            outs.append(BeamOutput(list(tokens), list(lps), float(sum(lps)), h.score, h.reason,
                                   torch.stack(logits) if logits else None))
        return outs


@dataclass(eq=False)
class BeamGroup:
    """The sequences one beam-search request runs as: `leader` prefills the prompt, the
    others are forked from it after the first step; `beams[i]` is running beam i of
    `search`. `reserved` holds the run slots set aside for beams at admission."""

    leader: object  # Sequence
    search: BeamSearch
    beams: list = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
