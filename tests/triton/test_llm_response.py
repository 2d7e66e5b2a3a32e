"""hybrid_llm response tensors (no server): streaming deltas, prefixes, final flush."""

from __future__ import annotations

from backend.engine.request import RequestOutput
from backend.triton.llm_response import PREFIX_LEN, OutputStream


def output(ids: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput("r#0", ids, finished, "length" if finished else None, 3, 0, 64, 4, 2)


def test_streaming_sends_deltas_with_the_streamed_tail_as_prefix():
    stream = OutputStream("r#0", [1, 2, 3], streaming=True, exclude_input=False)
    sent = [stream.on_output(output(list(range(10 * i, 10 * i + 5)))) for i in range(3)]
    assert sent[0]["output_ids"].tolist() == [[[0, 1, 2, 3, 4]]]
    assert sent[0]["prefix_length"].tolist() == [[0]]
    assert PREFIX_LEN == 8
    assert sent[2]["prefix_ids"].tolist() == [[[2, 3, 4, 10, 11, 12, 13, 14]]]
    assert sent[2]["num_output_tokens"].tolist() == [[5]]  # this response's tokens
    assert not sent[2]["flush"][0, 0]
    assert stream.on_output(output([])) is None  # a step without tokens sends nothing
    final = stream.on_output(output([], finished=True))
    assert final["flush"][0, 0] and final["sequence_length"].tolist() == [[0]]
    assert final["request_key"].tolist() == [[b"r#0"]]
    assert final["cached_tokens"].tolist() == [[64]]


def test_non_streaming_sends_one_response_with_everything():
    stream = OutputStream("r#0", [1, 2, 3], streaming=False, exclude_input=False)
    assert stream.on_output(output([7, 8])) is None
    final = stream.on_output(output([9], finished=True))
    assert final["output_ids"].tolist() == [[[1, 2, 3, 7, 8, 9]]]
    assert final["sequence_length"].tolist() == [[6]]
    assert final["num_output_tokens"].tolist() == [[3]]
    assert final["prefix_length"].tolist() == [[0]] and final["flush"][0, 0]
    excluded = OutputStream("r#1", [1, 2, 3], streaming=False, exclude_input=True)
    assert excluded.on_output(output([9], finished=True))["output_ids"].tolist() == [[[9]]]


def scored(ids: list[int], log_probs: list[float], cum: float, finished=False) -> RequestOutput:
    out = output(ids, finished)
    out.log_probs, out.cum_log_prob = log_probs, cum
    return out


def test_log_probs_follow_the_ids_they_score():
    stream = OutputStream("r#0", [1, 2, 3], streaming=True, exclude_input=True)
    first = stream.on_output(scored([7, 8], [-0.5, -1.0], -1.5))
    assert first["output_log_probs"].tolist() == [[[-0.5, -1.0]]]
    assert first["cum_log_probs"].tolist() == [[-1.5]]
    final = stream.on_output(scored([], [], -1.5, finished=True))  # e.g. the end id, not output
    assert final["output_log_probs"].shape == (1, 1, 0)
    assert final["cum_log_probs"].tolist() == [[-1.5]]
    whole = OutputStream("r#1", [1, 2, 3], streaming=False, exclude_input=False)
    assert whole.on_output(scored([7], [-0.25], -0.25)) is None
    done = whole.on_output(scored([8], [-0.5], -0.75, finished=True))
    assert done["output_ids"].tolist() == [[[1, 2, 3, 7, 8]]]  # the prompt has none
    assert done["output_log_probs"].tolist() == [[[-0.25, -0.5]]]
    assert done["cum_log_probs"].tolist() == [[-0.75]]
    # Not asked for: none, and a zero sum.
    plain = OutputStream("r#2", [1], streaming=False, exclude_input=True)
    bare = plain.on_output(output([4, 5], finished=True))
    assert bare["output_log_probs"].shape == (1, 1, 0) and bare["cum_log_probs"].tolist() == [[0]]
