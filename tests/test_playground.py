"""The playground page in headless Chromium: it loads, streams a request, draws the canvas settling
step by step and shows the final text (text model), or fills a 9x9 grid (sudoku model).

Chromium is Debian's `chromium` (`make setup` installs it as root), driven over its DevTools pipe
(`--remote-debugging-pipe`: JSON messages ending in a NUL byte, written to its fd 3, read from its
fd 4), so no websocket library or browser download is needed. Screenshots go to artifacts/.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from test_server import MODEL, PUZZLE, ServerProcess, write_sudoku_model

CHROMIUM = shutil.which("chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (make setup installs it as root)")


class Browser:
    """One headless Chromium tab, driven with DevTools protocol calls."""

    def __init__(self, width: int = 1280, height: int = 900):
        to_browser_read, self._to_browser = (_above_4(fd) for fd in os.pipe())
        self._from_browser, from_browser_write = (_above_4(fd) for fd in os.pipe())
        self.profile = tempfile.mkdtemp(prefix="dgemma-chromium-")

        def pipes_as_fd_3_and_4():  # in the child, before exec; dup2 leaves the copies inheritable
            os.dup2(to_browser_read, 3)
            os.dup2(from_browser_write, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             f"--user-data-dir={self.profile}", f"--window-size={width},{height}", "--no-first-run",
             "--no-default-browser-check", "--hide-scrollbars", "about:blank"],
            preexec_fn=pipes_as_fd_3_and_4, close_fds=False,  # Python's own descriptors are close-on-exec
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_read)
        os.close(from_browser_write)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=False, session=True)
        self.call("Page.enable", session=True)
        self.call("Runtime.enable", session=True)

    def call(self, method: str, session: bool = False, timeout: float = 30, **params) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read(timeout)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for i, event in enumerate(self.events):
                if event.get("method") == method:
                    return self.events.pop(i)
            self.events.append(self._read(deadline - time.monotonic()))

    def _read(self, timeout: float) -> dict:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._from_browser], [], [], max(0.0, timeout))
            if not ready:
                raise TimeoutError("no message from chromium")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def open(self, url: str):
        self.call("Page.navigate", url=url, session=True)
        self.wait_event("Page.loadEventFired")

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True,
                           session=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.02)
        raise TimeoutError(f"never true: {expression}")

    def screenshot(self, path: Path):
        data = self.call("Page.captureScreenshot", format="png", session=True)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def page_errors(self) -> list:
        """Uncaught exceptions and console errors seen so far."""
        self.js("0")  # drain pending events into self.events
        return [e for e in self.events if e.get("method") == "Runtime.exceptionThrown"
                or (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] == "error")]

    def close(self):
        try:
            self.call("Browser.close", timeout=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        shutil.rmtree(self.profile, ignore_errors=True)


def _above_4(fd: int) -> int:
    """The same pipe end on a descriptor above 4, so putting the child's copies on 3 and 4 clobbers nothing."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 5)
    os.close(fd)
    return moved


@pytest.fixture
def browser():
    b = Browser()
    yield b
    b.close()


def fill(browser: Browser, element_id: str, value: str):
    browser.js(f"document.getElementById({json.dumps(element_id)}).value = {json.dumps(value)}")


def test_playground_streams_the_canvas_and_the_text(tiny_model_dir, browser):
    server = ServerProcess(tiny_model_dir, api_key="sk-page")
    try:
        browser.open(server.url + "/")
        browser.wait_for("document.body.dataset.state === 'auth'")  # the key is asked for, not assumed
        fill(browser, "api-key", "sk-page")
        browser.js("document.querySelector('#auth button').click()")
        browser.wait_for("document.body.dataset.state === 'idle'")
        assert browser.js("document.getElementById('model-name').textContent") == MODEL
        assert browser.js("document.querySelectorAll('#canvas .cell').length") == 16
        assert browser.js("document.getElementById('image-input').hidden") is True  # a text-only model

        # many fixed steps, so the run lasts long enough to watch it from outside
        steps, max_tokens = 120, 48
        fill(browser, "prompt", "hello world")
        fill(browser, "seed", "21")
        fill(browser, "steps", str(steps))
        fill(browser, "max-tokens", str(max_tokens))
        browser.js("document.getElementById('fixed-steps').checked = true")
        browser.js("document.getElementById('run').click()")

        labels_while_running = set()
        while browser.js("document.body.dataset.state") == "running":
            labels_while_running.add(browser.js("document.getElementById('canvas-label').textContent"))
            if len(labels_while_running) == 5:
                browser.screenshot(ARTIFACTS / "playground-denoising.png")
            time.sleep(0.01)
        error = browser.js("document.getElementById('error').textContent")
        assert browser.js("document.body.dataset.state") == "done", error
        # the grid changed while the request ran, step after step, not only at the end
        assert len(labels_while_running - {""}) >= 3, labels_while_running

        frames = browser.js("playground.stepsSeen")
        canvases = {f.split(":")[0] for f in frames}
        assert len(canvases) == 3 and f"2:{steps}" in frames  # 48 tokens = 3 canvases of 16, each to its last step
        text = browser.js("document.getElementById('output').textContent")
        expected = server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello world"}], seed=21, max_tokens=max_tokens,
            extra_body={"steps": steps, "fixed_steps": True}).choices[0].message.content
        assert text == expected and text
        assert "3 canvases" in browser.js("document.getElementById('stats').textContent")
        # the last draft is on the grid, coloured: accepted cells green, the rest by entropy
        cells = browser.js("[...document.querySelectorAll('#canvas .cell')].map(c => [c.textContent, c.className])")
        assert len(cells) == 16 and any("accepted" in cls for _, cls in cells)
        assert browser.page_errors() == []
        browser.screenshot(ARTIFACTS / "playground-text.png")
    finally:
        server.stop()


