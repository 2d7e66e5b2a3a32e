"""An OpenAI-compatible HTTP frontend for the served ensemble (`python -m backend.openai_api`).

`/v1/completions`, `/v1/chat/completions` (streamed as server-sent events or not), `/v1/models`
and `/health/ready`, translated to the `ensemble` model's inputs and sent to a running Triton
server over gRPC streaming: `protocol.py` (request bodies -> ensemble inputs, with the errors a
client gets for what is wrong), `chat.py` (the model's chat template), `upstream.py` (the Triton
side: the served configuration, one gRPC stream a request) and `server.py` (the aiohttp app).
"""
