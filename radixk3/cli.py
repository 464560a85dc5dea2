"""`radixk3` command line: plan, make-checkpoint, generate, serve.

One of the package's public entry points (with `radixk3.Engine` and `python -m radixk3.launch_server`), the one
exception to "radixk3 imports nothing of runtime" (tests/test_imports.py lists them): `generate` and `serve`
start the runtime, imported inside those commands."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import orjson

from radixk3.builtin_model import checkpoint_dir
from radixk3.config import PRESETS, TINY_PRESET, TRUE_SIZE_PRESETS, ConfigError, preset
from radixk3.config_formats import load_model_config
from radixk3.generation_config import load_generation_config
from radixk3.plan import EXPERT_FORMATS, memory_plan, parallel_plan, parse_bytes


def _plan(args: argparse.Namespace) -> None:
    cfg = preset(args.preset) if args.model is None else load_model_config(args.model)
    name = args.preset if args.model is None else str(args.model)
    mem = None if args.mem_bytes is None else parse_bytes(args.mem_bytes)
    par = parallel_plan(cfg, args.tp, args.ep, args.dp, args.enable_dp_attention, mem, args.expert_format,
                        args.quantization)
    plan = memory_plan(cfg, par.attn_tp)
    from radixk3.vision.plan import vision_plan  # imports torch: `serve`'s process needs none of it

    vision = vision_plan(cfg)
    if args.json:
        source = {"preset": args.preset} if args.model is None else {"model": str(args.model)}
        source |= {"quantization": args.quantization}
        extra = {} if vision is None else {"vision": vision._asdict()}
        print(orjson.dumps(plan._asdict() | par.as_dict() | source | extra).decode())
        return
    mtp = f" (+ {cfg.num_nextn_predict_layers} MTP)" if cfg.num_nextn_predict_layers else ""
    print(f"{'model' if args.model else 'preset'} {name} ({cfg.model_type}), TP={par.tp} EP={par.ep} DP={par.dp}"
          f"{' with DP attention' if par.dp_attention else ''} on {par.devices} devices: {cfg.num_kda_layers} KDA + "
          f"{cfg.num_mla_layers} MLA layers{mtp}")
    if par.dp_attention:
        print(f"  DP attention: {par.dp} groups of {par.attn_tp} ranks, each with its own requests and KV; attention "
              f"and each request's KDA state split {par.attn_tp} ways ({par.dp}x a plain --tp {par.tp} state), "
              f"the MoE and MLPs split {par.tp} ways")
    elif par.dp > 1:
        print(f"  {par.dp} replicas of --tp {par.tp}, each with its own requests and KV")
    print(f"  KDA state per request per rank: {plan.state_bytes_per_request / 1e6:.2f} MB "
          f"({plan.state_bytes_per_request} bytes; recurrent {plan.recurrent_bytes_per_layer} "
          f"+ conv {plan.conv_bytes_per_layer} bytes per layer)")
    print(f"  MLA KV per token per rank:      {plan.kv_bytes_per_token / 1e3:.2f} KB ({plan.kv_bytes_per_token} bytes)")
    print(f"  one state weighs as much as {plan.tokens_per_state:,.0f} tokens of KV")
    if plan.mtp_kv_bytes_per_token:
        print(f"  MTP draft KV per token per rank: {plan.mtp_kv_bytes_per_token} bytes (not in the pool figures)")
    w = par.weights
    expert_format = args.expert_format or (cfg.expert_quant.kind if cfg.expert_quant else args.quantization
                                           or cfg.dtype)
    print(f"  weights per rank: {w.total / 1e9:.2f} GB (routed experts {w.routed_experts / 1e9:.2f} GB as "
          f"{expert_format}, other split tensors {w.sharded / 1e9:.2f} GB, replicated "
          f"{w.replicated / 1e9:.2f} GB)")
    if args.quantization:
        print(f"  --quantization {args.quantization}: the projections and dense routed experts as codes and scales; "
              f"the embedding, norms, router, KDA gates and MLA's kv_b_proj in {cfg.dtype}")
    if vision is not None:
        print(f"  vision tower per rank (replicated, not in the figures above): {vision.weight_bytes / 1e6:.1f} MB "
              f"weights; the largest image ({vision.image_patches} patches) needs about "
              f"{vision.activation_bytes_varlen / 1e6:.0f} MB of activations with varlen flash attention, "
              f"{vision.activation_bytes_sdpa / 1e9:.1f} GB with SDPA's mask and scores")
    if par.mem_bytes is None or par.pool_bytes is None:
        print("  (give --mem-bytes for the pool: device memory per rank less the weights)")
    elif par.pool_bytes <= 0:
        print(f"  memory per rank {par.mem_bytes / 1e9:.2f} GB: the weights exceed it by {-par.pool_bytes / 1e9:.2f} "
              f"GB: no pool (more ranks, or --expert-format)")
    else:
        print(f"  memory per rank {par.mem_bytes / 1e9:.2f} GB: pool {par.pool_bytes / 1e9:.2f} GB = "
              f"{par.states_fit:,} KDA states or {par.tokens_fit:,} KV tokens per rank (state blocks "
              f"{par.state_block_bytes} B aligned)")
        if par.groups > 1:
            print(f"  system ({par.groups} groups): {par.states_fit * par.groups:,} states or "
                  f"{par.tokens_fit * par.groups:,} tokens")


# Drafter presets: (writer's target preset); a drafter stores no embedding or lm_head, only the target's sizes.
DRAFTER_PRESETS = {"k3-tiny-dspark": "k3-tiny-native"}


def _make_checkpoint(args: argparse.Namespace) -> None:
    packed = args.expert_format not in (None, "none")
    if args.preset in DRAFTER_PRESETS:
        if packed or args.tokenizer is not None or args.vision:
            raise ConfigError(f"preset {args.preset!r} is a DSpark drafter: it has no routed experts to quantise "
                              "and no tokenizer or vision tower of its own (it uses its target's); drop "
                              "--expert-format, --tokenizer and --vision")
        from radixk3.dspark_checkpoint import write_random_dspark
        from radixk3.model import build_model

        out = write_random_dspark(args.out, build_model(preset(DRAFTER_PRESETS[args.preset])), seed=args.seed)
        print(f"wrote {args.preset} (seed {args.seed}, for {DRAFTER_PRESETS[args.preset]}) to {out}")
        return
    if args.preset in TRUE_SIZE_PRESETS:
        raise ConfigError(f"preset {args.preset!r} is a true-size plan; random checkpoints are for test presets")
    if args.tokenizer is not None:  # the published layout: tokenizer files, template, generation_config.json
        from radixk3.published_checkpoint import write_published_checkpoint

        out = write_published_checkpoint(args.preset, args.out, tokenizer=args.tokenizer,
                                         expert_format=args.expert_format or "none", num_shards=args.shards,
                                         seed=args.seed)
    elif packed:
        from radixk3.model import build_model
        from radixk3.quant_checkpoint import write_quantised_checkpoint

        out = write_quantised_checkpoint(build_model(preset(args.preset), seed=args.seed), args.out,
                                         args.expert_format, num_shards=args.shards)
    else:
        from radixk3.checkpoint import write_random_checkpoint  # torch: not for `serve`'s tokenizer process

        out = write_random_checkpoint(preset(args.preset), args.out, seed=args.seed, num_shards=args.shards)
    if args.vision:
        from radixk3.vision.weights import add_random_vision

        add_random_vision(out, seed=args.seed)
    what = "".join(f", {k} {v}" for k, v in (("experts", args.expert_format), ("tokenizer", args.tokenizer)) if v)
    what += ", vision tower" if args.vision else ""
    print(f"wrote {args.preset} (seed {args.seed}{what}) to {out}")


class GenerateError(RuntimeError):
    """The engine refused or failed the request."""


def _check_tokenizer(model: str | None, mode: str, trust_remote_code: bool) -> None:
    """The tokenizer the flags pick is one that loads (native files for --tokenizer-mode native; remote code only
    with --trust-remote-code), said in one line before any process starts."""
    from radixk3.tokenizer import has_tokenizer_files, tokenizer_kind

    if model is not None and (mode == "hf" or has_tokenizer_files(Path(model))):
        tokenizer_kind(model, mode, trust_remote_code)


def _generate(args: argparse.Namespace) -> None:
    # Imported here so that `plan` and `make-checkpoint` stay instant (no engine, no ZeroMQ).
    from runtime.model_files import model_config
    from runtime.server_args import ServerArgs
    from runtime.tokenizer.engine import Engine, EngineError

    server_args = ServerArgs.from_cli_args(args)
    # Checked here, before any process starts, so that a bad directory gets a one-line error.
    cfg = model_config(server_args)
    _check_tokenizer(checkpoint_dir(server_args.model), server_args.tokenizer_mode, server_args.trust_remote_code)
    try:
        engine = Engine(**dataclasses.asdict(server_args))
    except EngineError as e:
        raise GenerateError(str(e)) from e
    with engine:
        tok = engine.tokenizer
        ids = tok.encode(args.prompt, add_bos=True)
        if max(ids) >= cfg.vocab_size:
            raise ConfigError(f"tokenizer id {max(ids)} exceeds the model's vocab_size {cfg.vocab_size}")
        sampling = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                    "ignore_eos": args.ignore_eos}
        if args.sampling_seed is not None:
            sampling["seed"] = args.sampling_seed
        detok = tok.incremental_decoder()  # prints only whole characters, never half of a multi-byte one
        sys.stdout.write(args.prompt)
        for chunk in engine.stream(ids, sampling):
            if chunk.finished == "error":
                sys.stdout.write("\n")
                raise GenerateError(chunk.error or "the request failed")
            for t in chunk.token_ids:  # a stop token is special: the decoder skips it
                sys.stdout.write(detok.push(t))
            sys.stdout.flush()
        sys.stdout.write(detok.flush() + "\n")


def _serve(args: argparse.Namespace) -> None:
    # Imported here: FastAPI, uvicorn and the engine only for `serve`.
    from runtime.http.server import run_server
    from runtime.server_args import ServerArgs

    server_args = ServerArgs.from_cli_args(args)
    if (directory := checkpoint_dir(server_args.model)) is not None:
        load_model_config(directory)  # a bad directory gets a one-line error before any process starts
        load_generation_config(directory)
        _check_tokenizer(directory, server_args.tokenizer_mode, server_args.trust_remote_code)
    if server_args.node_rank > 0:  # another node: only its ranks, serving node 0's plans until it stops
        from runtime.node_main import run_node

        if run_node(server_args) != 0:
            raise GenerateError(f"node {server_args.node_rank}: a rank failed or node 0 went away")
        return
    if run_server(server_args) != 0:
        raise GenerateError("the server failed to start (see the log above)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixk3", description="Serving runtime for Kimi-K3-class hybrid models")
    sub = p.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="per-rank KDA state, MLA KV, weight and pool sizes under a parallel layout")
    plan.add_argument("--preset", default="kimi-k3", choices=sorted(PRESETS))
    plan.add_argument("--model", type=Path, default=None,
                      help="a checkpoint directory: its config and its experts' format (instead of --preset)")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    plan.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (divides --tp)")
    plan.add_argument("--dp", type=int, default=1, help="data-parallel replicas, or DP attention groups")
    plan.add_argument("--enable-dp-attention", action="store_true", help="attention data-parallel over the TP ranks")
    plan.add_argument("--mem-bytes", default=None, help="device memory per rank (e.g. 141GB, 141e9, 128GiB)")
    plan.add_argument("--expert-format", default=None, choices=sorted(EXPERT_FORMATS),
                      help="routed experts stored quantised (default: the model dtype, or with --model the "
                           "checkpoint's own format)")
    plan.add_argument("--quantization", default=None, choices=("int8", "int4"),
                      help="weight-only quantisation at load, as `radixk3 serve --quantization` does it: the "
                           "projections' and the dense routed experts' codes and scales counted")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(fn=_plan)

    mk = sub.add_parser("make-checkpoint", help="write a seeded random checkpoint (config, safetensors, tokenizer)")
    mk.add_argument("out", type=Path)
    mk.add_argument("--preset", default=TINY_PRESET, choices=sorted([*PRESETS, *DRAFTER_PRESETS]))
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--shards", type=int, default=1, help="safetensors shards (>1 writes an index)")
    mk.add_argument("--expert-format", default=None, choices=("mxfp4", "int4", "fp8", "none"),
                    help="routed experts (MTP layers' included) packed by compressed-tensors, with its "
                         "quantization_config in config.json (default: dense)")
    mk.add_argument("--tokenizer", default=None, choices=("tiktoken", "sentencepiece"),
                    help="the published layout: Kimi's tiktoken.model + tokenizer_config.json (vocab_size and "
                         "special ids to match) or the built-in sentencepiece model, Kimi's Jinja template for "
                         "the Kimi-Linear format, generation_config.json (default: the built-in tokenizer only)")
    mk.add_argument("--vision", action="store_true",
                    help="K3 format: add a small random vision tower (vision_config, vision_tower.*, mm_projector.*)")
    mk.set_defaults(fn=_make_checkpoint)

    from runtime.server_args import ServerArgs  # settings only: imports neither the engine nor ZeroMQ

    gen = sub.add_parser("generate", help="stream a completion through the engine (greedy by default)",
                         description="Starts radixk3.Engine with the ServerArgs flags below (--model DIR: a "
                                     "checkpoint, or a test preset; default: the built-in k3-gsm8k) and streams the "
                                     "text.")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampler (temperature > 0)")
    gen.add_argument("--ignore-eos", action="store_true")
    ServerArgs.add_cli_args(gen)
    # One short request never repays compiling the decode step (tens of seconds per batch size on a CPU): generate
    # decodes eagerly; RADIXK3_COMPILE=1 compiles anyway. `serve` and Engine() compile (--disable-compile).
    gen.set_defaults(fn=_generate, disable_compile=True)

    serve = sub.add_parser("serve", help="the HTTP server: native (/generate) and OpenAI-compatible (/v1) APIs",
                           description="Starts the engine with the ServerArgs flags below (--model/--model-path "
                                       "DIR or a test preset; default: the built-in k3-gsm8k) behind FastAPI on "
                                       "uvicorn; "
                                       "SIGTERM drains in-flight requests and exits. With --nnodes N "
                                       "--node-rank R > 0 --dist-init-addr HOST:PORT it runs only node R's "
                                       "ranks (no HTTP) until node 0 shuts down or goes away.")
    ServerArgs.add_cli_args(serve)
    serve.set_defaults(fn=_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.fn(args)
    except (ConfigError, FileNotFoundError, ValueError, GenerateError) as e:  # CheckpointError is a ValueError
        print(f"radixk3 {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
