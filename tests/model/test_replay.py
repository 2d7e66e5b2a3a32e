"""Group replay from exact entry hidden states reproduces the prefill's linear states."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import make_hf_checkpoint

from backend.model import load_model
from backend.model.generate import PagedSession


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay")
    make_hf_checkpoint(path, seed=11)
    return load_model(path)


@pytest.fixture(scope="module")
def tokens(model):
    return torch.randint(0, model.config.vocab_size, (1, 260),
                         generator=torch.Generator().manual_seed(5))


def _prefill_states(model, tokens, j):
    session = PagedSession(model, batch_size=1, max_tokens=j, page_size=64)
    session.step([tokens[0, :j].tolist()])
    return session.states.read(0)


@pytest.mark.parametrize("j", [1, 3, 64, 100, 256])
def test_replay_over_all_positions_is_exact(model, tokens, j):
    cfg = model.config
    states = _prefill_states(model, tokens, j)
    hidden = model.capture_hidden(tokens[:, :j], torch.arange(j).unsqueeze(0))  # [G, 1, j, D]
    for g, layers in enumerate(cfg.group_state_layers):
        replayed = model.replay_group(g, hidden[g])
        for layer_id, (conv, rec) in zip(layers, replayed):
            want_conv, want_rec = states[cfg.linear_layer_ids.index(layer_id)]
            torch.testing.assert_close(conv[0], want_conv, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(rec[0], want_rec, atol=1e-5, rtol=1e-4)


def test_packed_replay_equals_one_by_one(model, tokens):
    lens = [40, 130, 7]
    hidden = model.capture_hidden(tokens[:, :130], torch.arange(130).unsqueeze(0))[0, 0]
    packed = torch.zeros(3, 130, hidden.shape[-1])
    for b, n in enumerate(lens):
        packed[b, :n] = hidden[130 - n:]
    together = model.replay_group(0, packed, torch.tensor(lens))
    for b, n in enumerate(lens):
        alone = model.replay_group(0, hidden[130 - n:].unsqueeze(0))
        for (c_all, r_all), (c_one, r_one) in zip(together, alone):
            torch.testing.assert_close(c_all[b], c_one[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(r_all[b], r_one[0], atol=1e-5, rtol=1e-4)


def test_capture_writes_group_entry_rows_into_buffer(model, tokens):
    positions = torch.tensor([[3, 60, 61, 62, 63]])
    picked = model.capture_hidden(tokens[:, :64], positions)
    full = model.capture_hidden(tokens[:, :64], torch.arange(64).unsqueeze(0))
    torch.testing.assert_close(picked, full[:, :, positions[0]])
    # Different groups see different residual streams.
    assert not torch.allclose(picked[0], picked[1])
