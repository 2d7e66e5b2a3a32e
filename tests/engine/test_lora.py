"""LoRA adapters (`backend/model/lora.py`, `Engine.load_lora`): a request on an adapter decodes
what transformers decodes with the adapter merged into the weights (both families); requests
on different adapters and on the base model share a step and each gets its own; an adapter's
prefixes are cached apart from the base model's, and a hit under an adapter (anchors replayed
through the adapted layers, or its live state) decodes the same; bad adapters and names are
errors that say what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import TINY_MODEL_DIR, assert_no_leak, family_checkpoint, make_engine
from hf_oracle import make_lora_adapter, merge_lora

from backend.cache.radix import lora_namespace
from backend.engine import Engine, EngineConfig, SamplingParams
from backend.engine.request import Request
from backend.model import load_model
from backend.model.lora import AdapterError, load_adapter
from backend.replay.budget import ReplayConfig

GREEDY = SamplingParams(max_tokens=10, top_k=1)
QWEN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z",
                "in_proj_b", "in_proj_a", "out_proj", "gate_proj", "up_proj", "down_proj")
NEMOTRON_TARGETS = ("in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                    "up_proj", "down_proj")


def _hf(path, family):
    if family == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM as cls
    else:
        from transformers import NemotronHForCausalLM as cls
    return cls.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def setup(request, tmp_path_factory):
    """(our model, its directory, family, {adapter name: (dir, merged transformers model)})."""
    family = request.param
    if family == "qwen3_5":
        path = TINY_MODEL_DIR
    else:
        path = tmp_path_factory.mktemp("lora-nemotron")
        family_checkpoint(path, family, seed=2)
    targets = QWEN_TARGETS if family == "qwen3_5" else NEMOTRON_TARGETS
    adapters = {}
    for name, seed, rslora in (("math", 1, False), ("chat", 2, True)):
        folder = make_lora_adapter(tmp_path_factory.mktemp(f"lora-{name}"), _hf(path, family),
                                   targets, seed=seed, rslora=rslora)
        adapters[name] = (folder, merge_lora(_hf(path, family), folder))
    return load_model(path), path, family, adapters


def _oracle(hf, prompt: list[int], n: int = 10) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and its logits after the prompt."""
    ids = torch.tensor([prompt])
    out, first = [], None
    with torch.no_grad():
        for _ in range(n):
            logits = hf(ids, use_cache=False).logits[0, -1]
            first = logits if first is None else first
            out.append(int(logits.argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], 1)
    return out, first


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def _engine(setup, **options) -> Engine:
    model, _, _, adapters = setup
    engine = make_engine(model, max_tokens_per_step=200, **options)
    for name, (folder, _) in adapters.items():
        engine.load_lora(name, folder)
    return engine


def test_a_request_on_an_adapter_decodes_what_the_merged_model_decodes(setup):
    model, path, family, adapters = setup
    engine = _engine(setup)
    vocab = model.config.vocab_size
    prompt = _prompt(100, 7, vocab)
    base = engine.generate(prompt, GREEDY)
    for name, (_, merged) in adapters.items():
        want, logits = _oracle(merged, prompt)
        got = engine.generate(prompt, GREEDY, lora_name=name, return_first_logits=True)
        assert got.cached_tokens == 0  # the base model's pages are not this adapter's
        assert got.new_token_ids == want, name
        torch.testing.assert_close(got.first_logits, logits, atol=2e-3, rtol=0)
    # The adapters change the model: otherwise this test could not fail.
    assert {tuple(_oracle(m, prompt)[0]) for _, m in adapters.values()} != {
        tuple(base.new_token_ids)}
    assert_no_leak(engine)


def test_adapters_and_the_base_model_share_a_step(setup):
    model, _, _, adapters = setup
    engine = _engine(setup)
    prompt = _prompt(90, 8, model.config.vocab_size)
    outputs: dict[str, list[int]] = {}
    for name in (None, "math", "chat"):
        rid = name or "base"
        outputs[rid] = []
        engine.submit(Request(rid, prompt, GREEDY, lora_name=name,
                              on_output=lambda out, rid=rid: outputs[rid].extend(
                                  out.new_token_ids)))
    engine.step()
    assert len(engine.scheduler.running) == 3  # one forward for all three
    stats = engine.stats()
    assert stats["lora_running"] == {"chat": 1, "math": 1}
    assert stats["lora_requests"] == {"chat": 1, "math": 1}
    while engine.has_work:
        engine.step()
    assert outputs["base"] == engine.generate(prompt, GREEDY).new_token_ids
    for name, (_, merged) in adapters.items():
        assert outputs[name] == _oracle(merged, prompt)[0], name
    assert_no_leak(engine)


