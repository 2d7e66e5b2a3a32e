"""The frontend's request errors (OpenAI error bodies)."""

from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """A request the frontend answers with an OpenAI error body and `status`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.kind = kind
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}
