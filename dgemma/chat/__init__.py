"""Gemma 4's chat format, below the server and the chat command (it knows nothing of HTTP).

  codec.py        prompts to token ids and token ids to text for one model (`Codec`, `TextCodec`), and
                  `TextAssembler`, committed tokens to text deltas
  chat_output.py  an answer's raw text split into reasoning, content and tool calls
  tool_calls.py   Gemma 4's tool-call notation, parsed and written, and its OpenAI `tool_calls` form
  tool_schema.py  tool calls whose arguments satisfy their JSON schemas, as a constraint
"""
