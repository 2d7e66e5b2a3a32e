"""The CPU fast path for decode steps (`backend/model/decode.py`) against the general layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_oracle import NEMOTRON_H_CONFIGS, make_nemotron_h_checkpoint

from backend.model import load_model
from backend.model.batch import Capture, ForwardBatch, SeqInput
from backend.model.decode import MAX_FAST_TOKENS, FastDecode
from backend.model.generate import PagedSession
from backend.model.hybrid import HybridForCausalLM
from backend.model.linear import unpack_linears
from backend.model.mlp import ReluSquaredMLP
from engine_build.hf_export import save_hf_directory
from engine_build.train_tiny import init_weights, tiny_config

CONFIGS = {
    # the default model's shapes, smaller: 2 value heads per key head
    "gqa": dict(hidden=64, layers=4),
    # one value head per key head, biased attention projections, whole-head rotary, untied
    "plain": dict(hidden=48, layers=4, linear_num_value_heads=2, attention_bias=True,
                  partial_rotary_factor=1.0, tie_word_embeddings=False, num_key_value_heads=4),
}


def _config(hidden: int, layers: int, **overrides):
    cfg = tiny_config(hidden=hidden, layers=layers)
    return dataclasses.replace(cfg, **overrides)


NEMOTRON_H = {
    # transformers' Nemotron-H layout of the oracle tests (conv bias, no other biases)
    "nemotron_h": {},
    # the MLP's and the Mamba2 projections' biases on (transformers' Nemotron-H attention
    # has none), one B/C group, more heads per group
    "nemotron_h_biases": dict(mlp_bias=True, use_bias=True, n_groups=1, mamba_num_heads=4,
                              mamba_head_dim=16),
    # mixture-of-experts layers (their general code inside the fused step)
    "nemotron_h_moe": NEMOTRON_H_CONFIGS["moe-latent"],
}


@pytest.fixture(scope="module", params=list(CONFIGS) + list(NEMOTRON_H))
def model(request, tmp_path_factory):
    if request.param in NEMOTRON_H:
        pytest.importorskip("transformers")

        path = tmp_path_factory.mktemp(request.param)
        make_nemotron_h_checkpoint(path, seed=3, vocab_size=260, **NEMOTRON_H[request.param])
        if NEMOTRON_H[request.param]:  # biases start at zero: move them
            from safetensors.torch import load_file, save_file

            weights = load_file(path / "model.safetensors")
            for name, w in weights.items():
                if name.endswith("bias") and "conv1d" not in name:
                    weights[name] = w + 0.2 * torch.randn_like(w)
            save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        loaded = load_model(path)
        assert loaded.fast_decode is not None
        return loaded
    model = HybridForCausalLM(_config(**CONFIGS[request.param]))
    init_weights(model, seed=3, dt_init="log-uniform", qk_gain=2.0)
    with torch.no_grad():  # norms and biases away from their initial values
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    loaded = load_model(save_hf_directory(model, tmp_path_factory.mktemp(request.param)))
    assert loaded.fast_decode is not None
    return loaded


def _run(model, fast, batch: int, steps: int, seed: int = 0, max_chunk: int = 1,
         adapters: list[int] | None = None):
    """Prefill ragged prompts, then `steps` steps of 1..max_chunk tokens a row (ragged, with
    logits at every row's tokens where max_chunk > 1); logits of every step and the final
    KV / states buffers. `adapters`: each row's LoRA adapter."""
    saved = model.fast_decode
    model.fast_decode = fast
    try:
        g = torch.Generator().manual_seed(seed)
        session = PagedSession(model, batch, 400, page_size=16)
        if adapters is not None:
            session.adapters = adapters[:batch]
        session.step([torch.randint(0, 250, (n,), generator=g).tolist()
                      for n in (37, 5, 64, 90, 1, 17, 33, 48)[:batch]])
        logits = []
        for _ in range(steps):
            sizes = torch.randint(1, max_chunk + 1, (batch,), generator=g).tolist()
            chunks = [torch.randint(0, 250, (n,), generator=g).tolist() for n in sizes]
            if max_chunk == 1:
                logits.append(session.step(chunks))
                continue
            T = max(sizes)  # every token's logits, through forward_batch's logit_index
            index = torch.tensor([b * T + t for b, n in enumerate(sizes) for t in range(n)])
            seqs = [SeqInput(c, session.lengths[b], session.page_tables[b], b,
                             session.adapters[b]) for b, c in enumerate(chunks)]
            fb = ForwardBatch.build(seqs, session.kv, session.states)
            logits.append(model.forward_batch(fb, logit_index=index))
            for b, n in enumerate(sizes):
                session.lengths[b] += n
        return torch.cat(logits), session
    finally:
        model.fast_decode = saved


def _assert_same(model, batch: int, steps: int, **options) -> None:
    """The fast path's logits, states and KV against the general layers'."""
    ref, ref_s = _run(model, None, batch, steps, **options)
    out, out_s = _run(model, model.fast_decode, batch, steps, **options)
    scale = ref.abs().max().item()
    assert (out - ref).abs().max().item() <= 1e-5 * scale
    # each buffer to 1e-5 of its own scale: float32 sums in another order differ by a few
    # ulps of the largest values (keys reach ~9 with the LoRA terms), not of each element
    for a, b in zip(ref_s.states.rec + ref_s.states.conv + ref_s.kv.k + ref_s.kv.v,
                    out_s.states.rec + out_s.states.conv + out_s.kv.k + out_s.kv.v):
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, a.abs().max().item())


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_fast_decode_matches_the_general_layers(model, batch):
    _assert_same(model, batch, 40)


