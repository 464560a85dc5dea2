"""Checkpoints in the published layout, written by `radixk3 make-checkpoint --tokenizer ...`, served as a user's
download would be: a native K3 (`k3-tiny-native`, Kimi's tiktoken files, 3 shards, MXFP4 routed experts, its MTP
layer's too) through the whole engine exactness matrix, MTP speculation, DP attention with expert parallelism, a
frontend program, the HTTP server (native and OpenAI APIs, K3's chat encoding, tools, structured output, the
`openai` client) and the gsm8k harness; a Kimi-Linear one
(`k3-tiny`, tiktoken, INT4 experts, Kimi's Jinja template) served through its template, natively and with
`--tokenizer-mode hf` on a transformers tokenizer of the same vocabulary that carries the template."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from radixk3.chat_template import CHAT_TEMPLATE_FILE
from radixk3.checkpoint import INDEX_FILE, load_model
from radixk3.cli import main
from radixk3.config_formats import load_model_config
from radixk3.generation_config import GenerationConfig, load_generation_config
from radixk3.model import KimiForCausalLM
from radixk3.tiktoken_tokenizer import KIMI_PAT_STR, TiktokenTokenizer
from radixk3.tiktoken_writer import TINY_TIKTOKEN_BASE, TINY_TIKTOKEN_VOCAB_SIZE
from radixk3.tokenizer import load_tokenizer
from runtime.local_engine import LocalEngine
from runtime.server_args import ServerArgs
from runtime.tokenizer.engine import Engine
from runtime.tokenizer.k3_encoding import K3ChatOptions, render_k3_chat
from tests.greedy import greedy_reference
from tests.runtime.http_server_proc import Server, running_server
from tests.runtime.test_engine_exactness import CONFIGS, GREEDY, MAX_NEW, _waves

ROOT = Path(__file__).resolve().parents[2]
MEM = str(16 << 20)
NAME = "published"
PROMPT = "Natalia sold clips to 48 of her friends in April \u4e2d\u6587 \U0001f600"
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": WEATHER}}]


def make_checkpoint(out: Path, *flags: str) -> Path:
    assert main(["make-checkpoint", str(out), *flags]) == 0
    return out


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("published") / "k3", "--preset", "k3-tiny-native", "--tokenizer",
                           "tiktoken", "--shards", "3", "--expert-format", "mxfp4", "--seed", "12")


@pytest.fixture(scope="module")
def k3_model(k3_dir: Path) -> KimiForCausalLM:
    return load_model(k3_dir)


def test_the_directory_holds_what_a_published_checkpoint_holds(k3_dir: Path, k3_model: KimiForCausalLM) -> None:
    assert not (k3_dir / "tokenizer.model").exists() and not (k3_dir / CHAT_TEMPLATE_FILE).exists()
    raw = json.loads((k3_dir / "config.json").read_text())
    assert raw["model_type"] == "kimi_k3" and "text_config" in raw
    quant = raw["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["format"] == "mxfp4-pack-quantized"
    files = set(json.loads((k3_dir / INDEX_FILE).read_text())["weight_map"].values())
    assert files == {f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)}
    tok = load_tokenizer(k3_dir)
    assert isinstance(tok, TiktokenTokenizer) and tok.vocab_size == TINY_TIKTOKEN_VOCAB_SIZE
    cfg = load_model_config(k3_dir)
    assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        TINY_TIKTOKEN_VOCAB_SIZE, tok.bos_id, tok.eos_id, tok.pad_id)
    assert cfg.vision is not None and cfg.vision.media_placeholder_token_id == TINY_TIKTOKEN_BASE + 21
    gen = load_generation_config(k3_dir)
    assert gen.eos_token_ids == (tok.end_of_msg_id,) and gen.sampling == {"temperature": 1.0, "top_p": 0.95}
    # Packed in memory, the MTP layer's experts too.
    assert k3_model.config.expert_quant is not None and k3_model.config.expert_quant.kind == "mxfp4"
    assert k3_model.model.mtp_layers[0].block_sparse_moe.experts.quant is not None


def test_the_sentencepiece_layout(tmp_path: Path) -> None:
    """The built-in tokenizer in the same layout: the preset's vocabulary, Kimi's template for the Kimi-Linear
    format, generation_config.json ending at `<|im_end|>`, FP8 experts over 2 shards."""
    out = make_checkpoint(tmp_path / "sp", "--preset", "k3-tiny", "--tokenizer", "sentencepiece", "--expert-format",
                          "fp8", "--shards", "2")
    assert (out / "tokenizer.model").is_file() and (out / CHAT_TEMPLATE_FILE).is_file()
    assert not (out / "tiktoken.model").exists() and (out / INDEX_FILE).is_file()
    tok = load_tokenizer(out)
    cfg = load_model(out).config
    assert cfg.vocab_size == tok.vocab_size and cfg.expert_quant is not None and cfg.expert_quant.kind == "fp8"
    assert load_generation_config(out) == GenerationConfig({"temperature": 0.6, "top_p": 1.0}, (tok.im_end_id,))


def test_bad_combinations_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-checkpoint", str(tmp_path / "d"), "--preset", "k3-tiny-dspark", "--expert-format", "mxfp4"]) == 2
    assert "DSpark drafter" in capsys.readouterr().err
    assert main(["make-checkpoint", str(tmp_path / "d"), "--preset", "k3-tiny-dspark", "--tokenizer", "tiktoken"]) == 2
    assert main(["make-checkpoint", str(tmp_path / "k"), "--preset", "kimi-k3", "--tokenizer", "tiktoken"]) == 2
    assert "true-size" in capsys.readouterr().err


# --- the engine exactness matrix -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workload(k3_model: KimiForCausalLM) -> tuple[list, list]:
    """test_engine_exactness's waves, every other prompt (the module's run time), and their no-cache greedy
    outputs, each computed once."""
    memo: dict[tuple[int, ...], list[int]] = {}

    def reference(wave: list[list[int]]) -> list[list[int]]:
        for p in wave:
            if tuple(p) not in memo:
                memo[tuple(p)] = greedy_reference(k3_model, p, MAX_NEW)
        return [memo[tuple(p)] for p in wave]

    waves = [w[::2] for w in _waves(k3_model, reference)]
    return waves, [reference(w) for w in waves]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_matrix_equals_the_no_cache_forward(name: str, k3_dir: Path, k3_model: KimiForCausalLM,
                                                  workload: tuple[list, list]) -> None:
    waves, refs = workload
    eng = LocalEngine(ServerArgs(model=str(k3_dir), **CONFIGS[name]), k3_model, check=True)
    for wave, ref in zip(waves, refs, strict=True):
        assert eng.generate(wave, GREEDY) == ref
    if name != "no_radix":
        assert eng.scheduler.metrics.cached_tokens > 0
    assert not eng.scheduler.running and not eng.scheduler.waiting
    eng.scheduler.grammar.close()


def test_mtp_speculation_equals_the_no_cache_forward(k3_dir: Path, k3_model: KimiForCausalLM) -> None:
    from tests.runtime.test_spec_mtp import GREEDY as MTP_GREEDY
    from tests.runtime.test_spec_mtp import _workload

    prompts, refs = _workload(k3_model)
    eng = LocalEngine(ServerArgs(model=str(k3_dir), speculative_algorithm="mtp", speculative_num_draft_tokens=3),
                      k3_model, check=True)
    assert eng.generate(prompts, MTP_GREEDY) == refs
    assert eng.scheduler.metrics.verify_steps > 0 and eng.scheduler.metrics.draft_tokens > 0
    eng.scheduler.grammar.close()


def test_dp_attention_with_expert_parallelism_equals_the_no_cache_forward(k3_dir: Path,
                                                                         workload: tuple[list, list]) -> None:
    """--tp 2 --ep 2 --dp 2 --enable-dp-attention on the packed directory: two attention groups of one rank, the
    MXFP4 experts split whole between the ranks (a TP cut would split their 32-wide scale groups)."""
    waves, refs = workload
    engine = Engine(str(k3_dir), mem_bytes=int(MEM), tp_size=2, ep_size=2, dp_size=2, enable_dp_attention=True)
    try:
        for wave, ref in zip(waves[:2], refs[:2], strict=True):
            assert [r["output_ids"] for r in engine.generate(wave, GREEDY, timeout=120)] == ref
        assert all(d["prompt_tokens"] > 0 for d in engine.get_metrics()["dp_ranks"])
    finally:
        engine.shutdown()


def test_a_frontend_program(k3_dir: Path, k3_model: KimiForCausalLM) -> None:
    """SGLang-style programs on the directory: the tokenizer is its tiktoken one; select scores each choice as the
    packed model's no-cache forward does."""
    import frontend_lang as sgl
    from tests.frontend_lang.oracle import choice_logprobs
    from tests.frontend_lang.programs import CHOICES, PREFIX, pick

    runtime = sgl.Runtime(model_path=k3_dir, mem_bytes=int(MEM))
    try:
        assert isinstance(runtime.tokenizer, TiktokenTokenizer)
        truth = [choice_logprobs(k3_model, runtime.tokenizer, PREFIX, c) for c in CHOICES]
        means = [sum(t) / len(t) for t in truth]
        state = pick.run(prefix=PREFIX, choices=CHOICES, backend=runtime)
        got = state.get_meta_info("pick")["input_token_logprobs"]
        for lps, want in zip(got, truth, strict=True):
            assert [lp for lp, _ in lps] == pytest.approx(want, abs=1e-4)
        assert state["pick"] == CHOICES[means.index(max(means))]
    finally:
        runtime.shutdown()


