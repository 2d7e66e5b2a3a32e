"""Builders for engine tests: a small random HF checkpoint and engines over it."""

from __future__ import annotations

from pathlib import Path

import torch

from backend.cache.config import CacheConfig
from backend.engine import Engine, EngineConfig, SamplingParams
from backend.engine.beam import BeamSearch
from backend.engine.sampling import TokenCounts, adjusted_log_probs
from backend.replay.budget import ReplayConfig

TINY_MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repo/hybrid_llm/1/tiny_qwen3_5"
GREEDY = SamplingParams(max_tokens=12, top_k=1)
PAGE = 16
# The engine suites run on each: Gated DeltaNet and Mamba2 hybrids, and both with MoE MLPs.
FAMILIES = ("qwen3_5", "nemotron_h", "qwen3_next_moe", "nemotron_h_moe")


def family_checkpoint(path, family: str, seed: int, slow_decay: bool = False, **config):
    """A small random transformers checkpoint of `family` (one of FAMILIES) at `path`;
    `config`: fields to override (vocab_size, ...)."""
    from hf_oracle import (
        NEMOTRON_H_CONFIGS,
        QWEN3_NEXT_CONFIGS,
        make_hf_checkpoint,
        make_nemotron_h_checkpoint,
    )

    if family == "qwen3_5":
        return make_hf_checkpoint(path, seed=seed, slow_decay=slow_decay, **config)
    if family == "qwen3_next_moe":
        return make_hf_checkpoint(path, seed=seed, slow_decay=slow_decay, family="qwen3_next",
                                  **QWEN3_NEXT_CONFIGS["moe"], **config)
    layout = NEMOTRON_H_CONFIGS["moe-latent"] if family == "nemotron_h_moe" else {}
    return make_nemotron_h_checkpoint(path, seed=seed, slow_decay=slow_decay, **layout,
                                      **config)


def make_engine(model, policy="suffixreplay", replay=None, num_kv_pages=256, interval=64,
                max_tokens_per_step=96, max_num_seqs=8, num_checkpoint_slots=32,
                **cache_options) -> Engine:
    replay = replay or ReplayConfig(anchor_density=0.25, budget_fraction=1.0, k_max=8)
    cache = CacheConfig(page_size=PAGE, policy=policy, checkpoint_interval=interval,
                        num_kv_pages=num_kv_pages, anchor_density=replay.anchor_density,
                        num_checkpoint_slots=num_checkpoint_slots, **cache_options)
    return Engine(model, EngineConfig(max_num_seqs=max_num_seqs,
                                      max_tokens_per_step=max_tokens_per_step,
                                      cache=cache, replay=replay))


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_no_leak(engine: Engine) -> None:
    store = engine.store
    store.assert_invariants()
    assert not store.kv.ids and not store.anchors.ids and not store.states.ids
    assert engine.stats()["active_requests"] == 0
    if not engine.scheduler.running:  # nothing runs: no page is locked
        locked = [n for n in store.tree.iter_nodes() if n.lock_ref]
        assert not locked, f"{len(locked)} pages still locked"


def reference_adjust(logits: torch.Tensor, prompt: list[int], generated: list[int],
                     params: SamplingParams) -> torch.Tensor:
    """The sampler's documented logit changes, one token id at a time (a reference for
    `backend.engine.sampling.adjust_logits`): the bias, the repetition penalty over prompt and
    generated ids, the presence and frequency penalties over generated ids only; -inf for
    the tokens outside allowed_token_ids (where it is given)."""
    out = logits.clone().tolist()
    for token, value in params.logit_bias:
        out[token] += value
    for token in set(prompt) | set(generated):
        x = out[token]
        out[token] = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
    for token in set(generated):
        out[token] -= params.presence_penalty + params.frequency_penalty * generated.count(token)
    if params.allowed_token_ids:
        out = [x if t in params.allowed_token_ids else float("-inf") for t, x in enumerate(out)]
    return torch.tensor(out)


def reference_bans(tokens: list[int], n: int) -> set[int]:
    """no_repeat_ngram_size n by a full scan (transformers' rule): the tokens that followed
    every earlier occurrence of the last n - 1 tokens."""
    if len(tokens) + 1 < n:
        return set()
    last = tokens[len(tokens) - n + 1:] if n > 1 else []
    return {tokens[i + n - 1] for i in range(len(tokens) - n + 1)
            if tokens[i:i + n - 1] == last}


def reference_beams(model, prompt, params: SamplingParams, max_context_len=1 << 20):
    """The beams of a search whose every step prefills each beam from scratch (no cache)."""
    search = BeamSearch(params, len(prompt), max_context_len)
    V = model.config.vocab_size
    while True:
        rows = []
        for history in search.histories:
            with torch.inference_mode():
                rows.append(model.logits(torch.tensor([prompt + history]))[0, -1].float())
        logits = torch.stack(rows)
        n = logits.shape[0]
        counts = [TokenCounts(V, len(prompt)).update(prompt + h) for h in search.histories]
        repeats = [reference_bans(prompt + h, params.no_repeat_ngram_size)
                   for h in search.histories] if params.no_repeat_ngram_size else None
        scores = adjusted_log_probs(logits, [params] * n, [search.num_generated] * n,
                                    search.histories, counts, repeats)
        search.step(scores)
        if search.done:
            return [b.token_ids for b in search.outputs()]


def hf_rows(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' raw logits that chose each of `tokens` after `prompt`: [len(tokens), V]."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0].float()
    return logits[len(prompt) - 1:]