@pytest.mark.parametrize("batch", [1, 5])
def test_fast_steps_of_several_tokens_match_the_general_layers(model, batch):
    """Steps of 1..6 tokens a row (ragged: padded rows), every token's logits: the fused
    layers' recurrences a token at a time against the general path's chunked forms."""
    _assert_same(model, batch, 12, seed=1, max_chunk=6)


LORA_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z",
                "in_proj_b", "in_proj_a", "out_proj", "in_proj", "gate_proj", "up_proj",
                "down_proj"}


@pytest.mark.parametrize("rows", [[1, 1, 1, 1, 1], [0, 1, 2, 0, 2]])
def test_lora_rows_on_the_fast_path_match_the_general_layers(model, rows):
    """Rows on LoRA adapters (all on one; mixed with base-model rows): the fused products
    with each part's low-rank terms against the general layers', one- and multi-token
    steps; and the adapters change the logits (terms left out would show)."""
    from backend.model.linear import Linear
    from backend.model.lora import LoraAdapter, attach

    g = torch.Generator().manual_seed(7)
    adapters = {}
    for index in (1, 2):
        adapter = LoraAdapter(f"a{index}", None, 4, 2.0)
        for name, m in model.named_modules():
            if isinstance(m, Linear) and name.rsplit(".", 1)[-1] in LORA_TARGETS \
                    and ".experts." not in name:
                adapter.weights[name] = (torch.randn(4, m.in_features, generator=g) * 0.1,
                                         torch.randn(m.out_features, 4, generator=g) * 0.1)
        adapters[index] = adapter
    base, _ = _run(model, model.fast_decode, 5, 6)
    attach(model, adapters)
    try:
        _assert_same(model, 5, 12, adapters=rows)
        _assert_same(model, 5, 6, seed=1, max_chunk=6, adapters=rows)
        adapted, _ = _run(model, model.fast_decode, 5, 6, adapters=rows)
    finally:
        attach(model, {})
    assert (adapted - base).abs().max().item() > 1e-2


def test_fast_decode_takes_only_short_steps_of_cached_sequences(model, monkeypatch):
    calls = []
    real = FastDecode.run
    monkeypatch.setattr(FastDecode, "run", lambda self, b: calls.append(b) or real(self, b))
    session = PagedSession(model, 2, 100)
    session.step([[1, 2, 3], [4, 5]])  # prefill from empty state
    assert not calls
    session.step([[6], [7]])
    assert len(calls) == 1
    session.step([[8, 9], [10]])  # two tokens in one row
    assert len(calls) == 2
    session.step([list(range(MAX_FAST_TOKENS + 1)), [10]])  # a long chunk: the general path
    assert len(calls) == 2
    fresh = PagedSession(model, 2, 100)
    fresh.step([[1, 2]], rows=[0])
    fresh.step([[3], [4]])  # row 1 starts from zero state
    assert len(calls) == 2