def test_playground_sudoku_mode(tmp_path, browser):
    server = ServerProcess(write_sudoku_model(tmp_path), api_key=None)
    try:
        browser.open(server.url + "/")
        browser.wait_for("document.body.dataset.state === 'idle'")
        assert browser.js("document.body.dataset.task") == "sudoku"
        assert browser.js("document.getElementById('text-input').hidden") is True
        assert browser.js("document.getElementById('puzzle').value") == PUZZLE  # the example is filled in
        assert browser.js("document.querySelectorAll('#canvas.sudoku .cell').length") == 81
        fill(browser, "seed", "3")
        fill(browser, "steps", "40")
        browser.js("document.getElementById('fixed-steps').checked = true")
        browser.js("document.getElementById('run').click()")
        browser.wait_for("document.body.dataset.state === 'done'")

        frames = browser.js("playground.stepsSeen")
        assert frames[-1] == "0:40" and len(frames) >= 2
        cells = browser.js("[...document.querySelectorAll('#canvas .cell')].map(c => [c.textContent, c.className])")
        givens = [i for i, c in enumerate(PUZZLE) if c != "0"]
        assert all(cells[i][0] == PUZZLE[i] and "given" in cells[i][1] for i in givens)
        assert all(text.strip() in set("123456789") | {""} for text, _ in cells)
        assert browser.js("document.getElementById('stats').textContent").startswith("not solved")  # random weights
        assert len(browser.js("document.getElementById('output').textContent")) == 81
        assert browser.page_errors() == []
        browser.screenshot(ARTIFACTS / "playground-sudoku.png")
    finally:
        server.stop()


def test_playground_shows_each_samplers_moves(tiny_model_dir, browser):
    """The sampler chosen on the page reaches the request, its settings show for it alone, and the canvas outlines
    DDIM's corrector sweeps and block refinement's edits as the drafts arrive."""
    server = ServerProcess(tiny_model_dir, api_key=None)
    try:
        browser.open(server.url + "/")
        browser.wait_for("document.body.dataset.state === 'idle'")
        assert browser.js("document.getElementById('sampler').options[0].textContent") == "model's (entropy-bound)"
        visible = "[...document.querySelectorAll('label[data-sampler]')].filter(l => !l.hidden).map(l => l.dataset.sampler)"
        assert browser.js(visible) == ["entropy-bound"]
        choose = "(s => {{ s.value = '{}'; s.dispatchEvent(new Event('change')); }})(document.getElementById('sampler'))"
        browser.js(choose.format("ddim"))
        assert browser.js(visible) == ["block-refinement ddim", "ddim"]
        run_page(browser, prompt="hello world", seed="5", steps="7", **{"max-tokens": "16", "corrector-steps": "1",
                                                                      "temperature": "1"})
        # 7 forwards: three of them sweeps redrawing one position each (a reader that falls behind sees only the
        # newest draft, so some may be skipped, never all)
        sweeps = browser.js("playground.sweeps")
        assert 1 <= sweeps <= 3 and browser.js("playground.corrections") == sweeps
        browser.js(choose.format("block-refinement"))
        run_page(browser, prompt="hello world", seed="5", steps="7", **{"max-tokens": "16", "editing-threshold": "0.01",
                                                                      "temperature": "1"})
        assert browser.js("playground.edits") > 0 and browser.js("playground.sweeps") == 0
        assert browser.page_errors() == []
        browser.screenshot(ARTIFACTS / "playground-block-refinement.png")
    finally:
        server.stop()


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer"}}, "required": ["city"]}}}
POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "label": {"type": "string", "maxLength": 8}},
         "required": ["x", "label"], "additionalProperties": False}


