"""`python -m client` against the real server: generate (gRPC and HTTP), chat, health, stats."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.triton.server import ServerHandle
from client.generate import GenerateParams, generate_http

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Write one line about the sea"
GREEDY = ["--max-tokens", "10", "--top-k", "1", "--cache-salt", "cli"]


def run_client(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "client", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_generate_grpc_and_http_print_the_same_text(llm_server: ServerHandle):
    expected = generate_http(
        llm_server.urls.http, GenerateParams(PROMPT, max_tokens=10, top_k=1, cache_salt="cli")
    ).text
    grpc = run_client("generate", PROMPT, "--url", llm_server.urls.grpc, *GREEDY)
    http = run_client("generate", PROMPT, "--http", "--url", llm_server.urls.http, *GREEDY)
    for result in (grpc, http):
        assert result.returncode == 0, result.stderr
        assert result.stdout == expected + "\n"
        assert re.search(
            r"\[ttft \d+\.\d ms, output tokens \d+, num_input_tokens=28", result.stderr
        )


def test_generate_with_penalties_reports_the_log_probability(llm_server: ServerHandle):
    params = GenerateParams(PROMPT, max_tokens=10, top_k=1, cache_salt="cli",
                            repetition_penalty=1.6, frequency_penalty=0.5, return_log_probs=True)
    expected = generate_http(llm_server.urls.http, params)
    result = run_client("generate", PROMPT, "--url", llm_server.urls.grpc, *GREEDY,
                        "--repetition-penalty", "1.6", "--frequency-penalty", "0.5",
                        "--log-probs")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.text + "\n"
    printed = float(re.search(r"log_prob=(-?\d+\.\d+)", result.stderr).group(1))
    assert printed == pytest.approx(sum(expected.log_probs), abs=1e-3) and printed < 0


def test_generate_guided_by_a_schema_file_and_a_regex(llm_server: ServerHandle, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"n": {"type": "integer", '
                      '"minimum": 0, "maximum": 99}}, "required": ["n"]}')
    result = run_client("generate", PROMPT, "--url", llm_server.urls.grpc, *GREEDY,
                        "--max-tokens", "32", "--json-schema", f"@{schema}")
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r'\{"n": \d{1,2}\}\n', result.stdout), result.stdout
    result = run_client("generate", PROMPT, "--http", "--url", llm_server.urls.http, *GREEDY,
                        "--regex", "(sea|sky)-[0-9]")
    assert result.returncode == 0 and re.fullmatch(r"(sea|sky)-[0-9]\n", result.stdout), result
    result = run_client("generate", PROMPT, "--url", llm_server.urls.grpc, "--regex", "[0-")
    assert result.returncode != 0 and "not a valid regex" in result.stderr


def test_generate_several_sequences_prints_each(llm_server: ServerHandle):
    options = dict(max_tokens=10, temperature=0.9, seed=4, cache_salt="cli-n")
    expected = generate_http(llm_server.urls.http,
                             GenerateParams(PROMPT, num_return_sequences=3, **options)).texts
    args = ["--max-tokens", "10", "--temperature", "0.9", "--seed", "4", "--cache-salt", "cli-n"]
    for transport in (["--url", llm_server.urls.grpc], ["--http", "--url", llm_server.urls.http]):
        result = run_client("generate", PROMPT, "-n", "3", *transport, *args)
        assert result.returncode == 0, result.stderr
        assert result.stdout == "".join(f"--- sequence {k} ---\n{t}\n"
                                        for k, t in enumerate(expected))
        n = len(PROMPT.encode())  # the byte tokenizer
        assert re.search(rf"output tokens \d+, num_input_tokens={n} cached_tokens=\d+",
                         result.stderr), result.stderr
    assert len(set(expected)) == 3


def test_generate_beam_search_prints_each_beam(llm_server: ServerHandle):
    options = dict(max_tokens=10, beam_width=3, cache_salt="cli-beam")
    expected = generate_http(llm_server.urls.http, GenerateParams(PROMPT, **options)).texts
    args = ["--max-tokens", "10", "--beam-width", "3", "--cache-salt", "cli-beam"]
    for transport in (["--url", llm_server.urls.grpc], ["--http", "--url", llm_server.urls.http]):
        result = run_client("generate", PROMPT, *transport, *args)
        assert result.returncode == 0, result.stderr
        assert result.stdout == "".join(f"--- beam {k} ---\n{t}\n" for k, t in enumerate(expected))
    assert len(expected) == 3 and len(set(expected)) == 3
    # -n 2: the best two beams; --log-probs: each one's summed log probability.
    best = generate_http(llm_server.urls.http, GenerateParams(
        PROMPT, num_return_sequences=2, return_log_probs=True, **options))
    result = run_client("generate", PROMPT, "--url", llm_server.urls.grpc, *args, "-n", "2",
                        "--length-penalty", "1.0", "--early-stopping", "--log-probs")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "".join(f"--- beam {k} ---\n{t}\n" for k, t in enumerate(expected[:2]))
    printed = [float(v) for v in re.search(r"log_probs (\S+) (\S+)\]", result.stderr).groups()]
    assert printed == pytest.approx(best.cum_log_probs, abs=1e-3) and printed[0] > printed[1]


def test_generate_beam_options_become_ensemble_inputs():
    from client.cli import beam_options, parse_args

    args = parse_args(["generate", "hi", "--beam-width", "4", "-n", "2", "--length-penalty",
                       "0.5", "--early-stopping"])
    fields = GenerateParams("hi", num_return_sequences=args.num_sequences,
                            **beam_options(args)).fields(stream=True)
    assert {k: fields[k] for k in ("beam_width", "num_return_sequences", "length_penalty",
                                   "early_stopping")} == {
        "beam_width": 4, "num_return_sequences": 2, "length_penalty": 0.5, "early_stopping": True}
    plain = GenerateParams("hi", **beam_options(parse_args(["generate", "hi"]))).fields(True)
    assert not {"beam_width", "length_penalty", "early_stopping"} & set(plain)


@pytest.mark.parametrize("idle", ["nan", "-1", "0", "x"])
def test_kv_events_idle_time_must_be_seconds(idle, capsys):
    """--idle-s nan followed the events for ever; -1 read as 0."""
    from client.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["kv-events", "--idle-s", idle])
    assert f"expected a number of seconds > 0, got '{idle}'" in capsys.readouterr().err
    assert parse_args(["kv-events", "--idle-s", "0.5"]).idle_s == 0.5


def test_chat_resends_history_and_hits_the_cache(llm_server: ServerHandle):
    turns = "Hello, who are you?\nTell me more about it please.\n\n"
    result = run_client("chat", "--url", llm_server.urls.grpc, *GREEDY, stdin=turns)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("assistant> ") == 2
    cached = [int(n) for n in re.findall(r"cached_tokens=(\d+)", result.stderr)]
    assert len(cached) == 2 and cached[1] > 0  # the second turn re-sends the first


def test_health(llm_server: ServerHandle):
    result = run_client("health", "--url", llm_server.urls.grpc)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "server live=True ready=True" in result.stdout
    assert "hybrid_llm: ready" in result.stdout


def test_unreachable_server_is_one_line_error():
    result = run_client("generate", "hi", "--http", "--url", "http://127.0.0.1:9")
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr


def _stats(server: ServerHandle, page: bool = False) -> tuple[dict, str]:
    """page: name the metrics page itself (http://host:port/metrics), not the port."""
    time.sleep(0.5)  # the metrics thread refreshes every 100 ms
    url = server.urls.metrics + ("/metrics" if page else "")
    result = run_client("stats", "--metrics-url", url)
    assert result.returncode == 0, result.stderr
    m = re.search(r"prompt tokens: (\d+) looked up, (\d+) from the cache", result.stdout)
    assert m, result.stdout
    return {"queried": int(m[1]), "hit": int(m[2])}, result.stdout


def test_stats_reports_the_cache_as_requests_use_it(llm_server: ServerHandle):
    before, _ = _stats(llm_server)
    prompt = "Tell me about the stats of the cache. " * 12
    params = GenerateParams(prompt, max_tokens=2, top_k=1, cache_salt="cli-stats")
    first = generate_http(llm_server.urls.http, params)
    second = generate_http(llm_server.urls.http, params)
    after, text = _stats(llm_server, page=True)
    assert second.counts["cached_tokens"] > 0
    assert after["hit"] - before["hit"] == second.counts["cached_tokens"]
    asked = first.counts["num_input_tokens"] + second.counts["num_input_tokens"]
    assert after["queried"] - before["queried"] >= asked - 2  # the last token is never looked up
    assert re.search(r"memory in use: device KV \d+\.\d MiB", text), text
    assert re.search(r"pages: \d+ total, \d+ used, [1-9]\d* cached", text), text
    assert re.search(r"requests: \d+ finished, \d+ cancelled, \d+ timed out, \d+ failed",
                     text), text
    assert re.search(r"device evictions: \d+ pages, \d+ of them above the default retention "
                     r"priority", text), text


def test_metrics_url_forms():
    from client.cli import metrics_base_url

    for given in ("8002", "127.0.0.1:8002", "http://127.0.0.1:8002",
                  "http://127.0.0.1:8002/metrics", " http://127.0.0.1:8002/ "):
        assert metrics_base_url(given) == "http://127.0.0.1:8002", given
    assert metrics_base_url("https://gpu7:9000/metrics") == "https://gpu7:9000"


def test_stats_without_a_server_is_one_line_error():
    result = run_client("stats", "--metrics-url", "http://127.0.0.1:9")
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


def test_generate_several_prompts_sends_one_batch(llm_server: ServerHandle):
    prompts = [PROMPT, "Write one line about the hills"]
    expected = [generate_http(llm_server.urls.http, GenerateParams(
        p, max_tokens=10, top_k=1, cache_salt="cli")).text for p in prompts]
    assert expected[0] != expected[1]
    for transport in (["--url", llm_server.urls.grpc], ["--http", "--url", llm_server.urls.http],
                      ["--url", llm_server.urls.grpc, "--no-stream"]):
        result = run_client("generate", *prompts, *transport, *GREEDY)
        assert result.returncode == 0, result.stderr
        assert result.stdout == "".join(f"--- prompt {b} ---\n{t}\n"
                                        for b, t in enumerate(expected))
        sizes = ",".join(str(len(p.encode())) for p in prompts)  # the byte tokenizer
        assert re.search(rf"\[ttft \d+\.\d ms, output tokens \d+, num_input_tokens={sizes} "
                         r"cached_tokens=\d+,\d+", result.stderr), result.stderr
    refused = run_client("generate", *prompts, "-n", "2", "--url", llm_server.urls.grpc)
    assert refused.returncode == 1 and "one sequence each" in refused.stderr


def test_generate_allowed_token_ids(llm_server: ServerHandle):
    digits = run_client("generate", PROMPT, "--url", llm_server.urls.grpc, "--max-tokens", "8",
                        "--seed", "3", "--temperature", "1.5",
                        "--allowed-token-ids", ",".join(str(ord(c)) for c in "0123"))
    assert digits.returncode == 0, digits.stderr
    assert digits.stdout.strip() and set(digits.stdout.strip()) <= set("0123"), digits.stdout
    bad = run_client("generate", PROMPT, "--allowed-token-ids", "1,x")
    assert bad.returncode == 2 and "token ids separated by commas" in bad.stderr
