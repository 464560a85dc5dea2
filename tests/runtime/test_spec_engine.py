"""Speculative decoding end to end (n-gram proposer): greedy outputs equal the plain no-cache greedy loop token
for token with k = 1, 3, 6, ReplaySSM and snapshot, radix cache on and off, page sizes 1 and 16, a pool small
enough to force retraction; the state-parity hook checks every verify step; stops, stop strings, max and min
new tokens, per-request opt-out and grammar requests inside speculative batches behave as without speculation.

Two targets: the random `k3-tiny` (drafts are nearly always rejected: the rejection path) and a K3-format model
trained here for 30 steps on the shipped gsm8k train set (`bench/train_spec_pair.py`'s trainer, ~2 s): its
repetitive greedy text makes the lookup's drafts mostly accepted, so runs, stops and truncation inside accepted
runs are exercised."""

from __future__ import annotations

import random

import pytest
import torch

from radixk3.config import preset
from radixk3.model import build_model
from radixk3.tokenizer import load_tokenizer
from runtime.local_engine import LocalEngine
from runtime.messages import TokenOut
from runtime.pool_layout import PoolLayout
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs
from runtime.tokenizer.request_stream import SampleStream
from tests.greedy import greedy_reference

MAX_NEW = 24
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


def _trained():  # noqa: ANN202
    from bench.train_spec_pair import DATA, Stage, k3_config, token_stream, train_target, windows

    torch.manual_seed(0)
    data = windows(token_stream(DATA / "train.jsonl", 64), 64)
    model, _ = train_target(k3_config(64, 2, [2], 1, 32, 128, mtp=1), data, Stage(steps=30, lr=1e-2, batch=4), 0, "")
    return model.eval()


@pytest.fixture(scope="module", params=["random", "trained"])
def model(request):  # noqa: ANN001, ANN201
    return build_model(preset("k3-tiny"), seed=11) if request.param == "random" else _trained()


def _prompts(vocab: int) -> list[list[int]]:
    """Shared prefixes (the radix cache hits), text, and repeated runs (the n-gram lookup finds drafts)."""
    g = random.Random(3)
    tok = load_tokenizer()

    def rand(n: int) -> list[int]:
        return [g.randrange(vocab) for _ in range(n)]

    shots = rand(40)
    motif = rand(6)
    out = [shots + rand(g.randrange(2, 9)) for _ in range(5)]
    out += [motif * 4 + motif[: g.randrange(1, 5)] for _ in range(4)]  # ends inside the motif: drafts found
    out += [rand(g.randrange(5, 30)) for _ in range(3)]
    out.append(list(out[0]))
    out += [tok.encode(f"Question: Tom has {i} apples and buys {2 * i + 3} more. How many?\nAnswer:") for i in range(4)]
    vocab_once = list(range(vocab))
    g.shuffle(vocab_once)
    out.append(vocab_once + motif)  # every token occurs earlier: the lookup always finds drafts (last prompt)
    return out


@pytest.fixture(scope="module")
def workload(model):  # noqa: ANN001, ANN201
    prompts = _prompts(model.config.vocab_size)
    return prompts, [greedy_reference(model, p, MAX_NEW) for p in prompts]


def _engine(model, **kw) -> LocalEngine:  # noqa: ANN001
    args = ServerArgs(speculative_algorithm="ngram", debug_spec_state=True, **kw)
    return LocalEngine(args, model, check=True)


CONFIGS = {
    "radix": dict(),
    "no_radix": dict(disable_radix_cache=True),
    "page16_chunked": dict(page_size=16, chunked_prefill_size=32),
    "snapshot": dict(spec_state="snapshot"),
    "snapshot_page16_no_radix": dict(spec_state="snapshot", page_size=16, disable_radix_cache=True),
}


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_plain(model, workload, name: str, k: int) -> None:  # noqa: ANN001
    prompts, refs = workload
    eng = _engine(model, speculative_num_draft_tokens=k, **CONFIGS[name])
    assert eng.generate(prompts, GREEDY) == refs
    m = eng.scheduler.metrics
    assert m.verify_steps > 0 and m.draft_tokens > 0, "no verify window ran"
    if model.config.model_type == "kimi_k3":  # the trained target
        assert m.accepted_tokens > m.draft_tokens / 3, "the trained target should accept most lookups"
    eng.scheduler.check_integrity()


