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
    # Retrieval curriculum: fill task sequences with back-to-back examples whose contexts are
    # `task_context` bytes (a (min, max) range; None: 30-95% of the sequence, one example then
    # library text), and weigh their non-answer bytes by `text_weight`.
    task_context: tuple[int, int] | None = None
    text_weight: float = 1.0

    def __post_init__(self) -> None:
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
        if self.task_context is not None and self.rng.random() < self.task_fraction:
            return self._packed_tasks(n)
        if n >= 256 and self.rng.random() < self.task_fraction:
            kind = self.rng.choice(self.kinds)
            ctx = max(min(int(n * self.rng.uniform(0.3, 0.95)), n - 16), 128)
            ex = make_example(kind, ctx, self.rng, self.extra_queries)
            task = list(ex.text.encode()) + [EOT]
            task = task[: n]
            seq[: len(task)] = torch.tensor(task)
            for a0, a1 in ex.answer_spans():
                weight[a0 - 1: a1 - 1] = self.answer_weight  # target t predicts byte t+1
        return seq, weight

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
