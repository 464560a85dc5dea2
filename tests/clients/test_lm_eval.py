"""lm-eval (`lm-eval[api]`, from PyPI) against a live radixk3 server: `local-completions` on a small local
multiple-choice task (loglikelihoods through /v1/completions `echo` + `logprobs`) and a generate_until task, and
`sglang-generate` multiple choice (through /generate's input logprobs). They run to a score (random weights: its
value does not matter), and every loglikelihood lm-eval computes equals the no-cache forward's over the ids
radixk3's own tokenizer gives the same strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

from radixk3.config import PRESET_SEED
from radixk3.tokenizer import Tokenizer, load_tokenizer
from tests.frontend_lang.oracle import tiny_model, token_logprobs
from tests.runtime.http_server_proc import Server

TASKS = Path(__file__).parent / "lm_eval_tasks"


@pytest.fixture(scope="module")
def tasks() -> TaskManager:
    return TaskManager(include_path=str(TASKS), include_defaults=False)


def evaluate(server: Server, model: str, route: str, tasks: TaskManager, names: list[str], **model_args: Any
             ) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` of `model` at the server's `route`, tokenizing locally with the files at the
    server's `tokenizer_path`."""
    info = httpx.get(f"{server.url}/model_info").json()
    args = {"model": info["served_model_name"], "base_url": f"{server.url}{route}", "tokenizer_backend": "huggingface",
            "tokenizer": info["tokenizer_path"], "max_length": 512, "max_retries": 1} | model_args
    return simple_evaluate(model=model, model_args=args, tasks=names, task_manager=tasks, log_samples=True,
                           random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def split_pair(context: str, continuation: str) -> tuple[str, str]:
    """lm-eval's `_encode_pair` split: the context's trailing whitespace moves to the continuation."""
    n = len(context) - len(context.rstrip())
    return (context[:-n], context[-n:] + continuation) if n else (context, continuation)


def assert_loglikelihoods_are_radixk3s(samples: list[dict[str, Any]], tok: Tokenizer) -> int:
    """Each (context, continuation) lm-eval scored: its loglikelihood equals the no-cache forward's sum over
    the continuation's tokens, the ids being radixk3's; returns how many were checked."""
    model = tiny_model(PRESET_SEED)
    checked = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            context, continuation = split_pair(context, continuation)
            ctx, whole = tok.encode(context), tok.encode(context + continuation)
            assert whole[: len(ctx)] == ctx
            loglik = float(resp[0][0])
            assert loglik == pytest.approx(sum(token_logprobs(model, whole, len(ctx))), abs=1e-3), (context,
                                                                                                    continuation)
            checked += 1
    return checked


def test_local_completions_multiple_choice_and_generate_until(server: Server, tasks: TaskManager) -> None:
    out = evaluate(server, "local-completions", "/v1/completions", tasks, ["k3_mc", "k3_gen"], batch_size=4)
    assert 0.0 <= out["results"]["k3_mc"]["acc,none"] <= 1.0
    assert 0.0 <= out["results"]["k3_gen"]["exact_match,none"] <= 1.0
    assert assert_loglikelihoods_are_radixk3s(out["samples"]["k3_mc"], load_tokenizer()) == 4 + 4 + 4
    generated = [s["resps"][0][0] for s in out["samples"]["k3_gen"]]
    assert len(generated) == 2 and all(isinstance(g, str) for g in generated)


def test_sglang_generate_multiple_choice(server: Server, tasks: TaskManager) -> None:
    out = evaluate(server, "sglang-generate", "/generate", tasks, ["k3_mc"], batch_size=4)
    assert 0.0 <= out["results"]["k3_mc"]["acc,none"] <= 1.0
    assert assert_loglikelihoods_are_radixk3s(out["samples"]["k3_mc"], load_tokenizer()) == 4 + 4 + 4
