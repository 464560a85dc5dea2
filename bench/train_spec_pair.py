"""The trained model pair for the speculative-decoding bench: a small K3-family target with an MTP layer, a tiny
draft model, and (when the DSpark trainer is present) a DSpark drafter, all trained here on the gsm8k train set
the project ships, seeded and deterministic, in CPU minutes.

Stages, each on the frozen result of the one before:
1. target: next-token cross-entropy on "Question: ...\\nAnswer: ..." examples joined by blank lines (the shape of
   `bench/gsm8k.py`'s few-shot prompts), cut into fixed windows;
2. its MTP layer: token t+2 from (the target's pre-norm hidden state at t, token t+1); lm_head shared, frozen;
3. the draft: a 2-layer K3-family model distilled from the target (KL to its distribution plus cross-entropy);
4. DSpark, through `bench/spec_train_dspark.py`'s `train_dspark` when it is importable.

Training differentiates the model's own no-cache forward (`_prenorm_hidden`); nothing in the serving path
changes. The artifact is cached under `$XDG_CACHE_HOME/radixk3/spec_pair/<key>`, `<key>` a hash of the recipe
and data, written into a temporary directory and renamed into place (a killed run leaves no half artifact).

    python bench/train_spec_pair.py [--rebuild] [--steps-scale X]
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
from radixk3.checkpoint import load_model, write_checkpoint  # noqa: E402
from radixk3.config import ModelConfig, every_mla  # noqa: E402
from radixk3.model import KimiForCausalLM, build_model  # noqa: E402
from radixk3.mtp import run_mtp_layer  # noqa: E402
from radixk3.tokenizer import load_tokenizer  # noqa: E402

RECIPE_VERSION = 1  # bump when the training code changes what a recipe produces


class SpecPair(NamedTuple):
    target: Path
    draft: Path
    dspark: Path | None


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
class Recipe:
    target: ModelConfig = field(default_factory=lambda: k3_config(128, 4, [2, 4], 2, 64, 384, mtp=1))
    draft: ModelConfig = field(default_factory=lambda: k3_config(64, 2, [2], 2, 32, 192, mtp=0))
    target_stage: Stage = Stage(steps=400, lr=3e-3, batch=8)
    mtp_stage: Stage = Stage(steps=150, lr=3e-3, batch=8)
    draft_stage: Stage = Stage(steps=150, lr=4e-3, batch=8)
    dspark_steps: int = 150
    dspark_texts: int = 256  # the DSpark trainer holds the target's distribution at every token of its texts
    seq_len: int = 256
    num_examples: int | None = None  # None: the whole train set
    seed: int = 0

    def scaled(self, x: float) -> Recipe:
        def s(st: Stage) -> Stage:
            return dataclasses.replace(st, steps=max(1, round(st.steps * x)))
        return dataclasses.replace(self, target_stage=s(self.target_stage), mtp_stage=s(self.mtp_stage),
                                   draft_stage=s(self.draft_stage), dspark_steps=max(1, round(self.dspark_steps * x)))

    def key(self, data: Path) -> str:
        raw = {"version": RECIPE_VERSION, "recipe": dataclasses.asdict(self), "data_size": data.stat().st_size}
        return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:12]


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


def train_target(cfg: ModelConfig, data: torch.Tensor, stage: Stage, seed: int, log: str) -> tuple[
        KimiForCausalLM, list[float]]:
    model = build_model(cfg, seed=seed).train()
    params = [p for n, p in model.named_parameters() if ".mtp_layers." not in n]

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        logits = logits_of(model, x)[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))

    return model, optimise(params, stage, loss_fn, data, torch.Generator().manual_seed(seed + 1), log)


def mtp_loss(model: KimiForCausalLM, x: torch.Tensor) -> torch.Tensor:
    """MTP layer 0 on (h_t, token t+1) -> token t+2, for t = 0..T-3 of each window; the target frozen."""
    b, t = x.shape
    with torch.no_grad():
        ids, cu = packed(x)
        h = model._prenorm_hidden(ids, cu).view(b, t, -1)
    nxt, cu_m = packed(x[:, 1:])
    out = run_mtp_layer(model.model.mtp_layers, 0, nxt, h[:, :-1].reshape(-1, h.shape[-1]), cu_m, None)
    logits = model.mtp_logits(0, out).view(b, t - 1, -1)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 2:].reshape(-1))


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
            teacher = F.log_softmax(logits_of(target, x)[:, :-1], -1).flatten(0, 1)
        logits = logits_of(draft, x)[:, :-1].flatten(0, 1)
        logp = F.log_softmax(logits, -1)
        kl = F.kl_div(logp, teacher, log_target=True, reduction="batchmean")
        return kl + F.cross_entropy(logits, x[:, 1:].reshape(-1))

    return draft, optimise(list(draft.parameters()), stage, loss_fn, data, torch.Generator().manual_seed(seed + 4),
                           log)


def dspark_trainer() -> Any:
    """(train_dspark, write_dspark_checkpoint, config for a target) when the DSpark trainer is part of the
    tree, else None."""
    try:
        from bench.spec_train_dspark import train_dspark
        from radixk3.dspark_checkpoint import write_dspark_checkpoint
        from radixk3.dspark_config import k3_tiny_dspark_preset
    except ImportError:
        return None

    def config_for(target: ModelConfig) -> Any:
        # The k3-tiny drafter's shape at the target's width, reading an early and the last target layer
        # (layers 1 and 3 of 4, as the preset does for k3-tiny-native).
        n = target.num_hidden_layers
        ids = tuple(sorted({n // 4, n - 1}))
        return k3_tiny_dspark_preset().replace(
            hidden_size=target.hidden_size, target_hidden_size=target.hidden_size, num_target_layers=n,
            target_layer_ids=ids, intermediate_size=2 * target.hidden_size)

    return train_dspark, write_dspark_checkpoint, config_for


def train_into(out: Path, recipe: Recipe, data_path: Path, log: bool) -> dict[str, Any]:
    """Train every stage and write the checkpoints into `out`; returns the report."""
    torch.manual_seed(recipe.seed)
    t0 = time.perf_counter()
    stream = token_stream(data_path, recipe.num_examples)
    data = windows(stream, recipe.seq_len)
    say = (lambda s: print(s, flush=True)) if log else (lambda s: None)
    say(f"data: {stream.numel()} tokens, {data.shape[0]} windows of {recipe.seq_len}")
    target, t_loss = train_target(recipe.target, data, recipe.target_stage, recipe.seed, "target" if log else "")
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    m_loss = train_mtp(target, data, recipe.mtp_stage, recipe.seed, "mtp" if log else "")
    draft, d_loss = train_draft(recipe.draft, target, data, recipe.draft_stage, recipe.seed, "draft" if log else "")
    write_checkpoint(target.eval(), out / "target")
    write_checkpoint(draft.eval(), out / "draft")
    report: dict[str, Any] = {"recipe": dataclasses.asdict(recipe), "tokens": stream.numel(),
                              "final_loss": {"target": tail_mean(t_loss), "mtp": tail_mean(m_loss),
                                             "draft": tail_mean(d_loss)},
                              "first_loss": {"target": t_loss[0], "mtp": m_loss[0], "draft": d_loss[0]}}
    trainer = dspark_trainer()
    if trainer is not None:
        train_dspark, write_dspark, config_for = trainer
        tok = load_tokenizer()
        texts = [tok.encode(one_example(e, True)) for e in read_jsonl(data_path)[: recipe.dspark_texts]]
        ds_loss: list[float] = []
        ds = train_dspark(target, texts, seed=recipe.seed, steps=recipe.dspark_steps, losses=ds_loss,
                          cfg=config_for(recipe.target))
        write_dspark(ds, out / "dspark")
        report["final_loss"]["dspark"] = tail_mean(ds_loss)
        report["first_loss"]["dspark"] = ds_loss[0]
    report["train_seconds"] = time.perf_counter() - t0
    return report


def tail_mean(losses: list[float]) -> float:
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def ensure_spec_pair(rebuild: bool = False, *, recipe: Recipe | None = None, cache_dir: Path | None = None,
                     data_path: Path | None = None, log: bool = False) -> SpecPair:
    """The cached pair for `recipe` (default: the bench's), trained when missing or when `rebuild`."""
    recipe = recipe or Recipe()
    data_path = data_path or DATA / "train.jsonl"
    root = cache_dir or cache_root()
    final = root / recipe.key(data_path)
    if rebuild and final.exists():
        shutil.rmtree(final)
    if not (final / "report.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        report = train_into(tmp, recipe, data_path, log)
        for name in ("target", "draft"):
            load_model(tmp / name)  # refuse to publish an artifact that does not load
        (tmp / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        shutil.rmtree(final, ignore_errors=True)  # a leftover without report.json
        os.replace(tmp, final)
    dspark = final / "dspark"
    return SpecPair(final / "target", final / "draft", dspark if dspark.is_dir() else None)


# --- quick checks of the trained pair ----------------------------------------------------------------------
@torch.inference_mode()
def greedy(model: KimiForCausalLM, prompt: list[int], max_new: int, stop: set[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(max_new):
        nxt = int(model(torch.tensor(ids))[-1].argmax())
        if nxt in stop:
            break
        ids.append(nxt)
    return ids[len(prompt):]


class Agreement(NamedTuple):
    mtp_top1: float  # MTP's argmax for t+2 equals the target's argmax at t+1 (both on the true prefix)
    draft_top1: float  # the draft's argmax equals the target's at the same position


@torch.inference_mode()
def agreement(target: KimiForCausalLM, draft: KimiForCausalLM, ids: torch.Tensor) -> Agreement:
    cu = torch.tensor([0, ids.numel()])
    t_arg = target(ids).argmax(-1)
    h = target.prenorm_hidden(ids, cu)
    mtp = target.forward_mtp(0, ids[1:], h[:-1]).logits.argmax(-1)  # position t predicts t+2
    d_arg = draft(ids).argmax(-1)
    return Agreement(float((mtp[:-1] == t_arg[1:-1]).float().mean()), float((d_arg == t_arg).float().mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rebuild", action="store_true", help="retrain even when the cached artifact exists")
    ap.add_argument("--steps-scale", type=float, default=1.0, help="multiply every stage's steps")
    a = ap.parse_args()
    recipe = Recipe().scaled(a.steps_scale) if a.steps_scale != 1.0 else Recipe()
    t0 = time.perf_counter()
    pair = ensure_spec_pair(a.rebuild, recipe=recipe, log=True)
    print(f"artifact: {pair.target.parent} ({time.perf_counter() - t0:.0f}s)")
    print(json.dumps(json.loads((pair.target.parent / "report.json").read_text())["final_loss"]))
    target, draft = load_model(pair.target), load_model(pair.draft)
    tok = load_tokenizer()
    test = read_jsonl(DATA / "test.jsonl")
    for e in test[:2]:
        prompt = tok.encode(one_example(e, False))
        text = tok.decode(greedy(target, prompt, 128, set(tok.stop_ids))).split("\n\n")[0]
        print(f"--- {e['question']}\n>>> {text!r}\n(label {e['answer'].split('####')[-1].strip()})")
    held = torch.tensor(tok.encode("".join(one_example(e, True) + "\n\n" for e in test[100:110])))
    print(agreement(target, draft, held))


if __name__ == "__main__":
    main()
