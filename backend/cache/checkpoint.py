"""Checkpoint baseline (SGLang mamba radix cache / TensorRT-LLM periodic snapshots).

Full recurrent + conv states of all linear layers, one checkpoint slot each. A hit can only
resume at a checkpoint, so the usable match ends at the deepest checkpointed page; the
tokens after it are recomputed. Two placements:

- "grid" (`checkpoint_positions`, the default): a state at every multiple of the interval C
  inside a prefill and at the end of each prompt (its last whole page, because the tree only
  holds whole pages); in decode the latest page boundary.
- "sglang" (`sglang_positions`): where SGLang's mamba radix cache with its extra buffer
  (`--mamba-scheduler-strategy extra_buffer`, v0.5) keeps states: one per prefill chunk
  (its chunked prefill, e.g. 8192 tokens): at the request's branch point when that lies in
  the chunk (the deepest page-aligned position its KV matched beyond the deepest saved
  state, so that the next sibling resumes there), otherwise at the chunk's last whole page;
  in decode at multiples of the track interval C only. A prompt that diverges inside a long
  cached prefix without a state there recomputes from the deepest earlier state.
"""

from __future__ import annotations


def checkpoint_positions(prompt_len: int, start: int, interval: int, page_size: int) -> list[int]:
    """Token positions (state after that many tokens) where a prefill from `start` stores
    checkpoints: multiples of `interval` in (start, prompt_len], plus the last page boundary
    of the prompt. Sorted, without duplicates.
    """
    if page_size < 1 or interval < 1 or interval % page_size:
        raise ValueError(
            f"interval={interval} must be a positive multiple of page_size={page_size}"
        )
    if not 0 <= start <= prompt_len:
        raise ValueError(f"need 0 <= start <= prompt_len, got start={start}, {prompt_len=}")
    first = (start // interval + 1) * interval
    positions = list(range(first, prompt_len + 1, interval))
    end = prompt_len // page_size * page_size
    if end > start and (not positions or positions[-1] != end):
        positions.append(end)
    return positions


def sglang_positions(prompt_len: int, start: int, chunk: int, page_size: int,
                     branch_point: int | None = None) -> list[int]:
    """Token positions where a prefill from `start` stores states under the "sglang"
    placement: one per chunk of `chunk` tokens from `start`, at `branch_point` if it lies
    strictly inside that chunk, else at the chunk's last page boundary (none for a chunk
    shorter than a page). Sorted."""
    if page_size < 1 or chunk < 1 or chunk % page_size:
        raise ValueError(f"chunk={chunk} must be a positive multiple of page_size={page_size}")
    if not 0 <= start <= prompt_len:
        raise ValueError(f"need 0 <= start <= prompt_len, got start={start}, {prompt_len=}")
    positions = []
    for lo in range(start, prompt_len, chunk):
        hi = min(lo + chunk, prompt_len)
        if branch_point is not None and lo < branch_point < hi:
            positions.append(branch_point)
        elif hi - lo >= page_size:
            positions.append(lo + (hi - lo) // page_size * page_size)
    return positions
