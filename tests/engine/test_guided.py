"""Guided decoding (`backend/engine/guided.py`) on the trained default model: the tokens a guide
allows equal a brute-force reference (partial regular-expression matches over every byte), and
what the engine generates under a guide follows it, ends where the grammar ends, and leaves
unguided requests in the same batch unchanged."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import regex
import torch
from engine_helpers import assert_no_leak

from backend.engine import Engine, EngineConfig, SamplingParams
from backend.engine.guided import Guide
from backend.engine.request import Request

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repo/hybrid_llm/1/tiny_qwen3_5"
PROMPT_TEXT = '# settings\nuser = {"name": "alice", "age": 31, "admin": false}\nitem = '
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "admin": {"type": "boolean"},
        "role": {"enum": ["dev", "ops"]},
    },
    "required": ["name", "age", "admin", "role"],
}
# ASCII-only patterns (no '.', no negated classes): no byte >= 0x80 can ever be allowed.
REGEXES = [r"[0-9]{1,3}-(yes|no)", r"(ab|a[cd]+)e?[xyz]{2}", r"\(([a-z]+, )*[a-z]+\)",
           r"-?(0|[1-9][0-9]*)(\.[0-9]+)?"]
# Bounded ones: every output ends before max_tokens, whatever the model prefers.
BOUNDED = [r"[0-9]{1,3}-(yes|no)", r"(ab|a[cd]{1,4})e?[xyz]{2}",
           r"\(([a-z]{1,6}, ){0,3}[a-z]{1,6}\)", r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,4})?"]


@pytest.fixture(scope="module")
def engine():
    engine = Engine.from_model_dir(MODEL_DIR, EngineConfig())
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.tokenizer.encode(PROMPT_TEXT)


def reference_allowed(pattern: str, prefix: str) -> tuple[set[int], bool]:
    """The bytes that keep `prefix` a prefix of some match of `pattern`, and whether `prefix`
    is a whole match: plain `regex` partial matching, one candidate at a time."""
    allowed = {b for b in range(128)
               if regex.fullmatch(pattern, prefix + chr(b), partial=True) is not None}
    return allowed, regex.fullmatch(pattern, prefix) is not None


@pytest.mark.parametrize("pattern", REGEXES)
def test_allowed_tokens_equal_a_brute_force_reference(engine, pattern):
    grammars = engine.grammars()
    eos = engine.eos_token_id
    rng = random.Random(0)
    for walk in range(6):
        state = grammars.state(Guide("regex", pattern), eos)
        prefix = ""
        for _ in range(40):  # patterns with * never force an end
            allowed = set(state.allowed.nonzero().view(-1).tolist())
            expected, complete = reference_allowed(pattern, prefix)
            assert allowed - {eos} == expected, f"walk {walk} after {prefix!r}"
            assert (eos in allowed) == complete, f"walk {walk} after {prefix!r}"
            assert state.continues == bool(expected), f"walk {walk} after {prefix!r}"
            if not expected:
                break
            token = rng.choice(sorted(expected))
            state.accept(token)
            prefix += chr(token)


def test_special_tokens_are_never_allowed(engine):
    # The special tokens' names spell text a permissive pattern would match.
    state = engine.grammars().state(Guide("regex", r"[<|a-z_>]{1,20}"), engine.eos_token_id)
    specials = set(engine.tokenizer.special_tokens.values())
    assert specials and not specials & set(state.allowed.nonzero().view(-1).tolist())


def generate(engine, prompt, guide: Guide, **options):
    options.setdefault("max_tokens", 96)
    out = engine.generate(prompt, SamplingParams(guide=guide, **options))
    return engine.tokenizer.decode(out.new_token_ids), out


@pytest.mark.parametrize("pattern", BOUNDED)
def test_regex_outputs_match_and_end_with_the_grammar(engine, prompt, pattern):
    for options in ({"top_k": 1}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.3, "seed": 2}):
        text, out = generate(engine, prompt, Guide("regex", pattern), **options)
        assert regex.fullmatch(pattern, text), (options, text)
        assert out.finish_reason in ("stop", "eos") and out.num_output_tokens < 96, options


def test_json_schema_outputs_parse_and_follow_the_schema(engine, prompt):
    guide = Guide("json_schema", json.dumps(SCHEMA))
    for seed in range(4):
        text, out = generate(engine, prompt, guide, temperature=1.0, seed=seed)
        assert out.finish_reason in ("stop", "eos"), text
        value = json.loads(text)
        assert list(value) == ["name", "age", "admin", "role"], text
        assert isinstance(value["name"], str) and len(value["name"]) <= 12
        assert type(value["age"]) is int and 0 <= value["age"] <= 150
        assert type(value["admin"]) is bool and value["role"] in ("dev", "ops")
        assert text == json.dumps(value, ensure_ascii=False), "compact JSON on one line"


def test_json_outputs_are_an_object_or_an_array(engine, prompt):
    for seed in range(3):
        text, out = generate(engine, prompt, Guide("json"), max_tokens=200, temperature=1.0,
                             seed=seed)
        if out.finish_reason == "length":  # an array may go on; what came is its prefix
            assert text[0] in "[{", text
            continue
        assert isinstance(json.loads(text), dict | list), text


def test_ebnf_grammar_outputs_follow_the_grammar(engine, prompt):
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-z]+ | [0-9]+'
    for seed in range(3):
        text, _ = generate(engine, prompt, Guide("ebnf_grammar", grammar), temperature=1.0,
                           seed=seed)
        assert regex.fullmatch(r"\(([a-z]+|[0-9]+)(,([a-z]+|[0-9]+))*\)", text), text


def test_the_grammar_outranks_min_tokens_and_bad_words(engine, prompt):
    text, out = generate(engine, prompt, Guide("regex", "[ab]{3}"), top_k=1, min_tokens=20)
    assert len(text) == 3 and out.finish_reason == "stop"
    # a bad word removes a choice only where the grammar has another one
    text, _ = generate(engine, prompt, Guide("regex", "a[ab]{4}"), top_k=1,
                       bad_words=((ord("a"),),))
    assert text == "abbbb"


def test_without_an_end_token_the_output_stops_at_the_grammar_end(engine, prompt):
    text, out = generate(engine, prompt, Guide("regex", "(yes|no)!"), top_k=1, end_id=-1)
    assert text in ("yes!", "no!") and out.finish_reason == "stop"
    # A grammar that may go on keeps going (no end token to choose) until it cannot.
    text, out = generate(engine, prompt, Guide("regex", "[0-9]{1,5}"), top_k=1, end_id=-1)
    assert len(text) == 5 and out.finish_reason == "stop"


@pytest.mark.parametrize("guide, message", [
    (("regex", "[a-"), "not a valid regex: Regex parsing error"),
    (("json_schema", '{"type": "intege"}'), "not a valid json_schema"),
    (("json_schema", "{not json"), "not a valid json_schema"),
    (("ebnf_grammar", 'root ::= "a" |'), "not a valid ebnf_grammar"),
    (("ebnf_grammar", 'start ::= "a"'), "not a valid ebnf_grammar"),
    (("regex", "()"), "allows only an empty output"),
])
def test_bad_guides_are_value_errors_and_leak_nothing(engine, prompt, guide, message):
    with pytest.raises(ValueError, match=regex.escape(message)):
        engine.submit(Request("bad", prompt, SamplingParams(guide=Guide(*guide))))
    assert "bad" not in engine._live
    assert_no_leak_when_idle(engine)


@pytest.mark.parametrize("kind, text, message", [
    ("xml", "", "must be one of json, json_schema, regex, ebnf_grammar, structural_tag"),
    ("regex", " ", "needs a guided_decoding_guide"),
])
def test_bad_guide_fields_are_value_errors(kind, text, message):
    with pytest.raises(ValueError, match=message):
        Guide(kind, text)


def assert_no_leak_when_idle(engine: Engine) -> None:
    engine.store.assert_invariants()
    assert engine.stats()["active_requests"] == 0


def test_unguided_requests_beside_guided_ones_are_unchanged(prompt):
    engine = Engine.from_model_dir(MODEL_DIR, EngineConfig())
    greedy = SamplingParams(max_tokens=24, top_k=1)
    alone = engine.generate(prompt, greedy, cache_salt="alone").new_token_ids
    outputs: dict[str, list[int]] = {"plain": [], "guided": []}
    finished = []

    def collect(out):
        outputs[out.request_id].extend(out.new_token_ids)
        if out.finished:
            finished.append(out)

    engine.submit(Request("guided", prompt, SamplingParams(
        max_tokens=24, top_k=1, guide=Guide("regex", "[0-9]{6}")), cache_salt="guided",
        on_output=collect))
    engine.submit(Request("plain", prompt, greedy, cache_salt="plain", on_output=collect))
    while len(finished) < 2:
        engine.step()
    assert outputs["plain"] == alone
    assert regex.fullmatch("[0-9]{6}", engine.tokenizer.decode(outputs["guided"]))
    assert_no_leak(engine)


def test_the_mask_is_applied_before_every_choice(engine):
    """`sample` draws only allowed tokens whatever the logits say, greedy or not."""
    from backend.engine.sampling import sample

    V = engine.model_config.vocab_size
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 5

    allowed = engine.grammars().state(Guide("regex", r"\n|\x14|\x1e"), engine.eos_token_id)
    assert allowed.allowed.nonzero().view(-1).tolist() == [10, 20, 30]
    params = [SamplingParams(top_k=1), SamplingParams(temperature=2.0, seed=3),
              SamplingParams(top_k=1, bad_words=((10,), (20,), (30,))),
              SamplingParams(top_k=1)]
    gens = [None, torch.Generator().manual_seed(3), None, None]
    for _ in range(20):
        tokens = sample(logits, params, gens, [0] * 4, [()] * 4, None,
                        [allowed, allowed, allowed, None]).tolist()
        assert all(t in (10, 20, 30) for t in tokens[:3]), tokens
        assert tokens[0] == max((10, 20, 30), key=lambda t: logits[0, t])
        assert tokens[3] == int(logits[3].argmax())


def test_packed_masks_round_trip_and_match_plain_bit_arithmetic():
    from backend.engine.guided import pack_bits, unpack_bits

    gen = torch.Generator().manual_seed(0)
    for V in (1, 31, 32, 33, 260, 1000, 151_936):
        mask = torch.rand(V, generator=gen) < 0.3
        words = pack_bits(mask.numpy())
        assert words.shape == ((V + 31) // 32,) and words.dtype.str == "<i4"
        assert torch.equal(torch.from_numpy(unpack_bits(words, V).copy()), mask)
        # bit j of word w is token 32 w + j, as XGrammar lays its bitmask out
        plain = [bool((int(words[t // 32]) >> (t % 32)) & 1) for t in range(V)]
        assert plain == mask.tolist()


def test_apply_masks_exactly_the_tokens_not_allowed(engine):
    state = engine.grammars().state(Guide("regex", r"[0-9]{2}|yes"), engine.eos_token_id)
    row = torch.randn(engine.model_config.vocab_size)
    masked = row.clone()
    state.apply(masked)
    allowed = [ord(c) for c in "0123456789y"]
    assert torch.isfinite(masked).nonzero().view(-1).tolist() == allowed
    assert torch.equal(masked[allowed], row[allowed])


def test_sentencepiece_byte_fallback_vocabularies_spell_their_bytes():
    """A Llama-style vocabulary ("▁" for spaces, <0xNN> byte tokens): XGrammar reads its
    tokenizer.json, so tokens are matched by the text they decode to."""
    import tokenizers
    from tokenizers import decoders, models, normalizers

    from backend.engine.guided import GrammarBackend
    from backend.tokenizer import Tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for word in ("▁b", "a", "b", "▁", "ab", "ba"):
        vocab[word] = len(vocab)
    inner = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True,
                                            unk_token="<unk>"))
    inner.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                             normalizers.Replace(" ", "▁")])
    inner.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                       decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    inner.add_special_tokens(["<s>", "</s>"])
    state = GrammarBackend(Tokenizer(inner, "</s>"), len(vocab)).state(Guide("regex", "a b"), 2)
    names = {v: k for k, v in vocab.items()}

    def allowed() -> set[str]:
        return {names[i] for i in state.allowed.nonzero().view(-1).tolist()}

    assert allowed() == {"a", "<0x61>"}
    state.accept(vocab["a"])
    assert allowed() == {"▁", "▁b", "<0x20>"}
    state.accept(vocab["▁b"])
    assert allowed() == {"</s>"} and not state.continues


def test_jump_forward_gives_the_same_outputs_in_fewer_steps(prompt):
    """Forced tokens (the only one the grammar allows) join without a decode step each:
    greedy outputs equal those of one token per step, in fewer steps."""
    results = {}
    for jump in (False, True):
        engine = Engine.from_model_dir(MODEL_DIR, EngineConfig(guided_jump_forward=jump))
        rows = []
        for guide in (Guide("json_schema", json.dumps(SCHEMA)),
                      Guide("regex", r"(ab|a[cd]{1,4})e?[xyz]{2}")):
            steps = engine.stats()["steps"]
            out = engine.generate(prompt, SamplingParams(max_tokens=96, top_k=1, guide=guide))
            rows.append((out.new_token_ids, out.finish_reason, engine.stats()["steps"] - steps))
        results[jump] = (rows, engine.stats()["guided_forced_tokens"])
        assert_no_leak(engine)
    (plain, none_forced), (jumped, forced) = results[False], results[True]
    assert none_forced == 0 and forced > 10
    for (ids, reason, steps), (jump_ids, jump_reason, jump_steps) in zip(plain, jumped):
        assert jump_ids == ids and jump_reason == reason
        assert steps == len(ids)  # one decode step a token (the first after the prefill)
        assert jump_steps <= steps
    json_steps, json_jump_steps = plain[0][2], jumped[0][2]
    assert json_jump_steps <= json_steps - forced // 2, (json_steps, json_jump_steps, forced)


def test_jump_forward_leaves_requests_with_log_probs_a_step_a_token(engine, prompt):
    forced = engine.stats()["guided_forced_tokens"]
    out = engine.generate(prompt, SamplingParams(
        max_tokens=96, top_k=1, return_log_probs=True, guide=Guide("json_schema",
                                                                   json.dumps(SCHEMA))))
    assert engine.stats()["guided_forced_tokens"] == forced
    assert len(out.log_probs) == len(out.new_token_ids) > 20
    assert all(lp <= 0 for lp in out.log_probs)


TOOL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
               "required": ["city"]}


@pytest.mark.parametrize("form", ["xgrammar", "older"])
def test_structural_tags_guide_tagged_json_after_a_trigger(engine, prompt, form):
    """Free text until a trigger, then the tag's JSON and its end (a tool call): with the
    trigger in the prompt's continuation forced by a regex-like start, the call is valid."""
    if form == "xgrammar":
        tag = {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": ["<call="],
            "tags": [{"begin": "<call=weather>", "end": "</call>",
                      "content": {"type": "json_schema", "json_schema": TOOL_SCHEMA}}]}}
    else:
        tag = {"type": "structural_tag", "triggers": ["<call="], "structures": [
            {"begin": "<call=weather>", "schema": TOOL_SCHEMA, "end": "</call>"}]}
    state = engine.grammars().state(Guide("structural_tag", json.dumps(tag)),
                                    engine.eos_token_id)
    text = "I will check. <call=weather>"
    for ch in text:  # free text, then the trigger and the tag's begin
        assert bool(state.allowed[ord(ch)]), f"{ch!r} refused after {text[:text.index(ch)]!r}"
        state.accept(ord(ch))
    # Inside the tag only the schema's JSON may come: '{' and nothing else.
    assert state.allowed.nonzero().view(-1).tolist() == [ord("{")]
    for ch in '{"city": "oslo"}</call>':
        assert bool(state.allowed[ord(ch)]), ch
        state.accept(ord(ch))
    assert state.continues and bool(state.allowed[engine.eos_token_id])  # text may go on
    # Served through the engine, every tagged section it writes parses.
    for seed in range(3):
        out_text, _ = generate(engine, prompt + engine.tokenizer.encode("<call=weather>"),
                               Guide("structural_tag", json.dumps(tag)), temperature=1.0,
                               seed=seed, max_tokens=64)
        for body in regex.findall(r"<call=weather>(.*?)</call>", out_text):
            assert isinstance(json.loads(body)["city"], str), out_text


