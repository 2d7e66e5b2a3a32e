"""Executors own the device buffers and run the model: forward steps, replay, state copies.

`TorchExecutor` runs the PyTorch model (CPU here, CUDA where present). Buffers:
- kv: paged full-attention KV, indexed by the prefix store's KV page ids;
- run_states: one linear-state slot per running sequence;
- saved_states: the store's checkpoint slots (checkpoint baseline and live states);
- anchors: [G, num_anchor_blocks * anchors_per_page, D], indexed by anchor block ids.
"""

from __future__ import annotations

import math

import torch

from backend.config import ModelConfig
from backend.model import (
    Capture,
    ForwardBatch,
    HybridForCausalLM,
    PagedKV,
    SeqInput,
    Snapshots,
    StateSlots,
)
from backend.model.decode import StateLog
from backend.model.kernels import fla_available
from backend.model.quant import dequantize_int8


class ExecutorBuffers:
    """The buffers every executor owns, and the state-slot copies the cache manager asks for."""

    # Whether `forward` can save linear states in the middle of a step (`snapshots`); where
    # it cannot, the scheduler ends a step wherever a state is to be saved.
    supports_snapshots = False
    max_snapshots_per_row: int | None = None  # None: as many as asked
    _stash: StateSlots | None = None  # run-state copies for speculative steps
    _logs: list | tuple = ()  # (rows, StateLog) of the last forward's parts (speculative)

    def _allocate(self, cfg: ModelConfig, dtype: torch.dtype, device, num_kv_pages: int,
                  page_size: int, num_run_slots: int, num_saved_slots: int,
                  num_anchor_rows: int, int8_anchors: bool, spare_anchor_rows: int = 0) -> None:
        self.config = cfg
        self.page_size = page_size
        self.kv = PagedKV.allocate(cfg, num_kv_pages, page_size, dtype, device)
        self.run_states = StateSlots.allocate(cfg, num_run_slots, dtype, device)
        self.saved_states = StateSlots.allocate(cfg, num_saved_slots, dtype, device)
        anchor_dtype = torch.int8 if int8_anchors else dtype
        # `spare_anchor_rows` trailing rows are scratch space for the compiled step.
        self.anchor_storage = torch.zeros(cfg.num_groups, num_anchor_rows + spare_anchor_rows,
                                          cfg.hidden_size, dtype=anchor_dtype, device=device)
        self.anchors = self.anchor_storage[:, :num_anchor_rows]
        self.anchor_scales = None
        if int8_anchors:
            self.anchor_scales = torch.zeros(cfg.num_groups, num_anchor_rows, device=device)

    def save_state(self, run_slot: int, saved_slot: int) -> None:
        _copy_slot(self.run_states, run_slot, self.saved_states, saved_slot)

    def load_state(self, saved_slot: int, run_slot: int) -> None:
        _copy_slot(self.saved_states, saved_slot, self.run_states, run_slot)

    def reset_state(self, run_slot: int) -> None:
        self.run_states.zero(run_slot)

    def copy_run_states(self, src: list[int], dst: list[int]) -> None:
        """Run slot src[i]'s linear states into run slot dst[i] (beam search forking a beam;
        read before written, so the slots may overlap)."""
        _copy_index(self.run_states.conv + self.run_states.rec, 0, src, dst)

    def copy_pages(self, src: list[int], dst: list[int], src_blocks: list[int] = (),
                   dst_blocks: list[int] = (), anchors_per_page: int = 0) -> None:
        """KV page src[i] into page dst[i], and anchor block src_blocks[i] into
        dst_blocks[i] (its rows and int8 scales): a forked beam's copy of its parent's pages
        the prefix store does not share."""
        ps = self.page_size
        offsets = torch.arange(ps)
        rows = [(torch.tensor(p)[:, None] * ps + offsets).flatten() for p in (src, dst)]
        _copy_index(self.kv.k + self.kv.v, 0, *rows)
        if src_blocks:
            offsets = torch.arange(anchors_per_page)
            rows = [(torch.tensor(b)[:, None] * anchors_per_page + offsets).flatten()
                    for b in (src_blocks, dst_blocks)]
            scales = [self.anchor_scales] if self.anchor_scales is not None else []
            _copy_index([self.anchors, *scales], 1, *rows)

    def _write_replayed(self, slot_ids: torch.Tensor, layers, states) -> None:
        for layer_id, (conv, rec) in zip(layers, states):
            li = self.config.linear_layer_ids.index(layer_id)
            self.run_states.scatter(li, slot_ids, conv, rec)


