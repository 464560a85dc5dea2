"""The trained model pair for the speculative-decoding bench: a small K3-family target with an MTP layer, a draft
model and a DSpark drafter, all trained here on the gsm8k train set the project ships, seeded and deterministic,
in CPU minutes.

Stages, each on the frozen result of the one before:
1. target: next-token cross-entropy on "Question: ...\\nAnswer: ..." examples joined by blank lines (the shape of
   `bench/gsm8k.py`'s few-shot prompts), cut into fixed windows;
2. its MTP layer: token t+2 from (the target's pre-norm hidden state at t, token t+1), distilled from the target's
   distribution at t+1 (what a verify step accepts); lm_head shared, frozen;
3. the draft: a 2-layer K3-family model distilled from the target's distribution;
4. DSpark (`bench/spec_train_dspark.py`), distilled from the target on longer windows of the same stream (the
   stage's `window`), the blocks at `anchors` drawn positions of a window in one pass.

The bench's target is the built-in one, `radixk3/assets/k3-gsm8k/` (stages 1-2, weights in bf16, with the recipe
that made it in `recipe.json`), written by `--write-builtin`; the draft and DSpark are trained against it as
served (its bf16 weights) into `$XDG_CACHE_HOME/radixk3/spec_pair/<key>`, `<key>` a hash of the recipe, the data
and the target's weights. A recipe without a given target (the tests' small one) trains its own into the cache.
Artifacts are written into a temporary directory and renamed into place (a killed run leaves no half artifact).
Training differentiates the model's own no-cache forward (`_prenorm_hidden`); nothing in the serving path changes.

    python bench/train_spec_pair.py [--rebuild] [--steps-scale X]   # the pair on the built-in target: agreements
    python bench/train_spec_pair.py --write-builtin                  # retrain the built-in target (~33 CPU min)
    python bench/train_spec_pair.py --retrain-mtp                    # only its MTP layer, on it (~12 CPU min)
    python bench/train_spec_pair.py --retrain-dspark                 # only DSpark, against it
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script, bench/kernels.py would shadow the kernels package

from bench.gsm8k import DATA, one_example, read_jsonl  # noqa: E402
from bench.spec_pair_agreement import (  # noqa: E402
    agreement,
    dspark_agreement,
    held_out_ids,
    mtp_agreement,
    sample_replies,
)
from bench.spec_train_dspark import train_dspark_windows  # noqa: E402
from radixk3.checkpoint import SINGLE_FILE, load_model, write_checkpoint  # noqa: E402
from radixk3.config import ModelConfig, every_mla  # noqa: E402
from radixk3.dspark import DSparkModel  # noqa: E402
from radixk3.dspark_checkpoint import load_dspark, write_dspark_checkpoint  # noqa: E402
from radixk3.dspark_config import DSparkConfig, k3_tiny_dspark_preset  # noqa: E402
from radixk3.hf_tokenizer_writer import write_hf_tokenizer  # noqa: E402
from radixk3.model import KimiForCausalLM, build_model  # noqa: E402
from radixk3.mtp import run_mtp_layer  # noqa: E402
from radixk3.tokenizer import load_tokenizer  # noqa: E402

RECIPE_VERSION = 4  # bump when the training code changes what a recipe produces
BUILTIN = REPO / "radixk3" / "assets" / "k3-gsm8k"  # the committed target (`--write-builtin`)
WRITE_COMMAND = "python bench/train_spec_pair.py --write-builtin"
RETRAIN_COMMAND = "python bench/train_spec_pair.py --retrain-mtp"
RETRAIN_DSPARK_COMMAND = "python bench/train_spec_pair.py --retrain-dspark"


class SpecPair(NamedTuple):
    target: Path
    draft: Path
    dspark: Path
    report: Path  # report.json of the draft (and of the target when trained with them)


def k3_config(hidden: int, layers: int, mla_1based: list[int], heads: int, head_dim: int, ffn: int,
              mtp: int) -> ModelConfig:
    """A native-K3-format dense model: full-rank and safe KDA gates, Gated MLA, Block AttnRes, SiTU."""
    kda, mla = every_mla(layers, mla_1based)
    return ModelConfig(
        vocab_size=4096, hidden_size=hidden, num_hidden_layers=layers, kda_layers=kda, mla_layers=mla,
        kda_num_heads=heads, kda_head_dim=head_dim, conv_kernel_size=4,
        num_attention_heads=heads, kv_lora_rank=head_dim, q_lora_rank=None, qk_nope_head_dim=head_dim // 2,
        qk_rope_head_dim=head_dim // 4, v_head_dim=head_dim // 2, intermediate_size=ffn,
        moe_intermediate_size=ffn // 4, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
        routed_scaling_factor=1.0, first_k_dense_replace=layers + mtp + 1,  # every layer dense, MTP included
        rms_norm_eps=1e-6, model_type="kimi_k3", kda_full_rank_gate=True, kda_gate_lower_bound=-5.0,
        mla_use_output_gate=True, attn_res_block_size=2, hidden_act="situ", activation_situ_beta=1.0,
        num_nextn_predict_layers=mtp,
    )


@dataclass(frozen=True)
class Stage:
    steps: int
    lr: float
    batch: int  # windows per step


@dataclass(frozen=True)
class DSparkStage(Stage):
    """The DSpark stage's windows: `window` tokens each (None: the recipe's `seq_len`), cut from the same stream,
    with the blocks at `anchors` positions of each, drawn afresh every step (None: at every position)."""
    window: int | None = None
    anchors: int | None = None


@dataclass(frozen=True)
class Recipe:
    target: ModelConfig = field(default_factory=lambda: k3_config(160, 4, [2, 4], 2, 64, 448, mtp=1))
    draft: ModelConfig = field(default_factory=lambda: k3_config(128, 2, [2], 2, 64, 384, mtp=0))
    target_stage: Stage = Stage(steps=800, lr=3e-3, batch=8)
    mtp_stage: Stage = Stage(steps=1200, lr=4e-3, batch=8)
    draft_stage: Stage = Stage(steps=500, lr=4e-3, batch=8)
    # batch: windows per step. The drafter reads its context only through RoPE attention, so it is trained on
    # windows of 2,048 tokens (512 anchors drawn in each): trained on the 512-token windows, it agreed with the
    # target far less at the held-out stream's positions past 512 (77% of its 2,223) than before them, where the
    # MTP layer, fed h_t directly, agrees alike at both.
    dspark_stage: Stage = DSparkStage(steps=1500, lr=5e-3, batch=1, window=2048, anchors=512)
    seq_len: int = 512
    num_examples: int | None = None  # None: the whole train set
    seed: int = 0

    def scaled(self, x: float) -> Recipe:
        def s(st: Stage) -> Stage:
            return dataclasses.replace(st, steps=max(1, round(st.steps * x)))
        return dataclasses.replace(self, target_stage=s(self.target_stage), mtp_stage=s(self.mtp_stage),
                                   draft_stage=s(self.draft_stage), dspark_stage=s(self.dspark_stage))

    def key(self, data: Path) -> str:
        raw = {"version": RECIPE_VERSION, "recipe": dataclasses.asdict(self), "data": file_sha256(data)}
        return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:12]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "radixk3" / "spec_pair"


# --- data --------------------------------------------------------------------------------------------------
def token_stream(path: Path, num_examples: int | None) -> torch.Tensor:
    """The train set as one token stream: each example "Question: ...\\nAnswer: ..." and a blank line."""
    tok = load_tokenizer()
    rows = read_jsonl(path)[:num_examples]
    ids: list[int] = []
    for e in rows:
        ids += tok.encode(one_example(e, True) + "\n\n")
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[N, seq_len] non-overlapping windows of the stream."""
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)


