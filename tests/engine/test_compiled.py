"""The AOT-compiled engine (engine_build/aot.py + CompiledExecutor) against the eager model,
for the default Qwen3.5 model and small Nemotron-H, Nemotron-H MoE and Qwen3-Next MoE
checkpoints (MoE layers through the `moe_experts` operator)."""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import assert_no_leak, make_engine, random_prompt

from backend.engine import Engine, EngineConfig, SamplingParams
from backend.engine.compiled import CompiledExecutor, EngineFormatError, package_digest
from backend.engine.executor import TorchExecutor
from backend.model import SeqInput, load_model
from backend.replay.budget import ReplayConfig

SIZES = (24, 16, 4, 4, 40)  # pages, page size, run slots, saved slots, anchor rows


@pytest.fixture(scope="module",
                params=["qwen3_5", "nemotron_h", "nemotron_h_moe", "qwen3_next_moe"])
def aot_engine(request, aot_engine):
    """(model dir, engine dir) of each family's AOT build (overrides the session fixture)."""
    if request.param == "qwen3_5":
        return aot_engine
    return request.getfixturevalue(f"aot_build_{request.param}")[:2]


@pytest.fixture(scope="module")
def model(aot_engine):
    return load_model(aot_engine[0])


def _pair(model, engine_dir):
    return TorchExecutor(model, *SIZES), CompiledExecutor(engine_dir, *SIZES)


def _close(a, b, atol=2e-4):
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-4)


def _steps(model):
    V = model.config.vocab_size
    p0, p1, p2 = (random_prompt(n, V, seed) for n, seed in ((37, 1), (20, 2), (9, 3)))
    pt0, pt1, pt2 = torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7]), torch.tensor([8])
    return [
        # fresh prefill of two sequences, capturing four anchors (rows of the padded batch)
        ([SeqInput(p0, 0, pt0, 0), SeqInput(p1, 0, pt1, 1)],
         torch.tensor([0, 5, 36, 40]), torch.tensor([0, 1, 2, 3])),
        # a continuation, a decode and a fresh sequence in one step
        ([SeqInput(p1[:10], 37, pt0, 0), SeqInput([5], 20, pt1, 1), SeqInput(p2, 0, pt2, 2)],
         None, None),
        # a decode step of one sequence (the decode graph, batch of 1)
        ([SeqInput([7], 47, pt0, 0)], None, None),
    ]


def test_compiled_steps_match_eager(model, aot_engine):
    eager, compiled = _pair(model, aot_engine[1])
    for seqs, src, dst in _steps(model):
        _close(compiled.forward(seqs, src, dst), eager.forward(seqs, src, dst))
    for a, b in zip(eager.kv.k + eager.kv.v, compiled.kv.k + compiled.kv.v):
        _close(b, a)
    for a, b in zip(eager.run_states.conv + eager.run_states.rec,
                    compiled.run_states.conv + compiled.run_states.rec):
        _close(b, a)
    _close(compiled.anchors, eager.anchors)
    assert compiled.anchors[:, :4].abs().sum() > 0  # the captured rows were written


def test_compiled_int8_anchors_match_eager(model, aot_engine):
    """int8 anchors: the compiled step captures into its staging rows (15 captures: more
    than the first staging buffer holds) and quantizes them as the eager capture does; a
    replay from them gives the eager executor's states."""
    eager = TorchExecutor(model, *SIZES, int8_anchors=True)
    compiled = CompiledExecutor(aot_engine[1], *SIZES, int8_anchors=True)
    seqs = _steps(model)[0][0]
    src = torch.tensor([*range(12), 37, 38, 39])
    dst = torch.arange(15) + 20
    for ex in (eager, compiled):
        ex.forward(seqs, src, dst)
        ex.replay([3, 2], [torch.tensor([20, 21, 22, 25, 31]), torch.tensor([32, 33, 34])])
    assert compiled.anchors.dtype == torch.int8
    assert (compiled.anchors[:, 20:35].int() - eager.anchors[:, 20:35].int()).abs().max() <= 1
    assert compiled.anchors[:, :20].abs().sum() == 0 and compiled.anchors[:, 35:].abs().sum() == 0
    _close(compiled.anchor_scales, eager.anchor_scales)
    assert compiled.anchor_scales[:, 20:35].min() > 0
    for a, b in zip(eager.run_states.conv + eager.run_states.rec,
                    compiled.run_states.conv + compiled.run_states.rec):
        _close(b[2:4], a[2:4], atol=1e-3)
    assert compiled.run_states.rec[0][2:4].abs().sum() > 0


