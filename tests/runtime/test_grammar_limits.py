"""The scheduler's compiled-grammar cache is bounded in bytes (xgrammar's estimate) and `flush_cache` empties it;
the door's schema checks refuse what xgrammar would not enforce and nothing it does."""

from __future__ import annotations

import json
from typing import Any

import pytest

from radixk3.tokenizer import load_tokenizer
from runtime.errors import InvalidRequest
from runtime.grammar import GrammarBackend, GrammarKey, check_grammar
from runtime.local_engine import LocalEngine
from runtime.server_args import ServerArgs

TOK = load_tokenizer()


def enum_schema(i: int) -> dict[str, Any]:
    return {"enum": [f"value {i:03d} {j:03d}" for j in range(40)]}  # distinct, and alike in size


def test_the_compiled_grammar_cache_stays_under_its_bytes_and_flush_empties_it() -> None:
    probe = GrammarBackend(TOK, TOK.vocab_size, TOK.stop_ids)
    one = probe.compile(GrammarKey("json_schema", json.dumps(enum_schema(999)))).memory_size_bytes
    probe.close()
    bound = int(3.5 * one)
    eng = LocalEngine(ServerArgs(grammar_cache_bytes=bound))
    prompt = TOK.encode("Betty", add_bos=True)
    rids = [eng.submit(prompt, {"max_new_tokens": 24, "temperature": 0, "json_schema": enum_schema(i)})
            for i in range(10)]
    outs = eng.run()
    assert all(outs[r][-1].finished in ("stop", "length") for r in rids), outs
    cache = eng.scheduler.grammar.cache
    assert 0 < cache.bytes <= bound and 0 < len(cache) < 10, (cache.bytes, len(cache), bound)
    assert eng.scheduler.flush_cache()
    assert cache.bytes == 0 and len(cache) == 0
    eng.scheduler.grammar.close()


@pytest.mark.parametrize("schema", [
    {"$defs": {"b": {"type": "boolean"}}, "$ref": "#/$defs/b"},
    {"allOf": [{"type": "boolean"}]},
    {"type": "object", "properties": {"not": {"type": "boolean"}, "allOf": {"type": "integer"}}},
    {"enum": [{"not": 1, "$ref": "http://x"}]},  # values, not subschemas
])
def test_supported_schemas_pass_the_door(schema: dict[str, Any]) -> None:
    check_grammar(GrammarKey("json_schema", json.dumps(schema)))


@pytest.mark.parametrize(("schema", "feature"), [
    ({"if": {"type": "string"}, "then": {"minLength": 3}}, "if/then/else"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"$ref": "https://example.com/s.json"}]}}}, "$ref outside"),
])
def test_unenforced_schema_features_are_refused_at_the_door(schema: dict[str, Any], feature: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        check_grammar(GrammarKey("json_schema", json.dumps(schema)))
    assert e.value.param == "json_schema" and feature in e.value.message, e.value.message