# --- HTTP ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k3_server(k3_dir: Path) -> Iterator[Server]:
    with running_server("--model-path", str(k3_dir), "--mem-bytes", MEM, "--served-model-name", NAME) as server:
        yield server


def chat(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": NAME} | body)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_full_and_streamed(k3_server: Server, k3_dir: Path, k3_model: KimiForCausalLM) -> None:
    tok = load_tokenizer(k3_dir)
    ref = greedy_reference(k3_model, tok.encode(PROMPT, add_bos=True), 12)
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with k3_server.client() as c:
        full = c.post("/generate", json={"text": PROMPT, "sampling_params": params}).json()
        with c.stream("POST", "/generate", json={"text": PROMPT, "sampling_params": params, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert full["output_ids"] == ref and full["text"] == tok.decode(ref)
    assert events[-1]["text"] == full["text"]


def test_chat_renders_in_the_k3_encoding(k3_server: Server, k3_dir: Path) -> None:
    tok = load_tokenizer(k3_dir)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi <|end_of_msg|> \u4e2d\u6587"}]
    body = chat(k3_server, {"messages": messages, "max_tokens": 3, "temperature": 0})
    assert body["usage"]["prompt_tokens"] == len(render_k3_chat(messages).ids(tok))


def test_a_forced_tool_call_is_parsed(k3_server: Server, k3_dir: Path) -> None:
    # Room for the markup spelled out in characters, should the untrained model not pick the marker ids.
    body = chat(k3_server, {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "reasoning_effort": "none",
                            "parallel_tool_calls": False, "temperature": 0, "max_tokens": 400})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")
    options = K3ChatOptions(thinking=False, tool_choice="required")
    assert body["usage"]["prompt_tokens"] == len(render_k3_chat(ASK, TOOLS, options).ids(load_tokenizer(k3_dir)))


def test_json_schema_with_thinking_off(k3_server: Server) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    body = chat(k3_server, {"messages": ASK, "response_format": fmt, "chat_template_kwargs": {"thinking": False},
                            "temperature": 0, "max_tokens": 60})
    assert body["choices"][0]["finish_reason"] == "stop", body
    assert isinstance(json.loads(body["choices"][0]["message"]["content"])["n"], int)


def test_the_openai_client(k3_server: Server, k3_dir: Path) -> None:
    client = openai.OpenAI(base_url=f"{k3_server.url}/v1", api_key="none", timeout=60.0)
    r = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=4, temperature=0,  # type: ignore[arg-type]
                                       reasoning_effort="none")
    assert r.usage is not None and r.usage.completion_tokens <= 4
    c = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    assert c.choices[0].text is not None
    # The model path names the served model too (as in SGLang), answered under the served name.
    assert client.completions.create(model=str(k3_dir), prompt=PROMPT, max_tokens=1).model == NAME


# --- the gsm8k harness -----------------------------------------------------------------------------------


def test_gsm8k_harness(k3_dir: Path, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gsm8k.py"), "--backend", "engine", "--model",
                           str(k3_dir), "--num-questions", "8", "--max-new-tokens", "8", "--mem-mib", "64", "--json",
                           "--no-progress", "--result-file", str(tmp_path / "r.jsonl")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["num_questions"] == 8 and 0 < out["output_tokens"] <= 8 * 8
    assert out["cache_hit_rate"] > 0


# --- a Kimi-Linear published directory: its Jinja template ------------------------------------------------


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, PreTrainedTokenizerFast]:
    """The published directory (tiktoken, INT4 experts, Kimi's template) and a copy whose tokenizer is a
    transformers one of the same vocabulary carrying that template (what `--tokenizer-mode hf` loads)."""
    root = tmp_path_factory.mktemp("kimi-linear")
    native = make_checkpoint(root / "native", "--preset", "k3-tiny", "--tokenizer", "tiktoken", "--expert-format",
                             "int4", "--shards", "2", "--seed", "4")
    assert (native / CHAT_TEMPLATE_FILE).is_file() and load_model_config(native).expert_quant is not None
    tok = load_tokenizer(native)
    assert load_generation_config(native).eos_token_ids == (tok.im_end_id,)
    names = [tok.decode([i], skip_special_tokens=False) for i in range(tok.base_vocab_size, tok.vocab_size)]
    converted = TikTokenConverter(str(native / "tiktoken.model"), pattern=KIMI_PAT_STR,
                                  extra_special_tokens=names).converted()
    hf = PreTrainedTokenizerFast(tokenizer_object=converted, bos_token="[BOS]", eos_token="[EOS]",
                                 pad_token="[PAD]", unk_token="[UNK]")
    hf.chat_template = (native / CHAT_TEMPLATE_FILE).read_text()
    hf_dir = root / "hf"
    shutil.copytree(native, hf_dir)
    for name in ("tiktoken.model", "tokenizer_config.json", CHAT_TEMPLATE_FILE):
        (hf_dir / name).unlink()
    hf.save_pretrained(str(hf_dir))
    return native, hf_dir, hf


CONVERSATION = [{"role": "system", "content": "You are Kimi."}, {"role": "user", "content": "Hi \u4e2d\u6587"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Weather in Oslo?"}]


def transformers_count(hf: PreTrainedTokenizerFast, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None) -> int:
    return len(hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=False))


@pytest.mark.parametrize("mode", ["native", "hf"])
def test_kimi_linear_chat_through_its_template(mode: str, kimi_linear: tuple[Path, Path, PreTrainedTokenizerFast]
                                               ) -> None:
    native, hf_dir, hf = kimi_linear
    model_dir = native if mode == "native" else hf_dir
    with running_server("--model-path", str(model_dir), "--mem-bytes", MEM, "--tokenizer-mode", mode,
                        "--served-model-name", NAME) as server:
        plain = chat(server, {"messages": CONVERSATION, "max_tokens": 4, "temperature": 0})
        tooled = chat(server, {"messages": ASK, "tools": TOOLS, "max_tokens": 4, "temperature": 0})
        with server.client() as c:
            gen = c.post("/generate", json={"text": PROMPT, "sampling_params": {
                "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}).json()
    assert plain["usage"]["prompt_tokens"] == transformers_count(hf, CONVERSATION)
    assert tooled["usage"]["prompt_tokens"] == transformers_count(hf, ASK, TOOLS)
    ids = load_tokenizer(model_dir, mode).encode(PROMPT, add_bos=True)
    assert gen["output_ids"] == greedy_reference(load_model(native), ids, 6)
