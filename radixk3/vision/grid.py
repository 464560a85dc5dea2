"""An image's patch grid, a leaf without torch: the tokenizer process computes it, the tower consumes it."""

from __future__ import annotations

from typing import NamedTuple


class ImageGrid(NamedTuple):
    """An image's patch grid: frames, rows, columns (an image has one frame)."""

    t: int
    h: int
    w: int

    @property
    def num_patches(self) -> int:
        return self.t * self.h * self.w

    def num_tokens(self, merge_kernel: tuple[int, int]) -> int:
        """Merged tokens (one `<|media_pad|>` each): the frames pooled, each kernel of patches one token."""
        return (self.h // merge_kernel[0]) * (self.w // merge_kernel[1])
