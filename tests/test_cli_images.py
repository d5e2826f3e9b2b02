"""`dgemma generate --image` and `dgemma chat`'s `/image` on the tiny vision checkpoint, and every bad image
as one line on stderr with exit code 2."""

from __future__ import annotations

import json

import pytest
import torch

import dgemma
import dgemma.cli
from dgemma.chat.codec import encode_prompt
from dgemma.engine import Engine
from dgemma.images import ImageProcessor, open_image, prompt_with_images
from dgemma.tokenizer import Tokenizer
from tests.conftest import png_bytes, png_claiming
from tests.test_cli_generate import dgemma as run_dgemma


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    path = tmp_path_factory.mktemp("pictures") / "picture.png"
    path.write_bytes(png_bytes(37, 53))
    return path


def test_placeholders_in_the_prompt(gemma4_vision_model_dir):
    """Without --chat, images go where the text writes <|image|>, or all in front; with --chat, the image
    parts open the user turn and the template writes the placeholders."""
    tok = Tokenizer.from_folder(gemma4_vision_model_dir)
    image = tok.token_to_id("<|image|>")
    text = tok.encode("what is it?", add_special_tokens=False)
    assert encode_prompt(tok, "what is it?", False, 2, "<|image|>") == [2, image, image, *text]
    assert encode_prompt(tok, "a <|image|> b", False, 1, "<|image|>") == tok.encode("a <|image|> b")
    chat = encode_prompt(tok, "what is it?", True, 1, "<|image|>")
    assert chat.count(image) == 1 and chat.index(image) < len(chat) - len(text)
    assert tok.decode(chat, skip_special_tokens=False).startswith("<bos><|turn>user\n<|image|>what is it?<turn|>")


def test_generate_with_an_image_equals_the_engine(gemma4_vision_model_dir, picture):
    proc = run_dgemma("generate", "--model", str(gemma4_vision_model_dir), "--chat", "--image", str(picture),
                      "--prompt", "what is it?", "--max-new-tokens", "32", "--seed", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)

    model = dgemma.load_model(gemma4_vision_model_dir)
    tok = Tokenizer.from_folder(gemma4_vision_model_dir)
    ids = encode_prompt(tok, "what is it?", True, 1, "<|image|>")
    prompt, inputs = prompt_with_images(ids, [open_image(picture)], ImageProcessor.from_folder(gemma4_vision_model_dir),
                                        model.config)
    # the placeholder became <|image>, one <|image|> per soft token, <image|>
    assert out["prompt_tokens"] == len(prompt) == len(ids) - 1 + inputs.num_soft_tokens[0] + 2
    sampling = model.sampling_config.replace(max_new_tokens=32)
    with torch.no_grad():
        (request,) = Engine(model, max_batch=1, max_length=256).generate([prompt], sampling, seeds=[5], images=[inputs])
    assert out["tokens"] == request.tokens


def test_chat_attaches_images_to_the_next_message(gemma4_vision_model_dir, picture):
    proc = run_dgemma("chat", "--model", str(gemma4_vision_model_dir), "--max-new-tokens", "16", "--steps", "2",
                      stdin=f"/image {picture}\nwhat is it?\n/image {picture}\nand this one?\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("attached to the next message") == 2 and "image 2 attached" in proc.stderr
    assert proc.stdout.count("\n") == 2  # one answer per message


@pytest.mark.parametrize("kind,message", [
    ("text", "not an image"),
    ("truncated", "cannot decode image"),
    ("bomb", "exceeds the limit of 50,000,000 pixels"),
    ("missing", "no such image file"),
    ("text-only model", "no vision tower"),
])
def test_bad_images_are_one_line_and_exit_2(gemma4_vision_model_dir, tiny_model_dir, tmp_path, capsys, kind, message):
    path, model = tmp_path / "image.png", gemma4_vision_model_dir
    if kind == "text":
        path.write_text("hello, I am not a picture")
    elif kind == "truncated":
        path.write_bytes(png_bytes(64, 64)[:400])
    elif kind == "bomb":
        path.write_bytes(png_claiming(100_000, 100_000))
    elif kind == "text-only model":
        path.write_bytes(png_bytes())
        model = tiny_model_dir
    code = dgemma.cli.main(["generate", "--model", str(model), "--prompt", "hi", "--image", str(path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1


def test_chat_with_a_bad_image_in_a_script_exits_2(gemma4_vision_model_dir, tmp_path):
    proc = run_dgemma("chat", "--model", str(gemma4_vision_model_dir), "--steps", "2",
                      stdin=f"/image {tmp_path / 'missing.png'}\nhello\n")
    assert proc.returncode == 2 and "no such image file" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
