"""Randomized workloads against the model itself: branching and multi-turn prompts arriving
while others run, cancellations, preemption under few pages, evictions to DRAM and SSD, on
every cache configuration whose states are exact (suffix replay in exact mode, the checkpoint
baseline in both placements). Whatever the cache did, the logits that chose a request's first
token must be those of a plain full forward over its prompt (a wrong page, anchor or state
shows there; the random test models' greedy tokens alone hardly depend on the context), every
later token the model's greedy choice after the tokens before it, and nothing may stay held
at the end. Every third request also carries penalties and a logit bias: its tokens must be
the greedy choice after those rules (`engine_helpers.reference_adjust`), which count every
prompt token whatever the cache served and make the random models' tokens depend on the
context. Every sixth request whose beams fit the pool is a beam search of width 2 (forked
beams, preempted and restarted searches): its beams must be those of a search that prefills
each beam from scratch (`engine_helpers.reference_beams`). The other requests return their
generation logits (each token's row of that full forward) and, every fourth on the eager
executor, their context logits (the forward's rows over the prompt, whatever the cache held
and however often the request was preempted). On the eager executor, and on the
AOT-compiled one of each family's build; the served path has its own
(tests/triton/test_random_served.py)."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field, replace

import pytest
import torch
from engine_helpers import assert_no_leak, make_engine, reference_adjust, reference_beams

from backend.cache.tier_config import TierConfig
from backend.engine import Engine, Request, SamplingParams
from backend.model import load_model
from backend.replay.budget import ReplayConfig

CHECKPOINT = (13, True)  # seed, slow decay (conftest.family_model): states carry far
REQUESTS = 36
BEAM_WIDTH = 2
PAGE_BUDGET = 32 * 16  # the pool's tokens (`_engine`): a search's beams must fit it
TOLERANCE = 1e-3  # logits: batched and cached against one plain forward (float32)
# What every third request (`penalized`) adds to greedy decoding.
PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                 logit_bias=((0, 1.5), (1, -1.5)))

CONFIGS = {
    "replay": dict(replay=ReplayConfig.exact()),
    "checkpoint": dict(policy="checkpoint", interval=32, num_checkpoint_slots=12),
    # Interval 64, the compiled step graph's snapshot alignment (SNAPSHOT_ALIGN): there
    # checkpoints inside a step are saved mid-step instead of cutting the step short.
    "checkpoint64": dict(policy="checkpoint", interval=64, num_checkpoint_slots=12),
    "sglang": dict(policy="checkpoint", checkpoint_placement="sglang",
                   checkpoint_prefill_chunk=64, interval=32, num_checkpoint_slots=12),
    "replay+tiers": dict(replay=ReplayConfig.exact(), tiers=True),
    "checkpoint+tiers": dict(policy="checkpoint", interval=32, num_checkpoint_slots=12,
                             tiers=True),
    # DRAM only, pages copied in whole before the forward (no layer-wise overlap).
    "replay+dram": dict(replay=ReplayConfig.exact(),
                        tiers=dict(ssd_path=None, host_pages=64, enable_overlap=False)),
    # Approximate states (budgeted replay of int8 anchors): tokens may differ from the
    # model's; outputs, finish reasons and the pages are still checked.
    "budgeted+tiers": dict(replay=ReplayConfig(anchor_density=0.25, budget_fraction=0.5,
                                               k_max=8, anchor_dtype="int8"), tiers=True),
    # Speculative decoding (n-gram drafts from a single matching token, so that the random
    # models' outputs get drafts, kept and rejected): every token is still the model's.
    "replay+spec": dict(replay=ReplayConfig.exact(), spec=True),
    "checkpoint+spec": dict(policy="checkpoint", interval=32, num_checkpoint_slots=12,
                            spec=True),
    "replay+tiers+spec": dict(replay=ReplayConfig.exact(), tiers=True, spec=True),
    # Two live-state slots on the device, the states that lose theirs spilled to DRAM /
    # SSD state slots and loaded back where a match ends on their page.
    "replay+state-tiers": dict(replay=ReplayConfig.exact(), num_checkpoint_slots=2,
                               tiers=dict(host_checkpoint_slots=2, ssd_checkpoint_slots=8)),
}
# Seeds moved for coverage: the default one's workload on some family never hits a page in
# the DRAM tier (`_check` asks it to), as checked for every family with the seed used (re-
# chosen for "replay+dram" when beam searches joined the workloads).
SEED_OFFSETS = {"replay+tiers+spec": 300, "replay+dram": 100}
SPECULATIVE = dict(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                   prompt_lookup_max=4, speculative_adaptive=False)
APPROXIMATE = {"budgeted+tiers"}  # the rest keep exact states


@pytest.fixture(scope="module")
def model(family_model):
    """Every family of `engine_helpers.FAMILIES`."""
    return family_model


def _engine(model, name: str, tmp_path, engine_dir=None) -> Engine:
    """The engine of configuration `name`; with `engine_dir`, the same on the AOT-compiled
    executor of that engine directory."""
    options = dict(CONFIGS[name])
    with_tiers = options.pop("tiers", False)
    spec = options.pop("spec", False)
    # 32 pages of 16 tokens: four running prompts of up to 360 tokens do not fit (preemption);
    # what finished requests leave is evicted soon after.
    engine = make_engine(model, num_kv_pages=32, max_tokens_per_step=128, max_num_seqs=4,
                         **options)
    if not with_tiers and engine_dir is None and not spec:
        return engine
    config = engine.config
    if spec:
        config = replace(config, **SPECULATIVE)
    if with_tiers:
        states = 8 if options.get("policy") == "checkpoint" else 0
        tiers = TierConfig(host_pages=8, ssd_path=str(tmp_path / "ssd"), ssd_bytes=1 << 30,
                           model_fingerprint="random-workloads", io_threads=2,
                           host_checkpoint_slots=states, ssd_checkpoint_slots=4 * states)
        if isinstance(with_tiers, dict):
            tiers = replace(tiers, **with_tiers)
        config = replace(config, tiers=tiers)
    if engine_dir is None:
        return Engine(model, config)
    return Engine(None, replace(config, executor="compiled"), engine_dir=engine_dir)


class Workload:
    """Requests drawn with one seed: new prompts, branches cut anywhere in an earlier prompt
    (or a finished conversation: its prompt and answer) with new tokens after the cut."""

    def __init__(self, seed: int, vocab: int):
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.history: list[list[int]] = []
        self.lock = threading.Lock()  # client threads draw, the engine thread adds answers

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def add(self, conversation: list[int]) -> None:
        with self.lock:
            self.history.append(conversation)

    def next_prompt(self) -> list[int]:
        with self.lock:
            return self._next_prompt()

    def _next_prompt(self) -> list[int]:
        if not self.history or self.rng.random() < 0.2:
            prompt = self._tokens(self.rng.randint(20, 200))
        else:
            base = self.rng.choice(self.history)
            cut = self.rng.randint(1, min(len(base), 300))
            prompt = base[:cut] + self._tokens(self.rng.randint(1, 60))
        self.history.append(prompt)
        return prompt


@dataclass
class Outcome:
    prompt: list[int]
    max_tokens: int
    penalized: bool = False
    beam_width: int = 1
    tokens: list[int] = field(default_factory=list)
    beams: list[list[int]] | None = None
    reason: str | None = None
    first_logits: torch.Tensor | None = None
    context: bool = False  # asks for its context logits
    context_logits: torch.Tensor | None = None
    generation_logits: list[torch.Tensor] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def request(self, rid: str, workload: Workload) -> Request:
        """The request, its outputs collected here (the finished conversation joins the
        workload's history)."""

        def collect(out):
            self.tokens.extend(out.new_token_ids)
            if out.first_logits is not None:
                self.first_logits = out.first_logits
            if out.generation_logits is not None:
                self.generation_logits.append(out.generation_logits)
            if out.context_logits is not None:
                assert self.context_logits is None, "context logits sent twice"
                self.context_logits = out.context_logits
            if out.finished:
                self.reason = out.finish_reason
                if out.beams is not None:
                    self.beams = [b.token_ids for b in out.beams]
                workload.add(self.prompt + self.tokens)
                self.done.set()

        plain = self.beam_width == 1
        return Request(rid, self.prompt, self.sampling, on_output=collect,
                       return_first_logits=True, return_generation_logits=plain,
                       return_context_logits=plain and self.context)

    @property
    def sampling(self) -> SamplingParams:
        penalties = PENALTIES if self.penalized else {}
        if self.beam_width > 1:  # no end id: every beam runs to max_tokens
            return SamplingParams(max_tokens=self.max_tokens, beam_width=self.beam_width,
                                  end_id=-1, **penalties)
        return SamplingParams(max_tokens=self.max_tokens, top_k=1, **penalties)


def beam_width(o: Outcome, i: int) -> int:
    """Request i's beam width: BEAM_WIDTH for every sixth one whose beams fit the pool."""
    pages = -(-(len(o.prompt) + o.max_tokens) // 16)
    return BEAM_WIDTH if i % 6 == 5 and BEAM_WIDTH * pages * 16 <= PAGE_BUDGET else 1


def asks_context(engine: Engine, i: int) -> bool:
    """Whether request i asks for its context logits: every fourth, on the eager executor
    (a compiled step returns one position's logits a row)."""
    return i % 4 == 3 and engine.config.executor != "compiled"


def _run(engine: Engine, workload: Workload, seed: int) -> dict[str, Outcome]:
    """Submits REQUESTS requests a few at a time between steps and cancels some."""
    rng = random.Random(seed)
    outcomes: dict[str, Outcome] = {}
    steps = 0
    while len(outcomes) < REQUESTS or engine.has_work:
        for _ in range(rng.choice((0, 0, 1, 1, 2)) if len(outcomes) < REQUESTS else 0):
            rid = f"r{len(outcomes)}"
            o = outcomes[rid] = Outcome(workload.next_prompt(), rng.randint(1, 40),
                                        penalized=len(outcomes) % 3 == 1)
            o.beam_width = beam_width(o, len(outcomes) - 1)
            o.context = asks_context(engine, len(outcomes) - 1)
            engine.submit(o.request(rid, workload))
        running = [rid for rid, o in outcomes.items() if o.reason is None]
        if running and rng.random() < 0.05:
            engine.cancel(rng.choice(running))
        engine.step()
        steps += 1
        assert steps < 5000, "the workload does not finish"
    return outcomes


def _assert_model(model, rid: str, o: Outcome) -> None:
    """The first token's logits are a plain full forward's over the prompt; each token is the
    argmax (within TOLERANCE) of that forward over the prompt and the tokens before it."""
    if not o.tokens:
        return
    ids = torch.tensor([o.prompt + o.tokens[:-1]])
    with torch.inference_mode():
        full = model.logits(ids)[0].float()
    rows = full[len(o.prompt) - 1:]
    torch.testing.assert_close(o.first_logits, rows[0], atol=TOLERANCE, rtol=TOLERANCE,
                               msg=lambda m: f"{rid} ({len(o.prompt)}-token prompt): {m}")
    torch.testing.assert_close(torch.cat(o.generation_logits), rows, atol=TOLERANCE,
                               rtol=TOLERANCE, msg=lambda m: f"{rid} generation logits: {m}")
    if o.context:
        assert o.context_logits is not None, rid
        torch.testing.assert_close(o.context_logits, full[:len(o.prompt)], atol=TOLERANCE,
                                   rtol=TOLERANCE, msg=lambda m: f"{rid} context logits: {m}")
    if o.penalized:
        rows = torch.stack([reference_adjust(row, o.prompt, o.tokens[:i], o.sampling)
                            for i, row in enumerate(rows)])
    chosen = rows[torch.arange(len(o.tokens)), torch.tensor(o.tokens)]
    gap = rows.max(-1).values - chosen
    bad = (gap > TOLERANCE).nonzero().flatten().tolist()
    assert not bad, (f"{rid}: token {bad[0]} of {len(o.tokens)} after a {len(o.prompt)}-token "
                     f"prompt trails the model's choice by {gap[bad[0]]:.4f}")


def _check(engine: Engine, model, config: str, outcomes: dict[str, Outcome],
           coverage: bool = True) -> None:
    """The outcomes against the model, nothing held; with `coverage`, that the workload
    exercised what it is meant to (hits, cancellations, evictions, tiers)."""
    for rid, o in outcomes.items():
        assert o.reason in ("length", "cancelled"), (rid, o.reason)
        assert len(o.tokens) == o.max_tokens or o.reason == "cancelled", (rid, o)
        if o.beam_width > 1:
            if o.reason != "cancelled" and config not in APPROXIMATE:
                assert o.beams == reference_beams(model, o.prompt, o.sampling), rid
        elif config not in APPROXIMATE:
            _assert_model(model, rid, o)
    stats = engine.stats()  # waits for a running step (its releases) to end
    if coverage:
        assert any(o.beam_width > 1 and o.reason != "cancelled" for o in outcomes.values())
        assert stats["cache"]["hit_tokens"] > 0, stats["cache"]
        assert stats["cancelled_requests"] > 0
        assert sum(stats["cache"]["page_evictions_by_reason"].values()) > 0, stats["cache"]
        if engine.tiers is not None:
            assert stats["cache"]["hit_tokens_by_tier"]["host"] > 0, stats["cache"]
            assert engine.tiers.ssd is None or stats["tiers"]["ssd_reads"] > 0, stats["tiers"]
            if engine.tiers.states is not None:  # states loaded back from below the device
                tiers = stats["tiers"]
                assert tiers["state_loads_host"] + tiers["state_loads_ssd"] > 0, tiers
        if engine.config.speculative_method != "none":  # drafts kept and drafts rejected
            assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    if engine.tiers is not None:
        engine.tiers.drain()
    assert_no_leak(engine)


def _run_and_check(engine: Engine, model, config: str, seed: int) -> None:
    """One seeded workload on `engine` (stopped at the end), checked against `model`."""
    try:
        _check(engine, model, config, _run(engine, Workload(seed, model.config.vocab_size),
                                           seed))
    finally:
        engine.stop()


@pytest.mark.parametrize("config", list(CONFIGS))
def test_random_workload_matches_the_model(model, config, tmp_path):
    _run_and_check(_engine(model, config, tmp_path), model, config,
                   1000 + list(CONFIGS).index(config) + SEED_OFFSETS.get(config, 0))


@pytest.mark.parametrize("config", ["replay", "checkpoint64", "replay+tiers"])
@pytest.mark.parametrize("build", ["aot_build", "aot_build_nemotron_h", "aot_build_nemotron_h_moe",
                                   "aot_build_qwen3_next_moe"])
def test_random_workload_on_the_compiled_engine(build, config, request, tmp_path):
    """The same workloads on the AOT-compiled executor (`build.py --backend aot`: the default
    model and small random checkpoints of the other families), against the eager model of the
    same weights: compiled prefill, decode, replay and snapshot graphs under the cache."""
    model_dir, engine_dir = request.getfixturevalue(build)[:2]
    model = load_model(model_dir)
    engine = _engine(model, config, tmp_path, engine_dir=engine_dir)
    assert engine.config.executor == "compiled"
    _run_and_check(engine, model, config, 3000 + list(CONFIGS).index(config))


@pytest.mark.parametrize("config", ["replay+tiers", "checkpoint+tiers"])
def test_random_workload_from_client_threads(model, config, tmp_path):
    """The engine on its own thread, as served: four client threads submit (one turn after
    another or without waiting) and cancel some of their requests (at once, or a few ms
    later, when the request may be queued, running or finished) while the engine steps and
    the tiers' I/O threads read and write."""
    engine = _engine(model, config, tmp_path)
    workload = Workload(2000, model.config.vocab_size)
    outcomes: dict[str, Outcome] = {}
    errors: list[BaseException] = []

    def client(c: int) -> None:
        rng = random.Random(2000 + c)
        try:
            for j in range(REQUESTS // 4):
                rid = f"c{c}-{j}"
                o = outcomes[rid] = Outcome(workload.next_prompt(), rng.randint(1, 40),
                                            penalized=j % 3 == 1)
                o.beam_width = beam_width(o, j)
                o.context = asks_context(engine, j)
                engine.submit(o.request(rid, workload))
                if rng.random() < 0.15:
                    time.sleep(rng.choice((0, 0.002, 0.02)))
                    engine.cancel(rid)
                if rng.random() < 0.5:
                    assert o.done.wait(60), f"{rid} did not finish"
                else:
                    time.sleep(rng.uniform(0, 0.01))
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    engine.start()
    try:
        threads = [threading.Thread(target=client, args=(c,)) for c in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert all(o.done.wait(60) for o in outcomes.values())
        # What the cache did depends on the threads' timing: hits and evictions only.
        _check(engine, model, config, outcomes, coverage=False)
        assert any(o.beam_width > 1 for o in outcomes.values())
        cache = engine.stats()["cache"]
        assert cache["hit_tokens"] > 0 and sum(cache["page_evictions_by_reason"].values()), cache
    finally:
        engine.stop()
