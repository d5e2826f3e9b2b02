"""Scoring through `dgemma serve`, checked against the model's own encoder, then EleutherAI's
lm-evaluation-harness run against the server as users run it: loglikelihood and loglikelihood_rolling
tasks through `local-completions` (the server's tokenizer or a local one, several prompts per request),
generation through `local-completions` and `local-chat-completions`. Token-id prompts throughout, as
lm-eval sends them by default (a text prompt gets the tokenizer's special tokens from the server, which
lm-eval would not count).

The harness runs in this process (`lm_eval.simple_evaluate`, what `lm_eval run` calls) with task files
written here over local JSON lines, offline. Its per-sample results are compared with log-probabilities
computed directly from the checkpoint, and its generations with the server's answers to the same requests.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from test_server import API_KEY, MODEL, ServerProcess


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # rows enough for a batch of prompts, and a short context so that lm-eval's requests are long for it
    server = ServerProcess(tiny_model_dir, "--max-batch", "6", "--max-queue", "16")
    yield server
    server.stop_cleanly()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    """(model, tokenizer) from the checkpoint: log-probabilities straight from `encode`, in a fresh cache."""
    import dgemma
    from dgemma.tokenizer import Tokenizer

    return dgemma.load_model(tiny_model_dir).eval(), Tokenizer.from_folder(tiny_model_dir)


def encoder_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(T, V) log_softmax of one encoder pass: row t is the distribution of token t + 1."""
    with torch.no_grad():
        return torch.log_softmax(model.encode(torch.tensor([ids]), model.new_cache(1, len(ids)))[0], dim=-1)


# -- the scoring endpoint ---------------------------------------------------------------------------------

def test_prompt_logprobs_equal_the_encoder(client, oracle):
    """Several prompts (token ids) in one request: each choice's token_logprobs and top_logprobs are the
    encoder's log_softmax, with the encoder's most likely next token after the prompt (max_tokens 1)."""
    model, tok = oracle
    prompts = [[2] + tok.encode("the water is hot and the", add_special_tokens=False),
               [2] + tok.encode("the water is cold", add_special_tokens=False),
               [2, 40, 41],
               [9]]
    out = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=5, max_tokens=1)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == sum(map(len, prompts)) and out.usage.completion_tokens == 4
    for prompt, choice in zip(prompts, out.choices):
        logp = encoder_logprobs(model, prompt)
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
        assert lp.token_logprobs[1:-1] == pytest.approx(expected.tolist(), abs=1e-5)
        for t in range(1, len(prompt) + 1):  # token t's alternatives come from position t - 1
            values, ids = logp[t - 1].topk(5)
            expected = {}  # keyed by text: of two tokens with one text (ids past the tokenizer's), the likelier
            for v, i in zip(values.tolist(), ids.tolist()):
                expected.setdefault(tok.decode([i], skip_special_tokens=False), v)
            assert list(lp.top_logprobs[t]) == list(expected)
            assert list(lp.top_logprobs[t].values()) == pytest.approx(list(expected.values()), abs=1e-5)
        nxt = int(logp[-1].argmax())
        assert lp.tokens[-1] == tok.decode([nxt], skip_special_tokens=False)
        assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())  # exactly: harnesses test with ==
        assert choice.finish_reason == "length"
        assert choice.text.endswith(tok.decode(prompt + [nxt])[len(tok.decode(prompt)):])


