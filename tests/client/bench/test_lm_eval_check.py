"""The lm-eval check's own parts without lm-eval (it lives in an environment of its own): the
tasks it writes, and its comparison, which passes answers the oracle itself gave in lm-eval's
sample layout and catches each kind of wrong answer (a log likelihood off by 0.01, a wrong
greedy flag, a wrong rolling sum, a wrong completion). The whole check ran against the served
model with lm-eval 0.4.13 (README)."""

from __future__ import annotations

import json

import pytest

from client.bench.lm_eval_check import COMPLETION_TASKS, Oracle, check, write_tasks
from tests.engine.engine_helpers import TINY_MODEL_DIR


@pytest.fixture(scope="module")
def oracle():
    return Oracle(TINY_MODEL_DIR)


def _sample(*args: str, resps: list) -> dict:
    return {"arguments": {f"gen_args_{i}": {f"arg_{j}": a for j, a in enumerate(arg)}
                          for i, arg in enumerate(args)}, "resps": resps}


def _samples(oracle: Oracle, docs: list[dict]) -> tuple[dict[str, list], list]:
    """What a correct server gives, in lm-eval's logged layout (numbers as strings)."""
    def scored(context, continuation):
        value, greedy = oracle.scores(oracle.encode(context), oracle.encode(continuation))
        return [[str(value), str(greedy)]]

    prefix = oracle.tokenizer.eos_token_id if oracle.tokenizer.bos_token_id is None \
        else oracle.tokenizer.bos_token_id
    samples = {
        "tiny_ll": [_sample((d["context"], " " + d["target"]),
                            resps=[scored(d["context"], " " + d["target"])]) for d in docs],
        "tiny_mc": [_sample(*[(d["context"], " " + c) for c in d["choices"]],
                            resps=[scored(d["context"], " " + c) for c in d["choices"]])
                    for d in docs],
        "tiny_roll": [_sample((d["context"],), resps=[[str(oracle.scores(
            [prefix], oracle.encode(d["context"]))[0])]]) for d in docs],
        "tiny_gen": [_sample((d["context"], {"until": ["\n"]}),
                             resps=[[oracle.greedy(oracle.encode(d["context"]))]])
                     for d in docs],
    }
    chats = []
    for d in docs:
        messages = [{"role": "user", "content": d["context"]}]
        chats.append(_sample(([json.dumps(messages)], {}),
                             resps=[[oracle.greedy(oracle.chat_ids(messages))]]))
    return samples, chats


def test_the_tasks_cover_every_request_type(tmp_path):
    write_tasks(tmp_path, 5, seed=3)
    docs = [json.loads(line) for line in (tmp_path / "data.jsonl").read_text().splitlines()]
    assert len(docs) == 5 and all(d["choices"][d["label"]] == d["target"] for d in docs)
    kinds = {name: (tmp_path / f"{name}.yaml").read_text() for name in COMPLETION_TASKS}
    assert {k: v.split("output_type: ")[1].split("\n")[0] for k, v in kinds.items()} == {
        "tiny_ll": "loglikelihood", "tiny_mc": "multiple_choice",
        "tiny_roll": "loglikelihood_rolling", "tiny_gen": "generate_until"}
    again = tmp_path / "again"
    again.mkdir()
    write_tasks(again, 5, seed=3)  # the same seed, the same data
    assert (again / "data.jsonl").read_text() == (tmp_path / "data.jsonl").read_text()


def test_answers_the_oracle_gave_pass_and_each_wrong_one_is_caught(oracle, tmp_path):
    write_tasks(tmp_path, 2, seed=0)
    docs = [json.loads(line) for line in (tmp_path / "data.jsonl").read_text().splitlines()]
    samples, chats = _samples(oracle, docs)
    found = check(oracle, samples, chats)
    assert found["loglikelihoods"] == 2 + 2 * 3
    assert found["max_abs_loglikelihood_diff"] < 1e-4 and found["max_abs_rolling_diff"] < 1e-4
    assert found["greedy_flag_mismatches"] == 0
    assert not found["generation_mismatches"] and not found["chat_generation_mismatches"]

    ll = samples["tiny_mc"][1]["resps"][2][0]
    ll[0] = str(float(ll[0]) + 0.01)
    flag = samples["tiny_ll"][0]["resps"][0][0]
    flag[1] = "False" if flag[1] == "True" else "True"
    roll = samples["tiny_roll"][1]["resps"][0]
    roll[0] = str(float(roll[0]) - 1.0)
    samples["tiny_gen"][1]["resps"][0][0] += "x"
    chats[0]["resps"][0][0] = "something else"
    found = check(oracle, samples, chats)
    assert 0.009 < found["max_abs_loglikelihood_diff"] < 0.011
    assert found["greedy_flag_mismatches"] == 1
    assert 0.99 < found["max_abs_rolling_diff"] < 1.01
    assert found["generation_mismatches"] == [docs[1]["context"]]
    assert found["chat_generation_mismatches"] == [docs[0]["context"]]
