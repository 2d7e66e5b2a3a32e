"""The guided-decoding benchmark, short: every way ran to its token count, and the grammar's
work was timed on both vocabularies (the synthetic one made small here)."""

from __future__ import annotations

import json

from client.bench import guided


def test_a_short_run_measures_every_way(tmp_path):
    summary = guided.main(["--batch", "2", "--max-tokens", "16", "--repeats", "1",
                           "--large-vocab", "4000", "--out", str(tmp_path / "summary.json")])
    tokens = summary["output_tokens"]
    assert tokens["unguided"] == tokens["regex"] == 2 * 16  # the regex asks for 16 letters
    assert 2 <= tokens["json_schema"] <= 2 * 16
    assert set(summary["guided_over_unguided"]) == {"regex", "json_schema",
                                                    "json_schema_no_jump"}
    assert tokens["json_schema_no_jump"] == tokens["json_schema"]  # 16 tokens: cut alike
    jump = summary["jump_forward"]
    # the schema's first 16 tokens ('{"name": "' and six sampled ones) take fewer steps
    assert jump["steps"]["json_schema"] < jump["steps"]["json_schema_no_jump"], jump
    assert all(v > 0 for v in summary["decode_tokens_per_s"].values())
    work = summary["grammar_work"]
    assert work["model"]["vocab_size"] == 260 and work["large"]["vocab_size"] == 4000
    for entry in work.values():
        assert entry["regex_per_token_us"] > 0 and entry["json_schema_compile_ms"] > 0
    assert json.loads((tmp_path / "summary.json").read_text())["config"]["batch"] == 2


def test_the_synthetic_vocabulary_is_byte_level_and_distinct():
    tok = guided.synthetic_tokenizer(3000)
    assert tok.vocab_size == 3000 and tok.eos_token_id == 2999
    assert tok.decode(tok.encode("hello, world")) == "hello, world"
    vocab = tok.tok.get_vocab()
    assert len(set(vocab.values())) == len(vocab) == 3000