def _merged(path, folder):
    """Our model with the adapter merged into its weights (the direct test above checks
    the adapter against transformers; this one the cache paths against the same engine)."""
    model = load_model(path)
    adapter = load_adapter("merged", folder, model)
    with torch.no_grad():
        for name, (a, scaled_b) in adapter.weights.items():
            model.get_submodule(name).weight += scaled_b @ a
    return model


@pytest.mark.parametrize("live_state", [False, True], ids=["replay", "live-state"])
def test_a_hit_under_an_adapter_decodes_the_same(setup, live_state):
    """A branch's 144 cached tokens come back under the adapter: its linear states from
    anchors replayed through the adapted layers (suffix replay approximates the states;
    with the live state kept at the branch point's page, exactly). It decodes what the
    same engine decodes on a model with the adapter merged into its weights, with the same
    logits; the other adapter and the base model find none of it."""
    model, path, _, adapters = setup
    replay = ReplayConfig(anchor_density=0.25, budget_fraction=1.0, k_max=8,
                          live_state=live_state)
    engine = _engine(setup, replay=replay)
    merged = make_engine(_merged(path, adapters["math"][0]), max_tokens_per_step=200,
                         replay=replay)
    vocab = model.config.vocab_size
    prompt, other = _prompt(200, 9, vocab), _prompt(60, 10, vocab)
    branch = prompt[:150] + other[:30]
    if live_state:  # the first request's prompt ends at the branch point's page
        prompt = prompt[:144]
    engine.generate(prompt, GREEDY, lora_name="math")
    merged.generate(prompt, GREEDY)
    got = engine.generate(branch, GREEDY, lora_name="math", return_first_logits=True)
    want = merged.generate(branch, GREEDY, return_first_logits=True)
    assert got.cached_tokens == want.cached_tokens == 144
    assert got.replayed_anchors == want.replayed_anchors
    assert (got.replayed_anchors > 0) != live_state
    assert got.new_token_ids == want.new_token_ids
    torch.testing.assert_close(got.first_logits, want.first_logits, atol=2e-3, rtol=0)
    if live_state:  # an exact state: what a full prefill under the adapter decodes
        assert got.new_token_ids == _oracle(adapters["math"][1], branch)[0]
    assert engine.generate(branch, GREEDY, lora_name="chat").cached_tokens == 0
    assert engine.generate(branch, GREEDY).cached_tokens == 0
    assert_no_leak(engine)


def test_a_namespace_reset_covers_its_adapters(setup):
    model, _, _, _ = setup
    engine = _engine(setup)
    prompt = _prompt(100, 11, model.config.vocab_size)
    engine.generate(prompt, GREEDY, cache_salt="t", lora_name="math")
    assert engine.generate(prompt, GREEDY, cache_salt="t", lora_name="math").cached_tokens > 0
    assert engine.reset_prefix_cache("t", every_salt=False)["dropped_pages"] > 0
    assert engine.generate(prompt, GREEDY, cache_salt="t", lora_name="math").cached_tokens == 0
    # No salt is the default namespace under an adapter too (it was "None\x00lora:math":
    # shared with salt "None", untouched by a reset of "")
    engine.generate(prompt, GREEDY, cache_salt=None, lora_name="math")
    assert engine.generate(prompt, GREEDY, cache_salt="", lora_name="math").cached_tokens > 0
    assert engine.generate(prompt, GREEDY, cache_salt="None", lora_name="math"
                           ).cached_tokens == 0
    assert engine.reset_prefix_cache(None, every_salt=False)["dropped_pages"] > 0
    assert engine.generate(prompt, GREEDY, cache_salt=None, lora_name="math").cached_tokens == 0


def test_a_salt_cannot_name_an_adapters_namespace(setup):
    """An adapter's namespace is its request's salt, a NUL and its name: a base-model request
    whose cache_salt spells that would be served the adapter's KV and anchors (computed with
    other weights), and a reset with it would drop the adapter's pages. Such a salt is
    refused; the adapter's pages stay cached."""
    model, _, _, _ = setup
    engine = _engine(setup)
    prompt = _prompt(150, 12, model.config.vocab_size)
    engine.generate(prompt, GREEDY, lora_name="math")
    forged = lora_namespace("", "math")
    with pytest.raises(ValueError, match="cache_salt must not contain NUL"):
        engine.generate(prompt, GREEDY, cache_salt=forged)
    with pytest.raises(ValueError, match="cache_salt must not contain NUL"):
        engine.reset_prefix_cache(forged, every_salt=False)
    assert engine.generate(prompt, GREEDY, lora_name="math").cached_tokens > 0
    assert_no_leak(engine)


