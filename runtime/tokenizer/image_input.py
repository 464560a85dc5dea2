"""A request's images on the tokenizer side: each input (a data: URL, base64, raw bytes, a Pillow image, or an
http(s) URL when the server allows them) decoded with Pillow within the server's limits and processed for the
vision tower (`ProcessedImage`); the prompt's `<|kimi_image_placeholder|>` ids expanded as K3's encoding does,
with each image's pad run located (`ImageRef`) for the scheduler (radix keys) and the worker (embeddings).

Every refusal is an InvalidRequest naming the input (`image_data[i]`, or the caller's own name for it).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from radixk3.tokenizer_base import Encoder
from radixk3.vision.image_processor import ProcessedImage, process_image
from radixk3.vision.prompt import IMAGE_PLACEHOLDER, MEDIA_PAD, image_prompt
from runtime.errors import InvalidRequest
from runtime.messages import ImageRef
from runtime.server_args import ServerArgs

FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP"})  # what Pillow decodes that a chat client sends
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w-]+=[\w.-]+)*)(?P<b64>;base64)?,",
                       re.ASCII)


@dataclass(frozen=True)
class ImageLimits:
    max_images: int
    max_bytes: int
    max_pixels: int
    allow_urls: bool
    url_timeout: float

    @classmethod
    def of(cls, args: ServerArgs) -> ImageLimits:
        return cls(args.max_images_per_request, args.max_image_bytes, args.max_image_pixels, args.allow_image_urls,
                   args.image_url_timeout)


@dataclass(frozen=True)
class PromptImages:
    """A prompt's ids with its images expanded, each image's pad run, and their patches (flattened float32)."""

    ids: list[int]
    refs: list[ImageRef]
    patches: np.ndarray


def fetch_url(url: str, limits: ImageLimits, name: str) -> bytes:
    import httpx

    try:
        with httpx.stream("GET", url, timeout=limits.url_timeout, follow_redirects=True) as resp:
            if resp.status_code != 200:
                raise InvalidRequest(f"{name}: fetching the image URL gave HTTP {resp.status_code}", param=name)
            out = bytearray()
            for chunk in resp.iter_bytes():
                out += chunk
                if len(out) > limits.max_bytes:
                    raise InvalidRequest(f"{name}: the image is larger than {limits.max_bytes} bytes", param=name)
            return bytes(out)
    except httpx.HTTPError as e:
        raise InvalidRequest(f"{name}: the image URL could not be fetched ({type(e).__name__})", param=name) from None


def image_bytes(item: str | bytes, limits: ImageLimits, name: str) -> bytes:
    """The encoded image an input names: a data: URL's or a base64 string's bytes, raw bytes, or a fetched URL."""
    if isinstance(item, bytes | bytearray):
        data = bytes(item)
    elif isinstance(item, str):
        text = item.strip()
        if text.startswith(("http://", "https://")):
            if not limits.allow_urls:
                raise InvalidRequest(f"{name}: image URLs are not fetched by this server (start it with "
                                     "--allow-image-urls); send the image as a data: URL", param=name)
            data = fetch_url(text, limits, name)
        else:
            if text.startswith("data:"):
                m = _DATA_URL.match(text)
                if m is None or not m.group("b64"):
                    raise InvalidRequest(f"{name}: a data: URL must be base64 (data:image/png;base64,...)",
                                         param=name)
                if m.group("mime") and not m.group("mime").startswith("image/"):
                    raise InvalidRequest(f"{name}: {m.group('mime')} is not an image type", param=name)
                text = text[m.end():]
            if len(text) > limits.max_bytes * 4 // 3 + 4:
                raise InvalidRequest(f"{name}: the image is larger than {limits.max_bytes} bytes", param=name)
            try:
                data = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidRequest(f"{name}: not valid base64 (nor a data: or http(s) URL)", param=name) from None
    else:
        raise InvalidRequest(f"{name}: an image is a data: URL, base64 string, bytes or a PIL image, not "
                             f"{type(item).__name__}", param=name)
    if not data:
        raise InvalidRequest(f"{name}: the image is empty", param=name)
    if len(data) > limits.max_bytes:
        raise InvalidRequest(f"{name}: the image is larger than {limits.max_bytes} bytes", param=name)
    return data


def open_image(data: bytes, limits: ImageLimits, name: str) -> Image.Image:
    """Pillow's decoding of `data`, its size checked from the header before any pixel is decoded."""
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        raise InvalidRequest(f"{name}: not an image Pillow can read", param=name) from None
    if image.format not in FORMATS:
        raise InvalidRequest(f"{name}: unsupported image format {image.format} (one of "
                             f"{', '.join(sorted(FORMATS))})", param=name)
    return checked(image, limits, name, decode=True)


def checked(image: Image.Image, limits: ImageLimits, name: str, decode: bool = False) -> Image.Image:
    width, height = image.size
    if width < 1 or height < 1:
        raise InvalidRequest(f"{name}: the image is {width}x{height}", param=name)
    if width * height > limits.max_pixels:
        raise InvalidRequest(f"{name}: the image is {width}x{height}, more than {limits.max_pixels} pixels",
                             param=name)
    if decode:
        try:
            image.load()
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
            raise InvalidRequest(f"{name}: the image data is corrupt or truncated", param=name) from None
    return image


