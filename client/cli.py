"""`python -m client`: generate, chat and health against the served ensemble.

    python -m client generate "What is machine learning?"        # gRPC streaming
    python -m client generate --http "What is machine learning?" # HTTP generate_stream
    python -m client generate --json-schema @schema.json "A user:"  # guided: JSON of a schema
    python -m client generate --beam-width 4 -n 2 "Once upon"      # beam search: the best 2
    python -m client generate "First prompt" "Second prompt"      # one batched request
    python -m client chat --max-tokens 64                        # multi-turn, one session
    python -m client health
    python -m client stats                                       # the prefix cache's metrics
    python -m client reset-cache [--cache-salt S]                # forget the cached prefixes

Generated text goes to stdout as it arrives; TTFT and token counts go to stderr.
"""

from __future__ import annotations

import argparse
import math
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from client.generate import (
    MODEL,
    Chunk,
    GenerateError,
    GenerateParams,
    generate_http,
    reset_prefix_cache,
    stream_grpc,
    stream_grpc_batch,
    stream_http,
)

DEFAULT_GRPC_URL = "127.0.0.1:8001"
DEFAULT_HTTP_URL = "http://127.0.0.1:8000"
DEFAULT_METRICS_URL = "http://127.0.0.1:8002"
MODELS = ("ensemble", "preprocessing", "hybrid_llm", "postprocessing")
# ChatML with the model's special tokens (see the tokenizer's chat_template).
TURN = "<|im_start|>{role}\n{content}<|im_end|>\n"
END_OF_TURN = "<|im_end|>"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="one completion, printed as it streams")
    gen.add_argument("prompts", nargs="+", metavar="prompt",
                     help="the prompt; several are one batched request (each prompt's text "
                          "printed under --- prompt b --- once all finished)")
    gen.add_argument("-n", "--num-sequences", type=int,
                     help="sequences from the prompt (num_return_sequences; default 1, with "
                          "--beam-width W: the best N of the W beams, default all W); printed "
                          "one after another once all finished")
    gen.add_argument("--beam-width", type=int, metavar="W",
                     help="beam search with W beams, printed best first once the search "
                          "ends (deterministic: --temperature and --seed do not apply; --top-k, "
                          "--top-p, --min-p and guides are refused)")
    gen.add_argument("--length-penalty", type=float, metavar="X",
                     help="beam search: rank finished beams by summed log probability / "
                          "length ** X (default 1.0)")
    gen.add_argument("--early-stopping", action="store_true",
                     help="beam search: stop once W beams finished (default: once no running "
                          "beam can beat them)")
    guide = gen.add_mutually_exclusive_group()
    guide.add_argument("--json", action="store_true", help="guided: the output is JSON")
    guide.add_argument("--json-schema", metavar="SCHEMA",
                       help="guided: JSON following this schema (its text, or @FILE)")
    guide.add_argument("--regex", help="guided: the output matches this regular expression")
    guide.add_argument("--grammar", metavar="EBNF",
                       help="guided: the output follows this EBNF grammar with rule root "
                            "(its text, or @FILE)")
    guide.add_argument("--structural-tag", metavar="TAG",
                       help="guided: free text with tagged JSON sections after triggers "
                            "(the tag's JSON, or @FILE)")
    chat = commands.add_parser("chat", help="multi-turn chat; the history is re-sent each turn")
    chat.add_argument("--system", default="You are a helpful assistant.")
    health = commands.add_parser("health", help="server and model readiness")
    stats = commands.add_parser(
        "stats", help="the prefix cache: hits by tier, pages, memory, prefetches, requests")
    stats.add_argument("--metrics-url", default=DEFAULT_METRICS_URL,
                       help="the server's metrics address: a port (this host's), host:port, "
                            f"a URL or the /metrics page (default {DEFAULT_METRICS_URL})")
    reset = commands.add_parser(
        "reset-cache", help="forget the cached prefixes on every tier (device, DRAM, SSD); "
                            "pages running requests hold stay")
    reset.add_argument("--cache-salt", help="only this cache_salt namespace's prefixes")
    reset.add_argument("--url", default=DEFAULT_GRPC_URL,
                       help=f"the server's gRPC address (default {DEFAULT_GRPC_URL})")
    events = commands.add_parser(
        "kv-events", help="the server's KV cache events (kv_events_endpoint), one JSON line a "
                          "message: what a KV-aware router reads")
    events.add_argument("--endpoint", default="tcp://127.0.0.1:5557",
                        help="the server's kv_events_endpoint (default tcp://127.0.0.1:5557)")
    events.add_argument("--replay", metavar="ENDPOINT",
                        help="its kv_events_replay_endpoint: first print the kept messages "
                             "from --from on")
    events.add_argument("--from", dest="start", type=int, default=0, metavar="SEQ",
                        help="the first message wanted (default 0); one that came later has "
                             "\"gap\": true (without --replay, the first live one)")
    events.add_argument("--count", type=_positive_int, help="stop after this many messages")
    events.add_argument("--idle-s", type=_seconds,
                        help="stop when no message came for this many seconds")
    for sub in (gen, chat, health):
        sub.add_argument(
            "--url",
            help=f"server address (default {DEFAULT_GRPC_URL}, or {DEFAULT_HTTP_URL} with --http)",
        )
        sub.add_argument("--http", action="store_true", help="use HTTP instead of gRPC")
    for sub in (gen, chat):
        sub.add_argument("--model", default=MODEL,
                         help=f"the Triton model (default {MODEL}; hybrid_llm_bls: the same "
                              "contract in one model, whose streams survive a server stop)")
        sub.add_argument("--max-tokens", type=int, default=64)
        sub.add_argument("--temperature", type=float)
        sub.add_argument("--top-k", type=int)
        sub.add_argument("--top-p", type=float)
        sub.add_argument("--min-p", type=float, help="drop tokens below this fraction of the "
                         "likeliest token's probability (0: off)")
        sub.add_argument("--seed", type=int)
        sub.add_argument("--repetition-penalty", type=float)
        sub.add_argument("--presence-penalty", type=float)
        sub.add_argument("--frequency-penalty", type=float)
        sub.add_argument("--no-repeat-ngram-size", type=int, metavar="N",
                         help="never generate an N-gram the text already holds (0: off)")
        sub.add_argument("--allowed-token-ids", type=id_list, metavar="ID,ID,...",
                         help="generate only these token ids (vLLM's allowed_token_ids)")
        sub.add_argument("--log-probs", action="store_true",
                         help="report the generated tokens' summed log probability (each "
                              "sequence's or beam's with -n or --beam-width)")
        sub.add_argument("--perf-metrics", action="store_true",
                         help="report the server's per-request metrics (queue time, TTFT, "
                              "KV blocks reused / allocated, drafts accepted)")
        sub.add_argument("--cache-salt")
        sub.add_argument("--lora", metavar="NAME",
                         help="run on this LoRA adapter of the server's lora_adapters")
        sub.add_argument("--priority", type=int,
                         help="scheduling priority: lower runs first, ahead of (and if need "
                              "be in place of) requests with a higher one (default 0)")
        sub.add_argument("--timeout-ms", type=int, metavar="MS",
                         help="the request may take MS milliseconds from its arrival, then "
                              "ends with finish_reason timed_out (allotted_time_ms)")
        sub.add_argument("--retain", metavar="PRIORITY[:MS]", type=retention_arg,
                         help="keep the pages of this prompt and its output cached at this "
                              "priority (0-100; default 35), for MS milliseconds (default: "
                              "until evicted)")
        sub.add_argument("--no-stream", action="store_true", help="one response at the end")
    args = parser.parse_args(argv)
    if args.command in ("stats", "kv-events", "reset-cache"):
        return args
    args.url = args.url or (DEFAULT_HTTP_URL if args.http else DEFAULT_GRPC_URL)
    if args.http and not args.url.startswith(("http://", "https://")):
        args.url = f"http://{args.url}"
    return args


