"""Structured output on a tiny random model: every output matches its schema, regex, choice or
grammar, greedy and sampled, with n > 1, batched with unconstrained requests (which give exactly
what they give alone) and across preemption; specs that do not compile are refused up front."""

from __future__ import annotations

import json
import re

import pytest

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.params import SamplingParams
from engine.structured.spec import StructuredOutput

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "colour", "tags", "admin"],
    "additionalProperties": False,
}
JSON_SPEC = StructuredOutput(json=json.dumps(PERSON))
REGEX = r"[0-9]{3}-[a-z]{2}"


def _check_person(text: str) -> None:
    value = json.loads(text)
    assert set(value) == set(PERSON["properties"]), value
    assert isinstance(value["name"], str) and len(value["name"]) <= 8
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert value["colour"] in ("red", "green", "blue")
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 2 and all(len(t) <= 4 for t in value["tags"])
    assert isinstance(value["admin"], bool)


CASES = {
    "json": (JSON_SPEC, _check_person),
    "regex": (StructuredOutput(regex=REGEX), lambda text: re.fullmatch(REGEX, text) is not None),
    "choice": (
        StructuredOutput(choice=("red", "green (dark)", "blue?")),
        lambda t: t in ("red", "green (dark)", "blue?"),
    ),
    "lark": (StructuredOutput(grammar='start: "yes" | "no" | "maybe"'), lambda text: text in ("yes", "no", "maybe")),
    "gbnf": (StructuredOutput(grammar='root ::= "on" | "off"'), lambda text: text in ("on", "off")),
}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=8, max_num_batched_tokens=64))


def _holds(check, text: str) -> bool:
    try:
        return bool(check(text)) or check(text) is None
    except (ValueError, AssertionError):
        return False


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "sampled"])
def test_every_output_matches(llm, case, seeded):
    spec, check = CASES[case]
    sampling = {"temperature": 1.0, "seed": 7, "n": 3} if seeded else {"temperature": 0.0}
    params = SamplingParams(max_tokens=200, structured=spec, **sampling)
    results = llm.generate(["Hello world", "The quick brown fox"], params)
    for samples in results:
        for sample in samples:
            assert sample.finish_reason == "stop", (case, sample.text)
            assert _holds(check, sample.text), (case, sample.text)


def test_unconstrained_neighbours_give_what_they_give_alone(llm):
    plain = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=12, ignore_eos=True),
    ]
    prompts = ["Hello world", "A paged cache"]
    alone = [llm.generate([p], [sp])[0][0].token_ids for p, sp in zip(prompts, plain, strict=True)]
    constrained = SamplingParams(temperature=0.8, seed=3, max_tokens=200, structured=JSON_SPEC)
    together = llm.generate([*prompts, "Name a person", "Another one"], [*plain, constrained, constrained])
    assert [r[0].token_ids for r in together[:2]] == alone
    for result in together[2:]:
        _check_person(result[0].text)


def test_outputs_stay_valid_across_preemption(tiny_llama_dir):
    small = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4, num_blocks=31))
    big = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4))
    prompts = [f"Person number {i} is called" for i in range(10)]
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=90, structured=JSON_SPEC)
    expected = [r[0].token_ids for r in big.generate(prompts, params)]
    got = small.generate(prompts, params)
    assert small.engine.stats().num_preemptions > 0
    assert [r[0].token_ids for r in got] == expected  # a recomputed sequence keeps its matcher's state
    for result in got:
        _check_person(result[0].text)
    assert small.engine.stats().num_used_blocks == 0


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutput(regex="(a"), "invalid regex"),
        (StructuredOutput(json=json.dumps({"type": "strin"}), param="response_format"), "invalid json"),
        (StructuredOutput(grammar="start: undefined_rule"), "invalid grammar"),
    ],
)
def test_specs_that_do_not_compile_are_refused_naming_the_field(llm, spec, words):
    with pytest.raises(InvalidRequestError, match=words) as error:
        llm.engine.add_request([1, 2, 3], SamplingParams(structured=spec))
    assert error.value.param == spec.param
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("spec", "good", "bad"),
    [
        (StructuredOutput(json_object=True), '{"a":[1,{"b":null}]}', "[1]"),
        (JSON_SPEC, '{"name":"Al","age":3,"colour":"red","tags":[],"admin":true}', '{"name":"Al","age":300'),
        (StructuredOutput(regex=REGEX), "123-ab", "12-ab"),
        (StructuredOutput(choice=("red", "a.b")), "a.b", "axb"),
        (StructuredOutput(grammar='root ::= "on" | "off"'), "off", "of f"),
    ],
    ids=["json_object", "json", "regex", "choice", "gbnf"],
)
def test_the_matcher_accepts_what_the_spec_allows_and_nothing_else(llm, spec, good, bad):
    tokenizer = llm.tokenizer
    accepted = llm.engine.grammar.matcher(spec)
    assert accepted.consume_tokens(tokenizer.encode(good, add_special_tokens=False)) and accepted.is_accepting()
    refused = llm.engine.grammar.matcher(spec)
    ids = tokenizer.encode(bad, add_special_tokens=False)
    assert not (refused.try_consume_tokens(ids) == len(ids) and refused.is_accepting())


def test_the_grammar_tokenizer_is_built_on_the_first_compile_not_at_load(llm, monkeypatch):
    """Building llguidance's tokenizer holds the GIL: a load does not pay it, the first structured request
    does, once; a tokenizer llguidance cannot read is that request's 400."""
    import llguidance.hf

    from engine.structured.grammar import GrammarCompiler

    built = []
    real = llguidance.hf.from_tokenizer
    monkeypatch.setattr(llguidance.hf, "from_tokenizer", lambda *a, **k: built.append(1) or real(*a, **k))
    compiler = GrammarCompiler(llm.tokenizer._tok, llm.engine.vocab_size, (0,))
    assert built == []
    compiler.compile(StructuredOutput(regex="[ab]{2}"))
    compiler.compile(StructuredOutput(choice=("yes", "no")))
    assert built == [1]
    unreadable = GrammarCompiler(object(), llm.engine.vocab_size, (0,))
    with pytest.raises(InvalidRequestError, match="guided_regex: structured output is not available"):
        unreadable.compile(StructuredOutput(regex="a", param="guided_regex"))


def test_a_spec_must_set_exactly_one_thing():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutput(regex="a", json="{}")
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutput()
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutput(json="{nope")


def test_logprobs_report_the_masked_distribution(llm):
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=5, structured=StructuredOutput(choice=("yes", "no")))
    sample = llm.generate(["Answer:"], params)[0][0]
    assert sample.text in ("yes", "no")
    first = sample.logprobs[0]
    allowed = {llm.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no")}
    # Only tokens the grammar allows have a finite logprob; they share all the probability.
    finite = {tid: lp for tid, lp in first.top if lp > float("-inf")}
    assert set(finite) <= allowed | {first.token_id}
    assert sum(2.718281828**lp for lp in finite.values()) == pytest.approx(1.0, abs=1e-4)


def test_the_structured_benchmark_prints_a_row_per_batch_size(tiny_llama_dir, monkeypatch, capsys):
    from engine.bench import structured

    monkeypatch.setattr(
        "sys.argv", ["structured", "--model", tiny_llama_dir, "--batches", "1", "3", "--max-tokens", "6"]
    )
    structured.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "3"]
    assert all(row.count("x |") == 1 for row in rows)
