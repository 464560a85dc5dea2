"""A model with packed (compressed-tensors) routed experts through the engine: greedy outputs equal the no-cache
forward of the same packed model, token for token, radix on and off, page sizes 1 and 16, under retraction, with
MTP speculation (the MTP layer's experts packed too); and the multi-process engine at --tp 2 and --tp 2 --ep 2 (the
packed tensors and their scales sharded) equals --tp 1.

The same for weight-only `--quantization int8 / int4` of a dense checkpoint (quantised at load): cached, chunked,
retracting, MTP- and n-gram-speculative and --tp 2 (--ep 2) serving equal the no-cache forward of the same
quantised model."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixk3.checkpoint import load_model, write_checkpoint
from radixk3.config import preset
from radixk3.model import build_model
from radixk3.quant_checkpoint import write_quantised_checkpoint
from radixk3.weight_quant import quantize_model_
from runtime.local_engine import LocalEngine
from runtime.server_args import ServerArgs
from runtime.tokenizer.engine import Engine
from tests.greedy import greedy_reference
from tests.runtime.test_engine_exactness import CONFIGS, GREEDY, MAX_NEW, _waves

MEM = 8 << 20


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Per format: the packed checkpoint of k3-tiny (intermediate 64, so that --tp 2 keeps whole groups), the
    loaded model, the waves and their no-cache greedy outputs."""
    out = {}
    cfg = preset("k3-tiny").replace(moe_intermediate_size=64)
    for kind in ("mxfp4", "int4", "fp8"):
        path = write_quantised_checkpoint(build_model(cfg, seed=11), tmp_path_factory.mktemp(kind), kind)
        model = load_model(path)
        assert model.config.expert_quant is not None and model.config.expert_quant.kind == kind
        # Every other prompt of test_engine_exactness's waves (MXFP4, K3's format), or a third of its first wave.
        waves = [w[::2] for w in _waves(model)] if kind == "mxfp4" else [_waves(model)[0][::3]]
        out[kind] = (path, model, waves, [[greedy_reference(model, p, MAX_NEW) for p in w] for w in waves])
    return out


CASES = [("mxfp4", n) for n in ("radix", "no_radix", "page16_chunked", "tiny_pool", "tiny_pool_page16")]
CASES += [("int4", "radix"), ("int4", "page16_chunked"), ("fp8", "radix"), ("fp8", "page16_chunked")]


@pytest.mark.parametrize("kind,name", CASES)
def test_packed_greedy_equals_no_cache_forward(kind: str, name: str, packed: dict) -> None:
    _, model, waves, refs = packed[kind]
    eng = LocalEngine(ServerArgs(**CONFIGS[name]), model, check=True)
    for wave, ref in zip(waves, refs, strict=True):
        assert eng.generate(wave, GREEDY) == ref
    m = eng.scheduler.metrics
    if name != "no_radix" and len(waves) > 1:
        assert m.cached_tokens > 0
    if name == "tiny_pool":
        assert m.retractions > 0


@pytest.mark.parametrize("parallel", [dict(tp_size=2), dict(tp_size=2, ep_size=2)], ids=["tp2", "tp2_ep2"])
def test_packed_tp2_ep2_equal_tp1(parallel: dict, packed: dict) -> None:
    path, _, waves, refs = packed["mxfp4"]
    engine = Engine(str(Path(path)), mem_bytes=MEM, **parallel)
    try:
        for wave, ref in zip(waves[:2], refs[:2], strict=True):
            assert [r["output_ids"] for r in engine.generate(wave, GREEDY, timeout=120)] == ref
    finally:
        engine.shutdown()