def sampling_options(args: argparse.Namespace) -> dict:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "seed": args.seed,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "no_repeat_ngram_size": args.no_repeat_ngram_size,
        "allowed_token_ids": args.allowed_token_ids or (),
        "return_log_probs": args.log_probs or None,
        "return_perf_metrics": args.perf_metrics or None,
        "cache_salt": args.cache_salt,
        "lora_name": args.lora,
        "priority": args.priority,
        "allotted_time_ms": args.timeout_ms,
        **retention_options(args.retain),
    }


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}")
    return number


def _seconds(value: str) -> float:
    """A time in seconds: a finite number > 0 (NaN waited for ever, -1 read as 0)."""
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {value!r}")
    return number


def id_list(value: str) -> tuple[int, ...]:
    """--allowed-token-ids 97,98,99 -> (97, 98, 99)."""
    try:
        ids = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids separated by commas, got "
                                         f"{value!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"token ids are integers >= 0, got {value!r}")
    return ids


def retention_arg(value: str) -> tuple[int, int]:
    """--retain PRIORITY[:MS] -> (priority, duration_ms; -1: never expires)."""
    try:
        priority, _, ms = value.partition(":")
        parsed = int(priority), int(ms) if ms else -1
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PRIORITY[:MS] (integers), got {value!r}") \
            from None
    if not 0 <= parsed[0] <= 100 or parsed[1] < -1:
        raise argparse.ArgumentTypeError(f"priority must be in [0, 100] and MS >= 0, got "
                                         f"{value!r}")
    return parsed