def test_text_prompts_echo_and_offsets(client, oracle):
    model, tok = oracle
    texts = ["hello world", "the sea is water"]
    out = client.completions.create(model=MODEL, prompt=texts, echo=True, logprobs=0, max_tokens=0)
    for text, choice in zip(texts, out.choices):
        ids = tok.encode(text)  # the server adds the tokenizer's special tokens, as for generation
        lp = choice.logprobs
        assert choice.text == text and lp.tokens == [tok.decode([i], skip_special_tokens=False) for i in ids]
        assert lp.top_logprobs[1:] == [{}] * (len(ids) - 1)
        logp = encoder_logprobs(model, ids)
        assert lp.token_logprobs[1:] == pytest.approx(
            logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:], dtype=torch.long)].tolist(), abs=1e-5)
        # each token's text begins at its offset in the decoded prompt
        decoded = tok.decode(ids)
        for i, start in enumerate(lp.text_offset):
            assert decoded[: start] == tok.decode(ids[:i])
    # without echo: only the next token (max_tokens 1), or nothing (max_tokens 0)
    one = client.completions.create(model=MODEL, prompt=texts[0], logprobs=2, max_tokens=1).choices[0]
    assert len(one.logprobs.tokens) == 1 and one.logprobs.text_offset == [0] and one.logprobs.token_logprobs[0] < 0
    none = client.completions.create(model=MODEL, prompt=texts[0], logprobs=2, max_tokens=0).choices[0]
    assert none.text == "" and none.logprobs.tokens == []


def test_several_prompts_and_echo_for_generation(client):
    prompts = ["the water is", "hello world"]
    many = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, n=2, seed=3)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):  # prompt i's choice j: what the prompt alone gives with seed 3 + j
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, n=2, seed=3)
        assert [c.text for c in many.choices[2 * i : 2 * i + 2]] == [c.text for c in alone.choices]
    echoed = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, seed=3, echo=True)
    assert echoed.choices[0].text == prompts[0] + many.choices[0].text
    stream = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, seed=3, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == echoed.choices[0].text
    bare = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True)
    assert [c.text for c in bare.choices] == prompts and bare.usage.completion_tokens == 0


