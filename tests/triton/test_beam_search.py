"""Beam search served through the ensemble (beam_width > 1, TensorRT-LLM style): the rows are
transformers' `generate(num_beams=W, num_return_sequences=W)` beams, best first, with each
beam's log probabilities; not streamed, a beam request gets one final response carrying
every beam, streamed a response per step with every beam so far; num_return_sequences K
picks the best K; bad combinations are INVALID_ARG naming the problem."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from backend.tokenizer import Tokenizer
from backend.triton.server import ServerHandle
from client.generate import (
    Chunk,
    GenerateError,
    GenerateParams,
    generate_http,
    stream_grpc,
    stream_http,
)
from tests.triton.llm_helpers import idle_pool, scrape, value

PROMPT = ("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
          "\ndef fact(n):\n")
END_ID = 10  # "\n": ends the beams within the budget, at different lengths
MAX_TOKENS = 24
WIDTH = 3
MODEL = {"model": "hybrid_llm", "version": "1"}
PAD = 259  # transformers pads finished rows; not a byte
# The inputs that change which beams win (each case's beams differ from the default's).
CASES = {
    "default": {},
    "length_penalty": {"length_penalty": 0.0},
    "early_stopping": {"early_stopping": True},
}


@dataclass
class Beam:
    ids: list[int]
    text: str
    log_probs: list[float]  # the model's raw log probability of each id


@pytest.fixture(scope="module")
def reference(model_dir: Path, tokenizer: Tokenizer):
    """case -> transformers' beams for PROMPT (computed once per case)."""
    from transformers import Qwen3_5ForCausalLM

    hf = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = tokenizer.encode(PROMPT)
    done: dict[str, list[Beam]] = {}

    def beams(case: str) -> list[Beam]:
        if case not in done:
            options = CASES[case]
            rows = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                               num_beams=WIDTH, num_return_sequences=WIDTH, do_sample=False,
                               length_penalty=options.get("length_penalty", 1.0),
                               early_stopping=options.get("early_stopping", False),
                               eos_token_id=END_ID, pad_token_id=PAD)
            done[case] = []
            for row in rows:
                ids = [t for t in row[len(prompt):].tolist() if t != PAD]
                ids = ids[:ids.index(END_ID)] if END_ID in ids else ids  # the end id: not output
                with torch.inference_mode():
                    logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
                raw = torch.log_softmax(logits.float(), -1)[torch.arange(len(ids)),
                                                            torch.tensor(ids, dtype=torch.long)]
                done[case].append(Beam(ids, tokenizer.decode(ids, skip_special_tokens=True),
                                       raw.tolist()))
        return done[case]

    return beams


def beam_params(case: str = "default", **options) -> GenerateParams:
    return GenerateParams(PROMPT, max_tokens=MAX_TOKENS, beam_width=WIDTH,
                          extra={"end_id": END_ID}, return_log_probs=True,
                          cache_salt=uuid.uuid4().hex, **CASES[case], **options)


def assert_rows(chunk: Chunk, expected: list[Beam], tokenizer: Tokenizer) -> None:
    """One response carrying every row: the texts, each row's log probabilities (padded) and
    their sums, the token counts."""
    assert chunk.texts == [b.text for b in expected]
    assert chunk.sequence_index == -1
    assert chunk.counts["num_output_tokens"] == sum(len(b.ids) for b in expected)
    assert chunk.counts["num_input_tokens"] == len(tokenizer.encode(PROMPT))
    assert chunk.cum_log_probs == pytest.approx([sum(b.log_probs) for b in expected], abs=1e-3)
    width = max(len(b.ids) for b in expected)
    assert len(chunk.log_probs_by_sequence) == len(expected)
    for row, beam in zip(chunk.log_probs_by_sequence, expected):
        padding = [0.0] * (width - len(beam.ids))
        assert row == pytest.approx(beam.log_probs + padding, abs=1e-3)


@pytest.mark.parametrize("case", list(CASES))
def test_beams_are_transformers_beams(llm_server: ServerHandle, reference, tokenizer, case):
    expected = reference(case)
    if case != "default":  # the input reached the search: other beams won
        assert [b.ids for b in expected] != [b.ids for b in reference("default")]
    whole = generate_http(llm_server.urls.http, beam_params(case))
    assert_rows(whole, expected, tokenizer)
    idle_pool(llm_server)  # every beam's pages and slots released


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_streamed_beams_come_whole_at_every_step(llm_server: ServerHandle, reference,
                                                 tokenizer, transport):
    """As TensorRT-LLM streams beams: a response per step holding every running beam so far
    (rows of one more token each step, no finish reason yet), then the finished beams."""
    if transport == "grpc":
        chunks = list(stream_grpc(llm_server.urls.grpc, beam_params()))
        assert chunks[-1].final
    else:
        chunks = list(stream_http(llm_server.urls.http, beam_params()))
    *steps, last = chunks
    expected = reference("default")
    assert len(steps) >= max(len(b.ids) for b in expected) - 1
    for n, chunk in enumerate(steps, start=1):
        assert chunk.sequence_index == -1 and chunk.finish_reasons == [""] * WIDTH
        assert chunk.counts["num_output_tokens"] == WIDTH * n
        assert [len(row) for row in chunk.log_probs_by_sequence] == [n] * WIDTH
        assert all(len(text) <= n for text in chunk.texts)  # decoded whole, never the prompt
    assert_rows(last, expected, tokenizer)
    assert last.finish_reasons == [("eos" if len(b.ids) < MAX_TOKENS else "length")
                                   for b in expected]
    idle_pool(llm_server)


