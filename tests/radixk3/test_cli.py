from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from radixk3.cli import main


def test_plan_kimi_k3_tp8_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "kimi-k3", "--tp", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 50e6 <= out["state_bytes_per_request"] <= 58e6
    assert 26e3 <= out["kv_bytes_per_token"] <= 28e3
    assert out["tokens_per_state"] == pytest.approx(out["state_bytes_per_request"] / out["kv_bytes_per_token"])
    assert main(["plan", "--preset", "kimi-k3", "--tp", "8"]) == 0
    text = capsys.readouterr().out
    assert "MB" in text and "KB" in text


def test_plan_rejects_bad_tp(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "kimi-k3", "--tp", "7"]) == 2
    assert "--tp 7" in capsys.readouterr().err


def test_make_checkpoint_then_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-checkpoint", "--preset", "k3-tiny", str(tmp_path / "ck")]) == 0
    assert (tmp_path / "ck" / "config.json").is_file() and (tmp_path / "ck" / "tokenizer.model").is_file()
    capsys.readouterr()
    assert main(["generate", "Natalia sold clips", "--model", str(tmp_path / "ck"), "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("Natalia sold clips")


def test_generate_builtin_and_bad_model_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "Hello", "--max-new-tokens", "4", "--ignore-eos"]) == 0
    assert capsys.readouterr().out.startswith("Hello")
    assert main(["generate", "Hello", "--model", str(tmp_path / "nowhere")]) == 2
    assert "config.json not found" in capsys.readouterr().err


def test_generate_streams_the_engine_greedy_output(capsys: pytest.CaptureFixture[str]) -> None:
    """Through the engine (with ServerArgs flags), the printed text is the prompt + the no-cache greedy loop."""
    from radixk3.config import PRESET_SEED, TINY_PRESET, preset
    from radixk3.model import build_model
    from radixk3.tokenizer import load_tokenizer
    from tests.greedy import greedy_reference

    tok = load_tokenizer()
    prompt = "Natalia sold clips to 48 of her friends"
    ref = greedy_reference(build_model(preset(TINY_PRESET), seed=PRESET_SEED), tok.encode(prompt, add_bos=True), 6)
    expected = prompt + tok.decode(ref) + "\n"
    assert main(["generate", prompt, "--max-new-tokens", "6", "--ignore-eos", "--page-size", "4",
                 "--chunked-prefill-size", "8", "--disable-radix-cache", "--mem-bytes", str(16 << 20)]) == 0
    assert capsys.readouterr().out == expected


def test_generate_rejects_bad_server_args(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "Hello", "--page-size", "0"]) == 2
    assert "--page-size must be >= 1" in capsys.readouterr().err


def test_imports_stay_lazy() -> None:
    """`import radixk3` and building the CLI parser start no runtime: no engine, no ZeroMQ, no scheduler."""
    code = ("import sys, radixk3, radixk3.cli; radixk3.cli.build_parser(); "
            "bad = sorted(m for m in sys.modules if m == 'zmq' or m.startswith('zmq.') or m in "
            "('runtime.tokenizer.engine', 'runtime.scheduler.scheduler', 'runtime.scheduler_main', "
            "'runtime.worker.model_worker')); "
            "print(bad); assert not bad")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    import radixk3
    from runtime.tokenizer.engine import Engine

    assert radixk3.Engine is Engine and "Engine" in radixk3.__all__
    from runtime.errors import EngineError, EngineOverloaded, InvalidRequest

    assert (radixk3.EngineError, radixk3.EngineOverloaded, radixk3.InvalidRequest) == (
        EngineError, EngineOverloaded, InvalidRequest)


GB141 = "141GB"


def _plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", "--preset", "kimi-k3", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _routed_expert_params(cfg: object) -> int:
    """From the config alone: w1, w3 [I, latent] and w2 [latent, I] per expert, in every MoE layer (MTP too)."""
    from radixk3.config import ModelConfig

    assert isinstance(cfg, ModelConfig)
    dim = cfg.routed_expert_hidden_size or cfg.hidden_size
    layers = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers))
    return layers * cfg.num_experts * 3 * cfg.moe_intermediate_size * dim


def test_plan_kimi_k3_on_8_h200_weights_do_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """2.8T parameters: bf16 (or even mxfp4) experts over 8 ranks exceed 141 GB; the plan says so."""
    from radixk3.config import preset

    cfg = preset("kimi-k3")
    out = _plan_json(capsys, "--tp", "8", "--ep", "8", "--mem-bytes", GB141)
    assert out["devices"] == 8 and out["mem_bytes"] == 141 * 10**9
    assert out["weights"]["routed_experts"] == _routed_expert_params(cfg) * 2 // 8
    assert out["pool_bytes"] == 141 * 10**9 - out["weights"]["total"] < 0
    assert out["states_fit"] == out["tokens_fit"] == 0
    assert main(["plan", "--tp", "8", "--ep", "8", "--mem-bytes", GB141, "--expert-format", "mxfp4"]) == 0
    assert "exceed" in capsys.readouterr().out