def test_compiled_engine_with_int8_anchors_generates_like_eager(model, aot_engine):
    V = model.config.vocab_size
    replay = ReplayConfig(anchor_density=0.25, budget_fraction=1.0, k_max=8,
                          anchor_dtype="int8")
    eager = make_engine(model, replay=replay)
    compiled = Engine(None, EngineConfig(**{**eager.config.__dict__, "executor": "compiled"}),
                      engine_dir=aot_engine[1])
    assert compiled.executor.anchors.dtype == torch.int8
    shared = random_prompt(70, V, 19)
    prompts = [shared + random_prompt(12, V, 20), shared + random_prompt(7, V, 21)]
    params = SamplingParams(max_tokens=8, top_k=1)
    for engine in (eager, compiled):
        engine.outs = [engine.generate(p, params).new_token_ids for p in prompts]
    assert compiled.outs == eager.outs
    assert compiled.stats()["replayed_anchors"] > 0
    assert_no_leak(compiled)


def test_compiled_replay_matches_eager(model, aot_engine):
    eager, compiled = _pair(model, aot_engine[1])
    seqs, src, dst = _steps(model)[0]
    for ex in (eager, compiled):
        ex.forward(seqs, src, dst)
        ex.replay([3, 2], [torch.tensor([0, 1, 2]), torch.tensor([3])])
    for a, b in zip(eager.run_states.conv + eager.run_states.rec,
                    compiled.run_states.conv + compiled.run_states.rec):
        _close(b[2:4], a[2:4])
    assert compiled.run_states.rec[0][2:4].abs().sum() > 0


def test_eager_graphs_match_eager_model(model):
    """The packed formulation itself (uncompiled) equals the padded eager model."""
    eager = TorchExecutor(model, *SIZES)
    graphs = CompiledExecutor.from_graphs(model, *SIZES)
    for seqs, src, dst in _steps(model):
        _close(graphs.forward(seqs, src, dst), eager.forward(seqs, src, dst), atol=1e-5)


@pytest.mark.skipif(not __import__("plugins").triton_available(), reason="needs triton")
def test_graphs_through_the_triton_operators_match_eager(model, monkeypatch):
    """The graphs CUDA engines compile, with every operator in its Triton form (scans, conv,
    capture, MoE experts; Triton's interpreter on the CPU), equal the eager model."""
    monkeypatch.setenv("SUFFIXREPLAY_TRITON_ON_CPU", "1")
    eager = TorchExecutor(model, *SIZES)
    graphs = CompiledExecutor.from_graphs(model, *SIZES, snapshots=False)
    for seqs, src, dst in _steps(model):
        _close(graphs.forward(seqs, src, dst), eager.forward(seqs, src, dst), atol=1e-5)
    for ex in (eager, graphs):
        ex.replay([3, 2], [torch.tensor([0, 1, 2]), torch.tensor([3])])
    for a, b in zip(eager.run_states.rec, graphs.run_states.rec):
        _close(b[2:4], a[2:4], atol=1e-5)
    _close(graphs.anchors, eager.anchors, atol=1e-5)


def test_graphs_without_snapshots_run_like_cuda_engines(model):
    """The prefill graph CUDA engines get (no snapshot inputs): same logits and states, no
    mid-step states offered, and asking for one is an error."""
    eager = TorchExecutor(model, *SIZES)
    graphs = CompiledExecutor.from_graphs(model, *SIZES, snapshots=False)
    assert not graphs.supports_snapshots
    for seqs, src, dst in _steps(model):
        _close(graphs.forward(seqs, src, dst), eager.forward(seqs, src, dst), atol=1e-5)
    for a, b in zip(eager.run_states.rec, graphs.run_states.rec):
        _close(b, a, atol=1e-5)
    prefix, step, snaps = _snapshot_step(model)
    graphs.forward(prefix)
    with pytest.raises(ValueError, match="cannot save states mid-step"):
        graphs.forward(step, snapshots=snaps)


