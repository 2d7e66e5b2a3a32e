"""The training sampler: where tasks go in a sequence and how their bytes are weighted."""

from __future__ import annotations

import pytest
import torch

from engine_build.corpus import EOT, MixedSampler

TEXT = torch.tensor(list(b"def f(x):\n    return x + 1\n" * 400))


def _decode(ids: torch.Tensor) -> str:
    return bytes(i for i in ids.tolist() if i < 256).decode()


def test_single_layout_puts_one_task_first_and_weighs_only_its_answers():
    s = MixedSampler(TEXT, task_fraction=1.0, answer_weight=3.0, kinds=("kv",), extra_queries=5,
                     task_context=(150, 250), text_weight=0.0, seed=4)
    ids, w = s.sample(6, 384)
    for row, weight in zip(ids, w):
        text = _decode(row)
        assert text.startswith("Key-value store.")
        end = row.tolist().index(EOT)
        store = text[: text.index("Lookup ")]
        assert 150 - 24 <= len(store) <= 250  # the context range (the question takes ~24)
        # Weighted targets predict exactly the answer digits; the library text after the
        # task keeps weight 1, the task's other bytes weight 0 (text_weight).
        targets = row[1:]
        answers = (weight == 3.0).nonzero().flatten()
        assert len(answers) == 4 * 6  # all six answers fit
        assert all(chr(int(targets[i])).isdigit() for i in answers)
        assert torch.all(weight[end:] == 1.0)
        assert set(weight[:end].unique().tolist()) <= {0.0, 3.0}


def test_context_range_is_capped_by_the_sequence_length():
    s = MixedSampler(TEXT, task_fraction=1.0, kinds=("kv",), extra_queries=3,
                     task_context=(40, 4000), seed=1)
    ids, _ = s.sample(4, 256)
    for row in ids:
        assert EOT in row.tolist()  # the whole first question and its answer fit


def test_packed_layout_and_bad_layout():
    s = MixedSampler(TEXT, task_fraction=1.0, kinds=("kv",), task_context=(60, 120),
                     task_layout="packed", seed=2)
    ids, _ = s.sample(1, 512)
    assert _decode(ids[0]).count("Key-value store.") >= 2
    with pytest.raises(ValueError, match="task_layout"):
        MixedSampler(TEXT, task_layout="interleaved")
