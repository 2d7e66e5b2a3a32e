"""The request parsers under arbitrary tensors. hybrid_llm's: every input of its config, with the
dtype the config declares (Triton refuses any other before the model runs) and random shapes
and values (NaN, infinities, huge and negative numbers, invalid UTF-8, empty tensors), either
parses into a valid request or raises `RequestError` saying what is wrong; never another
exception (which Triton would report as an internal error instead of INVALID_ARG).
Preprocessing's the same way, with its config's dtypes and ranks ([batch, 1] or [batch, W]),
batch sizes that may disagree, and text that may not be UTF-8."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.engine.request import SamplingParams
from backend.tokenizer import load_tokenizer
from backend.triton.errors import RequestError
from backend.triton.llm_request import LlmRequest, parse_request
from backend.triton.tokenize import Preprocessor

REPO = Path(__file__).resolve().parents[2] / "model_repo"
CONFIG = REPO / "hybrid_llm/config.pbtxt"
NUMPY = {"TYPE_INT32": np.int32, "TYPE_UINT64": np.uint64, "TYPE_FP32": np.float32,
         "TYPE_BOOL": np.bool_, "TYPE_STRING": np.object_}
# input name -> numpy dtype, from the input blocks of the config
DTYPE_OF = {name: NUMPY[kind] for name, kind in re.findall(
    r'name: "(\w+)"\s+data_type: (TYPE_\w+)', CONFIG.read_text().split("output [")[0])}
VALUES = st.one_of(
    st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2, 7, 2**31 - 1, 2**31, 1.5, 0.0]),
    st.binary(max_size=6), st.text(max_size=4))


@st.composite
def named_tensor(draw) -> tuple[str, np.ndarray]:
    name = draw(st.sampled_from(sorted(DTYPE_OF)))
    dtype = DTYPE_OF[name]
    shape = draw(st.sampled_from([(), (1,), (1, 1), (2,), (1, 3), (1, 2, 3), (1, 0), (0,)]))
    size = int(np.prod(shape))
    values = draw(st.lists(VALUES, min_size=size, max_size=size))
    return name, as_tensor(values, dtype, shape)


def as_tensor(values: list, dtype, shape: tuple[int, ...]) -> np.ndarray:
    """`values` as a tensor of `dtype` and `shape` (Triton hands BYTES tensors over as bytes
    objects); zeros of the dtype when a value does not fit it."""
    array = np.empty(len(values), dtype=object)
    if dtype is np.object_:
        array[:] = [v if isinstance(v, bytes) else str(v).encode() for v in values]
        return array.reshape(shape)
    array[:] = values
    try:
        with np.errstate(all="ignore"):
            return array.astype(dtype).reshape(shape)
    except (ValueError, TypeError, OverflowError):
        return np.zeros(shape, dtype=dtype)


BASE = {"input_ids": np.array([[104, 105]], np.int32),
        "request_output_len": np.array([[8]], np.int32)}


@settings(max_examples=400, deadline=None)
@given(st.lists(named_tensor(), max_size=4), st.booleans())
def test_any_tensors_parse_or_say_what_is_wrong(changed, keep_base):
    inputs = {**(BASE if keep_base else {}), **dict(changed)}
    try:
        request = parse_request(inputs, 256, exclude_input=True)
    except RequestError as exc:
        assert str(exc)  # a message for the client
        return
    assert isinstance(request, LlmRequest) and isinstance(request.sampling, SamplingParams)
    assert request.prompt_ids and all(isinstance(t, int) for t in request.prompt_ids)


PRE_CONFIG = (REPO / "preprocessing/config.pbtxt").read_text().split("output [")[0]
PRE_INPUTS = {name: (NUMPY[kind], dims == "1") for name, kind, dims in re.findall(
    r'name: "(\w+)"\s+data_type: (TYPE_\w+)\s+dims: \[ (-?1) \]', PRE_CONFIG)}
TEXTS = st.one_of(st.text(max_size=6).map(str.encode), st.binary(max_size=4))


@st.composite
def pre_tensor(draw) -> tuple[str, np.ndarray]:
    """A preprocessing input: [B, 1] or [B, W] (what Triton lets through for its dims)."""
    name = draw(st.sampled_from(sorted(PRE_INPUTS)))
    dtype, single = PRE_INPUTS[name]
    shape = (draw(st.integers(1, 2)), 1 if single else draw(st.integers(0, 3)))
    numbers = VALUES.filter(lambda v: not isinstance(v, (bytes, str)))
    values = draw(st.lists(TEXTS if dtype is np.object_ else numbers,
                           min_size=shape[0] * shape[1], max_size=shape[0] * shape[1]))
    return name, as_tensor(values, dtype, shape)


PREPROCESS = Preprocessor(load_tokenizer(REPO / "hybrid_llm/1/tiny_qwen3_5"))
PRE_BASE = {"QUERY": np.array([[b"hello"]], dtype=object),
            "REQUEST_OUTPUT_LEN": np.array([[8]], np.int32)}


@settings(max_examples=300, deadline=None)
@given(st.lists(pre_tensor(), max_size=4), st.booleans())
def test_any_preprocessing_tensors_tokenize_or_say_what_is_wrong(changed, keep_base):
    inputs = {**(PRE_BASE if keep_base else {}), **dict(changed)}
    try:
        out = PREPROCESS(inputs)
    except RequestError as exc:
        assert str(exc)
        return
    batch = inputs["QUERY"].shape[0]
    assert out["INPUT_ID"].shape[0] == batch and out["INPUT_ID"].dtype == np.int32
    assert (out["REQUEST_INPUT_LEN"] >= 1).all()
