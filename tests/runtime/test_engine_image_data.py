"""`Engine.generate(..., image_data=...)` (SGLang's spelling) on a K3 checkpoint with a vision tower (`make-checkpoint
--vision`): through the processes, a text prompt's `<|kimi_image_placeholder|>` becomes the image's media markers
and pads, and the greedy tokens equal the no-cache forward with the tower's rows at the pads; the same image sent
again hits the radix cache past it; a bad image is refused by name. The frontend's `sgl.image` (in-process
`Runtime` over the same engine, and as a file path) gives the same reply."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import frontend_lang as sgl
from radixk3.checkpoint import load_model
from radixk3.forward_batch import EmbeddingOverride
from radixk3.tokenizer import load_tokenizer
from radixk3.vision.image_processor import process_image
from radixk3.vision.weights import load_vision_encoder
from runtime.errors import InvalidRequest
from runtime.tokenizer.engine import Engine
from runtime.tokenizer.image_input import expand_text_images

MAX_NEW = 4
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
PROMPT = "Look: <|kimi_image_placeholder|> and say"


def png(seed: int, w: int, h: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@torch.inference_mode()
def reference(vision_checkpoint: Path, image: Image.Image) -> list[int]:
    model, encoder = load_model(vision_checkpoint), load_vision_encoder(vision_checkpoint)
    im = process_image(image)
    prompt = expand_text_images(PROMPT, [im], load_tokenizer(vision_checkpoint))
    (ref,) = prompt.refs
    rows = encoder.encode(torch.from_numpy(im.patches), [im.grid])
    over = EmbeddingOverride(torch.arange(ref.offset, ref.offset + ref.num_tokens), rows)
    seq, out = list(prompt.ids), []
    for _ in range(MAX_NEW):
        out.append(int(model(torch.tensor(seq), embeds=over)[-1].argmax()))
        seq.append(out[-1])
    return out


@sgl.function
def look(s, image) -> None:  # noqa: ANN001
    s += "Look: " + sgl.image(image) + " and say"
    s += sgl.gen("answer", max_tokens=MAX_NEW)


def test_generate_with_image_data(vision_checkpoint: Path, tmp_path: Path) -> None:
    image = png(0, 90, 60)
    image.save(tmp_path / "look.png")
    want = reference(vision_checkpoint, image)
    with Engine(str(vision_checkpoint), mem_bytes=8 << 20, page_size=1) as engine:
        first = engine.generate(PROMPT, GREEDY, image_data=data_url(image))
        assert first["output_ids"] == want
        again = engine.generate(PROMPT, GREEDY, image_data=[image])  # a PIL image, the same pixels
        assert again["output_ids"] == want
        assert again["meta_info"]["cached_tokens"] > first["meta_info"]["prompt_tokens"] - 4
        batch = engine.generate([PROMPT, "no image here"], GREEDY, image_data=[data_url(image), None])
        assert batch[0]["output_ids"] == want
        with pytest.raises(InvalidRequest, match=r"image_data\[0\]: not valid base64") as bad:
            engine.generate(PROMPT, GREEDY, image_data="%%%")
        assert bad.value.param == "image_data[0]"
        with pytest.raises(InvalidRequest, match="1 image placeholder"):
            engine.generate(PROMPT, GREEDY, image_data=[image, image])
        runtime = sgl.Runtime(engine=engine)
        for source in (image, str(tmp_path / "look.png")):
            state = look.run(image=source, temperature=0, ignore_eos=True, backend=runtime)
            assert state["answer"] == first["text"]
