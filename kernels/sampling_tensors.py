"""The sampler's per-row parameter tensors, and what both sampling backends compute the same way from them: the
counter-based hash's constants and the top-k / top-p cut-offs. A leaf shared by the dispatcher and torch
reference (`kernels/sampling.py`) and the Triton kernels (`kernels/sampling_triton.py`): neither imports the
other's types."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from kernels.sampling_columns import SamplingColumns

MASK32 = 0xFFFFFFFF
HASH_MUL1 = 0x7FEB352D  # both < 2**31: a 32-bit value times either fits an int64 exactly
HASH_MUL2 = 0x68E31DA4
SEED_MASK = 2**63 - 1  # a seed is taken modulo 2**63 (two's complement: its low 63 bits), the hash's input
FRESH_SEEDS = 2**62  # an unseeded row draws its seed uniformly in [0, FRESH_SEEDS) each step
# A temperature below this samples greedily (SGLang's and vLLM's threshold): at such a temperature the draw is
# the argmax anyway, save for ties, and float32 cannot hold 1 / T for the tiniest ones (1e-45 is a denormal).
GREEDY_BELOW = 1e-5


def _tensor(a: np.ndarray) -> Tensor:
    return torch.from_numpy(np.require(a, requirements="W"))  # arrays off the wire are read-only: copied


class SamplingTensors(NamedTuple):
    """The rows' parameters as [N] tensors on the logits' device."""

    temperature: Tensor
    top_k: Tensor  # int64, <= 0: off
    top_p: Tensor
    min_p: Tensor
    frequency_penalty: Tensor
    presence_penalty: Tensor
    repetition_penalty: Tensor
    greedy: Tensor  # bool
    seed: Tensor  # int64 in [0, 2**63)
    step: Tensor  # int64

    @staticmethod
    def from_columns(cols: SamplingColumns, device: torch.device | str) -> SamplingTensors:
        """The columns as tensors on `device`; each unseeded row gets a fresh seed from torch's global
        generator (a new one at every call: a new step draws new numbers)."""
        # Host arithmetic in numpy, one tensor per column: each torch call costs a few microseconds in the
        # interpreter a step's weight reads keep evicting, a numpy one about a microsecond.
        seed = np.bitwise_and(cols.seed, SEED_MASK)  # a new array: the unseeded rows are written below
        unseeded = np.flatnonzero(~cols.seeded)
        if len(unseeded):
            seed[unseeded] = torch.randint(0, FRESH_SEEDS, (len(unseeded),)).numpy()
        greedy = (cols.temperature < np.float32(GREEDY_BELOW)) | (cols.top_k == 1)  # compared in fp32, as a tensor's
        host = SamplingTensors(
            temperature=_tensor(cols.temperature), top_k=_tensor(cols.top_k), top_p=_tensor(cols.top_p),
            min_p=_tensor(cols.min_p), frequency_penalty=_tensor(cols.frequency_penalty),
            presence_penalty=_tensor(cols.presence_penalty), repetition_penalty=_tensor(cols.repetition_penalty),
            greedy=torch.from_numpy(greedy), seed=torch.from_numpy(seed), step=_tensor(cols.step),
        )
        return host if torch.device(device).type == "cpu" else SamplingTensors(*(t.to(device) for t in host))

    @property
    def num_rows(self) -> int:
        return int(self.step.numel())

    def take(self, index: Tensor) -> SamplingTensors:
        """Rows `index` (an int64 tensor on their device), in that order."""
        return SamplingTensors(*(t[index] for t in self))

    def has_penalties(self) -> bool:
        """Whether some row has a frequency, presence or repetition penalty."""
        return bool(((self.frequency_penalty != 0) | (self.presence_penalty != 0)
                     | (self.repetition_penalty != 1.0)).any())


def finite_max(x: Tensor) -> Tensor:
    """[N] each row's largest value; 0 for a row with nothing finite (every token banned), so that subtracting
    it never makes inf - inf."""
    top = x.amax(-1)
    return torch.where(torch.isfinite(top), top, 0.0)


def tempered(adjusted: Tensor, p: SamplingTensors) -> Tensor:
    """z [N, V] fp32: sampled rows (x - max x) / T, greedy rows x itself. Shifting by the row's max changes
    neither the softmax nor the Gumbel-max draw, and keeps every z <= 0 with the best token at 0: no temperature
    can overflow z to inf (a far token may underflow to -inf: probability 0, as it is), so the cut-offs and the
    draw never see inf or NaN."""
    shift = torch.where(p.greedy, 0.0, finite_max(adjusted))
    return (adjusted - shift[:, None]) / torch.where(p.greedy, 1.0, p.temperature)[:, None]


def cutoffs(z: Tensor, p: SamplingTensors) -> Tensor:
    """Per-row z cut-off of top-k and top-p ([N] fp32, -inf where neither applies); rows need sorting only if
    they use top-k or top-p."""
    cut = torch.full((z.shape[0],), float("-inf"), device=z.device)
    need = ((p.top_k > 0) | (p.top_p < 1.0)) & ~p.greedy
    if not bool(need.any()):
        return cut
    rows = need.nonzero().squeeze(1)
    zs, _ = z[rows].sort(dim=-1, descending=True)
    vocab = z.shape[1]
    k = torch.where(p.top_k[rows] > 0, p.top_k[rows].clamp(max=vocab), vocab)
    probs = zs.softmax(-1)
    before = probs.cumsum(-1) - probs  # mass strictly before each sorted position
    in_p = (before < p.top_p[rows, None]).sum(-1).clamp(min=1)  # the first token always stays
    last = torch.minimum(k, in_p) - 1
    cut[rows] = zs.gather(1, last[:, None]).squeeze(1)
    return cut