def _snapshot_step(model):
    """A fresh 150-token row and an 80-token continuation of a 20-token prefix, each with
    one mid-step state to save (after 128 and 64 new tokens; saved slots 1 and 2)."""
    V = model.config.vocab_size
    p0, p1 = random_prompt(150, V, 21), random_prompt(100, V, 22)
    tables = torch.arange(0, 10), torch.arange(10, 17)
    prefix = [SeqInput(p1[:20], 0, tables[1], 1)]
    step = [SeqInput(p0, 0, tables[0], 0), SeqInput(p1[20:], 20, tables[1], 1)]
    return prefix, step, [(0, 128, 1), (1, 64, 2)]


@pytest.mark.parametrize("compiled_graphs", [True, False])
def test_compiled_snapshots_match_eager(model, aot_engine, compiled_graphs):
    """The prefill graph's mid-step states (one per row) are the eager executor's."""
    eager = TorchExecutor(model, *SIZES)
    other = (CompiledExecutor(aot_engine[1], *SIZES) if compiled_graphs
             else CompiledExecutor.from_graphs(model, *SIZES))
    assert other.supports_snapshots and other.max_snapshots_per_row == 1
    prefix, step, snaps = _snapshot_step(model)
    for ex in (eager, other):
        ex.forward(prefix)
    _close(other.forward(step, snapshots=snaps), eager.forward(step, snapshots=snaps))
    for a, b in zip(eager.saved_states.conv + eager.saved_states.rec,
                    other.saved_states.conv + other.saved_states.rec):
        _close(b[:4], a[:4])
    assert other.saved_states.rec[0][1:3].abs().sum() > 0
    assert other.saved_states.rec[0][0].abs().sum() == 0  # nothing else written
    with pytest.raises(ValueError, match="one state per sequence"):
        other.forward(step, snapshots=[(0, 64, 1), (0, 128, 2)])
    with pytest.raises(ValueError, match="multiples of 64"):
        other.forward(step, snapshots=[(0, 100, 1)])


def test_compiled_engine_prefills_a_prompt_with_its_live_state_in_one_step(model, aot_engine,
                                                                          monkeypatch):
    """A 140-token prompt (last page boundary 128, a chunk boundary): the compiled engine
    saves the live state there mid-step, so the prompt takes one step (two where the
    engine's graph cannot save states mid-step); a branch at 135 resumes from that state
    (no replay) and generates what the eager engine does."""
    V = model.config.vocab_size
    eager = make_engine(model, max_tokens_per_step=256)
    prompt = random_prompt(140, V, 31)
    branch = prompt[:135] + [3, 4, 5]
    params = SamplingParams(max_tokens=6, top_k=1)
    want = [eager.generate(p, params).new_token_ids for p in (prompt, branch)]
    steps = {}
    for snapshots in (True, False):
        engine = Engine(None, EngineConfig(**{**eager.config.__dict__, "executor": "compiled"}),
                        engine_dir=aot_engine[1])
        if not snapshots:  # the scheduler asks for none (the graph still gets its inputs)
            monkeypatch.setattr(CompiledExecutor, "supports_snapshots", property(lambda _: False))
        out = engine.generate(prompt, params)
        steps[snapshots] = engine.scheduler.num_steps - (len(out.new_token_ids) - 1)
        again = engine.generate(branch, params)
        assert [out.new_token_ids, again.new_token_ids] == want
        assert again.cached_tokens == 128 and again.replayed_anchors == 0
        assert engine.stats()["live_state_hits"] == 1
        assert_no_leak(engine)
    assert steps == {True: 1, False: 2}


def test_compiled_engine_generates_like_eager_with_cache_hits(model, aot_engine):
    V = model.config.vocab_size
    eager = make_engine(model)
    compiled = Engine(None, EngineConfig(**{**eager.config.__dict__, "executor": "compiled"}),
                      engine_dir=aot_engine[1])
    shared = random_prompt(70, V, 9)
    prompts = [shared + random_prompt(12, V, 10), shared + random_prompt(7, V, 11),
               random_prompt(30, V, 12)]
    params = SamplingParams(max_tokens=10, top_k=1)
    for engine in (eager, compiled):
        engine.outs = [engine.generate(p, params).new_token_ids for p in prompts]
    assert compiled.outs == eager.outs
    stats = compiled.stats()
    assert stats["cache"]["hit_tokens"] > 0
    assert stats["replayed_anchors"] + stats["live_state_hits"] > 0
    assert_no_leak(compiled)


