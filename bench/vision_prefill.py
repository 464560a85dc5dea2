"""Prefill with images (issue 26): the same engine (`LocalEngine`: the real scheduler and worker in one process)
on prompts holding one image each against text-only prompts of the same length, and the worker's encoder cache on a
repeated-image workload.

1. images vs text: N requests of `head` text tokens + one WxH image (its pad run) + `tail` text tokens, all different
   images, radix cache off, one new token each; against N text-only prompts of the same lengths. Reported: prompt
   tokens per second of each, and their ratio (the tower's share of a prefill).
2. encoder cache: N requests all carrying the same image (different text around it), one after another (a step's
   copies of one image are encoded once anyway), radix cache off so that only the encoder cache can save work; with
   the cache (the default bound) and without it (0 bytes). Reported: prompt
   tokens per second, images encoded and encoder calls of each.

The text model is a `--preset` (default k3-small, random); the tower is the test-size one (`tiny_vision_dict`) unless
`--full-tower` (the preset's own vision_config, when it has one: K2.5's MoonViT size, slow on a CPU).

    python bench/vision_prefill.py [--json] [--requests N] [--image WxH] [--preset NAME] [--full-tower]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script, bench/kernels.py would shadow the kernels package

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from bench.machine_info import cpu_name  # noqa: E402
from radixk3.config import preset  # noqa: E402
from radixk3.model import build_model  # noqa: E402
from radixk3.vision.config import VisionConfig, tiny_vision_dict  # noqa: E402
from radixk3.vision.encoder import VisionEncoder  # noqa: E402
from radixk3.vision.image_processor import ProcessedImage, process_image  # noqa: E402
from radixk3.vision.weights import random_vision_encoder  # noqa: E402
from runtime.local_engine import LocalEngine  # noqa: E402
from runtime.messages import ImageRef  # noqa: E402
from runtime.server_args import ServerArgs  # noqa: E402

PAD = 7  # any id: the image rows replace its embedding
ONE = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}


def random_image(seed: int, w: int, h: int) -> ProcessedImage:
    rng = np.random.default_rng(seed)
    return process_image(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))


def image_request(text: list[int], at: int, image: ProcessedImage) -> tuple[list[int], dict[str, Any]]:
    """`text` with the image's pad run inserted at `at`, and the GenerateReq options that carry the image."""
    ids = text[:at] + [PAD] * image.num_tokens + text[at:]
    ref = ImageRef(image.content_hash, tuple(image.grid), at, image.num_tokens)
    return ids, {"images": [ref], "image_patches": image.patches.reshape(-1)}


def timed_prefill(engine: LocalEngine, requests: list[tuple[list[int], dict[str, Any]]],
                  one_by_one: bool = False) -> float:
    """Seconds to prefill every request: all at once, or `one_by_one` (each after the last has finished)."""
    start = time.perf_counter()
    for ids, options in requests:
        engine.submit(ids, ONE, **options)
        if one_by_one:
            engine.run()
    engine.run()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = preset(args.preset)
    model = build_model(cfg, seed=0)
    if args.full_tower:
        if cfg.vision is None:
            raise SystemExit(f"preset {args.preset} has no vision_config")
        vcfg = VisionConfig.from_spec(cfg.vision, cfg.hidden_size)
    else:
        vcfg = VisionConfig.from_dict(tiny_vision_dict(cfg.hidden_size), cfg.hidden_size)
    encoder: VisionEncoder = random_vision_encoder(vcfg, seed=1).to(cfg.torch_dtype)
    w, h = (int(x) for x in args.image.split("x"))
    g = np.random.default_rng(2)
    n, head, tail = args.requests, args.head, args.tail

    def text(k: int) -> list[int]:
        return [int(x) for x in g.integers(16, cfg.vocab_size, k)]

    def engine(**flags: Any) -> LocalEngine:
        return LocalEngine(ServerArgs(mem_bytes=args.mem_bytes, disable_radix_cache=True, **flags), model,
                           vision=encoder)

    images = [random_image(i, w, h) for i in range(n)]
    with_images = [image_request(text(head + tail), head, im) for im in images]
    text_only = [(text(len(ids)), {}) for ids, _ in with_images]
    prompt_tokens = sum(len(ids) for ids, _ in with_images)
    timed_prefill(engine(), with_images[:1] + text_only[:1])  # warm-up: first-call costs out of the figures
    t_images = timed_prefill(engine(), with_images)
    t_text = timed_prefill(engine(), text_only)

    same = [image_request(text(head + tail), head, images[0]) for _ in range(n)]
    cached, uncached = engine(), engine(image_encoder_cache_bytes=0)
    t_cached, t_uncached = timed_prefill(cached, same, True), timed_prefill(uncached, same, True)
    assert cached.worker.images is not None and uncached.worker.images is not None
    return {
        "machine": {"cpu": cpu_name(), "python": platform.python_version()},
        "preset": args.preset, "tower": "full" if args.full_tower else "tiny", "requests": n,
        "image": args.image, "image_tokens": images[0].num_tokens, "prompt_tokens": prompt_tokens,
        "prefill_tok_s_images": prompt_tokens / t_images, "prefill_tok_s_text": prompt_tokens / t_text,
        "ratio_images_vs_text": t_text / t_images,
        "repeated_tok_s_cache": sum(len(ids) for ids, _ in same) / t_cached,
        "repeated_tok_s_no_cache": sum(len(ids) for ids, _ in same) / t_uncached,
        "repeated_images_encoded_cache": cached.worker.images.images_encoded,
        "repeated_images_encoded_no_cache": uncached.worker.images.images_encoded,
        "repeated_encoder_calls_cache": cached.worker.images.encoder_calls,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="k3-small")
    p.add_argument("--full-tower", action="store_true")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--image", default="448x336", help="WxH of each image")
    p.add_argument("--head", type=int, default=64)
    p.add_argument("--tail", type=int, default=32)
    p.add_argument("--mem-bytes", type=int, default=256 << 20)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = run(args)
    if not args.json:
        print(f"prefill with one {args.image} image ({out['image_tokens']} tokens) per prompt: "
              f"{out['prefill_tok_s_images']:.0f} tok/s; text only, same lengths: {out['prefill_tok_s_text']:.0f} "
              f"tok/s ({out['ratio_images_vs_text']:.2f}x)")
        print(f"the same image in {args.requests} prompts (radix cache off): {out['repeated_tok_s_cache']:.0f} tok/s "
              f"with the encoder cache ({out['repeated_images_encoded_cache']} encoded), "
              f"{out['repeated_tok_s_no_cache']:.0f} tok/s without ({out['repeated_images_encoded_no_cache']} encoded)")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
