"""A structured-output spec as an xgrammar ``Grammar``, built without any vocabulary.

Shared by the tokenizer stage (a bad schema is refused before scheduling,
``tokenizer/grammar_checks.py``) and the scheduler (which compiles the grammar against
the vocabulary, ``scheduler/grammar.py``). xgrammar is imported on first use.
"""

from __future__ import annotations

import re

from pocketllm.proto.messages import StructuredSpec

KINDS = ("json_object", "json_schema", "regex", "grammar", "structural_tag")
# xgrammar prefixes its messages with "[time] /path/file.cc:line: "; callers need only the why.
_XGR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")


def explain(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return _XGR_PREFIX.sub("", text).strip()


# xgrammar 0.2.9 lets two kinds of text into JSON strings that no JSON parser takes back:
# control characters in strings with maxLength/minLength, and UTF-8-encoded surrogates in
# any string. Its printed grammar is rewritten to refuse both (a no-op if the form changes).
_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\uD800-\uDFFF]'


def _valid_json_strings(grammar):
    import xgrammar as xgr

    text = fixed = str(grammar)
    for cls in _STRING_CHARS:
        fixed = fixed.replace(cls, _JSON_STRING_CHAR)
    if fixed == text:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(fixed)
    except Exception:  # noqa: BLE001 - keep xgrammar's own grammar rather than fail
        return grammar


def to_grammar(spec: StructuredSpec):
    """The xgrammar ``Grammar`` of a spec, built without any vocabulary (cheap).

    JSON schemas are compiled strictly (an object without ``additionalProperties``
    takes only its listed properties, as OpenAI's strict mode requires) and with
    compact separators, so a model cannot pad its answer with endless whitespace.
    Raises ValueError naming the problem.
    """
    import xgrammar as xgr

    kind, value = spec.kind, spec.value
    try:
        if kind == "json_object":  # any JSON object (never a bare string or array)
            return _valid_json_strings(xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False))
        if kind == "json_schema":
            return _valid_json_strings(xgr.Grammar.from_json_schema(
                value, any_whitespace=False, strict_mode=True))
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(value)
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(value)
    except Exception as e:  # xgrammar raises RuntimeError/ValueError/its own types
        raise ValueError(f"invalid {kind.replace('_', ' ')}: {explain(e)}") from None
    raise ValueError(f"unknown structured output kind {kind!r}; one of {', '.join(KINDS)}")