class TorchExecutor(ExecutorBuffers):
    def __init__(
        self,
        model: HybridForCausalLM,
        num_kv_pages: int,
        page_size: int,
        num_run_slots: int,
        num_saved_slots: int,
        num_anchor_rows: int,
        int8_anchors: bool = False,
    ) -> None:
        self.model = model
        self.dtype, self.device = model.dtype, model.device
        self._allocate(model.config, model.dtype, model.device, num_kv_pages, page_size,
                       num_run_slots, num_saved_slots, num_anchor_rows, int8_anchors)

    @property
    def supports_snapshots(self) -> bool:
        """The PyTorch chunked delta rule carries the state between 64-token chunks, so a
        state at a chunk boundary costs a copy; flash-linear-attention's kernels (CUDA) do
        not hand it out."""
        return not (self.model.device.type == "cuda" and fla_available())

    def forward(
        self, seqs: list[SeqInput], capture_src: torch.Tensor | None = None,
        capture_dst: torch.Tensor | None = None, layer_hooks: object | None = None,
        snapshots: list[tuple[int, int, int]] | None = None,
        num_logits: list[int] | None = None, log_states: bool = True,
    ) -> torch.Tensor:
        """One batched step; returns last-token logits [B, V] (fp32).

        snapshots: (row, offset, saved slot): after the row's first `offset` new tokens (a
        multiple of SNAPSHOT_ALIGN, inside the step) its linear states go to that slot.
        num_logits: per row, how many of its last tokens' logits to return (speculative
        verification); then [B, L, V] with L = max(num_logits), row b's in [b, :n_b] in
        token order (the rest zeros), and with `log_states` the step's recurrences are
        logged where the fast path ran them (`rewind`); context logits ask for every
        position of a prompt chunk the same way, without the log.

        The eager model pads a step's sequences to its longest one, so a step whose rows
        differ much in length runs as several forwards (`split_rows`): decode rows beside a
        prefill chunk (the model's decode path), a short chunk beside a long one."""
        self._logs = []
        if num_logits is not None:
            if any(not 1 <= n <= len(s.token_ids) for s, n in zip(seqs, num_logits)):
                raise ValueError(f"num_logits {num_logits}: each row's logits are of 1 to all "
                                 f"of its new tokens ({[len(s.token_ids) for s in seqs]})")
            if max(num_logits) == 1:
                num_logits = None
        parts = split_rows(seqs)
        if parts is None:
            return self._forward(seqs, capture_src, capture_dst, layer_hooks, snapshots,
                                 num_logits, log_states=log_states)
        T = max(len(s.token_ids) for s in seqs)
        logits = None
        for i, rows in enumerate(parts):
            last = i == len(parts) - 1
            sub = _sub_step(rows, len(seqs), T, [seqs[b] for b in rows], capture_src,
                            capture_dst, snapshots)
            # New KV is copied out (offload) once every part has written it: the earlier
            # part only waits for its layers' loads.
            hooks = layer_hooks if last or layer_hooks is None else _LoadOnly(layer_hooks)
            counts = None if num_logits is None else [num_logits[b] for b in rows]
            out = self._forward(*sub[:3], hooks, sub[3], counts, rows, log_states)
            if logits is None:
                shape = (len(seqs), out.shape[-1]) if num_logits is None else \
                    (len(seqs), max(num_logits), out.shape[-1])
                logits = out.new_zeros(shape)
            if num_logits is None:
                logits[rows] = out
            else:
                out = out if out.dim() == 3 else out.unsqueeze(1)  # [rows, L_part, V]
                logits[rows, :out.shape[1]] = out
        return logits

    def _forward(self, seqs, capture_src, capture_dst, layer_hooks, snapshots,
                 num_logits=None, rows=None, log_states=True):
        capture = None
        if capture_src is not None and capture_src.numel():
            capture = Capture(capture_src, capture_dst, self.anchors, self.anchor_scales)
        batch = ForwardBatch.build(seqs, self.kv, self.run_states, capture,
                                   device=self.model.device)
        batch.layer_hooks = layer_hooks
        if snapshots:
            snap_rows, offsets, slots = (torch.tensor(v, device=self.model.device)
                                         for v in zip(*snapshots))
            batch.snapshots = Snapshots(snap_rows, offsets, slots, self.saved_states)
        if num_logits is None or max(num_logits) == 1:
            return self.model.forward_batch(batch).float()
        if log_states:
            batch.state_log = StateLog()
            self._logs.append((list(range(len(seqs))) if rows is None else rows,
                               batch.state_log))
        T = batch.input_ids.shape[1]
        index, place = [], []
        for b, (s, n) in enumerate(zip(seqs, num_logits)):
            end = len(s.token_ids)
            index += range(b * T + end - n, b * T + end)
            place += [(b, i) for i in range(n)]
        out = self.model.forward_batch(
            batch, logit_index=torch.tensor(index, device=self.model.device)).float()
        logits = out.new_zeros(len(seqs), max(num_logits), out.shape[-1])
        b, i = zip(*place)
        logits[list(b), list(i)] = out
        return logits

    def stash_states(self, slots: list[int]) -> None:
        """Copies the run slots' linear states aside (before a speculative step: a rejected
        draft puts them back with `restore_states`)."""
        if self._stash is None:
            n = self.run_states.conv[0].shape[0] if self.run_states.conv else 0
            self._stash = StateSlots.allocate(self.config, n, self.dtype, self.device)
        _copy_slots(self.run_states, self._stash, slots)

    def rewind(self, requests: list[tuple[int, int, int]]) -> set[int]:
        """After a speculative step (`forward` with num_logits): (row, run slot, n) gives
        the row's slot the linear states after its first n new tokens, rebuilt from its
        stashed states (`stash_states`) through the recurrences the step logged. Returns the
        rows done; the others (their part of the step ran the general path, which logs
        nothing) need `restore_states` and their tokens computed again."""
        done: set[int] = set()
        for rows, log in self._logs:
            if not log.layers:
                continue
            local = {b: i for i, b in enumerate(rows)}
            mine = [(local[b], slot, n) for b, slot, n in requests if b in local]
            if not mine:
                continue
            index, slots, counts = (torch.tensor(v, device=self.device) for v in zip(*mine))
            log.rewind(self.run_states, self._stash, index, slots, counts)
            done.update(b for b, _, _ in requests if b in local)
        return done

    def restore_states(self, slots: list[int]) -> None:
        """The run slots' linear states as `stash_states` last saw them."""
        _copy_slots(self._stash, self.run_states, slots)

    def replay(self, slots: list[int], anchor_rows: list[torch.Tensor],
               adapters: list[int] | None = None) -> None:
        """Rebuilds linear states into run slots `slots` from anchor rows, one packed batch
        per group (sequence b replays anchors `anchor_rows[b]`, in position order, through
        its LoRA adapter `adapters[b]`, 0: none)."""
        cfg = self.model.config
        lengths = torch.tensor([r.numel() for r in anchor_rows])
        T = int(lengths.max())
        index = torch.zeros(len(slots), T, dtype=torch.long)
        for b, rows in enumerate(anchor_rows):
            index[b, : rows.numel()] = rows
        slot_ids = torch.tensor(slots, device=self.model.device)
        rows = torch.tensor(adapters, device=self.model.device) if adapters else None
        for g, layers in enumerate(cfg.group_state_layers):
            hidden = self.anchors[g][index]  # [B, T, D]
            if self.anchor_scales is not None:
                hidden = dequantize_int8(hidden, self.anchor_scales[g][index], self.model.dtype)
            self._write_replayed(slot_ids, layers,
                                 self.model.replay_group(g, hidden, lengths, rows))


