"""Images through the scheduler and worker (LocalEngine): greedy outputs equal the no-cache forward given the same
image embeddings at the pad positions, token for token (radix cache on and off, page sizes 1 and 16, chunked
prefill that splits an image's pad run, overlap off); the radix cache keys pad runs by the image's content hash
(the same image hits past it, another image of the same size shares nothing after its first pad); the worker's
encoder cache encodes a repeated image once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from radixk3.config import preset
from radixk3.forward_batch import EmbeddingOverride
from radixk3.model import build_model
from radixk3.vision.config import VisionConfig, tiny_vision_dict
from radixk3.vision.image_processor import ProcessedImage, process_image
from radixk3.vision.weights import random_vision_encoder
from runtime.local_engine import LocalEngine
from runtime.messages import ImageRef
from runtime.server_args import ServerArgs
from runtime.worker.image_embedder import EncoderCache

MAX_NEW = 5
LONG_NEW = 12  # the retraction run's outputs
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
PAD = 7  # the pad id: the engine never reads it (the image rows replace its embedding)


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return build_model(preset("k3-tiny"), seed=11)


@pytest.fixture(scope="module")
def encoder(model):  # noqa: ANN001, ANN201
    h = model.config.hidden_size
    return random_vision_encoder(VisionConfig.from_dict(tiny_vision_dict(h), h), seed=3)


def _image(seed: int, w: int, h: int) -> ProcessedImage:
    rng = np.random.default_rng(seed)
    return process_image(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))


@pytest.fixture(scope="module")
def images() -> list[ProcessedImage]:
    # 12, 10 and 12 tokens; the first and last have the same size and different pixels
    return [_image(0, 112, 84), _image(1, 56, 140), _image(2, 112, 84)]


class Prompt:
    """Token ids with image pad runs, as the tokenizer side sends them."""

    def __init__(self, parts: list[list[int] | ProcessedImage]) -> None:
        self.ids: list[int] = []
        self.refs: list[ImageRef] = []
        self.images: list[ProcessedImage] = []
        for p in parts:
            if isinstance(p, ProcessedImage):
                self.refs.append(ImageRef(p.content_hash, tuple(p.grid), len(self.ids), p.num_tokens))
                self.images.append(p)
                self.ids.extend([PAD] * p.num_tokens)
            else:
                self.ids.extend(p)

    def options(self) -> dict:
        patches = np.concatenate([im.patches.reshape(-1) for im in self.images])
        return {"images": self.refs, "image_patches": patches}


@torch.inference_mode()
def reference(model, encoder, prompts: list[Prompt], images: bool = True,  # noqa: ANN001
              max_new: int = MAX_NEW) -> list[list[int]]:
    """The plain no-cache greedy loop, the prompts packed side by side, with each image's rows (encoded alone) at
    its pad positions (`images` False: the pad ids' own embeddings)."""
    seqs = [list(p.ids) for p in prompts]
    rows = torch.cat([encoder.encode(torch.from_numpy(im.patches), [im.grid]) for p in prompts for im in p.images])
    for _ in range(max_new):
        cu = np.cumsum([0] + [len(s) for s in seqs])
        over = None
        if images:
            pos = torch.cat([torch.arange(c + r.offset, c + r.offset + r.num_tokens)
                             for p, c in zip(prompts, cu, strict=False) for r in p.refs])
            over = EmbeddingOverride(pos, rows)
        logits = model(torch.tensor([t for s in seqs for t in s]), torch.from_numpy(cu), embeds=over)
        for s, end in zip(seqs, cu[1:], strict=True):
            s.append(int(logits[end - 1].argmax()))
    return [s[len(p.ids):] for s, p in zip(seqs, prompts, strict=True)]


def _text(seed: int, n: int, vocab: int) -> list[int]:
    g = np.random.default_rng(seed)
    return [int(x) for x in g.integers(10, vocab, n)]


@pytest.fixture(scope="module")
def prompts(model, images) -> list[Prompt]:  # noqa: ANN001
    v = model.config.vocab_size
    a, b, c = images
    head = _text(1, 9, v)
    return [
        Prompt([head, a, _text(2, 6, v)]),
        Prompt([head, a, _text(3, 4, v), b, _text(4, 5, v)]),
        Prompt([head, c, _text(2, 6, v)]),  # same size as a, other pixels
        Prompt([_text(5, 3, v), b, c, _text(6, 2, v)]),  # two runs back to back
    ]


@pytest.fixture(scope="module")
def long_refs(model, encoder, prompts) -> list[list[int]]:  # noqa: ANN001
    return reference(model, encoder, prompts, max_new=LONG_NEW)


@pytest.fixture(scope="module")
def refs(long_refs) -> list[list[int]]:  # noqa: ANN001
    return [r[:MAX_NEW] for r in long_refs]  # greedy: the longer run's first tokens


def _run(model, encoder, prompts: list[Prompt], **args) -> tuple[list[list[int]], list[int], LocalEngine]:  # noqa: ANN001
    eng = LocalEngine(ServerArgs(mem_bytes=16 << 20, **args), model, check=True, vision=encoder)
    rids = [eng.submit(p.ids, GREEDY, **p.options()) for p in prompts]
    outs = eng.run()
    tokens = [[t for o in outs[r] for t in o.token_ids] for r in rids]
    cached = [outs[r][-1].cached_tokens for r in rids]
    return tokens, cached, eng


def test_images_change_the_reference(model, encoder, prompts, refs) -> None:  # noqa: ANN001
    """The test can fail: the pad tokens' own embeddings give other tokens than the image rows; and the packed
    reference is the one-prompt loop's."""
    assert reference(model, encoder, prompts, images=False) != refs
    assert reference(model, encoder, prompts[1:2]) == refs[1:2]


@pytest.mark.parametrize("args", [
    dict(page_size=1, chunked_prefill_size=8, max_prefill_tokens=64),  # chunks split image runs
    dict(page_size=16, chunked_prefill_size=16, disable_overlap_schedule=True),
    dict(page_size=16, disable_radix_cache=True, chunked_prefill_size=16),
], ids=["p1-chunk8", "p16-chunk16-nooverlap", "p16-noradix"])
def test_greedy_with_images_equals_no_cache(model, encoder, prompts, refs, args) -> None:  # noqa: ANN001
    got, _, eng = _run(model, encoder, prompts, **args)
    assert got == refs
    # One batched encoder call per step that first reaches new images, each image encoded once.
    assert eng.worker.images.images_encoded == 3


@pytest.mark.parametrize("page_size", [1, 16])
def test_same_image_hits_past_it_and_another_misses(model, encoder, prompts, refs, page_size) -> None:  # noqa: ANN001
    """Sequentially (each request after the last): the repeat of prompt 0 hits its image (page size 1: past it; 16:
    up to the page inside its pad run, where the prefill restarts mid-image on a slice of its rows); prompt 2 (another
    image of the same size, the same text around it: the same ids) hits nothing past its first pad."""
    assert prompts[2].ids == prompts[0].ids
    eng = LocalEngine(ServerArgs(mem_bytes=16 << 20, page_size=page_size), model, check=True, vision=encoder)
    cached = {}
    for name, p in (("first", prompts[0]), ("again", prompts[0]), ("other", prompts[2])):
        rid = eng.submit(p.ids, GREEDY, **p.options())
        outs = eng.run()[rid]
        assert [t for o in outs for t in o.token_ids] == (refs[2] if name == "other" else refs[0])
        cached[name] = outs[-1].cached_tokens
    first_pad = prompts[0].refs[0].offset
    end = first_pad + prompts[0].refs[0].num_tokens
    assert cached["first"] == 0
    if page_size == 1:
        assert cached["again"] > end
    else:
        assert first_pad < cached["again"] == 16 < end
    assert cached["other"] <= first_pad
    assert eng.worker.images.images_encoded == 2  # the repeat came from the encoder cache
    assert eng.worker.images.encoder_calls == 2


def test_retraction_with_images(model, encoder, prompts, long_refs) -> None:  # noqa: ANN001
    """A pool small enough that decoding outgrows it (no decode reserve, unmixed steps): retracted requests prefill
    their images again and still give the no-cache tokens."""
    eng = LocalEngine(ServerArgs(mem_bytes=80_000, chunked_prefill_size=48, decode_checkpoint_interval=3,
                                 schedule_conservativeness=0.0, enable_mixed_chunk=False, max_running_requests=12),
                      model, check=True, vision=encoder)
    rids = [eng.submit(p.ids, GREEDY | {"max_new_tokens": LONG_NEW}, **p.options()) for p in prompts * 3]
    outs = eng.run()
    assert [[t for o in outs[r] for t in o.token_ids] for r in rids] == long_refs * 3
    assert eng.scheduler.metrics.retractions > 0


def test_encoder_cache_is_bounded_and_keeps_held_entries() -> None:
    rows = torch.zeros(4, 8)  # 128 bytes each
    cache = EncoderCache(max_bytes=300)
    cache.put("a", rows)
    cache.hold(3, "a")  # a prefill is in the middle of image a
    cache.put("b", rows.clone())
    cache.put("c", rows.clone())  # over the bound: b (the least recent not held) goes, a stays
    assert cache.get("a") is not None and cache.get("b") is None and cache.get("c") is not None
    assert cache.bytes == 256
    cache.put("d", rows.clone())  # c is the least recent not held
    assert cache.get("c") is None and len(cache) == 2
    cache.release(3)  # the row is reset: a may go now
    cache.put("e", rows.clone())
    assert cache.get("a") is None and cache.get("d") is not None and cache.get("e") is not None
