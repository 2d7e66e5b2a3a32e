"""`EngineConfig`: scheduler limits, cache and replay settings; parsed from Triton parameters."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace

import torch

from backend.cache.config import CACHE_POLICIES, CacheConfig
from backend.cache.events import ENCODINGS as KV_EVENT_ENCODINGS
from backend.cache.retention import MAX_PRIORITY, MIN_PRIORITY
from backend.cache.tier_config import TierConfig
from backend.engine.speculative import SPECULATIVE_METHODS
from backend.replay.budget import SAMPLINGS, ReplayConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

SCHEDULE_POLICIES = ("fcfs", "lpm")
MAX_SPECULATIVE_TOKENS = 32
MIN_PRIORITY_AGING_S = 0.001  # a priority level per millisecond at the most

# Placeholder until `Engine.from_model_dir` hashes the weights (TierConfig.model_fingerprint).
FINGERPRINT_FROM_MODEL_DIR = "from-model-dir"


MAX_JSON_WHITESPACE = 2**31 - 1


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16
    # Requests that may wait for a slot (queued, not yet running; TensorRT-LLM's
    # max_queue_size, SGLang's max_queued_requests): one more is refused with `QueueFull`
    # (Triton UNAVAILABLE, HTTP 503) so clients and routers go elsewhere or retry; 0: no limit.
    max_queue_size: int = 0
    max_tokens_per_step: int = 512  # token budget of one step (prefill chunks + decodes)
    max_context_len: int = 8192
    executor: str = "torch"  # "torch" (eager PyTorch) or "compiled" (AOT engine directory)
    engine_dir: str = "aot"  # compiled engine folder, relative to the model directory
    dtype: str = "float32"
    cache: CacheConfig = field(default_factory=CacheConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    tiers: TierConfig | None = None  # None: device pool only (evicted pages are dropped)
    # Admission order of waiting requests: "fcfs" (arrival), or "lpm" (longest cached prefix
    # first, SGLang's cache-aware order; ties and queues longer than 128 in queue order).
    schedule_policy: str = "fcfs"
    # Under "lpm", a request that has waited this long goes ahead of every cached prefix (in
    # arrival order), so a stream of hits cannot starve a request without one; 0: plain FCFS.
    lpm_max_wait_s: float = 5.0
    # Priority aging: a request counts one priority level more urgent for each this many
    # seconds since it arrived (queue order and preemption: `Scheduler.urgency`), so a steady
    # stream of urgent requests cannot hold a less urgent one back forever; 0: off (vLLM's
    # priority policy, the default).
    priority_aging_s: float = 0.0
    # A queued request whose prompt shares pages not cached yet with a prompt that a running
    # request is prefilling waits for them to join the store rather than computing them a
    # second time beside it (suffix replay: pages join with their anchors after every chunk).
    share_running_prefills: bool = True
    # A request with a session_id (and no retention config of its own) leaves its pages at
    # this retention priority for session_retention_s seconds after each turn, so a chat's
    # history outlives one-off prompts (`backend/cache/retention.py`; 35, the default
    # priority: sessions are not told apart).
    session_priority: int = 50
    session_retention_s: float = 600.0
    # Whitespace that guided JSON outputs (`json`, `json_schema`) may hold between elements:
    # "compact" (one line with ", " and ": ", as json.dumps writes it), "any" (XGrammar's
    # default; models not trained on JSON may then fill whitespace until max_tokens), or a
    # number N (at most N whitespace characters at each place).
    guided_json_whitespace: str = "compact"
    # Jump-forward: tokens a guide forces (the only one its grammar allows next) join the
    # output without a decode step each; the next step computes them with the sampled token
    # as one chunk (not for requests that ask for log probabilities, which need their logits).
    guided_jump_forward: bool = True
    # Speculative decoding: "ngram" drafts up to `num_speculative_tokens` tokens a step by
    # prompt lookup (`backend/engine/speculative.py`: the tokens that followed the longest
    # earlier match, `prompt_lookup_min`..`prompt_lookup_max` tokens, of the sequence's
    # last ones) and verifies them in one forward; "suffix" also looks in what earlier
    # requests of the same cache namespace generated (the last `suffix_cache_tokens`
    # tokens of them); "none": a token a step.
    speculative_method: str = "none"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 3
    prompt_lookup_max: int = 8
    suffix_cache_tokens: int = 65536
    # On: a step's drafts are cut to the length worth its measured cost (`DraftPolicy`);
    # off: every proposal goes out whole (up to num_speculative_tokens).
    speculative_adaptive: bool = True
    # KV cache events for KV-aware routers (`backend/cache/events.py`: vLLM's ZeroMQ
    # layout): the PUB endpoint ("tcp://*:5557"; empty: none), an optional replay endpoint
    # (ROUTER), the topic, how many messages the replay keeps, and the events' encoding
    # ("map": vLLM's and SGLang's since 2026; "array": their older positional layout).
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = "kv-events"
    kv_events_buffer_steps: int = 10_000
    kv_events_encoding: str = "map"
    # LoRA adapters served beside the base model (`backend/model/lora.py`): "name=path,..."
    # (PEFT directories; a relative path is under the model directory). A request names one
    # (`Request.lora_name`); executor 'torch' only.
    lora_adapters: str = ""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_queue_size < 0:
            raise ValueError(f"max_queue_size must be >= 0 (0: no limit), got "
                             f"{self.max_queue_size}")
        if self.max_tokens_per_step < self.cache.page_size:
            raise ValueError(
                f"max_tokens_per_step={self.max_tokens_per_step} must be >= page_size="
                f"{self.cache.page_size}"
            )
        if self.max_context_len < 2:
            raise ValueError(f"max_context_len must be >= 2, got {self.max_context_len}")
        if self.executor not in ("torch", "compiled"):
            raise ValueError(f"executor must be 'torch' or 'compiled', got {self.executor!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got "
                             f"{self.schedule_policy!r}")
        if not self.lpm_max_wait_s >= 0:
            raise ValueError(f"lpm_max_wait_s must be >= 0 seconds, got {self.lpm_max_wait_s}")
        if not (math.isfinite(self.priority_aging_s) and (
                self.priority_aging_s == 0 or self.priority_aging_s >= MIN_PRIORITY_AGING_S)):
            # (a level per 1e-320 s: an infinite bonus, which failed every step)
            raise ValueError(f"priority_aging_s must be 0 (off) or at least "
                             f"{MIN_PRIORITY_AGING_S} seconds, got {self.priority_aging_s}")
        if isinstance(self.session_priority, bool) or not isinstance(self.session_priority, int) \
                or not MIN_PRIORITY <= self.session_priority <= MAX_PRIORITY:
            raise ValueError(f"session_priority must be an integer in [{MIN_PRIORITY}, "
                             f"{MAX_PRIORITY}], got {self.session_priority!r}")
        if not (math.isfinite(self.session_retention_s) and self.session_retention_s >= 0):
            raise ValueError(f"session_retention_s must be >= 0 seconds, got "
                             f"{self.session_retention_s}")
        ws = self.guided_json_whitespace
        if ws not in ("compact", "any") and not (
                ws.isascii() and ws.isdigit() and 1 <= int(ws) <= MAX_JSON_WHITESPACE):
            # (XGrammar counts in a C int: 2**31 failed every guided request, blaming it)
            raise ValueError("guided_json_whitespace must be 'compact', 'any' or a number in "
                             f"1..{MAX_JSON_WHITESPACE}, got {ws!r}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {SPECULATIVE_METHODS}, got "
                             f"{self.speculative_method!r}")
        if self.speculative_method != "none":
            if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
                raise ValueError(f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}"
                                 f", got {self.num_speculative_tokens}")
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ValueError("prompt_lookup_min / prompt_lookup_max must satisfy 1 <= min "
                                 f"<= max, got {self.prompt_lookup_min} / "
                                 f"{self.prompt_lookup_max}")
            if self.suffix_cache_tokens < 1:
                raise ValueError(f"suffix_cache_tokens must be >= 1, got "
                                 f"{self.suffix_cache_tokens}")
            if self.executor == "compiled":
                raise ValueError("speculative decoding runs on executor 'torch' (the AOT step "
                                 "graphs return one position's logits a sequence)")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.kv_events_encoding not in KV_EVENT_ENCODINGS:
            raise ValueError(f"kv_events_encoding must be map or array, got "
                             f"{self.kv_events_encoding!r}")
        if self.kv_events_buffer_steps < 1:
            raise ValueError(f"kv_events_buffer_steps must be >= 1, got "
                             f"{self.kv_events_buffer_steps}")
        if self.lora_adapters.strip():
            self.lora_adapter_paths()  # checks the list's form
            if self.executor == "compiled":
                raise ValueError("lora_adapters need executor 'torch' (the AOT graphs hold the "
                                 "base model's weights only)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.tiers is not None and (
                self.tiers.host_checkpoint_slots or self.tiers.ssd_checkpoint_slots):
            if self.cache.policy == "none":
                raise ValueError("host_checkpoint_slots / ssd_checkpoint_slots tier the saved "
                                 "states of cache_policy 'checkpoint' or 'suffixreplay' (its "
                                 "live states), not 'none'")
            if self.cache.num_checkpoint_slots < 1:
                raise ValueError("host_checkpoint_slots / ssd_checkpoint_slots keep the states "
                                 "that leave the device's state slots: num_checkpoint_slots "
                                 "must be >= 1")
            if self.cache.policy == "suffixreplay" and not self.replay.live_state:
                raise ValueError("host_checkpoint_slots / ssd_checkpoint_slots under "
                                 "cache_policy 'suffixreplay' tier its live states: they need "
                                 "live_state on")
        if self.cache.anchor_density != self.replay.anchor_density:
            raise ValueError(
                f"cache.anchor_density={self.cache.anchor_density} differs from "
                f"replay.anchor_density={self.replay.anchor_density}"
            )

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    def lora_adapter_paths(self) -> list[tuple[str, str]]:
        """`lora_adapters` as (name, path) pairs, in order (ValueError naming a bad entry)."""
        return adapter_entries(self.lora_adapters.split(","), "lora_adapters")

    @classmethod
    def from_params(cls, params: dict[str, str]) -> EngineConfig:
        """Builds the config from string parameters (config.pbtxt); unknown keys are errors.

        Keys are field names of EngineConfig, CacheConfig (e.g. `cache_policy` for `policy`,
        `num_kv_pages`) and ReplayConfig (`anchor_density`, `k_max`, ...).
        """
        engine, cache, replay, tiers = {}, {}, {}, {}
        targets = (
            (engine, cls, {}),
            (cache, CacheConfig, {"cache_policy": "policy"}),
            (replay, ReplayConfig, {"anchor_sampling": "sampling"}),
            (tiers, TierConfig, {}),
        )
        for key, raw in params.items():
            if raw.strip() == "":
                continue  # an empty string parameter means "use the default"
            if key in ("k_max", "anchor_density") and raw.strip().lower() == "auto":
                replay[f"{key}_auto"] = True
                continue
            if key in ("anchor_density",):
                cache[key] = replay[key] = _parse(key, raw, float)
                continue
            for out, kind, aliases in targets:
                name = aliases.get(key, key)
                types = {f.name: f.type for f in fields(kind)}
                if name in types and name not in ("cache", "replay", "tiers"):
                    out[name] = _parse(key, raw, _py_type(types[name]))
                    break
            else:
                raise ValueError(f"unknown engine parameter {key!r} (value {raw!r})")
        for key, field_name, source in (("cache_policy", "policy", cache),
                                        ("anchor_sampling", "sampling", replay)):
            if key in params and field_name in source:
                _check_alias(key, field_name, source)
        if tiers and "host_pages" not in tiers and not tiers.get("ssd_path"):
            # The tiers are on where host_pages or ssd_path is set; another tier key alone
            # turned on 1024 DRAM pages (host_checkpoint_slots=0 among them). Left at its
            # default it is ignored, set otherwise it is a mistake.
            defaults = TierConfig()
            changed = sorted(k for k, v in tiers.items() if v != getattr(defaults, k))
            if changed:
                raise ValueError(f"{', '.join(changed)} configure the tiers below the device, "
                                 "which are off: set host_pages (DRAM) or ssd_path (SSD) too")
            tiers = {}
        try:
            if tiers.get("ssd_path") and not tiers.get("model_fingerprint"):
                tiers["model_fingerprint"] = FINGERPRINT_FROM_MODEL_DIR
            tier_cfg = TierConfig(**tiers) if tiers else None
            base = cls(cache=CacheConfig(**cache), replay=ReplayConfig(**replay), tiers=tier_cfg)
            return replace(base, **engine)
        except (TypeError, ValueError) as e:
            raise ValueError(f"invalid engine parameters: {e}") from e


def adapter_entries(entries: Iterable[str], what: str) -> list[tuple[str, str]]:
    """NAME=PATH entries (blank ones skipped) as (name, path) pairs, in order; ValueError
    naming `what` (the parameter or option) for a malformed or repeated one."""
    pairs: dict[str, str] = {}
    for entry in entries:
        if not entry.strip():
            continue
        name, sep, path = (part.strip() for part in entry.partition("="))
        if not sep or not name or not path:
            raise ValueError(f"{what} {entry.strip()!r} is not NAME=PATH")
        check_adapter_name(name)
        if name in pairs:
            raise ValueError(f"{what} names {name!r} twice")
        pairs[name] = path
    return list(pairs.items())


def check_adapter_name(name: str) -> None:
    """A LoRA adapter's name: what clients send as lora_name (or an OpenAI `model`)."""
    if not name or len(name) > 128 or not all(c.isalnum() or c in "-_.:/" for c in name):
        raise ValueError(f"LoRA adapter name {name!r} must be 1-128 letters, digits or -_.:/")


def _check_alias(key: str, field_name: str, source: dict) -> None:
    """Validates an aliased value up front so the error names the parameter key."""
    allowed = {"policy": CACHE_POLICIES, "sampling": SAMPLINGS}[field_name]
    if source[field_name] not in allowed:
        raise ValueError(f"engine parameter {key!r} must be one of {allowed}, "
                         f"got {source[field_name]!r}")


def _py_type(annotation: str) -> type:
    text = str(annotation)
    if text.startswith("int | None"):
        return _optional_int
    if text.startswith("str | Path"):
        return str
    for name, t in (("bool", _bool), ("int", int), ("float", float)):
        if text.startswith(name):
            return t
    return str


def _optional_int(raw: str) -> int | None:
    return None if raw.strip().lower() in ("", "none", "inf", "infinity") else int(raw)


def _bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {raw!r}")


def _parse(key: str, raw: str, kind):
    try:
        return kind(raw)
    except ValueError as e:
        raise ValueError(f"engine parameter {key!r}: cannot parse {raw!r} ({e})") from e
