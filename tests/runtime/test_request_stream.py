"""The tokenizer side of a sample's output (`runtime/tokenizer/request_stream.py`): stop strings and regexes are
cut where the scheduler's last TokenOut says its match begins, not where a stop first occurs in the text."""

from __future__ import annotations

import pytest

from radixk3.tokenizer import load_tokenizer
from runtime.messages import TokenOut
from runtime.sampling_params import SamplingParams
from runtime.tokenizer.request_stream import SampleStream

TOK = load_tokenizer()


def _text(parts: list[str], outs: list[tuple[int, str | None, int | None]], **sampling: object) -> list[str]:
    """Each chunk's text: `parts` encoded, then sent as `outs` say (parts taken, finished, stop_from_end)."""
    params = SamplingParams.from_dict({"max_new_tokens": 64, **sampling}, TOK.vocab_size)
    stream, at, texts = SampleStream("r", 0, TOK, params), 0, []
    for n, finished, from_end in outs:
        ids = [t for p in parts[at : at + n] for t in TOK.encode_ordinary(p)]
        at += n
        out = TokenOut("r", ids, finished=finished, matched_stop="ab" if from_end is not None else None,
                       stop_from_end=from_end)
        texts.append(stream.chunk(out).text)
    return texts


@pytest.mark.parametrize("sampling", [{"stop": ["ab"]}, {"stop_regex": "a[b]"}])
def test_the_cut_is_where_the_scheduler_matched_not_the_first_occurrence(sampling: dict) -> None:
    # Read whole: the one chunk holds an occurrence below min_new_tokens before the matched one.
    assert _text(["xx ab yy ", "ab"], [(2, "stop", 2)], **sampling) == ["xx ab yy "]
    # Streamed: "a" is held back (it may begin the stop), and the cut reaches into it.
    assert _text(["xx ab yy a", "b"], [(1, None, None), (1, "stop", 2)], **sampling) == ["xx ab yy ", ""]
    # The stop's own text ends inside the last token: what follows it goes too.
    assert "".join(_text(["ab xx ", "abz"], [(1, None, None), (1, "stop", 3)], **sampling)) == "ab xx "


def test_no_stop_trim_and_other_finishes_keep_the_text() -> None:
    assert _text(["xx ab"], [(1, "stop", 2)], stop=["ab"], no_stop_trim=True) == ["xx ab"]
    assert _text(["xx ab"], [(1, "length", None)], stop=["ab"]) == ["xx ab"]


def test_a_complete_regex_match_at_the_end_is_held_back() -> None:
    """"ab" completes "ab+" below min_new_tokens (no stop), but more text can extend it into the match the scheduler
    stops on ("abb", from the same start): a stream holds it back, so it ends where the result read whole ends."""
    streamed = _text(["xx", "a", "b", "b"], [(1, None, None), (1, None, None), (1, None, None), (1, "stop", 3)],
                     stop_regex="ab+")
    assert "".join(streamed) == "".join(_text(["xx", "a", "b", "b"], [(4, "stop", 3)], stop_regex="ab+")) == "xx"