def test_plan_kimi_k3_on_2x8_h200_matches_the_engine_pool(capsys: pytest.CaptureFixture[str]) -> None:
    """tp 16 with mxfp4 experts fits; states and tokens that fit are what runtime.pool_layout makes of the pool."""
    from radixk3 import plan as plan_mod
    from radixk3.config import preset
    from runtime import pool_layout

    cfg = preset("kimi-k3")
    assert plan_mod.ALIGN == pool_layout.ALIGN
    tp16 = _plan_json(capsys, "--tp", "16", "--ep", "16", "--mem-bytes", GB141, "--expert-format", "mxfp4")
    dpa = _plan_json(capsys, "--tp", "16", "--ep", "16", "--dp", "2", "--enable-dp-attention", "--mem-bytes", GB141,
                     "--expert-format", "mxfp4")
    for out, attn_tp in ((tp16, 16), (dpa, 8)):
        assert out["attn_tp"] == attn_tp and out["devices"] == 16
        assert out["pool_bytes"] == 141 * 10**9 - out["weights"]["total"] > 20e9
        layout = pool_layout.PoolLayout.from_config(cfg, tp=attn_tp)
        geo = layout.geometry(out["pool_bytes"])
        assert out["state_block_bytes"] == layout.state_block_bytes and out["kv_token_bytes"] == layout.kv_token_bytes
        assert (out["states_fit"], out["tokens_fit"]) == (geo.num_state_slots, geo.num_token_slots)
    # DP attention: a state is twice as big per rank (8-way attention), attention weights too; the MoE is not;
    # two groups each hold their own requests and tokens.
    assert dpa["state_block_bytes"] == 2 * tp16["state_block_bytes"]
    assert dpa["kv_token_bytes"] == tp16["kv_token_bytes"]
    assert dpa["weights"]["routed_experts"] == tp16["weights"]["routed_experts"]
    assert dpa["weights"]["sharded"] > tp16["weights"]["sharded"]
    assert dpa["system_states_fit"] == 2 * dpa["states_fit"] and tp16["system_states_fit"] == tp16["states_fit"]
    assert dpa["system_tokens_fit"] > 1.5 * tp16["system_tokens_fit"]
    # Replicas: two independent tp 8 engines on 16 devices, each rank as plain tp 8.
    rep = _plan_json(capsys, "--tp", "8", "--ep", "8", "--dp", "2", "--mem-bytes", GB141)
    assert rep["devices"] == 16 and rep["groups"] == 2 and rep["attn_tp"] == 8
    assert main(["plan", "--tp", "16", "--ep", "16", "--dp", "2", "--enable-dp-attention", "--mem-bytes", GB141,
                 "--expert-format", "mxfp4"]) == 0
    text = capsys.readouterr().out
    assert "DP attention: 2 groups of 8 ranks" in text and "system (2 groups)" in text


def test_plan_weight_bytes_add_up_over_ranks() -> None:
    """Rank shards of every split tensor add up to the unsharded model (k3-tiny: no vocabulary padding); the
    routed experts per rank do not depend on --ep (experts / ep, each split over tp / ep ranks)."""
    from radixk3.config import preset
    from radixk3.model import build_model
    from radixk3.plan import weight_bytes

    for name in ("k3-tiny", "k3-tiny-native", "kimi-k3"):
        cfg = preset(name)
        one = weight_bytes(cfg)
        if name != "kimi-k3":
            assert one.total == sum(p.numel() * p.element_size() for p in build_model(cfg).parameters())
        assert one.replicated == 0 or one.sharded == 0  # unsharded: nothing is "split"
        for tp, ep in ((2, 1), (2, 2)):
            w = weight_bytes(cfg, tp, ep)
            assert w.routed_experts * tp == one.routed_experts
            assert w.sharded * tp + w.replicated == one.total - one.routed_experts
            assert w.replicated > 0 and w.sharded > 0
    assert weight_bytes(preset("kimi-k3"), 8, 1) == weight_bytes(preset("kimi-k3"), 8, 8)


def test_plan_rejects_bad_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--tp", "8", "--ep", "3"]) == 2
    assert "--ep 3 must divide --tp 8" in capsys.readouterr().err
    assert main(["plan", "--tp", "8", "--dp", "3", "--enable-dp-attention"]) == 2
    assert "--dp 3 must divide --tp 8" in capsys.readouterr().err
    assert main(["plan", "--tp", "8", "--mem-bytes", "lots"]) == 2
    assert "--mem-bytes 'lots'" in capsys.readouterr().err
    from radixk3.plan import parse_bytes

    assert parse_bytes("141GB") == parse_bytes("141e9") == 141 * 10**9 and parse_bytes("2GiB") == 2 << 30


def test_plan_imports_no_runtime() -> None:
    code = ("import sys; from radixk3.config import preset; from radixk3.plan import parallel_plan; "
            "parallel_plan(preset('k3-tiny-native'), 2, 2, 2, True, 10**9, 'mxfp4'); "
            "bad = sorted(m for m in sys.modules if m == 'runtime' or m.startswith('runtime.')); print(bad); "
            "assert not bad")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