def retention_options(retain: tuple[int, int] | None) -> dict:
    """The whole prompt's token range and the output's pages at one priority."""
    if retain is None:
        return {}
    priority, ms = retain
    return {"retention_ranges": ((0, -1, priority, ms),), "retention_decode_priority": priority,
            "retention_decode_duration_ms": ms}


def guide_options(args: argparse.Namespace) -> dict:
    """guide_type / guide for the generate command's --json / --json-schema / --regex /
    --grammar / --structural-tag (text, or @FILE for a schema, grammar or tag)."""
    def text(value: str) -> str:
        return Path(value[1:]).read_text() if value.startswith("@") else value

    if args.json:
        return {"guide_type": "json"}
    if args.json_schema is not None:
        return {"guide_type": "json_schema", "guide": text(args.json_schema)}
    if args.regex is not None:
        return {"guide_type": "regex", "guide": args.regex}
    if args.grammar is not None:
        return {"guide_type": "ebnf_grammar", "guide": text(args.grammar)}
    if args.structural_tag is not None:
        return {"guide_type": "structural_tag", "guide": text(args.structural_tag)}
    return {}


def responses(args: argparse.Namespace, params: GenerateParams) -> Iterator[Chunk]:
    if args.http:
        return (
            iter([generate_http(args.url, params, args.model)])
            if args.no_stream
            else stream_http(args.url, params, args.model)
        )
    return stream_grpc(args.url, params, stream=not args.no_stream, model=args.model)


def print_stream(chunks: Iterator[Chunk], out: TextIO, err: TextIO) -> tuple[str, dict]:
    """Writes text as it arrives; reports TTFT and counts on `err`. Returns (text, counts)."""
    text, counts, ttft, num_output, log_probs, perf = "", {}, None, 0, [], {}
    for chunk in chunks:
        if ttft is None:
            ttft = chunk.elapsed_s
        out.write(chunk.text)
        out.flush()
        text += chunk.text
        counts = chunk.counts or counts
        num_output += chunk.counts.get("num_output_tokens", 0)
        log_probs += chunk.log_probs
        perf = chunk.perf or perf
    out.write("\n")
    if ttft is not None:
        summary = _counts_summary([counts])
        if log_probs:
            summary += f" log_prob={sum(log_probs):.3f}"
        err.write(f"[ttft {ttft * 1000:.1f} ms, output tokens {num_output}, {summary}]\n")
    write_perf([perf], err)
    return text, counts


def _counts_summary(rows: list[dict]) -> str:
    """`key=value` of the prompt's counts but the output tokens (cached_tokens, ...); with
    several prompts (a batch) each key's values by prompt, comma-separated."""
    keys = [k for k in dict.fromkeys(k for row in rows for k in row) if k != "num_output_tokens"]
    return " ".join(f"{k}=" + ",".join(str(row.get(k, "-")) for row in rows) for k in keys)


def write_perf(perfs: list[dict], err: TextIO) -> None:
    """The server's perf metrics (return_perf_metrics) on `err`, over the sequences whose
    latest metrics are `perfs` (nothing when the server sent none: not asked)."""
    perfs = [p for p in perfs if p.get("arrival_time_ns")]
    if not perfs:
        return
    def total(name: str) -> int:
        return sum(int(p.get(name, 0)) for p in perfs)

    def ms(end: str, start: str = "arrival_time_ns") -> str:
        ends = [int(p[end]) for p in perfs if p.get(end)]
        begin = min(int(p[start]) for p in perfs)
        if not ends:
            return "-"
        last = max(ends) if end == "last_token_time_ns" else min(ends)
        return f"{(last - begin) / 1e6:.1f} ms"

    drafts = total("total_draft_tokens")
    line = (f"[server: queue {ms('first_scheduled_time_ns')}, ttft {ms('first_token_time_ns')}, "
            f"last token {ms('last_token_time_ns')}; kv blocks reused "
            f"{total('kv_cache_reused_blocks')}, allocated {total('kv_cache_alloc_new_blocks')}"
            f" new / {total('kv_cache_alloc_total_blocks')} total")
    if drafts:
        line += f"; drafts accepted {total('total_accepted_draft_tokens')}/{drafts}"
    err.write(line + "]\n")


