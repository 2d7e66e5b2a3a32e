"""Which token positions of a page are anchors, and where each anchor row is stored.

An anchor block holds `anchors_per_page` rows per group for one page, in position order:
row `block * anchors_per_page + i` of each group's buffer is the i-th anchor of that page.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AnchorLayout:
    page_size: int
    anchors_per_page: int
    sampling: str = "dense_tail"

    def __post_init__(self) -> None:
        if not 1 <= self.anchors_per_page <= self.page_size:
            raise ValueError(
                f"anchors_per_page={self.anchors_per_page} must be in [1, {self.page_size}]"
            )

    @property
    def offsets(self) -> torch.Tensor:
        """In-page offsets of the anchors, ascending: dense tail or evenly spread."""
        a, ps = self.anchors_per_page, self.page_size
        if self.sampling == "dense_tail":
            return torch.arange(ps - a, ps)
        stride = ps // a
        return torch.arange(a) * stride + (stride - 1)

    def capture_plan(
        self, start: int, end: int, page_blocks: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Anchors among positions [start, end): (offsets from `start`, anchor-buffer rows).

        page_blocks[p] is the anchor block of page p (covering every page touched).
        """
        ps, a = self.page_size, self.anchors_per_page
        first, last = start // ps, (end - 1) // ps
        pages = torch.arange(first, last + 1)
        pos = (pages.unsqueeze(1) * ps + self.offsets).reshape(-1)
        keep = (pos >= start) & (pos < end)
        slot_in_page = torch.arange(a).repeat(len(pages))
        blocks = torch.as_tensor(page_blocks[first:last + 1]).repeat_interleave(a)
        rows = blocks * a + slot_in_page
        return (pos - start)[keep], rows[keep]

    def last_rows(self, page_blocks: list[int], k: int) -> torch.Tensor:
        """Buffer rows of the last k anchors of pages `page_blocks`, in position order."""
        a = self.anchors_per_page
        num_pages = min(len(page_blocks), -(-k // a))
        blocks = torch.as_tensor(page_blocks[len(page_blocks) - num_pages:])
        rows = (blocks.unsqueeze(1) * a + torch.arange(a)).reshape(-1)
        return rows[-k:]
