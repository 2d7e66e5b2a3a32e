"""hybrid_llm response tensors (no server): streaming deltas, prefixes, final flush."""

from __future__ import annotations

import numpy as np
import pytest

from backend.engine.request import BeamOutput, RequestOutput
from backend.triton.llm_response import PREFIX_LEN, OutputStream


def output(ids: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput("r#0", ids, finished, "length" if finished else None, 3, 0, 64, 4, 2)


def send(stream: OutputStream, out: RequestOutput, index: int = 0):
    """The tensors sent for `out` (None: nothing yet); checks the final flag follows the
    request's last finished sequence."""
    tensors, final = stream.on_output(out, index)
    assert final == (stream.unfinished == 0)
    return tensors


def test_streaming_sends_deltas_with_the_streamed_tail_as_prefix():
    stream = OutputStream("r#0", [1, 2, 3], streaming=True, exclude_input=False)
    sent = [send(stream, output(list(range(10 * i, 10 * i + 5)))) for i in range(3)]
    assert sent[0]["output_ids"].tolist() == [[[0, 1, 2, 3, 4]]]
    assert sent[0]["prefix_length"].tolist() == [[0]]
    assert PREFIX_LEN == 8
    assert sent[2]["prefix_ids"].tolist() == [[[2, 3, 4, 10, 11, 12, 13, 14]]]
    assert sent[2]["num_output_tokens"].tolist() == [[5]]  # this response's tokens
    assert not sent[2]["flush"][0, 0]
    assert sent[2]["finish_reason"].tolist() == [[b""]]  # not ended yet
    assert send(stream, output([])) is None  # a step without tokens sends nothing
    final = send(stream, output([], finished=True))
    assert final["flush"][0, 0] and final["sequence_length"].tolist() == [[0]]
    assert final["request_key"].tolist() == [[b"r#0"]]
    assert final["cached_tokens"].tolist() == [[64]]
    assert final["finish_reason"].tolist() == [[b"length"]]


def test_non_streaming_sends_one_response_with_everything():
    stream = OutputStream("r#0", [1, 2, 3], streaming=False, exclude_input=False)
    assert send(stream, output([7, 8])) is None
    final = send(stream, output([9], finished=True))
    assert final["output_ids"].tolist() == [[[1, 2, 3, 7, 8, 9]]]
    assert final["sequence_length"].tolist() == [[6]]
    assert final["num_output_tokens"].tolist() == [[3]]
    assert final["prefix_length"].tolist() == [[0]] and final["flush"][0, 0]
    assert final["finish_reason"].tolist() == [[b"length"]]
    excluded = OutputStream("r#1", [1, 2, 3], streaming=False, exclude_input=True)
    assert send(excluded, output([9], finished=True))["output_ids"].tolist() == [[[9]]]


def scored(ids: list[int], log_probs: list[float], cum: float, finished=False) -> RequestOutput:
    out = output(ids, finished)
    out.log_probs, out.cum_log_prob = log_probs, cum
    return out


def test_log_probs_follow_the_ids_they_score():
    stream = OutputStream("r#0", [1, 2, 3], streaming=True, exclude_input=True)
    first = send(stream, scored([7, 8], [-0.5, -1.0], -1.5))
    assert first["output_log_probs"].tolist() == [[[-0.5, -1.0]]]
    assert first["cum_log_probs"].tolist() == [[-1.5]]
    final = send(stream, scored([], [], -1.5, finished=True))  # e.g. the end id, not output
    assert final["output_log_probs"].shape == (1, 1, 0)
    assert final["cum_log_probs"].tolist() == [[-1.5]]
    whole = OutputStream("r#1", [1, 2, 3], streaming=False, exclude_input=False)
    assert send(whole, scored([7], [-0.25], -0.25)) is None
    done = send(whole, scored([8], [-0.5], -0.75, finished=True))
    assert done["output_ids"].tolist() == [[[1, 2, 3, 7, 8]]]  # the prompt has none
    assert done["output_log_probs"].tolist() == [[[-0.25, -0.5]]]
    assert done["cum_log_probs"].tolist() == [[-0.75]]
    # Not asked for: none, and a zero sum.
    plain = OutputStream("r#2", [1], streaming=False, exclude_input=True)
    bare = send(plain, output([4, 5], finished=True))
    assert bare["output_log_probs"].shape == (1, 1, 0) and bare["cum_log_probs"].tolist() == [[0]]


def test_top_log_probs_follow_the_ids_they_score():
    """[1, K, T, N] alternatives for the ids a response carries: streamed, the row of the
    sequence sent; not streamed, every row's, padded with id -1 to the longest."""
    def alternatives(out: RequestOutput, *tops) -> RequestOutput:
        out.top_log_probs = [list(t) for t in tops]
        return out

    stream = OutputStream("r#0", [1], streaming=True, exclude_input=True, num_sequences=2,
                          extras=frozenset({"top_log_probs"}))
    a = send(stream, alternatives(scored([7, 8], [-0.5, -1.0], -1.5),
                                  [(7, -0.5), (3, -1.0)], [(2, -0.2), (8, -1.0)]), 1)
    assert a["top_log_prob_ids"].shape == (1, 2, 2, 2)
    assert a["top_log_prob_ids"][0, 1].tolist() == [[7, 3], [2, 8]]
    assert (a["top_log_prob_ids"][0, 0] == -1).all()  # the other row carries nothing
    assert a["top_log_probs"][0, 1].tolist() == [[-0.5, -1.0], [pytest.approx(-0.2), -1.0]]
    assert a["top_log_probs"].dtype.name == "float32"
    end = send(stream, alternatives(scored([], [], -1.5, finished=True)), 1)
    assert end["top_log_prob_ids"].shape == (1, 2, 0, 0)
    whole = OutputStream("r#1", [1], streaming=False, exclude_input=True, num_sequences=2,
                         extras=frozenset({"top_log_probs"}))
    send(whole, alternatives(scored([5], [-0.1], -0.1, finished=True), [(5, -0.1)]), 1)
    done = send(whole, alternatives(scored([6, 4], [-0.3, -0.4], -0.7, finished=True),
                                    [(6, -0.3)], [(4, -0.4)]), 0)
    assert done["top_log_prob_ids"].tolist() == [[[[6], [4]], [[5], [-1]]]]
    assert done["top_log_probs"].tolist() == [[[[pytest.approx(-0.3)], [pytest.approx(-0.4)]],
                                               [[pytest.approx(-0.1)], [0.0]]]]
    # Not asked for: not sent (an ensemble passes on only what every response carries).
    plain = OutputStream("r#2", [1], streaming=False, exclude_input=True)
    assert "top_log_probs" not in send(plain, output([4], finished=True))


def test_prompt_scores_come_once_with_the_prompt_ids():
    """return_prompt_log_probs: the response carrying the first sequence's first ids has the
    prompt's ids, scores and alternatives; the others empty ones (same outputs, no data)."""
    stream = OutputStream("r#0", [5, 6, 7], streaming=True, exclude_input=True,
                          extras=frozenset({"prompt_log_probs", "top_log_probs"}))
    first = output([9])
    first.prompt_log_probs = [-1.0, -2.0]
    first.prompt_top_log_probs = [[(6, -1.0), (1, -1.5)], [(3, -0.5), (7, -2.0)]]
    first.prompt_log_prob_ranks = [1, 3]
    a = send(stream, first)
    assert a["prompt_token_ids"].tolist() == [[5, 6, 7]]
    assert a["prompt_log_probs"].tolist() == [[-1.0, -2.0]]
    assert a["prompt_log_prob_ranks"].tolist() == [[1, 3]]
    assert a["prompt_log_prob_ranks"].dtype == np.int32
    assert a["prompt_top_log_prob_ids"].tolist() == [[[6, 1], [3, 7]]]
    assert a["prompt_top_log_probs"].tolist() == [[[-1.0, -1.5], [-0.5, -2.0]]]
    b = send(stream, output([4], finished=True))
    assert b["prompt_token_ids"].shape == (1, 0) and b["prompt_log_probs"].shape == (1, 0)
    assert b["prompt_top_log_prob_ids"].shape == (1, 0, 0)
    assert b["prompt_log_prob_ranks"].shape == (1, 0)
    # Without alternatives: [1, P - 1, 0]; not streamed: on the one response.
    whole = OutputStream("r#1", [5, 6, 7], streaming=False, exclude_input=True,
                         extras=frozenset({"prompt_log_probs"}))
    only = output([9], finished=True)
    only.prompt_log_probs = [-1.0, -2.0]
    done = send(whole, only)
    assert done["prompt_log_probs"].tolist() == [[-1.0, -2.0]]
    assert done["prompt_top_log_probs"].shape == (1, 2, 0)
    assert "prompt_log_probs" not in send(OutputStream("r#2", [1], streaming=False,
                                                       exclude_input=True),
                                          output([4], finished=True))


def test_several_sequences_stream_one_row_at_a_time():
    stream = OutputStream("r#0", [1, 2, 3], streaming=True, exclude_input=True, num_sequences=3)
    a = send(stream, output([7, 8]), 0)
    assert a["output_ids"].tolist() == [[[7, 8], [0, 0], [0, 0]]]
    assert a["sequence_length"].tolist() == [[2, 0, 0]]
    assert a["prefix_length"].tolist() == [[0, 0, 0]] and a["num_output_tokens"].tolist() == [[2]]
    b = send(stream, output([5]), 2)
    assert b["output_ids"].tolist() == [[[0], [0], [5]]]
    assert b["sequence_length"].tolist() == [[0, 0, 1]]
    c = send(stream, output([9], finished=True), 0)  # sequence 0 ends: flush, not final
    assert c["prefix_ids"].tolist() == [[[7, 8], [0, 0], [0, 0]]]
    assert c["prefix_length"].tolist() == [[2, 0, 0]] and c["flush"][0, 0]
    assert c["finish_reason"].tolist() == [[b"length", b"", b""]]  # only the row that ended
    assert b["finish_reason"].tolist() == [[b"", b"", b""]]
    assert stream.unfinished == 2
    send(stream, output([4], finished=True), 1)
    last = send(stream, output([6], finished=True), 2)
    assert stream.unfinished == 0 and last["prefix_ids"].tolist() == [[[0], [0], [5]]]


def test_several_sequences_without_streaming_come_in_one_final_response():
    stream = OutputStream("r#0", [1, 2], streaming=False, exclude_input=False, num_sequences=2)
    assert send(stream, output([7, 8, 9], finished=True), 1) is None  # sequence 0 still runs
    assert send(stream, output([5]), 0) is None
    done = send(stream, scored([6], [-0.5], -0.7, finished=True), 0)
    assert done["output_ids"].tolist() == [[[1, 2, 5, 6, 0], [1, 2, 7, 8, 9]]]
    assert done["sequence_length"].tolist() == [[4, 5]]
    assert done["num_output_tokens"].tolist() == [[5]]
    assert done["cached_tokens"].tolist() == [[128]]  # summed: 64 each
    assert done["cum_log_probs"].tolist() == [[pytest.approx(-0.7), 0.0]]
    assert done["flush"][0, 0]


def beam_output(beams: list[BeamOutput]) -> RequestOutput:
    """A beam search's only output: finished, the best beam's ids, every beam."""
    out = output(list(beams[0].token_ids), finished=True)
    out.log_probs, out.cum_log_prob, out.beams = beams[0].log_probs, beams[0].cum_log_prob, beams
    return out


BEAMS = [BeamOutput([7, 8, 9], [-0.1, -0.2, -0.3], -0.6, -0.2, "length"),
         BeamOutput([7, 5], [-0.1, -0.9], -1.0, -0.5, "eos"),
         BeamOutput([6], [-1.5], -1.5, -1.5, "eos")]


def running_output(beams: list[BeamOutput]) -> RequestOutput:
    """A streamed beam search's output before its final one: no new ids, the running
    beams."""
    out = output([])
    out.beams = beams
    return out


def test_beam_search_without_streaming_sends_its_beams_in_one_final_response():
    stream = OutputStream("r#0", [1, 2], streaming=False, exclude_input=False,
                          num_sequences=3, beam_search=True)
    assert stream.unfinished == 1  # one engine request for the three rows
    done = send(stream, beam_output(BEAMS))
    assert stream.unfinished == 0
    assert done["output_ids"].tolist() == [[[1, 2, 7, 8, 9], [1, 2, 7, 5, 0], [1, 2, 6, 0, 0]]]
    assert done["sequence_length"].tolist() == [[5, 4, 3]]
    assert done["num_output_tokens"].tolist() == [[6]]  # generated ids of every row
    assert done["num_input_tokens"].tolist() == [[3]] and done["cached_tokens"].tolist() == [[64]]
    assert done["output_log_probs"].tolist() == [[[pytest.approx(-0.1), pytest.approx(-0.2),
                                                   pytest.approx(-0.3)],
                                                  [pytest.approx(-0.1), pytest.approx(-0.9), 0],
                                                  [-1.5, 0, 0]]]
    assert done["cum_log_probs"].tolist() == [[pytest.approx(-0.6), -1.0, -1.5]]
    assert done["prefix_length"].tolist() == [[0, 0, 0]] and done["prefix_ids"].shape == (1, 3, 0)
    assert done["flush"][0, 0] and done["sequence_index"].tolist() == [[-1]]
    assert done["request_key"].tolist() == [[b"r#0"]]
    assert done["finish_reason"].tolist() == [[b"length", b"eos", b"eos"]]  # each beam's


def test_streamed_beam_search_sends_every_steps_running_beams_whole():
    """As TensorRT-LLM streams beams: each step's response holds the best K running beams so
    far (whole rows, never the prompt, flush false, no finish reason); the final one the
    finished beams, flushed."""
    stream = OutputStream("r#0", [1, 2], streaming=True, exclude_input=False, num_sequences=2,
                          beam_search=True)
    first = send(stream, running_output([BeamOutput([7], [-0.1], -0.1, -0.1, ""),
                                         BeamOutput([6], [-1.5], -1.5, -1.5, ""),
                                         BeamOutput([5], [-2.0], -2.0, -2.0, "")]))
    assert first["output_ids"].tolist() == [[[7], [6]]]  # the best 2 of 3, no prompt
    assert first["sequence_length"].tolist() == [[1, 1]]
    assert first["num_output_tokens"].tolist() == [[2]]
    assert not first["flush"][0, 0] and first["sequence_index"].tolist() == [[-1]]
    assert first["prefix_length"].tolist() == [[0, 0]]
    assert first["finish_reason"].tolist() == [[b"", b""]]
    assert first["cum_log_probs"].tolist() == [[pytest.approx(-0.1), -1.5]]
    assert stream.unfinished == 1
    # The next step reordered the beams: the rows follow.
    second = send(stream, running_output([BeamOutput([6, 4], [-1.5, -0.1], -1.6, -0.8, ""),
                                          BeamOutput([7, 8], [-0.1, -2.0], -2.1, -1.05, "")]))
    assert second["output_ids"].tolist() == [[[6, 4], [7, 8]]]
    assert second["output_log_probs"].tolist() == [[[-1.5, pytest.approx(-0.1)],
                                                    [pytest.approx(-0.1), -2.0]]]
    assert send(stream, output([])) is None  # no beams: nothing to send
    done = send(stream, beam_output(BEAMS))
    assert done["output_ids"].tolist() == [[[7, 8, 9], [7, 5, 0]]]  # streamed: no prompt
    assert done["flush"][0, 0] and stream.unfinished == 0
    assert done["finish_reason"].tolist() == [[b"length", b"eos"]]


def test_beam_search_returns_the_best_k_beams():
    stream = OutputStream("r#0", [1, 2], streaming=True, exclude_input=True, num_sequences=2,
                          beam_search=True)
    assert send(stream, output([7])) is None  # not expected from the engine: nothing sent
    done = send(stream, beam_output(BEAMS))
    assert done["output_ids"].tolist() == [[[7, 8, 9], [7, 5, 0]]]
    assert done["sequence_length"].tolist() == [[3, 2]]
    assert done["cum_log_probs"].tolist() == [[pytest.approx(-0.6), -1.0]]
    assert done["num_output_tokens"].tolist() == [[5]]
    # Without return_log_probs the beams carry no log probabilities: none, zero sums.
    bare = [BeamOutput([4, 4], [], 0.0, -0.3, "length"), BeamOutput([], [], 0.0, -0.4, "eos")]
    plain = OutputStream("r#1", [1], streaming=False, exclude_input=True, num_sequences=2,
                         beam_search=True)
    done = send(plain, beam_output(bare))
    assert done["output_ids"].tolist() == [[[4, 4], [0, 0]]]
    assert done["sequence_length"].tolist() == [[2, 0]]  # a beam that ended at once
    assert done["output_log_probs"].shape == (1, 2, 0)
    assert done["cum_log_probs"].tolist() == [[0, 0]]


def test_rows_beyond_the_beams_found_are_empty():
    stream = OutputStream("r#0", [1], streaming=False, exclude_input=True, num_sequences=3,
                          beam_search=True)
    done = send(stream, beam_output(BEAMS[:2]))
    assert done["output_ids"].tolist() == [[[7, 8, 9], [7, 5, 0], [0, 0, 0]]]
    assert done["sequence_length"].tolist() == [[3, 2, 0]]
    assert done["cum_log_probs"].tolist() == [[pytest.approx(-0.6), -1.0, 0]]


def test_perf_metrics_sum_blocks_and_span_the_rows_times():
    from backend.engine.request import RequestMetrics

    stream = OutputStream("r#0", [1, 2, 3], streaming=False, exclude_input=True, num_sequences=2,
                          extras=frozenset({"perf_metrics"}))
    a, b = output([7], finished=True), output([8], finished=True)
    a.metrics = RequestMetrics(100, 110, 150, 300, 2, 3, 4, 10, 6)
    b.metrics = RequestMetrics(90, 0, 0, 0, 1, 5, 5, 0, 0)  # not scheduled yet: zeros
    assert send(stream, a, 0) is None
    final = send(stream, b, 1)
    got = {name: final[name].item() for name in (
        "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
        "last_token_time_ns", "kv_cache_reused_blocks", "kv_cache_alloc_new_blocks",
        "kv_cache_alloc_total_blocks", "total_draft_tokens", "total_accepted_draft_tokens")}
    assert got == {"arrival_time_ns": 90, "first_scheduled_time_ns": 110,
                   "first_token_time_ns": 150, "last_token_time_ns": 300,
                   "kv_cache_reused_blocks": 3, "kv_cache_alloc_new_blocks": 8,
                   "kv_cache_alloc_total_blocks": 9, "total_draft_tokens": 10,
                   "total_accepted_draft_tokens": 6}
    assert final["acceptance_rate"].item() == pytest.approx(0.6)
    assert final["arrival_time_ns"].dtype.name == "int64"
    # Not asked: not sent.
    plain = OutputStream("r#1", [1], streaming=True, exclude_input=True)
    sent = send(plain, output([5], finished=True))
    assert not {"kv_cache_reused_blocks", "generation_logits", "context_logits"} & set(sent)
