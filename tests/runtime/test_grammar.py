"""Structured output (xgrammar): every sample of a regex / JSON schema / EBNF request matches its grammar, greedy
and sampled, through the Engine; invalid grammars are refused at the door naming the field; constrained rows do
not disturb their unconstrained batch-mates; overlap on and off, chunked prefill and retraction give the same
constrained output; the sampler's mask is xgrammar's; the matcher rolls back."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from kernels.sampling import TokenMask, masked_logits, sample
from kernels.sampling_columns import SamplingColumns
from kernels.sampling_tensors import SamplingTensors
from radixk3.tokenizer import load_tokenizer
from runtime.errors import InvalidRequest
from runtime.grammar import GrammarBackend, GrammarKey, fill_masks
from runtime.local_engine import LocalEngine
from runtime.server_args import ServerArgs
from runtime.tokenizer.engine import Engine
from tests.runtime.grammar_cases import EBNF, EBNF_AS_REGEX, MAX_NEW_TOKENS, REGEXES, SCHEMAS

PROMPT = "Question: what is it?\nAnswer:"
SEEDS = {"n": 3, "temperature": 1.0, "seed": 7}  # three sampled outputs, seeds 7, 8, 9


@pytest.fixture(scope="module")
def engine(builtin_engine: Engine) -> Engine:
    return builtin_engine


def outputs(engine: Engine, grammar: dict[str, Any], max_new_tokens: int = MAX_NEW_TOKENS) -> list[dict[str, Any]]:
    """The greedy output and three seeded samples under `grammar`."""
    base = {"max_new_tokens": max_new_tokens} | grammar
    greedy = engine.generate(PROMPT, base | {"temperature": 0})
    return [greedy, *engine.generate(PROMPT, base | SEEDS)]


@pytest.mark.parametrize("pattern", REGEXES)
def test_every_regex_sample_matches(engine: Engine, pattern: str) -> None:
    for out in outputs(engine, {"regex": pattern}):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert re.fullmatch(pattern, out["text"]), (pattern, out["text"])


@pytest.mark.parametrize("schema", SCHEMAS)
def test_every_json_schema_sample_validates(engine: Engine, schema: dict[str, Any]) -> None:
    for as_text in (False, True):  # an object, or the schema as a JSON string (SGLang's form)
        for out in outputs(engine, {"json_schema": json.dumps(schema) if as_text else schema}):
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            jsonschema.validate(json.loads(out["text"]), schema)


def test_every_ebnf_sample_matches(engine: Engine) -> None:
    for out in outputs(engine, {"ebnf": EBNF}):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert re.fullmatch(EBNF_AS_REGEX, out["text"]), out["text"]


def test_any_json_is_valid_json_or_a_valid_prefix(engine: Engine) -> None:
    """json_object (any JSON) need not end within max_new_tokens on random weights: what ended parses, what
    did not is a prefix xgrammar's JSON grammar accepts."""
    backend = GrammarBackend(load_tokenizer(), engine.tm.vocab_size, [3])
    compiled = backend.compile(GrammarKey("json_schema", "$$ANY$$"))
    for out in outputs(engine, {"json_schema": "$$ANY$$"}, max_new_tokens=24):
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            json.loads(out["text"])
        else:
            m = backend.matcher(compiled)
            assert all(m.accept(t) for t in out["output_ids"]), out["text"]


