"""SuffixReplay: anchor sampling, replay budget, group-wise (batched) replay."""

from backend.replay.anchors import AnchorLayout
from backend.replay.budget import ReplayConfig, replay_budget

__all__ = ["AnchorLayout", "ReplayConfig", "replay_budget"]