def print_sequences(chunks: Iterator[Chunk], num: int, out: TextIO, err: TextIO,
                    label: str = "sequence", log_probs: bool = False) -> list[str]:
    """Collects the `num` sequences (a streamed response adds to the sequence it names; one
    that carries every row, sequence_index -1, holds them whole: the non-streamed response,
    and each of a beam search's responses, whose rows are its beams so far), then writes them
    one after another, each under `--- <label> k ---`; TTFT and the output token count go to
    `err`, and with `log_probs` each row's summed log probability."""
    texts, ttft, num_output, cum, perf, counts = [""] * num, None, 0, [], {}, {}
    for chunk in chunks:
        ttft = chunk.elapsed_s if ttft is None else ttft
        counts = chunk.counts or counts  # the prompt's: the same for every sequence
        whole = chunk.sequence_index == -1
        num_output = (0 if whole else num_output) + chunk.counts.get("num_output_tokens", 0)
        for k, text in enumerate(chunk.texts):
            texts[k] = text if whole else texts[k] + text
        cum = chunk.cum_log_probs or cum  # running sums: the last response's are the totals
        if chunk.perf:  # per sequence when streamed; -1: a response carrying every row
            perf[chunk.sequence_index] = chunk.perf
    for k, text in enumerate(texts):
        out.write(f"--- {label} {k} ---\n{text}\n")
    if ttft is not None:
        summary = f"ttft {ttft * 1000:.1f} ms, output tokens {num_output}"
        if counts:
            summary += ", " + _counts_summary([counts])
        if log_probs and cum:
            summary += ", log_probs " + " ".join(f"{v:.3f}" for v in cum)
        err.write(f"[{summary}]\n")
    write_perf([perf[-1]] if -1 in perf else list(perf.values()), err)
    return texts


def print_batch(chunks: Iterator[Chunk], num: int, out: TextIO, err: TextIO) -> list[str]:
    """Collects each prompt's text of a batched request (by `batch_index`), then writes them
    one after another under `--- prompt b ---`; TTFT (the first response's), the output
    tokens of all and each prompt's counts (cached_tokens, ...) go to `err`."""
    texts, ttft, num_output = [""] * num, None, 0
    counts: list[dict] = [{} for _ in range(num)]
    for chunk in chunks:
        ttft = chunk.elapsed_s if ttft is None else ttft
        texts[chunk.batch_index] += chunk.text
        num_output += chunk.counts.get("num_output_tokens", 0)
        counts[chunk.batch_index] = chunk.counts or counts[chunk.batch_index]
    for b, text in enumerate(texts):
        out.write(f"--- prompt {b} ---\n{text}\n")
    if ttft is not None:
        summary = _counts_summary(counts)
        err.write(f"[ttft {ttft * 1000:.1f} ms, output tokens {num_output}"
                  + (f", {summary}" if summary else "") + "]\n")
    return texts


def beam_options(args: argparse.Namespace) -> dict:
    return {
        "beam_width": args.beam_width,
        "length_penalty": args.length_penalty,
        "early_stopping": args.early_stopping or None,
    }


def cmd_generate(args: argparse.Namespace) -> int:
    beams = (args.beam_width or 1) > 1
    if len(args.prompts) > 1:
        if beams or (args.num_sequences or 1) > 1:
            raise ValueError("several prompts take one sequence each (no -n, no "
                             "--beam-width)")
        if args.http and args.no_stream:
            raise ValueError("several prompts over HTTP stream (Triton's /generate takes one "
                             "response); leave out --no-stream or use gRPC")
        batch = [GenerateParams(p, **sampling_options(args), **guide_options(args))
                 for p in args.prompts]
        chunks = (stream_http(args.url, batch, args.model) if args.http else
                  stream_grpc_batch(args.url, batch, stream=not args.no_stream,
                                    model=args.model))
        print_batch(chunks, len(batch), sys.stdout, sys.stderr)
        return 0
    if beams or (args.num_sequences or 1) > 1:
        # Beam search without -n returns every beam (the server's default).
        num = args.num_sequences or (args.beam_width if beams else 1)
        params = GenerateParams(args.prompts[0], num_return_sequences=args.num_sequences,
                                **sampling_options(args), **beam_options(args),
                                **guide_options(args))
        print_sequences(responses(args, params), num, sys.stdout, sys.stderr,
                        label="beam" if beams else "sequence", log_probs=args.log_probs)
        return 0
    params = GenerateParams(args.prompts[0], num_return_sequences=args.num_sequences,
                            **sampling_options(args), **beam_options(args),
                            **guide_options(args))
    print_stream(responses(args, params), sys.stdout, sys.stderr)
    return 0


