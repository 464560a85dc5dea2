"""The worker's images: a step's images encoded by the vision tower in one batch, their rows placed at their pad
tokens (`EmbeddingOverride`), and the encoder outputs kept by content hash (`EncoderCache`).

A chunked prefill may split an image's pad run over several steps: its encoder output is held for the request's
table row until the slice that ends the run, or until the row is reset (the request went away), so it is never
encoded twice for one prefill, whatever the cache's bound. The plan carries every image's patches whenever its run
meets the step (the scheduler does not know what this cache holds), so a miss can always be encoded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np
import torch

from radixk3.forward_batch import EmbeddingOverride
from radixk3.vision.encoder import VisionEncoder
from runtime.messages import PlanImage, StepPlan


class EncoderCache:
    """Encoder outputs by content hash, least recently used out past `max_bytes`; an entry held by a table row
    (an image a prefill is in the middle of) is never evicted."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._held: dict[int, set[str]] = {}  # table row -> the hashes it holds

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def get(self, key: str) -> torch.Tensor | None:
        got = self._entries.get(key)
        if got is not None:
            self._entries.move_to_end(key)
        return got

    def put(self, key: str, rows: torch.Tensor) -> None:
        if key in self._entries:
            return
        self._entries[key] = rows
        self._bytes += rows.numel() * rows.element_size()
        self._evict()

    def hold(self, row: int, key: str) -> None:
        self._held.setdefault(row, set()).add(key)

    def release(self, row: int, key: str | None = None) -> None:
        """The row's hold on `key` (every hold of the row when None) ends."""
        keys = self._held.get(row)
        if keys is None:
            return
        if key is None:
            keys.clear()
        else:
            keys.discard(key)
        if not keys:
            del self._held[row]
        self._evict()

    def _evict(self) -> None:
        if self._bytes <= self.max_bytes:
            return
        held = set().union(*self._held.values()) if self._held else set()
        for key in [k for k in self._entries if k not in held]:
            if self._bytes <= self.max_bytes:
                return
            rows = self._entries.pop(key)
            self._bytes -= rows.numel() * rows.element_size()


class ImageEmbedder:
    def __init__(self, encoder: VisionEncoder, cache_bytes: int) -> None:
        self.encoder = encoder
        self.cache = EncoderCache(cache_bytes)
        self.encoder_calls = 0  # batched encoder runs
        self.images_encoded = 0
        weight = next(encoder.parameters())
        self._device, self._dtype = weight.device, weight.dtype

    def reset_rows(self, rows: Iterable[int]) -> None:
        """Table rows (re)assigned to a request: whatever they held is free."""
        for r in rows:
            self.cache.release(r)

    def override(self, plan: StepPlan) -> EmbeddingOverride:
        """The plan's image rows at their packed positions, encoding (in one batch) the images the cache lacks."""
        p = self.encoder.cfg.patch_size
        patches = torch.from_numpy(np.array(plan.image_patches, dtype=np.float32)).view(-1, 3, p, p)  # writable
        per_image = patches.split([im.num_patches for im in plan.images])
        rows_of = self._encode_missing(plan.images, per_image)
        positions, rows = [], []
        for im in plan.images:
            emb = rows_of[im.content_hash]
            positions.append(torch.arange(im.dst, im.dst + im.hi - im.lo))
            rows.append(emb[im.lo : im.hi])
            table_row = int(plan.rows[im.seq])
            if im.hi < im.num_tokens:
                self.cache.hold(table_row, im.content_hash)  # the next chunk takes the rest of the run
            else:
                self.cache.release(table_row, im.content_hash)
        return EmbeddingOverride(torch.cat(positions).to(self._device), torch.cat(rows))

    def _encode_missing(self, images: list[PlanImage], patches: tuple[torch.Tensor, ...]
                        ) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        todo: dict[str, tuple[PlanImage, torch.Tensor]] = {}
        for im, pt in zip(images, patches, strict=True):
            got = self.cache.get(im.content_hash)
            if got is not None:
                found[im.content_hash] = got
            elif im.content_hash not in todo:
                todo[im.content_hash] = (im, pt)
        if todo:
            grids = [im.grid for im, _ in todo.values()]
            batch = torch.cat([pt for _, pt in todo.values()]).to(self._device, self._dtype)
            with torch.inference_mode():
                out = self.encoder.split(self.encoder.encode(batch, grids), grids)
            self.encoder_calls += 1
            self.images_encoded += len(todo)
            for key, rows in zip(todo, out, strict=True):
                rows = rows.clone()  # its own storage: the cache must not pin the whole batch's output
                found[key] = rows
                self.cache.put(key, rows)
        return found