def test_num_return_sequences_returns_the_best_beams(llm_server: ServerHandle, reference,
                                                     tokenizer):
    expected = reference("default")
    two = generate_http(llm_server.urls.http, beam_params(num_return_sequences=2))
    assert_rows(two, expected[:2], tokenizer)
    one = list(stream_grpc(llm_server.urls.grpc, beam_params(num_return_sequences=1)))
    assert len(one) > 1 and all(len(c.texts) == 1 for c in one)  # the best running beam
    assert_rows(one[-1], expected[:1], tokenizer)
    # The prompt before each beam when the client asks for it.
    whole = generate_http(llm_server.urls.http, beam_params(num_return_sequences=2,
                                                            exclude_input_in_output=False))
    assert whole.texts == [PROMPT + b.text for b in expected[:2]]


def queried_tokens(server: ServerHandle) -> float:
    """Prompt tokens looked up in the prefix store so far (each engine request looks up its
    prompt once), read once the engine is idle and the metrics refreshed."""
    idle_pool(server)
    time.sleep(0.5)  # the metrics thread refreshes every 100 ms
    return value(scrape(server), "suffixreplay_queried_tokens_total", **MODEL)


def test_a_beam_search_is_one_engine_request(llm_server: ServerHandle):
    """All its beams run under one engine request (forked from it), not one request each as
    num_return_sequences' sequences are."""
    before = queried_tokens(llm_server)
    forks = value(scrape(llm_server), "suffixreplay_beam_forks_total", **MODEL)
    generate_http(llm_server.urls.http, GenerateParams(PROMPT, max_tokens=4, top_k=1,
                                                       cache_salt=uuid.uuid4().hex))
    plain = queried_tokens(llm_server) - before
    generate_http(llm_server.urls.http, beam_params())
    beams = queried_tokens(llm_server) - before - plain
    assert plain > 0 and beams == plain
    # ... whose beams forked from each other (metrics: forks, and the pages they copied).
    metrics = scrape(llm_server)
    assert value(metrics, "suffixreplay_beam_forks_total", **MODEL) > forks
    assert value(metrics, "suffixreplay_beam_copied_pages_total", **MODEL) > 0


# (id, options, what the error must say); LLM_PARAMS serve max_num_seqs 8.
BAD = [
    ("width_zero", dict(beam_width=0), "beam_width must be in [1, 64], got 0"),
    ("width_65", dict(beam_width=65), "beam_width must be in [1, 64], got 65"),
    ("top_k", dict(beam_width=2, top_k=5),
     "top_k=5 / top_p=1.0 / min_p=0.0 do not apply to beam search (beam_width > 1)"),
    ("more_sequences_than_beams", dict(beam_width=3, num_return_sequences=4),
     "num_return_sequences=4 must be in [1, beam_width=3]"),
    ("over_max_num_seqs", dict(beam_width=9), "beam_width=9 is more than the engine's "
                                              "max_num_seqs=8"),
    ("guided", dict(beam_width=2, guide_type="json"),
     "guided decoding with beam search (beam_width > 1) is not supported"),
    ("length_penalty_inf", dict(beam_width=2, length_penalty=float("inf")),
     "len_penalty must be finite"),
    ("top_log_probs", dict(beam_width=2, num_top_log_probs=3),
     "num_top_log_probs with beam search (beam_width > 1) is not supported"),
]


@pytest.mark.parametrize(("options", "message"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_beam_requests_are_invalid_arg(llm_server: ServerHandle, options, message):
    params = GenerateParams("hi", max_tokens=4, **options)
    with pytest.raises(GenerateError) as info:
        generate_http(llm_server.urls.http, params)
    assert info.value.status == "HTTP 400"
    assert message in info.value.message
    with pytest.raises(GenerateError) as info:  # the same words in a gRPC stream
        list(stream_grpc(llm_server.urls.grpc, params))
    assert message in info.value.message
    assert llm_server.is_ready()
    assert idle_pool(llm_server)["held_by_requests"] == 0


def test_a_server_that_served_a_beam_search_stops_cleanly(tmp_path):
    """Stopping a server after a beam search (whose sender the cancellation watcher asked
    while it ran) crashed hybrid_llm's stub at interpreter exit (SIGSEGV in
    ~ResponseSender, freed by the last garbage collection after the backend was gone; the
    server's exit status still 0). The model's finalize collects them first."""
    from client.generate import GenerateParams, stream_grpc
    from tests.triton.conftest import LLM_MODELS, LLM_PARAMS, launch

    server = launch(LLM_MODELS, LLM_PARAMS, tmp_path)
    try:
        chunks = list(stream_grpc(server.urls.grpc, GenerateParams(
            "Hi", max_tokens=8, beam_width=4), timeout_s=60))
        assert chunks and chunks[-1].final
    finally:
        code = server.stop()
    log = (tmp_path / "tritonserver.log").read_text(errors="replace")
    assert "Segfault" not in log and "successfully unloaded 'hybrid_llm'" in log, log[-3000:]
    assert code == 0