def chat_prompt(history: list[tuple[str, str]]) -> str:
    return "".join(TURN.format(role=r, content=c) for r, c in history) + "<|im_start|>assistant\n"


def cmd_chat(args: argparse.Namespace) -> int:
    session_id = uuid.uuid4().hex
    history: list[tuple[str, str]] = [("system", args.system)]
    interactive = sys.stdin.isatty()
    sys.stderr.write(f"[session {session_id}; an empty line or Ctrl-D ends the chat]\n")
    while True:
        if interactive:
            sys.stderr.write("you> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line.strip():
            return 0
        history.append(("user", line.strip()))
        params = GenerateParams(
            chat_prompt(history),
            stop_words=(END_OF_TURN,),
            session_id=session_id,
            **sampling_options(args),
        )
        sys.stdout.write("assistant> ")
        reply, _ = print_stream(responses(args, params), sys.stdout, sys.stderr)
        history.append(("assistant", reply))


def cmd_health(args: argparse.Namespace) -> int:
    if args.http:
        import tritonclient.http as tc

        client = tc.InferenceServerClient(args.url.split("://", 1)[1])
    else:
        import tritonclient.grpc as tc

        client = tc.InferenceServerClient(args.url)
    live, ready = client.is_server_live(), client.is_server_ready()
    print(f"server live={live} ready={ready}")
    models_ready = True
    for model in repository_models(client, args.http):
        model_ready = client.is_model_ready(model)
        models_ready &= model_ready
        print(f"  {model}: {'ready' if model_ready else 'NOT READY'}")
    return 0 if live and ready and models_ready else 1


def repository_models(client, http: bool) -> list[str]:
    """The pipeline's models, then any other model the server's repository holds (e.g.
    hybrid_llm_bls), each once."""
    index = client.get_model_repository_index()
    names = [m["name"] for m in index] if http else [m.name for m in index.models]
    return list(dict.fromkeys([*MODELS, *sorted(names)]))


def cmd_stats(args: argparse.Namespace) -> int:
    from client.metrics import cache_report, scrape

    url = metrics_base_url(args.metrics_url)
    print("\n".join(cache_report(scrape(url))))
    return 0


def metrics_base_url(given: str) -> str:
    """--metrics-url as given (a port, host:port, a URL, or the /metrics page's own address)
    -> the http://host:port that `scrape` reads."""
    url = given.strip()
    if url.isdigit():  # a bare port: this host's
        url = f"127.0.0.1:{url}"
    url = url if "://" in url else f"http://{url}"
    return url.rstrip("/").removesuffix("/metrics")


def cmd_reset_cache(args: argparse.Namespace) -> int:
    counts = reset_prefix_cache(args.url, args.cache_salt)
    where = "every namespace" if args.cache_salt is None else f"cache_salt {args.cache_salt!r}"
    print(f"prefix cache reset ({where}): {counts['dropped_pages']} pages dropped, "
          f"{counts['kept_pages']} held by running requests kept")
    return 0


def cmd_kv_events(args: argparse.Namespace) -> int:
    import json

    from client.kv_events import KvEventSubscriber

    sub = KvEventSubscriber(args.endpoint, args.replay)
    try:
        for n, message in enumerate(sub.follow(args.start, args.idle_s), 1):
            print(json.dumps(message._asdict()), flush=True)
            if args.count is not None and n >= args.count:
                break
    finally:
        sub.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = {"generate": cmd_generate, "chat": cmd_chat, "health": cmd_health,
               "stats": cmd_stats, "kv-events": cmd_kv_events,
               "reset-cache": cmd_reset_cache}[args.command]
    try:
        return command(args)
    except GenerateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # connection refused and the like: one line, not a traceback
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