@pytest.mark.parametrize("tag", ['{"type": "structural_tag"}', '{"structures": 5}', "[]"])
def test_a_bad_structural_tag_is_a_value_error(engine, tag):
    with pytest.raises(ValueError, match="not a valid structural_tag: Invalid structural tag"):
        engine.grammars().compile(Guide("structural_tag", tag))


LONG_KEYS = {"type": "object", "properties": {
    "description_of_the_item": {"type": "string", "maxLength": 12},
    "a_long_forced_property_name_number_one": {"type": "integer", "minimum": 0, "maximum": 150},
    "another_long_forced_property_name_two": {"type": "boolean"}},
    "required": ["description_of_the_item", "a_long_forced_property_name_number_one",
                 "another_long_forced_property_name_two"]}


@pytest.mark.parametrize("policy", ["suffixreplay", "checkpoint"])
def test_a_jump_forward_answer_saves_the_states_a_token_a_step_saves(prompt, policy):
    """Forced runs (the long property names) crossed page boundaries in one chunk, which saves
    a state at its end only: the next turn resumed pages earlier (checkpoint) or replayed
    (suffix replay). A jump now stops at the next page boundary."""
    from dataclasses import replace

    from backend.cache.config import CacheConfig

    got = []
    for jump in (False, True):
        config = replace(EngineConfig(guided_jump_forward=jump),
                         cache=CacheConfig(policy=policy, page_size=16))
        engine = Engine.from_model_dir(MODEL_DIR, config)
        answer = engine.generate(prompt, SamplingParams(
            max_tokens=200, top_k=1, guide=Guide("json_schema", json.dumps(LONG_KEYS))))
        assert answer.finish_reason == "stop"
        turn = prompt + answer.new_token_ids + engine.tokenizer.encode(" and then")
        out = engine.generate(turn, SamplingParams(max_tokens=4, top_k=1))
        got.append((answer.new_token_ids, out.cached_tokens, out.replayed_anchors))
        if jump:
            assert engine.stats()["guided_forced_tokens"] > 60
        engine.reset_prefix_cache()
        assert_no_leak(engine)
    assert got[1] == got[0]
    computed = len(prompt) + len(got[0][0]) - 1
    assert got[0][1:] == (computed // 16 * 16, 0)


def test_seeded_guided_tokens_do_not_depend_on_log_probs_or_jump_forward(prompt):
    """A forced token is taken, not drawn, whether jump-forward appends it or a step samples
    it (a request with log probabilities or logits, or jump-forward off): drawing it moved
    the seeded generator, and every token after the first forced run differed."""
    guide = Guide("json_schema", json.dumps(SCHEMA))
    runs = []
    for jump in (True, False):
        engine = Engine.from_model_dir(MODEL_DIR, EngineConfig(guided_jump_forward=jump))
        for extra in ({}, {"return_log_probs": True}):
            out = engine.generate(prompt, SamplingParams(max_tokens=60, seed=3, temperature=1.0,
                                                         guide=guide, **extra))
            runs.append(out.new_token_ids)
            if extra:
                assert len(out.log_probs) == len(out.new_token_ids)
                assert all(lp <= 0 for lp in out.log_probs)
        assert_no_leak(engine)
    assert all(r == runs[0] for r in runs), runs


def test_a_grammar_completed_on_the_last_allowed_token_stops(engine, prompt):
    """The output 'abc' is whole on the max_tokens-th token: "stop" (it read "length", which
    tells a client the answer was cut)."""
    text, out = generate(engine, prompt, Guide("regex", "abc"), top_k=1, max_tokens=3)
    assert text == "abc" and out.finish_reason == "stop"


def test_the_grammar_end_drawn_before_min_tokens_is_an_end_not_an_output(engine, prompt):
    """After 'a' the grammar allows 'b' (a bad word) or its end (banned by min_tokens): the
    bans give way and the end is drawn; it was output as a token with reason "stop"."""
    eos = engine.eos_token_id
    text, out = generate(engine, prompt, Guide("regex", "ab?"), top_k=1, min_tokens=5,
                         bad_words=((ord("b"),),), logit_bias=((eos, 20.0),))
    assert out.new_token_ids == [ord("a")] and out.finish_reason == "eos"


def test_an_end_id_the_grammar_needs_as_text_fails_the_request(engine, prompt):
    """end_id 10 (a newline) with a grammar that writes a newline: XGrammar takes 10 as the
    grammar's end only, so after 'a' nothing may follow; that read as a complete output
    ('a', "stop", not a match). Now the request fails with a clear message."""
    text, out = generate(engine, prompt, Guide("regex", "a\nb"), top_k=1, end_id=10)
    assert out.finish_reason == "error" and "end_id 10" in out.error
    assert_no_leak(engine)
