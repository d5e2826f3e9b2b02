"""What a validated request (requests.py) asks of the engine and of the chat template: its length, its sampling
config (the model's defaults with the request's overrides), the token automaton its answer is held to, the seeds
of its n choices, and a chat request's messages, template variables and images as the template reads them.

A request field the engine cannot take as asked (a length that does not fit the context, a schema outside the
supported subset, the step cache on a model that refuses it) is a 400 that names it (errors.py). Running the engine
requests and turning their tokens into answers is completions.py's.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from dgemma.chat.tool_schema import calls_constraint
from dgemma.config import SAMPLER_SETTINGS, SAMPLERS, ConfigError, SamplingConfig, settings_not_read
from dgemma.generation.canvas import most_new_tokens
from dgemma.sampling import seed_or_random
from dgemma.serving.errors import bad_request
from dgemma.serving.requests import COMPLETIONS_DEFAULT_MAX_TOKENS, ChatCompletionRequest, FunctionDefinition, ImagePart
from dgemma.serving.state import ServerState
from dgemma.structured import ConstraintError, SchemaError, VocabularyError

# block refinement's and DDIM's settings: request fields named as SamplingConfig's
OTHER_SAMPLER_SETTINGS = tuple(dict.fromkeys(f for s in SAMPLERS[1:] for f in SAMPLER_SETTINGS[s]))
# request field -> the SamplingConfig field it overrides (left out of the request: the model's default)
SAMPLING_OVERRIDES = {"steps": "max_denoising_steps", "entropy_bound": "entropy_bound",
                      "accept_order": "accept_order", "t_min": "t_min", "t_max": "t_max",
                      "fixed_steps": "fixed_steps", "step_cache": "step_cache", "sampler": "sampler",
                      **{name: name for name in OTHER_SAMPLER_SETTINGS}}


# -- sampling -----------------------------------------------------------------------------------------

def token_limit(state: ServerState, body) -> int | None:
    """The most tokens an answer may have, as the request asks (chat: max_completion_tokens wins over
    max_tokens). Left out: a completion writes COMPLETIONS_DEFAULT_MAX_TOKENS (a task model its fixed answer
    length); a chat answer (None) as many whole canvases as fit after the prompt, capped by the model's default."""
    if isinstance(body, ChatCompletionRequest):
        return body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    if body.max_tokens is None and state.codec.fixed_max_tokens is None:
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    return body.max_tokens


