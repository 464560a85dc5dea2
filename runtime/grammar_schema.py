"""What the door checks in a JSON schema before xgrammar sees it: its nesting depth and the features xgrammar
would accept but not enforce.

Depth first: xgrammar's schema converter takes time cubic in the nesting (800 levels: tens of seconds, 10,000:
minutes, with an assertion at the end), so a schema nested past `MAX_SCHEMA_DEPTH` levels of JSON objects and
arrays is refused without converting it. Then the features: xgrammar 0.2.9 logs a warning and drops a `$ref` to
anything but this document (`#...`) and an `allOf` of more than one schema (it allows any JSON instead), and
silently ignores `not`, `if`/`then`/`else`, `dependentRequired`/`dependentSchemas`/`dependencies`,
`uniqueItems` and `contains` (it allows outputs the schema forbids, or forbids all but `[]`). Each is refused
naming the keyword. A one-schema `allOf` (as pydantic writes a described `$ref`) is supported, as are local
`$ref`s. Keywords are looked for in subschemas only (walked by `referencing`, the jsonschema project's library),
so a property *named* "not" is no feature.
"""

from __future__ import annotations

from typing import Any

import orjson
import referencing.jsonschema

from runtime.errors import InvalidRequest

MAX_SCHEMA_DEPTH = 64  # levels of nested JSON objects/arrays in a json_schema (OpenAI allows 10 levels of objects)

# Keywords xgrammar does not enforce (beyond allOf and $ref, checked by value), and what the client is told.
_IGNORED = {
    "not": "not", "if": "if/then/else", "then": "if/then/else", "else": "if/then/else",
    "dependentRequired": "dependentRequired", "dependentSchemas": "dependentSchemas", "dependencies": "dependencies",
    "contains": "contains", "minContains": "contains", "maxContains": "contains",
    "$dynamicRef": "$dynamicRef", "$recursiveRef": "$recursiveRef",
}


def schema_too_deep() -> InvalidRequest:
    return InvalidRequest(f"json_schema is nested too deeply: more than {MAX_SCHEMA_DEPTH} levels of objects and "
                          f"arrays (the limit)", param="json_schema")


def _unsupported(feature: str) -> InvalidRequest:
    return InvalidRequest(f"json_schema uses {feature}, which structured output does not support", param="json_schema")


def _depth_within(value: Any, limit: int) -> bool:
    """Whether `value` nests at most `limit` objects/arrays deep (iterative: no recursion limit to hit)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > limit:
                return False
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return True


def _check_features(schema: dict[str, Any]) -> None:
    for key in schema.keys() & _IGNORED.keys():
        raise _unsupported(_IGNORED[key])
    if schema.get("uniqueItems") is True:
        raise _unsupported("uniqueItems")
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise _unsupported("allOf with more than one schema")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise _unsupported(f"a $ref outside the schema ({ref[:80]!r}); only local references (#/...) are resolved")


def vet_json_schema(source: str) -> None:
    """InvalidRequest naming the limit or the feature if `source` (a JSON schema's text) is nested too deeply
    or uses a feature xgrammar would not enforce; text that is not JSON is left to xgrammar's parser."""
    try:
        schema = orjson.loads(source)
    except orjson.JSONDecodeError as e:
        if "depth" in str(e) or "recursion" in str(e).lower():
            raise schema_too_deep() from None
        return  # xgrammar's parser says what is wrong with it
    if not _depth_within(schema, MAX_SCHEMA_DEPTH):
        raise schema_too_deep()
    if not isinstance(schema, dict):
        return
    spec = referencing.jsonschema.specification_with(str(schema.get("$schema", "")),
                                                     default=referencing.jsonschema.DRAFT202012)
    stack: list[Any] = [schema]
    while stack:  # depth is bounded above, but the walk stays iterative anyway
        sub = stack.pop()
        if isinstance(sub, dict):
            _check_features(sub)
            stack.extend(spec.subresources_of(sub))
