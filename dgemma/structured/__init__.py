"""Structured output: answers guaranteed to match a JSON schema or a regex, decoded canvas by canvas.

    vocabulary = TokenVocabulary.from_tokenizer(tokenizer, size=model.config.vocab_size)
    constraint = json_schema_constraint(schema, vocabulary)        # or regex_constraint / json_object_constraint
    engine.generate([prompt], sampling, constraints=[constraint])  # or dgemma.generation.generate(..., constraint=...)

vocabulary.py: token ids -> bytes; schema.py: the supported JSON-schema subset; automaton.py: the
token automaton (outlines-core) with token classes; decode.py: the canvas DP (DINGO-style Viterbi).
"""

from dgemma.structured.automaton import (
    JSON_WHITESPACE,
    ConstraintError,
    TokenAutomaton,
    json_object_constraint,
    json_schema_constraint,
    regex_constraint,
    set_disk_cache,
)
from dgemma.structured.decode import ENDED, CanvasChoice, constrained_canvas, constrained_sample
from dgemma.structured.schema import SchemaError, check_schema
from dgemma.structured.vocabulary import NOT_SPECIAL, TokenVocabulary, VocabularyError

__all__ = [
    "ENDED",
    "JSON_WHITESPACE",
    "NOT_SPECIAL",
    "CanvasChoice",
    "ConstraintError",
    "SchemaError",
    "TokenAutomaton",
    "TokenVocabulary",
    "VocabularyError",
    "check_schema",
    "constrained_canvas",
    "constrained_sample",
    "json_object_constraint",
    "json_schema_constraint",
    "regex_constraint",
    "set_disk_cache",
]
