"""Training and held-out text: the running interpreter's standard library, split by path hash."""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_build.tasks import TASKS, make_example

EOT = 256  # <|endoftext|> in the byte tokenizer
HELD_OUT_PERCENT = 5


def stdlib_files() -> list[Path]:
    """Sorted .py files of the standard library (site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_held_out(path: Path) -> bool:
    root = Path(sysconfig.get_paths()["stdlib"])
    digest = hashlib.sha256(path.relative_to(root).as_posix().encode()).digest()
    return digest[0] * 100 // 256 < HELD_OUT_PERCENT


def load_split(held_out: bool, max_bytes: int | None = None) -> bytes:
    """Concatenated file bytes of one split, each file followed by the end-of-text marker."""
    parts, size = [], 0
    for p in stdlib_files():
        if is_held_out(p) != held_out:
            continue
        try:
            data = p.read_bytes()
        except OSError:
            continue
        parts.append(data)
        size += len(data)
        if max_bytes is not None and size >= max_bytes:
            break
    return b"\x00".join(parts)  # NUL never occurs in source; mapped to EOT below


def to_ids(data: bytes) -> torch.Tensor:
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    ids[ids == 0] = EOT
    return ids


@dataclass
class MixedSampler:
    """Sequences of `seq_len + 1` ids: stdlib text, or a synthetic task then stdlib text.

    Returns ids and a loss weight per target: answer bytes of tasks weigh `answer_weight`.
    """

    text: torch.Tensor
    task_fraction: float = 0.5
    answer_weight: float = 4.0
    seed: int = 0
    extra_queries: int = 0  # further kv questions per task context (denser retrieval signal)
    kinds: tuple[str, ...] = TASKS
    # Task contexts of `task_context` bytes (a (min, max) range; None: 30-95% of the sequence)
    # and the layout of a task sequence: "single" (one example at the start, then library
    # text) or "packed" (examples back to back). Non-answer bytes of tasks weigh `text_weight`.
    task_context: tuple[int, int] | None = None
    text_weight: float = 1.0
    task_layout: str = "single"

    def __post_init__(self) -> None:
        if self.task_layout not in ("single", "packed"):
            raise ValueError(f"task_layout must be 'single' or 'packed', got {self.task_layout!r}")
        self.rng = random.Random(self.seed)

    def sample(self, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        weights = torch.ones(batch_size, seq_len)
        for b in range(batch_size):
            ids[b], weights[b] = self._one(seq_len + 1)
        return ids, weights

    def _one(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.rng.randrange(len(self.text) - n)
        seq = self.text[start:start + n].clone()
        weight = torch.ones(n - 1)
        if self.task_layout == "packed" and self.task_context is not None:
            if self.rng.random() < self.task_fraction:
                return self._packed_tasks(n)
            return seq, weight
        if (n >= 256 or self.task_context is not None) and self.rng.random() < self.task_fraction:
            ex = make_example(self.rng.choice(self.kinds), self._context_len(n), self.rng,
                              self.extra_queries)
            task = list(ex.text.encode()) + [EOT]
            task = task[: n]
            seq[: len(task)] = torch.tensor(task)
            weight[: len(task) - 1] = self.text_weight
            for a0, a1 in ex.answer_spans():  # target t predicts byte t+1
                weight[max(a0 - 1, 0): max(min(a1, len(task)) - 1, 0)] = self.answer_weight
        return seq, weight

    def _context_len(self, n: int) -> int:
        """Context bytes of a single task that leave room for its questions in n bytes."""
        room = n - 24 - 18 * min(self.extra_queries, 3)  # later questions may be cut off
        if self.task_context is None:
            return max(min(int(n * self.rng.uniform(0.3, 0.95)), room), 128)
        lo, hi = self.task_context
        return self.rng.randint(min(lo, max(room, 32)), max(min(hi, room), 32))

    def _packed_tasks(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Examples back to back (each closed by the end-of-text marker) up to n ids."""
        ids: list[int] = []
        answer_targets: list[tuple[int, int]] = []
        lo, hi = self.task_context
        hi = max(lo, min(hi, int(0.9 * n)))  # contexts grow with the sequence-length phases
        while len(ids) < n:
            ex = make_example(self.rng.choice(self.kinds), self.rng.randint(lo, hi), self.rng,
                              self.extra_queries)
            base = len(ids)
            answer_targets += [(base + a, base + b) for a, b in ex.answer_spans()]
            ids += list(ex.text.encode()) + [EOT]
        seq = torch.tensor(ids[:n])
        weight = torch.full((n - 1,), self.text_weight)
        for a0, a1 in answer_targets:
            weight[max(a0 - 1, 0): max(a1 - 1, 0)] = self.answer_weight
        return seq, weight
