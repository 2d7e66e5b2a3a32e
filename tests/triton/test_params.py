from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.tokenizer import write_byte_tokenizer
from backend.triton.errors import ConfigError
from backend.triton.params import (
    get_bool_param,
    get_param,
    load_tokenizer_param,
    parse_model_config,
    repository_root,
)


def config(**params: str) -> dict:
    return {"parameters": {k: {"string_value": v} for k, v in params.items()}}


def backend_args(model_dir: Path, **params: str) -> dict[str, str]:
    return {"model_config": json.dumps(config(**params)), "model_repository": str(model_dir)}


def test_unfilled_template_counts_as_unset():
    assert get_param(config(tokenizer_dir="${tokenizer_dir}"), "tokenizer_dir", "d") == "d"
    assert get_param(config(tokenizer_dir="  "), "tokenizer_dir") is None
    assert get_param(config(tokenizer_dir="x"), "tokenizer_dir") == "x"


@pytest.mark.parametrize(("value", "expected"), [("True", True), ("0", False), ("no", False)])
def test_bool_params(value, expected):
    assert get_bool_param(config(flag=value), "flag", default=not expected) is expected


def test_bad_bool_names_the_parameter():
    with pytest.raises(ConfigError, match="skip_special_tokens must be true or false, got 'maybe'"):
        get_bool_param(config(skip_special_tokens="maybe"), "skip_special_tokens", True)


def test_repository_root_is_the_models_parent(tmp_path):
    assert repository_root({"model_repository": str(tmp_path / "pre")}) == tmp_path.resolve()


def test_relative_tokenizer_dir_resolves_against_repository(tmp_path):
    write_byte_tokenizer(tmp_path / "hybrid_llm" / "1" / "tiny_qwen3_5")
    args = backend_args(tmp_path / "preprocessing")
    tok = load_tokenizer_param(parse_model_config(args), args)
    assert tok.eos_token_id == 256


def test_missing_tokenizer_names_parameter_and_path(tmp_path):
    args = backend_args(tmp_path / "preprocessing", tokenizer_dir="nowhere")
    with pytest.raises(ConfigError, match=r"tokenizer_dir='nowhere'.*nowhere"):
        load_tokenizer_param(parse_model_config(args), args)


def test_unparsable_model_config():
    with pytest.raises(ConfigError, match="model config"):
        parse_model_config({"model_config": "{oops"})
