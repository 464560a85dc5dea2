"""transformers' Kimi K2.5 vision classes as oracles for radixk3.vision.

- The tower + projector: `Kimi_K25ForConditionalGeneration.from_pretrained` on a directory of published-name
  tensors, so that transformers' own conversion (K2.5's checkpoint mapping: the renames, `wqkv` split, and the
  rotary row permutation of q and k) turns them into its modules; its text model is a one-layer DeepSeek-V3 that
  the vision path never runs.
- The image processor: `Kimi_K25ImageProcessor` imports torchvision, which cannot be installed here, so its
  module cannot be imported. Its own `navit_resize` and `patchify` are taken from the installed file's source
  (the functions alone, compiled as they are written there) and run on transformers' PIL/numpy backend
  (`PilBackend`: RGB conversion, Pillow resize, numpy pad, rescale and normalise), in the order its
  `_preprocess` applies them. What this leaves unchecked is the torchvision resize itself.
"""

from __future__ import annotations

import ast
import math
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from radixk3.vision.config import VisionConfig


def k25_config(vcfg: VisionConfig) -> Any:
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

    text = {"model_type": "deepseek_v3", "hidden_size": vcfg.text_hidden_size, "num_hidden_layers": 1,
            "vocab_size": 128, "intermediate_size": 32, "moe_intermediate_size": 16, "num_attention_heads": 2,
            "num_key_value_heads": 2, "n_routed_experts": 2, "num_experts_per_tok": 1, "kv_lora_rank": 16,
            "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
            "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
    vision = {"patch_size": vcfg.patch_size, "pos_emb_height": vcfg.pos_emb_height,
              "pos_emb_width": vcfg.pos_emb_width, "pos_emb_time": vcfg.pos_emb_time,
              "num_attention_heads": vcfg.num_heads, "num_hidden_layers": vcfg.num_layers,
              "hidden_size": vcfg.hidden_size, "intermediate_size": vcfg.intermediate_size,
              "merge_kernel_size": list(vcfg.merge_kernel),
              "rope_parameters": {"rope_type": "axial", "rope_theta": vcfg.rope_theta}}
    return Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=vcfg.hidden_size,
                          projection_layer_norm_eps=vcfg.projector_ln_eps, tie_word_embeddings=False)


def k25_vision_model(checkpoint: Path, vcfg: VisionConfig) -> Any:
    """transformers' Kimi-K2.5 model (fp32, eager attention) with the vision tensors of `checkpoint` (a directory
    of safetensors in the published names); every vision and projector weight must have loaded."""
    from transformers import logging as hf_logging
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    if vcfg.qkv_hidden_size != vcfg.hidden_size:
        raise ValueError("transformers' K2.5 tower has q, k, v as wide as the hidden size")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the text model's weights are missing on purpose
    try:
        model, info = Kimi_K25ForConditionalGeneration.from_pretrained(
            checkpoint, config=k25_config(vcfg), dtype=torch.float32, attn_implementation="eager",
            ignore_mismatched_sizes=True, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = [n for n in info["missing_keys"] if "language_model" not in n and not n.startswith("lm_head")]
    assert not missing, f"the oracle did not load {missing}"
    return model.eval()


def k25_image_features(model: Any, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
    """The projected embeddings, images concatenated: `get_image_features`' pooled output."""
    with torch.no_grad():
        out = model.model.get_image_features(patches, torch.tensor(grids, dtype=torch.long))
    return torch.cat(out.pooler_output)


@cache
def _k25_processor_functions() -> dict[str, Any]:
    """`navit_resize` and `Kimi_K25ImageProcessor.patchify` from the installed source, compiled alone."""
    import transformers

    path = Path(transformers.__file__).parent / "models" / "kimi_k25" / "image_processing_kimi_k25.py"
    tree = ast.parse(path.read_text())
    wanted: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "navit_resize":
            wanted.append(node)
        if isinstance(node, ast.ClassDef) and node.name == "Kimi_K25ImageProcessor":
            wanted += [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "patchify"]
            defaults = {t.id: ast.literal_eval(s.value) for s in node.body if isinstance(s, ast.Assign)
                        for t in s.targets
                        if isinstance(t, ast.Name) and isinstance(s.value, ast.Constant | ast.Dict)}
    assert [f.name for f in wanted] == ["navit_resize", "patchify"], "transformers' processor moved"
    namespace: dict[str, Any] = {"math": math, "torch": torch}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return {"navit_resize": namespace["navit_resize"], "patchify": namespace["patchify"], "defaults": defaults}


def k25_preprocess(image: Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Kimi_K25ImageProcessor's pixel values and grid for one image at its defaults (max 512 patches a side,
    16384 patches, bicubic, mean / std 0.5), on transformers' PIL backend."""
    from transformers.image_processing_backends import PilBackend
    from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling, SizeDict

    fns = _k25_processor_functions()
    d = fns["defaults"]
    backend = PilBackend()
    pixels = backend.process_image(image, do_convert_rgb=True)  # (3, H, W) uint8
    (h, w), (ph, pw) = fns["navit_resize"](pixels.shape[1], pixels.shape[2], patch_size=d["patch_size"],
                                           merge_kernel_size=d["merge_size"], max_patches=d["max_patches"],
                                           max_size_per_side=d["size"]["max_height"])
    pixels = backend.resize(pixels, SizeDict(height=h, width=w), resample=PILImageResampling.BICUBIC)
    pixels = backend.pad([pixels], pad_size=SizeDict(height=ph, width=pw))[0]
    pixels = backend.rescale(pixels, 1 / 255)
    pixels = backend.normalize(pixels, IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD)
    patches, gh, gw = fns["patchify"](None, torch.from_numpy(np.ascontiguousarray(pixels))[None], d["patch_size"])
    return patches[0], (1, gh, gw)
