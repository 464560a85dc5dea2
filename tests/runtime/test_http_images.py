"""Images over HTTP on a K3 checkpoint with a vision tower (`make-checkpoint --vision`): an OpenAI chat `image_url`
part (a base64 data: URL) through the `openai` client, native `/generate` `image_data`, and malformed images each a
400 naming the part while a good batch-mate (sent at the same time) succeeds and the server keeps serving."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
from PIL import Image

import frontend_lang as sgl
from radixk3.cli import main
from tests.runtime.http_server_proc import Server, running_server

GREEDY = {"max_tokens": 3, "temperature": 0}


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def picture(seed: int, w: int = 60, h: int = 40) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


GOOD = data_url(encoded(picture(0)))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    ck = tmp_path_factory.mktemp("k3_vision_http") / "ck"
    assert main(["make-checkpoint", "--preset", "k3-tiny-native", "--tokenizer", "tiktoken", "--vision",
                 "--seed", "5", str(ck)]) == 0
    with running_server("--model", str(ck), "--mem-bytes", str(16 << 20), "--max-images-per-request", "2",
                        "--max-image-pixels", str(1 << 20)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def chat(client: openai.OpenAI, *urls: str) -> object:
    parts = [{"type": "text", "text": "What is this?"}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return client.chat.completions.create(model="default", messages=[{"role": "user", "content": parts}], **GREEDY)


def test_chat_with_a_base64_image(server: Server, client: openai.OpenAI) -> None:
    first = chat(client, GOOD)
    again = chat(client, GOOD)
    assert first.choices[0].message.content == again.choices[0].message.content
    # The prompt holds the image's 6 pads (60x40 -> a 4 x 6 patch grid, merged 2 x 2) and its markers.
    assert first.usage.prompt_tokens > 12
    assert again.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2


@sgl.function
def see(s) -> None:  # noqa: ANN001
    s += "See " + sgl.image(GOOD) + " here"
    s += sgl.gen("out", max_tokens=3)


def test_generate_with_image_data(server: Server) -> None:
    with server.client() as c:
        r = c.post("/generate", json={"text": "See <|kimi_image_placeholder|> here", "image_data": GOOD,
                                      "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 3
        # The frontend's sgl.image over HTTP sends the same request.
        state = see.run(temperature=0, ignore_eos=True, backend=sgl.RuntimeEndpoint(server.url))
        assert state["out"] == r.json()["text"]
        r = c.post("/generate", json={"text": ["<|kimi_image_placeholder|> a", "b"], "image_data": [GOOD, None],
                                      "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        assert r.status_code == 200, r.text
        r = c.post("/generate", json={"text": "no placeholder", "image_data": GOOD})
        assert r.status_code == 400 and "placeholder" in r.json()["error"]["message"]


BAD = {
    "bad base64": "data:image/png;base64,%%%not-base64%%%",
    "not an image": data_url(b"plain text, not pixels"),
    "not an image type": data_url(encoded(picture(1)), "text/plain"),
    "zero-size": data_url(b""),
    "truncated": data_url(encoded(picture(2))[:60]),
    "huge dimensions": data_url(encoded(Image.new("RGB", (2048, 1024)))),
    "URL without the flag": "https://example.com/cat.png",
    "unsupported format": data_url(encoded(picture(3), "TIFF"), "image/tiff"),
    "not a URL": "ftp://example.com/cat.png",
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_image_is_a_400_naming_the_part(client: openai.OpenAI, name: str) -> None:
    with ThreadPoolExecutor(2) as pool:  # a good request alongside: it succeeds
        good = pool.submit(chat, client, GOOD)
        with pytest.raises(openai.BadRequestError) as bad:
            chat(client, BAD[name])
        assert good.result().choices[0].finish_reason == "length"
    assert bad.value.body["param"] == "messages[0].content[1]", bad.value.body


def test_too_many_images(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, GOOD, GOOD, GOOD)
    assert "more than the 2" in bad.value.body["message"]
    assert bad.value.body["param"] == "messages[0].content[3]"
