"""Images in chat requests on a real server with the tiny vision checkpoint, driven by the official openai
client: the answer equals the engine run alone on the same image (streamed or not), usage counts the soft
tokens, every bad image is a 400 in OpenAI's error shape, and remote URLs are fetched only from the hosts
named by --allowed-image-domains (a PNG served on loopback by this test)."""

from __future__ import annotations

import base64
import http.server
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from test_server import MODEL, ServerProcess

import dgemma
from dgemma.chat.codec import TextCodec
from dgemma.engine import Engine
from dgemma.images import ImageProcessor, open_image, prompt_with_images
from dgemma.tokenizer import Tokenizer
from tests.conftest import png_bytes, png_claiming, torch_threads

PNG = png_bytes(37, 53)
QUESTION = "what is it?"


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def image_message(*urls: str, text: str = QUESTION, plain: bool = False) -> dict:
    parts = [{"type": "image_url", "image_url": url if plain else {"url": url}} for url in urls]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def client(gemma4_vision_model_dir):
    """The official client of a server that takes at most two images per request."""
    server = ServerProcess(gemma4_vision_model_dir, "--max-batch", "4", "--max-images-per-request", "2")
    client = server.client()
    client.server = server
    yield client
    server.stop_cleanly()


@pytest.fixture(scope="module")
def reference(gemma4_vision_model_dir):
    """The chat request with its images, run alone in this process: -> (text, request, prompt length)."""
    model = dgemma.load_model(gemma4_vision_model_dir)
    tokenizer = Tokenizer.from_folder(gemma4_vision_model_dir)
    processor = ImageProcessor.from_folder(gemma4_vision_model_dir)
    ends = TextCodec(tokenizer, model.config.vocab_size).answer_ends
    eos = tuple(dict.fromkeys([*model.sampling_config.eos_token_ids, *sorted(ends)]))

    def run(images: list[bytes], seed: int, max_tokens: int, text: str = QUESTION):
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}])
        prompt, inputs = prompt_with_images(ids, [open_image(b) for b in images], processor, model.config)
        sampling = model.sampling_config.replace(max_new_tokens=max_tokens, eos_token_ids=eos)
        with torch_threads(1):
            (request,) = Engine(model, max_batch=1, max_length=512).generate([prompt], sampling, seeds=[seed],
                                                                              images=[inputs])
        return tokenizer.decode(request.tokens), request, len(prompt)

    return run


def ask(client, *messages, **kwargs):
    kwargs.setdefault("max_tokens", 32)
    return client.chat.completions.create(model=MODEL, messages=list(messages), **kwargs)


def test_the_model_card_says_images_are_accepted(client):
    card = client.models.retrieve(MODEL).model_extra["dgemma"]["images"]
    assert card == {"accepted": True, "max_per_request": 2, "max_soft_tokens": 70, "max_pixels": 50_000_000,
                    "remote_urls": False}


def test_an_image_chat_equals_the_engine_alone(client, reference):
    out = ask(client, image_message(data_url(PNG)), seed=3)
    text, request, prompt_tokens = reference([PNG], 3, 32)
    assert out.choices[0].message.content == text
    assert out.usage.prompt_tokens == prompt_tokens > 40  # the image's soft tokens are counted
    assert out.usage.completion_tokens == len(request.tokens)
    # the image_url as a plain string, as some clients send it: the same request
    assert ask(client, image_message(data_url(PNG), plain=True), seed=3).choices[0].message.content == text


def test_streamed_image_chat_equals_the_engine_alone(client, reference):
    stream = ask(client, image_message(data_url(PNG), data_url(png_bytes(90, 20, seed=1))), seed=4, stream=True,
                 stream_options={"include_usage": True})
    chunks = list(stream)
    text, _, prompt_tokens = reference([PNG, png_bytes(90, 20, seed=1)], 4, 32)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens == prompt_tokens


