"""GPU checks of the model and the engine (run by tests/gpu/run.sh on a CUDA machine; skipped
everywhere else): the model on CUDA against the CPU, engine hits on the device, from DRAM
(pinned memory, side-stream copies) and from SSD (KvikIO where present), under suffix replay
and the checkpoint policy with its states tiered.

`SUFFIXREPLAY_GPU_TEST_DEVICE=cpu` runs the same checks on the CPU (a dry run of the script's
logic on machines without a GPU)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

DEVICE = os.environ.get("SUFFIXREPLAY_GPU_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from hf_oracle import make_hf_checkpoint

    path = tmp_path_factory.mktemp("gpu-model")
    make_hf_checkpoint(path, seed=5)
    return path


@pytest.fixture(autouse=True)
def _exact_matmuls():
    if DEVICE == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def test_model_logits_on_the_device_match_the_cpu(ckpt):
    from backend.model import load_model

    cpu, dev = load_model(ckpt), load_model(ckpt, device=DEVICE)
    ids = torch.randint(0, cpu.config.vocab_size, (2, 300),
                        generator=torch.Generator().manual_seed(0))
    want = cpu.logits(ids)
    got = dev.logits(ids.to(DEVICE)).float().cpu()
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("policy", ["suffixreplay", "checkpoint"])
@pytest.mark.parametrize("where", ["device", "dram", "ssd"])
def test_engine_hits_on_the_device_give_full_prefill_tokens(ckpt, tmp_path, where, policy):
    from engine_helpers import GREEDY, assert_no_leak, make_engine, random_prompt

    from backend.cache.file_io import probe_kvikio
    from backend.cache.tier_config import TierConfig
    from backend.engine import Engine
    from backend.model import load_model
    from backend.model.generate import greedy_generate

    model = load_model(ckpt, device=DEVICE)
    states = dict(host_checkpoint_slots=16) if policy == "checkpoint" else {}
    tiers = {"device": None, "dram": TierConfig(host_pages=64, **states),
             "ssd": TierConfig(host_pages=12, ssd_path=str(tmp_path / "ssd"), ssd_bytes=1 << 30,
                               model_fingerprint="gpu-test", **states)}[where]
    if where == "ssd" and policy == "checkpoint":
        tiers = replace(tiers, host_checkpoint_slots=1, ssd_checkpoint_slots=16)
    base = make_engine(model, policy=policy, num_kv_pages=256 if tiers is None else 24,
                       max_tokens_per_step=200, num_checkpoint_slots=32 if tiers is None else 3)
    engine = Engine(model, replace(base.config, tiers=tiers))
    prompts = [random_prompt(200, 97, seed=s) for s in range(40, 44)]
    for p in prompts:
        engine.generate(p, GREEDY)
    if engine.tiers is not None:
        engine.tiers.drain()
    branch = prompts[0][:150] + prompts[1][:30]
    want = greedy_generate(model, [branch], max_new_tokens=12, page_size=16)[0]
    got = engine.generate(branch, GREEDY)
    assert got.new_token_ids == want
    assert got.cached_tokens == (144 if policy == "suffixreplay" else 128)
    stats = engine.stats()
    if where != "device":
        lower = stats["cache"]["hit_tokens_by_tier"]
        assert lower["host"] + lower["ssd"] > 0, stats
    if where == "ssd":
        assert stats["tiers"]["ssd_bytes_read"] > 0
        if DEVICE == "cuda" and probe_kvikio().available:
            assert engine.tiers.ssd.io.name == "kvikio"  # GPUDirect Storage served the reads
    assert_no_leak(engine)
    engine.stop()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_pages_read_back_from_ssd_are_bit_identical_on_the_device(tmp_path, overlap):
    """Device pages evicted to SSD and promoted back (through KvikIO where it is present,
    else POSIX reads into pinned DRAM) equal what was written, bit for bit."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cache"))
    from tier_helpers import make_tiered, pages, run_request

    from backend.cache.base import Tier
    from backend.cache.file_io import probe_kvikio

    store, tiers = make_tiered(tmp_path / "ssd", num_kv_pages=8, host_pages=3, device=DEVICE,
                               enable_overlap=overlap, use_kvikio=True, o_direct=True)
    first, second = pages(1, 2, 3), pages(7, 8, 9)
    run_request(store, tiers, first)
    run_request(store, tiers, second)
    tiers.drain()
    store.evict(6)
    tiers.drain()
    assert Tier.SSD in [n.kv_location for n in store.match_prefix(first).nodes]
    _, served = run_request(store, tiers, first)  # checks every served page bit for bit
    assert served == 3 and tiers.stats.ssd_reads >= 1
    if DEVICE == "cuda" and probe_kvikio().available:
        assert tiers.ssd.io.name == "kvikio"
    tiers.assert_invariants()
    tiers.close()