def test_packed_native_k3_with_mtp_speculation(tmp_path: Path) -> None:
    """K3 as shipped: LatentMoE and MTP layers, every routed expert MXFP4 (the MTP layer's too); greedy with MTP
    drafts (k 3, radix on) equals the packed model's no-cache forward."""
    from tests.runtime.test_spec_mtp import GREEDY as MTP_GREEDY
    from tests.runtime.test_spec_mtp import _workload

    path = write_quantised_checkpoint(build_model(preset("k3-tiny-native"), seed=11), tmp_path / "k3", "mxfp4")
    model = load_model(path)
    assert model.model.mtp_layers[0].block_sparse_moe.experts.quant is not None
    prompts, refs = _workload(model)
    eng = LocalEngine(ServerArgs(speculative_algorithm="mtp", speculative_num_draft_tokens=3), model, check=True)
    assert eng.generate(prompts, MTP_GREEDY) == refs
    assert eng.scheduler.metrics.verify_steps > 0 and eng.scheduler.metrics.draft_tokens > 0


@pytest.fixture(scope="module")
def weight_only(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Per --quantization method: a dense checkpoint of the k3-tiny above, the model loaded and quantised as the
    worker does, a third of the first wave and its no-cache greedy outputs (of the quantised model)."""
    out = {}
    # MLA's o_proj 64 inputs wide, so that --tp 2 keeps whole int4 groups.
    cfg = preset("k3-tiny").replace(moe_intermediate_size=64, v_head_dim=32)
    path = write_checkpoint(build_model(cfg, seed=11), tmp_path_factory.mktemp("dense"))
    for method in ("int8", "int4"):
        model = quantize_model_(load_model(path), method)
        # The first wave's prompts do not depend on outputs: no reference is run for the later waves' extensions.
        waves = [_waves(model, lambda wave: [[] for _ in wave])[0][::3]]
        out[method] = (path, model, waves, [[greedy_reference(model, p, MAX_NEW) for p in w] for w in waves])
    return out


# The suite's time budget: the kernels run a scalar loop on fp32 activations (only bf16 is vectorised), so each
# method is served once here (int4 with its chunk split mid-prompt); the MTP and --tp 2 cases below cover the rest.
WEIGHT_ONLY_CASES = [("int8", "radix"), ("int4", "chunked_mid_prompt")]


@pytest.mark.parametrize("method,name", WEIGHT_ONLY_CASES)
def test_weight_only_greedy_equals_no_cache_forward(method: str, name: str, weight_only: dict) -> None:
    _, model, waves, refs = weight_only[method]
    eng = LocalEngine(ServerArgs(quantization=method, **CONFIGS[name]), model, check=True)
    for wave, ref in zip(waves, refs, strict=True):
        assert eng.generate(wave, GREEDY) == ref


@pytest.mark.parametrize("method,parallel", [("int8", dict(tp_size=2))], ids=["int8_tp2"])
def test_weight_only_tp2_equals_tp1(method: str, parallel: dict, weight_only: dict) -> None:
    """Each rank quantises its shard at load (int8: the row-parallel rows' amax over the group) into the codes of
    the whole model: greedy equals the unsharded quantised model's no-cache forward."""
    path, _, waves, refs = weight_only[method]
    engine = Engine(str(Path(path)), mem_bytes=MEM, quantization=method, **parallel)
    try:
        assert [r["output_ids"] for r in engine.generate(waves[0], GREEDY, timeout=120)] == refs[0]
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def trained_int4() -> tuple:
    """A K3-format target trained briefly (drafts mostly accepted), int4 with its MTP layer, its workload and the
    quantised model's no-cache greedy outputs."""
    from tests.runtime.test_spec_engine import _trained
    from tests.runtime.test_spec_mtp import _workload

    model = quantize_model_(_trained(), "int4")
    return (model, *_workload(model))


@pytest.mark.parametrize("algorithm", ["mtp"])
def test_weight_only_speculation_equals_no_cache_forward(algorithm: str, trained_int4: tuple) -> None:
    """MTP and n-gram speculation (k 3, radix on) on the int4 target equal its no-cache forward."""
    from tests.runtime.test_spec_mtp import GREEDY as MTP_GREEDY

    model, prompts, refs = trained_int4
    eng = LocalEngine(ServerArgs(quantization="int4", speculative_algorithm=algorithm, speculative_num_draft_tokens=3,
                                 debug_spec_state=True), model, check=True)
    assert eng.generate(prompts, MTP_GREEDY) == refs
    m = eng.scheduler.metrics
    assert m.verify_steps > 0 and m.accepted_tokens > 0