def sampling_for(state: ServerState, body, prompt: list[int], max_tokens: int | None,
                 adapter: int = 0) -> SamplingConfig:
    """The model's sampling defaults with the request's overrides, and a length that fits the cache;
    adapter: the index of the LoRA adapter the request names (0: the base model)."""
    L, context, n = state.canvas_length, state.worker.max_length, len(prompt)
    fixed = state.codec.fixed_max_tokens
    if fixed is not None:
        if max_tokens not in (None, fixed):
            raise bad_request(f"max_tokens: a {state.codec.task} answer is exactly {fixed} tokens", param="max_tokens")
        max_tokens = fixed
    whole_canvases = most_new_tokens(n, context, L)  # the engine reserves whole canvases
    if whole_canvases < 1:
        raise bad_request(f"the prompt is {n} tokens; the context holds {context}, and a canvas of {L} tokens "
                          f"must fit after the prompt", param="prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(state.sampling.max_new_tokens, whole_canvases)
    elif max_tokens > whole_canvases:
        raise bad_request(f"max_tokens {max_tokens} does not fit: the prompt is {n} tokens, the context holds "
                          f"{context}, and output is made in canvases of {L}, so at most {whole_canvases} tokens "
                          f"can follow this prompt", param="max_tokens", code="context_length_exceeded")
    eos = tuple(dict.fromkeys([*state.sampling.eos_token_ids, *sorted(state.codec.answer_ends)]))
    refusal = state.worker.model.step_cache_refusal(adapter) if body.step_cache else None
    if refusal is not None:
        raise bad_request(f"step_cache: {refusal} ({body.model!r} is one; the base model takes it)"
                          if adapter else f"step_cache: {refusal}", param="step_cache")
    overrides = {field: getattr(body, name) for name, field in SAMPLING_OVERRIDES.items()}
    sampler = body.sampler or state.sampling.sampler
    if sampler == "entropy-bound":  # OpenAI's temperature, which clients send routinely: not this sampler's
        overrides["temperature"] = None
    problem = settings_not_read(sampler, {name: overrides[name] for name in
                                          (*SAMPLER_SETTINGS["entropy-bound"], *OTHER_SAMPLER_SETTINGS)})
    if problem:
        raise bad_request(problem, param=problem.split(":")[0])
    try:
        return state.sampling.replace(max_new_tokens=max_tokens, eos_token_ids=eos, **overrides)
    except ConfigError as e:  # the fields are valid alone but not together, e.g. t_min > t_max
        raise bad_request(str(e)) from None


def choice_seeds(body) -> list[int]:
    """The seeds of a prompt's n choices: seed, seed + 1, ... (from a random seed when none is given)."""
    base = seed_or_random(body.seed)
    return [(base + i) % 2**63 for i in range(body.choices)]


# -- the answer's constraint --------------------------------------------------------------------------

async def tool_constraint(state: ServerState, body: ChatCompletionRequest, template_variables: dict):
    """tool_choice "required" or a named function: the answer must be calls with valid arguments."""
    if body.tool_mode not in ("required", "named"):
        return None
    if state.codec.task != "text":
        raise bad_request(f"tool_choice: a {state.codec.task} model does not call tools", param="tool_choice")
    tools = [(f.name, f.parameters) for f in allowed_tools(body)]
    try:  # built once per set of tools (cached), off the event loop: seconds on a large vocabulary
        return await asyncio.to_thread(
            calls_constraint, state.codec.tokenizer, state.codec.vocab_size, tools,
            several=body.tool_mode == "required" and body.parallel_tool_calls is not False,
            thought=bool(template_variables.get("enable_thinking")))
    except SchemaError as e:
        raise bad_request(f"tools: {e}", param="tools", code="unsupported_schema") from None
    except (VocabularyError, ConstraintError) as e:
        raise bad_request(f"tool_choice: this model cannot be constrained to Gemma 4's tool calls: {e}",
                          param="tool_choice") from None


def allowed_tools(body: ChatCompletionRequest) -> list[FunctionDefinition]:
    """The functions an answer may call: the named one, or all of them."""
    functions = [t.function for t in body.tools or []]
    if body.named_tool is not None:
        return [f for f in functions if f.name == body.named_tool]
    return functions


async def answer_constraint(state: ServerState, body, tools_constraint=None):
    """The token automaton the answer is held to, or None: `tools_constraint` (a required or named
    tool_choice's, `tool_constraint`) or the request's response_format / structured_outputs, not both."""
    answer_format = await _format_constraint(state, body)
    if answer_format is not None and tools_constraint is not None:
        raise bad_request("tool_choice: a required or named tool_choice writes the answer itself; send "
                          "tool_choice \"auto\" or \"none\" with a response_format", param="tool_choice")
    return tools_constraint or answer_format


async def _format_constraint(state: ServerState, body):
    """The request's response_format as a token automaton (None for plain text); a schema outside the
    supported subset is a 400 that names the keyword."""
    structured = body.structured
    if structured is None:
        return None
    if state.codec.task != "text":
        raise bad_request(f"response_format: a {state.codec.task} model writes its own answer format; "
                          f"only {{\"type\": \"text\"}} applies", param="response_format")
    kind, schema = structured
    try:  # the first request with a schema builds its automaton: seconds on a large vocabulary
        return await asyncio.to_thread(state.codec.constraint, kind, schema)
    except SchemaError as e:
        raise bad_request(f"response_format.json_schema.schema: {e}", param="response_format",
                          code="unsupported_schema") from None
    except ConstraintError as e:
        field = "structured_outputs" if kind == "regex" else "response_format"
        raise bad_request(f"{field}: {e}", param=field) from None


# -- the chat template's input ------------------------------------------------------------------------

def template_variables(body: ChatCompletionRequest) -> dict[str, Any]:
    """Variables for the chat template: tools, thinking (reasoning_effort: any value but "none" is on;
    an explicit chat_template_kwargs.enable_thinking wins), and the client's own."""
    variables: dict[str, Any] = {}
    if body.tools:
        variables["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    if body.reasoning_effort is not None:
        variables["enable_thinking"] = body.reasoning_effort != "none"
    return {**variables, **(body.chat_template_kwargs or {})}


def template_messages(body: ChatCompletionRequest) -> list[dict]:
    """The messages as Hugging Face chat templates read them: "developer" is "system"; a call's arguments
    are a dict (as vLLM passes them); a tool result carries the name of the function it answers."""
    names: dict[str, str] = {}
    messages = []
    for m in body.messages:
        content = m.content if isinstance(m.content, str) else [  # the template writes its image placeholder
            {"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text} for p in m.content]
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in m.tool_calls]
            names.update((c.id, c.function.name) for c in m.tool_calls)
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id
            message["name"] = m.name or names.get(m.tool_call_id, "unknown")
        elif m.name is not None:
            message["name"] = m.name
        if m.reasoning_content is not None and m.role == "assistant":
            message["reasoning_content"] = m.reasoning_content
        messages.append(message)
    return messages


def image_urls(body: ChatCompletionRequest) -> list[str]:
    """The URLs of the image parts of all messages, in order (the order of the template's placeholders)."""
    return [p.url for m in body.messages if isinstance(m.content, list) for p in m.content
            if isinstance(p, ImagePart)]