def test_requests_with_and_without_images_are_served_together(client, reference):
    """Sent at once, a text chat and two image chats each get what they get alone."""
    jobs = [(image_message(data_url(PNG)), 7), ({"role": "user", "content": "hello"}, 8),
            (image_message(data_url(png_bytes(90, 20, seed=1))), 9)]
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda job: ask(client, job[0], seed=job[1]).choices[0].message.content, jobs))
    assert answers[0] == reference([PNG], 7, 32)[0]
    assert answers[2] == reference([png_bytes(90, 20, seed=1)], 9, 32)[0]
    assert answers[1] == ask(client, {"role": "user", "content": "hello"}, seed=8).choices[0].message.content


BAD = {
    "not an image": ([data_url(b"hello, I am not a picture")], "image 1: not an image"),
    "truncated": ([data_url(png_bytes(64, 64)[:400])], "image 1: cannot decode image"),
    "decompression bomb": ([data_url(png_claiming(100_000, 100_000))], "exceeds the limit of 50,000,000 pixels"),
    "too many pixels": ([data_url(PNG), data_url(png_claiming(10_000, 8_000))],
                        "image 2: image of 10000x8000 pixels exceeds the limit"),
    "too many images": ([data_url(PNG)] * 3, "3 images, and this server takes at most 2 per request"),
    "not base64": (["data:image/png," + "x" * 40], "must be base64-encoded"),
    "bad base64": (["data:image/png;base64,@@@not-base64@@@"], "not valid base64"),
    "remote, by default": (["https://example.com/cat.png"], "this server fetches no remote images"),
    "a file URL": (["file:///etc/passwd"], "must be a data URL"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_images_are_400(client, case):
    urls, message = BAD[case]
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, image_message(*urls))
    assert error.value.status_code == 400
    body = error.value.body
    assert message in body["message"] and body["param"] == "messages" and body["type"] == "invalid_request_error"


@pytest.mark.parametrize("messages,message", [
    ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}}]},
      {"role": "user", "content": "hi"}], "only user messages carry images"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "got 'input_audio'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"detail": "low"}}]}],
     'an image_url part is {"type": "image_url"'),
    ([image_message(data_url(PNG), text="and <|image|> too")], "the prompt has 2 image placeholders for 1 images"),
])
def test_bad_content_parts_are_400(client, messages, message):
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, *messages)
    assert message in error.value.body["message"]


def test_the_server_is_healthy_after_bad_images(client):
    assert client.server.health()["status"] == "ok"
    assert ask(client, image_message(data_url(PNG)), seed=1, max_tokens=16).choices[0].finish_reason


# -- remote images from named hosts ----------------------------------------------------------------------

class PictureHost(http.server.BaseHTTPRequestHandler):
    """/picture.png: the PNG; /elsewhere: a redirect to the same PNG on another host name; else 404."""

    def do_GET(self):
        if self.path == "/picture.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)
        elif self.path == "/elsewhere":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_port}/picture.png")
            self.end_headers()
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def picture_host():
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), PictureHost)
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{host.server_port}"
    host.shutdown()


def test_remote_images_only_from_allowed_hosts(gemma4_vision_model_dir, picture_host, reference):
    server = ServerProcess(gemma4_vision_model_dir, "--allowed-image-domains", "127.0.0.1, example.org")
    try:
        client = server.client()
        out = ask(client, image_message(f"{picture_host}/picture.png"), seed=3)
        assert out.choices[0].message.content == reference([PNG], 3, 32)[0]
        for url, message in [(f"{picture_host}/missing.png", "answered HTTP 404"),
                             (f"{picture_host}/elsewhere", "'localhost' is not among the hosts"),
                             (picture_host.replace("127.0.0.1", "localhost") + "/picture.png",
                              "'localhost' is not among the hosts")]:
            with pytest.raises(openai.BadRequestError) as error:
                ask(client, image_message(url))
            assert message in error.value.body["message"], error.value.body
        assert client.models.retrieve(MODEL).model_extra["dgemma"]["images"]["remote_urls"] is True
    finally:
        server.stop_cleanly()
