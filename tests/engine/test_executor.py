"""The eager executor's split of steps whose rows differ in length: decode tokens beside
prefill chunks, short chunks beside long ones."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import random_prompt

import backend.engine.executor as executor_mod
from backend.engine.executor import (
    FORWARD_COST_ROWS,
    SPLIT_MIN_CHUNK,
    SPLIT_MIN_PADDED_ROWS,
    SPLIT_MIN_SAVED_ROWS,
    TorchExecutor,
    group_by_length,
    split_decode_rows,
    split_rows,
)
from backend.model import SeqInput, load_model
from backend.model.hybrid import HybridForCausalLM
from engine_build.hf_export import save_hf_directory
from engine_build.train_tiny import init_weights, tiny_config

SIZES = dict(num_kv_pages=24, page_size=16, num_run_slots=4, num_saved_slots=4,
             num_anchor_rows=8)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m = HybridForCausalLM(tiny_config(hidden=64, layers=4))
    init_weights(m, seed=5, dt_init="log-uniform")
    return load_model(save_hf_directory(m, tmp_path_factory.mktemp("split")))


def _prefix_step(model):
    """Prompts of rows 0, 1 and 3 (so that the mixed step continues them)."""
    V = model.config.vocab_size
    tables = (torch.arange(0, 6), torch.arange(6, 12), torch.arange(12, 22),
              torch.arange(22, 24))
    return [SeqInput(random_prompt(40, V, 1), 0, tables[0], 0),
            SeqInput(random_prompt(20, V, 2), 0, tables[1], 1),
            SeqInput(random_prompt(30, V, 5), 0, tables[3], 3)], tables


def _mixed_step(model, tables):
    """Decode tokens (rows 0 and 3), a 10-token continuation (row 1) and a fresh 150-token
    prompt (row 2, whose state after 128 tokens is saved): anchors captured in every row."""
    V = model.config.vocab_size
    seqs = [SeqInput([7], 40, tables[0], 0), SeqInput(random_prompt(10, V, 3), 20, tables[1], 1),
            SeqInput(random_prompt(150, V, 4), 0, tables[2], 2), SeqInput([9], 30, tables[3], 3)]
    T = 150
    src = torch.tensor([0 * T + 0, 1 * T + 3, 2 * T + 100, 2 * T + 149, 3 * T])
    dst = torch.tensor([5, 2, 7, 0, 4])
    return seqs, src, dst, [(2, 128, 3)]


def _run(model, split: bool, monkeypatch, hooks=None):
    with monkeypatch.context() as m:
        if not split:
            m.setattr(executor_mod, "split_rows", lambda seqs: None)
        ex = TorchExecutor(model, **SIZES)
        prefix, tables = _prefix_step(model)
        ex.forward(prefix)
        seqs, src, dst, snaps = _mixed_step(model, tables)
        return ex, ex.forward(seqs, src, dst, layer_hooks=hooks, snapshots=snaps)


def test_a_mixed_step_split_equals_one_padded_forward(model, monkeypatch):
    """The step runs as three forwards (decode rows 0 and 3, the 10-token row, the 150-token
    row) and computes what one padded forward does."""
    prefix, tables = _prefix_step(model)
    assert split_rows(_mixed_step(model, tables)[0]) == [[0, 3], [1], [2]]
    ref_ex, ref = _run(model, False, monkeypatch)
    ex, out = _run(model, True, monkeypatch)
    torch.testing.assert_close(out, ref, atol=1e-5 * ref.abs().max().item(), rtol=0)
    for name in ("kv", "run_states", "saved_states"):
        a, b = getattr(ref_ex, name), getattr(ex, name)
        pairs = zip(a.k + a.v, b.k + b.v) if name == "kv" else zip(a.conv + a.rec,
                                                                   b.conv + b.rec)
        for x, y in pairs:
            torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
    assert ref_ex.saved_states.rec[0][3].abs().sum() > 0  # the snapshot was taken
    torch.testing.assert_close(ex.anchors, ref_ex.anchors, atol=1e-5, rtol=1e-5)
    assert (ref_ex.anchors[:, [0, 2, 4, 5, 7]].abs().sum(-1) > 0).all()  # every capture landed


def test_new_kv_is_offloaded_only_after_every_part_wrote_it(model, monkeypatch):
    events = []

    class Hooks:
        def after_write(self, a):
            events.append(("offload", a))

        def before_read(self, a):
            events.append(("load", a))

    forwards = []
    real = HybridForCausalLM.forward_batch
    monkeypatch.setattr(HybridForCausalLM, "forward_batch",
                        lambda self, b, last_only=True: forwards.append(len(events))
                        or real(self, b, last_only))
    _run(model, True, monkeypatch, hooks=Hooks())
    n = len(model.config.attention_layer_ids)
    first, last = forwards[-3], forwards[-1]  # events before the first and the last part
    assert events[first:last] == [("load", a) for a in range(n)] * 2
    assert sorted(e for e in events[last:] if e[0] == "offload") == [("offload", a)
                                                                    for a in range(n)]


def test_split_decode_rows_picks_one_token_continuations():
    def seq(n, start):
        return SeqInput([1] * n, start)

    assert split_decode_rows([seq(1, 5), seq(1, 9)]) is None  # decode only
    assert split_decode_rows([seq(30, 0), seq(4, 9)]) is None  # no decode row
    # a one-token fresh prompt is not a decode row (it has no state to continue)
    assert split_decode_rows([seq(1, 0), seq(30, 0)]) is None
    assert split_decode_rows([seq(80, 0), seq(1, 7), seq(1, 0), seq(1, 3)]) == [[1, 3],
                                                                               [0, 2]]
    # padding cheaper than a second forward: chunks of at most 64 tokens, or few padded rows
    assert (SPLIT_MIN_CHUNK, SPLIT_MIN_PADDED_ROWS) == (65, 64)
    assert split_decode_rows([seq(64, 0)] + [seq(1, 7)] * 8) is None
    assert split_decode_rows([seq(65, 0)] + [seq(1, 7)] * 8) == [list(range(1, 9)), [0]]
    assert split_decode_rows([seq(200, 0), seq(1, 7)]) == [[1], [0]]


def test_group_by_length_pays_a_forward_only_for_padding_it_saves():
    assert (FORWARD_COST_ROWS, SPLIT_MIN_SAVED_ROWS) == (48, 64)
    assert group_by_length([300]) is None
    assert group_by_length([5, 507]) == [[0], [1]]  # one: 48 + 1014 rows; two: 96 + 512
    assert group_by_length([300, 212]) is None  # saves 40 rows
    assert group_by_length([64, 64, 64, 64]) is None
    assert group_by_length([20, 1, 1, 1]) is None  # saves 9 rows
    # rows group with those of their length, each group padded to its own longest
    assert group_by_length([10, 400, 20, 390]) == [[0, 2], [1, 3]]
    assert group_by_length([400, 1, 200, 2, 390]) == [[1, 3], [2], [0, 4]]


def test_split_rows_takes_decode_rows_apart_then_groups_the_rest():
    def seq(n, start):
        return SeqInput([1] * n, start)

    assert split_rows([seq(1, 5), seq(1, 9)]) is None
    assert split_rows([seq(300, 0), seq(212, 40)]) is None
    assert split_rows([seq(300, 0), seq(1, 7), seq(20, 0)]) == [[1], [2], [0]]
    assert split_rows([seq(300, 0), seq(1, 7), seq(280, 0)]) == [[1], [0, 2]]
    assert split_rows([seq(20, 0), seq(507, 64)]) == [[0], [1]]
