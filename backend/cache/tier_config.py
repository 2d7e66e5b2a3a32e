"""`TierConfig`: sizes and ablation switches of the tiered KV store (DRAM and SSD under the
device pools of `PrefixStore`).

PCR's baselines are configurations of this code: CCache = DRAM only (`enable_ssd=False`,
no overlap, no prefetch), SCCache = DRAM + SSD without overlap and prefetch, PCR = all on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_PREFETCH_WINDOW = 6  # PCR's look-ahead window W


MAX_IO_THREADS = 256  # (a million failed at start: "can't start new thread")


@dataclass(frozen=True)
class TierConfig:
    """host_pages: DRAM slots, one per page (its KV and its anchor block, each in its own
    physical pool). ssd_path / ssd_bytes: SSD directory and byte budget (files included).
    prefetch_window: W, the waiting requests the prefetcher looks at. io_threads: SSD I/O
    workers. o_direct: use O_DIRECT where the filesystem accepts it (probed). use_kvikio:
    allow the KvikIO backend where `probe_kvikio()` finds a GPU and libcufile.
    host_checkpoint_slots / ssd_checkpoint_slots: DRAM slots and SSD files for the saved
    states that leave the device's state slots (`state_tier.py`): the checkpoint policy's
    checkpoints, or suffix replay's live states; 0 / 0: states stay on the device and a state
    is lost with its device slot. The SSD files are paid from ssd_bytes: the page chunks get
    what ssd_checkpoint_slots state files leave.
    model_fingerprint: identifies the weights and dtype (`fingerprint_model_dir`); SSD chunks
    of another fingerprint are foreign and never served. The SSD tier is on when
    `enable_ssd` and `ssd_path` is set (the default config is DRAM only).
    """

    host_pages: int = 1024
    ssd_path: str | Path | None = None
    ssd_bytes: int = 64 << 30
    prefetch_window: int = DEFAULT_PREFETCH_WINDOW
    enable_ssd: bool = True
    enable_overlap: bool = True
    enable_prefetch: bool = True
    enable_lookahead: bool = True
    o_direct: bool = True
    use_kvikio: bool = True
    io_threads: int = 8
    model_fingerprint: str = ""
    host_checkpoint_slots: int = 0
    ssd_checkpoint_slots: int = 0

    def __post_init__(self) -> None:
        if self.host_pages < 0:
            raise ValueError(f"host_pages must be >= 0, got {self.host_pages}")
        if self.ssd_bytes < 0:
            raise ValueError(f"ssd_bytes must be >= 0, got {self.ssd_bytes}")
        if self.prefetch_window < 0:
            raise ValueError(f"prefetch_window must be >= 0, got {self.prefetch_window}")
        for name in ("host_checkpoint_slots", "ssd_checkpoint_slots"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.ssd_checkpoint_slots and self.uses_ssd and not self.host_checkpoint_slots:
            raise ValueError("SSD checkpoint states are staged through DRAM: "
                             "host_checkpoint_slots must be >= 1 with ssd_checkpoint_slots")
        if not 1 <= self.io_threads <= MAX_IO_THREADS:
            raise ValueError(f"io_threads must be in 1..{MAX_IO_THREADS}, got {self.io_threads}")
        if self.uses_ssd and not self.model_fingerprint:
            raise ValueError("an SSD tier needs a model_fingerprint (it guards the SSD cache)")
        if self.uses_ssd and self.host_pages < 1:
            raise ValueError(
                f"the SSD tier stages pages through DRAM: host_pages must be >= 1, got "
                f"{self.host_pages}"
            )

    @property
    def uses_ssd(self) -> bool:
        return self.enable_ssd and self.ssd_path is not None

    @property
    def uses_prefetch(self) -> bool:
        return self.uses_ssd and self.enable_prefetch and self.prefetch_window > 0


def fingerprint_model_dir(model_dir: str | Path, dtype: str) -> str:
    """A model fingerprint for `TierConfig`: xxh3-128 over config.json and every safetensors
    file's bytes, plus the serving dtype. Reads the weights once (about 1 s per 10 GB);
    retrained weights of the same shapes get a new fingerprint, so their KV is never mixed."""
    import xxhash

    root = Path(model_dir)
    h = xxhash.xxh3_128()
    h.update(dtype.encode())
    for path in [root / "config.json", *sorted(root.glob("*.safetensors"))]:
        h.update(path.name.encode())
        with open(path, "rb") as f:
            while block := f.read(16 << 20):
                h.update(block)
    return h.hexdigest()
