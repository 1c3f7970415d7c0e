"""Speculative decoding changes speed, never output: greedy tokens identical to plain decoding (alone,
batched with requests that do not speculate, through preemption, under a sliding window with sinks,
with an n-gram or a draft-model proposer), sampled tokens with the target's distribution, logprobs the
target's, and every KV block back in the pool afterwards."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.sequence import Sequence
from engine.errors import ModelLoadError
from engine.llm import LLM
from engine.params import SamplingParams
from engine.spec.speculator import FIRST_PAUSE_TOKENS, NgramProposer, Speculator
from tests.support.tiny_models import make_tiny_model
from tests.support.workloads import random_prompts

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3)


def untimed(llm: LLM) -> LLM:
    """`llm` with every sequence given its full k drafts: the draft budget learns from measured step times,
    and on a loaded machine those can make drafts look unprofitable and turn them off, so a test counting
    accepted drafts would depend on the machine's load (the budget itself: tests/unit/test_draft_budget.py)."""
    llm.engine.speculative.speculator.cost_model.fit = lambda: None
    return llm


def chi_square_999(degrees: int) -> float:
    """The upper 0.1% point of chi-square (Wilson-Hilferty; within 1% from 3 degrees of freedom up)."""
    z, a = 3.0902, 2.0 / (9.0 * degrees)
    return degrees * (1.0 - a + z * a**0.5) ** 3


def _tokens(results) -> list[list[int]]:
    return [r[0].token_ids for r in results]


def _assert_nothing_held(llm: LLM) -> None:
    engine = llm.engine
    assert engine.stats().num_used_blocks == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
    proposer = engine.speculative.speculator.proposer if engine.speculative is not None else None
    if proposer is not None and hasattr(proposer, "pool"):
        assert proposer.pool.num_used_blocks == 0 and proposer.num_mirrors == 0


@pytest.fixture(scope="module")
def plain(tiny_llama_dir) -> LLM:
    return LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4))


def _greedy(i: int, speculative: bool = True) -> SamplingParams:
    # Every third request stops at EOS or a stop token when it meets one, inside accepted drafts too.
    stops = {"stop_token_ids": (7, 11)} if i % 3 == 0 else {"ignore_eos": True}
    return SamplingParams(temperature=0, max_tokens=40 + i % 7, logprobs=2, speculative=speculative, **stops)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_ngram_greedy_equals_plain_batched_with_requests_that_do_not_speculate(tiny_llama_dir, plain, quantization):
    """float32 verifies through the torch layers; int8 through the fused native kernel, one row per token."""
    if quantization != "none":
        plain = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4, quantization=quantization))
    prompts = random_prompts(plain, 12, seed=5)
    expected = plain.generate(prompts, [_greedy(i) for i in range(12)])
    spec = untimed(
        LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4, quantization=quantization, speculative=NGRAM))
    )
    # Odd requests opt out: they share every step with the speculating ones.
    got = spec.generate(prompts, [_greedy(i, speculative=i % 2 == 0) for i in range(12)])
    assert _tokens(got) == _tokens(expected)
    for g, e in zip(got, expected):
        assert [lp.token_id for lp in g[0].logprobs] == [lp.token_id for lp in e[0].logprobs]
        assert [lp.logprob for lp in g[0].logprobs] == pytest.approx([lp.logprob for lp in e[0].logprobs], abs=1e-4)
        assert [lp.top for lp in g[0].logprobs][-1][0][0] == [lp.top for lp in e[0].logprobs][-1][0][0]
    stats = spec.engine.stats()
    assert stats.num_spec_accepted_tokens > 0, "nothing was accepted: the test would not see a wrong acceptance"
    assert stats.num_spec_draft_tokens >= stats.num_spec_accepted_tokens
    assert sum(stats.spec_accepted_per_position) == stats.num_spec_accepted_tokens
    assert stats.num_generation_tokens == sum(len(t) for t in _tokens(got))
    # Rejected drafts are not prompt tokens: without preemption each prompt token is computed once or cached.
    assert stats.num_preemptions == 0
    assert stats.num_computed_prompt_tokens == stats.num_prompt_tokens - stats.num_cached_prompt_tokens
    _assert_nothing_held(spec)


def test_ngram_greedy_through_preemption(tiny_llama_dir, plain):
    prompts = random_prompts(plain, 12, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True) for _ in range(12)]
    expected = plain.generate(prompts, params)
    # 40 usable blocks of 4 tokens cannot hold 12 sequences of up to ~120 tokens at once.
    small = untimed(LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4, num_blocks=41, speculative=NGRAM)))
    got = small.generate(prompts, params)
    assert _tokens(got) == _tokens(expected)
    stats = small.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_spec_accepted_tokens > 0
    _assert_nothing_held(small)
    assert small.engine.pool.num_free_blocks == 40