@pytest.mark.parametrize("k", [1, 3])
def test_retraction_under_a_small_pool(model, workload, k: int) -> None:  # noqa: ANN001
    prompts, refs = workload[0][:-1], workload[1][:-1]  # the vocabulary-long prompt would not fit
    # room for a few requests' pages at once: admission overcommits and decode must retract
    lay = PoolLayout.from_config(model.config)
    pool = 6 * lay.state_block_bytes + 250 * lay.kv_token_bytes  # a handful of requests' states and tokens
    eng = _engine(model, speculative_num_draft_tokens=k, mem_bytes=pool + lay.spec_window_bytes("replay", 8, k + 1),
                  max_running_requests=8,
                  chunked_prefill_size=40, schedule_conservativeness=0.0)
    assert eng.generate(prompts, GREEDY) == refs
    assert eng.scheduler.metrics.retractions > 0
    eng.scheduler.check_integrity()


def test_finishing_inside_a_run_matches_plain(model, workload) -> None:  # noqa: ANN001
    """Stop ids, stop strings, max/min new tokens, logit biases and opted-out or constrained requests:
    the same outputs with speculation as without."""
    prompts, refs = workload
    cases = [
        dict(GREEDY, stop_token_ids=[refs[5][7]]),
        dict(GREEDY, max_new_tokens=5),
        dict(GREEDY, min_new_tokens=10, stop_token_ids=[refs[6][3], refs[6][12]]),
        dict(GREEDY, speculative=False),
        dict(GREEDY, max_new_tokens=1),
        dict(GREEDY, stop=[load_tokenizer().decode(refs[-2][5:7]) or "0"]),
        # A verify window's positions are biased as the plain sampler's rows are.
        dict(GREEDY, logit_bias={str(refs[0][2]): 4.0, str(refs[9][4]): -30.0, str(refs[-1][1]): 2.5}),
    ]
    # Every case's requests in one batch per engine (one engine start and one run each side, not one per case):
    # each request is compared with its own plain twin, so batch-mates of other cases change nothing checked.
    def run(eng: LocalEngine) -> list[list[list[int]]]:
        rids = [[eng.submit(p, sampling) for p in prompts] for sampling in cases]
        outs = eng.run()
        return [[[t for o in outs[r] for t in o.token_ids] for r in case] for case in rids]

    plain, spec = run(LocalEngine(ServerArgs(), model)), run(_engine(model, speculative_num_draft_tokens=3))
    for sampling, want, got in zip(cases, plain, spec, strict=True):
        assert got == want, sampling


def test_seeded_sampling_is_reproducible(model, workload) -> None:  # noqa: ANN001
    prompts, _ = workload
    sampling = {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 5, "ignore_eos": True}
    a = _engine(model, speculative_num_draft_tokens=3).generate(prompts[:6], sampling)
    b = _engine(model, speculative_num_draft_tokens=3).generate(prompts[:6], sampling)
    assert a == b and all(len(x) == 16 for x in a)


def test_constrained_requests_ride_along_masked(model, workload) -> None:  # noqa: ANN001
    """A grammar request never drafts; in a verify batch its one position is still masked."""
    prompts, _ = workload

    def run(eng: LocalEngine) -> list[list[int]]:
        rids = [eng.submit(p, dict(GREEDY, regex="[a-z]{3,12}") if i % 3 == 0 else GREEDY)
                for i, p in enumerate(prompts)]
        outs = eng.run()
        return [[t for o in outs[r] for t in o.token_ids] for r in rids]

    # One compile worker each: the pool's size is not what this checks, and each worker is a process importing torch.
    spec = _engine(model, speculative_num_draft_tokens=3, grammar_compile_workers=1)
    assert run(spec) == run(LocalEngine(ServerArgs(grammar_compile_workers=1), model))
    assert spec.scheduler.metrics.verify_steps > 0


def test_a_prompt_run_again_drafts_from_its_first_run(model, workload) -> None:  # noqa: ANN001
    """The shared n-gram corpus: once a request finished, a request with the same prompt drafts the first one's
    output from it (greedy repeats it, so the drafts are accepted); with the corpus off (capacity 0) it only has
    its own context."""
    prompts, refs = workload
    accepted = {}
    for cap in (0, 1 << 16):
        eng = _engine(model, speculative_num_draft_tokens=6, speculative_ngram_capacity=cap)
        assert eng.generate([prompts[9]], GREEDY) == [refs[9]]
        m = eng.scheduler.metrics
        drafts, before = m.draft_tokens, m.accepted_tokens
        assert eng.generate([prompts[9]], GREEDY) == [refs[9]]
        accepted[cap] = (m.accepted_tokens - before, m.draft_tokens - drafts)
        eng.scheduler.check_integrity()
    got, proposed = accepted[1 << 16]
    assert accepted[0][0] < got and proposed >= MAX_NEW // 2, accepted
    if model.config.model_type != "kimi_k3":  # random weights: its own context matches nothing longer, so
        assert got == proposed, accepted  # every draft is the first run's output, and taken
    assert eng.scheduler.flush_cache() and not eng.scheduler.ngram_corpus.held()


