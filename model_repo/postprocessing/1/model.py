"""Triton Python model `postprocessing`: token ids -> text (backend/triton/postprocess.py)."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from backend.triton.cancel import stop_cancelled
from backend.triton.errors import ConfigError
from backend.triton.params import get_bool_param, load_tokenizer_param, parse_model_config
from backend.triton.postprocess import Postprocessor
from backend.triton.responses import respond


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        try:
            config = parse_model_config(args)
            tokenizer = load_tokenizer_param(config, args)
            skip_special_tokens = get_bool_param(config, "skip_special_tokens", True)
        except ConfigError as exc:
            raise pb_utils.TritonModelException(str(exc)) from exc
        self.postprocess = Postprocessor(tokenizer, skip_special_tokens)

    def execute(self, requests: list) -> list:
        # A cancelled ensemble request shows up here first: stop its generation. Its response
        # is still a normal one (an error here leaves the ensemble request hanging in Triton).
        stop_cancelled(pb_utils, requests)
        return respond(pb_utils, requests, self.postprocess)
