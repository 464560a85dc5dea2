"""Validation at the door: every malformed parameter is refused with an InvalidRequest naming its field."""

from __future__ import annotations

import math

import numpy as np
import pytest

from runtime.errors import InvalidRequest
from runtime.sampling_params import SamplingParams
from runtime.scheduler.plan_builder import sampling_columns

VOCAB = 4096

BAD: list[tuple[dict, str]] = [
    ({"n": 0}, "n"),
    ({"n": -3}, "n"),
    ({"n": 2.7}, "n"),
    ({"n": "2"}, "n"),
    ({"n": True}, "n"),
    ({"n": 2.0}, "n"),
    ({"seed": "abc"}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"seed": 2**63 - 1, "n": 2}, "seed"),  # sample 1 would draw with seed + 1
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 2**70}, "top_k"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 2**64}, "max_new_tokens"),
    ({"max_new_tokens": "5"}, "max_new_tokens"),
    ({"max_new_tokens": False}, "max_new_tokens"),
    ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": 2**70}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"presence_penalty": -math.inf}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stop_token_ids": [4103]}, "stop_token_ids"),
    ({"stop_token_ids": [-1769]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop": ""}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop": 7}, "stop"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
    ({"max_tokens": 5}, "max_tokens"),
]


@pytest.mark.parametrize(("params", "field"), BAD, ids=[repr(p) for p, _ in BAD])
def test_bad_parameters_name_their_field(params: dict, field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_dict(params, VOCAB)
    assert e.value.param == field
    assert field in str(e.value)


def test_good_parameters_pass_and_normalise() -> None:
    good = {"n": 3, "seed": 2**63 - 3, "top_k": 5, "temperature": 0, "stop": "x", "stop_token_ids": [0, VOCAB - 1],
            "top_p": 1}
    p = SamplingParams.from_dict(good, VOCAB)
    assert p.stop == ["x"] and p.n == 3 and p.stop_token_ids == [0, VOCAB - 1]
    cols = sampling_columns([p], [0])
    assert cols.temperature.dtype == np.float32 and cols.temperature.tolist() == [0.0]
    assert [q.seed for q in (p.for_sample(i) for i in range(3))] == [2**63 - 3, 2**63 - 2, 2**63 - 1]
    assert p.for_sample(2).n == 1 and SamplingParams().for_sample(5).seed is None
    with pytest.raises(InvalidRequest):
        SamplingParams.from_dict([], VOCAB)  # type: ignore[arg-type]


def test_the_parameters_and_their_columns_cost_the_scheduler_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, runtime.sampling_params, kernels.sampling_columns, runtime.messages; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
