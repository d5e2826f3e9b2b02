"""dgemma.tokenizer on a tiny byte-level BPE trained in the test and a small Gemma-style chat template."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from dgemma.tokenizer import Tokenizer, TokenizerError

SPECIALS = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>"]  # ids 0..4, as trained below

GEMMA_STYLE_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<|turn>{{ role }}\n{{ message['content'] | trim }}<turn|>\n"
    "{% endfor %}"
    "{% if tools %}<|tools>{{ tools | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def train_backend() -> BackendTokenizer:
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["hello world", "the model writes text", "why is the sky blue?", "diffusion denoises a canvas"] * 20
    tok.train_from_iterator(corpus, trainer)
    # like Gemma's tokenizer.json: plain encoding prepends <bos>
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return tok


@pytest.fixture
def folder(tmp_path):
    train_backend().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(GEMMA_STYLE_TEMPLATE)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": {"content": "<eos>", "special": True}, "pad_token": "<pad>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4], "pad_token_id": 0}))
    return tmp_path


def test_text_round_trips_and_bos_comes_from_the_post_processor(folder):
    tok = Tokenizer.from_folder(folder)
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2, 3, 4]
    text = "why is the sky blue?\nHello, wörld! 123"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 2 and ids.count(2) == 1
    assert tok.decode(ids) == text  # byte-level: exact, even for unseen characters
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids, skip_special_tokens=False).startswith("<bos>")


def test_chat_renders_like_gemma_with_a_single_bos(folder):
    tok = Tokenizer.from_folder(folder)
    chat = [{"role": "user", "content": "why is the sky blue? "}, {"role": "assistant", "content": "hello world"},
            {"role": "user", "content": "the model"}]
    expected = ("<bos><|turn>user\nwhy is the sky blue?<turn|>\n<|turn>model\nhello world<turn|>\n"
                "<|turn>user\nthe model<turn|>\n")
    assert tok.render_chat(chat, add_generation_prompt=False) == expected
    assert tok.render_chat(chat) == expected + "<|turn>model\n"
    ids = tok.apply_chat_template(chat)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id  # not doubled by the post-processor
    assert ids.count(tok.token_to_id("<|turn>")) == 4  # special tokens in the text map to their ids
    assert tok.decode(ids, skip_special_tokens=False) == expected + "<|turn>model\n"


def test_template_helpers_and_variables(folder):
    tok = Tokenizer.from_folder(folder)
    with pytest.raises(TokenizerError, match="unknown role: robot"):
        tok.render_chat([{"role": "robot", "content": "hi"}])
    tools = [{"name": "lookup", "description": "<find> & 'fetch'"}]
    rendered = tok.render_chat([{"role": "user", "content": "hi"}], tools=tools)
    assert '<|tools>[{"name": "lookup", "description": "<find> & \'fetch\'"}]\n' in rendered  # no HTML escaping


def test_templates_are_sandboxed(folder):
    (folder / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(TokenizerError):
        Tokenizer.from_folder(folder).render_chat([{"role": "user", "content": "x"}])


def test_template_from_tokenizer_config_including_the_named_list_form(folder):
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for chat_template in ("{{ bos_token }}[{{ messages[0]['content'] }}]",
                          [{"name": "tool_use", "template": "tools!"},
                           {"name": "default", "template": "{{ bos_token }}[{{ messages[0]['content'] }}]"}]):
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat_template}))
        assert Tokenizer.from_folder(folder).render_chat([{"role": "user", "content": "hi"}]) == "<bos>[hi]"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer.from_folder(folder).render_chat([{"role": "user", "content": "hi"}])


def test_eos_and_pad_ids_come_from_the_config(folder):
    tok = Tokenizer.from_folder(folder)
    assert tok.eos_token_ids == (1, 4) and tok.pad_token_id == 0 and tok.eos_token == "<eos>"
    (folder / "generation_config.json").unlink()
    (folder / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": [4], "pad_token_id": 0}}))
    assert Tokenizer.from_folder(folder).eos_token_ids == (4,)
    (folder / "config.json").unlink()
    assert Tokenizer.from_folder(folder).eos_token_ids == (1,)  # the tokenizer's own eos_token


def test_a_folder_without_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json is missing"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(TokenizerError, match="only tokenizer.model"):
        Tokenizer.from_folder(tmp_path)