def batches(data: torch.Tensor, batch: int, steps: int, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """`steps` batches of windows, epochs in a seeded order."""
    order = torch.randperm(data.shape[0], generator=gen)
    pos = 0
    for _ in range(steps):
        if pos + batch > order.numel():
            order, pos = torch.randperm(data.shape[0], generator=gen), 0
        yield data[order[pos : pos + batch]]
        pos += batch


def packed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] -> packed ids [B*T] and cu_seqlens."""
    b, t = x.shape
    return x.reshape(-1), torch.arange(0, (b + 1) * t, t)


# --- training ----------------------------------------------------------------------------------------------
def logits_of(model: KimiForCausalLM, x: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T, V] through the differentiable no-cache path."""
    ids, cu = packed(x)
    return model.lm_head(model.model.norm(model._prenorm_hidden(ids, cu))).view(*x.shape, -1)


def optimise(params: list[torch.nn.Parameter], stage: Stage, loss_fn: Any, data: torch.Tensor,
             gen: torch.Generator, log: str) -> list[float]:
    """AdamW, linear warmup then cosine decay to 10%; returns each step's loss."""
    opt = torch.optim.AdamW(params, lr=stage.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warm = max(1, stage.steps // 20)

    def lr_at(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / max(1, stage.steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    losses: list[float] = []
    t0 = time.perf_counter()
    for step, x in enumerate(batches(data, stage.batch, stage.steps, gen)):
        loss = loss_fn(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if log and (step % 50 == 0 or step == stage.steps - 1):
            print(f"  {log} step {step}/{stage.steps} loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f}s)",
                  flush=True)
    return losses


def distill_loss(logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per position, [N, V] logits against the teacher's log-probabilities [N, V]: a
    proposer is judged by agreeing with the target, not with the text."""
    return F.kl_div(F.log_softmax(logits, -1), teacher, log_target=True, reduction="batchmean")


def train_target(cfg: ModelConfig, data: torch.Tensor, stage: Stage, seed: int, log: str) -> tuple[
        KimiForCausalLM, list[float]]:
    model = build_model(cfg, seed=seed).train()
    params = [p for n, p in model.named_parameters() if ".mtp_layers." not in n]

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        logits = logits_of(model, x)[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))

    return model, optimise(params, stage, loss_fn, data, torch.Generator().manual_seed(seed + 1), log)


def mtp_loss(model: KimiForCausalLM, x: torch.Tensor) -> torch.Tensor:
    """MTP layer 0 on (h_t, token t+1) -> token t+2, for t = 0..T-3 of each window, distilled from the target's
    distribution at t+1 (its prediction of t+2); the target frozen."""
    b, t = x.shape
    with torch.no_grad():
        ids, cu = packed(x)
        h = model._prenorm_hidden(ids, cu).view(b, t, -1)
        teacher = F.log_softmax(model.lm_head(model.model.norm(h[:, 1:-1])), -1).flatten(0, 1)
    nxt, cu_m = packed(x[:, 1:])
    out = run_mtp_layer(model.model.mtp_layers, 0, nxt, h[:, :-1].reshape(-1, h.shape[-1]), cu_m, None)
    logits = model.mtp_logits(0, out).view(b, t - 1, -1)[:, :-1]
    return distill_loss(logits.flatten(0, 1), teacher)


def train_mtp(model: KimiForCausalLM, data: torch.Tensor, stage: Stage, seed: int, log: str) -> list[float]:
    layer = model.model.mtp_layers[0]
    with torch.no_grad():  # start from the target's embedding; the unused shared head mirrors lm_head
        layer.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
        layer.shared_head.head.weight.copy_(model.lm_head.weight)
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for n, p in layer.named_parameters() if not n.startswith("shared_head.head")]
    for p in params:
        p.requires_grad_(True)
    losses = optimise(params, stage, lambda x: mtp_loss(model, x), data, torch.Generator().manual_seed(seed + 2),
                      log)
    for p in model.parameters():
        p.requires_grad_(False)
    return losses


def train_draft(cfg: ModelConfig, target: KimiForCausalLM, data: torch.Tensor, stage: Stage, seed: int,
                log: str) -> tuple[KimiForCausalLM, list[float]]:
    draft = build_model(cfg, seed=seed + 3).train()

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher = F.log_softmax(logits_of(target, x), -1).flatten(0, 1)
        return distill_loss(logits_of(draft, x).flatten(0, 1), teacher)

    return draft, optimise(list(draft.parameters()), stage, loss_fn, data, torch.Generator().manual_seed(seed + 4),
                           log)


def dspark_config(target: ModelConfig) -> DSparkConfig:
    """The k3-tiny drafter's shape at the target's width, reading an early and the last target layer (layers 1 and
    3 of 4, as the preset does for k3-tiny-native), with wider attention and Markov head than the preset's."""
    n = target.num_hidden_layers
    return k3_tiny_dspark_preset().replace(
        hidden_size=target.hidden_size, target_hidden_size=target.hidden_size, num_target_layers=n,
        target_layer_ids=tuple(sorted({n // 4, n - 1})), intermediate_size=2 * target.hidden_size,
        q_lora_rank=target.hidden_size // 2, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=64, markov_rank=32)


class Trained(NamedTuple):
    losses: list[float]
    seconds: float


def timed(fn: Any, *args: Any, **kw: Any) -> tuple[Any, float]:  # noqa: ANN401
    t0 = time.perf_counter()
    return fn(*args, **kw), time.perf_counter() - t0


def train_target_stages(recipe: Recipe, data: torch.Tensor, log: bool) -> tuple[KimiForCausalLM, dict[str, Trained]]:
    """Stages 1-2: the target, then its MTP layer; the model comes back frozen, in eval mode."""
    torch.manual_seed(recipe.seed)
    (target, t_loss), t_sec = timed(train_target, recipe.target, data, recipe.target_stage, recipe.seed,
                                    "target" if log else "")
    target = as_served(target)  # stage 2 distils the target as served: its bf16 weights
    m_loss, m_sec = timed(train_mtp, target, data, recipe.mtp_stage, recipe.seed, "mtp" if log else "")
    return target, {"target": Trained(t_loss, t_sec), "mtp": Trained(m_loss, m_sec)}


def as_served(model: KimiForCausalLM) -> KimiForCausalLM:
    """`model`'s weights as its bf16 checkpoint serves them (rounded to bf16; the tensors served in fp32 kept), in
    fp32, frozen, in eval mode."""
    served = build_model(model.config.replace(dtype="bfloat16"))
    served.load_state_dict(model.state_dict())
    out = build_model(model.config)
    out.load_state_dict(served.state_dict())
    for p in out.parameters():
        p.requires_grad_(False)
    return out.eval()


def train_drafters_into(out: Path, recipe: Recipe, target: KimiForCausalLM, data: torch.Tensor,
                        log: bool) -> dict[str, Trained]:
    """Stages 3-4 against the frozen `target`: the draft model into `out/draft`, DSpark into `out/dspark`."""
    torch.manual_seed(recipe.seed)
    (draft, d_loss), d_sec = timed(train_draft, recipe.draft, target, data, recipe.draft_stage, recipe.seed,
                                   "draft" if log else "")
    write_checkpoint(draft.eval(), out / "draft")
    ds, ds_trained = train_dspark_stage(recipe, target, data, log)
    write_dspark_checkpoint(ds, out / "dspark")
    return {"draft": Trained(d_loss, d_sec), "dspark": ds_trained}


def train_dspark_stage(recipe: Recipe, target: KimiForCausalLM, data: torch.Tensor,
                       log: bool) -> tuple[DSparkModel, Trained]:
    """Stage 4 against the frozen `target`, on the recipe's windows `data` recut to the DSpark stage's length."""
    st = recipe.dspark_stage
    window, anchors = getattr(st, "window", None), getattr(st, "anchors", None)
    if window is not None and window != data.shape[1]:
        data = windows(data.reshape(-1), window)
    if log:
        print(f"  dspark: {st.steps} steps of {st.batch} window(s) of {data.shape[1]} tokens, "
              f"{'every' if anchors is None else anchors} anchor(s) each", flush=True)
    ds_loss: list[float] = []
    ds, ds_sec = timed(train_dspark_windows, target, data, seed=recipe.seed, steps=st.steps, losses=ds_loss,
                       cfg=dspark_config(recipe.target), windows_per_step=st.batch, lr=st.lr, anchors=anchors,
                       log="dspark" if log else "")
    if log:
        print(f"  dspark loss {ds_loss[0]:.3f} -> {tail_mean(ds_loss):.3f} ({ds_sec:.0f}s)", flush=True)
    return ds, Trained(ds_loss, ds_sec)


def stage_report(stages: dict[str, Trained]) -> dict[str, dict[str, float]]:
    return {"first_loss": {k: s.losses[0] for k, s in stages.items()},
            "final_loss": {k: tail_mean(s.losses) for k, s in stages.items()},
            "seconds": {k: round(s.seconds, 1) for k, s in stages.items()}}


def training_data(recipe: Recipe, data_path: Path, log: bool) -> tuple[torch.Tensor, dict[str, Any]]:
    """The recipe's windows and what they were cut from (file, bytes, sha256, tokens)."""
    stream = token_stream(data_path, recipe.num_examples)
    data = windows(stream, recipe.seq_len)
    about = {"file": str(data_path.relative_to(REPO)) if data_path.is_relative_to(REPO) else data_path.name,
             "bytes": data_path.stat().st_size, "sha256": file_sha256(data_path), "tokens": stream.numel(),
             "windows": data.shape[0]}
    if log:
        print(f"data: {about['tokens']} tokens, {about['windows']} windows of {recipe.seq_len}", flush=True)
    return data, about


def tail_mean(losses: list[float]) -> float:
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def served_target(path: Path) -> KimiForCausalLM:
    """A checkpoint's weights as served (a bf16 checkpoint's values), computed in fp32, frozen."""
    model = load_model(path, dtype=torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def ensure_spec_pair(rebuild: bool = False, *, recipe: Recipe | None = None, target: Path | None = None,
                     cache_dir: Path | None = None, data_path: Path | None = None, log: bool = False) -> SpecPair:
    """The cached pair for `recipe` (default: the bench's), trained when missing or when `rebuild`. `target`: a
    trained target checkpoint (with its MTP layer) to train the draft and DSpark against; None: the recipe's
    target is trained too, into the cache."""
    recipe = recipe or Recipe()
    data_path = data_path or DATA / "train.jsonl"
    root = cache_dir or cache_root()
    key = recipe.key(data_path) + ("" if target is None else "-" + file_sha256(target / SINGLE_FILE)[:12])
    final = root / key
    if rebuild and final.exists():
        shutil.rmtree(final)
    if not (final / "report.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        (data, about), data_sec = timed(training_data, recipe, data_path, log)
        if target is None:
            model, stages = train_target_stages(recipe, data, log)
            write_checkpoint(model, tmp / "target")
        else:
            model, stages = served_target(target), {}
        stages |= train_drafters_into(tmp, recipe, model, data, log)
        for name in ("target", "draft"):
            if (tmp / name).is_dir():
                load_model(tmp / name)  # refuse to publish an artifact that does not load
        report = {"recipe_version": RECIPE_VERSION, "recipe": dataclasses.asdict(recipe), "data": about,
                  "target": "trained here" if target is None else str(target), **stage_report(stages)}
        report["seconds"]["data"] = round(data_sec, 1)
        (tmp / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        shutil.rmtree(final, ignore_errors=True)  # a leftover without report.json
        os.replace(tmp, final)
    return SpecPair(target or final / "target", final / "draft", final / "dspark", final / "report.json")


def measure(pair: SpecPair) -> dict[str, Any]:
    """Top-1 agreements of the pair's proposers with its target as served, on held-out gsm8k text, and the
    target's replies to two test questions."""
    target = served_target(pair.target)
    draft = load_model(pair.draft)
    drafter = load_dspark(pair.dspark, target)
    tok = load_tokenizer()
    test = read_jsonl(DATA / "test.jsonl")
    agree = agreement(target, draft, held_out_ids(tok, test), drafter)
    return {"agreement": agree._asdict(), "samples": [
        {"question": e["question"], "reply": r, "label": e["answer"].split("####")[-1].strip()}
        for e, r in zip(test[:2], sample_replies(target, tok, test[:2]), strict=True)]}


def write_served(model: KimiForCausalLM, out: Path) -> Path:
    """`model` as the built-in checkpoint (bf16, the fp32 gates kept fp32, as when served) with the built-in
    tokenizer's files (transformers' too: `bench_serving` and lm-eval load the folder /model_info names), into a
    fresh temporary folder beside `out` that the caller renames into place. Returns the folder."""
    served = build_model(model.config.replace(dtype="bfloat16"))
    served.load_state_dict(model.state_dict())
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    write_checkpoint(served, tmp)
    write_hf_tokenizer(tmp)
    return tmp


def write_builtin(recipe: Recipe, out: Path = BUILTIN, data_path: Path | None = None, log: bool = True) -> Path:
    """Train the target (stages 1-2), write it in bf16 into `out` (replacing it), train the draft and DSpark
    against it as served (into the cache, where the bench finds them), and write `out/recipe.json`: the recipe,
    data, losses, agreements, seconds per stage and the command."""
    data_path = data_path or DATA / "train.jsonl"
    t0 = time.perf_counter()
    (data, about), data_sec = timed(training_data, recipe, data_path, log)
    model, stages = train_target_stages(recipe, data, log)
    tmp = write_served(model, out)
    load_model(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    pair = ensure_spec_pair(True, recipe=recipe, target=out, data_path=data_path, log=log)
    train_seconds = round(time.perf_counter() - t0, 1)  # before measuring: the recipe's cost
    mine, drafters = stage_report(stages), json.loads(pair.report.read_text())
    # The drafters' run tokenised the data again: those seconds count in train_seconds only.
    drafter_seconds = {k: v for k, v in drafters["seconds"].items() if k != "data"}
    report = {"recipe_version": RECIPE_VERSION, "recipe": dataclasses.asdict(recipe), "data": about,
              "first_loss": mine["first_loss"] | drafters["first_loss"],
              "final_loss": mine["final_loss"] | drafters["final_loss"], **measure(pair),
              "seconds": {"data": round(data_sec, 1)} | mine["seconds"] | drafter_seconds,
              "train_seconds": train_seconds, "threads": torch.get_num_threads(), "command": WRITE_COMMAND}
    (out / "recipe.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return out


def retrain_mtp(recipe: Recipe, out: Path = BUILTIN, data_path: Path | None = None, log: bool = True) -> Path:
    """Stage 2 alone, on the committed target: its MTP layer reset to what stage 1 leaves it (the seeded init,
    which the target's training never touches), trained again against the target as served, as `--write-builtin`
    does after stage 1. Rewrites the checkpoint (the target's own tensors unchanged: checked) and the MTP figures
    of `out/recipe.json`; the draft and DSpark figures stand (they depend on the target's own weights only)."""
    data_path = data_path or DATA / "train.jsonl"
    report = json.loads((out / "recipe.json").read_text())
    (data, _), _ = timed(training_data, recipe, data_path, log)
    before = served_target(out)
    target = served_target(out)
    init = as_served(build_model(recipe.target, seed=recipe.seed))
    target.model.mtp_layers.load_state_dict(init.model.mtp_layers.state_dict())
    m_loss, m_sec = timed(train_mtp, target, data, recipe.mtp_stage, recipe.seed, "mtp" if log else "")
    tmp = write_served(target, out)
    written = served_target(tmp)
    for (name, a), b in zip(before.state_dict().items(), written.state_dict().values(), strict=True):
        if ".mtp_layers." not in name and not torch.equal(a, b):
            raise RuntimeError(f"retraining the MTP layer changed the target's {name}")
    tok = load_tokenizer()
    mtp = mtp_agreement(written, held_out_ids(tok, read_jsonl(DATA / "test.jsonl")))
    stage = stage_report({"mtp": Trained(m_loss, m_sec)})
    report["train_seconds"] = round(report["train_seconds"] - report["seconds"]["mtp"] + m_sec, 1)
    report |= {"recipe_version": RECIPE_VERSION, "recipe": dataclasses.asdict(recipe),
               "first_loss": report["first_loss"] | stage["first_loss"],
               "final_loss": report["final_loss"] | stage["final_loss"],
               "agreement": report["agreement"] | {"mtp_top1": mtp},
               "seconds": report["seconds"] | stage["seconds"], "mtp_retrained_by": RETRAIN_COMMAND}
    (tmp / "recipe.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def retrain_dspark(recipe: Recipe, out: Path = BUILTIN, data_path: Path | None = None, log: bool = True,
                   cache_dir: Path | None = None) -> Path:
    """Stage 4 alone, against the committed target as served: DSpark trained as `ensure_spec_pair` trains it (the
    recipe's `dspark_stage`, the same seeds: the same bytes). Updates only the DSpark figures of
    `out/recipe.json` (first and final loss, agreement, seconds, the recipe) and the checkpoint is not touched
    (the drafter is no part of it: checked). The drafter goes where the bench finds it: into the cached pair of
    this recipe and target when one is there (its `dspark` and its report's DSpark figures replaced). The cache
    key covers the whole recipe, so a changed `dspark_stage` names a pair not trained yet: the first bench run
    trains it (the draft model too, as it trains any new recipe's pair), and its DSpark is this one."""
    data_path = data_path or DATA / "train.jsonl"
    report = json.loads((out / "recipe.json").read_text())
    checkpoint = (out / SINGLE_FILE).read_bytes()
    (data, _), _ = timed(training_data, recipe, data_path, log)
    target = served_target(out)
    ds, trained = train_dspark_stage(recipe, target, data, log)
    if (out / SINGLE_FILE).read_bytes() != checkpoint:
        raise RuntimeError(f"retraining DSpark changed {out / SINGLE_FILE}")
    ds_top1 = dspark_agreement(target, ds, held_out_ids(load_tokenizer(), read_jsonl(DATA / "test.jsonl")))
    stage = stage_report({"dspark": trained})
    report["train_seconds"] = round(report["train_seconds"] - report["seconds"]["dspark"] + trained.seconds, 1)
    report |= {"recipe_version": RECIPE_VERSION,
               "recipe": report["recipe"] | {"dspark_stage": dataclasses.asdict(recipe.dspark_stage)},
               "first_loss": report["first_loss"] | stage["first_loss"],
               "final_loss": report["final_loss"] | stage["final_loss"],
               "agreement": report["agreement"] | {"dspark_top1": ds_top1},
               "seconds": report["seconds"] | stage["seconds"], "dspark_retrained_by": RETRAIN_DSPARK_COMMAND}
    tmp = out / f".tmp-recipe-{os.getpid()}.json"
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, out / "recipe.json")
    pair = (cache_dir or cache_root()) / (recipe.key(data_path) + "-" + file_sha256(out / SINGLE_FILE)[:12])
    if (pair / "report.json").is_file():
        staged = pair / f".tmp-dspark-{os.getpid()}"
        shutil.rmtree(staged, ignore_errors=True)
        write_dspark_checkpoint(ds, staged)
        shutil.rmtree(pair / "dspark", ignore_errors=True)
        os.replace(staged, pair / "dspark")
        cached = json.loads((pair / "report.json").read_text())
        for k in ("first_loss", "final_loss", "seconds"):
            cached[k] = cached[k] | stage[k]
        (pair / "report.json").write_text(json.dumps(cached, indent=2, default=str) + "\n")
        if log:
            print(f"drafter: {pair / 'dspark'}", flush=True)
    elif log:
        print("drafter: no cached pair for this recipe yet (the first bench run trains it, DSpark included)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rebuild", action="store_true", help="retrain the draft and DSpark even when cached")
    ap.add_argument("--steps-scale", type=float, default=1.0, help="multiply every stage's steps")
    ap.add_argument("--write-builtin", action="store_true",
                    help=f"retrain the built-in target into {BUILTIN.relative_to(REPO)} (then the rest against it)")
    ap.add_argument("--retrain-mtp", action="store_true",
                    help=f"retrain only the MTP layer of {BUILTIN.relative_to(REPO)} (stage 2 on the committed target)")
    ap.add_argument("--retrain-dspark", action="store_true",
                    help=f"retrain only DSpark against {BUILTIN.relative_to(REPO)} (stage 4 on the committed target)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the recipe's figures: 2)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    recipe = Recipe().scaled(a.steps_scale) if a.steps_scale != 1.0 else Recipe()
    if a.retrain_mtp or a.retrain_dspark:
        report = json.loads(((retrain_mtp if a.retrain_mtp else retrain_dspark)(recipe) / "recipe.json").read_text())
        print("final loss", json.dumps(report["final_loss"]), "seconds", json.dumps(report["seconds"]))
        print("agreement (top-1 with the target on held-out gsm8k text):", json.dumps(report["agreement"]))
        return
    if a.write_builtin:
        out = write_builtin(recipe)
        report = json.loads((out / "recipe.json").read_text())
        pair = ensure_spec_pair(recipe=recipe, target=out)
    else:
        t0 = time.perf_counter()
        pair = ensure_spec_pair(a.rebuild, recipe=recipe, target=BUILTIN, log=True)
        print(f"artifact: {pair.draft.parent} ({time.perf_counter() - t0:.0f}s)")
        report = json.loads(pair.report.read_text()) | measure(pair)
    print(f"target: {pair.target.relative_to(REPO) if pair.target.is_relative_to(REPO) else pair.target}")
    print("final loss", json.dumps(report["final_loss"]), "seconds", json.dumps(report["seconds"]))
    for s in report["samples"]:
        print(f"--- {s['question']}\n>>> {s['reply']!r}\n(label {s['label']})")
    print("agreement (top-1 with the target on held-out gsm8k text):", json.dumps(report["agreement"]))


if __name__ == "__main__":
    main()
