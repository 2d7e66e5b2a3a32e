"""preprocessing and postprocessing through the real tritonserver, over HTTP and gRPC."""

from __future__ import annotations

from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from backend.tokenizer import byte_tokenizer

pytestmark = pytest.mark.slow

TOK = byte_tokenizer()
PROMPT = "Grüße, 世界! 😀 naïve café"
# What each protocol reports for an INVALID_ARG error response.
INVALID_ARG_STATUS = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}


class Client(NamedTuple):
    protocol: str
    module: ModuleType
    conn: Any


@pytest.fixture(scope="module")
def server(triton_server):
    return triton_server(["preprocessing", "postprocessing"])


@pytest.fixture(params=["http", "grpc"])
def client(request, server):
    if request.param == "http":
        conn = httpclient.InferenceServerClient(server.urls.http.removeprefix("http://"))
        yield Client("http", httpclient, conn)
    else:
        conn = grpcclient.InferenceServerClient(server.urls.grpc)
        yield Client("grpc", grpcclient, conn)
    conn.close()


def infer(client: Client, model: str, **arrays: np.ndarray) -> Any:
    inputs = []
    for name, array in arrays.items():
        tensor = client.module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return client.conn.infer(model, inputs)


def query(*prompts: str | bytes) -> np.ndarray:
    values = [p.encode("utf-8") if isinstance(p, str) else p for p in prompts]
    return np.array(values, dtype=object).reshape(len(values), 1)


def output_len(batch: int, value: int = 16) -> np.ndarray:
    return np.full((batch, 1), value, dtype=np.int32)


def assert_invalid_arg(client: Client, exc: pytest.ExceptionInfo, text: str) -> None:
    assert exc.value.status() == INVALID_ARG_STATUS[client.protocol]
    assert text in exc.value.message()
    assert client.conn.is_server_ready()


def test_preprocessing_ids_equal_tokenizer_ids(client):
    result = infer(client, "preprocessing", QUERY=query(PROMPT), REQUEST_OUTPUT_LEN=output_len(1))
    expected = TOK.encode(PROMPT)
    assert result.as_numpy("INPUT_ID").tolist() == [expected]
    assert result.as_numpy("REQUEST_INPUT_LEN").tolist() == [[len(expected)]]
    assert result.as_numpy("OUT_END_ID").tolist() == [[TOK.eos_token_id]]
    assert result.as_numpy("REQUEST_OUTPUT_LEN").tolist() == [[16]]


def test_preprocessing_batch_and_stop_words(client):
    stop = np.array([[b"\xe4\xb8\x96", b"ab"], [b"", b"z"]], dtype=object)
    result = infer(
        client,
        "preprocessing",
        QUERY=query("ab", "世"),
        REQUEST_OUTPUT_LEN=output_len(2),
        STOP_WORDS_DICT=stop,
    )
    assert result.as_numpy("INPUT_ID").tolist() == [[97, 98, 259], [228, 184, 150]]
    stop_ids = result.as_numpy("STOP_WORDS_IDS")
    assert stop_ids[0].tolist() == [[228, 184, 150, 97, 98], [3, 5, -1, -1, -1]]
    assert stop_ids[1].tolist() == [[122, 0, 0, 0, 0], [1, -1, -1, -1, -1]]


def test_postprocessing_round_trips(client):
    ids = TOK.encode(PROMPT)
    tokens = np.array([[ids + [256, 259, 259]]], dtype=np.int32)  # [B=1, beams=1, T]
    lengths = np.array([[len(ids) + 1]], dtype=np.int32)
    result = infer(client, "postprocessing", TOKENS_BATCH=tokens, SEQUENCE_LENGTH=lengths)
    assert [[v.decode("utf-8") for v in row] for row in result.as_numpy("OUTPUT")] == [[PROMPT]]


def test_postprocessing_streams_split_characters_exactly(client):
    ids = TOK.encode("😀世")
    pieces = []
    for start, end in [(0, 2), (2, 5), (5, 7)]:  # cuts fall inside both characters
        prefix = np.array([[ids[:start]]], dtype=np.int32).reshape(1, 1, start)
        result = infer(
            client,
            "postprocessing",
            TOKENS_BATCH=np.array([[ids[start:end]]], dtype=np.int32),
            SEQUENCE_LENGTH=np.array([[end - start]], dtype=np.int32),
            PREFIX_TOKENS=prefix,
            PREFIX_LENGTH=np.array([[start]], dtype=np.int32),
            FLUSH=np.array([[end == len(ids)]]),
        )
        pieces.append(result.as_numpy("OUTPUT")[0, 0].decode("utf-8"))
    assert pieces == ["", "😀", "世"]


def test_invalid_utf8_prompt_is_invalid_arg(client):
    with pytest.raises(InferenceServerException) as exc:
        infer(
            client, "preprocessing", QUERY=query(b"bad \xc3\x28"), REQUEST_OUTPUT_LEN=output_len(1)
        )
    assert_invalid_arg(client, exc, "QUERY[0] is not valid UTF-8: byte 0xc3 at offset 4")


def test_empty_prompt_is_invalid_arg(client):
    with pytest.raises(InferenceServerException) as exc:
        infer(client, "preprocessing", QUERY=query(""), REQUEST_OUTPUT_LEN=output_len(1))
    assert_invalid_arg(client, exc, "QUERY[0] is empty")


def test_a_negative_id_is_invalid_arg(client):
    with pytest.raises(InferenceServerException) as exc:
        infer(
            client,
            "postprocessing",
            TOKENS_BATCH=np.array([[[65, -4]]], dtype=np.int32),
            SEQUENCE_LENGTH=np.array([[2]], dtype=np.int32),
        )
    assert_invalid_arg(client, exc, "TOKENS_BATCH holds ids that are no token ids: [-4]")
    # An id past the tokenizer (a model's padded vocabulary) decodes to nothing, as the
    # tokenizer decodes it: an error mid-stream would leave an ensemble request open.
    result = infer(client, "postprocessing", TOKENS_BATCH=np.array([[[65, 4000]]], np.int32),
                   SEQUENCE_LENGTH=np.array([[2]], dtype=np.int32))
    assert result.as_numpy("OUTPUT").tolist() == [[b"A"]]


def test_server_still_serves_after_errors(client):
    test_invalid_utf8_prompt_is_invalid_arg(client)
    result = infer(client, "preprocessing", QUERY=query("ok"), REQUEST_OUTPUT_LEN=output_len(1))
    assert result.as_numpy("INPUT_ID").tolist() == [[111, 107]]
    assert client.conn.is_model_ready("preprocessing")
    assert client.conn.is_model_ready("postprocessing")