def test_bad_adapters_and_names_are_errors(setup, tmp_path):
    model, path, family, adapters = setup
    engine = _engine(setup)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope' \\(loaded: chat, math\\)"):
        engine.submit(Request("x", [5, 6, 7], GREEDY, lora_name="nope"))
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora("math", adapters["math"][0])
    with pytest.raises(ValueError, match="must be 1-128"):
        engine.load_lora("bad name", adapters["math"][0])
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        engine.load_lora("empty", tmp_path)
    # lm_head is not a layer an adapter may change here
    folder = make_lora_adapter(tmp_path / "head", _hf(path, family), ("lm_head",))
    with pytest.raises(AdapterError, match="lm_head"):
        engine.load_lora("head", folder)
    # a lora_B of the wrong shape
    src = adapters["math"][0]
    bad = tmp_path / "shape"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("lora_B.weight"))
    tensors[key] = tensors[key][:-1]
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="lora_B"):
        engine.load_lora("shape", bad)
    config = json.loads((src / "adapter_config.json").read_text())
    save_file(load_file(str(src / "adapter_model.safetensors")),
              str(bad / "adapter_model.safetensors"))
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 4}))
    with pytest.raises(AdapterError, match="rank 4"):  # the files' rank is 8: scale wrong
        engine.load_lora("rank", bad)
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora"):
        engine.load_lora("dora", bad)
    # "false" as a string read as true: the adapter loaded at alpha / sqrt(r), silently
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": "false"}))
    with pytest.raises(AdapterError, match="use_rslora must be true or false"):
        engine.load_lora("rslora", bad)
    # a lora_alpha that is not a finite number (NaN / Infinity parse as JSON), or one that
    # takes lora_B times the scale out of the dtype's range: its requests' logits were NaN,
    # and its KV poisoned the base-model rows that read its pages as padding
    for alpha, message in (("NaN", "not a finite number"), ("Infinity", "not a finite number"),
                           ("1e300", "leaves the range"), ("true", "a number lora_alpha")):
        text = json.dumps({**config, "lora_alpha": 0}).replace('"lora_alpha": 0',
                                                               f'"lora_alpha": {alpha}')
        (bad / "adapter_config.json").write_text(text)
        with pytest.raises(AdapterError, match=message):
            engine.load_lora("alpha", bad)
    # a float64 lora_A past float32's range: finite as stored, inf in the model's dtype
    (bad / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(str(src / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    tensors[key] = tensors[key].double()
    tensors[key][0, 0] = 1e300
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="lora_A leaves the range of torch.float32"):
        engine.load_lora("wide", bad)
    with pytest.raises(ValueError, match="executor 'torch'"):
        EngineConfig(executor="compiled", lora_adapters="math=/x")
    with pytest.raises(ValueError, match="not NAME=PATH"):
        EngineConfig(lora_adapters="math")
    assert engine.stats()["active_requests"] == 0


def test_engines_over_one_model_keep_each_others_adapters(setup):
    """Two engines over one model object: the second one's load_lora attached only its own
    adapters, and the first engine's requests on 'chat' ran as the base model (cached in
    chat's namespace). An engine that is gone leaves no adapter attached."""
    import gc

    model, _, _, adapters = setup
    first = _engine(setup)
    prompt = _prompt(60, 21, model.config.vocab_size)
    want = _oracle(adapters["chat"][1], prompt)[0]
    second = make_engine(model, max_tokens_per_step=200)
    second.load_lora("other", adapters["math"][0])
    assert first.generate(prompt, GREEDY, lora_name="chat").new_token_ids == want
    assert second.adapters["other"] not in first.adapters.values()  # one index each
    second.unload_lora("other")
    assert first.generate(prompt, GREEDY, lora_name="chat", cache_salt="b").new_token_ids == want
    indices = set(first.adapters.values())
    del first
    gc.collect()
    assert not any(indices & set(m.lora or {}) for m in model.modules()
                   if hasattr(m, "lora"))


def test_unloading_an_adapter_forgets_its_outputs_in_the_suffix_corpus(setup):
    """Suffix decoding's corpus kept an unloaded adapter's outputs (another adapter loaded
    under the name drafted from them) until the process ended."""
    from dataclasses import replace

    model, _, _, adapters = setup
    plain = make_engine(model, max_tokens_per_step=200)
    engine = Engine(model, replace(plain.config, speculative_method="suffix",
                                   num_speculative_tokens=4))
    engine.load_lora("math", adapters["math"][0])
    prompt = _prompt(40, 22, model.config.vocab_size)
    engine.generate(prompt, SamplingParams(max_tokens=20, top_k=1))
    engine.generate(prompt, SamplingParams(max_tokens=20, top_k=1), lora_name="math")
    corpus = engine.scheduler.drafter.corpus
    assert {ns for ns, _ in corpus.requests} == {"", lora_namespace("", "math")}
    engine.unload_lora("math")
    assert {ns for ns, _ in corpus.requests} == {""}  # the base model's stay


def test_adapters_named_in_the_engine_config(setup):
    """`lora_adapters` ("name=path,...") loads them with the model (Engine.from_model_dir)."""
    model, path, family, adapters = setup
    if family != "qwen3_5":
        pytest.skip("one family is enough for the configuration path")
    listing = ",".join(f"{n}={folder}" for n, (folder, _) in adapters.items())
    engine = Engine.from_model_dir(path, EngineConfig(lora_adapters=listing))
    assert sorted(engine.adapters) == ["chat", "math"]
    prompt = _prompt(40, 12, model.config.vocab_size)
    got = engine.generate(prompt, GREEDY, lora_name="chat")
    assert got.new_token_ids == _oracle(adapters["chat"][1], prompt)[0]


def test_speculative_decoding_and_beam_search_run_on_the_adapter(setup):
    """ngram drafts verified on the adapter give the tokens a step a token gives; a beam
    search's beams (forked sequences) stay on the adapter: its best beam is what a search
    on the merged-weights model finds."""
    from dataclasses import replace

    model, path, family, adapters = setup
    if family != "qwen3_5":
        pytest.skip("one family is enough for the decoding modes")
    engine = _engine(setup)
    spec = make_engine(model, max_tokens_per_step=200)
    spec = Engine(model, replace(spec.config, speculative_method="ngram",
                                 num_speculative_tokens=4, prompt_lookup_min=2,
                                 speculative_adaptive=False))
    spec.load_lora("math", adapters["math"][0])
    repeat = _prompt(30, 13, model.config.vocab_size) * 3  # much to look up
    sampling = SamplingParams(max_tokens=24, top_k=1)
    want = engine.generate(repeat, sampling, lora_name="math").new_token_ids
    assert spec.generate(repeat, sampling, lora_name="math").new_token_ids == want
    assert spec.stats()["spec_draft_tokens"] > 0
    beams = SamplingParams(max_tokens=8, beam_width=3)
    merged = make_engine(_merged(path, adapters["math"][0]), max_tokens_per_step=200)
    prompt = _prompt(50, 14, model.config.vocab_size)
    got = engine.generate(prompt, beams, lora_name="math")
    assert got.new_token_ids == merged.generate(prompt, beams).new_token_ids
    assert_no_leak(engine)


def test_ssd_pages_of_another_adapter_of_the_same_name_are_foreign(setup, tmp_path):
    """A restarted engine restores an adapter's pages from SSD only when the adapter of that
    name is the same (its weights' digest is part of the namespace's hash): with other
    weights under the name, nothing is restored and the tokens are the new adapter's."""
    from dataclasses import replace

    from backend.cache.tier_config import TierConfig

    model, path, family, adapters = setup
    if family != "qwen3_5":
        pytest.skip("one family is enough for the SSD tier")
    tiers = TierConfig(host_pages=64, ssd_path=str(tmp_path / "ssd"), model_fingerprint="m",
                       ssd_bytes=1 << 30)
    config = replace(make_engine(model, max_tokens_per_step=200).config, tiers=tiers)

    def restarted(folder):
        engine = Engine(model, config)
        engine.load_lora("tuned", folder)
        return engine

    prompt = _prompt(200, 15, model.config.vocab_size)
    first = restarted(adapters["math"][0])
    first.generate(prompt, GREEDY, lora_name="tuned")
    first.tiers.drain()
    first.stop()
    same = restarted(adapters["math"][0])
    assert same.generate(prompt, GREEDY, lora_name="tuned").cached_tokens > 0
    same.tiers.drain()
    same.stop()
    other = restarted(adapters["chat"][0])
    got = other.generate(prompt, GREEDY, lora_name="tuned")
    assert got.cached_tokens == 0
    assert got.new_token_ids == _oracle(adapters["chat"][1], prompt)[0]
    assert other.stats()["tiers"]["restored_pages"] == 0
    other.stop()


def test_adapters_load_and_unload_at_run_time(setup):
    """An adapter loaded while the engine serves runs the next request; unloading one is
    refused while a request on it is queued, then forgets its cached pages (the base model's
    and the other adapter's stay) and its name (a request on it is refused); a reload under
    the name serves it again."""
    model, _, _, adapters = setup
    engine = make_engine(model, max_tokens_per_step=200)
    engine.load_lora("math", adapters["math"][0])
    prompt = _prompt(150, 16, model.config.vocab_size)
    engine.generate(prompt, GREEDY)
    before = engine.generate(prompt, GREEDY, lora_name="math").new_token_ids
    engine.load_lora("chat", adapters["chat"][0])  # at run time
    assert engine.generate(prompt, GREEDY, lora_name="chat").new_token_ids == \
        _oracle(adapters["chat"][1], prompt)[0]
    engine.submit(Request("queued", prompt, GREEDY, lora_name="math"))
    with pytest.raises(ValueError, match="1 request\\(s\\) on LoRA adapter 'math'"):
        engine.unload_lora("math")
    while engine.has_work:
        engine.step()
    assert engine.unload_lora("math")["dropped_pages"] == 150 // 16
    with pytest.raises(ValueError, match="unknown LoRA adapter 'math' \\(loaded: chat\\)"):
        engine.submit(Request("gone", prompt, GREEDY, lora_name="math"))
    assert engine.generate(prompt, GREEDY).cached_tokens > 0
    assert engine.generate(prompt, GREEDY, lora_name="chat").cached_tokens > 0
    engine.load_lora("math", adapters["math"][0])
    again = engine.generate(prompt, GREEDY, lora_name="math")
    assert again.cached_tokens == 0 and again.new_token_ids == before
    stats = engine.stats()
    assert stats["lora_requests"] == {"chat": 2, "math": 3}
    layers = engine._adapters[engine.adapters["chat"]].weights
    per_adapter = sum(a.numel() + b.numel() for a, b in layers.values()) * 4  # float32
    assert stats["memory_bytes"]["lora"] == 2 * per_adapter  # chat and math, same shapes
    assert_no_leak(engine)


@pytest.mark.parametrize("family", ["qwen3_next_moe", "nemotron_h_moe"])
def test_an_adapter_on_the_moe_router_and_shared_expert(tmp_path, family):
    """The MoE block's linear layers but its routed experts (Qwen3-Next's router, shared
    expert and its gate; Nemotron-H's shared expert and latent projections) take an adapter:
    its tokens are those of the model with the adapter merged into those weights; the routed
    experts are refused."""
    from backend.model.linear import Linear
    from backend.model.lora import save_adapter

    family_checkpoint(tmp_path / "m", family, seed=3)
    model = load_model(tmp_path / "m")
    moe = {n for n, m in model.named_modules() if type(m).__name__.endswith("MoE")} or \
        {n.rsplit(".", 2)[0] for n, _ in model.named_modules() if ".experts." in n}
    targets = [n for n, m in model.named_modules() if isinstance(m, Linear)
               and ".experts." not in n and any(n.startswith(b + ".") for b in moe)]
    if family == "qwen3_next_moe":  # (Nemotron-H's router is no linear layer)
        assert any(n.endswith("mlp.gate") for n in targets), targets
    g = torch.Generator().manual_seed(1)
    modules = dict(model.named_modules())
    weights = {n: (torch.randn(4, modules[n].in_features, generator=g) * 0.3,
                   torch.randn(modules[n].out_features, 4, generator=g) * 0.3) for n in targets}
    folder = save_adapter(tmp_path / "adapter", weights, 8.0)
    merged = load_model(tmp_path / "m")
    with torch.no_grad():
        merged_modules = dict(merged.named_modules())
        for n, (a, b) in weights.items():
            merged_modules[n].weight += 2.0 * (b @ a)  # alpha / r
    prompt = _prompt(40, 5, model.config.vocab_size)
    engine = make_engine(model, max_tokens_per_step=200)
    engine.load_lora("moe", folder)
    adapted = engine.generate(prompt, GREEDY, lora_name="moe").new_token_ids
    assert adapted == make_engine(merged).generate(prompt, GREEDY).new_token_ids
    assert adapted != engine.generate(prompt, GREEDY).new_token_ids
    expert = next(n for n, m in model.named_modules() if isinstance(m, Linear)
                  and ".experts." in n) if any(".experts." in n for n, _ in
                                               model.named_modules()) else None
    if expert is not None:
        bad = save_adapter(tmp_path / "expert", {expert: (
            torch.zeros(4, modules[expert].in_features),
            torch.zeros(modules[expert].out_features, 4))}, 8.0)
        with pytest.raises(AdapterError, match="MoE experts"):
            engine.load_lora("expert", bad)
