// The dgemma playground: sends one streaming request with drafts switched on and draws each draft
// (the argmax canvas after a denoising step) as a grid of tokens coloured by entropy, then the text. Block
// refinement's edits and DDIM's corrector sweeps are outlined as they happen.
// Plain browser JavaScript, no libraries: the page works without a network.
"use strict";

const $ = (id) => document.getElementById(id);
const EXAMPLE_PUZZLE =
  "530070000600195000098000060800060003400803001700020006060000280000419005000080079";
const EXAMPLE_TOOLS = [{
  type: "function",
  function: {
    name: "get_weather",
    description: "Current weather in a city",
    parameters: {
      type: "object",
      properties: { city: { type: "string" }, unit: { type: "string", enum: ["celsius", "fahrenheit"] } },
      required: ["city"],
    },
  },
}];

const playground = {
  model: null,        // the /v1/models card of the served model
  task: "text",       // "text" | "sudoku"
  apiKey: localStorage.getItem("dgemma-api-key") || "",
  controller: null,   // AbortController of the request in flight
  cells: [],          // the canvas grid's cell elements, reused from draft to draft
  givens: null,       // sudoku: the puzzle's digits, 0 for blanks
  draftFrames: 0,     // drafts drawn in this run (tests read it)
  stepsSeen: [],      // "canvas:step" of every draft drawn in this run
  toolCalls: [],      // the tool calls of this run: {id, name, arguments}
  images: [],         // data URLs of the attached images, in order
  sampler: "entropy-bound",  // the served model's own sampler (its card's defaults)
  edits: 0,           // block refinement's edited positions drawn in this run (tests read it)
  corrections: 0,     // positions redrawn by DDIM corrector sweeps in this run
  sweeps: 0,          // corrector sweeps drawn in this run
};
window.playground = playground;

function setState(state, message) {
  document.body.dataset.state = state;
  $("status").textContent = message || "";
  const running = state === "running";
  $("run").disabled = running || !playground.model;
  $("stop").disabled = !running;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (playground.apiKey) h["Authorization"] = "Bearer " + playground.apiKey;
  return h;
}

async function loadModel() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (response.status === 401) {
    $("auth").hidden = false;
    $("model-name").textContent = "API key needed";
    setState("auth");
    return;
  }
  const body = await response.json();
  if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
  $("auth").hidden = true;
  playground.model = body.data[0];
  playground.task = (playground.model.dgemma && playground.model.dgemma.task) || "text";
  $("model-name").textContent = playground.model.id;
  $("model-task").textContent = playground.task === "sudoku"
    ? "sudoku" : `canvas ${playground.model.dgemma.canvas_length}`;
  document.body.dataset.task = playground.task;
  $("text-input").hidden = playground.task === "sudoku";
  $("sudoku-input").hidden = playground.task !== "sudoku";
  const images = playground.model.dgemma.images;
  $("image-input").hidden = !(images && images.accepted);
  if (!$("image-input").hidden) $("model-task").textContent += " · images";
  if (playground.task === "sudoku" && !$("puzzle").value) $("puzzle").value = EXAMPLE_PUZZLE;
  if (playground.task === "sudoku") $("max-tokens").disabled = true;  // an answer is always 81 cells
  buildGrid(playground.task === "sudoku" ? 81 : playground.model.dgemma.canvas_length);
  playground.sampler = playground.model.dgemma.defaults.sampler || "entropy-bound";
  $("sampler").options[0].textContent = `model's (${playground.sampler})`;
  showSamplerFields();
  setState("idle", "ready");
}

// -- drawing -----------------------------------------------------------------------------------------

function buildGrid(length) {
  const canvas = $("canvas");
  canvas.replaceChildren();
  canvas.className = playground.task === "sudoku" ? "canvas sudoku" : "canvas";
  playground.cells = [];
  for (let i = 0; i < length; i++) {
    const cell = document.createElement("span");
    cell.className = "cell empty";
    if (playground.task === "sudoku") {
      const row = Math.floor(i / 9), col = i % 9;
      if (col % 3 === 2 && col < 8) cell.classList.add("box-right");
      if (row % 3 === 2 && row < 8) cell.classList.add("box-bottom");
    }
    cell.textContent = playground.task === "sudoku" ? "" : "·";
    canvas.appendChild(cell);
    playground.cells.push(cell);
  }
}

function showGivens() {
  if (!playground.givens) return;
  playground.givens.forEach((digit, i) => {
    if (!digit || !playground.cells[i]) return;
    playground.cells[i].textContent = String(digit);
    playground.cells[i].classList.replace("empty", "given");
  });
}

function entropyColour(entropy) {
  // yellow (certain) to red (unsure); 3 nats and above is fully red
  const t = Math.min(1, entropy / 3);
  return `hsl(${55 - 55 * t} 95% ${82 - 4 * t}%)`;
}

