"""All engine settings in one typed dataclass, with a CLI parser generated from its fields."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from radixk3.builtin_model import default_model, random_preset
from radixk3.config import PRESET_SEED
from radixk3.tokenizer_base import TOKENIZER_MODES

# "0" turns the compiled decode step off, "1" on, whatever --disable-compile says (the test suite sets "0").
COMPILE_ENV = "RADIXK3_COMPILE"
SPECULATIVE_ALGORITHMS = ("ngram", "mtp", "draft", "dspark")
MAX_DRAFT_TOKENS = 16
MAX_SCHEDULER_STEPS = 64  # a window longer than this delays new requests for little more gain

# Other spellings of a flag, as SGLang users type them.
_ALIASES: dict[str, tuple[str, ...]] = {
    "model": ("--model-path",), "tp_size": ("--tp",), "ep_size": ("--ep",), "dp_size": ("--dp",),
    "max_logprobs": ("--max-top-logprobs",),
}
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "cache_aware")
SAMPLING_DEFAULTS = ("model", "openai")
TOOL_CALL_PARSERS = ("kimi_k2", "kimi_k3")
REASONING_PARSERS = ("kimi_k2", "kimi", "kimi_k3")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("nixl", "fake")
QUANTIZATIONS = ("int8", "int4")  # kernels.weight_quant.METHODS (this module imports no torch)


@dataclass
class ServerArgs:
    model: str | None = field(default=None, metadata={"help": (
        "a checkpoint directory, or a test preset's name (k3-tiny, k3-tiny-native, k3-small: random weights from "
        "--seed); default: $RADIXK3_DEFAULT_MODEL if set, else the built-in k3-gsm8k (a small K3 model trained on "
        "gsm8k text)")})
    tokenizer_mode: str = field(default="auto", metadata={"help": (
        "native: radixk3's own tokenizer (a sentencepiece tokenizer.model, or Kimi's tiktoken.model with its "
        "tokenizer_config.json); hf: the checkpoint's own class through transformers' AutoTokenizer; auto: native "
        "when it recognises the files, else hf")})
    trust_remote_code: bool = field(default=False, metadata={"help": (
        "let --tokenizer-mode hf run the checkpoint's own tokenizer code (tokenizer_config.json's auto_map)")})
    page_size: int = 1
    mem_bytes: int = field(default=64 << 20, metadata={"help": (
        "bytes of each worker rank's unified pool (KDA states and MLA KV, and the speculative scratch)")})
    # Resolved by each worker after its weights load (runtime.worker.pool_memory), never here: a copy of these
    # args made elsewhere (dataclasses.replace) must not take a reading of its own.
    mem_fraction: float | None = field(default=None, metadata={"help": (
        "instead of --mem-bytes: size each worker rank's pool as this share, in (0, 1), of the memory its "
        "device has free once the model's weights are loaded (CUDA: the device's free memory; CPU: the "
        "machine's available memory), read by the worker then; every rank of a replica takes the smallest of "
        "their readings, and the scheduler and the tokenizer use the size the ranks report")})
    max_running_requests: int = 64
    chunked_prefill_size: int = 512  # the most prefill tokens one request computes in a step (its chunk)
    max_prefill_tokens: int | None = field(default=None, metadata={"help": (
        "the most prefill tokens one step computes across requests, shared fairly between the running "
        "prefills and the requests waiting to start (default: --chunked-prefill-size)")})
    disable_radix_cache: bool = False
    schedule_policy: str = "lpm"  # longest prefix match, FCFS fallback for long queues; or "fcfs"
    lpm_max_queue: int = 128  # above this many waiting requests, lpm falls back to fcfs
    decode_checkpoint_interval: int = 64  # checkpoint the KDA state every N decode tokens
    # Running decodes ride in every prefill (extend) step, so that a long prompt never stalls them; SGLang's
    # --enable-mixed-chunk, on by default here (the flag still parses), turned off by --disable-mixed-chunk.
    enable_mixed_chunk: bool = field(default=True, metadata={"off_flag": "--disable-mixed-chunk", "help": (
        "running decodes ride in every prefill step (the default; --disable-mixed-chunk: they wait until "
        "no prefill work is left)")})
    disable_overlap_schedule: bool = False  # plan step N+1 only after step N's result (no overlap)
    num_scheduler_steps: int = field(default=1, metadata={"help": (
        "decode steps a worker runs back to back for one plan when only decodes run (vLLM's flag, its multi-step "
        "scheduling): each step feeds the tokens the one before sampled, and the scheduler plans, checks stops and "
        "streams once per window; a request arriving meanwhile waits for the window's end. 1: a plan per step")})
    schedule_conservativeness: float = 1.0  # scales the decode tokens admission reserves (0: none, retract instead)
    sampling_defaults: str = field(default="model", metadata={"help": (
        "where a request's unset sampling parameters come from (SGLang's flag): model, the checkpoint's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens; its "
        "eos_token_id always ends generation), or openai, the engine's own defaults (temperature 1, no cut-offs)")})
    chat_template: str | None = field(default=None, metadata={"help": (
        "a Jinja chat template file to render chats with, instead of the checkpoint's own (SGLang's and vLLM's "
        "flag); by default a Kimi-Linear-format checkpoint's chat_template.jinja or tokenizer_config.json "
        "chat_template is used, and radixk3's native Kimi framing without one")})
    tool_call_parser: str | None = field(default=None, metadata={"help": (
        "how tool calls are read from replies (SGLang's names): kimi_k2 (<|tool_calls_section_begin|> markup, "
        "after a Jinja template) or kimi_k3 (K3's XTML, with the native and K3 renderers); default: the "
        "chat template family's")})
    reasoning_parser: str | None = field(default=None, metadata={"help": (
        "how reasoning is read from replies (SGLang's names): kimi_k2 (<think>...</think>) or kimi "
        "(Kimi-VL's think markers) after a Jinja template, kimi_k3 (K3's XTML) otherwise; default: none after a "
        "Jinja template, kimi_k3 otherwise")})
    max_queued_requests: int = field(default=4096, metadata={"help": (
        "requests (samples) pending at once; beyond this a new request gets HTTP 503 with Retry-After, and a "
        "request or batch asking for more samples than this in all can never fit: HTTP 400")})
    max_n: int = field(default=128, metadata={"help": (
        "the most samples one prompt may ask for (n; OpenAI's limit); more: HTTP 400")})
    max_logprobs: int = field(default=20, metadata={"help": (
        "the most top logprobs per token a request may ask for (top_logprobs_num, OpenAI's top_logprobs and "
        "logprobs; vLLM's --max-logprobs, also spelled --max-top-logprobs); more: HTTP 400")})
    device: str = "cpu"
    dtype: str = "auto"  # serving dtype of weights, activations and pool: auto (the checkpoint's), bfloat16, float32
    quantization: str | None = field(default=None, metadata={"help": (
        "weight-only quantisation of the model's projections and routed experts at load, after --dtype (SGLang's "
        "and vLLM's flag): int8 (one scale per output channel) or int4 (groups of 32 inputs, scale and zero; "
        "int8 where a weight does not pack), on torch's CPU kernels; the embedding, norms, router and KDA "
        "gates stay in the model dtype (README: Weight-only quantisation)")})
    seed: int = PRESET_SEED  # a random preset's weights
    disable_compile: bool = field(default=False, metadata={"help": (
        "run decode steps eagerly, not through the compiled decode step (torch.compile of the whole decode "
        "forward: inductor's C++ on CPU, CUDA graphs on CUDA, compiled at startup once per batch-size bucket); "
        f"SGLang's --disable-cuda-graph. {COMPILE_ENV}=0 / 1 in the environment overrides it")})
    disable_compiled_verify: bool = field(default=False, metadata={"help": (
        "with the compiled decode step and speculation (n-gram, MTP), run the verify step (and MTP's draft and "
        "catch-up steps) eagerly rather than compiled per batch-size bucket")})
    disable_cpp_wrapper: bool = field(default=False, metadata={"help": (
        "CPU: compile the decode (verify, MTP) steps with inductor's Python wrapper rather than its C++ one, which "
        "makes each step's few hundred kernel and op calls from C++ (10-14% faster small-batch steps here) but "
        "takes longer to compile into an empty inductor cache (k3-small's six buckets 80 -> 138 s; the built-in "
        "model's the same; README: Compiled decode step)")})
    compile_max_bs: int = field(default=32, metadata={"help": (
        "the largest decode batch the compiled step covers (buckets 1, 2, 4, ... up to it, a smaller batch "
        "padded to its bucket; larger ones run eagerly); SGLang's --cuda-graph-max-bs")})
    # Speculative decoding (verify k+1 positions per step; KDA state recovered by ReplaySSM).
    speculative_algorithm: str | None = None  # ngram | mtp | draft | dspark; None: off
    speculative_num_draft_tokens: int = 3  # k drafts per step
    speculative_draft_model: str | None = None  # checkpoint of the draft model (draft) or drafter (dspark)
    speculative_ngram_max: int = 4  # n-gram prompt lookup: longest suffix matched
    speculative_ngram_min: int = 1  # ... and the shortest
    speculative_ngram_capacity: int = 1 << 16  # requests' tokens (running, finished) n-gram drafts come from (0: off)
    spec_state: str = "replay"  # how the KDA state of the draft window is recovered: replay | snapshot
    debug_spec_state: bool = False  # after every verify, check the live KDA state against plain decode (tests)
    # Images (models with a vision tower): what a request's images may cost, and the worker's encoder cache.
    max_images_per_request: int = field(default=16, metadata={"help": (
        "the most images one request may carry; more: HTTP 400")})
    max_image_bytes: int = field(default=16 << 20, metadata={"help": (
        "the largest encoded image (decoded from base64, or fetched), in bytes; larger: HTTP 400")})
    max_image_pixels: int = field(default=1 << 26, metadata={"help": (
        "the most pixels (width x height) an image may have before it is resized; more: HTTP 400")})
    allow_image_urls: bool = field(default=False, metadata={"help": (
        "fetch http(s) image URLs (within --max-image-bytes and --image-url-timeout); without it only data: URLs "
        "and base64 are taken")})
    image_url_timeout: float = 10.0  # seconds an image URL's fetch may take in all
    image_encoder_cache_bytes: int = field(default=256 << 20, metadata={"help": (
        "bytes of vision-encoder outputs each worker rank keeps by image content hash (least recently used out), "
        "so that a repeated image is not encoded again")})
    # Structured output (runtime.grammar): what a grammar may cost the server.
    max_grammar_bytes: int = field(default=128 << 10, metadata={"help": (
        "the largest regex / json_schema / ebnf a request may carry, in bytes (UTF-8); larger ones get 400")})
    grammar_compile_timeout: float = field(default=30.0, metadata={"help": (
        "seconds a new grammar may take to compile (in a worker process, killed past it); then the request "
        "gets 400 and the grammar is refused at once if it comes again")})
    grammar_cache_bytes: int = field(default=256 << 20, metadata={"help": (
        "bytes of compiled grammars the scheduler keeps (least recently used out; /flush_cache empties it)")})
    grammar_compile_workers: int = field(default=2, metadata={"help": (
        "worker processes compiling new grammars, started at the first one (each ~300 MB: they import torch)")})
    # Parallelism past one device (torch.distributed: gloo on CPU, NCCL on CUDA), spelled as SGLang spells it.
    tp_size: int = 1  # tensor-parallel ranks per engine replica (--tp)
    ep_size: int = 1  # expert-parallel ranks for the MoE, inside the TP group (--ep; divides --tp)
    dp_size: int = 1  # data-parallel: engine replicas, or DP attention ranks with --enable-dp-attention (--dp)
    enable_dp_attention: bool = False  # attention data-parallel over the TP ranks (--dp divides --tp)
    load_balance_method: str = "cache_aware"  # DP replicas: round_robin | shortest_queue | cache_aware
    nnodes: int = 1  # machines the ranks span
    node_rank: int = 0  # this machine's index; node 0 runs the tokenizer and scheduler
    dist_init_addr: str | None = None  # host:port of node 0's rendezvous; None: a free local port
    dist_timeout: float = 60.0  # seconds a collective may wait before the group fails (a dead or hung rank)
    watchdog_timeout: float = field(default=300.0, metadata={"help": (
        "seconds a forward step, or a scheduler with requests pending, may go without progress before the "
        "watchdog fails the requests concerned with an error naming the stuck process (the worker rank or "
        "the scheduler) and /health answers 503 until it recovers; 0 turns the watchdog off")})
    # Prefill/decode disaggregation, spelled as SGLang spells it (runtime.disagg): a prefill server computes the
    # prompt and writes the request's memory into a decode server's pool; sglang-router --pd-disaggregation
    # sends each request to both with a bootstrap room.
    disaggregation_mode: str = field(default="null", metadata={"help": (
        "null: serve whole requests; prefill: compute prompts and send their KV pages and KDA state to the decode "
        "server that a request's bootstrap fields name; decode: receive them and decode. With "
        "--speculative-algorithm the decode server speculates; a prefill server samples one token, never "
        "speculates, but runs the same mtp / draft / dspark proposer, whose state over the prompt moves too")})
    disaggregation_transfer_backend: str = field(default="nixl", metadata={"help": (
        "nixl: NIXL (UCX) writes into the decode pool's registered memory; fake: in-process copies (tests)")})
    disaggregation_bootstrap_port: int = field(default=8998, metadata={"help": (
        "prefill mode: the port of the bootstrap server (decode servers look up this server's transfer address)")})
    disaggregation_decode_enable_radix_cache: bool = field(default=False, metadata={"help": (
        "decode mode: a request whose prompt prefix is in this server's radix cache reserves (and receives) only "
        "the MLA pages past it; the KDA state always moves")})
    disaggregation_timeout: float = field(default=60.0, metadata={"help": (
        "seconds a disaggregated request may wait for its other side (decode's reservation, prefill's transfer) "
        "before it fails and its memory is freed")})
    log_level: str = "warning"
    # HTTP server (`radixk3 serve`); the offline Engine ignores these.
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None  # if set: `Authorization: Bearer KEY` on every endpoint but /health
    max_body_bytes: int = 8 << 20  # larger request bodies get 413
    served_model_name: str | None = None  # the model id /v1 reports; default: model_id
    graceful_shutdown_timeout: float = field(default=10.0, metadata={"help": (
        "on SIGTERM: seconds to let in-flight requests finish; then each is aborted and ends with a 503 error "
        "(a stream: an error event and [DONE]), and the server exits 0")})
    timeout_keep_alive: float = field(default=5.0, metadata={"help": (
        "seconds an idle connection is kept after a response for the next request to begin; then the server "
        "closes it (uvicorn's flag and default)")})
    timeout_request_head: float = field(default=60.0, metadata={"help": (
        "seconds a new connection, or a request whose head has begun, may take to send its request line and "
        "headers in full; then the server closes it, so clients that never finish a head hold no connection "
        "(nginx's client_header_timeout and Node's headersTimeout, both 60 s)")})

    def __post_init__(self) -> None:
        if self.model is None or not self.model.strip():  # resolved once: the worker processes copy it as it is
            self.model = default_model()
        random_preset(self.model)  # a true-size preset is refused here, by name
        if self.mem_fraction is not None and not 0 < self.mem_fraction < 1:
            raise ValueError("--mem-fraction must be in (0, 1)")
        if self.page_size < 1:
            raise ValueError("--page-size must be >= 1")
        if self.chunked_prefill_size < self.page_size:
            raise ValueError("--chunked-prefill-size must be >= --page-size")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < self.page_size:
            raise ValueError("--max-prefill-tokens must be >= --page-size")
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise ValueError("--schedule-policy must be 'lpm' or 'fcfs'")
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError("--dtype must be 'auto', 'bfloat16' or 'float32'")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization is not None and self.device != "cpu":
            raise ValueError(f"--quantization {self.quantization} runs on torch's CPU kernels: --device cpu")
        if self.schedule_conservativeness < 0:
            raise ValueError("--schedule-conservativeness must be >= 0")
        if self.max_queued_requests < 1:
            raise ValueError("--max-queued-requests must be >= 1")
        if self.max_n < 1:
            raise ValueError("--max-n must be >= 1")
        if self.max_logprobs < 0:
            raise ValueError("--max-logprobs must be >= 0")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.compile_max_bs < 1:
            raise ValueError("--compile-max-bs must be >= 1")
        if not 0 <= self.port < 65536:
            raise ValueError("--port must be in [0, 65535]")
        if self.max_body_bytes < 1:
            raise ValueError("--max-body-bytes must be >= 1")
        if self.speculative_algorithm not in (None, *SPECULATIVE_ALGORITHMS):
            raise ValueError(f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}")
        if not 1 <= self.num_scheduler_steps <= MAX_SCHEDULER_STEPS:
            raise ValueError(f"--num-scheduler-steps must be in [1, {MAX_SCHEDULER_STEPS}], "
                             f"got {self.num_scheduler_steps}")
        if self.num_scheduler_steps > 1:  # their steps are their own: a window would never run, refused by name
            for on, what in ((self.speculative_algorithm is not None, "--speculative-algorithm"),
                             (self.enable_dp_attention, "--enable-dp-attention"),
                             (self.disaggregation_mode != "null", "--disaggregation-mode")):
                if on:
                    raise ValueError(f"--num-scheduler-steps > 1 with {what} is not supported")
        if not 1 <= self.speculative_num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"--speculative-num-draft-tokens must be in [1, {MAX_DRAFT_TOKENS}]")
        if self.speculative_algorithm in ("draft", "dspark") and self.speculative_draft_model is None:
            raise ValueError(f"--speculative-algorithm {self.speculative_algorithm} needs --speculative-draft-model")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError("--speculative-ngram-min must be in [1, --speculative-ngram-max]")
        if self.speculative_ngram_capacity < 0:
            raise ValueError("--speculative-ngram-capacity must be >= 0")
        if self.spec_state not in ("replay", "snapshot"):
            raise ValueError("--spec-state must be 'replay' or 'snapshot'")
        if self.max_grammar_bytes < 1 or self.grammar_cache_bytes < 0 or self.grammar_compile_workers < 1:
            raise ValueError("--max-grammar-bytes and --grammar-compile-workers must be >= 1, "
                             "--grammar-cache-bytes >= 0")
        if min(self.max_images_per_request, self.max_image_bytes, self.max_image_pixels) < 1 \
                or self.image_encoder_cache_bytes < 0 or not self.image_url_timeout > 0:
            raise ValueError("--max-images-per-request, --max-image-bytes and --max-image-pixels must be >= 1, "
                             "--image-encoder-cache-bytes >= 0, --image-url-timeout > 0")
        if not self.grammar_compile_timeout > 0:  # also refuses NaN
            raise ValueError(f"--grammar-compile-timeout must be > 0 seconds, got {self.grammar_compile_timeout}")
        for name in ("tp_size", "ep_size", "dp_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.tp_size % self.ep_size:
            raise ValueError(f"--ep-size {self.ep_size} must divide --tp-size {self.tp_size}")
        if self.enable_dp_attention and self.tp_size % self.dp_size:
            raise ValueError(f"--dp-size {self.dp_size} must divide --tp-size {self.tp_size} with DP attention")
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(f"--tokenizer-mode must be one of {', '.join(TOKENIZER_MODES)}, "
                             f"got {self.tokenizer_mode!r}")
        if self.sampling_defaults not in SAMPLING_DEFAULTS:
            raise ValueError(f"--sampling-defaults must be one of {', '.join(SAMPLING_DEFAULTS)}, "
                             f"got {self.sampling_defaults!r}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"--load-balance-method must be one of {', '.join(LOAD_BALANCE_METHODS)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes) = [0, {self.nnodes})")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("--nnodes > 1 needs --dist-init-addr host:port (node 0's address)")
        if self.dist_timeout <= 0:
            raise ValueError("--dist-timeout must be > 0")
        if not self.watchdog_timeout >= 0:  # also refuses NaN
            raise ValueError(f"--watchdog-timeout must be >= 0 seconds (0 turns the watchdog off), "
                             f"got {self.watchdog_timeout}")
        if not self.graceful_shutdown_timeout >= 0:  # also refuses NaN
            raise ValueError("--graceful-shutdown-timeout must be >= 0")
        self._check_disaggregation()
        for flag, seconds in (("--timeout-keep-alive", self.timeout_keep_alive),
                              ("--timeout-request-head", self.timeout_request_head)):
            if not 0 < seconds < float("inf"):
                raise ValueError(f"{flag} must be a positive number of seconds, got {seconds}")

    def _check_disaggregation(self) -> None:
        """P/D combinations that are not supported yet fail here, by name, rather than serve wrongly."""
        mode = self.disaggregation_mode
        if mode not in DISAGGREGATION_MODES:
            raise ValueError(f"--disaggregation-mode must be one of {', '.join(DISAGGREGATION_MODES)}, got {mode!r}")
        if self.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"--disaggregation-transfer-backend must be one of {', '.join(TRANSFER_BACKENDS)}")
        if not 0 < self.disaggregation_bootstrap_port <= 65535:
            raise ValueError("--disaggregation-bootstrap-port must be in [1, 65535]")
        if not 0 < self.disaggregation_timeout < float("inf"):
            raise ValueError("--disaggregation-timeout must be a positive number of seconds")
        if self.disaggregation_decode_enable_radix_cache and (mode != "decode" or self.disable_radix_cache):
            raise ValueError("--disaggregation-decode-enable-radix-cache needs --disaggregation-mode decode and the "
                             "radix cache (no --disable-radix-cache)")
        if mode == "null":
            return
        unsupported = [(self.dp_size > 1, "--dp > 1"), (self.enable_dp_attention, "--enable-dp-attention"),
                       (self.nnodes > 1, "--nnodes > 1")]
        for on, what in unsupported:
            if on:
                raise ValueError(f"--disaggregation-mode {mode} with {what} is not supported yet")

    @property
    def model_id(self) -> str:
        """The model as given or defaulted: a checkpoint path, a preset name or the built-in model's name."""
        assert self.model is not None  # __post_init__ resolved it
        return self.model

    @property
    def overlap_schedule(self) -> bool:
        """Whether the step loop overlaps planning with the worker. Not with speculation: a verify step's
        positions depend on how many drafts the step before it accepted."""
        return not self.disable_overlap_schedule and self.speculative_algorithm is None

    @property
    def compile_decode(self) -> bool:
        """Whether decode steps run compiled: --disable-compile, unless the environment says otherwise."""
        forced = os.environ.get(COMPILE_ENV, "").strip()
        if forced not in ("", "0", "1"):
            raise ValueError(f"{COMPILE_ENV}={forced!r}: expected 0 or 1")
        return not self.disable_compile if not forced else forced == "1"

    @property
    def compile_buckets(self) -> list[int]:
        """The compiled decode step's batch sizes: 1, 2, 4, ... and the largest it covers."""
        largest = min(self.compile_max_bs, self.max_running_requests)
        out = [1]
        while out[-1] * 2 < largest:
            out.append(out[-1] * 2)
        return out if out[-1] == largest else [*out, largest]

    @property
    def step_prefill_budget(self) -> int:
        """The most prefill tokens one step computes, across requests."""
        return self.chunked_prefill_size if self.max_prefill_tokens is None else self.max_prefill_tokens

    @property
    def heartbeat_interval(self) -> float:
        """How often a busy scheduler says it is alive, and the watchdogs look: a fifth of the watchdog's
        timeout, at most a second (a hang is noticed within the timeout plus about this)."""
        return min(1.0, self.watchdog_timeout / 5)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(ServerArgs):
            flags = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, ())]
            doc = f.metadata.get("help")
            if f.type in ("bool", bool):
                parser.add_argument(*flags, dest=f.name, action="store_true", default=f.default, help=doc)
                if "off_flag" in f.metadata:  # a feature on by default: its SGLang-style off switch
                    parser.add_argument(f.metadata["off_flag"], dest=f.name, action="store_false")
            else:
                kind: Any = {"int": int, "int | None": int, "float": float, "float | None": float}.get(str(f.type), str)
                parser.add_argument(*flags, dest=f.name, type=kind, default=f.default, help=doc)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
