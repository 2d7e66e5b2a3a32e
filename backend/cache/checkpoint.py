"""Checkpoint baseline (SGLang mamba radix cache / TensorRT-LLM periodic snapshots).

Full recurrent + conv states of all linear layers are kept at every multiple of the track
interval C and at the end of each prompt, one checkpoint slot each. A hit can only resume at
a checkpoint, so the usable match ends at the deepest checkpointed page; the tokens after it
are recomputed. The prompt-end checkpoint is taken at the last whole page of the prompt,
because the tree only holds whole pages.
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
