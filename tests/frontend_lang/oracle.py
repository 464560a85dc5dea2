"""Choice logprobs straight from the model's no-cache forward: the ground truth `select` is checked against."""

from __future__ import annotations

from functools import cache

import torch

from radixk3.config import preset
from radixk3.model import KimiForCausalLM, build_model


@cache
def tiny_model(seed: int) -> KimiForCausalLM:
    return build_model(preset("k3-tiny"), seed=seed)


@torch.inference_mode()
def token_logprobs(model: KimiForCausalLM, ids: list[int], start: int) -> list[float]:
    """log p(ids[t] | ids[:t]) for t in [start, len(ids)), from one full forward without a cache."""
    logp = torch.log_softmax(model(torch.tensor(ids)).float(), dim=-1)
    return [float(logp[t - 1, ids[t]]) for t in range(start, len(ids))]


def choice_logprobs(model: KimiForCausalLM, tok: object, prefix: str, choice: str) -> list[float]:
    """The logprobs of the tokens of prefix + choice from the first one that is not the prefix's own."""
    pre, full = tok.encode(prefix, add_bos=True), tok.encode(prefix + choice, add_bos=True)  # type: ignore[attr-defined]
    start = next(i for i in range(len(full)) if i >= len(pre) or pre[i] != full[i])
    return token_logprobs(model, full, start)