@pytest.mark.parametrize(("sampling", "param", "needle"), [
    ({"regex": "a(b"}, "regex", "parenthesis is not closed"),
    ({"regex": "[z-a]"}, "regex", "invalid regex"),
    ({"json_schema": '{"type": "object"'}, "json_schema", "Failed to parse JSON"),
    ({"json_schema": {"type": 5}}, "json_schema", "Type should be a string"),
    ({"ebnf": "root ::= foo"}, "ebnf", 'Rule "foo" is not defined'),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "at most one of regex, json_schema, ebnf"),
    ({"regex": 5}, "regex", "regex must be a non-empty string"),
    ({"json_schema": ""}, "json_schema", "json_schema must be a non-empty string or a JSON object"),
])
def test_invalid_grammar_is_refused_at_the_door(engine: Engine, sampling: dict[str, Any], param: str,
                                                needle: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        engine.generate(PROMPT, {"max_new_tokens": 4} | sampling)
    assert e.value.param == param and needle in e.value.message, (e.value.param, e.value.message)
    assert "/project/" not in e.value.message  # xgrammar's C++ source location is cut off
    ok = engine.generate(PROMPT, {"max_new_tokens": 16, "temperature": 0, "regex": REGEXES[0]})
    assert re.fullmatch(REGEXES[0], ok["text"])


def test_a_grammar_left_with_only_surrogates_ends_with_an_error_saying_so(engine: Engine) -> None:
    """A regex of UTF-16 surrogates (which well-formed UTF-8 cannot hold) passes xgrammar but dead-ends under the
    UTF-8 narrowing: the request ends with an error that says why, and the engine serves on."""
    out = engine.generate(PROMPT, {"max_new_tokens": 8, "temperature": 1.0, "seed": 1, "regex": r"[\ud800-\udfff]"})
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "error" and "not well-formed UTF-8" in meta["error"], meta
    ok = engine.generate(PROMPT, {"max_new_tokens": 16, "temperature": 0, "regex": REGEXES[0]})
    assert re.fullmatch(REGEXES[0], ok["text"])


# --- the scheduler and worker, in process ------------------------------------------------------------------

TOK = load_tokenizer()
PROMPTS = [TOK.encode(p, add_bos=True) for p in ("Natalia sold clips", "Weng earns $12 an hour", "Betty")]
PLAIN = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def local_args(**kw: Any) -> ServerArgs:
    """An in-process engine's settings with one grammar compile worker: each engine starts its own pool, each
    worker a process importing torch, and the pool's size is not what these tests check (test_grammar_limits)."""
    return ServerArgs(grammar_compile_workers=1, **kw)


def constrained_requests() -> list[dict[str, Any]]:
    return ([{"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "regex": r} for r in REGEXES]
            + [{"max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0, "seed": s, "json_schema": SCHEMAS[1]}
               for s in (1, 2)])


def run_local(args: ServerArgs, requests: list[tuple[list[int], dict[str, Any]]], **kw: Any) -> list[list[int]]:
    eng = LocalEngine(args, check=True, **kw)
    rids = [eng.submit(p, sp) for p, sp in requests]
    outs = eng.run()
    assert all(outs[r][-1].finished in ("stop", "length") for r in rids), outs
    return [[t for o in outs[r] for t in o.token_ids] for r in rids]


def check_constrained(texts: list[list[int]]) -> None:
    for ids, sp in zip(texts, constrained_requests(), strict=True):
        text = TOK.decode(ids)
        if "regex" in sp:
            assert re.fullmatch(sp["regex"], text), text
        else:
            jsonschema.validate(json.loads(text), sp["json_schema"])


def test_constrained_rows_leave_their_batch_mates_unchanged() -> None:
    args = local_args()
    alone = run_local(args, [(p, PLAIN) for p in PROMPTS])
    mixed = [(PROMPTS[i % 3], sp) for i, sp in enumerate(constrained_requests())]
    together = run_local(args, [(p, PLAIN) for p in PROMPTS] + mixed)
    assert together[:3] == alone
    check_constrained(together[3:])


def test_overlap_chunked_prefill_and_retraction_give_the_same_constrained_output() -> None:
    long_prompt = TOK.encode("Natalia sold clips to 48 of her friends in April, and then she sold half", add_bos=True)
    reqs = [(long_prompt, sp) for sp in constrained_requests()]
    sent_in_flight: list[int] = []

    def record(eng: LocalEngine) -> None:
        send = eng.loop.send
        eng.loop.send = lambda plan: (sent_in_flight.append(eng.scheduler.steps_in_flight), send(plan))[1]

    def recorded(args: ServerArgs) -> list[list[int]]:
        eng = LocalEngine(args, check=True)
        record(eng)
        rids = [eng.submit(p, sp) for p, sp in reqs]
        outs = eng.run()
        return [[t for o in outs[r] for t in o.token_ids] for r in rids]

    overlapped = recorded(local_args())
    # A constrained decode is planned only once the step before it is resolved: never two steps in flight.
    assert max(sent_in_flight) == 1
    check_constrained(overlapped)
    assert run_local(local_args(disable_overlap_schedule=True), reqs) == overlapped
    assert run_local(local_args(chunked_prefill_size=8), reqs) == overlapped


def test_retracted_requests_keep_their_grammar_state() -> None:
    # Admission reserves no decode tokens (conservativeness 0): 150-digit outputs outgrow the pool and retract.
    prompts = [list(range(40 * i, 40 * i + 40)) for i in range(1, 4)]
    reqs = [(p, {"max_new_tokens": 160, "temperature": 1.0, "seed": i, "regex": "[0-9]{150}"})
            for i, p in enumerate(prompts)]
    free = run_local(local_args(), reqs)
    eng = LocalEngine(local_args(mem_bytes=120_000, chunked_prefill_size=16, schedule_conservativeness=0.0),
                      check=True)
    rids = [eng.submit(p, sp) for p, sp in reqs]
    outs = eng.run()
    assert eng.scheduler.metrics.retractions > 0
    assert [[t for o in outs[r] for t in o.token_ids] for r in rids] == free
    assert all(re.fullmatch("[0-9]{150}", TOK.decode(ids)) for ids in free)


def test_unconstrained_batches_stay_overlapped() -> None:
    eng = LocalEngine(ServerArgs())
    seen: list[int] = []
    send = eng.loop.send
    eng.loop.send = lambda plan: (seen.append(eng.scheduler.steps_in_flight), send(plan))[1]
    [eng.submit(p, PLAIN) for p in PROMPTS]
    eng.run()
    assert max(seen) == 2


# --- the mask and the matcher --------------------------------------------------------------------------


def test_sampler_mask_is_xgrammars_and_leaves_logprobs_alone() -> None:
    import xgrammar as xgr

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1000, generator=g)
    full = torch.randint(-(2**31), 2**31 - 1, (4, 32), dtype=torch.int32, generator=g)
    rows = torch.tensor([1, 3])
    bitmask = full[rows]  # the plan carries the constrained rows' bitmask only
    ours = masked_logits(logits, TokenMask(rows, bitmask))
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, full, indices=[1, 3])
    assert torch.equal(ours, theirs)
    for temperature in (0.0, 1.0):
        params = SamplingColumns.of(4, temperature=temperature, seed=list(range(4)), top_p=0.9)
        res = sample(logits, SamplingTensors.from_columns(params, "cpu"), mask=TokenMask(rows, bitmask))
        allowed = torch.isfinite(ours)
        assert all(bool(allowed[i, t]) for i, t in enumerate(res.tokens.tolist()))
        assert torch.allclose(res.logprobs, logits.log_softmax(-1).gather(1, res.tokens[:, None])[:, 0])


def test_matcher_accepts_rolls_back_and_terminates() -> None:
    backend = GrammarBackend(TOK, 4096, TOK.stop_ids)
    m = backend.matcher(backend.compile(GrammarKey("regex", "ab|ac")))
    start = fill_masks([m]).copy()
    a, b = TOK.encode("a"), TOK.encode("b")
    assert len(a) == len(b) == 1
    assert m.accept(a[0]) and not m.accept(a[0])  # "aa" is not in the language
    m.rollback(1)
    assert (fill_masks([m]) == start).all()
    assert m.accept(a[0]) and m.accept(b[0]) and not m.terminated
    assert m.accept(TOK.eos_id) and m.terminated


@pytest.mark.parametrize("bounds", [{}, {"maxLength": 8}, {"minLength": 1, "maxLength": 8}])
def test_json_strings_never_admit_control_characters(bounds: dict[str, int]) -> None:
    """Strict JSON has no raw U+0000-U+001F inside strings (xgrammar 0.2.9's length-bounded strings let them
    in; the backend narrows them): after the opening quote no allowed token holds such a byte."""
    tok = load_tokenizer()
    backend = GrammarBackend(tok, tok.vocab_size, tok.stop_ids)
    m = backend.matcher(backend.compile(GrammarKey("json_schema", json.dumps({"type": "string", **bounds}))))
    assert m.accept(tok.encode('"')[-1])
    words = fill_masks([m])[0]
    allowed = [t for t in range(tok.vocab_size) if (int(words[t // 32]) >> (t % 32)) & 1]
    assert len(allowed) > 100  # letters, digits, pieces: the mask is not trivially empty
    assert not [t for t in allowed if any(b < 0x20 for b in tok.token_bytes(t))]
    backend.close()
