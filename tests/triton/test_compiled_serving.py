"""The ensemble served with the AOT-compiled engine (executor 'compiled')."""

from __future__ import annotations

import pytest
import torch

from backend.engine import Engine, EngineConfig, SamplingParams
from client.generate import GenerateError, GenerateParams, generate_http, stream_grpc
from tests.triton.conftest import LLM_MODELS, LLM_PARAMS
from tests.triton.llm_helpers import assert_prompt_and_branch_served_as_generated, long_prompt

MAX_TOKENS = 10


def test_compiled_engine_serves_what_the_eager_engine_generates(triton_server, aot_engine):
    model_dir, engine_dir = aot_engine
    params = {"hybrid_llm": {**LLM_PARAMS["hybrid_llm"], "executor": "compiled",
                             "engine_dir": str(engine_dir)}}
    server = triton_server(LLM_MODELS, params)
    eager = Engine.from_model_dir(model_dir, EngineConfig.from_params(LLM_PARAMS["hybrid_llm"]))
    sampling = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, top_k=1)
    for seed in ("def parse(", "Once upon a time"):
        prompt = long_prompt(seed, 150)
        request = GenerateParams(prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, top_k=1,
                                 cache_salt="compiled")
        served = generate_http(server.urls.http, request)
        ids = eager.tokenizer.encode(prompt)
        want = eager.tokenizer.decode(eager.generate(ids, sampling).new_token_ids,
                                      skip_special_tokens=True)
        assert served.text == want
        # the second identical request hits the prefix cache of the compiled engine
        streamed = "".join(c.text for c in stream_grpc(server.urls.grpc, request))
        assert streamed == want
    # Generation logits come from the compiled step too; context logits need the eager one.
    request = GenerateParams("Once upon a time", max_tokens=4, top_k=1,
                             return_generation_logits=True)
    served = generate_http(server.urls.http, request)
    ids = eager.tokenizer.encode("Once upon a time")
    want = eager.generate(ids, SamplingParams(max_tokens=4, top_k=1),
                          return_generation_logits=True)
    assert served.text == eager.tokenizer.decode(want.new_token_ids, skip_special_tokens=True)
    torch.testing.assert_close(torch.from_numpy(served.generation_logits),
                               want.generation_logits.reshape(-1), atol=1e-3, rtol=0)
    with pytest.raises(GenerateError, match="return_context_logits needs executor 'torch'"):
        generate_http(server.urls.http, GenerateParams("Hello", max_tokens=2,
                                                       return_context_logits=True))
    with pytest.raises(GenerateError, match="return_prompt_log_probs needs executor 'torch'"):
        generate_http(server.urls.http, GenerateParams("Hello", max_tokens=2,
                                                       return_prompt_log_probs=True))
    # Generated tokens' alternatives need no prompt logits: served compiled too.
    top = generate_http(server.urls.http, GenerateParams("Hello", max_tokens=3, top_k=1,
                                                         num_top_log_probs=2))
    want = eager.generate(eager.tokenizer.encode("Hello"),
                          SamplingParams(max_tokens=3, top_k=1, top_log_probs=2))
    assert top.top_log_prob_ids.tolist() == [t for p in want.top_log_probs for t, _ in p]
    torch.testing.assert_close(torch.from_numpy(top.top_log_probs),
                               torch.tensor([v for p in want.top_log_probs for _, v in p]),
                               atol=1e-3, rtol=0)


def test_compiled_engine_serves_int8_anchors_through_the_dram_tier(triton_server, aot_engine):
    """`anchor_dtype: int8` and a DRAM tier (`host_pages`) on the compiled executor, set in
    config.pbtxt: the server generates what the eager engine with int8 anchors does, and a
    branch of a served prompt hits its pages."""
    model_dir, engine_dir = aot_engine
    int8 = {**LLM_PARAMS["hybrid_llm"], "anchor_dtype": "int8", "host_pages": "64"}
    server = triton_server(LLM_MODELS, {"hybrid_llm": {**int8, "executor": "compiled",
                                                       "engine_dir": str(engine_dir)}})
    eager = Engine.from_model_dir(model_dir, EngineConfig.from_params(int8))
    assert eager.executor.anchors.dtype == torch.int8 and eager.tiers is not None
    counts = assert_prompt_and_branch_served_as_generated(server, eager, "Quantized anchors",
                                                          MAX_TOKENS)
    assert counts["cached_tokens"] >= 128
