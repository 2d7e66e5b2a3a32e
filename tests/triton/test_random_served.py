"""Randomized workloads through the real tritonserver against the model itself: four gRPC
clients stream token ids to `hybrid_llm` (new prompts, branches cut anywhere in an earlier
prompt or finished conversation, some requests cancelled mid-stream) while a small pool
evicts, (suffix replay) pages out to DRAM and SSD, and at times preempts. Every token that
comes back must be the model's greedy choice after the prompt and the tokens before it
(exact replay and the checkpoint baseline keep exact states), and nothing may stay held at
the end. Every third request of a client also sends penalties, an embedding bias and
return_log_probs: its tokens must be the greedy choice after those rules
(`reference_adjust`), its log probabilities the model's. The engine suite checks the same
logits in-process (tests/engine/test_random_workloads.py); this is the served path: the
request parser, the responder, cancellation and the tiers' threads beside Triton's."""

from __future__ import annotations

import queue
import random
import threading

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from backend.engine import SamplingParams
from backend.model import load_model
from client.generate import grpc_inputs
from client.metrics import by_label
from tests.engine.engine_helpers import reference_adjust
from tests.triton.conftest import DEFAULT_MODEL
from tests.triton.llm_helpers import idle_pool, scrape

CLIENTS, PER_CLIENT = 4, 8
SEED = 4000  # the workload's; client c draws its output lengths and cancels from SEED + 100 + c
TOLERANCE = 1e-3  # a served token may trail the plain forward's best by this much (ties)
# 12 pages of 64 tokens: four prompts of up to ~600 tokens do not fit at once (admission
# waits; a run may preempt: 2 preemptions seen with the tiers, none with checkpoints); what
# finished requests leave is evicted to the tiers (or dropped) soon after.
POOL = {"num_kv_pages": "12", "max_num_seqs": "4", "max_tokens_per_step": "256",
        "max_context_len": "704"}
# What every third request of a client (`penalized`) adds: the same rules as
# tests/engine/test_random_workloads.py, sent as hybrid_llm's inputs.
PENALTIES = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                           logit_bias=((0, 1.5), (1, -1.5)))
SERVED = {
    "replay+tiers": {"anchor_density": "1.0", "budget_fraction": "1.0", "k_max": "none",
                     "host_pages": "8", "ssd_bytes": str(1 << 28)},
    # 16 state slots: with 8, four running requests' states pushed every cached one out
    # before its branch came in one of 8 hunted seeds (no hit at all).
    "checkpoint": {"cache_policy": "checkpoint", "checkpoint_interval": "64",
                   "num_checkpoint_slots": "16"},
}


@pytest.fixture(scope="module", params=list(SERVED))
def served(request, triton_server, tmp_path_factory):
    """(configuration name, server) of each configuration, hybrid_llm only."""
    params = {**POOL, **SERVED[request.param]}
    if "host_pages" in params:
        params["ssd_path"] = str(tmp_path_factory.mktemp("ssd"))
    return request.param, triton_server(["hybrid_llm"], {"hybrid_llm": params})


class Workload:
    """Prompts drawn with one seed by every client under a lock: new ones, or a cut of an
    earlier prompt or finished conversation with new tokens after it."""

    def __init__(self, seed: int, vocab: int):
        self.rng, self.vocab = random.Random(seed), vocab
        self.history: list[list[int]] = []
        self.lock = threading.Lock()

    def next_prompt(self) -> list[int]:
        with self.lock:
            if not self.history or self.rng.random() < 0.2:
                prompt = self._tokens(self.rng.randint(64, 400))
            else:
                base = self.rng.choice(self.history)
                cut = self.rng.randint(1, min(len(base), 560))
                prompt = base[:cut] + self._tokens(self.rng.randint(1, 60))
            self.history.append(prompt)
            return prompt

    def add(self, conversation: list[int]) -> None:
        with self.lock:
            self.history.append(conversation)

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]


