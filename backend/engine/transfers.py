"""Per-step layer-wise KV transfers of the tiered store, as hooks for the model's attention.

The promoted KV of attention layer a must be on the device before layer a reads it (load);
the new KV layer a wrote is copied to DRAM while later layers compute (offload).
"""

from __future__ import annotations


class LayerTransfers:
    def __init__(self, tiers, offload_pages: list[int]) -> None:
        self.load = tiers.start_layer_load()
        self.offload = tiers.start_layer_offload(offload_pages)

    def after_write(self, layer: int) -> None:
        self.offload.layer_done(layer)

    def before_read(self, layer: int) -> None:
        self.load.wait(layer)

    def finish(self) -> None:
        self.load.wait_all()
        self.offload.finish()