def test_running_requests_draft_from_each_other() -> None:
    """The corpus holds running requests' tokens: a request whose greedy answer another request's prompt spells
    out drafts it from there while both run (greedy repeats it, so the drafts are taken); with the corpus off it
    has only its own context. The other request runs longer and drafts nothing itself."""
    model = build_model(preset("k3-tiny"), seed=11)
    g = random.Random(5)
    vocab = model.config.vocab_size
    cue = g.sample(range(vocab), 8)  # distinct tokens: its own context has nothing to look up at first
    answer = greedy_reference(model, cue, MAX_NEW)
    teacher = [g.randrange(vocab) for _ in range(20)] + cue + answer
    longer = dict(GREEDY, max_new_tokens=3 * MAX_NEW, speculative=False)
    teacher_out = greedy_reference(model, teacher, 3 * MAX_NEW)
    accepted = {}
    for cap in (0, 1 << 16):
        eng = _engine(model, speculative_num_draft_tokens=6, speculative_ngram_capacity=cap)
        t, s = eng.submit(teacher, longer), eng.submit(cue, GREEDY)
        outs = eng.run()
        assert [[x for o in outs[r] for x in o.token_ids] for r in (t, s)] == [teacher_out, answer]
        accepted[cap] = eng.scheduler.metrics.accepted_tokens
        eng.scheduler.check_integrity()
    assert accepted[1 << 16] >= MAX_NEW // 2 and accepted[0] < accepted[1 << 16], accepted


def test_a_verify_window_crossing_min_new_tokens_cuts_at_the_matched_stop() -> None:
    """One verify window commits tokens below min_new_tokens, one of them completing a stop string, and the first
    checked token, completing it again: the request stops there and its text (the tokenizer side's, from the
    chunks) ends at that second occurrence, the first one kept. The prompt is run once first, so that every
    draft of the second run is the first run's output and taken (the random target: see the corpus test)."""
    model = build_model(preset("k3-tiny"), seed=11)
    tok = load_tokenizer()
    prompt = _prompts(model.config.vocab_size)[9]
    ref = greedy_reference(model, prompt, MAX_NEW)
    eng = _engine(model, speculative_num_draft_tokens=6, speculative_ngram_capacity=1 << 16)

    def chunks(sampling: dict) -> list[TokenOut]:
        rid = eng.submit(prompt, sampling)
        return eng.run()[rid]

    assert eng.generate([prompt], GREEDY) == [ref]
    windows = [o.token_ids for o in chunks(GREEDY)]  # the second run's chunks: its verify windows
    starts = [sum(len(w) for w in windows[:k]) for k in range(len(windows))]
    text = tok.decode(ref)
    covering = [len(tok.decode(ref[:n])) for n in range(len(ref) + 1)]

    def token_of(pos: int) -> int:  # the output token whose text first covers character `pos`
        return next(n for n, c in enumerate(covering) if c > pos) - 1

    def window_of(t: int) -> int:
        return max(k for k, s in enumerate(starts) if s <= t)

    # Tokens i < j of two occurrences of a character with none between, j >= i + 2 (so the first check, at j,
    # reads only tokens j - 1 and j), in one window.
    cases = []
    for c in dict.fromkeys(x for x in text if x.isalpha()):
        at = sorted({token_of(p): p for p in reversed(range(len(text))) if text[p] == c}.items())
        cases += [(c, i, j, p) for (i, _), (j, p) in zip(at, at[1:], strict=False)
                  if j >= i + 2 and window_of(i) == window_of(j)]
    assert cases, (text, windows)
    stop, i, j, pos = cases[0]
    sampling = dict(GREEDY, stop=stop, min_new_tokens=j + 1)
    outs = chunks(sampling)
    last = window_of(j)
    assert [o.token_ids for o in outs] == windows[:last] + [windows[last][: j + 1 - starts[last]]]
    stream = SampleStream("r", 0, tok, SamplingParams.from_dict(sampling, model.config.vocab_size))
    got = "".join(stream.chunk(o).text for o in outs)
    assert (outs[-1].finished, outs[-1].matched_stop) == ("stop", stop)
    assert got == text[:pos] and text[:pos].count(stop) >= 1, (got, text[:pos])
    eng.scheduler.check_integrity()
