"""The hybrid model in PyTorch: layers, layout and groups, HF checkpoint loading."""

from backend.model.batch import Capture, ForwardBatch, SeqInput, Snapshots
from backend.model.hybrid import HybridForCausalLM
from backend.model.kv_cache import PagedKV, StateSlots
from backend.model.loader import CheckpointError, load_model

__all__ = [
    "Capture",
    "CheckpointError",
    "ForwardBatch",
    "HybridForCausalLM",
    "PagedKV",
    "SeqInput",
    "Snapshots",
    "StateSlots",
    "load_model",
]