@pytest.mark.parametrize("change,param,message", [
    ({"logprobs": 1}, "logprobs", "no left-to-right probabilities"),  # denoised tokens: max_tokens unset
    ({"logprobs": 1, "max_tokens": 2}, "logprobs", "echo: true with max_tokens 0"),
    ({"logprobs": 21, "max_tokens": 0}, "logprobs", "less than or equal to 20"),
    ({"logprobs": -1, "max_tokens": 0}, "logprobs", "greater than or equal to 0"),
    ({"logprobs": True, "max_tokens": 0}, "logprobs", "valid integer"),
    ({"logprobs": 1, "max_tokens": 0, "stream": True}, "stream", "answers at once"),
    ({"logprobs": 1, "max_tokens": 0, "n": 2}, "n", "deterministic"),
    ({"max_tokens": 0, "stream": True}, "stream", "nothing to stream"),
    ({"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
    ({"prompt": []}, "prompt", "the prompt is empty"),
    ({"prompt": ["a", ""]}, "prompt", "prompt 1 is empty"),
    ({"prompt": [[1, 2], []]}, "prompt", "prompt 1 is empty"),
    ({"prompt": ["a", [1, 2]]}, "prompt", "not both"),
    ({"prompt": [[1, 2], [1, "x"]]}, "prompt", "prompt 1: expected a list of token ids"),
    ({"prompt": [[1, 2], [1, True]]}, "prompt", "prompt 1: expected a list of token ids"),
    ({"prompt": [[1, 2], [1, 100000]], "logprobs": 0, "max_tokens": 0}, "prompt", "outside the vocabulary"),
    ({"prompt": [[1] * 300], "logprobs": 0, "max_tokens": 0}, "prompt", "does not fit"),
    ({"prompt": [[1, 2]] * 17, "logprobs": 0, "max_tokens": 0}, "prompt", "at most 16 prompts"),
])
def test_bad_scoring_requests_are_400(server, change, param, message):
    body = {"model": MODEL, "prompt": "hello", **change}
    r = server.post("/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error"


def test_tokenizer_routes(server, oracle):
    _, tok = oracle
    r = server.post("/tokenize", {"prompt": "hello world", "add_special_tokens": False})
    assert r.json()["tokens"] == tok.encode("hello world", add_special_tokens=False)
    assert server.post("/tokenize", {"prompt": "hello world"}).json()["tokens"] == tok.encode("hello world")
    detokenized = server.post("/detokenize", {"tokens": [2, 9]}).json()
    assert detokenized == {"prompt": tok.decode([2, 9], skip_special_tokens=False)}
    import httpx

    info = httpx.get(f"{server.url}/tokenizer_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert (info["bos_token"], info["eos_token"], info["model_max_length"]) == ("<bos>", "<eos>", 256)
    assert httpx.get(f"{server.url}/tokenizer_info").status_code == 401
    for path, body, message in [("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {}, "prompt: this field"),
                                ("/detokenize", {"tokens": [1, 999]}, "outside the vocabulary"),
                                ("/tokenize", {"prompt": "a", "model": "other"}, "does not exist")]:
        r = server.post(path, body)
        assert r.status_code == (404 if "model" in body else 400) and message in r.json()["error"]["message"], r.text


# -- the harness ----------------------------------------------------------------------------------------

MC_DOCS = [
    {"question": "the water is", "choices": ["hot", "a word", "you see the", "one"], "answer": 0},
    {"question": "the water is", "choices": ["cold", "hot water", "the", "he was"], "answer": 1},
    {"question": "what do you call the number one", "choices": ["two", "time", "hello world", "the"], "answer": 0},
    {"question": "hello", "choices": ["world", "sudoku", "people", "day"], "answer": 3},
]
TEXT_DOCS = [{"question": q, "answer": "hot"} for q in ["the water is", "hello world", "what is the number"]]


def write_tasks(folder) -> None:
    """Three tasks in lm-eval's YAML format over local JSON lines: multiple choice, rolling, generation."""
    def data(name, docs):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(d) + "\n" for d in docs))
        return f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"

    (folder / "dg_mc.yaml").write_text(
        "task: dg_mc\n" + data("mc", MC_DOCS) + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (folder / "dg_rolling.yaml").write_text(
        "task: dg_rolling\n" + data("text", TEXT_DOCS) + "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{question}} {{answer}}'\nmetric_list:\n  - metric: word_perplexity\n")
    (folder / "dg_gen.yaml").write_text(
        "task: dg_gen\n" + data("gen", TEXT_DOCS) + "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['<end_of_turn>']\n  max_gen_toks: 16\n"
        "metric_list:\n  - metric: exact_match\n")


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """lm_eval.simple_evaluate, offline, with our task folder; the key travels as lm-eval reads it."""
    mp = pytest.MonkeyPatch()
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        mp.setenv(name, "1")
    mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets")))
    mp.setenv("OPENAI_API_KEY", API_KEY)
    import lm_eval
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("tasks")
    write_tasks(folder)
    manager = TaskManager(include_path=str(folder))

    def run(model: str, model_args: str, tasks: list[str], **kwargs) -> dict:
        return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=manager,
                                       log_samples=True, **kwargs)

    yield run
    mp.undo()


def continuation_logprob(model, tok, context: str, continuation: str, bos: bool) -> tuple[float, bool]:
    """What lm-eval asks for: log p(continuation | context) and whether it is the greedy continuation,
    tokenised as lm-eval does (the pair as one text; the context's tokens; the rest)."""
    first = [tok.bos_token_id] if bos else []
    whole = first + tok.encode(context + continuation, add_special_tokens=False)
    ctx = first + tok.encode(context, add_special_tokens=False)
    logp = encoder_logprobs(model, whole)
    rows = torch.arange(len(ctx) - 1, len(whole) - 1)
    targets = torch.tensor(whole[len(ctx):], dtype=torch.long)
    return float(logp[rows, targets].sum()), bool((logp[rows].argmax(-1) == targets).all())


def check_choices(samples, model, tok, *, bos: bool):
    """lm-eval's per-choice (log-likelihood, is_greedy) equal the encoder's; returns the accuracy."""
    assert len(samples) == len(MC_DOCS)
    correct = 0
    for sample in samples:
        doc = MC_DOCS[sample["doc_id"]]
        expected = [continuation_logprob(model, tok, doc["question"], " " + c, bos) for c in doc["choices"]]
        got = [tuple(r[0]) for r in sample["resps"]]
        assert [g[0] for g in got] == pytest.approx([e[0] for e in expected], abs=1e-4)
        assert [g[1] for g in got] == [e[1] for e in expected]
        correct += max(range(len(expected)), key=lambda i: expected[i][0]) == doc["answer"]
    return correct / len(MC_DOCS)


def test_lm_eval_loglikelihood_with_the_servers_tokenizer(server, harness, oracle):
    """Multiple choice and rolling log-likelihoods through local-completions, counting tokens with the
    server's own tokenizer (lm-eval finds /tokenizer_info), four prompts per request (batch_size)."""
    model, tok = oracle
    args = f"model={MODEL},base_url={server.url}/v1/completions,auth_token={API_KEY},max_retries=1,batch_size=4"
    out = harness("local-completions", args, ["dg_mc", "dg_rolling"])
    accuracy = check_choices(out["samples"]["dg_mc"], model, tok, bos=False)
    assert out["results"]["dg_mc"]["acc,none"] == pytest.approx(accuracy)
    # rolling: every token of the text after the BOS prefix token
    for sample in out["samples"]["dg_rolling"]:
        doc = TEXT_DOCS[sample["doc_id"]]
        ids = [tok.bos_token_id] + tok.encode(f"{doc['question']} {doc['answer']}", add_special_tokens=False)
        logp = encoder_logprobs(model, ids)
        expected = float(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:], dtype=torch.long)].sum())
        assert sample["resps"][0][0] == pytest.approx(expected, abs=1e-4)
    assert math.isfinite(out["results"]["dg_rolling"]["word_perplexity,none"])


