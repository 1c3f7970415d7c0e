"""Prompt logprobs against transformers: every prompt token after the first, scored during prefill.

Chunked prefill, the prefix cache, n > 1 samples, batching with requests that do not ask, and a
preemption in the middle of the prompt must all give the same numbers as one plain forward.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.params import SamplingParams
from engine.runner import prompt_logprobs as prompt_logprobs_module
from tests.conftest import ARCHS
from tests.support.tiny_models import load_reference

PROMPT = "The quick brown fox jumps over the lazy dog. Hello world! A paged KV cache stores keys and values."
OTHER = "Attention sinks keep the first tokens while the window slides over the rest of a long text."


def _engine(model_dir: str, **overrides) -> LLM:
    return LLM.from_config(EngineConfig(model=model_dir, **overrides))


def _reference_logprobs(model_dir: str, prompt_ids: list[int]) -> torch.Tensor:
    """[P - 1, vocab]: row j is the distribution that scores prompt token j + 1."""
    reference = load_reference(model_dir)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt_ids])).logits[0].float()
    return logits[:-1].log_softmax(dim=-1)


def _as_tuples(scored) -> list:
    return [None if s is None else (s.token_id, round(s.logprob, 4), s.rank, [t for t, _ in s.top]) for s in scored]


def _assert_same_scores(scored, expected) -> None:
    """The same tokens, ranks and top tokens, and logprobs within float32 rounding: a prompt scored in other
    chunks, or beside other sequences, attends in other shapes (last bits of its sums)."""
    assert [None if s is None else (s.token_id, s.rank, [t for t, _ in s.top]) for s in scored] == [
        None if s is None else (s.token_id, s.rank, [t for t, _ in s.top]) for s in expected
    ]
    for got, want in zip(scored, expected, strict=True):
        if want is not None:
            assert got.logprob == pytest.approx(want.logprob, abs=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_match_transformers_through_chunked_prefill(tiny_model_dirs, arch):
    model_dir = tiny_model_dirs[arch]
    # A 7-token budget splits the prompt over several steps; block size 4 crosses blocks within a chunk.
    engine = _engine(model_dir, max_num_batched_tokens=7, block_size=4)
    prompt_ids = engine.tokenizer.encode(PROMPT)
    result = engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0][0]
    scored = result.prompt_logprobs
    assert scored is not None and len(scored) == len(prompt_ids) and scored[0] is None
    expected = _reference_logprobs(model_dir, prompt_ids)
    for j, item in enumerate(scored[1:]):
        row = expected[j]
        assert item.token_id == prompt_ids[j + 1]
        assert item.logprob == pytest.approx(float(row[prompt_ids[j + 1]]), abs=1e-4)
        assert item.rank == int((row > row[prompt_ids[j + 1]]).sum()) + 1
        top_values, top_ids = row.topk(3)
        assert [t for t, _ in item.top] == top_ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in item.top]), top_values, atol=1e-4, rtol=0)
    assert engine.engine.stats().num_used_blocks == 0


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, block_size=4)
    prompt_ids = engine.tokenizer.encode(PROMPT)
    alone = engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0][0]
    # The same prompt again: its blocks are cached now, but the request that asks must not use them...
    hits_before = engine.engine.stats().prefix_cache_hits
    again = engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0][0]
    assert engine.engine.stats().prefix_cache_hits == hits_before
    assert _as_tuples(again.prompt_logprobs) == _as_tuples(alone.prompt_logprobs)
    # ...while one that does not ask still does.
    engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=2))
    assert engine.engine.stats().prefix_cache_hits > hits_before


def test_prompt_logprobs_in_a_batch_with_n_samples_and_requests_that_do_not_ask(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, block_size=4, max_num_batched_tokens=16)
    prompt_ids = engine.tokenizer.encode(PROMPT)
    other_ids = engine.tokenizer.encode(OTHER)
    alone = engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1))[0][0]
    params = [
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=3, prompt_logprobs=1),
        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0),
    ]
    plain, samples, short_top = engine.generate([other_ids, prompt_ids, prompt_ids[:9]], params)
    assert plain[0].prompt_logprobs is None
    assert len(samples) == 3
    for sample in samples:  # one scoring of the prompt, shared by the n samples
        assert _as_tuples(sample.prompt_logprobs) == _as_tuples(samples[0].prompt_logprobs)
        _assert_same_scores(sample.prompt_logprobs, alone.prompt_logprobs)
    assert [(s.token_id, s.top) for s in short_top[0].prompt_logprobs[1:]] == [
        (s.token_id, []) for s in alone.prompt_logprobs[1:9]
    ]
    assert engine.engine.stats().num_used_blocks == 0


def test_a_preemption_in_the_middle_of_the_prompt_scores_each_token_once(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, block_size=4, max_num_batched_tokens=7)
    prompt_ids = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    alone = engine.generate([prompt_ids], params)[0][0]

    request_id = engine.engine.add_request(prompt_ids, params)
    seq = engine.engine._requests[request_id].seqs[0]
    engine.engine.step()
    engine.engine.step()
    assert 0 < len(seq.prompt_logprobs) < len(prompt_ids) - 1
    engine.engine.scheduler._preempt(seq)  # its KV is gone: the prompt is computed again from the start
    outputs = []
    while engine.engine.has_unfinished_requests():
        outputs.extend(engine.engine.step())
    sent = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert len(sent) == 1
    assert _as_tuples(sent[0]) == _as_tuples(alone.prompt_logprobs)


def test_logits_are_made_a_slice_of_rows_at_a_time(tiny_llama_dir, monkeypatch):
    """Memory stays bounded for a long prompt: never more than ROWS_PER_SLICE rows of logits at once."""
    engine = _engine(tiny_llama_dir)
    prompt_ids = engine.tokenizer.encode(PROMPT + " " + OTHER)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    whole = engine.generate([prompt_ids], params)[0][0]
    monkeypatch.setattr(prompt_logprobs_module, "ROWS_PER_SLICE", 5)
    rows_seen = []
    model = engine.engine.runner.model
    compute = model.compute_logits

    def counting(hidden):
        rows_seen.append(hidden.shape[0])
        return compute(hidden)

    monkeypatch.setattr(model, "compute_logits", counting)
    sliced = engine.generate([prompt_ids], params)[0][0]
    assert max(rows_seen) == 5 and sum(rows_seen) == len(prompt_ids) - 1 + 1  # + the sampling row
    assert _as_tuples(sliced.prompt_logprobs) == _as_tuples(whole.prompt_logprobs)


def test_a_one_token_prompt_has_only_the_null_entry(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    result = engine.generate([[5]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0][0]
    assert result.prompt_logprobs == [None]


def test_the_prompt_logprobs_benchmark_prints_a_ratio_per_case(tiny_llama_dir, capsys):
    from engine.bench import prompt_logprobs

    prompt_logprobs.main(["--model", tiny_llama_dir, "--num-tokens", "40", "--repeats", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "x |" in line]
    assert len(rows) == 3 and rows[0].endswith("| 1.00x |")


def test_the_prompt_beside_streams_benchmark_caps_the_long_prompts_chunks(tiny_llama_dir, capsys):
    from engine.bench import prompt_beside_streams

    argv = ["--model", tiny_llama_dir, "--prompt-tokens", "40", "--streams", "2", "--rounds", "1", "--threshold", "16"]
    prompt_beside_streams.main(argv)
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 40 |")]
    assert [row[2] for row in rows] == ["3", "1"]  # steps: 16 + 16 + 8 tokens capped, 40 at once without
    assert rows[1][4] == "1.00x"