def load_image(item: Any, limits: ImageLimits, name: str) -> ProcessedImage:
    if isinstance(item, ProcessedImage):  # processed by the caller (the frontend's in-process backend)
        return item
    image = item if isinstance(item, Image.Image) else open_image(image_bytes(item, limits, name), limits, name)
    if isinstance(item, Image.Image):
        checked(image, limits, name)
    try:
        return process_image(image)
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"{name}: the image could not be processed ({e})", param=name) from None


def load_images(items: Sequence[Any], limits: ImageLimits, names: Sequence[str] | None = None
                ) -> list[ProcessedImage]:
    """Decode and process every image (blocking: a route runs it in a thread); `names[i]` names input i in errors
    (default `image_data[i]`)."""
    names = list(names) if names is not None else [f"image_data[{i}]" for i in range(len(items))]
    if len(items) > limits.max_images:
        raise InvalidRequest(f"{len(items)} images, more than the {limits.max_images} a request may carry",
                             param=names[limits.max_images] if limits.max_images < len(names) else None)
    return [load_image(item, limits, n) for item, n in zip(items, names, strict=True)]


def marker_id(encoder: Encoder, marker: str) -> int | None:
    ids = encoder.encode(marker)
    return ids[0] if len(ids) == 1 else None


def _patches(images: Sequence[ProcessedImage]) -> np.ndarray:
    if not images:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate([im.patches.reshape(-1) for im in images])


def _image_ids(im: ProcessedImage, encoder: Encoder) -> list[int]:
    return image_prompt(im.slot).ids(encoder, add_bos=False)


def _pad_id(encoder: Encoder, param: str) -> int:
    pad = marker_id(encoder, MEDIA_PAD)
    if pad is None:
        raise InvalidRequest(f"this model's tokenizer has no {MEDIA_PAD} token: it cannot take images", param=param)
    return pad


def _count_error(found: int, images: Sequence[ProcessedImage], param: str) -> InvalidRequest:
    return InvalidRequest(f"the prompt has {found} image placeholder(s) ({IMAGE_PLACEHOLDER}) for {len(images)} "
                          "image(s)", param=param)


def expand_text_images(text: str, images: Sequence[ProcessedImage], encoder: Encoder, add_bos: bool = True,
                       param: str = "image_data") -> PromptImages:
    """A raw text prompt's ids with its i-th `<|kimi_image_placeholder|>` replaced by image i's media markers and
    pad ids, as K3's encoding expands it (the text between placeholders encoded as a raw prompt is)."""
    pad = _pad_id(encoder, param)
    pieces = text.split(IMAGE_PLACEHOLDER)
    if len(pieces) - 1 != len(images):
        raise _count_error(len(pieces) - 1, images, param)
    ids = encoder.encode(pieces[0], add_bos=add_bos)
    refs: list[ImageRef] = []
    for im, piece in zip(images, pieces[1:], strict=True):
        part = _image_ids(im, encoder)
        refs.append(ImageRef(im.content_hash, tuple(im.grid), len(ids) + part.index(pad), im.num_tokens))
        ids += part + encoder.encode(piece)
    return PromptImages(ids, refs, _patches(images))


def locate_images(ids: Sequence[int], images: Sequence[ProcessedImage], encoder: Encoder,
                  param: str = "image_data") -> PromptImages:
    """Token ids with their images: the i-th `<|kimi_image_placeholder|>` id (a tokenizer that has one) expanded
    as K3's encoding does; without placeholders, ids already expanded (a rendered chat), whose i-th pad run must be
    image i's length."""
    pad = _pad_id(encoder, param)
    placeholder = marker_id(encoder, IMAGE_PLACEHOLDER)
    out: list[int] = []
    refs: list[ImageRef] = []
    if placeholder is not None and placeholder in ids:
        found = sum(1 for t in ids if t == placeholder)
        if found != len(images):
            raise _count_error(found, images, param)
        it = iter(images)
        for t in ids:
            if t != placeholder:
                out.append(t)
                continue
            im = next(it)
            part = _image_ids(im, encoder)
            refs.append(ImageRef(im.content_hash, tuple(im.grid), len(out) + part.index(pad), im.num_tokens))
            out.extend(part)
        return PromptImages(out, refs, _patches(images))
    runs: list[tuple[int, int]] = []  # (start, length) of each pad run
    for i, t in enumerate(ids):
        if t != pad:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    if len(runs) != len(images):
        raise _count_error(len(runs), images, param)
    for (start, n), im in zip(runs, images, strict=True):
        if n != im.num_tokens:
            raise InvalidRequest(f"the prompt's image at {start} has {n} {MEDIA_PAD} ids, the image {im.num_tokens}",
                                 param=param)
        refs.append(ImageRef(im.content_hash, tuple(im.grid), start, n))
    return PromptImages(list(ids), refs, _patches(images))
