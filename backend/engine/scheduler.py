"""Continuous batching: FCFS admission or longest cached prefix first (`schedule_policy`; a
request whose cached pages are still being read from SSD, or are being prefilled by a running
request, stays queued while others run),
chunked prefill under a per-step token budget mixed with decode steps, sampling, stop rules,
preemption by recompute when pages run out.

One `step()` = schedule -> (replay) -> forward -> sample, on the engine thread; its outputs go
to their clients before `after_outputs()` runs the step's cache work (the layer-wise offload's
tail, inserting new pages and states, releasing finished requests), so a request's first token
never waits for the store. Both run before the next step is planned.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from backend.cache.radix import TOKEN_BYTES
from backend.engine.beam import BeamGroup
from backend.engine.cache_manager import CacheManager
from backend.engine.config import EngineConfig
from backend.engine.executor import TorchExecutor
from backend.engine.request import RequestOutput
from backend.engine.sampling import (
    adjusted_log_probs,
    finish_reason,
    make_generator,
    sample,
    scored_log_probs,
)
from backend.engine.sequence import SeqStatus, Sequence
from backend.engine.speculative import DraftPolicy, NgramDrafter, Prediction, SuffixCorpus
from backend.engine.transfers import LayerTransfers
from backend.model import SeqInput
from backend.model.batch import SNAPSHOT_ALIGN
from backend.model.decode import MAX_FAST_TOKENS


@dataclass
class Chunk:
    seq: Sequence
    start: int
    end: int
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (position, saved slot)
    # Speculative tokens computed after [start, end) (end: the sequence's length); each is
    # verified against the token sampled before it.
    draft: list[int] = field(default_factory=list)


# Budget-cut prefill chunks of at least this many tokens end on a SNAPSHOT_ALIGN boundary when
# the prompt has states planned further on (`_plan`).
ALIGN_MIN_CHUNK = 4 * SNAPSHOT_ALIGN
# A queued request whose pages are still being read from SSD (after `_read_wait`) waits at
# most this many steps for them while others run; then the engine waits for the rest.
MAX_ADMISSION_DEFERRALS = 64
# A queued request waits for a running request's prefill (`_waits_for_prefill`) when that
# prefill computes at least this many pages of its prompt that the store does not hold yet,
# for at most MAX_PREFILL_WAITS steps.
MIN_SHARED_PAGES = 2
MAX_PREFILL_WAITS = 128
# schedule_policy "lpm" orders at most this many waiting requests by their cached prefix.
LPM_MAX_QUEUE = 128


def common_pages(a: bytes, b: bytes, page_bytes: int) -> int:
    """The number of whole pages (of `page_bytes`) two encoded token sequences share from
    their start (a binary search over prefix comparisons)."""
    va, vb = memoryview(a), memoryview(b)
    lo, hi = 0, min(len(a), len(b)) // page_bytes
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if va[:mid * page_bytes] == vb[:mid * page_bytes]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Scheduler:
    def __init__(self, config: EngineConfig, cache: CacheManager, executor: TorchExecutor) -> None:
        self.config = config
        self.cache = cache
        self.executor = executor
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(config.max_num_seqs))
        self.num_preemptions = 0
        self.num_stalls = 0  # steps no row could get a page for (a request was preempted)
        self.num_forced_tokens = 0  # tokens a guide forced, appended without a step each
        self.drafter = None
        # Drafts need the eager executor (a compiled step returns one position's logits): a
        # request's prediction is a hint a compiled engine does without.
        self.predicting = config.executor == "torch"
        self.draft_policy = DraftPolicy(config.num_speculative_tokens)
        if config.speculative_method in ("ngram", "suffix"):
            corpus = SuffixCorpus(config.prompt_lookup_min, config.prompt_lookup_max,
                                  config.suffix_cache_tokens) \
                if config.speculative_method == "suffix" else None
            self.drafter = NgramDrafter(config.num_speculative_tokens, config.prompt_lookup_min,
                                        config.prompt_lookup_max, corpus)
        self.num_draft_tokens = 0  # speculative tokens verified
        self.num_accepted_tokens = 0  # ... and kept (each a token without a step of its own)
        self.num_rewinds = 0  # rejected drafts whose states the executor rebuilt
        self.num_beam_forks = 0  # beams that took another beam's history ...
        self.num_beam_pages_copied = 0  # ... and the pages copied for them
        self.num_steps = 0
        self.num_finished = 0
        self.num_prefill_waits = 0  # steps queued requests waited for a running prefill
        self.last_step_seconds = 0.0  # wall time of the last step that ran a forward
        # The step's cache work, run by after_outputs() once its outputs are delivered.
        self._after: list[Callable[[], None]] = []
        # Beam searches' next beams, set up before the next step is planned (`_beam_advance`).
        self._beam_pending: list[tuple[BeamGroup, list[tuple[int, int]]]] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # One iteration ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration up to sampling; the caller delivers the outputs and then calls
        `after_outputs()` (a step also runs any cache work a caller left pending)."""
        self.after_outputs()
        pending, self._beam_pending = self._beam_pending, []
        for group, selection in pending:
            if group.leader.status is SeqStatus.RUNNING:  # not preempted or cancelled since
                self._beam_advance(group, selection)
        outputs: list[RequestOutput] = []
        start = time.perf_counter()
        if self.config.schedule_policy == "lpm":
            self._longest_prefix_first()
        self._by_priority()
        self._look_ahead()
        self._admit()
        chunks = self._plan()
        if not chunks:
            return outputs
        # A step of decoding rows only (no prompt chunk): its time tells what verifying
        # drafts of its length costs at its number of rows.
        decoding = (self.drafter is not None or self.predicting) and all(
            c.end == len(c.seq.tokens) and c.seq.num_output_tokens for c in chunks)
        logits = self._forward(chunks)
        self.num_steps += 1
        done = [c for c in chunks if c.end == len(c.seq.tokens)]
        for c in chunks:
            c.seq.num_computed = c.end
            if not c.draft:  # a draft's states are settled after sampling (`_settle`)
                self.cache.after_forward(c.seq)
            if c.end < len(c.seq.tokens):
                # A prefill chunk that is not the prompt's last: its whole pages join the
                # store after this step, so requests admitted from the next step on share
                # them (as vLLM's block hashing and SGLang's cache_unfinished_req do).
                self._after.append(partial(self.cache.insert, c.seq, c.end, with_states=False))
        plain = [c for c in done if c.seq.beam is None]
        if plain:
            rows = [chunks.index(c) for c in plain]
            drafts = [c.draft for c in plain] if any(c.draft for c in plain) else None
            sampled = self._sample([c.seq for c in plain], logits[rows], drafts)
            outputs.extend(sampled)
            if drafts is not None:
                finished = {id(c.seq) for c, out in zip(plain, sampled) if out.finished}
                self._settle([(chunks.index(c), c) for c in plain if c.draft], finished)
        if len(plain) < len(done):
            outputs.extend(self._beam_steps(chunks, [c for c in done if c.seq.beam], logits))
        self.last_step_seconds = time.perf_counter() - start
        if decoding:
            self.draft_policy.record(len(chunks), max(c.end + len(c.draft) - c.start
                                                      for c in chunks), self.last_step_seconds)
        return outputs

    def after_outputs(self) -> None:
        """The last step's cache work, in order: the offload's remaining layers, new pages and
        states into the store, finished requests released. Work that raises is dropped (the
        caller fails the running requests, which releases what they hold)."""
        work, self._after = self._after, []
        for fn in work:
            fn()

    def drop_after(self) -> None:
        """Forgets the pending cache work (a failed step: its requests are released)."""
        self._after, self._beam_pending = [], []

    def _longest_prefix_first(self) -> None:
        """Orders the waiting requests by cached prefix, longest first (stable: ties keep
        their queue order); a queue longer than LPM_MAX_QUEUE keeps its order (matching
        every prompt each step would cost more than the order saves, as in SGLang).
        Requests that have waited `lpm_max_wait_s` or longer come first, in queue order: the
        cache-aware order never starves a request without a cached prefix."""
        if not self.free_slots or not 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            return
        deadline = time.perf_counter() - self.config.lpm_max_wait_s
        aged = [s for s in self.waiting if s.arrival <= deadline]
        rest = [s for s in self.waiting if s.arrival > deadline]
        cached = {id(s): self.cache.cached_pages(s) for s in rest}
        self.waiting = deque(aged + sorted(rest, key=lambda s: -cached[id(s)]))

    def _by_priority(self) -> None:
        """Orders the waiting requests by urgency, lower first (stable: equal ones keep the
        policy's order); nothing to do where their priorities are all equal."""
        if len(self.waiting) > 1 and len({s.request.priority for s in self.waiting}) > 1:
            now = time.perf_counter()
            self.waiting = deque(sorted(self.waiting, key=lambda s: self.urgency(s, now)))

    def urgency(self, seq: Sequence, now: float) -> int:
        """A request's priority (lower: more urgent), one level lower for each
        `priority_aging_s` since it arrived (a preempted one keeps its arrival): it orders
        the queue and decides who gives up a slot or pages to whom."""
        aging = self.config.priority_aging_s
        if aging <= 0:
            return seq.request.priority
        return seq.request.priority - int((now - seq.arrival) // aging)

    def _preemption_order(self, now: float) -> Callable[[Sequence], tuple[int, float]]:
        """The key whose maximum is preempted: the least urgent, then the youngest."""
        return lambda seq: (self.urgency(seq, now), seq.arrival)

    def _less_urgent(self, seq: Sequence, spare: Container[Sequence] = ()) -> list[Sequence]:
        """The running requests `seq` may take a slot from: the less urgent ones, but `spare`
        (beam searches neither take nor give up slots this way)."""
        if seq.beam is not None:
            return []
        now = time.perf_counter()
        level = self.urgency(seq, now)
        return [s for s in self.running if s.beam is None and s not in spare
                and self.urgency(s, now) > level]

    def _look_ahead(self) -> None:
        """Protects (and, with tiers, prefetches) the pages of the first W waiting requests."""
        waiting = [(s.prefix_key(), s.salt) for s in self.waiting]
        if self.cache.tiers is not None:
            self.cache.tiers.prefetcher.update(waiting)
        else:  # (an empty queue too: the last waiting requests' protection ends)
            self.cache.store.protect(waiting)

    def _admit(self) -> None:
        replays: list[tuple[int, torch.Tensor, int]] = []
        replayed: list[Sequence] = []
        deferred: list[Sequence] = []
        admitted: set[Sequence] = set()  # this step's: their replays are queued below
        while self.waiting and (self.free_slots
                                or self._less_urgent(self.waiting[0], admitted)):
            seq = self.waiting.popleft()
            if self.running and seq.admission_deferrals < MAX_ADMISSION_DEFERRALS and \
                    self.cache.reads_pending(seq, self._read_wait()):
                # Its pages are still on their way from SSD: it stays queued while the
                # running requests step (PCR's queue-time prefetch) rather than all of them
                # waiting for the disk.
                seq.admission_deferrals += 1
                deferred.append(seq)
                continue
            if self._waits_for_prefill(seq):
                seq.prefill_waits += 1
                self.num_prefill_waits += 1
                deferred.append(seq)
                continue
            if not self.free_slots:
                # No free slot, but a running request is less urgent: the least urgent (the
                # youngest among equals) gives its slot up and queues again behind the more
                # urgent ones (it recomputes from its cached pages when it comes back).
                self._preempt(max(self._less_urgent(seq, admitted),
                                  key=self._preemption_order(time.perf_counter())))
                self._by_priority()
            if seq.beam is not None:
                if len(self.free_slots) < seq.beam.search.width:
                    deferred.append(seq)  # its beams' slots: the requests after it wait too
                    break
                seq.beam.reserved = [self.free_slots.pop()
                                     for _ in range(seq.beam.search.width - 1)]
            seq.run_slot = self.free_slots.pop()
            queued = len(replays)
            try:
                if seq.generator is None:
                    seq.generator = make_generator(seq.request.sampling.seed)
                self.cache.admit(seq, replays)
            except Exception:
                # Back in the queue, holding nothing: the failed step's cleanup ends it with
                # an error (a request in neither queue would never get its final output, and
                # its run slot would be lost).
                del replays[queued:]
                self.cache.release(seq, cache=False)
                self.free_slots.append(seq.run_slot)
                seq.run_slot = None
                if seq.beam is not None:
                    self.free_slots.extend(seq.beam.reserved)
                    seq.beam.reserved = []
                self.waiting.appendleft(seq)
                self.waiting.extendleft(reversed(deferred))
                raise
            if len(replays) > queued:
                replayed.append(seq)
            seq.status = SeqStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            seq.shared_pages.clear()
            self.running.append(seq)
            admitted.add(seq)
        self.waiting.extendleft(reversed(deferred))
        if replays:
            slots, rows, adapters = zip(*replays)
            self.executor.replay(list(slots), list(rows), list(adapters))
            for seq in replayed:
                self.cache.keep_replayed(seq)

    def _waits_for_prefill(self, seq: Sequence) -> bool:
        """Whether the queued `seq` should wait for a running request that is prefilling
        at least MIN_SHARED_PAGES pages of its prompt the store does not hold yet: they join
        the store after the chunk that computes them, and `seq` then resumes from them (a
        replay) instead of computing them a second time in the same steps. Same-prompt bursts
        (a system prompt at a cold start, retries, RAG queries over the same documents)
        prefill their common part once; SGLang checks requests it batches together the same
        way. Suffix replay only: its pages join with their anchors after every chunk, while
        the checkpoint policy's states join at the prompt's end."""
        if not self.config.share_running_prefills or self.cache.policy != "suffixreplay" \
                or seq.prefill_waits >= MAX_PREFILL_WAITS or seq.request.needs_prompt_logits:
            return False
        key, salt = seq.prefix_key(), seq.salt
        page_bytes = self.config.page_size * TOKEN_BYTES
        cached = None
        for run in self.running:
            if run.prefix_inserted or run.salt != salt or \
                    run.num_computed >= len(run.tokens) - 1:
                continue  # not prefilling a prompt, or another cache namespace
            shared = seq.shared_pages.get(run)
            if shared is None:  # both prompts stay as they are: compared once
                shared = seq.shared_pages[run] = common_pages(key, run.prefix_key(), page_bytes)
            if shared - run.num_tree_pages < MIN_SHARED_PAGES:
                continue
            if cached is None:
                cached = self.cache.cached_pages(seq)
            if shared - cached >= MIN_SHARED_PAGES:
                return True
        return False

    def _read_wait(self) -> float:
        """How long admission may wait for a request's SSD reads before deferring it: a wait
        of w delays the running requests and this one (n + 1 waits of w); deferring delays
        it by about one step, so the break-even is the last step's time over n + 1."""
        return self.last_step_seconds / (len(self.running) + 1)

    def _plan(self) -> list[Chunk]:
        """The step's chunks. Where no row could get a page (every running request is
        prefilling, e.g. a preempted one computing its tokens again beside a new prompt,
        and their own pages fill the pool: decode rows preempt in `_grow`, prefill rows do
        not), the least urgent (the youngest among equals) is preempted and the step planned
        again, so the others go on (every step empty, forever, before); one request alone
        fits the pool (`Engine.validate`)."""
        while True:
            chunks = self._plan_once()
            if chunks or len(self.running) < 2:
                return chunks
            self._preempt(max(self.running, key=self._preemption_order(time.perf_counter())))
            self.num_stalls += 1

    def _plan_once(self) -> list[Chunk]:
        budget = self.config.max_tokens_per_step
        chunks: list[Chunk] = []
        decodes = [s for s in self.running if s.num_computed == len(s.tokens) - 1]
        prefills = [s for s in self.running if s.num_computed < len(s.tokens) - 1]
        for seq in decodes:
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted while planning this step
            end = self._grow(seq, seq.num_computed + 1)
            if end is not None and seq.status is SeqStatus.RUNNING:
                chunks.append(Chunk(seq, seq.num_computed, end))
                budget -= 1
        chunks = [c for c in chunks if c.seq.status is SeqStatus.RUNNING]
        for seq in prefills:
            if budget <= 0 or seq.status is not SeqStatus.RUNNING:
                continue
            end = min(len(seq.tokens), seq.num_computed + budget)
            if end < len(seq.tokens) and end - seq.num_computed >= ALIGN_MIN_CHUNK and \
                    any(p > end for p in seq.capture_positions):
                # A long chunk cut by the budget before a planned state ends on a chunk
                # boundary of the delta rule (giving up < 1/4 of it), so the next chunk starts
                # on one and saves that state on its way: from an unaligned start it would be
                # cut short there, a step of a few tokens.
                end = end // SNAPSHOT_ALIGN * SNAPSHOT_ALIGN
            end = self.cache.ensure_pages(seq, end)
            end, snapshots = self.cache.plan_snapshots(seq, seq.num_computed, end)
            if end > seq.num_computed:
                chunks.append(Chunk(seq, seq.num_computed, end, snapshots))
                budget -= end - seq.num_computed
        if budget > 0 and (self.drafter is not None or self.predicting and any(
                c.seq.request.prediction for c in chunks)):
            self._draft(chunks, budget)
        return chunks

    def _draft(self, chunks: list[Chunk], budget: int) -> None:
        """Speculative drafts for the chunks that compute a generating sequence's last tokens
        (within the step's remaining budget, each request's max_tokens, the context and the
        pages to be had without preempting anyone, and the next position whose state is
        saved: `CacheManager.draft_room`), cut to the length `DraftPolicy` finds worth its
        cost: from the request's prediction where it has one that proposes, else
        from the engine's drafter."""
        proposals = []
        for c in chunks:
            seq = c.seq
            if c.end != len(seq.tokens) or seq.num_output_tokens == 0 or seq.beam:
                continue  # a prompt's chunks (its last one samples the first token); beams
            if c.snapshots or c.end - c.start > MAX_FAST_TOKENS:
                continue  # a long chunk (a preempted sequence computing its tokens again)
                # cannot rewind a rejected draft: it would compute the whole chunk twice
            limit = min(seq.request.sampling.max_tokens - seq.num_output_tokens - 1,
                        self.config.max_context_len - len(seq.tokens) - 1)
            draft = []
            if seq.request.prediction and self.predicting:
                if seq.prediction is None:
                    seq.prediction = Prediction(seq.request.prediction,
                                                self.config.prompt_lookup_min)
                draft = seq.prediction.propose(seq.output_ids,
                                               min(self.config.num_speculative_tokens, limit))
            if not draft and self.drafter is not None:
                draft = self.drafter.propose(seq, limit)
            if draft:
                proposals.append((c, draft))
        if not proposals:
            return
        cap = self.config.num_speculative_tokens
        if self.config.speculative_adaptive:
            policy = self.draft_policy
            cap = policy.choose(len(chunks), [(len(d), policy.accept_rate(c.seq))
                                              for c, d in proposals])
        for c, draft in proposals:
            room = self.cache.draft_room(c.end)
            draft = draft[:min(cap, budget, room if room is not None else cap)]
            if draft:
                covered = self.cache.ensure_pages(c.seq, c.end + len(draft))
                draft = draft[:covered - c.end]
            c.draft = draft
            budget -= len(draft)

    def _settle(self, chunks: list[tuple[int, Chunk]], finished: set[int]) -> None:
        """After sampling a speculative step's (row, chunk)s: a sequence whose tokens now
        start with its whole draft has computed it (its states are past it, where a step a
        token would have left them). One that rejected a draft token keeps the tokens before
        it: the executor rebuilds its states after them from the states before the step
        (`rewind`: the step's recurrences, stopped there), or where it cannot, gives the
        states before the step back and the sequence computes those tokens again in its next
        step (their KV and anchors are rewritten the same). A sequence that `finished` keeps
        the KV of every token it kept, and the state of a draft kept whole (drafts end at
        the next position whose state is saved: `CacheManager.draft_room`); a rejected
        draft's states are not used again."""
        rewind = []
        for row, c in chunks:
            seq = c.seq
            kept = 0
            while kept < len(c.draft) and c.end + kept < len(seq.tokens) and \
                    seq.tokens[c.end + kept] == c.draft[kept]:
                kept += 1
            self.num_draft_tokens += len(c.draft)
            seq.draft_tokens += len(c.draft)
            self.num_accepted_tokens += kept
            self.draft_policy.settled(seq, kept, kept < len(c.draft))
            if kept == len(c.draft) or id(seq) in finished:
                seq.num_computed = c.end + kept
                if kept == len(c.draft):
                    self.cache.after_forward(seq, caught_up=True)
            else:
                rewind.append((row, c, kept))
        if not rewind:
            return
        done = self.executor.rewind([(row, c.seq.run_slot, c.end - c.start + kept)
                                     for row, c, kept in rewind])
        restore = []
        for row, c, kept in rewind:
            if row in done:
                c.seq.num_computed = c.end + kept
                self.cache.after_forward(c.seq, caught_up=True)
            else:
                c.seq.num_computed = c.start
                restore.append(c.seq.run_slot)
        if restore:
            self.executor.restore_states(restore)
        self.num_rewinds += len(done)

    def _grow(self, seq: Sequence, end: int) -> int | None:
        """Pages for a decode step; preempts a sequence when none are free: the least
        urgent (`urgency`: the highest priority value, aged), the youngest among equals,
        `seq` itself where that is it (an older request of the same priority is not
        preempted for a younger one, as vLLM's)."""
        while self.cache.ensure_pages(seq, end) < end:
            victims = [s for s in self.running
                       if s is not seq and (seq.beam is None or s.beam is not seq.beam)]
            order = self._preemption_order(time.perf_counter())
            victim = max(victims, key=order) if victims else None
            if victim is None or order(victim) < order(seq):
                self._preempt(seq)
                return None
            self._preempt(victim)
        return end

    def _preempt(self, seq: Sequence) -> None:
        """Releases everything; the sequence re-enters the queue and recomputes (its pages
        were inserted, so it will mostly hit). A beam search restarts from its prompt."""
        if seq.beam is not None:
            self._preempt_beams(seq.beam)
            return
        self.cache.release(seq, cache=True)
        self.running.remove(seq)
        self.free_slots.append(seq.run_slot)
        seq.run_slot, seq.num_computed, seq.status = None, 0, SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _forward(self, chunks: list[Chunk]) -> torch.Tensor:
        seqs, src, dst, snapshots = [], [], [], []
        T = max(c.end + len(c.draft) - c.start for c in chunks)
        for b, c in enumerate(chunks):
            table = torch.tensor(c.seq.page_table)
            seqs.append(SeqInput(c.seq.tokens[c.start:c.end] + c.draft, c.start, table,
                                 c.seq.run_slot, c.seq.adapter))
            snapshots += [(b, pos - c.start, slot) for pos, slot in c.snapshots]
            plan = self.cache.capture_plan(c.seq, c.start, c.end + len(c.draft))
            if plan is not None:
                src.append(plan[0] + b * T)
                dst.append(plan[1])
        transfers = None
        if self.cache.tiers is not None:
            pages = [p for c in chunks for p in self.cache.offload_pages(c.seq, c.end)]
            transfers = LayerTransfers(self.cache.tiers, pages)
        capture = (torch.cat(src), torch.cat(dst)) if src else (None, None)
        extra = {}
        drafts = any(c.draft for c in chunks)
        context = [c.seq.wants_context_logits and c.start < c.seq.num_prompt_tokens
                   for c in chunks]
        if drafts or any(context):
            # speculative: logits at each draft token too; context logits: at every position
            extra["num_logits"] = [c.end - c.start if ctx else 1 + len(c.draft)
                                   for c, ctx in zip(chunks, context)]
            extra["log_states"] = drafts
        if drafts:
            self.executor.stash_states([c.seq.run_slot for c in chunks if c.draft])
        logits = self.executor.forward(seqs, *capture, layer_hooks=transfers,
                                       snapshots=snapshots, **extra)
        if transfers is not None:  # the rest of the copies after the outputs
            self._after.append(transfers.finish)
        if any(context):
            logits = self._take_context_logits(chunks, context, logits)
        return logits

    @staticmethod
    def _take_context_logits(chunks: list[Chunk], context: list[bool],
                             logits: torch.Tensor) -> torch.Tensor:
        """Keeps the prompt positions' logits of the `context` rows (a sequence restarting
        its prompt from 0 starts over) and returns the step's logits as without them: [B, V],
        or [B, L, V] from each row's last computed token on when the step has drafts."""
        if logits.dim() == 2:
            logits = logits.unsqueeze(1)
        for b, (c, ctx) in enumerate(zip(chunks, context)):
            if ctx:
                seq = c.seq
                take = min(c.end, seq.num_prompt_tokens) - c.start
                if seq.request.return_context_logits:
                    if c.start == 0 or seq.context_rows is None:
                        seq.context_rows = []
                    seq.context_rows.append(logits[b, :take].clone())
                if seq.request.return_prompt_log_probs:
                    if c.start == 0 or seq.prompt_scores is None:
                        seq.prompt_scores = []
                    seq.prompt_scores.append(_prompt_scores(seq, c.start, logits[b, :take]))
        L = 1 + max(len(c.draft) for c in chunks)
        out = logits.new_zeros(len(chunks), L, logits.shape[-1])
        for b, (c, ctx) in enumerate(zip(chunks, context)):
            start = c.end - c.start - 1 if ctx else 0
            n = 1 + len(c.draft)
            out[b, :n] = logits[b, start:start + n]
        return out[:, 0] if L == 1 else out

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor,
                drafts: list[list[int]] | None = None) -> list[RequestOutput]:
        """Samples each sequence's next token from logits [B, V]; with `drafts`, logits
        [B, L, V] hold row b's logits after its last computed token and after each of its
        draft tokens: a row goes on to its next position while the token it drew equals the
        draft's (and it does not finish), so it emits the tokens a step a token would have
        drawn, from the same distributions, in one step."""
        if logits.dim() == 2:
            logits = logits.unsqueeze(1)
        drafts = drafts or [[] for _ in seqs]
        emitted: list[list[int]] = [[] for _ in seqs]
        log_probs: list[list[float]] = [[] for _ in seqs]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in seqs]
        kept: list[list[torch.Tensor]] = [[] for _ in seqs]  # generation logits asked for
        reasons: list[str | None] = [None] * len(seqs)
        errors: list[str | None] = [None] * len(seqs)
        now = time.perf_counter()
        first = [s.first_token_time is None for s in seqs]
        active = list(range(len(seqs)))
        for i in range(logits.shape[1]):
            rows, active = active, []
            # A token the guide forces (the only one its grammar allows) is taken, not drawn:
            # a draw would move a seeded request's generator, so the tokens after it would
            # depend on whether jump-forward appended it without a step (it does not where
            # the request returns log probabilities or logits, or is cut at a saved state's
            # position). Its log probability is scored as a drawn one's.
            forced = {r: seqs[r].guide.forced for r in rows
                      if seqs[r].guide is not None and seqs[r].guide.forced is not None}
            drawn = [r for r in rows if r not in forced]
            picks = dict(zip(drawn, zip(*self._draw([seqs[r] for r in drawn],
                                                    logits[drawn, i])))) if drawn else {}
            if forced:
                taken = list(forced)
                scored = self._score([seqs[r].request.sampling for r in taken],
                                     logits[taken, i], torch.tensor([forced[r] for r in taken]))
                picks.update(zip(taken, zip([forced[r] for r in taken], *scored)))
            # (counted where they save a step: after a token drawn in this step, as jump-
            # forward appends them)
            self.num_forced_tokens += sum(i > 0 and self._jumps(seqs[r]) for r in forced)
            for r in rows:
                token, lp, top = picks[r]
                seq = seqs[r]
                if i == 0 and not seq.prefix_inserted:
                    self._after.append(partial(self._insert_prompt, seq, len(seq.tokens)))
                if seq.first_token_time is None:
                    seq.first_token_time = now
                seq.last_token_time = now
                seq.tokens.append(token)
                if seq.guide is not None:
                    try:
                        seq.guide.accept(token)
                    except ValueError as exc:  # a grammar fault: this request fails, not the step
                        errors[r] = f"guided decoding: {exc}"
                reason = reasons[r] = "error" if errors[r] else self._finish_reason(seq)
                if reason not in ("eos", "error"):  # an end id is not output
                    emitted[r].append(token)
                    if lp is not None:
                        log_probs[r].append(lp)
                    if top is not None:
                        tops[r].append(top)
                    if seq.request.return_generation_logits:
                        kept[r].append(logits[r, i])
                if reason is None and i < len(drafts[r]) and token == drafts[r][i]:
                    active.append(r)  # the draft's token: its logits are next
        outputs = []
        for r, seq in enumerate(seqs):
            reason = reasons[r]
            if reason is None and self._jumps(seq):
                reason = self._jump_forward(seq, emitted[r])
            if reason is not None:
                self._after.append(partial(self._finish, seq))
            out = seq.output(emitted[r], reason is not None, reason, errors[r])
            if seq.request.sampling.return_log_probs:
                seq.cum_log_prob += sum(log_probs[r])
                out.log_probs = log_probs[r]
                out.cum_log_prob = seq.cum_log_prob
                out.top_log_probs = tops[r]
            if first[r] and seq.request.return_first_logits:
                out.first_logits = logits[r, 0].clone()
            if seq.request.return_generation_logits:
                out.generation_logits = torch.stack(kept[r]) if kept[r] else \
                    logits.new_zeros(0, logits.shape[-1])
            outputs.append(out)
        return outputs

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor
              ) -> tuple[list[int], list, list]:
        """One token per row from logits [B, V] (penalties, guides and the sampling
        parameters applied), its log probability for rows that return them (else None) and
        the row's likeliest alternatives [(id, log probability)] for rows that ask for
        top_log_probs (else None)."""
        params = [s.request.sampling for s in seqs]
        counts = None
        if any(p.penalized for p in params):
            counts = [s.counts(logits.shape[-1]) if p.penalized else None
                      for s, p in zip(seqs, params)]
        masks = None
        if any(s.guide is not None for s in seqs):
            masks = [s.guide for s in seqs]
        repeats = None
        if any(p.no_repeat_ngram_size for p in params):
            repeats = [s.repeat_bans() for s in seqs]
        tokens = sample(logits, params, [s.generator for s in seqs],
                        [s.num_output_tokens for s in seqs], [s.output_ids for s in seqs],
                        counts, masks, repeats)
        return (tokens.tolist(), *self._score(params, logits, tokens))

    @staticmethod
    def _score(params: list, logits: torch.Tensor, tokens: torch.Tensor
               ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
        """The chosen tokens' log probabilities (rows that return them, else None) and
        their likeliest alternatives (rows that ask for top_log_probs, else None)."""
        lps: list[float | None] = [None] * len(params)
        tops: list[list[tuple[int, float]] | None] = [None] * len(params)
        wanted = [row for row, p in enumerate(params) if p.return_log_probs]
        if wanted:
            top = max(params[row].top_log_probs for row in wanted)
            chosen, ids, values = scored_log_probs(logits[wanted], tokens[wanted], top)
            ids, values = ids.tolist(), values.tolist()
            for i, (row, value) in enumerate(zip(wanted, chosen.tolist())):
                lps[row] = value
                n = params[row].top_log_probs
                if n:
                    tops[row] = list(zip(ids[i][:n], values[i][:n]))
        return lps, tops

    def _jumps(self, seq: Sequence) -> bool:
        """Whether tokens `seq`'s guide forces are appended without a step of their own
        (jump-forward: not where the request returns per-token log probabilities or logits,
        which are a step's)."""
        return seq.guide is not None and self.config.guided_jump_forward \
            and not seq.request.sampling.return_log_probs \
            and not seq.request.return_generation_logits

    def _jump_forward(self, seq: Sequence, new_ids: list[int]) -> str | None:
        """Appends the tokens the guide forces after the one just sampled (each the only
        token its grammar allows), up to the sequence's end or the next position whose
        state is saved (`CacheManager.draft_room`: a page boundary; a chunk past it would
        not save it, and the next turn would resume a page earlier or replay); the next
        step computes them as one chunk. Returns the finish reason, if one of them ends the
        sequence."""
        reason = None
        room = self.cache.draft_room(len(seq.tokens))
        while reason is None and seq.guide.forced is not None and room != 0:
            if room is not None:
                room -= 1
            token = seq.guide.forced
            seq.tokens.append(token)
            seq.guide.accept(token)
            new_ids.append(token)
            self.num_forced_tokens += 1
            reason = self._finish_reason(seq)
        return reason

    def _insert_prompt(self, seq: Sequence, num_tokens: int) -> None:
        self.cache.insert(seq, num_tokens)
        seq.prefix_inserted = True

    def _finish_reason(self, seq: Sequence) -> str | None:
        reason = finish_reason(seq.output_ids, seq.request.sampling)
        guide = seq.guide
        if guide is not None and not guide.continues and reason != "eos":
            if guide.end_id is not None and seq.tokens[-1] == guide.end_id:
                # its end, drawn before min_tokens: the guide outranks min_tokens (its
                # end was the only token left), and an end id is not output
                reason = "eos"
            elif reason in (None, "length"):
                reason = "stop"  # the grammar is complete (on the last token max_tokens
                # allows too): only its end could follow
        if reason is None and len(seq.tokens) >= self.config.max_context_len:
            reason = "length"
        return reason

    def _finish(self, seq: Sequence) -> None:
        """A finished sequence (its last output is out) leaves the batch, also where its
        cache work fails (the step's failure then ends the others)."""
        try:
            if self.drafter is not None:
                self.drafter.learn(seq)
            self.cache.release(seq, cache=True)
        finally:
            self.running.remove(seq)
            self.free_slots.append(seq.run_slot)
            seq.status = SeqStatus.FINISHED
            self.num_finished += 1

    def time_out(self, seq: Sequence) -> RequestOutput:
        """Ends `seq` at its deadline as `stop` does, with finish_reason "timed_out", but
        its computed pages join the prefix store (as a preempted request's: a retry with more
        time hits them)."""
        return self.stop(seq, "timed_out", cache=True)

    def stop(self, seq: Sequence, reason: str = "cancelled",
             cache: bool = False) -> RequestOutput:
        """Ends `seq` between two steps as `cancel` does (a client's cancel or stop, a
        deadline): its tokens went out with earlier outputs; a beam search's final output
        carries its beams so far (the finished ones, else the running ones with `reason`,
        best first), none before its first step."""
        search = seq.beam.search if seq.beam is not None else None
        beams = None
        if search is not None and search.num_generated:
            beams = search.outputs()  # the running ones where none finished: ended early
            if not search.finished:
                beams = [replace(b, finish_reason=reason) for b in beams]
        out = self.cancel(seq, reason, cache=cache)
        if beams:
            best = beams[0]
            out.new_token_ids, out.num_output_tokens = list(best.token_ids), len(best.token_ids)
            if seq.request.sampling.return_log_probs:
                out.log_probs, out.cum_log_prob = best.log_probs, best.cum_log_prob
            out.generation_logits = best.logits
            out.beams = beams
        return out

    def cancel(self, seq: Sequence, reason: str = "cancelled",
               cache: bool = False) -> RequestOutput:
        """Ends `seq` between two steps, whatever it was doing, with no tokens in its output;
        with `cache` (not for a beam search) its computed pages are inserted first."""
        if seq.beam is not None and seq.status is SeqStatus.RUNNING:
            self._release_beams(seq.beam, cache=False)
        elif seq.status is SeqStatus.RUNNING:
            try:
                self.cache.release(seq, cache=cache)
            finally:  # out of the batch whatever the release did
                self.running.remove(seq)
                self.free_slots.append(seq.run_slot)
                seq.status = SeqStatus.FINISHED
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        return seq.output([], True, reason)

    # Beam search ------------------------------------------------------------------------
    def _beam_steps(self, chunks: list[Chunk], done: list[Chunk],
                    logits: torch.Tensor) -> list[RequestOutput]:
        """The step's beam-search rows, a request at a time (all its beams run in each
        step: they decode together, and a preemption takes the whole request)."""
        if logits.dim() == 3:  # a step with drafts (other rows): position 0 is the next token's
            logits = logits[:, 0]
        groups: dict[int, tuple[BeamGroup, dict[int, int]]] = {}
        for c in done:
            entry = groups.setdefault(id(c.seq.beam), (c.seq.beam, {}))
            entry[1][id(c.seq)] = chunks.index(c)
        outputs = []
        for group, rows in groups.values():
            missing = [s for s in group.beams if id(s) not in rows]
            if missing:
                raise RuntimeError(f"{group.leader.request_id}: {len(missing)} of its beams "
                                   "missed the step")
            out = self._beam_step(group, logits[[rows[id(s)] for s in group.beams]])
            if out is not None:
                outputs.append(out)
        return outputs

    def _beam_step(self, group: BeamGroup, logits: torch.Tensor) -> RequestOutput | None:
        """Scores the beams' continuations (`BeamSearch.step`). The request's last output
        carries the finished beams, best first; before it, a request that streams its beams
        (`Request.stream_beams`) gets an output at each step carrying the running beams so
        far, the others none. The next beams are set up after the outputs
        (`_beam_advance`)."""
        search, leader = group.search, group.leader
        params = leader.request.sampling
        n, V = logits.shape
        counts = [s.counts(V) for s in group.beams] if params.penalized else None
        repeats = [s.repeat_bans() for s in group.beams] if params.no_repeat_ngram_size \
            else None
        scores = adjusted_log_probs(logits, [params] * n, [search.num_generated] * n,
                                    search.histories, counts, repeats)
        raw = torch.log_softmax(logits.float(), -1) if params.return_log_probs else None
        kept = logits.float() if leader.request.return_generation_logits else None
        leader.last_token_time = time.perf_counter()
        if leader.first_token_time is None:
            leader.first_token_time = leader.last_token_time
        selection = search.step(scores, raw, kept)
        if not search.done:
            self._beam_pending.append((group, selection))
            if not leader.request.stream_beams:
                return None
            out = leader.output([], False)
            out.beams = search.running()
            out.num_output_tokens = search.num_generated
            return out
        self._after.append(partial(self._finish_beams, group))
        beams = search.outputs()
        if not beams:
            return leader.output([], True, "error", "beam search: no beam could go on")
        best = beams[0]
        out = leader.output(best.token_ids, True, best.finish_reason)
        out.num_output_tokens = len(best.token_ids)
        if params.return_log_probs:
            out.log_probs, out.cum_log_prob = best.log_probs, best.cum_log_prob
        out.generation_logits = best.logits
        out.beams = beams
        return out

    def _beam_advance(self, group: BeamGroup, selection: list[tuple[int, int]]) -> None:
        """Before the next step is planned (where preempting others for pages is safe: no
        step's work is pending): the beams' new whole pages join the prefix store (so
        beams forked from them share them), then beam i of the next step becomes
        `selection[i]` = (parent, token): a parent's first child is the parent's sequence;
        each further child is a sequence whose beam ended (or a new one), given a copy of the
        parent's run states and of its pages the store does not hold (at most its last,
        partial page when the store caches), its tokens and its locked path."""
        beams, leader = group.beams, group.leader
        if not leader.prefix_inserted:  # the first step: the prompt joins, with its states
            self._insert_prompt(leader, len(leader.tokens))
        else:
            for seq in beams:
                self.cache.insert(seq, seq.num_computed, with_states=False)
        parents = [p for p, _ in selection]
        nxt: list[Sequence | None] = [None] * len(selection)
        kept: set[int] = set()
        forks = []
        for i, p in enumerate(parents):
            if p in kept:
                forks.append(i)
            else:
                kept.add(p)
                nxt[i] = beams[p]
        spare = [s for j, s in enumerate(beams) if j not in kept]
        if leader in spare and not forks:  # the leader (the request's id) stays a beam
            forks.append(0)
            spare.append(beams[parents[0]])
        if leader in spare:
            spare.remove(leader)
            spare.append(leader)  # the first fork target
        src_slots, dst_slots = [], []
        for i in forks:
            parent = beams[parents[i]]
            target = spare.pop() if spare else self._new_beam(group)
            if not self._fork(group, parent, target):
                held = [*beams, *(seq for seq in nxt if seq is not None), target]
                group.beams = list({id(seq): seq for seq in held}.values())
                self._preempt_beams(group)
                return
            nxt[i] = target
            src_slots.append(parent.run_slot)
            dst_slots.append(target.run_slot)
        self.executor.copy_run_states(src_slots, dst_slots)
        for seq in spare:  # beams that ended without a child taking their sequence
            self.cache.release(seq, cache=True)
            self.running.remove(seq)
            group.reserved.append(seq.run_slot)
            seq.run_slot, seq.status = None, SeqStatus.FINISHED
        for seq, (_, token) in zip(nxt, selection):
            seq.tokens.append(token)
        group.beams = nxt

    def _new_beam(self, group: BeamGroup) -> Sequence:
        leader = group.leader
        seq = Sequence(leader.request, [], leader.num_prompt_tokens, arrival=leader.arrival,
                       arrival_wall_ns=leader.arrival_wall_ns,
                       status=SeqStatus.RUNNING, run_slot=group.reserved.pop(), beam=group,
                       adapter=leader.adapter)
        self.running.append(seq)
        return seq

    def _fork(self, group: BeamGroup, parent: Sequence, target: Sequence) -> bool:
        """`target` drops what it holds and takes `parent`'s history: its locked path and a
        copy of its private pages (run states: the caller copies them). False when no pages
        can be had, even by preempting other requests."""
        self.cache.release(target, cache=False)  # its own history is gone
        store = self.cache.store
        uses_anchors = store.uses_anchors
        n = parent.num_tree_pages
        private = parent.page_table[n:]
        alloc = None
        while private and (alloc := store.alloc_pages(len(private))) is None:
            victims = [s for s in self.running if s.beam is not group]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda s: s.arrival))
        self.num_beam_forks += 1
        if alloc is not None:
            self.num_beam_pages_copied += len(private)
            group.leader.pages_loaded += len(private)
            blocks = parent.anchor_blocks[n:] if uses_anchors else []
            self.executor.copy_pages(private, alloc.kv_pages, blocks, alloc.anchor_blocks,
                                     self.cache.layout.anchors_per_page)
        store.lock(parent.locked_nodes)
        target.locked_nodes = list(parent.locked_nodes)
        target.num_tree_pages = n
        target.page_table = parent.page_table[:n] + (alloc.kv_pages if alloc else [])
        if uses_anchors:
            target.anchor_blocks = parent.anchor_blocks[:n] + (alloc.anchor_blocks
                                                               if alloc else [])
        target.tokens = list(parent.tokens)
        target.num_computed = parent.num_computed
        target.capture_positions = set()
        target.token_counts = target.repeated_ngrams = None
        target.prefix_inserted = True
        return True

    def _release_beams(self, group: BeamGroup, cache: bool) -> None:
        """Releases every beam of `group` (and its reserved slots); the leader's status is
        the caller's to set."""
        for seq in group.beams:
            self.cache.release(seq, cache=cache)
            if seq in self.running:
                self.running.remove(seq)
            if seq.run_slot is not None:
                self.free_slots.append(seq.run_slot)
            seq.run_slot = None
            if seq is not group.leader:
                seq.status = SeqStatus.FINISHED
        self.free_slots.extend(group.reserved)
        group.reserved = []
        group.beams = [group.leader]

    def _finish_beams(self, group: BeamGroup) -> None:
        self._release_beams(group, cache=True)
        group.leader.status = SeqStatus.FINISHED
        self.num_finished += 1

    def _preempt_beams(self, group: BeamGroup) -> None:
        """A beam search gives up its pages and slots and starts again from its prompt (no
        output went out yet); its computed pages stay cached, so the prompt mostly hits."""
        self._release_beams(group, cache=True)
        leader = group.leader
        del leader.tokens[leader.num_prompt_tokens:]
        leader.num_computed, leader.status = 0, SeqStatus.WAITING
        leader.token_counts, leader.repeated_ngrams, leader.prefix_inserted = None, None, False
        leader.capture_positions = set()
        group.search.reset()
        self.waiting.appendleft(leader)
        self.num_preemptions += 1


