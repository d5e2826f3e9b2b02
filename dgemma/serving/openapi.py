"""What the server answers, as OpenAPI responses, and the pages that publish the API.

Every body of /openapi.json is the pydantic model that makes or reads it: requests the models that validate
them (requests.py), answers the models the routes build them with (responses.py, health.py, and errors.py's
OpenAI error shape). The fuzz test (tests/test_server_fuzz.py) checks every response it provokes against the
published schemas.
Streams (`stream: true`) are documented as `text/event-stream`; each event is one of responses.py's chunk models.

/docs is Swagger UI from the swagger-ui-bundle-v2 package, served from this server (no CDN: the server
works offline). It is a page without content of its own, like the playground: it loads /openapi.json and
sends "Try it out" requests with the API key the playground keeps in the browser (asking for one when the
schema answers 401).
"""

from __future__ import annotations

from pydantic import BaseModel

from dgemma.serving.errors import ErrorResponse
from dgemma.serving.responses import ChatCompletionChunk, CompletionChunk

ERRORS = {
    400: "bad input: a wrong type, a value out of range, malformed JSON, an unsupported field or schema, a prompt "
         "too long for the context, a bad image",
    401: "missing or wrong API key (when the server has one)",
    404: "no such model: the `model` field names neither the served model nor one of its adapters "
         "(code model_not_found)",
    413: "the body is over --max-body-bytes",
    429: "the queue is full (a Retry-After header says when to retry)",
    500: "the engine failed while running the request",
    503: "the engine is not running",
    504: "the request ran past the server's time limit (`dgemma serve --request-timeout`); its row was freed",
}


def error_responses(*statuses: int) -> dict:
    return {status: {"model": ErrorResponse, "description": ERRORS[status]} for status in statuses}


STREAM_CHUNKS = (ChatCompletionChunk, CompletionChunk)  # put into the schema's components by `add_stream_chunks`


def generation_responses(body: type[BaseModel], chunk: type[BaseModel]) -> dict:
    """200 as JSON, or as server-sent events with `stream: true`; and the errors. As OpenAPI 3.1 reads an
    event stream's `schema`: one event ({"data": ...}), whose data is a JSON chunk, an error, or [DONE]."""
    event = {"type": "object", "required": ["data"], "properties": {"data": {
        "anyOf": [{"type": "string", "contentMediaType": "application/json",
                   "contentSchema": {"anyOf": [{"$ref": f"#/components/schemas/{chunk.__name__}"},
                                               {"$ref": "#/components/schemas/ErrorResponse"}]}},
                  {"const": "[DONE]"}],
        "description": f"a {chunk.__name__} as JSON; an error object if the engine fails mid-stream; the last "
                       "event's data is [DONE]"}}}
    return {200: {"model": body, "description": "the answer; with stream: true, server-sent events",
                  "content": {"text/event-stream": {"schema": event}}},
            **error_responses(400, 401, 404, 413, 429, 500, 503, 504)}


def add_stream_chunks(schema: dict) -> dict:
    """The chunk models that stream events refer to, added to the schema's components."""
    from pydantic.json_schema import models_json_schema

    _, defs = models_json_schema([(m, "serialization") for m in STREAM_CHUNKS],
                                 ref_template="#/components/schemas/{model}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    return schema


DOCS_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>dgemma API</title>
<link rel="stylesheet" href="/swagger-ui/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="/swagger-ui/swagger-ui-bundle.js"></script>
<script>
// the key the playground keeps (localStorage "dgemma-api-key"); asked for when the schema needs one
function key() { return localStorage.getItem("dgemma-api-key") || ""; }
async function start() {
  let answer = await fetch("/openapi.json", {headers: key() ? {Authorization: "Bearer " + key()} : {}});
  if (answer.status === 401) {
    const typed = prompt("This server wants an API key:") || "";
    localStorage.setItem("dgemma-api-key", typed);
    answer = await fetch("/openapi.json", {headers: {Authorization: "Bearer " + typed}});
  }
  SwaggerUIBundle({dom_id: "#swagger-ui", spec: await answer.json(), deepLinking: true,
    requestInterceptor: (request) => {
      if (key() && !request.headers.Authorization) request.headers.Authorization = "Bearer " + key();
      return request;
    }});
}
start();
</script></body></html>
"""


def swagger_ui_folder() -> str:
    import swagger_ui_bundle

    return str(swagger_ui_bundle.swagger_ui_path)


def without_422(schema: dict) -> dict:
    """FastAPI documents a 422 on every route that takes input; this server answers a bad body or parameter
    with a 400 in OpenAI's shape (middleware.py's handler), already documented where it can happen."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None and "400" not in responses:
                responses["400"] = {"description": ERRORS[400],
                                    "content": {"application/json": {"schema": {
                                        "$ref": "#/components/schemas/ErrorResponse"}}}}
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    return schema
