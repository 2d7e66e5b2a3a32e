"""Triton Python model `preprocessing`: prompt -> token ids (backend/triton/tokenize.py)."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from backend.triton.errors import ConfigError
from backend.triton.params import get_bool_param, load_tokenizer_param, parse_model_config
from backend.triton.responses import respond
from backend.triton.tokenize import Preprocessor


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        try:
            config = parse_model_config(args)
            tokenizer = load_tokenizer_param(config, args)
            add_special_tokens = get_bool_param(config, "add_special_tokens", True)
        except ConfigError as exc:
            raise pb_utils.TritonModelException(str(exc)) from exc
        self.preprocess = Preprocessor(tokenizer, add_special_tokens)

    def execute(self, requests: list) -> list:
        return respond(pb_utils, requests, self.preprocess)
