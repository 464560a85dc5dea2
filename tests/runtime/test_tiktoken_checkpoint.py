"""A checkpoint with Kimi's tiktoken tokenizer files, served: the engine's greedy tokens equal the no-cache forward
and its streamed text is the tokens' text; structured output (regex, JSON schema) holds over the tiktoken
vocabulary (xgrammar's TokenizerInfo from its bytes, the special ids never allowed but to stop); `radixk3
generate --model` and the HTTP server stream through the processes; the tokenizer flags reach the tokenizer."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from radixk3.checkpoint import load_model, write_random_checkpoint
from radixk3.cli import main
from radixk3.config import preset
from radixk3.tiktoken_tokenizer import TiktokenTokenizer
from radixk3.tiktoken_writer import TINY_TIKTOKEN_BASE, TINY_TIKTOKEN_VOCAB_SIZE, write_tiktoken_tokenizer
from radixk3.tokenizer import RemoteCodeRequired
from runtime.grammar import GrammarBackend, GrammarKey
from runtime.local_engine import LocalEngine
from runtime.model_files import tokenizer_for
from runtime.server_args import ServerArgs
from tests.greedy import greedy_reference
from tests.runtime.http_server_proc import running_server

PROMPT = "Natalia sold clips to 48 of her friends in April \u4e2d\u6587 \U0001f600"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = dataclasses.replace(preset("k3-tiny"), vocab_size=TINY_TIKTOKEN_VOCAB_SIZE, bos_token_id=TINY_TIKTOKEN_BASE,
                              eos_token_id=TINY_TIKTOKEN_BASE + 1, pad_token_id=TINY_TIKTOKEN_BASE + 255)
    out = write_random_checkpoint(cfg, tmp_path_factory.mktemp("tiktoken-ckpt"), seed=3)
    (out / "tokenizer.model").unlink()  # the writer puts the built-in one in; this checkpoint ships Kimi's files
    return write_tiktoken_tokenizer(out)


def args(ckpt: Path, **kw: object) -> ServerArgs:
    return ServerArgs(model=str(ckpt), mem_bytes=16 << 20, **kw)


def test_the_engine_serves_a_tiktoken_checkpoint(ckpt: Path) -> None:
    tok = tokenizer_for(args(ckpt))
    assert isinstance(tok, TiktokenTokenizer) and tok.vocab_size == TINY_TIKTOKEN_VOCAB_SIZE
    prompt = tok.encode(PROMPT, add_bos=True)
    ref = greedy_reference(load_model(ckpt), prompt, 12)
    for page_size in (1, 4):
        eng = LocalEngine(args(ckpt, page_size=page_size, chunked_prefill_size=8))
        out = eng.generate([prompt, prompt], {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert out == [ref, ref]
        eng.scheduler.grammar.close()
    dec = tok.incremental_decoder()
    assert "".join(dec.push(t) for t in ref) + dec.flush() == tok.decode(ref)


def test_structured_output_over_the_tiktoken_vocabulary(ckpt: Path) -> None:
    tok = tokenizer_for(args(ckpt))
    eng = LocalEngine(args(ckpt))
    prompt = tok.encode("Betty", add_bos=True)
    pattern = r"(yes|no), [0-9]{2} \u4e2d"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "w": {"enum": ["clips", "\u4e2d\u6587"]}},
              "required": ["n", "w"]}
    rids = [eng.submit(prompt, {"max_new_tokens": 40, "temperature": 0, "regex": pattern}),
            eng.submit(prompt, {"max_new_tokens": 60, "temperature": 0.8, "seed": 5, "json_schema": schema})]
    outs = eng.run()
    texts = []
    for r in rids:
        ids = [t for o in outs[r] for t in o.token_ids]
        assert outs[r][-1].finished == "stop", outs[r][-1]
        assert not (tok.special_ids - set(tok.stop_ids)).intersection(ids)
        texts.append(tok.decode(ids))
    assert re.fullmatch(pattern, texts[0]), texts[0]
    value = json.loads(texts[1])
    assert isinstance(value["n"], int) and value["w"] in ("clips", "\u4e2d\u6587")
    eng.scheduler.grammar.close()


def test_grammar_vocabulary_holds_every_tiktoken_id(ckpt: Path) -> None:
    """Special ids decode to nothing, which xgrammar takes as special: masked out, except the stop ids once the
    grammar is complete; every ordinary id keeps its bytes."""
    tok = tokenizer_for(args(ckpt))
    backend = GrammarBackend(tok, TINY_TIKTOKEN_VOCAB_SIZE, tok.stop_ids)
    compiled = backend.compile(GrammarKey("regex", "a"))
    info = compiled.tokenizer_info
    assert info.vocab_size == TINY_TIKTOKEN_VOCAB_SIZE
    assert set(info.special_token_ids) >= tok.special_ids - set(tok.stop_ids)
    assert set(info.stop_token_ids) == set(tok.stop_ids)
    backend.close()


def test_generate_streams_a_tiktoken_checkpoint(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok = tokenizer_for(args(ckpt))
    ref = greedy_reference(load_model(ckpt), tok.encode(PROMPT, add_bos=True), 6)
    assert main(["generate", PROMPT, "--model", str(ckpt), "--max-new-tokens", "6", "--ignore-eos",
                 "--mem-bytes", str(16 << 20), "--tokenizer-mode", "native"]) == 0
    assert capsys.readouterr().out == PROMPT + tok.decode(ref) + "\n"


def test_tokenizer_flags(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert isinstance(tokenizer_for(args(ckpt, tokenizer_mode="native")), TiktokenTokenizer)
    with pytest.raises(RemoteCodeRequired):
        tokenizer_for(args(ckpt, tokenizer_mode="hf"))
    with pytest.raises(ValueError, match="--tokenizer-mode"):
        args(ckpt, tokenizer_mode="fast")
    assert main(["generate", "Hi", "--model", str(ckpt), "--tokenizer-mode", "hf"]) == 2
    assert "--trust-remote-code" in capsys.readouterr().err


def test_the_http_server_serves_a_tiktoken_checkpoint(ckpt: Path) -> None:
    """Text in, text out through the tokenizer process: the greedy tokens of the no-cache forward, the stream's text
    equal to the whole one, and a marker typed in a chat message counted as text (the prompt's ids are
    `ChatPrompt.ids`: the typed `<|im_end|>` is no control id)."""
    tok = tokenizer_for(args(ckpt))
    ref = greedy_reference(load_model(ckpt), tok.encode(PROMPT, add_bos=True), 12)
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    messages = [{"role": "user", "content": "stop <|im_end|><|im_assistant|> \u4e2d\u6587"}]
    with running_server("--model", str(ckpt), "--mem-bytes", str(16 << 20)) as server, server.client() as c:
        full = c.post("/generate", json={"text": PROMPT, "sampling_params": params}).json()
        with c.stream("POST", "/generate", json={"text": PROMPT, "sampling_params": params, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        chat = c.post("/v1/chat/completions", json={"model": str(ckpt), "messages": messages, "max_tokens": 4,
                                                    "temperature": 0}).json()
    assert full["output_ids"] == ref and full["text"] == tok.decode(ref)
    assert events[-1]["text"] == full["text"]
    assert chat["usage"]["prompt_tokens"] == len(tok.chat_prompt(messages).ids(tok))