def test_lm_eval_loglikelihood_with_a_local_tokenizer_and_bos(server, harness, oracle, tiny_model_dir, tmp_path):
    """The recipe for Gemma checkpoints (docs/evaluation.md): lm-eval's own Hugging Face tokenizer with
    add_bos_token=True, so every context starts with <bos>, one prompt per request."""
    from tokenizers import Tokenizer, processors

    model, tok = oracle
    hf = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    hf.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    hf.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # the file as it is, not a model's own class
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    args = (f"model={MODEL},base_url={server.url}/v1/completions,max_retries=1,tokenizer_backend=huggingface,"
            f"tokenizer={tmp_path},add_bos_token=True")
    out = harness("local-completions", args, ["dg_mc"])
    accuracy = check_choices(out["samples"]["dg_mc"], model, tok, bos=True)
    assert out["results"]["dg_mc"]["acc,none"] == pytest.approx(accuracy)


def test_lm_eval_generation_tasks(server, harness, client, oracle):
    _, tok = oracle
    """generate_until through local-chat-completions (the chat template applied by the server) and through
    local-completions (token-id prompts, three per request): lm-eval gets what the server answers."""
    chat = harness("local-chat-completions", f"model={MODEL},base_url={server.url}/v1/chat/completions",
                   ["dg_gen"], apply_chat_template=True)
    for sample in chat["samples"]["dg_gen"]:
        doc = TEXT_DOCS[sample["doc_id"]]
        direct = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": doc["question"]}],
                                                max_tokens=16, stop=["<end_of_turn>"], seed=1234, temperature=0)
        assert sample["resps"][0][0] == direct.choices[0].message.content
    assert "exact_match,none" in chat["results"]["dg_gen"]

    args = f"model={MODEL},base_url={server.url}/v1/completions,auth_token={API_KEY},batch_size=4"
    completions = harness("local-completions", args, ["dg_gen"])
    for sample in completions["samples"]["dg_gen"]:
        ids = tok.encode(TEXT_DOCS[sample["doc_id"]]["question"], add_special_tokens=False)  # as lm-eval sends it
        direct = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, seed=1234,
                                           stop=["<end_of_turn>", "<eos>"])
        assert sample["resps"][0][0] == direct.choices[0].text
