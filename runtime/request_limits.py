"""The limits a request is held to at the door (the tokenizer process), checked before anything is allocated or
encoded for it: samples per prompt (`--max-n`), top logprobs per token (`--max-logprobs`), requests the engine
queues (`--max-queued-requests`, which also bounds a batch: prompts x samples), and tokens per request (the pool's
per-request capacity, prompt + max_new_tokens; a text is bounded by its length before it is encoded).

A request that can never fit is an `InvalidRequest` (HTTP 400) that names the limit and the flag that sets it; one
that does not fit now, beside the requests pending, is `EngineOverloaded` (HTTP 503 with Retry-After), raised by
the tokenizer manager. This module imports no torch: the limits are plain numbers from the server's arguments.
"""

from __future__ import annotations

from runtime.errors import InvalidRequest
from runtime.server_args import ServerArgs


class RequestLimits:
    """The door's limits; read from `args` at each check (the arguments are the server's, one object)."""

    def __init__(self, args: ServerArgs, context_length: int, max_token_bytes: int) -> None:
        self.args = args
        self.context_length = context_length  # tokens (prompt + new) one request may hold: the pool's bound
        self.max_token_bytes = max(1, max_token_bytes)  # the most UTF-8 bytes one token of the tokenizer stands for

    def check_n(self, n: int, param: str = "n") -> None:
        if n > self.args.max_n:
            raise InvalidRequest(f"{param} is {n}: at most {self.args.max_n} samples per prompt (--max-n)",
                                 param=param)

    def check_top_logprobs(self, k: int, param: str = "top_logprobs_num") -> None:
        if k > self.args.max_logprobs:
            raise InvalidRequest(f"{param} is {k}: at most {self.args.max_logprobs} top logprobs per token "
                                 f"(--max-logprobs)", param=param)

    def check_samples(self, samples: int, prompts: int, param: str) -> None:
        """A request (or batch) of `samples` sequences in all, over `prompts` prompts: more than the engine ever
        queues can never be admitted, whatever else is pending."""
        limit = self.args.max_queued_requests
        if samples > limit:
            what = f"{samples} samples" if prompts == 1 else f"{prompts} prompts with {samples} samples in all"
            raise InvalidRequest(f"the request asks for {what}, more than the {limit} requests the engine queues "
                                 f"(--max-queued-requests); split it", param=param)

    def check_text(self, chars: int, max_new_tokens: int, param: str) -> None:
        """Before encoding: a text of `chars` characters is at least chars / max_token_bytes tokens (encoding
        round-trips exactly, and a character is at least one byte), plus the BOS; `param` names the text's field,
        blamed when the text alone is too long (else max_new_tokens is)."""
        at_least = -(-chars // self.max_token_bytes) + 1
        if at_least + max_new_tokens > self.context_length:
            param = param if at_least > self.context_length else "max_new_tokens"  # which one alone is too much
            raise InvalidRequest(
                f"the prompt ({chars} characters, at least {at_least} tokens) + max_new_tokens ({max_new_tokens}) "
                f"exceed the pool's capacity of {self.context_length} tokens per request (--mem-bytes / "
                f"--mem-fraction size the pool)", param=param)

    def check_tokens(self, prompt_tokens: int, max_new_tokens: int, param: str) -> None:
        """After encoding: prompt + max_new_tokens against the pool; `param` names the prompt's field, blamed when
        the prompt alone is too long (else max_new_tokens is)."""
        need = prompt_tokens + max_new_tokens
        if need > self.context_length:
            param = param if prompt_tokens > self.context_length else "max_new_tokens"
            raise InvalidRequest(
                f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = {need} tokens exceed the "
                f"pool's capacity of {self.context_length} tokens per request (--mem-bytes / --mem-fraction size "
                f"the pool)", param=param)
