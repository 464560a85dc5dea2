"""The nested native-K3 config.json: text_config with the K3 switches, vision keys accepted, presets."""

from __future__ import annotations

import copy
import json

import pytest

from radixk3.config import ConfigError, preset
from radixk3.config_formats import model_config_from_dict, model_config_to_dict
from radixk3.plan import memory_plan


def _raw() -> dict:
    return copy.deepcopy(model_config_to_dict(preset("k3-tiny-native")))


def test_nested_config_reads_every_switch() -> None:
    raw = _raw()
    text = raw["text_config"]
    text["linear_attn_config"].update(kda_layers=[1, 3, 4], full_attn_layers=[2])  # never consulted
    raw["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    cfg = model_config_from_dict(raw)
    assert cfg.model_type == "kimi_k3" and cfg.is_k3_format
    assert cfg.kda_layers == (0, 2, 3) and cfg.mla_layers == (1,)  # 1-based; every other layer is MLA
    assert cfg.kda_full_rank_gate and cfg.kda_gate_lower_bound == -5.0 and cfg.mla_use_output_gate
    assert cfg.q_lora_rank == 24 and cfg.attn_res_block_size == 3 and cfg.routed_expert_hidden_size == 32
    assert cfg.latent_moe_use_norm and cfg.hidden_act == "situ"
    assert (cfg.activation_situ_beta, cfg.activation_situ_linear_beta) == (2.0, 4.0)
    assert cfg.num_nextn_predict_layers == 1
    # vLLM's conventions for the K3 model: latent norms take rms_norm_eps, the full-rank KDA o_norm 1e-5.
    assert cfg.mla_kv_norm_eps == cfg.mla_q_norm_eps == cfg.rms_norm_eps == 1e-6
    assert cfg.kda_o_norm_eps == 1e-5


def test_sizes_are_forwarded_from_the_top() -> None:
    raw = _raw()
    del raw["text_config"]["hidden_size"]
    assert model_config_from_dict(raw).hidden_size == 64
    raw["hidden_size"] = 65
    raw["text_config"]["hidden_size"] = 64
    with pytest.raises(ConfigError, match="hidden_size 65 at the top disagrees"):
        model_config_from_dict(raw)


def test_images_need_a_vision_tower() -> None:
    cfg = model_config_from_dict(_raw())
    assert cfg.vision is not None and cfg.vision.model_type == "kimi_k3_vision"
    cfg.check_images(0)
    cfg.check_images(2)  # the worker builds the tower (radixk3.vision)
    raw = _raw()
    for key in ("vision_config", "media_placeholder_token_id", "image_placeholder"):
        del raw[key]
    with pytest.raises(ConfigError, match="no vision tower"):
        model_config_from_dict(raw).check_images(1)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.update(some_new_knob=1), "some_new_knob"),
        (lambda r: r.pop("text_config"), "text_config"),
        (lambda r: r["text_config"].update(model_type="deepseek_v3"), "text_config.model_type"),
        (lambda r: r["text_config"].update(mystery=1), "text_config.mystery"),
        (lambda r: r["text_config"].pop("kv_lora_rank"), "text_config.kv_lora_rank"),
        (lambda r: r["text_config"]["linear_attn_config"].update(gate_lower_bound=-6), "gate_lower_bound"),
        (lambda r: r["text_config"]["linear_attn_config"].update(gate_lower_bound=0), "gate_lower_bound"),
        (lambda r: r["text_config"]["linear_attn_config"].update(use_full_rank_gate="yes"), "use_full_rank_gate"),
        (lambda r: r["text_config"].update(hidden_act="gelu"), "hidden_act"),
        (lambda r: r["text_config"].update(attn_res_block_size=0), "attn_res_block_size"),
        (lambda r: r["text_config"].update(routed_expert_hidden_size=None), "latent_moe_use_norm"),
        (lambda r: r["text_config"].update(activation_situ_beta=-1), "activation_situ_beta"),
        (lambda r: r["text_config"].update(num_nextn_predict_layers=-1), "num_nextn_predict_layers"),
        (lambda r: r["text_config"].update(mla_use_nope=False), "mla_use_nope"),
        (lambda r: r.update(vision_config=[1]), "vision_config"),
    ],
)
def test_bad_k3_config_names_the_key(mutate, message: str) -> None:  # noqa: ANN001
    raw = _raw()
    mutate(raw)
    with pytest.raises(ConfigError, match=message):
        model_config_from_dict(raw)


def test_kimi_linear_config_json_is_unchanged_by_the_switches() -> None:
    raw = model_config_to_dict(preset("k3-tiny"))
    assert raw["model_type"] == "kimi_linear" and "text_config" not in raw
    assert not {"mla_use_output_gate", "attn_res_block_size", "routed_expert_hidden_size"} & set(raw)
    assert set(raw["linear_attn_config"]) == {"kda_layers", "full_attn_layers", "num_heads", "head_dim",
                                              "short_conv_kernel_size"}
    switched = preset("k3-tiny").replace(kda_gate_lower_bound=-5.0, mla_use_output_gate=True)
    back = model_config_from_dict(json.loads(json.dumps(model_config_to_dict(switched))))
    assert back == switched and back.mla_kv_norm_eps == 1e-6 != back.rms_norm_eps  # Moonshot's convention


def test_kimi_k3_preset_is_the_native_layout() -> None:
    cfg = preset("kimi-k3")
    raw = model_config_to_dict(cfg)
    assert raw["model_type"] == "kimi_k3" and raw["text_config"]["num_hidden_layers"] == 93
    assert (cfg.num_kda_layers, cfg.num_mla_layers, cfg.num_experts, cfg.num_experts_per_token) == (69, 24, 896, 16)
    assert cfg.kda_full_rank_gate and cfg.mla_use_output_gate and cfg.q_lora_rank == 1536
    assert cfg.routed_expert_hidden_size == 3584 and cfg.num_nextn_predict_layers == 1
    assert -(-cfg.num_hidden_layers // cfg.attn_res_block_size) <= 8  # the native AttnRes kernel's block limit
    plan = memory_plan(cfg, tp=8)
    assert 50e6 <= plan.state_bytes_per_request <= 58e6
    assert 26e3 <= plan.kv_bytes_per_token <= 28.5e3
    assert plan.mtp_kv_bytes_per_token == cfg.kv_dim * 2
