"""The ensemble served with the AOT-compiled engine (executor 'compiled')."""

from __future__ import annotations

from backend.engine import Engine, EngineConfig, SamplingParams
from client.generate import GenerateParams, generate_http, stream_grpc
from tests.triton.conftest import LLM_MODELS, LLM_PARAMS
from tests.triton.llm_helpers import long_prompt

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