def _inputs(prompt: list[int], max_tokens: int, penalized: bool, vocab: int) -> list:
    fields = {
        "input_ids": np.array([prompt], dtype=np.int32),
        "input_lengths": np.array([[len(prompt)]], dtype=np.int32),
        "request_output_len": np.array([[max_tokens]], dtype=np.int32),
        "runtime_top_k": np.array([[1]], dtype=np.int32),
        "end_id": np.array([[-1]], dtype=np.int32),  # no end token: max_tokens are generated
        "streaming": np.array([[True]]),
    }
    if penalized:
        bias = np.zeros((1, vocab), dtype=np.float32)
        for token, value in PENALTIES.logit_bias:
            bias[0, token] = value
        fields.update({
            name: np.array([[getattr(PENALTIES, name)]], dtype=np.float32)
            for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")})
        fields.update(embedding_bias=bias, return_log_probs=np.array([[True]]))
    return grpc_inputs(fields)


def _stream(url: str, prompt: list[int], max_tokens: int, cancel_after: int | None,
            penalized: bool, vocab: int) -> tuple[list[int], list[float], bool]:
    """Streams one request; with `cancel_after`, cancels it after that many tokens. Returns
    the tokens received, their log probabilities (penalized requests ask for them) and
    whether the final response came."""
    client = grpcclient.InferenceServerClient(url)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    tokens: list[int] = []
    log_probs: list[float] = []
    final = False
    try:
        client.async_stream_infer("hybrid_llm", _inputs(prompt, max_tokens, penalized, vocab),
                                  enable_empty_final_response=True)
        while not final and (cancel_after is None or len(tokens) < cancel_after):
            result, error = responses.get(timeout=120)
            assert error is None, error
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            if any(o.name == "output_ids" for o in response.outputs):
                tokens.extend(int(t) for t in result.as_numpy("output_ids").reshape(-1))
                log_probs.extend(result.as_numpy("output_log_probs").reshape(-1).tolist())
    finally:
        client.stop_stream(cancel_requests=not final)
        client.close()
    return tokens, log_probs, final


def _assert_model(model, rid: str, prompt: list[int], tokens: list[int], penalized: bool,
                  log_probs: list[float]) -> None:
    """Each token is the argmax (within TOLERANCE) of a plain forward over the prompt and
    the tokens before it (changed by PENALTIES for penalized requests, which also get the
    forward's log probabilities back; the others none)."""
    assert len(log_probs) == (len(tokens) if penalized else 0), (rid, len(log_probs))
    if not tokens:
        return
    with torch.inference_mode():
        rows = model.logits(torch.tensor([prompt + tokens[:-1]]))[0, len(prompt) - 1:].float()
    if penalized:
        expected = torch.log_softmax(rows, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
        torch.testing.assert_close(torch.tensor(log_probs), expected, atol=TOLERANCE, rtol=0,
                                   msg=lambda m: f"{rid} log probabilities: {m}")
        rows = torch.stack([reference_adjust(row, prompt, tokens[:i], PENALTIES)
                            for i, row in enumerate(rows)])
    chosen = rows[torch.arange(len(tokens)), torch.tensor(tokens)]
    gap = rows.max(-1).values - chosen
    bad = (gap > TOLERANCE).nonzero().flatten().tolist()
    assert not bad, (f"{rid}: token {bad[0]} of {len(tokens)} after a {len(prompt)}-token "
                     f"prompt trails the model's choice by {gap[bad[0]]:.4f}")


def test_random_served_workload_matches_the_model(served):
    name, server = served
    model = load_model(server.model_repository / DEFAULT_MODEL)
    workload = Workload(SEED + list(SERVED).index(name), model.config.vocab_size)
    before = scrape(server)
    results: dict[str, tuple] = {}  # rid -> (prompt, tokens, log probs, max_tokens, ...)
    errors: list[BaseException] = []

    def client(c: int) -> None:
        rng = random.Random(SEED + 100 + c)
        try:
            for j in range(PER_CLIENT):
                prompt, max_tokens, cancel = workload.next_prompt(), rng.randint(1, 40), None
                if rng.random() < 0.15:  # cancelled after 0-20 of 80 tokens: still running
                    max_tokens, cancel = 80, rng.randint(0, 20)
                penalized = j % 3 == 1
                tokens, log_probs, final = _stream(server.urls.grpc, prompt, max_tokens, cancel,
                                                   penalized, model.config.vocab_size)
                results[f"c{c}-{j}"] = (prompt, tokens, log_probs, max_tokens, final, cancel,
                                        penalized)
                if final:
                    workload.add(prompt + tokens)
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert len(results) == CLIENTS * PER_CLIENT
    for rid, (prompt, tokens, log_probs, max_tokens, final, cancel, penalized) in \
            results.items():
        if cancel is None:
            assert final and len(tokens) == max_tokens, (rid, len(tokens), max_tokens)
        _assert_model(model, rid, prompt, tokens, penalized, log_probs)
    after = idle_pool(server, timeout_s=60)
    assert after["held_by_requests"] == 0 and after["active"] == 0, after
    now = scrape(server)

    def grew(family: str, label: str) -> dict[str, float]:
        old = by_label(before, family, label)
        return {k: v - old.get(k, 0.0) for k, v in by_label(now, family, label).items()}

    # The workload did what it is for: hits, cancellations, evictions (and the tiers' hits).
    hits = grew("suffixreplay_hit_tokens_total", "tier")
    unfinished = grew("suffixreplay_unfinished_requests_total", "reason")
    assert sum(hits.values()) > 0, hits
    assert unfinished.get("cancelled", 0) > 0 and unfinished.get("failed", 0) == 0, unfinished
    assert grew("suffixreplay_evictions_total", "tier").get("device", 0) > 0
    if name == "replay+tiers":
        assert hits.get("host", 0) + hits.get("ssd", 0) > 0, hits
