"""`stream_grpc` reports every failure as `GenerateError`, so callers (the soak, the suite,
`client generate`) count it instead of losing a thread to tritonclient's own exceptions."""

from __future__ import annotations

import pytest

from backend.triton.repo import free_ports
from client.generate import GenerateError, GenerateParams, stream_grpc


def test_a_server_that_is_not_there_is_a_generate_error():
    [port] = free_ports(1)
    for _ in range(5):  # the broken stream shows either at the send or in the callback;
        # either way the error says why (not tritonclient's "stream no longer in valid state")
        with pytest.raises(GenerateError, match="(?i)connection refused|failed to connect"):
            list(stream_grpc(f"localhost:{port}", GenerateParams("hello", max_tokens=2),
                             timeout_s=20))