function drawDraft(draft) {
  if (draft.tokens.length !== playground.cells.length) buildGrid(draft.tokens.length);
  draft.tokens.forEach((token, i) => {
    const cell = playground.cells[i];
    const given = playground.givens && playground.givens[i];
    let piece = draft.pieces[i];
    if (playground.task === "sudoku") piece = /^[1-9]$/.test(piece) ? piece : "";
    cell.textContent = given ? String(given) : (piece === "" ? "\u00a0" : piece.replace(/\n/g, "⏎"));
    cell.classList.remove("empty", "accepted", "given", "wrong", "edited", "corrected", "settled");
    if (draft.settled && draft.settled[i]) cell.classList.add("settled");  // kept by the step cache this step
    cell.style.background = "";
    if (given) {
      cell.classList.add("given");
      if (piece !== String(given)) cell.classList.add("wrong");  // the model disagrees with a given
    } else if (draft.accepted[i]) {
      cell.classList.add("accepted");
    } else {
      cell.style.background = entropyColour(draft.entropy[i]);
    }
    // the samplers' own moves: a committed token block refinement replaced, a position a corrector sweep redrew
    if (draft.edited && draft.edited[i]) cell.classList.add("edited");
    if (draft.corrected && draft.corrected[i]) cell.classList.add("corrected");
    cell.title = `position ${i} · token ${token} · entropy ${draft.entropy[i].toFixed(3)}` +
      (draft.edited && draft.edited[i] ? " · edited" : "") +
      (draft.corrected && draft.corrected[i] ? " · redrawn by the corrector" : "") +
      (draft.settled && draft.settled[i] ? " · kept by the step cache" : "");
  });
  const sweep = draft.phase === "corrector" ? " · corrector sweep" : "";
  $("canvas-label").textContent = `canvas ${draft.canvas + 1} · step ${draft.step}${sweep}`;
  if (draft.edited) playground.edits += draft.edited.filter(Boolean).length;
  if (draft.corrected) playground.corrections += draft.corrected.filter(Boolean).length;
  if (draft.phase === "corrector") playground.sweeps += 1;
  playground.draftFrames += 1;
  playground.stepsSeen.push(`${draft.canvas}:${draft.step}`);
  document.body.dataset.draftFrames = String(playground.draftFrames);
}

function showStats(stats) {
  if (!stats) return;
  const parts = [
    `${stats.canvases} canvas${stats.canvases === 1 ? "" : "es"}`,
    `steps ${JSON.stringify(stats.steps_per_canvas)}`,
    `${stats.tokens_per_forward.toFixed(1)} tokens/forward`,
    ...(stats.decoder_positions < stats.whole_canvas_positions
      ? [`${stats.decoder_positions} of ${stats.whole_canvas_positions} decoder positions (step cache)`] : []),
    `${stats.elapsed_s.toFixed(2)} s`,
    `seed ${stats.seed}`,
  ];
  if (stats.sudoku) parts.unshift(stats.sudoku.solved ? "solved ✓" : "not solved");
  $("stats").textContent = parts.join(" · ");
}

// -- the request -------------------------------------------------------------------------------------

function numberField(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

function jsonField(id, what) {
  const value = $(id).value.trim();
  if (value === "") return undefined;
  try {
    return JSON.parse(value);
  } catch (error) {
    throw new Error(`${what} is not valid JSON: ${error.message}`);
  }
}

// The sampler's fields: only the chosen sampler's settings are sent (the server refuses the others').
function samplerFields() {
  const sampler = $("sampler").value || playground.sampler;
  const fields = { sampler: $("sampler").value || undefined };
  if (sampler === "entropy-bound") fields.entropy_bound = numberField("entropy-bound");
  if (sampler === "block-refinement" || sampler === "ddim") fields.temperature = numberField("temperature");
  if (sampler === "block-refinement") fields.editing_threshold = numberField("editing-threshold");
  if (sampler === "ddim") fields.corrector_steps = numberField("corrector-steps");
  return fields;
}

// Show the settings of the sampler chosen (the model's own when none is).
function showSamplerFields() {
  const sampler = $("sampler").value || playground.sampler;
  document.querySelectorAll("[data-sampler]").forEach((element) => {
    element.hidden = !element.dataset.sampler.split(" ").includes(sampler);
  });
}

function requestBody() {
  const body = {
    model: playground.model.id,
    stream: true,
    stream_options: { include_drafts: true, include_usage: true },
    steps: numberField("steps"),
    ...samplerFields(),
    seed: numberField("seed"),
    fixed_steps: $("fixed-steps").checked || undefined,
    step_cache: $("step-cache").value === "" ? undefined : $("step-cache").value === "on",
  };
  if (playground.task === "sudoku") {
    const puzzle = $("puzzle").value.replace(/\s+/g, "");
    playground.givens = [...puzzle].map((c) => (/[1-9]/.test(c) ? Number(c) : 0));
    return ["/v1/completions", { ...body, prompt: puzzle }];
  }
  playground.givens = null;
  body.max_tokens = numberField("max-tokens");
  const schema = jsonField("json-schema", "the JSON schema");
  if (schema !== undefined) {
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema, strict: true } };
  }
  const text = $("prompt").value;
  if (!$("chat").checked) {
    if (playground.images.length) throw new Error("images go in a chat message: tick 'use the chat template'");
    return ["/v1/completions", { ...body, prompt: text }];
  }
  const tools = jsonField("tools", "the tools");
  if (tools !== undefined) {
    body.tools = tools;
    body.tool_choice = $("tool-choice").value;
  }
  if ($("think").checked) body.reasoning_effort = "medium";
  const images = playground.images.map((url) => ({ type: "image_url", image_url: { url } }));
  const content = images.length ? [...images, { type: "text", text }] : text;
  return ["/v1/chat/completions", { ...body, messages: [{ role: "user", content }] }];
}

