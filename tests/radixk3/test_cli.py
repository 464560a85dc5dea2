from __future__ import annotations

import json
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