def run_page(browser: Browser, **fields):
    """Fill the page's fields (id -> value; True/False tick a box), run, wait for the end."""
    for element_id, value in fields.items():
        if isinstance(value, bool):
            browser.js(f"document.getElementById({json.dumps(element_id)}).checked = {json.dumps(value)}")
        else:
            fill(browser, element_id, value)
    browser.js("document.getElementById('run').click()")
    browser.wait_for("['done', 'error'].includes(document.body.dataset.state)", timeout=120)
    error = browser.js("document.getElementById('error').textContent")
    assert browser.js("document.body.dataset.state") == "done", error


def test_playground_json_schema_tool_calls_and_thoughts(gemma4_chat_model_dir, browser):
    server = ServerProcess(gemma4_chat_model_dir, api_key=None)
    try:
        client = server.client()
        browser.open(server.url + "/")
        browser.wait_for("document.body.dataset.state === 'idle'")
        common = {"prompt": "Weather in Paris?", "steps": "3", "max-tokens": "64"}
        api = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=64,
                   extra_body={"steps": 3})

        # a JSON schema: the text is the same valid JSON the API gives for that seed
        run_page(browser, **common, seed="5", **{"json-schema": json.dumps(POINT)})
        text = browser.js("document.getElementById('output').textContent")
        expected = client.chat.completions.create(seed=5, response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": POINT}}, **api)
        assert text == expected.choices[0].message.content and json.loads(text).keys() == {"x", "label"}
        browser.screenshot(ARTIFACTS / "playground-json-schema.png")

        # tools, a required call and thinking: thoughts in their box, calls listed, as the API answers
        tools = {"tools": json.dumps([WEATHER_TOOL]), "json-schema": "", "think": True}
        browser.js("document.getElementById('tool-choice').value = 'required'")
        answers = {seed: client.chat.completions.create(seed=seed, tools=[WEATHER_TOOL], tool_choice="required",
                                                        reasoning_effort="medium", **api).choices[0].message
                   for seed in range(6)}
        seed = next(s for s, m in answers.items() if (m.model_extra or {}).get("reasoning_content"))
        run_page(browser, **common, **tools, seed=str(seed))
        calls = browser.js("playground.toolCalls")
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in answers[seed].tool_calls]
        assert browser.js("document.querySelectorAll('#tool-calls li').length") == len(calls)
        assert browser.js("document.getElementById('thoughts-box').hidden") is False
        assert browser.js("document.getElementById('thoughts').textContent") == \
            answers[seed].model_extra["reasoning_content"]
        assert browser.js("document.getElementById('output').textContent") == ""
        browser.screenshot(ARTIFACTS / "playground-tool-calls.png")

        # a schema that is not JSON is refused on the page, before anything is sent
        fill(browser, "json-schema", "{not json")
        browser.js("document.getElementById('run').click()")
        browser.wait_for("document.body.dataset.state === 'error'")
        assert "the JSON schema is not valid JSON" in browser.js("document.getElementById('error').textContent")
        assert browser.page_errors() == []
    finally:
        server.stop()


def set_files(browser: Browser, element_id: str, paths: list[str]):
    """Pick files in a file input, as the user's file dialog would (the page gets its change event)."""
    element = browser.call("Runtime.evaluate", expression=f"document.getElementById({json.dumps(element_id)})",
                           session=True)["result"]
    browser.call("DOM.setFileInputFiles", files=paths, objectId=element["objectId"], session=True)


def test_playground_attaches_an_image(gemma4_vision_model_dir, tmp_path, browser):
    from conftest import png_bytes

    picture = tmp_path / "picture.png"
    picture.write_bytes(png_bytes(37, 53))
    server = ServerProcess(gemma4_vision_model_dir, api_key=None)
    try:
        browser.open(server.url + "/")
        browser.wait_for("document.body.dataset.state === 'idle'")
        assert browser.js("document.getElementById('image-input').hidden") is False
        set_files(browser, "image", [str(picture)])
        browser.wait_for("playground.images.length === 1 && document.querySelectorAll('#image-previews img').length")
        url = browser.js("playground.images[0]")
        assert url == "data:image/png;base64," + base64.b64encode(picture.read_bytes()).decode()
        run_page(browser, prompt="what is it?", seed="3", **{"max-tokens": "32"})
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}]
        expected = server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], seed=3, max_tokens=32)
        assert browser.js("document.getElementById('output').textContent") == expected.choices[0].message.content
        browser.screenshot(ARTIFACTS / "playground-image.png")

        # without the chat template the page says why it sends nothing; removed, the images are gone
        browser.js("document.getElementById('chat').checked = false")
        browser.js("document.getElementById('run').click()")
        browser.wait_for("document.body.dataset.state === 'error'")
        assert "images go in a chat message" in browser.js("document.getElementById('error').textContent")
        browser.js("document.getElementById('clear-images').click()")
        browser.wait_for("playground.images.length === 0 && !document.querySelector('#image-previews img')")
        assert browser.page_errors() == []
    finally:
        server.stop()