def test_ngram_greedy_under_a_sliding_window_with_sinks(tiny_model_dirs):
    model_dir = tiny_model_dirs["mistral"]
    config = EngineConfig(model=model_dir, block_size=4, sliding_window=8, num_sink_tokens=2)
    windowed = LLM.from_config(config)
    prompts = random_prompts(windowed, 6, seed=2)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    expected = windowed.generate(prompts, params)
    spec = untimed(LLM.from_config(EngineConfig(**{**config.__dict__, "speculative": NGRAM})))
    got = spec.generate(prompts, params)
    assert _tokens(got) == _tokens(expected)
    assert spec.engine.stats().num_spec_accepted_tokens > 0
    _assert_nothing_held(spec)


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(tiny_llama_dir, plain):
    """A seeded request's tokens do not depend on speculation, nor on how many drafts a step verified."""
    prompts = random_prompts(plain, 6, seed=3)
    params = [SamplingParams(temperature=0.8, top_k=5, seed=100 + i, max_tokens=30, ignore_eos=True) for i in range(6)]
    expected = _tokens(plain.generate(prompts, params))
    spec_config = SpeculativeConfig(method="draft", draft_model=tiny_llama_dir, num_speculative_tokens=3)
    spec = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4, speculative=spec_config))
    assert _tokens(spec.generate(prompts, params)) == expected
    assert [_tokens(spec.generate([p], [sp]))[0] for p, sp in zip(prompts, params)] == expected
    stats = spec.engine.stats()
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens  # drafts kept and rejected
    _assert_nothing_held(spec)


def test_sampled_tokens_keep_the_target_distribution(tiny_llama_dir, plain):
    """On a tiny model: the second and third tokens, which come out of verified drafts, are distributed
    the same with and without speculation (two-sample chi-square over the top-k tokens). The draft is
    the target itself proposing greedily, so drafts are sometimes accepted and sometimes resampled."""
    prompt = plain.tokenizer.encode("fox jumps over the lazy dog")
    count = 800
    spec_config = SpeculativeConfig(method="draft", draft_model=tiny_llama_dir, num_speculative_tokens=2)
    spec = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4, max_num_seqs=256, speculative=spec_config))

    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, top_k=4, seed=seed, max_tokens=3, ignore_eos=True)

    with_spec = _tokens(spec.generate([prompt] * count, [params(i) for i in range(count)]))
    without = _tokens(plain.generate([prompt] * count, [params(count + i) for i in range(count)]))
    stats = spec.engine.stats()
    assert stats.num_spec_drafts >= count
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens  # both branches taken
    for position in (1, 2):  # position 0 comes from the prefill, before any draft
        values = sorted({t[position] for t in with_spec + without})
        table = torch.tensor(
            [[float(sum(t[position] == v for t in run)) for v in values] for run in (with_spec, without)]
        )
        expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
        statistic = float(((table - expected) ** 2 / expected).sum())
        degrees = table.shape[1] - 1
        assert statistic < chi_square_999(degrees), (position, statistic, degrees)
    _assert_nothing_held(spec)


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory) -> str:
    """A different tiny model (another architecture, other weights) with the same tokenizer."""
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-draft"), "gpt2", seed=11))


@pytest.mark.parametrize("draft", ["itself", "other"])
def test_draft_model_greedy_equals_plain(tiny_llama_dir, other_draft_dir, plain, draft):
    draft_dir = tiny_llama_dir if draft == "itself" else other_draft_dir
    spec_config = SpeculativeConfig(method="draft", draft_model=draft_dir, num_speculative_tokens=3)
    spec = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4, speculative=spec_config))
    prompts = random_prompts(plain, 8, seed=4)
    params = [_greedy(i, speculative=i != 5) for i in range(8)]
    assert _tokens(spec.generate(prompts, params)) == _tokens(plain.generate(prompts, params))
    stats = spec.engine.stats()
    if draft == "itself":
        # The draft is the target: every proposal is what the target picks.
        assert stats.num_spec_draft_tokens > 0 and stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens
    else:
        # Random drafts are rejected, and rejected sequences pause: far fewer drafts than decode steps.
        assert stats.num_spec_drafts < stats.num_generation_tokens // 3
    _assert_nothing_held(spec)


