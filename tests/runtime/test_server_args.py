from __future__ import annotations

import argparse
import dataclasses

import pytest

from runtime.server_args import ServerArgs
from runtime.worker.pool_memory import pool_memory_bytes


def test_cli_round_trip() -> None:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    args = ServerArgs.from_cli_args(p.parse_args(
        ["--page-size", "16", "--chunked-prefill-size", "256", "--disable-radix-cache", "--schedule-policy", "fcfs",
         "--mem-bytes", "1000000", "--model", "ckpt"]))
    assert (args.page_size, args.chunked_prefill_size, args.disable_radix_cache) == (16, 256, True)
    assert (args.schedule_policy, args.mem_bytes, args.model) == ("fcfs", 1_000_000, "ckpt")
    assert ServerArgs.from_cli_args(p.parse_args([])) == ServerArgs()


def test_mem_fraction_and_bad_values() -> None:
    # A fraction is resolved by the worker after its weights load (pool_memory_bytes), to a positive size; the
    # args keep it unresolved, so a copy of them (each worker's, for its device) takes no reading of its own.
    args = ServerArgs(mem_fraction=0.01)
    assert 0 < pool_memory_bytes(args, "cpu")
    copy = dataclasses.replace(args, device="cuda:1")  # as worker_main makes its rank's (no reading: no GPU here)
    assert (copy.mem_bytes, copy.mem_fraction) == (args.mem_bytes, args.mem_fraction)
    assert pool_memory_bytes(ServerArgs(mem_bytes=12345), "cpu") == 12345
    for bad in (dict(page_size=0), dict(schedule_policy="random"), dict(mem_fraction=1.5),
                dict(page_size=64, chunked_prefill_size=32), dict(max_running_requests=0)):
        with pytest.raises(ValueError):
            ServerArgs(**bad)


def test_num_scheduler_steps() -> None:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    assert ServerArgs.from_cli_args(p.parse_args(["--num-scheduler-steps", "8"])).num_scheduler_steps == 8
    for bad in (0, 65):
        with pytest.raises(ValueError, match="--num-scheduler-steps must be in"):
            ServerArgs(num_scheduler_steps=bad)
    for other, flag in ((dict(speculative_algorithm="ngram"), "--speculative-algorithm"),
                        (dict(enable_dp_attention=True, tp_size=2, dp_size=2), "--enable-dp-attention"),
                        (dict(disaggregation_mode="prefill"), "--disaggregation-mode")):
        with pytest.raises(ValueError, match=f"--num-scheduler-steps > 1 with {flag}"):
            ServerArgs(num_scheduler_steps=4, **other)


def test_speculative_flags() -> None:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    args = ServerArgs.from_cli_args(p.parse_args(
        ["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "6", "--spec-state", "snapshot"]))
    assert (args.speculative_algorithm, args.speculative_num_draft_tokens, args.spec_state) == ("ngram", 6, "snapshot")
    assert not args.overlap_schedule and ServerArgs().overlap_schedule
    for bad, says in ((dict(speculative_algorithm="eagle"), "speculative-algorithm"),
                      (dict(speculative_algorithm="draft"), "speculative-draft-model"),
                      (dict(speculative_algorithm="ngram", speculative_num_draft_tokens=0), "num-draft-tokens"),
                      (dict(spec_state="copy"), "spec-state"),
                      (dict(speculative_ngram_min=3, speculative_ngram_max=2), "ngram-min"),
                      (dict(speculative_ngram_capacity=-1), "ngram-capacity")):
        with pytest.raises(ValueError, match=says):
            ServerArgs(**bad)


def test_dp_attention_flags() -> None:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    args = ServerArgs.from_cli_args(p.parse_args(["--tp", "4", "--dp", "2", "--enable-dp-attention",
                                                  "--speculative-algorithm", "ngram"]))
    assert (args.tp_size, args.dp_size, args.enable_dp_attention) == (4, 2, True)
    with pytest.raises(ValueError, match="must divide"):
        ServerArgs(tp_size=4, dp_size=3, enable_dp_attention=True)
    for alg in ("draft", "dspark"):  # every proposer runs with DP attention
        ServerArgs(tp_size=2, dp_size=2, enable_dp_attention=True, speculative_algorithm=alg,
                   speculative_draft_model="d")


def test_http_timeouts() -> None:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    args = ServerArgs.from_cli_args(p.parse_args(["--timeout-keep-alive", "2.5", "--graceful-shutdown-timeout", "0",
                                                  "--timeout-request-head", "7"]))
    assert (args.timeout_keep_alive, args.graceful_shutdown_timeout, args.timeout_request_head) == (2.5, 0.0, 7.0)
    defaults = ServerArgs()
    assert (defaults.timeout_keep_alive, defaults.graceful_shutdown_timeout, defaults.timeout_request_head) == (
        5.0, 10.0, 60.0)
    for bad, says in ((dict(timeout_request_head=0), "timeout-request-head"),
                      (dict(timeout_request_head=float("inf")), "timeout-request-head"),
                      (dict(timeout_keep_alive=0), "timeout-keep-alive"),
                      (dict(timeout_keep_alive=-1), "timeout-keep-alive"),
                      (dict(timeout_keep_alive=float("nan")), "timeout-keep-alive"),
                      (dict(timeout_keep_alive=float("inf")), "timeout-keep-alive"),
                      (dict(graceful_shutdown_timeout=-1), "graceful-shutdown-timeout"),
                      (dict(graceful_shutdown_timeout=float("nan")), "graceful-shutdown-timeout")):
        with pytest.raises(ValueError, match=says):
            ServerArgs(**bad)


def test_prefill_flags() -> None:
    """Mixed chunk is on by default: SGLang's --enable-mixed-chunk still parses, --disable-mixed-chunk turns it
    off; --max-prefill-tokens defaults to the chunk size."""
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    assert ServerArgs().enable_mixed_chunk and ServerArgs().step_prefill_budget == ServerArgs().chunked_prefill_size
    assert ServerArgs.from_cli_args(p.parse_args(["--enable-mixed-chunk"])).enable_mixed_chunk
    args = ServerArgs.from_cli_args(p.parse_args(["--disable-mixed-chunk", "--max-prefill-tokens", "2048"]))
    assert not args.enable_mixed_chunk and args.max_prefill_tokens == args.step_prefill_budget == 2048
    with pytest.raises(ValueError, match="max-prefill-tokens"):
        ServerArgs(page_size=16, max_prefill_tokens=8)


def test_disaggregation_flags() -> None:
    """SGLang's spellings parse; what P/D does not serve yet is refused by name."""
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    args = ServerArgs.from_cli_args(p.parse_args(
        ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "fake",
         "--disaggregation-bootstrap-port", "9001"]))
    assert (args.disaggregation_mode, args.disaggregation_transfer_backend) == ("prefill", "fake")
    assert args.disaggregation_bootstrap_port == 9001
    for bad, says in [(dict(disaggregation_mode="both"), "--disaggregation-mode"),
                      (dict(disaggregation_transfer_backend="mooncake"), "--disaggregation-transfer-backend"),
                      (dict(disaggregation_mode="prefill", dp_size=2), "--dp > 1"),
                      (dict(disaggregation_timeout=0.0), "--disaggregation-timeout")]:
        with pytest.raises(ValueError, match=says):
            ServerArgs(**bad)
    for mode in ("prefill", "decode"):  # decode speculates; prefill runs the proposer over the prompt only
        for alg in ("ngram", "mtp"):
            assert ServerArgs(disaggregation_mode=mode, speculative_algorithm=alg).speculative_algorithm == alg
