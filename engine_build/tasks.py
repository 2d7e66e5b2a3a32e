"""Synthetic long-context tasks (bytes in, bytes out), generated deterministically from a seed.

Each task makes a `TaskExample`: a prompt of about `context_len` bytes whose answer depends on
something far back in it, and the answer bytes. Three kinds:
- `kv`: key-value retrieval over many `abc=NNNN` lines (three-letter keys, four-digit values);
  the question restates the key (`Lookup abc=`) and the answer is its value;
- `needle`: one `The secret code is NNNN.` line hidden in filler prose; the prompt ends by
  starting that sentence again;
- `vars`: Python-style variable assignment chains mixed with distractor assignments (two hops).
The answers are all digits, so accuracy is an exact match of the greedy answer bytes.

`extra_queries` (training only) appends further questions about the same context, each with
its answer, so one long context carries several supervised retrievals.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TASKS = ("kv", "needle", "vars")
# Training-only warm-ups: `copy` (repeat a string) and `recall` (associative recall over short
# letter keys), which teach the attention layers content-based lookup before `kv` needs it.
TRAIN_ONLY = ("copy", "recall")
_WORDS = (
    "the of and to in is was for on that with as by it at from this be are or an which "
    "river stone market window garden morning silver letter engine valley harbor paper "
    "quiet green early small bright open distant ancient simple heavy narrow"
).split()


@dataclass(frozen=True)
class TaskExample:
    kind: str
    prompt: str
    answer: str
    # (question, answer) pairs asked after the first answer; empty for evaluation.
    more: tuple[tuple[str, str], ...] = ()

    @property
    def text(self) -> str:
        return self.prompt + self.answer + "\n" + "".join(q + a + "\n" for q, a in self.more)

    def answer_spans(self) -> list[tuple[int, int]]:
        """Byte ranges [start, end) of every answer inside `text`."""
        spans, pos = [], len(self.prompt.encode())
        spans.append((pos, pos + len(self.answer.encode())))
        pos = spans[-1][1] + 1
        for q, a in self.more:
            pos += len(q.encode())
            spans.append((pos, pos + len(a.encode())))
            pos = spans[-1][1] + 1
        return spans


def make_example(kind: str, context_len: int, rng: random.Random,
                 extra_queries: int = 0) -> TaskExample:
    if kind == "kv":
        return _kv(context_len, rng, extra_queries)
    if kind == "needle":
        return _needle(context_len, rng)
    if kind == "vars":
        return _vars(context_len, rng)
    if kind == "copy":
        return _copy(context_len, rng)
    if kind == "recall":
        return _recall(context_len, rng, extra_queries)
    raise ValueError(f"unknown task {kind!r}; expected one of {TASKS}")


def _kv(context_len: int, rng: random.Random, extra_queries: int = 0) -> TaskExample:
    """`abc=4821` lines under a header, then `Lookup abc=` -> `4821`.

    Keys are three lowercase letters (distinct within a context), values four digits."""
    head = "Key-value store. Remember every value.\n"
    pairs: dict[str, str] = {}
    size = len(head)
    while size < context_len - 24 or not pairs:
        key = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(3))
        if key in pairs:
            continue
        pairs[key] = f"{rng.randrange(10**4):04d}"
        size += len(f"{key}={pairs[key]}\n")
    keys = list(pairs)
    asked = [rng.choice(keys) for _ in range(1 + extra_queries)]
    body = "".join(f"{k}={pairs[k]}\n" for k in keys)
    more = tuple((f"Lookup {k}=", pairs[k]) for k in asked[1:])
    return TaskExample("kv", f"{head}{body}Lookup {asked[0]}=", pairs[asked[0]], more)


def _copy(context_len: int, rng: random.Random) -> TaskExample:
    """A random string of digits and letters, then the same string again."""
    n = rng.randint(8, max(8, min(context_len // 2 - 8, 120)))
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyz"
    s = "".join(rng.choice(alphabet) for _ in range(n))
    return TaskExample("copy", f"Copy: {s}\nAgain: ", s)


def _recall(context_len: int, rng: random.Random, extra_queries: int = 0) -> TaskExample:
    """`ab=3;xq=9;...|xq=` -> `9`: keys of 1-3 letters, one-digit values."""
    key_len = rng.randint(1, 3)
    num = max(2, min(context_len // (key_len + 3), 26 ** key_len // 2, 200))
    keys: list[str] = []
    seen: set[str] = set()
    while len(keys) < num:
        key = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(key_len))
        if key not in seen:
            seen.add(key)
            keys.append(key)
    values = {k: str(rng.randrange(10)) for k in keys}
    asked = [rng.choice(keys) for _ in range(1 + extra_queries)]
    body = "".join(f"{k}={values[k]};" for k in keys)
    more = tuple((f"|{k}=", values[k]) for k in asked[1:])
    return TaskExample("recall", f"{body}|{asked[0]}=", values[asked[0]], more)


def _filler_sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 12))]
    return " ".join(words).capitalize() + ". "


def _needle(context_len: int, rng: random.Random) -> TaskExample:
    code = f"{rng.randrange(10**4):04d}"
    needle = f"The secret code is {code}. "
    sentences = []
    size = len(needle)
    while size < context_len - 50:
        s = _filler_sentence(rng)
        sentences.append(s)
        size += len(s)
    sentences.insert(rng.randint(0, len(sentences)), needle)
    return TaskExample("needle", "".join(sentences) + "\nRecall: The secret code is ", code)


def _vars(context_len: int, rng: random.Random) -> TaskExample:
    names = [f"v{i}" for i in rng.sample(range(1000), 200)]
    target_value = f"{rng.randrange(10**5):05d}"
    chain = names[:3]  # two hops: v_a = value; v_b = v_a; v_c = v_b
    lines = [f"{chain[0]} = {target_value}"] + [f"{b} = {a}" for a, b in zip(chain, chain[1:])]
    distractors = names[3:]
    body: list[str] = []
    size = 0
    while size < context_len - 80 or len(body) < len(lines):
        line = f"{rng.choice(distractors)} = {rng.randrange(10**5):05d}"
        body.append(line)
        size += len(line) + 1
    # Chain links keep their order but are spread through the whole context.
    slots = sorted(rng.sample(range(len(body) + 1), len(lines)))
    for offset, (slot, line) in enumerate(zip(slots, lines)):
        body.insert(slot + offset, line)
    code = "\n".join(body)
    return TaskExample("vars", f"# variable tracking\n{code}\nprint({chain[-1]})  # prints ",
                       target_value)
