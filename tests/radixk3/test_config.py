from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixk3.config import PRESETS, ConfigError, preset
from radixk3.config_formats import load_model_config, model_config_from_dict, model_config_to_dict


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_config_json(name: str) -> None:
    cfg = preset(name)
    assert model_config_from_dict(json.loads(json.dumps(model_config_to_dict(cfg)))) == cfg


def test_k3_small_is_the_design_card_model() -> None:
    c = preset("k3-small")
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (4096, 512, 8)
    assert c.mla_layers == (3, 7) and c.num_kda_layers == 6
    assert (c.kda_num_heads, c.kda_head_dim, c.num_experts, c.num_experts_per_token) == (8, 64, 16, 4)


def test_kimi_k3_layer_counts() -> None:
    c = preset("kimi-k3")
    assert (c.num_kda_layers, c.num_mla_layers) == (69, 24)


def _raw() -> dict:
    return model_config_to_dict(preset("k3-tiny"))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.update(model_type="llama"), "model_type"),
        (lambda r: r.update(some_new_knob=1), "some_new_knob"),
        (lambda r: r.pop("kv_lora_rank"), "kv_lora_rank"),
        (lambda r: r.update(hidden_size="64"), "hidden_size"),
        (lambda r: r["linear_attn_config"].update(kda_layers=[0, 1]), "kda_layers"),
        (lambda r: r["linear_attn_config"].update(full_attn_layers=[2]), "full_attn_layers"),
        (lambda r: r["linear_attn_config"].update(mystery=3), "mystery"),
        (lambda r: r.update(num_experts_per_token=99), "num_experts_per_token"),
        (lambda r: r.update(mla_use_nope=False), "mla_use_nope"),
        (lambda r: r.update(num_expert_group=3), "num_expert_group"),
        (lambda r: r.update(torch_dtype="int8"), "torch_dtype"),
    ],
)
def test_bad_config_names_the_key(mutate, message: str) -> None:  # noqa: ANN001
    raw = _raw()
    mutate(raw)
    with pytest.raises(ConfigError, match=message):
        model_config_from_dict(raw)


def test_missing_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_config(tmp_path)


def test_unknown_preset() -> None:
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("k9")
