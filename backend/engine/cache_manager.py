"""Glue between sequences and the prefix store: match + state restore, page growth, insert,
release. Runs on the engine thread only (the store is not thread-safe).
"""

from __future__ import annotations

import torch

from backend.cache.base import Tier
from backend.cache.retention import DEFAULT_RETENTION, RetentionConfig, RetentionRange
from backend.cache.store import PrefixStore
from backend.engine.config import EngineConfig
from backend.engine.executor import TorchExecutor
from backend.engine.sequence import Sequence
from backend.model.batch import SNAPSHOT_ALIGN
from backend.replay.anchors import AnchorLayout
from backend.replay.budget import recompute_is_cheaper, replay_budget


class CacheManager:
    def __init__(self, config: EngineConfig, store: PrefixStore, executor: TorchExecutor,
                 tiers=None) -> None:
        self.config = config
        self.store = store
        self.executor = executor
        self.tiers = tiers  # TieredBackend or None
        self.page_size = config.page_size
        self.policy = config.cache.policy
        self.layout = AnchorLayout(config.page_size, config.cache.anchors_per_page,
                                   config.replay.sampling)
        self.snapshots = self.policy != "none" and (
            config.replay.live_state or self.policy == "checkpoint"
        )
        self.sglang_placement = (self.policy == "checkpoint"
                                 and config.cache.checkpoint_placement == "sglang")
        # What a request with a session_id and no retention config of its own leaves.
        keep = (config.session_priority, config.session_retention_s)
        self.session_retention = RetentionConfig((RetentionRange(0, None, *keep),), *keep)
        self.num_replayed_anchors = 0
        self.num_live_state_hits = 0
        self.num_recomputed_tokens = 0
        self._locked: list = []  # during `admit`: the path it locked so far

    # Admission --------------------------------------------------------------------------
    def admit(self, seq: Sequence, replays: list[tuple[int, torch.Tensor, int]]) -> None:
        """Matches the sequence's prefix, locks it, restores linear states at the match end
        (live state, or a replay queued into `replays`), and plans state snapshots."""
        # Context logits, prompt log probabilities: every prompt position is computed (the
        # store holds no logits).
        key = b"" if seq.request.needs_prompt_logits else seq.prefix_key()
        match = self.store.match_prefix(key, seq.salt, count_hits=False)
        found_on = self.store.locations(match)  # before promotion moves them
        self._locked = []  # the path locked so far (`_usable_prefix`, `_relock`)
        try:
            nodes = self._usable_prefix(match)
            n = len(nodes)
            live = match.live_state if n == match.num_matched_pages else None
            if self.policy == "suffixreplay" and not self.config.replay.live_state:
                live = None
            restored, branch_point = False, None
            if n and self.policy == "checkpoint":
                nodes, restored = self._resume_checkpoint(seq, nodes)
                n, live = len(nodes), None
            elif n and live is None and self.policy == "suffixreplay" and \
                    self.config.replay.live_state:
                restored = self._resume_at_end(seq, nodes[-1])
                if not restored:
                    nodes, live = self._resume_short(match, nodes)
                    n = len(nodes)
        except BaseException:
            # (a state load or a promotion failed before the sequence holds its path: the
            # caller's release would find nothing to unlock, and the pages stayed locked)
            self.store.unlock(self._locked)
            raise
        finally:
            self._locked = []
        if self.sglang_placement and match.num_cached_pages > n:
            # KV cached past the deepest state: SGLang's branch point (where the "sglang"
            # placement saves this prompt's state, for the siblings that follow).
            branch_point = match.num_cached_pages * self.page_size
        seq.locked_nodes = nodes
        seq.page_table = [node.kv_page for node in nodes]
        seq.anchor_blocks = [node.anchor_block for node in nodes] if self.store.uses_anchors else []
        seq.num_tree_pages = n
        self.store.count_hits(found_on[:n])  # the pages used, not all that were matched
        seq.num_computed = seq.cached_tokens = n * self.page_size
        seq.pages_loaded += sum(where != Tier.DEVICE for where in found_on[:n])
        if n == 0:
            self.executor.reset_state(seq.run_slot)
        elif restored:
            self.num_live_state_hits += 1
        elif live is not None:
            self.executor.load_state(live, seq.run_slot)
            self.store.resumed_from(match.checkpoint.node)
            self.num_live_state_hits += 1
        else:
            k = replay_budget(seq.num_computed, self.config.replay,
                              n * self.layout.anchors_per_page)
            replays.append((seq.run_slot, self.layout.last_rows(seq.anchor_blocks, k),
                            seq.adapter))
            seq.replayed_anchors = k
            self.num_replayed_anchors += k
        seq.recomputed_tokens = len(seq.tokens) - seq.num_computed
        self.num_recomputed_tokens += seq.recomputed_tokens
        self._plan_snapshots(seq, branch_point)

    def cached_pages(self, seq: Sequence) -> int:
        """Pages of the waiting `seq`'s prompt found in the store (any tier); no side effects
        (no LRU touch, no hit counted)."""
        if self.policy == "none":
            return 0
        return len(self.store.tree.walk(seq.prefix_key(), seq.salt))

    def reads_pending(self, seq: Sequence, timeout: float) -> bool:
        """Whether the waiting `seq`'s matched pages (or state) are still being read from SSD
        after waiting at most `timeout` s (reads not started yet are started); a True is
        counted as a deferred admission."""
        if self.tiers is None:
            return False
        pending = self.tiers.prefetcher.reads_pending(seq.prefix_key(), seq.salt,
                                                      timeout)
        self.tiers.stats.deferred_admissions += pending
        return pending

    def keep_replayed(self, seq: Sequence) -> None:
        """Keeps the state a replay just rebuilt (in the sequence's run slot) as the live
        state of its match end: it joins the tree with the sequence's pages, and the next
        prompt that matches up to the same page (a sibling of the same branch point) loads
        it instead of replaying. It is what that replay would rebuild again (same anchors,
        same budget); best-effort like every live state (no free slot: not kept)."""
        if not self.snapshots or seq.num_computed in seq.pending_states:
            return
        slots = self.store.alloc_state_slots(1)
        if slots is None:
            return
        seq.pending_states[seq.num_computed] = slots[0]  # (before the copy: a failed one
        self.executor.save_state(seq.run_slot, slots[0])  # is released with the sequence)

    def _resume_checkpoint(self, seq: Sequence, nodes: list) -> tuple[list, bool]:
        """Checkpoint policy: the deepest node of the locked usable path `nodes` with a saved
        state (a device slot, else a lower tier) is loaded into the sequence's run slot; the
        path is cut there. Returns (path, whether a state was loaded)."""
        for i in range(len(nodes) - 1, -1, -1):
            if self._load_saved_state(seq, nodes[i]):
                return self._relock(nodes, i + 1), True
        return self._relock(nodes, 0), False

    def _load_saved_state(self, seq: Sequence, node) -> bool:
        """Loads `node`'s saved state (its device slot, else a copy a lower tier keeps:
        `state_tier.py`) into the sequence's run slot; False: none, or a copy that failed
        its checks (a miss)."""
        if node.state_slot is not None:
            self.executor.load_state(node.state_slot, seq.run_slot)
            return True
        return self.tiers is not None and self.tiers.load_state(
            node, self.executor.run_states, seq.run_slot)

    def _resume_at_end(self, seq: Sequence, node) -> bool:
        """Suffix replay, no live state at the match's end: a state saved at the usable
        path's last node `node` anyway (its device slot where promotion cut the path short
        of the match, else a lower tier's copy) is loaded instead of a replay."""
        if not self._load_saved_state(seq, node):
            return False
        self.store.resumed_from(node)
        return True

    def _resume_short(self, match, nodes: list) -> tuple[list, int | None]:
        """Suffix replay: the deepest live state on the locked usable path `nodes`, short of
        its end, when recomputing the pages after it costs less than the replay at the end
        (`recompute_is_cheaper`; e.g. a branch one page past an earlier prompt's end). The
        path is cut there. Returns (path, the state's slot or None: replay at the end)."""
        state = match.checkpoint
        if state is None or state.slot is None:
            return nodes, None
        depth = state.num_tokens // self.page_size
        if not 0 < depth < len(nodes) or nodes[depth - 1] is not state.node:
            return nodes, None
        end = len(nodes) * self.page_size
        k = replay_budget(end, self.config.replay, len(nodes) * self.layout.anchors_per_page)
        if not recompute_is_cheaper(end - state.num_tokens, end, k, self.config.replay):
            return nodes, None
        return self._relock(nodes, depth), state.slot

    def _relock(self, nodes: list, n: int) -> list:
        """Keeps the lock on `nodes[:n]` only (a locked path is unlocked root first)."""
        if n < len(nodes):
            self.store.unlock(nodes)
            self._locked = []
            self.store.lock(nodes[:n])
            self._locked = nodes[:n]
        return nodes[:n]

    def _usable_prefix(self, match) -> list:
        """The matched nodes whose KV (and anchors) are on the device, locked. With tiers,
        pages on DRAM / SSD are read (waiting only for reads still in flight) and promoted."""
        if self.tiers is None:
            n = len(match.kv_pages)
            if self.store.uses_anchors:
                n = min(n, len(match.anchor_blocks))
            nodes = match.nodes[:n]
            self.store.lock(nodes)
            self._locked = nodes
            return nodes
        nodes = match.nodes[: self.tiers.prefetcher.wait_for(match.nodes)]
        self.store.lock(nodes)
        self._locked = nodes
        if not self.store.promote(nodes):
            on_device = 0
            while on_device < len(nodes) and nodes[on_device].on_device:
                on_device += 1
            nodes = self._relock(nodes, on_device)
        return nodes

    def offload_pages(self, seq: Sequence, end: int) -> list[int]:
        """Pages a prefill chunk ending at `end` completes and the step then inserts (the
        whole pages of [0, end) not yet in the store)."""
        if seq.prefix_inserted:
            return []
        return seq.page_table[seq.num_tree_pages: end // self.page_size]

    def _plan_snapshots(self, seq: Sequence, branch_point: int | None = None) -> None:
        if not self.snapshots:
            return
        positions = set(self.store.checkpoint_positions(len(seq.tokens), seq.num_computed,
                                                        branch_point))
        end = len(seq.tokens) // self.page_size * self.page_size
        if end > seq.num_computed and not self.sglang_placement:
            positions.add(end)
        seq.capture_positions = positions

    def plan_snapshots(self, seq: Sequence, start: int, end: int) -> tuple[int, list]:
        """The states a prefill step [start, end) saves on its way: returns the step's end
        and [(position, saved slot)] for the planned positions strictly inside it. Where the
        executor saves states mid-step (chunk-aligned offsets, up to its
        `max_snapshots_per_row`) one step covers them; otherwise the step ends at that
        position and `after_forward` saves it (making room as it does). The slots are the
        sequence's pending states from now on (a failed step's release frees them).

        When no slot can be had (every one held by running requests), the sequence gives up
        its shallowest state from an earlier step, as `after_forward` does, or else goes
        without this one: the step is not cut short for a checkpoint it could not keep
        (cutting cost an extra forward, and the rest of the prompt's chunk, for nothing)."""
        planned: list[tuple[int, int]] = []
        limit = self.executor.max_snapshots_per_row
        for pos in sorted(p for p in seq.capture_positions if start < p < end):
            if not (self.executor.supports_snapshots and (pos - start) % SNAPSHOT_ALIGN == 0) \
                    or (limit is not None and len(planned) >= limit):
                return pos, planned
            slots = self.store.alloc_state_slots(1) or self._give_up_shallowest(seq, start)
            if slots is None:
                continue
            self._keep_state(seq, pos, slots[0])
            planned.append((pos, slots[0]))
        return end, planned

    # Growth -----------------------------------------------------------------------------
    def ensure_pages(self, seq: Sequence, end: int) -> int:
        """Allocates pages so tokens [0, end) have KV slots; returns the end covered."""
        need = -(-end // self.page_size) - len(seq.page_table)
        if need > 0:
            alloc = self.store.alloc_pages(need)
            if alloc is None:
                return len(seq.page_table) * self.page_size
            seq.page_table.extend(alloc.kv_pages)
            seq.anchor_blocks.extend(alloc.anchor_blocks)
            seq.owner.pages_new += need
        return end

    def capture_plan(self, seq: Sequence, start: int, end: int):
        """(offsets in [0, end - start), anchor rows) of the anchors among [start, end)."""
        if not self.store.uses_anchors:
            return None
        return self.layout.capture_plan(start, end, seq.anchor_blocks)

    def after_forward(self, seq: Sequence, caught_up: bool | None = None) -> None:
        """Saves states where planned (checkpoints, page-boundary live state). `caught_up`:
        the step computed every token but those it sampled (default: num_computed is the
        sequence's length, as before sampling)."""
        if not self.snapshots:
            return
        pos = seq.num_computed
        if caught_up is None:
            caught_up = pos >= len(seq.tokens)
        if not (pos in seq.capture_positions or (caught_up and self._at_boundary(seq, pos))):
            return
        slots = self.store.alloc_state_slots(1) or self._give_up_shallowest(seq, pos)
        if slots is None:
            return  # an optimisation only: no free slot, no snapshot
        try:
            self.executor.save_state(seq.run_slot, slots[0])
        except BaseException:  # (the slot is no one's yet: it leaked)
            self.store.free_state_slots(slots)
            raise
        self._keep_state(seq, pos, slots[0])

    def _every(self) -> int:
        """How often a generating sequence's state is saved: a page (under SGLang's placement,
        its interval)."""
        return self.config.cache.checkpoint_interval if self.sglang_placement \
            else self.page_size

    def _at_boundary(self, seq: Sequence, pos: int) -> bool:
        floor = seq.num_prompt_tokens if self.sglang_placement \
            else seq.num_tree_pages * self.page_size
        return pos % self._every() == 0 and pos > floor

    def draft_room(self, pos: int) -> int | None:
        """Draft tokens a step that computes up to `pos` may verify after it without passing
        the next position where `after_forward` may save a generating sequence's state
        (`pos` itself included: the state there is the step's own only without drafts): the
        kept tokens may reach it, not go past it, or its state would not be saved (a later
        turn would replay, or resume a page earlier). None: no limit (no states saved)."""
        if not self.snapshots:
            return None
        return -pos % self._every()

    @staticmethod
    def _give_up_shallowest(seq: Sequence, upto: int) -> list[int] | None:
        """The slot of the sequence's shallowest pending state at or before `upto`, taken
        from it (None if it has none). When the pool is full of running prompts' own states
        (not evictable while they run), deeper states are worth more: they cover longer
        matches, which is what re-sent prompts (turns, tool calls, retries) hit."""
        earlier = [p for p in seq.pending_states if p <= upto]
        if not earlier:
            return None
        shallowest = min(earlier)
        if seq.live_position == shallowest:
            seq.live_position = None
        return [seq.pending_states.pop(shallowest)]

    def _keep_state(self, seq: Sequence, pos: int, slot: int) -> None:
        """The state at `pos` (in `slot`) becomes the sequence's latest; the previous latest
        goes unless it is a planned checkpoint."""
        old = seq.live_position
        if old is not None and old in seq.pending_states and old not in seq.capture_positions:
            self.store.free_state_slots([seq.pending_states.pop(old)])
        again = seq.pending_states.get(pos)  # (a step planned again: its first slot goes)
        if again is not None and again != slot:
            self.store.free_state_slots([again])
        seq.pending_states[pos] = slot
        seq.live_position = pos

    # Insert and release -----------------------------------------------------------------
    def insert(self, seq: Sequence, num_tokens: int, with_states: bool = True) -> None:
        """Caches the whole pages of tokens [0, num_tokens) and moves the lock onto them.

        Without `with_states` (a prefill chunk that is not the prompt's last) the saved
        states stay pending and join at the prompt's end, as the checkpoint baseline was
        measured; while pending, `after_forward` gives up a long prompt's shallowest ones
        first when the slots run out."""
        num_pages = num_tokens // self.page_size
        if self.policy == "none" or num_pages < seq.num_tree_pages:
            return
        end = num_pages * self.page_size
        states = {p: s for p, s in seq.pending_states.items() if p <= end} if with_states \
            else {}
        if num_pages == seq.num_tree_pages and not states:
            return  # nothing new (states saved on pages an earlier chunk inserted do join)
        anchors = seq.anchor_blocks[:num_pages] if self.store.uses_anchors else ()
        result = self.store.insert(seq.tokens[:end], seq.salt,
                                   seq.page_table[:num_pages], anchors, states)
        for i, node in enumerate(result.nodes):
            seq.page_table[i] = node.kv_page
            if self.store.uses_anchors:
                seq.anchor_blocks[i] = node.anchor_block
        self.store.free_pages(result.duplicate_kv_pages, result.duplicate_anchor_blocks)
        self.store.free_state_slots(result.duplicate_state_slots)
        for p in states:
            del seq.pending_states[p]
        if any(p > seq.cached_tokens for p in states):
            # A state past the resume point: the one(s) resumed from go first from now on.
            self.store.shadow_states(result.nodes[: seq.cached_tokens // self.page_size])
        self.store.lock(result.nodes)
        self.store.unlock(seq.locked_nodes)
        seq.locked_nodes = result.nodes
        seq.num_tree_pages = num_pages

    def release(self, seq: Sequence, cache: bool) -> None:
        """Frees what the sequence holds; with `cache`, its computed pages are inserted. The
        sequence lets go of everything before any of it is freed, so a release that fails
        partway (and the cancel that follows it) never frees a page twice."""
        if cache:
            self.insert(seq, seq.num_computed)
        private = seq.page_table[seq.num_tree_pages:]
        anchors = seq.anchor_blocks[seq.num_tree_pages:] if self.store.uses_anchors else []
        states, locked = list(seq.pending_states.values()), seq.locked_nodes
        seq.page_table, seq.anchor_blocks, seq.locked_nodes = [], [], []
        seq.pending_states, seq.num_tree_pages, seq.live_position = {}, 0, None
        try:
            self.store.free_pages(private, anchors)
            self.store.free_state_slots(states)
            if locked:
                retention = seq.request.retention
                if retention is None:
                    retention = self.session_retention if seq.request.session_id \
                        else DEFAULT_RETENTION
                self.store.retain(locked, retention.page_priorities(
                    len(locked), self.page_size, seq.num_prompt_tokens))
        finally:
            self.store.unlock(locked)
            self.store.trim()