// -- images --------------------------------------------------------------------------------------------

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attachImages() {
  playground.images = await Promise.all([...$("image").files].map(readAsDataURL));
  $("image-previews").replaceChildren(...playground.images.map((url) => {
    const img = document.createElement("img");
    img.src = url;
    img.alt = "attached image";
    return img;
  }));
}

async function run() {
  $("output").textContent = "";
  $("stats").textContent = "";
  $("error").textContent = "";
  $("thoughts").textContent = "";
  $("thoughts-box").hidden = true;
  $("tool-calls").replaceChildren();
  $("tool-calls").hidden = true;
  let path, body;
  try {
    [path, body] = requestBody();
  } catch (error) {
    $("error").textContent = error.message;
    setState("error", "not sent");
    return;
  }
  playground.draftFrames = 0;
  playground.stepsSeen = [];
  playground.edits = playground.corrections = playground.sweeps = 0;
  playground.toolCalls = [];
  buildGrid(playground.task === "sudoku" ? 81 : playground.cells.length);
  showGivens();
  playground.controller = new AbortController();
  setState("running", "denoising…");
  try {
    const response = await fetch(path, {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: playground.controller.signal,
    });
    if (!response.ok) {
      const error = await response.json().catch(() => null);
      throw new Error(error && error.error ? error.error.message : `HTTP ${response.status}`);
    }
    await readEvents(response.body, onChunk);
    setState("done", "done");
  } catch (error) {
    if (error.name === "AbortError") {
      setState("idle", "stopped");
    } else {
      $("error").textContent = error.message;
      setState("error", "failed");
    }
  } finally {
    playground.controller = null;
  }
}

function onChunk(chunk) {
  if (chunk.error) throw new Error(chunk.error.message);
  if (chunk.dgemma) showStats(chunk.dgemma);
  const choice = chunk.choices && chunk.choices[0];
  if (!choice) return;  // the usage chunk
  if (choice.dgemma_draft) drawDraft(choice.dgemma_draft);
  const text = choice.delta ? choice.delta.content : choice.text;
  if (text) $("output").textContent += text;
  const delta = choice.delta || {};
  if (delta.reasoning_content) {
    $("thoughts-box").hidden = false;
    $("thoughts").textContent += delta.reasoning_content;
  }
  for (const call of delta.tool_calls || []) showToolCall(call);
}

// A call arrives whole in one delta (dgemma sends each once it is complete and parsed).
function showToolCall(call) {
  const entry = { id: call.id, name: call.function.name, arguments: call.function.arguments };
  playground.toolCalls.push(entry);
  const item = document.createElement("li");
  const name = document.createElement("span");
  name.className = "name";
  name.textContent = entry.name;
  item.append(name, `(${entry.arguments})`);
  item.title = entry.id;
  $("tool-calls").appendChild(item);
  $("tool-calls").hidden = false;
}

// Server-sent events over fetch (EventSource cannot POST): events end with a blank line, and each
// "data: " line carries one JSON chunk; "[DONE]" closes the stream.
async function readEvents(stream, handle) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        handle(JSON.parse(data));
      }
    }
  }
}

// -- wiring ------------------------------------------------------------------------------------------

$("form").addEventListener("submit", (event) => {
  event.preventDefault();
  run();
});
$("stop").addEventListener("click", () => playground.controller && playground.controller.abort());
$("image").addEventListener("change", () => attachImages().catch((error) => {
  $("error").textContent = `cannot read the image: ${error.message}`;
}));
$("clear-images").addEventListener("click", () => {
  $("image").value = "";
  attachImages();
});
$("example").addEventListener("click", () => { $("puzzle").value = EXAMPLE_PUZZLE; });
$("sampler").addEventListener("change", showSamplerFields);
$("example-tools").addEventListener("click", () => {
  $("tools").value = JSON.stringify(EXAMPLE_TOOLS, null, 2);
  $("prompt").value = "What is the weather in Paris?";
});
$("auth").addEventListener("submit", (event) => {
  event.preventDefault();
  playground.apiKey = $("api-key").value.trim();
  localStorage.setItem("dgemma-api-key", playground.apiKey);
  loadModel().catch(showLoadError);
});

function showLoadError(error) {
  $("error").textContent = `cannot reach the server: ${error.message}`;
  setState("error", "offline");
}

loadModel().catch(showLoadError);
