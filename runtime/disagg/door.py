"""What a request must be to enter a prefill or a decode server (checked at the door: the tokenizer manager and
LocalEngine), so that what P/D disaggregation does not serve yet is refused by name, never served wrongly."""

from __future__ import annotations

from runtime.errors import InvalidRequest
from runtime.messages import Bootstrap
from runtime.sampling_params import SamplingParams


def check_disaggregated(mode: str, bootstrap: Bootstrap | None, params: SamplingParams, return_logprob: bool,
                        logprob_start_len: int, prompt_len: int, top_logprobs_num: int = 0) -> None:
    """Raises InvalidRequest for a request this server (in --disaggregation-mode `mode`) cannot serve."""
    if mode == "null":
        if bootstrap is not None:
            raise InvalidRequest("bootstrap_host, bootstrap_port, bootstrap_room: this server is not a prefill or "
                                 "decode server (--disaggregation-mode null)", param="bootstrap_room")
        return
    if bootstrap is None:
        raise InvalidRequest(f"this is a {mode} server (--disaggregation-mode {mode}): a request needs "
                             "bootstrap_host, bootstrap_port and bootstrap_room (send it through sglang-router "
                             "--pd-disaggregation)", param="bootstrap_room")
    if params.grammar is not None:
        raise InvalidRequest("structured output with P/D disaggregation is not supported yet", param=params.grammar[0])
    if return_logprob and 0 <= logprob_start_len < prompt_len:
        raise InvalidRequest("input logprobs with P/D disaggregation are not supported yet", param="logprob_start_len")
    if return_logprob and top_logprobs_num > 0:  # only the first token and its logprob move from prefill
        raise InvalidRequest("top logprobs with P/D disaggregation are not supported yet (the first token's stay on "
                             "the prefill server)", param="top_logprobs_num")
    if params.max_new_tokens < 1:
        raise InvalidRequest("P/D disaggregation needs max_new_tokens >= 1", param="max_new_tokens")