def test_compiled_engine_beam_search_is_eager_beam_search(model, aot_engine):
    """Beams forked across pages (their run states and partial pages copied in the compiled
    executor's buffers) give the eager engine's beams."""
    V = model.config.vocab_size
    eager = make_engine(model)
    compiled = Engine(None, EngineConfig(**{**eager.config.__dict__, "executor": "compiled"}),
                      engine_dir=aot_engine[1])
    params = SamplingParams(max_tokens=24, beam_width=3, end_id=-1)
    prompt = random_prompt(29, V, 13)
    beams = [[b.token_ids for b in e.generate(prompt, params).beams] for e in (eager, compiled)]
    assert beams[1] == beams[0] and len(beams[0]) == 3
    assert compiled.stats()["beam_forks"] > 0
    assert_no_leak(compiled)


def test_engine_from_model_dir_selects_the_compiled_executor(aot_engine):
    model_dir, engine_dir = aot_engine
    config = EngineConfig.from_params({"executor": "compiled", "engine_dir": str(engine_dir),
                                       "num_kv_pages": "64", "page_size": "16"})
    engine = Engine.from_model_dir(model_dir, config)
    assert isinstance(engine.executor, CompiledExecutor) and engine.model is None
    out = engine.generate(list(b"def main():"), SamplingParams(max_tokens=4, top_k=1))
    assert len(out.new_token_ids) == 4


def test_bad_engine_directories_are_clear_errors(tmp_path, aot_engine):
    with pytest.raises(EngineFormatError, match="engine.json"):
        CompiledExecutor(tmp_path, *SIZES)
    (tmp_path / "engine.json").write_text("{not json")
    with pytest.raises(EngineFormatError, match="not valid JSON"):
        CompiledExecutor(tmp_path, *SIZES)
    meta = json.loads((aot_engine[1] / "engine.json").read_text())
    (tmp_path / "engine.json").write_text(json.dumps({**meta, "format": 99}))
    with pytest.raises(EngineFormatError, match="format 99"):
        CompiledExecutor(tmp_path, *SIZES)
    (tmp_path / "engine.json").write_text(json.dumps(meta))
    with pytest.raises(EngineFormatError, match="prefill"):
        CompiledExecutor(tmp_path, *SIZES)


