"""With every K3 switch off, a native-K3-format checkpoint is the Kimi-Linear model: the same logits, exactly, as
the equivalent Kimi-Linear checkpoint (and so transformers' within 1e-4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from oracles import transformers_module
from radixk3.checkpoint import SINGLE_FILE, load_model, write_random_checkpoint
from radixk3.config import preset
from radixk3.config_formats import load_model_config, model_config_to_dict
from radixk3.tensor_names import public_tensors

# The K3 reference gives kv_a_layernorm rms_norm_eps where Moonshot's Kimi-Linear code uses 1e-6: with
# rms_norm_eps = 1e-6 the two conventions coincide, so the formats can be compared exactly.
EPS = 1e-6


def _as_k3(kl_dir: Path, out: Path, *, legacy_names: bool) -> Path:
    """Rewrite a Kimi-Linear checkpoint as native K3: nested config, `language_model.` names, A_log as [H]
    (optionally the `language_model.layers.` alias and the legacy A_log shape)."""
    cfg = load_model_config(kl_dir)
    k3 = cfg.replace(model_type="kimi_k3")
    out.mkdir()
    raw = model_config_to_dict(k3)
    assert raw["model_type"] == "kimi_k3" and raw["text_config"]["linear_attn_config"]["use_full_rank_gate"] is False
    (out / "config.json").write_text(json.dumps(raw))
    tensors = {}
    for name, t in load_file(kl_dir / SINGLE_FILE).items():
        if name.endswith("A_log") and not legacy_names:
            t = t.flatten()
        new = "language_model." + name
        if legacy_names and name.startswith("model.layers."):
            new = "language_model." + name[len("model."):]
        tensors[new] = t
    save_file(tensors, out / SINGLE_FILE)
    return out


@pytest.fixture(scope="module")
def kl_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(preset("k3-tiny").replace(rms_norm_eps=EPS), tmp_path_factory.mktemp("kl"), seed=4)


@pytest.mark.parametrize("legacy_names", [False, True])
def test_k3_format_with_switches_off_is_the_kimi_linear_model(
    kl_checkpoint: Path, tmp_path: Path, legacy_names: bool
) -> None:
    k3_dir = _as_k3(kl_checkpoint, tmp_path / "k3", legacy_names=legacy_names)
    kl, k3 = load_model(kl_checkpoint), load_model(k3_dir)
    assert k3.config.is_k3_format and not kl.config.is_k3_format
    ids = torch.randint(0, kl.config.vocab_size, (2, 80), generator=torch.Generator().manual_seed(1))
    assert torch.equal(k3(ids), kl(ids))


def test_bf16_k3_format_is_exact_too(tmp_path: Path) -> None:
    """K3 keeps the conv weights in fp32 (Kimi-Linear: model dtype); loaded from the same bf16 checkpoint values,
    the logits still agree bit for bit."""
    kl_dir = write_random_checkpoint(preset("k3-tiny").replace(rms_norm_eps=EPS, dtype="bfloat16"), tmp_path / "kl")
    k3_dir = _as_k3(kl_dir, tmp_path / "k3", legacy_names=False)
    kl, k3 = load_model(kl_dir), load_model(k3_dir)
    conv = "model.layers.0.self_attn.q_conv1d.weight"
    assert public_tensors(k3)[conv].dtype == torch.float32 and public_tensors(kl)[conv].dtype == torch.bfloat16
    ids = torch.randint(0, kl.config.vocab_size, (1, 50), generator=torch.Generator().manual_seed(2))
    assert torch.equal(k3(ids), kl(ids))


def test_k3_format_matches_transformers(kl_checkpoint: Path, tmp_path: Path) -> None:
    k3 = load_model(_as_k3(kl_checkpoint, tmp_path / "k3", legacy_names=False))
    ref = transformers_module().KimiLinearForCausalLM.from_pretrained(
        kl_checkpoint, use_kernels=False, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    ids = torch.randint(0, k3.config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(input_ids=ids, use_cache=False).logits
    assert (k3(ids) - expected).abs().max().item() < 1e-4
