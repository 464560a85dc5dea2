"""Byte layout of the unified pool: how big a KDA state block and an MLA KV page are, and where each
layer's tensor sits inside them.

A state block holds, for every KDA layer of this rank, the recurrent state [H/tp, K, V] (state dtype,
fp32 by default) and the conv state [3*H*D/tp, conv_kernel-1] (model dtype), each region starting on an
ALIGN boundary. A KV token row holds, for every MLA layer, kv_dim = kv_lora_rank + qk_rope_head_dim
values (model dtype), layer after layer, so that one MLA layer's latent KV is a strided
[num_token_slots, kv_dim] view and physical token slot p*page_size + o is page p, offset o.

A speculative draft model keeps its own KDA states and MLA latents in the same pool: a nested `draft` layout
whose state block is appended to the target's in every state block, and whose token row is appended to the
target's in every KV token row. The allocator, the radix cache's copies and retraction then move both at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from radixk3.config import ModelConfig
    from runtime.server_args import ServerArgs

# Every typed region of a state block, and the state block itself, start on this many bytes: enough for
# 16-byte vector loads and 128-byte cache lines on every accelerator we target.
ALIGN = 256


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# The pool's dtypes by name (torch's), with their bytes: the scheduler and the tokenizer side size the pool without
# importing torch (hundreds of MiB resident in each process); the worker makes the tensors.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES[dtype]


class CopyCommand(NamedTuple):
    """Copy `nbytes` bytes of the pool buffer from byte `src` to byte `dst` (ranges never overlap)."""

    src: int
    dst: int
    nbytes: int


class PoolGeometry(NamedTuple):
    """Where the two ends of one pool of `total_bytes` lie.

    KV page p spans [p*page_bytes, (p+1)*page_bytes); physical state slot s spans
    [state_base + s*state_block_bytes, ...): slot num_state_slots-1 ends exactly at the top of the buffer,
    so states grow downwards by taking lower slot numbers.
    """

    total_bytes: int
    state_block_bytes: int
    page_bytes: int
    num_state_slots: int
    state_base: int
    num_pages: int
    page_size: int

    @property
    def num_token_slots(self) -> int:
        return self.num_pages * self.page_size

    def state_offset(self, slot: int) -> int:
        return self.state_base + slot * self.state_block_bytes

    def page_offset(self, page: int) -> int:
        return page * self.page_bytes


@dataclass(frozen=True)
class PoolLayout:
    """Per-rank sizes of one KDA state block and one MLA KV page (plain numbers; see `from_config`)."""

    num_kda_layers: int
    kda_heads: int  # KDA heads on this rank (H / tp)
    head_dim: int  # K = V = head_dim
    conv_kernel: int
    num_mla_layers: int
    kv_dim: int  # kv_lora_rank + qk_rope_head_dim
    state_dtype: str = "float32"  # recurrent state (a DTYPE_BYTES name)
    kv_dtype: str = "bfloat16"  # the model dtype: latent KV and the conv state
    page_size: int = 1
    draft: PoolLayout | None = None  # the draft model's part of every state block and token row

    def __post_init__(self) -> None:
        for name in ("state_dtype", "kv_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"PoolLayout.{name} must be one of {list(DTYPE_BYTES)}, got {getattr(self, name)!r}")
        for name in ("num_kda_layers", "kda_heads", "head_dim", "num_mla_layers", "kv_dim", "page_size"):
            # A nested draft part may be MLA-only (the MTP layers' latents): no KDA layers there.
            least = 0 if name == "num_kda_layers" and self.draft is None else 1
            if getattr(self, name) < least:
                raise ValueError(f"PoolLayout.{name} must be >= {least}, got {getattr(self, name)}")
        if self.conv_kernel < 2:
            raise ValueError(f"PoolLayout.conv_kernel must be >= 2 (it keeps kernel-1 inputs), got {self.conv_kernel}")
        if self.draft is not None and (self.draft.kv_dtype != self.kv_dtype or self.draft.draft is not None):
            raise ValueError("a draft layout must share the model dtype and have no draft of its own")

    @classmethod
    def from_config(
        cls,
        cfg: ModelConfig,
        tp: int = 1,
        page_size: int = 1,
        state_dtype: str = "float32",
    ) -> PoolLayout:
        if cfg.kda_num_heads % tp:
            raise ValueError(f"kda_num_heads={cfg.kda_num_heads} does not split over tp={tp}")
        return cls(
            num_kda_layers=cfg.num_kda_layers,
            kda_heads=cfg.kda_num_heads // tp,
            head_dim=cfg.kda_head_dim,
            conv_kernel=cfg.conv_kernel_size,
            num_mla_layers=cfg.num_mla_layers,
            # The latent KV is one 576-wide "head" shared by all query heads: every rank keeps all of it.
            kv_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim,
            state_dtype=state_dtype,
            kv_dtype=cfg.dtype,
            page_size=page_size,
        )

    # --- KDA state block -------------------------------------------------------------------------------
    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.kda_heads, self.head_dim, self.head_dim)

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (3 * self.kda_heads * self.head_dim, self.conv_kernel - 1)

    @property
    def recurrent_bytes(self) -> int:
        h, k, v = self.recurrent_shape
        return h * k * v * dtype_bytes(self.state_dtype)

    @property
    def conv_bytes(self) -> int:
        c, w = self.conv_shape
        return c * w * dtype_bytes(self.kv_dtype)

    @property
    def _layer_stride(self) -> int:
        return round_up(self.recurrent_bytes, ALIGN) + round_up(self.conv_bytes, ALIGN)

    def recurrent_offset(self, layer: int) -> int:
        """Byte offset of KDA layer `layer`'s recurrent state inside a state block."""
        self._check_layer(layer, self.num_kda_layers)
        return layer * self._layer_stride

    def conv_offset(self, layer: int) -> int:
        self._check_layer(layer, self.num_kda_layers)
        return layer * self._layer_stride + round_up(self.recurrent_bytes, ALIGN)

    @property
    def draft_state_offset(self) -> int:
        """Byte offset of the draft's state block inside a state block (after the target's layers)."""
        return self.num_kda_layers * self._layer_stride

    @property
    def state_block_bytes(self) -> int:
        return self.draft_state_offset + (self.draft.state_block_bytes if self.draft is not None else 0)

    @property
    def state_payload_bytes(self) -> int:
        """Bytes of one state without alignment padding."""
        own = self.num_kda_layers * (self.recurrent_bytes + self.conv_bytes)
        return own + (self.draft.state_payload_bytes if self.draft is not None else 0)

    # --- MLA KV page -----------------------------------------------------------------------------------
    @property
    def draft_kv_offset(self) -> int:
        """Byte offset of the draft's latents inside one token row (after the target's MLA layers)."""
        return self.num_mla_layers * self.kv_dim * dtype_bytes(self.kv_dtype)

    @property
    def kv_token_bytes(self) -> int:
        """Latent KV bytes of one token over all MLA layers (the draft's included)."""
        return self.draft_kv_offset + (self.draft.kv_token_bytes if self.draft is not None else 0)

    def kv_offset(self, layer: int) -> int:
        """Byte offset of MLA layer `layer`'s values inside one token row."""
        self._check_layer(layer, self.num_mla_layers)
        return layer * self.kv_dim * dtype_bytes(self.kv_dtype)

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.kv_token_bytes

    # --- whole pool ------------------------------------------------------------------------------------
    def geometry(self, total_bytes: int) -> PoolGeometry:
        total = total_bytes - total_bytes % ALIGN  # keeps state_base, hence every state view, aligned
        sb = self.state_block_bytes
        if total < max(sb, self.page_bytes):
            raise ValueError(f"a pool of {total_bytes} bytes is smaller than one state block ({sb} B) "
                             f"or one KV page ({self.page_bytes} B)")
        slots = total // sb
        return PoolGeometry(
            total_bytes=total,
            state_block_bytes=sb,
            page_bytes=self.page_bytes,
            num_state_slots=slots,
            state_base=total - slots * sb,
            num_pages=total // self.page_bytes,
            page_size=self.page_size,
        )

    # --- speculative decoding's draft window (radixk3/spec_window.py) ------------------------------------
    def spec_window_token_bytes(self, mode: str) -> int:
        """Scratch bytes of one window position of one row, over all KDA layers of this rank. ReplaySSM keeps
        the token's inputs (k, v in the model dtype, the fp32 decay and beta, the conv input); the snapshot
        baseline a whole recurrent + conv state."""
        h, d, e = self.kda_heads, self.head_dim, dtype_bytes(self.kv_dtype)
        conv_channels = self.conv_shape[0]
        if mode == "replay":
            per_layer = 2 * h * d * e + h * d * 4 + h * 4 + conv_channels * e
        elif mode == "snapshot":
            per_layer = self.recurrent_bytes + self.conv_bytes
        else:
            raise ValueError(f"spec state mode must be 'replay' or 'snapshot', got {mode!r}")
        # The draft model's own window (its KDA states are rewound by the same commit as the target's).
        return self.num_kda_layers * per_layer + (self.draft.spec_window_token_bytes(mode) if self.draft else 0)

    def spec_window_bytes(self, mode: str, rows: int, width: int) -> int:
        return rows * width * self.spec_window_token_bytes(mode)

    def state_equivalent_tokens(self) -> int:
        """Tokens whose KV weighs as much as one state, per layer: one KDA layer's state over one MLA layer's
        per-token KV. This is the block size vLLM's hybrid manager must use so that a KDA layer's state
        fits in one page of the shared page size (about 1,900 tokens for Kimi-Linear-48B)."""
        per_layer_state = self.recurrent_bytes + self.conv_bytes
        per_layer_token = self.kv_dim * dtype_bytes(self.kv_dtype)
        return -(-per_layer_state // per_layer_token)

    @staticmethod
    def _check_layer(layer: int, n: int) -> None:
        if not 0 <= layer < n:
            raise IndexError(f"layer {layer} out of range [0, {n})")


def serving_dtype(cfg: ModelConfig, args: ServerArgs) -> str:
    """The dtype the engine serves in (torch's name): `args.dtype`, or the checkpoint's for "auto"."""
    return cfg.dtype if args.dtype == "auto" else args.dtype


def pool_budget(layout: PoolLayout, args: ServerArgs, mem_bytes: int | None = None) -> int:
    """Bytes of the unified pool: `mem_bytes` (the worker's resolved memory, `runtime.worker.pool_memory`;
    default `--mem-bytes`) less the speculative draft window's scratch, allocated once for every page-table row
    (`max_running_requests`) when speculation is on. A `--mem-fraction` is resolved by the worker alone, after
    its weights load: anyone else takes the pool's size from the ranks' readiness (`WorkerReady.pool_bytes`)."""
    if mem_bytes is None:
        if args.mem_fraction is not None:
            raise ValueError("--mem-fraction is resolved by the workers after their weights load: take the pool's "
                             "size from their readiness (WorkerReady.pool_bytes)")
        mem_bytes = args.mem_bytes
    total = mem_bytes
    if args.speculative_algorithm is not None:
        total -= layout.spec_window_bytes(args.spec_state, args.max_running_requests,
                                          args.speculative_num_draft_tokens + 1)
    if args.speculative_algorithm == "draft" and layout.draft is not None:
        total -= args.max_running_requests * layout.draft.state_payload_bytes  # its running state in drafting
    if total <= 0:
        raise ValueError(f"--mem-bytes / --mem-fraction: {mem_bytes} bytes do not even hold the speculative draft "
                         "window")
    return total


def pool_layout(cfg: ModelConfig, args: ServerArgs) -> PoolLayout:
    """The pool layout; the scheduler (metadata) and the worker (bytes) must both derive it from here. With a
    draft model (`--speculative-algorithm draft`) its config is read from its checkpoint and nested. Under
    `--tp` every part is this rank's: KDA heads / tp (the draft model is sharded as the target is); the MLA
    latents are whole on every rank. With DP attention the KDA heads split over the attention group only
    (tp / dp ranks)."""
    dtype = serving_dtype(cfg, args)
    tp = args.tp_size // args.dp_size if args.enable_dp_attention else args.tp_size
    layout = dataclasses.replace(PoolLayout.from_config(cfg, tp, page_size=args.page_size), kv_dtype=dtype)
    if args.speculative_algorithm == "draft":
        from radixk3.config_formats import load_model_config

        assert args.speculative_draft_model is not None
        dcfg = load_model_config(args.speculative_draft_model)
        check_draft_config(cfg, dcfg)
        draft = dataclasses.replace(PoolLayout.from_config(dcfg, tp, page_size=args.page_size), kv_dtype=dtype)
        layout = dataclasses.replace(layout, draft=draft)
    if args.speculative_algorithm == "mtp":
        if cfg.num_nextn_predict_layers < 1:
            raise ValueError("--speculative-algorithm mtp: the checkpoint has no MTP layers "
                             "(num_nextn_predict_layers=0)")
        # The MTP layers' latents ride in every token row, after the target's (no KDA state: MLA only).
        mtp = dataclasses.replace(PoolLayout.from_config(cfg, tp, page_size=args.page_size), kv_dtype=dtype,
                                  num_kda_layers=0, num_mla_layers=cfg.num_nextn_predict_layers)
        layout = dataclasses.replace(layout, draft=mtp)
    if args.speculative_algorithm == "dspark":
        from radixk3.dspark_config import DSparkConfig

        assert args.speculative_draft_model is not None
        dcfg = DSparkConfig.from_file(args.speculative_draft_model)
        dcfg.check_target(cfg)
        # The drafter's context latents: one MLA-only latent per draft layer in every token row (no KDA state).
        ds = dataclasses.replace(PoolLayout.from_config(cfg, page_size=args.page_size), kv_dtype=dtype,
                                 num_kda_layers=0, num_mla_layers=dcfg.num_hidden_layers, kv_dim=dcfg.kv_dim)
        layout = dataclasses.replace(layout, draft=ds)
    return layout


def check_draft_config(target: ModelConfig, draft: ModelConfig) -> None:
    """A draft model proposes target token ids: its vocabulary must be the target's."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.vocab_size}) differs from the target's "
                         f"({target.vocab_size}): speculative decoding needs the same token ids")
