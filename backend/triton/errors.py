"""Error kinds of the Triton models, kept free of `triton_python_backend_utils` for unit tests.

`model.py` turns a `ConfigError` raised in `initialize` into `pb_utils.TritonModelException`
(the model fails to load, naming the bad parameter) and a `RequestError` raised for one request
into an error response with code INVALID_ARG (HTTP 400); the other requests of the batch and
the server carry on.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad config.pbtxt parameter; the message names it and its value."""


class RequestError(ValueError):
    """A bad request (wrong shape, invalid UTF-8, empty prompt...); the message says what."""