def _copy_slot(src: StateSlots, i: int, dst: StateSlots, j: int) -> None:
    for s, d in zip(src.conv + src.rec, dst.conv + dst.rec):
        d[j].copy_(s[i])


def _copy_index(tensors: list[torch.Tensor], dim: int, src, dst) -> None:
    """Entries `src` of each tensor along `dim` into entries `dst` (gathered first)."""
    if not len(src):
        return
    device = tensors[0].device
    src, dst = (torch.as_tensor(i, device=device) for i in (src, dst))
    for t in tensors:
        t.index_copy_(dim, dst, t.index_select(dim, src))


def _copy_slots(src: StateSlots, dst: StateSlots, slots: list[int]) -> None:
    """Slots `slots` of `src` into the same slots of `dst`, one indexed copy a tensor."""
    index = torch.tensor(slots, device=src.rec[0].device)
    for s, d in zip(src.conv + src.rec, dst.conv + dst.rec):
        d.index_copy_(0, index, s.index_select(0, index))


# A mixed step is split when its longest chunk is longer than the chunked delta rule's chunk
# (64 tokens: up to there a row costs about the same whatever its length, padding included)
# and its decode rows would be padded by at least SPLIT_MIN_PADDED_ROWS rows in all. Below
# either, a second forward costs more than the padding (tiny model on the development CPU:
# 1-2 decode rows beside an 8-16-token chunk ran 10-15% slower split; the capacity
# workload's hits, ~20-token chunks beside decodes, 8% slower; 8 decode rows beside a
# 128-token chunk 4.8x faster, beside a 512-token chunk 7x).
SPLIT_MIN_CHUNK = 65
SPLIT_MIN_PADDED_ROWS = 64
# The other rows (prefill chunks, hits' suffixes) are grouped by length with a cost model of
# one eager forward: FORWARD_COST_ROWS + rows x longest row, in padded rows (default model on
# the development CPU: 8-10 ms a forward, 0.2 ms a row; alternating runs, one forward against
# the split: a 5-token chunk beside a 507-token one 200 vs 127 ms, 10 beside 130 77 vs 61,
# 128 beside 384 167 vs 135; 3 x 3 beside 64 the same either way; 300 beside 212 is not split).
# A split is taken only when it saves SPLIT_MIN_SAVED_ROWS padded rows.
FORWARD_COST_ROWS = 48
SPLIT_MIN_SAVED_ROWS = 64


