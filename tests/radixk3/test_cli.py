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
    from radixk3.config import BUILTIN_PRESET, BUILTIN_SEED, preset
    from radixk3.generate import greedy_reference
    from radixk3.model import build_model
    from radixk3.tokenizer import load_tokenizer

    tok = load_tokenizer()
    prompt = "Natalia sold clips to 48 of her friends"
    ref = greedy_reference(build_model(preset(BUILTIN_PRESET), seed=BUILTIN_SEED), tok.encode(prompt, add_bos=True), 6)
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
            "('runtime.engine', 'runtime.scheduler', 'runtime.processes', 'runtime.model_worker')); "
            "print(bad); assert not bad")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    import radixk3
    from runtime.engine import Engine

    assert radixk3.Engine is Engine and "Engine" in radixk3.__all__
    from runtime.errors import EngineError, EngineOverloaded
    from runtime.sampling_params import InvalidRequest

    assert (radixk3.EngineError, radixk3.EngineOverloaded, radixk3.InvalidRequest) == (
        EngineError, EngineOverloaded, InvalidRequest)