# Prompt positions scored at once: [256, V] fp32 copies, 155 MB at a 151K vocabulary
PROMPT_SCORE_ROWS = 256


def _prompt_scores(seq: Sequence, start: int, rows: torch.Tensor
                   ) -> tuple[list[float], list[list[tuple[int, float]]], list[int]]:
    """A prompt chunk's scores: the logits `rows` at positions start.. predict the prompt
    tokens after them (the last prompt position predicts the first generated token: not
    scored); the log probability of each, its position's likeliest tokens and its rank
    there (1 + the tokens with higher logits, vLLM's `rank`). Scored `PROMPT_SCORE_ROWS`
    positions at a time, so the float copies it makes stay small beside the logits."""
    n = min(len(rows), seq.num_prompt_tokens - 1 - start)
    if n <= 0:
        return [], [], []
    targets = torch.tensor(seq.tokens[start + 1:start + 1 + n])
    top = seq.request.sampling.top_log_probs
    chosen: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    ranks: list[int] = []
    for at in range(0, n, PROMPT_SCORE_ROWS):
        block, wanted = rows[at:min(n, at + PROMPT_SCORE_ROWS)], targets[at:at + PROMPT_SCORE_ROWS]
        scores, ids, values = scored_log_probs(block, wanted, top)
        chosen += scores.tolist()
        if top:
            tops += [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        raw = block.float()
        target_logits = raw.gather(1, wanted.view(-1, 1).to(raw.device))
        ranks += ((raw > target_logits).sum(-1) + 1).tolist()
    return chosen, tops, ranks