def split_rows(seqs: list[SeqInput]) -> list[list[int]] | None:
    """The rows of a step as parts run one forward each (shortest part first), or None for
    one forward. Decode rows (one-token continuations of cached sequences, the model's fused
    decode path) go apart beside chunks longer than SPLIT_MIN_CHUNK when padding them would
    cost SPLIT_MIN_PADDED_ROWS rows (`split_decode_rows`); the rest are grouped by length
    where that saves SPLIT_MIN_SAVED_ROWS padded rows (`group_by_length`)."""
    decode = split_decode_rows(seqs)
    rest = decode[1] if decode else list(range(len(seqs)))
    groups = group_by_length([len(seqs[b].token_ids) for b in rest])
    if decode is None and groups is None:
        return None
    parts = [[rest[i] for i in g] for g in groups] if groups else [rest]
    return ([decode[0]] if decode else []) + parts


def split_decode_rows(seqs: list[SeqInput]) -> list[list[int]] | None:
    """[decode rows, other rows] of a step that mixes one-token continuations of cached
    sequences with chunks longer than SPLIT_MIN_CHUNK, where padding the decode rows to the
    longest chunk would cost at least SPLIT_MIN_PADDED_ROWS rows; None otherwise."""
    decode = [b for b, s in enumerate(seqs) if len(s.token_ids) == 1 and s.start > 0]
    if not decode or len(decode) == len(seqs):
        return None
    T = max(len(s.token_ids) for s in seqs)
    if T < SPLIT_MIN_CHUNK or len(decode) * (T - 1) < SPLIT_MIN_PADDED_ROWS:
        return None
    chosen = set(decode)
    return [decode, [b for b in range(len(seqs)) if b not in chosen]]


def group_by_length(lengths: list[int]) -> list[list[int]] | None:
    """Indices of `lengths` in groups (shortest group first, each in index order) that
    minimise the modelled cost of one forward per group, FORWARD_COST_ROWS + size x longest;
    None when that saves fewer than SPLIT_MIN_SAVED_ROWS rows over a single forward. The
    best groups are runs of the rows sorted by length (a row never pads to a longer group
    than it must), found by dynamic programming over those runs."""
    n = len(lengths)
    # A split saves at most the padding, less a forward's cost: decode steps (equal rows)
    # and near-equal chunks stop here, before the O(n^2) search.
    if n < 2 or n * max(lengths) - sum(lengths) - FORWARD_COST_ROWS < SPLIT_MIN_SAVED_ROWS:
        return None
    order = sorted(range(n), key=lambda i: -lengths[i])
    best, cut = [0] + [math.inf] * n, [0] * (n + 1)
    for j in range(1, n + 1):  # best[j]: the j longest rows, grouped
        for i in range(j):  # last group: order[i:j], padded to lengths[order[i]]
            cost = best[i] + FORWARD_COST_ROWS + (j - i) * lengths[order[i]]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    if FORWARD_COST_ROWS + n * lengths[order[0]] - best[n] < SPLIT_MIN_SAVED_ROWS:
        return None
    groups, j = [], n
    while j:
        groups.append(sorted(order[cut[j]:j]))
        j = cut[j]
    return groups


def _sub_step(rows: list[int], B: int, T: int, seqs: list[SeqInput], capture_src,
              capture_dst, snapshots):
    """The step's inputs restricted to `rows` (a sub-batch padded to its own length):
    capture rows (flat indices into the [B, T] padded view) and snapshot rows renumbered."""
    T_sub = max(len(s.token_ids) for s in seqs)
    src = dst = None
    if capture_src is not None and capture_src.numel():
        where = torch.full((B,), -1, dtype=torch.long)
        where[rows] = torch.arange(len(rows))
        b, t = capture_src.div(T, rounding_mode="floor"), capture_src.remainder(T)
        nb = where[b.cpu()].to(capture_src.device)
        keep = nb >= 0
        src, dst = (nb * T_sub + t)[keep], capture_dst[keep]
    new_row = {b: i for i, b in enumerate(rows)}
    snaps = [(new_row[r], off, slot) for r, off, slot in snapshots or () if r in new_row]
    return seqs, src, dst, snaps


class _LoadOnly:
    """Layer hooks that wait for loads but do not start the offload of new KV."""

    def __init__(self, hooks) -> None:
        self.hooks = hooks

    def after_write(self, layer: int) -> None:
        pass

    def before_read(self, layer: int) -> None:
        self.hooks.before_read(layer)
