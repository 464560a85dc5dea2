"""Programs shared by the in-process and the live-server tests."""

from __future__ import annotations

import frontend_lang as sgl

# Ends in "\n", a piece of its own in the built-in tokenizer: appended text never merges into it.
PREFIX = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
          "in May. How many clips did Natalia sell altogether in April and May?\n")
# On the built-in model the normalised and the summed logprob choose differently among these (checked).
CHOICES = [" yes", " she sold 72 clips", " no"]
# "is " + "no" tokenises with the prefix's trailing space merged into the choice's first token.
MERGING_PREFIX, MERGING_CHOICES = "The answer is ", ["no", "twelve clips", "she sold 72 clips"]


@sgl.function
def plain_gen(s, prompt: str, stop: list[str] | None = None):  # noqa: ANN001, ANN201
    s += prompt
    s += sgl.gen("out", max_tokens=12, stop=stop, ignore_eos=True)


@sgl.function
def pick(s, prefix: str, choices: list[str], method=sgl.token_length_normalized):  # noqa: ANN001, ANN201
    s += prefix
    s += sgl.select("pick", choices=choices, choices_method=method)


@sgl.function
def chat(s, question: str):  # noqa: ANN001, ANN201
    s += sgl.system("You answer briefly.")
    s += sgl.user_begin()
    s += question
    s += sgl.user_end()
    s += sgl.assistant(sgl.gen("answer", max_tokens=6))
    with s.user():
        s += "And why?"
    s += sgl.assistant_begin() + sgl.gen("why", max_tokens=4) + sgl.assistant_end()


@sgl.function
def branches(s, prefix: str, n: int):  # noqa: ANN001, ANN201
    s += prefix
    forks = s.fork(n)
    forks += sgl.gen("branch", max_tokens=4, ignore_eos=True)
    forks.join()


@sgl.function
def fork_and_append(s, prefix: str):  # noqa: ANN001, ANN201
    s += prefix
    forks = s.fork(3)
    forks += [sgl.gen("g", max_tokens=2, ignore_eos=True)] * 3
    metas = [f.get_meta_info("g") for f in forks]
    s.set_var("parts", [f["g"] for f in forks])
    forks.join("concate_and_append")
    return metas


@sgl.function
def numbered(s, i: int):  # noqa: ANN001, ANN201
    s += f"Question {i}: how many clips are {i} and {i + 1}?\nAnswer:"
    s += sgl.gen("answer", max_tokens=5, ignore_eos=True)


@sgl.function
def nested_roles(s):  # noqa: ANN001, ANN201
    s += sgl.user_begin()
    s += sgl.assistant_begin()


@sgl.function
def with_regex(s):  # noqa: ANN001, ANN201
    s += "The number is "
    s += sgl.gen("n", max_tokens=4, regex=r"[0-9]+")


@sgl.function
def constrained(s, regex=None, json_schema=None):  # noqa: ANN001, ANN201
    s += "Question: tell me.\nAnswer: "
    s += sgl.gen("out", max_tokens=64, regex=regex, json_schema=json_schema)
    s += "\nQuestion: and a number?\nAnswer: "
    s += sgl.gen("n", max_tokens=6, regex=r"[0-9]+")  # may not end in 6 tokens: every prefix is digits


def check_constrained(backend: sgl.Backend) -> None:
    """`constrained` for every regex and JSON schema of the structured-output tests, greedy and sampled (three
    times): each output matches its pattern / validates against its schema."""
    import json
    import re

    import jsonschema

    from tests.runtime.grammar_cases import REGEXES, SCHEMAS

    args = [{"regex": r} for r in REGEXES] + [{"json_schema": json.dumps(sc)} for sc in SCHEMAS]
    for temperature in (0.0, 1.0, 1.0, 1.0):
        states = constrained.run_batch(args, temperature=temperature, backend=backend)
        for a, st in zip(args, states, strict=True):
            if "regex" in a:
                assert re.fullmatch(a["regex"], st["out"]), (a, st["out"])
            else:
                jsonschema.validate(json.loads(st["out"]), json.loads(a["json_schema"]))
            assert re.fullmatch("[0-9]+", st["n"]), st["n"]


@sgl.function
def typed_markup(s, typed: str):  # noqa: ANN001, ANN201
    """Roles whose contents carry marker strings, then a fork whose branches append more and are joined."""
    s += sgl.system("Be brief." + typed)
    with s.user():
        s += typed
        forks = s.fork(2)
        forks += [typed, "x" + typed]
        forks.join("concate_and_append")
    s += sgl.assistant(sgl.gen("answer", max_tokens=2, return_logprob=True, logprob_start_len=0))
    s += sgl.user(typed + "?")
    s += sgl.assistant(sgl.select("pick", choices=[typed, "no"]))