def test_an_engine_loads_only_beside_the_checkpoint_it_was_built_from(tmp_path, aot_engine):
    """An engine folder beside another checkpoint (or a checkpoint retrained in place) loaded
    without a word and served the engine's own weights with the folder's tokenizer; now it
    is refused. A malformed engine.json is an EngineFormatError, not a KeyError."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir, engine_dir = aot_engine
    if model_dir.name != "tiny":
        pytest.skip("one family is enough for the engine's provenance")
    config = EngineConfig.from_params({"executor": "compiled", "engine_dir": str(engine_dir),
                                       "num_kv_pages": "64", "page_size": "16"})
    copy = shutil.copytree(model_dir, tmp_path / "copy", ignore=shutil.ignore_patterns("aot"))
    Engine.from_model_dir(copy, config)  # the same checkpoint elsewhere: fine
    [weights] = list(copy.glob("*.safetensors"))
    tensors = load_file(weights)
    name = sorted(tensors)[len(tensors) // 2]  # a layer in the middle, retrained
    tensors[name] = tensors[name] * 1.01
    save_file(tensors, weights)
    with pytest.raises(EngineFormatError, match="built from another checkpoint"):
        Engine.from_model_dir(copy, config)
    meta = json.loads((engine_dir / "engine.json").read_text())
    for change, field in (({"num_groups": None}, "num_groups"), ({"dtype": "fp16"}, "dtype"),
                          ({"source_signature": None}, "source_signature")):
        (tmp_path / "engine.json").write_text(json.dumps({**meta, **change}))
        with pytest.raises(EngineFormatError, match=field):
            CompiledExecutor(tmp_path, *SIZES)
    (tmp_path / "engine.json").write_text("[]")
    with pytest.raises(EngineFormatError, match="not a JSON object"):
        CompiledExecutor(tmp_path, *SIZES)


def test_a_changed_package_is_refused(tmp_path, aot_engine):
    """Bytes flipped inside a package's compiled library (its frozen weights) loaded and ran
    with other logits; a truncated one failed in torch naming no file. Both are
    EngineFormatErrors naming the package now, as is an engine.json without digests."""
    import shutil

    model_dir, engine_dir = aot_engine
    if model_dir.name != "tiny":
        pytest.skip("one family is enough for the packages' digests")
    meta = json.loads((engine_dir / "engine.json").read_text())
    assert set(meta["package_digests"]) == set(meta["packages"])
    out = shutil.copytree(engine_dir, tmp_path / "aot")
    decode = out / meta["packages"]["decode"]
    intact = decode.read_bytes()
    middle = len(intact) // 2
    decode.write_bytes(intact[:middle] + bytes(b ^ 0xFF for b in intact[middle:middle + 64])
                       + intact[middle + 64:])
    with pytest.raises(EngineFormatError, match=f"{decode.name}: its bytes differ"):
        CompiledExecutor(out, *SIZES)
    decode.write_bytes(intact[:middle])  # truncated, with engine.json's digest made to fit
    (out / "engine.json").write_text(json.dumps(
        {**meta, "package_digests": {**meta["package_digests"],
                                     "decode": package_digest(decode)}}))
    with pytest.raises(EngineFormatError, match=f"{decode.name}: cannot be loaded"):
        CompiledExecutor(out, *SIZES)
    decode.write_bytes(intact)
    (out / "engine.json").write_text(json.dumps({**meta, "package_digests": {}}))
    with pytest.raises(EngineFormatError, match="no digest of 'prefill'"):
        CompiledExecutor(out, *SIZES)
    (out / "engine.json").write_text(json.dumps(meta))
    CompiledExecutor(out, *SIZES)  # intact again: loads


def test_a_rebuild_that_stops_part_way_leaves_no_engine(tmp_path, aot_engine, monkeypatch):
    """A rebuild into an engine folder removes engine.json before it compiles: one that
    fails part way left the old engine.json beside new packages, loaded as one engine."""
    import shutil

    from engine_build import aot

    model_dir, engine_dir = aot_engine
    if model_dir.name != "tiny":
        pytest.skip("one family is enough for the build's order")
    out = shutil.copytree(engine_dir, tmp_path / "aot")

    def fail(*args, **kwargs):
        raise RuntimeError("compile failed")

    monkeypatch.setattr(aot, "export_step", fail)
    with pytest.raises(RuntimeError, match="compile failed"):
        aot.build_aot_engine(model_dir, out, progress=False)
    with pytest.raises(EngineFormatError, match="missing"):
        CompiledExecutor(out, *SIZES)


def test_compiled_snapshot_beside_rows_shorter_than_the_conv(model, aot_engine):
    """A mixed prefill step: a row with a snapshot beside rows of one and two new tokens
    (fewer than the conv's W - 1 = 3 inputs): the graph's gathers stay in bounds."""
    eager, compiled = _pair(model, aot_engine[1])
    V = model.config.vocab_size
    p0, p1 = random_prompt(80, V, 41), random_prompt(30, V, 42)
    tables = torch.arange(0, 8), torch.arange(8, 12), torch.arange(12, 16)
    for ex in (eager, compiled):
        ex.forward([SeqInput(p1[:28], 0, tables[1], 1), SeqInput(p1[:10], 0, tables[2], 2)])
    step = [SeqInput(p0, 0, tables[0], 0), SeqInput(p1[28:], 28, tables[1], 1),
            SeqInput(p1[10:11], 10, tables[2], 2)]
    snaps = [(0, 64, 3)]
    _close(compiled.forward(step, snapshots=snaps), eager.forward(step, snapshots=snaps))
    for a, b in zip(eager.saved_states.conv + eager.saved_states.rec,
                    compiled.saved_states.conv + compiled.saved_states.rec):
        _close(b[3], a[3])


def test_qwen3_next_dense_runs_the_qwen3_5_graphs(tmp_path):
    """A dense Qwen3-Next checkpoint loads into Qwen3.5's layers (its packed projections cut
    at load time), so the packed graphs AOT engines compile run it like the eager model."""
    pytest.importorskip("transformers")
    from hf_oracle import QWEN3_NEXT_CONFIGS, make_hf_checkpoint

    make_hf_checkpoint(tmp_path, seed=4, family="qwen3_next", vocab_size=260,
                       **QWEN3_NEXT_CONFIGS["dense"])
    model = load_model(tmp_path)
    assert model.config.model_type == "qwen3_next" and not model.config.has_moe
    eager = TorchExecutor(model, *SIZES)
    graphs = CompiledExecutor.from_graphs(model, *SIZES)
    for seqs, src, dst in _steps(model):
        _close(graphs.forward(seqs, src, dst), eager.forward(seqs, src, dst), atol=1e-5)
