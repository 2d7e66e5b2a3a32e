"""The engine: a prefix store, an executor and a scheduler behind a thread-safe API.

Used in-process by benchmarks and tests (`generate`, or `submit` + `step`) and by the Triton
`hybrid_llm` model, which starts the engine thread and streams outputs from callbacks.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import threading
import time
import weakref
from array import array
from collections import deque
from dataclasses import replace
from pathlib import Path

import torch

from backend import openmp
from backend.cache.page_io import DeviceBuffers
from backend.cache.radix import check_salt, lora_namespace, lora_of
from backend.cache.retention import RetentionConfig, finite_seconds
from backend.cache.store import PrefixStore
from backend.cache.tier_config import fingerprint_model_dir
from backend.cache.tiers import TieredBackend
from backend.engine.beam import BeamGroup, BeamSearch
from backend.engine.cache_manager import CacheManager
from backend.engine.config import (
    DTYPES,
    FINGERPRINT_FROM_MODEL_DIR,
    EngineConfig,
    check_adapter_name,
)
from backend.engine.executor import TorchExecutor
from backend.engine.guided import GrammarBackend
from backend.engine.request import Request, RequestOutput, SamplingParams
from backend.engine.scheduler import Scheduler
from backend.engine.sequence import SeqStatus, Sequence
from backend.model import HybridForCausalLM, load_model, lora
from backend.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """A request refused because `max_queue_size` requests wait already (not the request's
    fault: the same request may be retried later or elsewhere)."""


def apply_calibration(model_dir: str | Path, config: EngineConfig,
                      calibration: str | Path | None = None) -> EngineConfig:
    """`k_max: auto` / `anchor_density: auto`: the values of `engine_build/calibrate.py`'s
    calibration.json (`calibration`, default the model folder's; the configured values, with
    a warning, where it is missing). Warns when
    the calibration missed its target, or was measured at another anchor density than the
    one served (its k_max was chosen for that density)."""
    replay = config.replay
    if not (replay.k_max_auto or replay.anchor_density_auto):
        return config
    path = Path(calibration) if calibration else Path(model_dir) / "calibration.json"
    if not path.exists():
        log.warning("k_max / anchor_density: auto but %s is missing; using k_max=%s, "
                    "anchor_density=%s", path, replay.k_max, replay.anchor_density)
        return config
    try:
        calib = json.loads(path.read_text())
        k_max = int(calib["k_max"])
        density = int(calib.get("anchors_per_page", 4)) / int(calib.get("page_size", 64))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: unreadable calibration ({e})") from e
    if calib.get("target_met") is False:
        log.warning("%s: the calibration did not reach its target top-1 agreement %s (best "
                    "%s at k=%s); replayed states are coarser for this model", path,
                    calib.get("target_top1_agreement"), calib.get("top1_agreement"), k_max)
    cache = config.cache
    if replay.anchor_density_auto:
        replay, cache = replace(replay, anchor_density=density), replace(cache,
                                                                        anchor_density=density)
    elif abs(replay.anchor_density - density) > 1e-12:
        log.warning("%s was measured with anchor density %s, this engine stores %s: its "
                    "k_max=%s may not hold (set anchor_density: auto, or recalibrate)",
                    path, density, replay.anchor_density, k_max)
    if replay.k_max_auto:
        replay = replace(replay, k_max=k_max)
    return replace(config, replay=replay, cache=cache)


def _pool_entry_bytes(executor, store: PrefixStore) -> tuple[int, int, int]:
    """Bytes of one KV page, one anchor block and one saved-state slot on the device."""
    def per_entry(tensors, count: int) -> int:
        return sum(t.nbytes for t in tensors) // count if count else 0

    scales = [executor.anchor_scales] if executor.anchor_scales is not None else []
    states = executor.saved_states
    return (per_entry(executor.kv.k + executor.kv.v, store.kv_pool.capacity),
            per_entry([executor.anchors, *scales], store.anchor_pool.capacity),
            per_entry(states.conv + states.rec, store.state_pool.capacity))


def _check_ids(ids, vocab: int, what: str, outside: str) -> None:
    """ValueError unless `ids` are int32 integers inside [0, vocab): a float would pass
    the range check and fail the batch's step. `outside` words the range error, with
    `{bad}` where the first offending ids go."""
    try:
        packed = array("i", ids)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"{what} must be int32 integers: {exc}") from None
    # (min / max first: the list is built only for the error; a 16K prompt's check
    # 0.9 -> 0.4 ms)
    if not 0 <= min(packed) <= max(packed) < vocab:
        bad = [t for t in packed if not 0 <= t < vocab][:5]
        raise ValueError(outside.format(bad=bad) + f" the vocabulary [0, {vocab})")


class Engine:
    def __init__(self, model: HybridForCausalLM | None, config: EngineConfig | None = None,
                 tokenizer: Tokenizer | None = None, engine_dir: str | Path | None = None) -> None:
        """`model` runs eagerly (executor 'torch'); with executor 'compiled' the AOT engine in
        `engine_dir` runs instead and `model` may be None."""
        self.config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        cache_cfg = self.config.cache
        sizes = (cache_cfg.num_kv_pages, cache_cfg.page_size, self.config.max_num_seqs,
                 cache_cfg.num_checkpoint_slots,
                 cache_cfg.anchor_pool_size * cache_cfg.anchors_per_page)
        int8 = self.config.replay.anchor_dtype == "int8"
        if self.config.executor == "compiled":
            from backend.engine.compiled import CompiledExecutor

            if engine_dir is None:
                raise ValueError("executor 'compiled' needs an engine directory")
            self.executor = CompiledExecutor(engine_dir, *sizes, int8_anchors=int8)
            if self.executor.dtype != DTYPES[self.config.dtype]:
                raise ValueError(f"{engine_dir} was built for {self.executor.dtype}; the "
                                 f"engine configuration asks for dtype {self.config.dtype!r}")
        else:
            if model is None:
                raise ValueError("executor 'torch' needs the model")
            self.executor = TorchExecutor(model, *sizes, int8_anchors=int8)
        self.model_config = self.executor.config
        self.tiers = None
        if self.config.tiers is not None:
            replay = self.config.replay
            buffers = DeviceBuffers.from_executor(self.executor, cache_cfg.anchors_per_page,
                                                  with_anchors=cache_cfg.uses_anchors,
                                                  anchor_sampling=replay.sampling)
            tag = "" if cache_cfg.policy != "suffixreplay" else (
                f"replay:{replay.sampling}:{replay.anchor_density!r}:"
                f"{replay.budget_fraction!r}:{replay.k_max}:{replay.anchor_dtype}")
            self.tiers = TieredBackend(self.config.tiers, buffers, state_tag=tag)
        self.store = PrefixStore(cache_cfg, self.tiers)
        self.kv_events = None  # KvEventPublisher: the store's page events for routers
        if self.config.kv_events_endpoint:
            from backend.cache.events import KvEventLog, KvEventPublisher

            self.store.tree.events = KvEventLog()
            self.kv_events = KvEventPublisher(
                self.store.tree.events, self.config.kv_events_endpoint,
                self.config.kv_events_replay_endpoint, self.config.kv_events_topic,
                self.config.kv_events_buffer_steps, self.config.kv_events_encoding)
        self.cache = CacheManager(self.config, self.store, self.executor, self.tiers)
        self.scheduler = Scheduler(self.config, self.cache, self.executor)
        self._entry_bytes = _pool_entry_bytes(self.executor, self.store)
        self.eos_token_id = self.model_config.eos_token_id
        self.max_context_len = min(self.config.max_context_len,
                                   self.model_config.max_position_embeddings)
        self._lock = threading.Condition()
        self._inbox: deque[Sequence] = deque()
        self._cancels: set[str] = set()
        # (deadline, tie-breaker, sequence) of live requests with a Request.deadline
        self._deadlines: list[tuple[float, int, Sequence]] = []
        self._deadline_ids = itertools.count()
        self.clock = time.monotonic  # what Request.deadline is measured against
        self._live: dict[str, Sequence] = {}
        # Requests in the scheduler's queue, as of the engine thread's last look (with the
        # inbox: what max_queue_size counts; written under _lock).
        self._queued = 0
        self._thread: threading.Thread | None = None
        # Held for a whole step, output callbacks included (reentrant: a callback may call
        # stats()); stats() may be called from other threads (metrics).
        self._step_lock = threading.RLock()
        self.num_cancelled = 0  # requests ended by cancel() (a client that left, a stop)
        self.num_timed_out = 0  # requests ended at their deadline (Request.deadline)
        self.num_failed = 0  # requests ended by a failed step
        self.num_rejected = 0  # requests refused with the queue full (max_queue_size)
        self.num_cache_resets = 0  # reset_prefix_cache calls
        self.adapters: dict[str, int] = {}  # LoRA adapter name -> its index in the model
        self.lora_requests: dict[str, int] = {}  # requests submitted on each adapter
        self._adapters: dict[int, lora.LoraAdapter] = {}  # this engine's, by model index
        if model is not None:  # (a model outliving its engine keeps no adapter of it)
            weakref.finalize(self, lora.withdraw, model, self._adapters)
        self._stopping = False
        self._grammars: GrammarBackend | None = None  # built for the first guided request
        self._grammar_lock = threading.Lock()

    @classmethod
    def from_model_dir(cls, path: str | Path, config: EngineConfig | None = None,
                       calibration: str | Path | None = None) -> Engine:
        """The engine of the checkpoint folder `path`; `calibration`: the calibration.json
        `k_max` / `anchor_density: auto` read (default `path`'s)."""
        config = config or EngineConfig()
        config = apply_calibration(path, config, calibration)
        if config.tiers is not None and config.tiers.model_fingerprint in (
                "", FINGERPRINT_FROM_MODEL_DIR):
            fingerprint = fingerprint_model_dir(path, config.dtype)
            config = replace(config, tiers=replace(config.tiers, model_fingerprint=fingerprint))
        if config.executor == "compiled":
            from backend.engine.compiled import check_engine_source

            engine_dir = Path(path) / config.engine_dir
            check_engine_source(engine_dir, path)
            return cls(None, config, load_tokenizer(path), engine_dir=engine_dir)
        model = load_model(path, dtype=DTYPES[config.dtype])
        engine = cls(model, config, load_tokenizer(path))
        for name, adapter_path in config.lora_adapter_paths():
            engine.load_lora(name, Path(path) / adapter_path)  # an absolute path stays as is
        return engine

    # LoRA adapters ----------------------------------------------------------------------
    def load_lora(self, name: str, path: str | Path) -> None:
        """Serves the PEFT LoRA adapter at `path` as `name` (`backend/model/lora.py`):
        requests with `lora_name` = name run on it. Raises ValueError (AdapterError) for an
        adapter this model cannot take or a name already in use."""
        check_adapter_name(name)
        if self.config.executor != "torch":
            raise ValueError("LoRA adapters need executor 'torch'")
        if name in self.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        adapter = lora.load_adapter(name, path, self.model)
        with self._step_lock, self._lock:  # between two steps: no forward sees half of it
            if name in self.adapters:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
            index = lora.serve(self.model, adapter)
            self._adapters[index] = adapter
            self.adapters[name] = index
            self.lora_requests.setdefault(name, 0)
            if self.tiers is not None:  # SSD pages of another adapter of that name: foreign
                self.tiers.add_adapter(name, adapter.fingerprint)
        log.info("LoRA adapter %r loaded from %s: rank %d, scale %g, %d layers", name, path,
                 adapter.rank, adapter.scale, len(adapter.weights))

    def unload_lora(self, name: str) -> dict[str, int]:
        """Stops serving LoRA adapter `name` and forgets the prefixes cached under it, on
        every tier (`PrefixStore.reset` of each of its namespaces). Raises ValueError while
        a request on it is queued or running, or for an unknown name. Returns
        {"dropped_pages"}."""
        with self._step_lock, self._lock:
            if name not in self.adapters:
                raise ValueError(f"unknown LoRA adapter {name!r} (loaded: "
                                 f"{', '.join(sorted(self.adapters)) or 'none'})")
            users = sum(seq.request.lora_name == name for seq in self._live.values())
            if users:
                raise ValueError(f"{users} request(s) on LoRA adapter {name!r} are queued or "
                                 "running: unload it once they finished")
            index = self.adapters.pop(name)
            del self._adapters[index]
            lora.withdraw(self.model, [index])
            salts = [s for s in self.store.tree.roots if lora_of(s) == name]
            dropped = sum(self.store.reset(s, every_salt=False)[0] for s in salts)
            corpus = self.scheduler.drafter.corpus if self.scheduler.drafter else None
            if corpus is not None:  # suffix decoding's drafts from its outputs go too
                corpus.forget({ns for ns, _ in corpus.requests if lora_of(ns) == name})
            if self.kv_events is not None:
                self.kv_events.flush()
        log.info("LoRA adapter %r unloaded: %d cached pages dropped", name, dropped)
        return {"dropped_pages": dropped}

    # Requests ---------------------------------------------------------------------------
    def submit(self, request: Request, over_queue_limit: bool = False) -> None:
        """Queues a request; raises ValueError (with the offending values) for bad ones and
        `QueueFull` when `max_queue_size` requests wait already (`over_queue_limit`: queued
        anyway, e.g. the later sequences of a request that was admitted)."""
        self.validate(request)
        with self._lock:  # refused before a guide is compiled; checked again below
            self._check_queue(over_queue_limit)
        params = request.sampling
        if params.end_id is None and self.eos_token_id is not None:
            request.sampling = replace(params, end_id=self.eos_token_id)
        seq = Sequence(request, list(request.prompt_ids), len(request.prompt_ids))
        if params.beam_width > 1:
            search = BeamSearch(request.sampling, len(request.prompt_ids), self.max_context_len)
            seq.beam = BeamGroup(seq, search, [seq])
        if params.guide is not None:
            seq.guide = self.grammars().state(params.guide, request.sampling.end_id)
        with self._lock:  # (unload_lora holds it: the adapter stays while this is live)
            if request.request_id in self._live:
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            self._check_queue(over_queue_limit)
            if request.lora_name is not None:
                self._check_adapter(request.lora_name)
                seq.adapter = self.adapters[request.lora_name]
                self.lora_requests[request.lora_name] += 1
            self._live[request.request_id] = seq
            self._inbox.append(seq)
            if request.deadline is not None:
                heapq.heappush(self._deadlines,
                               (request.deadline, next(self._deadline_ids), seq))
            self._lock.notify()

    def _check_queue(self, over_queue_limit: bool) -> None:
        """QueueFull when `max_queue_size` requests wait (caller holds `_lock`)."""
        limit = self.config.max_queue_size
        if limit and not over_queue_limit and self._queued + len(self._inbox) >= limit:
            self.num_rejected += 1
            raise QueueFull(f"the request queue is full ({limit} requests wait for the "
                            f"model's {self.config.max_num_seqs} slots: max_queue_size); "
                            "retry later")

    def validate(self, request: Request) -> None:
        """ValueError (with the offending values) for a request `submit` would refuse for
        what it asks (its prompt, parameters and outputs; not the queue)."""
        ids = request.prompt_ids
        if not ids:
            raise ValueError("the prompt is empty")
        if request.needs_prompt_logits and self.config.executor == "compiled":
            what = ("return_context_logits" if request.return_context_logits
                    else "return_prompt_log_probs")
            raise ValueError(f"{what} needs executor 'torch': a compiled engine's step "
                             "returns the last position's logits only")
        check_salt(request.cache_salt)
        if isinstance(request.priority, bool) or not isinstance(request.priority, int):
            raise ValueError(f"priority must be an integer, got {request.priority!r}")
        if request.retention is not None and not isinstance(request.retention, RetentionConfig):
            raise ValueError(f"retention must be a RetentionConfig, got "
                             f"{type(request.retention).__name__}")
        vocab = self.model_config.vocab_size
        _check_ids(ids, vocab, "token ids", "token ids {bad} are outside")
        params = request.sampling
        if params.top_log_probs > vocab:
            raise ValueError(f"top_log_probs={params.top_log_probs} is more than the "
                             f"vocabulary's {vocab} tokens")
        # -1: no end token (TensorRT-LLM's way to force max_tokens); any other id outside the
        # vocabulary could never be sampled, so it is a client's mistake (another tokenizer).
        if params.end_id is not None and params.end_id != -1 and not 0 <= params.end_id < vocab:
            raise ValueError(f"end_id={params.end_id} is outside the vocabulary [0, {vocab}) "
                             "(-1: no end token)")
        for name in ("stop_words", "bad_words"):
            bad = [t for word in getattr(params, name) for t in word if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} hold token ids {bad[:5]} outside the vocabulary "
                                 f"[0, {vocab})")
        if request.deadline is not None and not finite_seconds(request.deadline):
            raise ValueError(f"deadline must be a finite time (the engine clock's seconds), "
                             f"got {request.deadline!r}")
        if request.prediction:
            _check_ids(request.prediction, vocab, "the prediction's token ids",
                       "the prediction holds token ids {bad} outside")
        if request.lora_name is not None:
            self._check_adapter(request.lora_name)  # (again at submit, under the lock)
        bad = [t for t in params.allowed_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"allowed_token_ids holds token ids {bad[:5]} outside the "
                             f"vocabulary [0, {vocab})")
        bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias names token ids {bad[:5]} outside the vocabulary "
                             f"[0, {vocab})")
        total = len(ids) + request.sampling.max_tokens
        if total > self.max_context_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens plus max_tokens={request.sampling.max_tokens} is "
                f"{total} tokens, more than the context limit of {self.max_context_len}"
            )
        pages = -(-total // self.config.page_size)
        width = params.beam_width
        if width > self.config.max_num_seqs:
            raise ValueError(f"beam_width={width} is more than the engine's max_num_seqs="
                             f"{self.config.max_num_seqs} (each beam runs as a sequence)")
        if width > 1 and width * pages > self.config.cache.num_kv_pages:
            raise ValueError(
                f"beam_width={width} beams of up to {pages} KV pages each need "
                f"{width * pages} pages, the pool holds {self.config.cache.num_kv_pages}")
        if pages > self.config.cache.num_kv_pages:
            raise ValueError(
                f"the request needs {pages} KV pages, the pool holds "
                f"{self.config.cache.num_kv_pages}"
            )
        anchors = self.config.cache.anchor_pool_size
        if self.config.cache.uses_anchors and pages > anchors:  # (one block a page, as KV)
            raise ValueError(f"the request needs {pages} anchor blocks, the pool holds "
                             f"{anchors} (num_anchor_blocks)")

    def _check_adapter(self, name: str) -> None:
        if name not in self.adapters:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {loaded})")

    def grammars(self) -> GrammarBackend:
        """The guided-decoding compiler for this model's vocabulary (ValueError without a
        tokenizer or without xgrammar)."""
        with self._grammar_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("guided decoding needs the model's tokenizer")
                self._grammars = GrammarBackend(self.tokenizer, self.model_config.vocab_size,
                                                self.config.guided_json_whitespace)
            return self._grammars

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._live:
                self._cancels.add(request_id)
                self._lock.notify()

    def reset_prefix_cache(self, cache_salt: str | None = None,
                           every_salt: bool = True) -> dict[str, int]:
        """Forgets the cached prefixes (namespace `cache_salt`, or all of them with
        `every_salt`) on the device, in DRAM and on SSD, between two steps (thread-safe), and
        the outputs suffix decoding drafts from in those namespaces. Pages running requests
        hold stay cached; the requests go on unchanged. Returns
        `{"dropped_pages", "kept_pages"}`; the KV cache events announce the removals."""
        check_salt(cache_salt)
        with self._step_lock:
            removed, kept = self.store.reset(cache_salt, every_salt)
            if not every_salt:  # the namespace's prefixes under each adapter too
                for name in self.adapters:
                    r, k = self.store.reset(lora_namespace(cache_salt or "", name), False)
                    removed, kept = removed + r, kept + k
            corpus = self.scheduler.drafter.corpus if self.scheduler.drafter else None
            if corpus is not None:  # suffix decoding's earlier outputs go with the prefixes
                corpus.forget(None if every_salt else
                              {lora_namespace(cache_salt or "", name)
                               for name in (None, *self.adapters)})
            self.num_cache_resets += 1
            if self.kv_events is not None:
                self.kv_events.flush()
        log.info("prefix cache reset (%s): %d pages dropped, %d held by running requests kept",
                 "every namespace" if every_salt else f"cache_salt {cache_salt!r}", removed,
                 kept)
        return {"dropped_pages": removed, "kept_pages": kept}

    # Stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Drains new requests and cancellations, runs one scheduler step, delivers outputs,
        then runs the step's cache work (so a first token never waits for the store; other
        threads' `stats()` see the step whole)."""
        with self._step_lock:
            outputs = self._drain()
            try:
                outputs.extend(self.scheduler.step())
            except Exception as e:  # a failed step fails its requests, never the engine
                outputs.extend(self._fail_step(e))
            self._count_queued()
            for out in outputs:
                self._deliver(out)
            try:
                self.scheduler.after_outputs()
            except Exception as e:
                failed = self._fail_step(e)
                for out in failed:
                    self._deliver(out)
                outputs.extend(failed)
            if self.kv_events is not None:
                self.kv_events.flush()
        return outputs

    def _count_queued(self) -> None:
        """Publishes how many requests wait in the scheduler for their first slot (a beam
        search once; a preempted request waiting to resume is not counted: the engine's own
        preemptions do not make the queue refuse new requests)."""
        waiting = sum(1 for s in self.scheduler.waiting
                      if (s.beam is None or s is s.beam.leader) and s.first_scheduled_time is None)
        with self._lock:
            self._queued = waiting

    def _fail_step(self, error: Exception) -> list[RequestOutput]:
        log.exception("engine step failed")
        self.scheduler.drop_after()
        return self._fail_all(f"internal error: {error}")

    def _drain(self) -> list[RequestOutput]:
        with self._lock:
            new, self._inbox = list(self._inbox), deque()
            cancels, self._cancels = self._cancels, set()
            self._queued += len(new)  # until the step's own count (`_count_queued`)
            expired = []
            now = self.clock()
            while self._deadlines and self._deadlines[0][0] <= now:
                expired.append(heapq.heappop(self._deadlines)[2])
            if len(self._deadlines) > 2 * len(self._live) + 64:  # drop the finished ones
                self._deadlines = [e for e in self._deadlines
                                   if self._live.get(e[2].request.request_id) is e[2]]
                heapq.heapify(self._deadlines)
        self.scheduler.waiting.extend(new)
        outputs = []
        for rid in cancels:
            seq = self._live.get(rid)
            if seq is not None:
                outputs.append(self.scheduler.stop(seq))
        self.num_cancelled += len(outputs)
        for seq in expired:  # past its deadline, unless it ended meanwhile
            if self._live.get(seq.request.request_id) is seq and \
                    seq.status is not SeqStatus.FINISHED:
                outputs.append(self.scheduler.time_out(seq))
                self.num_timed_out += 1
        return outputs

    def _fail_all(self, message: str) -> list[RequestOutput]:
        outputs = []
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            if seq.beam is not None and seq is not seq.beam.leader:
                continue  # a beam of a beam search: cancelled with its leader
            try:
                self.scheduler.cancel(seq)
            except Exception:  # its request still ends; the engine goes on
                log.exception("releasing request %s after a failed step failed",
                              seq.request.request_id)
            outputs.append(seq.output([], True, "error", error=message))
        self.num_failed += len(outputs)
        return outputs

    def _deliver(self, out: RequestOutput) -> None:
        seq = self._live.get(out.request_id)
        if out.finished:
            with self._lock:
                self._live.pop(out.request_id, None)
        callback = seq.request.on_output if seq is not None else None
        if seq is not None and seq.request.return_perf_metrics:
            out.metrics = seq.metrics(self.config.cache.page_size)
        if seq is not None and seq.context_rows and seq.first_token_time is not None and \
                sum(len(rows) for rows in seq.context_rows) == seq.num_prompt_tokens:
            out.context_logits = torch.cat(seq.context_rows)  # the first output: the prompt's
            seq.context_rows = None
        if seq is not None and seq.prompt_scores is not None and seq.first_token_time is not None \
                and sum(len(s[0]) for s in seq.prompt_scores) == seq.num_prompt_tokens - 1:
            out.prompt_log_probs = [v for values, _, _ in seq.prompt_scores for v in values]
            out.prompt_log_prob_ranks = [r for _, _, ranks in seq.prompt_scores for r in ranks]
            if seq.request.sampling.top_log_probs:
                out.prompt_top_log_probs = [t for _, tops, _ in seq.prompt_scores for t in tops]
            seq.prompt_scores = None
        if callback is not None:
            try:
                callback(out)
            except Exception:
                log.exception("output callback of %s failed", out.request_id)

    @property
    def has_work(self) -> bool:
        return bool(self._inbox or self._cancels or self.scheduler.has_work)

    # Thread -----------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the engine thread. The calling thread (which loaded the model and built the
        buffers) gives up its idle OpenMP workers, so the engine thread's are the process's
        only ones (`backend/openmp.py`: two pools on one machine's cores slow every op)."""
        if self._thread is not None:
            return
        self._stopping = False
        openmp.release_workers()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.tiers is not None:
            self.tiers.close()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._lock:
                idle = not (self._stopping or self.has_work)
            if idle:  # nothing to run: hold no OpenMP workers while waiting (other threads'
                openmp.release_workers()  # torch ops then run at full speed)
            with self._lock:
                while not (self._stopping or self.has_work):
                    self._lock.wait()
                if self._stopping:
                    return
            self.step()

    # Convenience ------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
                 cache_salt: str = "", session_id: str | None = None,
                 request_id: str | None = None, return_first_logits: bool = False,
                 return_perf_metrics: bool = False, return_generation_logits: bool = False,
                 return_context_logits: bool = False,
                 retention: RetentionConfig | None = None,
                 return_prompt_log_probs: bool = False,
                 lora_name: str | None = None) -> RequestOutput:
        """Blocking: runs one request to completion and returns all its tokens."""
        done = threading.Event()
        tokens: list[int] = []
        log_probs: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        final: list[RequestOutput] = []

        first_logits: list = []
        generation_logits: list = []
        context_logits: list = []
        prompt_scores: list = []

        def collect(out: RequestOutput) -> None:
            tokens.extend(out.new_token_ids)
            log_probs.extend(out.log_probs)
            tops.extend(out.top_log_probs)
            if out.first_logits is not None:
                first_logits.append(out.first_logits)
            if out.generation_logits is not None:
                generation_logits.append(out.generation_logits)
            if out.context_logits is not None:
                context_logits.append(out.context_logits)
            if out.prompt_log_probs is not None:
                prompt_scores.append((out.prompt_log_probs, out.prompt_top_log_probs,
                                      out.prompt_log_prob_ranks))
            if out.finished:
                final.append(out)
                done.set()

        rid = request_id or f"generate-{id(done)}"
        self.submit(Request(rid, list(prompt_ids), sampling or SamplingParams(), cache_salt,
                            session_id, collect, return_first_logits, return_perf_metrics,
                            return_generation_logits, return_context_logits,
                            return_prompt_log_probs, retention, lora_name=lora_name))
        if self._thread is None:
            while not done.is_set():
                self.step()
        done.wait()
        out = final[0]
        out.new_token_ids, out.log_probs, out.top_log_probs = tokens, log_probs, tops
        if first_logits:
            out.first_logits = first_logits[0]
        if generation_logits:
            out.generation_logits = torch.cat(generation_logits)
        if context_logits:
            out.context_logits = context_logits[0]
        if prompt_scores:
            (out.prompt_log_probs, out.prompt_top_log_probs,
             out.prompt_log_prob_ranks) = prompt_scores[0]
        return out

    def stats(self) -> dict:
        """Counters and gauges (thread-safe: waits for a running step to finish)."""
        with self._step_lock:
            return self._stats()

    def _lora_running(self) -> dict[str, int]:
        """Requests running (admitted) on each LoRA adapter."""
        names = {index: name for name, index in self.adapters.items()}
        running = dict.fromkeys(self.lora_requests, 0)  # unloaded ones too: a gauge at 0
        for seq in self.scheduler.running:
            if seq.adapter and (seq.beam is None or seq is seq.beam.leader):
                running[names[seq.adapter]] += 1
        return running

    def _memory_bytes(self) -> dict[str, int]:
        """Bytes in use: the device pools' KV pages, anchor blocks and saved-state slots
        (cached entries and running requests' pages alike), the lower tiers', and the LoRA
        adapters' weights."""
        store = self.store
        kv, anchors, states = self._entry_bytes
        out = {"device_kv": store.kv_pool.num_used * kv,
               "device_anchors": store.anchor_pool.num_used * anchors,
               "device_states": store.state_pool.num_used * states}
        if self.tiers is not None:
            out.update(self.tiers.memory_bytes())
        if self._adapters:  # LoRA adapters' weights (A and scaled B of every adapted layer)
            out["lora"] = sum(t.numel() * t.element_size() for a in self._adapters.values()
                              for pair in a.weights.values() for t in pair)
        return out

    def _stats(self) -> dict:
        store, sched = self.store, self.scheduler
        return {
            "page_size": self.config.page_size,
            "kv_pages_total": store.kv_pool.capacity,
            "kv_pages_free": store.kv_pool.num_free,
            "kv_pages_used": store.kv_pool.capacity - store.kv_pool.num_free,
            "kv_pages_held_by_requests": len(store.kv.ids),
            "cached_pages": store.num_cached_pages,
            "state_slots_total": store.state_pool.capacity,
            "state_slots_free": store.state_pool.num_free,
            "max_num_seqs": self.config.max_num_seqs,
            "active_requests": len(sched.running),
            "context_requests": sum(s.num_computed < len(s.tokens) - 1 for s in sched.running),
            "waiting_requests": len(sched.waiting),
            "finished_requests": sched.num_finished,
            "cancelled_requests": self.num_cancelled,
            "timed_out_requests": self.num_timed_out,
            "prefix_cache_resets": self.num_cache_resets,
            "lora_adapters": sorted(self.adapters),
            "lora_requests": dict(self.lora_requests),
            "lora_running": self._lora_running(),
            "failed_requests": self.num_failed,
            "rejected_requests": self.num_rejected,
            "max_queue_size": self.config.max_queue_size,
            "steps": sched.num_steps,
            "preemptions": sched.num_preemptions,
            "prefill_waits": sched.num_prefill_waits,
            "guided_forced_tokens": sched.num_forced_tokens,
            "spec_draft_tokens": sched.num_draft_tokens,
            "spec_accepted_tokens": sched.num_accepted_tokens,
            "spec_corpus_drafts": sched.drafter.corpus_drafts if sched.drafter else 0,
            "beam_forks": sched.num_beam_forks,
            "beam_pages_copied": sched.num_beam_pages_copied,
            "replayed_anchors": self.cache.num_replayed_anchors,
            "recomputed_tokens": self.cache.num_recomputed_tokens,
            "live_state_hits": self.cache.num_live_state_hits,
            "memory_bytes": self._memory_bytes(),
            "cache": store.stats.as_dict(),
            "tiers": self.tiers.stats.as_dict() if self.tiers is not None else None,
        }