def test_draft_model_aborted_and_preempted_requests_leave_nothing(tiny_llama_dir):
    spec_config = SpeculativeConfig(method="draft", draft_model=tiny_llama_dir, num_speculative_tokens=4)
    spec = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4, num_blocks=41, speculative=spec_config))
    prompts = random_prompts(spec, 10, seed=6)
    ids = [spec.engine.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for p in prompts]
    for _ in range(12):
        spec.engine.step()
    for request_id in ids[::2]:
        spec.engine.abort(request_id)
    while spec.engine.has_unfinished_requests():
        spec.engine.step()
    assert spec.engine.stats().num_preemptions > 0
    _assert_nothing_held(spec)


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_llama_dir, tmp_path):
    other = shutil.copytree(tiny_llama_dir, tmp_path / "other-tokenizer")
    tokenizer_file = other / "tokenizer.json"
    data = json.loads(tokenizer_file.read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # the same tokens, two ids swapped
    tokenizer_file.write_text(json.dumps(data))
    spec_config = SpeculativeConfig(method="draft", draft_model=str(other))
    with pytest.raises(ModelLoadError, match="different tokenizer"):
        LLM.from_config(EngineConfig(model=tiny_llama_dir, speculative=spec_config))


def _decoding_seq(params: SamplingParams, generated: int = 0) -> Sequence:
    seq = Sequence(0, "r", 0, [1, 2, 3], params, 0.0)
    seq.token_ids += [4] * generated
    seq.num_computed_tokens = len(seq.token_ids) - 1
    return seq


def _verify(speculator: Speculator, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
    """One verification recorded, then its tokens appended (the accepted drafts and the one after them)."""
    speculator.record(seq, num_proposed, num_accepted)
    seq.token_ids += [4] * (num_accepted + 1)


def test_a_sequence_whose_drafts_are_rejected_pauses_and_the_pause_doubles():
    speculator = Speculator(NGRAM, NgramProposer(1, 3), max_model_len=1000, vocab_size=100)
    seq = _decoding_seq(SamplingParams(temperature=0, max_tokens=500))
    assert speculator.draft_slots(seq) == 4
    _verify(speculator, seq, 4, 0)
    _verify(speculator, seq, 4, 0)
    _verify(speculator, seq, 4, 0)  # the moving average falls under the threshold
    assert speculator.draft_slots(seq) == 0
    seq.token_ids += [4] * (FIRST_PAUSE_TOKENS - 1)
    assert speculator.draft_slots(seq) == 0  # the pause counts from the verification's own token on
    seq.token_ids += [4]
    assert speculator.draft_slots(seq) == 4  # the pause is over
    _verify(speculator, seq, 4, 0)  # failing again pauses twice as long
    seq.token_ids += [4] * FIRST_PAUSE_TOKENS
    assert speculator.draft_slots(seq) == 0
    seq.token_ids += [4] * FIRST_PAUSE_TOKENS
    assert speculator.draft_slots(seq) == 4
    for _ in range(5):
        _verify(speculator, seq, 4, 4)  # accepted drafts keep it going
    assert speculator.draft_slots(seq) == 4
    assert speculator.stats.num_drafts == 9 and speculator.stats.accepted_per_position == [5, 5, 5, 5]


def test_draft_slots_respect_limits_and_opt_outs():
    speculator = Speculator(NGRAM, NgramProposer(1, 3), max_model_len=20, vocab_size=100)
    assert speculator.draft_slots(_decoding_seq(SamplingParams(max_tokens=3), generated=0)) == 2
    assert speculator.draft_slots(_decoding_seq(SamplingParams(max_tokens=3), generated=2)) == 0
    assert speculator.draft_slots(_decoding_seq(SamplingParams(max_tokens=None), generated=14)) == 2  # context 20
    assert speculator.draft_slots(_decoding_seq(SamplingParams(speculative=False))) == 0
    assert speculator.propose([_decoding_seq(SamplingParams())], [0]) == [[]]


class _FixedProposer:
    def propose(self, seqs, num_tokens):
        return [[5, 200, 6, 7] for _ in seqs]

    def forget(self, seq_ids):
        return None


def test_drafts_outside_the_target_vocabulary_are_cut_off():
    """A draft model's table may be larger than the target's: its drafts end before the first such id."""
    speculator = Speculator(NGRAM, _FixedProposer(), max_model_len=1000, vocab_size=100)
    seqs = [_decoding_seq(SamplingParams()), _decoding_seq(SamplingParams())]
    assert speculator.propose(seqs, [4, 0]) == [[5], []]


def test_a_failing_draft_model_costs_drafts_not_requests(tiny_llama_dir, plain, monkeypatch, caplog):
    """The draft model raising mid-proposal: those steps decode without drafts, output unchanged, nothing held."""
    spec_config = SpeculativeConfig(method="draft", draft_model=tiny_llama_dir, num_speculative_tokens=3)
    spec = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4, speculative=spec_config))
    proposer = spec.engine.speculative.speculator.proposer
    calls = {"n": 0}
    original = proposer.runner.compute_logits

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("draft model out of memory")
        return original(batch)

    monkeypatch.setattr(proposer.runner, "compute_logits", flaky)
    prompts = random_prompts(plain, 4, seed=8)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with caplog.at_level("ERROR"):
        assert _tokens(spec.generate(prompts, params)) == _tokens(plain.generate(prompts, params))
    assert "proposer failed" in caplog.text
    assert spec.engine.stats().num_spec_accepted_tokens > 0  # the other steps still speculated
    _assert_nothing_held(spec)