def test_weights_edited_after_loading_are_seen(model):
    """An in-place edit (and a replaced parameter) reaches both paths: no stale copy."""
    layers = model.model.layers
    linear = next(layer for layer in layers if layer.is_linear)
    attn = next(layer for layer in layers if not layer.is_linear and
                getattr(layer, "is_attention", True))
    keep = {n: p.detach().clone() for n, p in model.named_parameters()}
    old_norm = model.model.norm.weight
    try:
        with torch.no_grad():
            if model.config.is_nemotron_h:
                mlp = next(layer for layer in layers
                           if isinstance(layer.mixer, ReluSquaredMLP))
                linear.mixer.in_proj.weight.mul_(-1.5)
                linear.mixer.A_log.add_(0.5)
                attn.mixer.k_proj.weight.mul_(0.5)
                mlp.mixer.up_proj.weight.add_(0.01)
            else:
                linear.linear_attn.in_proj_z.weight.mul_(-1.5)
                linear.linear_attn.A_log.add_(0.5)
                attn.self_attn.k_proj.weight.mul_(0.5)
                attn.mlp.up_proj.weight.add_(0.01)
        model.model.norm.weight = torch.nn.Parameter(old_norm.detach() + 0.3)
        ref, _ = _run(model, None, 2, 5)
        out, _ = _run(model, model.fast_decode, 2, 5)
        assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
        # and the edit changed the logits (a stale copy would have been visible)
        model.model.norm.weight = old_norm
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(keep[n])
        before, _ = _run(model, model.fast_decode, 2, 5)
        assert (before - out).abs().max().item() > 1e-3
    finally:
        model.model.norm.weight = old_norm
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(keep[n])


def test_capture_and_layer_hooks_during_decode(model):
    """Anchor capture writes the same group-entry rows; the tiered KV's hooks run in order."""
    class Hooks:
        def __init__(self):
            self.events = []

        def after_write(self, a):
            self.events.append(("write", a))

        def before_read(self, a):
            self.events.append(("read", a))

    results = []
    for fast in (None, model.fast_decode):
        model.fast_decode, saved = fast, model.fast_decode
        try:
            session = PagedSession(model, 3, 100)
            session.step([[1, 2, 3], [4, 5, 6, 7], [8]])
            seqs = [SeqInput([9 + r], session.lengths[r], session.page_tables[r], r)
                    for r in range(3)]
            batch = ForwardBatch.build(seqs, session.kv, session.states)
            G, D = model.config.num_groups, model.config.hidden_size
            buffers = torch.zeros(G, 5, D)
            batch.capture = Capture(torch.tensor([2, 0]), torch.tensor([4, 1]), buffers)
            batch.layer_hooks = hooks = Hooks()
            logits = model.forward_batch(batch)
            results.append((logits, buffers, hooks.events))
        finally:
            model.fast_decode = saved
    (ref, ref_buf, ref_ev), (out, out_buf, out_ev) = results
    assert torch.allclose(out, ref, atol=1e-5 * ref.abs().max().item(), rtol=0)
    assert ref_buf.abs().sum() > 0
    assert torch.allclose(out_buf, ref_buf, atol=1e-5, rtol=0)
    assert out_ev == ref_ev and len(ref_ev) == 2 * len(model.config.attention_layer_ids)


def test_fast_decode_is_off_where_it_does_not_apply(tmp_path, monkeypatch):
    model = HybridForCausalLM(_config(hidden=32, layers=4))
    init_weights(model, seed=0)
    path = save_hf_directory(model, tmp_path / "m")
    assert load_model(path).fast_decode is not None
    assert load_model(path, dtype=torch.bfloat16).fast_decode is None
    assert load_model(path, pack=False).fast_decode is None
    loaded = load_model(path)
    unpack_linears(loaded)
    assert loaded.fast_decode is None
    monkeypatch.setenv("SUFFIXREPLAY_FAST_DECODE", "0")
    assert load_model(path).fast_decode is None
    monkeypatch.setenv("SUFFIXREPLAY_FAST_DECODE", "1")
    monkeypatch.setenv("SUFFIXREPLAY_PACKED_LINEAR", "0")
    assert load_model(path).fast_decode is None
