"""Synthetic tasks: deterministic, about the asked length, and answerable from the context."""

from __future__ import annotations

import random
import re

import pytest

from engine_build.tasks import TASKS, TRAIN_ONLY, make_example


@pytest.mark.parametrize("kind", TASKS + TRAIN_ONLY)
def test_examples_are_deterministic_and_sized(kind):
    a = make_example(kind, 1024, random.Random(7))
    b = make_example(kind, 1024, random.Random(7))
    assert a == b
    assert a.answer and a.prompt.isascii()
    if kind != "copy":
        assert 700 <= len(a.prompt) <= 1100, len(a.prompt)


def test_kv_answer_is_the_value_stored_under_the_asked_key():
    ex = make_example("kv", 1024, random.Random(3), extra_queries=3)
    pairs = dict(re.findall(r"^([a-z]{3})=(\d{4})$", ex.prompt, flags=re.M))
    assert len(pairs) > 60  # ~9 bytes per pair at 1K
    asked = re.search(r"Lookup ([a-z]{3})=$", ex.prompt).group(1)
    assert ex.answer == pairs[asked]
    for question, answer in ex.more:
        assert pairs[re.fullmatch(r"Lookup ([a-z]{3})=", question).group(1)] == answer
    # Answer spans point at the answers inside the training text.
    spans = ex.answer_spans()
    assert [ex.text[a:b] for a, b in spans] == [ex.answer] + [a for _, a in ex.more]
