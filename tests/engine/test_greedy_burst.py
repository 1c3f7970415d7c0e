"""Greedy bursts (engine/models/greedy_burst.py): several greedy decode steps in one native call emit the tokens
the step by step path emits, stop where it stops, give every KV block back, and run only where nothing needs
Python between tokens; the scheduler makes room for them only while no request waits."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from engine.models import greedy_burst, registry
from engine.outputs import FINISH_LENGTH, FINISH_STOP, EmittedTokens
from engine.params import SamplingParams
from tests.support.llama_gguf import write_qwen3_gguf
from tests.support.native_kernels import needs_kernels
from tests.support.scheduling import make_scheduler, make_seq, put_running
from tests.support.tiny_models import make_tiny_model

FUSED_ARCHS = [entry.model_type for entry in registry.entries() if entry.fused_decode]
# Prompt lengths around the 4-token blocks; outputs of lengths that bursts of 5 do not divide.
PROMPTS = [[5, 7], [9, 11, 13], [15, 17, 19, 21, 23], [25] * 9]
MAX_TOKENS = [13, 7, 21, 2]


def _engine(model: str, burst: int, **overrides) -> LLM:
    settings = {"block_size": 4, "quantization": "int8", "kv_cache_dtype": "float32", **overrides}
    return LLM.from_config(EngineConfig(model=model, greedy_burst=burst, greedy_burst_ms=0, **settings))


def _count_bursts(monkeypatch) -> list[int]:
    """Each burst call's number of steps run, as it returns."""
    calls: list[int] = []
    original = greedy_burst.GreedyBurst.__call__

    def counted(self, *args, **kwargs):
        tokens = original(self, *args, **kwargs)
        calls.append(tokens.shape[0])
        return tokens

    monkeypatch.setattr(greedy_burst.GreedyBurst, "__call__", counted)
    return calls


def _greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


def _tokens(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [out[0].token_ids for out in llm.generate(PROMPTS, params)]


@needs_kernels
@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_bursts_emit_the_tokens_of_steps_one_at_a_time(tiny_model_dirs, arch, monkeypatch):
    """Every architecture on the fused path whose step past the layers the kernel computes: bursts of up to 5
    steps over 4-token blocks (a sliding window, several attention groups where the model has them) give the
    same greedy tokens as steps one at a time, and every block goes back. The others never burst."""
    params = [_greedy(n) for n in MAX_TOKENS]
    reference = _tokens(_engine(tiny_model_dirs[arch], 1), params)
    bursting = _engine(tiny_model_dirs[arch], 5)
    calls = _count_bursts(monkeypatch)
    got = _tokens(bursting, params)
    runner = bursting.engine.runner
    if runner.greedy_burst is None:  # a model with a logit softcap (the tiny Gemmas)
        assert greedy_burst.unsupported_reason(runner.fused_decode.recipe.tail) is not None
        assert not calls
    else:
        assert calls and max(calls) == 5
    assert got == reference
    pool = bursting.engine.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


@needs_kernels
def test_a_gemma3_without_a_logit_cap_bursts_over_both_window_kinds(tmp_path, monkeypatch):
    """Gemma 3's scaled embedding, 1 + w final norm, sliding and full layers with their own RoPE, in bursts."""
    model = str(make_tiny_model(tmp_path, "gemma3_text", final_logit_softcapping=None))
    params = [_greedy(n) for n in MAX_TOKENS]
    reference = _tokens(_engine(model, 1), params)
    calls = _count_bursts(monkeypatch)
    assert _tokens(_engine(model, 4), params) == reference
    assert calls and max(calls) == 4


@needs_kernels
@pytest.mark.parametrize("matrix_type", ["Q8_0", "Q4_0"])
def test_bursts_over_gguf_blocks_emit_the_same_tokens(tiny_model_dirs, tmp_path, matrix_type, monkeypatch):
    """A GGUF file: the embedding rows dequantized from its blocks, its head in blocks."""
    folder = tiny_model_dirs["qwen3"]
    gguf = str(write_qwen3_gguf(folder, tmp_path / f"tiny-{matrix_type}.gguf", matrix_type))
    params = [_greedy(n) for n in MAX_TOKENS]
    # The file carries no tokenizer: the folder's serves it.
    reference = _tokens(_engine(gguf, 1, quantization="gguf", tokenizer=folder), params)
    calls = _count_bursts(monkeypatch)
    assert _tokens(_engine(gguf, 6, quantization="gguf", tokenizer=folder), params) == reference
    assert calls


@needs_kernels
def test_a_stop_token_inside_a_burst_ends_it_there(tiny_llama_dir, monkeypatch):
    reference = _engine(tiny_llama_dir, 1).generate([PROMPTS[0]], [_greedy(20)])[0][0].token_ids
    stop = reference[6]
    first = reference.index(stop)
    bursting = _engine(tiny_llama_dir, 8)
    calls = _count_bursts(monkeypatch)
    out = bursting.generate([PROMPTS[0]], [_greedy(20, stop_token_ids=(stop,))])[0][0]
    assert out.token_ids == reference[: first + 1]
    assert out.finish_reason == FINISH_STOP
    assert sum(calls) <= first  # the burst that chose it ran no further (the first token is the prefill's)
    pool = bursting.engine.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


@needs_kernels
def test_requests_that_need_python_between_tokens_do_not_burst(tiny_llama_dir, monkeypatch):
    """Sampling, logprobs, penalties, logit bias, a min_tokens ban: the batch decodes a step at a time, with the
    same tokens as an engine without bursts; a greedy request beside them does not burst either."""
    others = [
        SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True),
        _greedy(9, logprobs=1),
        _greedy(9, repetition_penalty=1.3),
        _greedy(9, logit_bias={7: 2.0}),
        SamplingParams(temperature=0, max_tokens=9, min_tokens=9),  # banned to the end
    ]
    for params in others:
        both = [_greedy(9), params]
        reference = [out[0].token_ids for out in _engine(tiny_llama_dir, 1).generate(PROMPTS[:2], both)]
        calls = _count_bursts(monkeypatch)
        got = [out[0].token_ids for out in _engine(tiny_llama_dir, 8).generate(PROMPTS[:2], both)]
        assert got == reference, params
        assert not calls, params
        monkeypatch.undo()


@needs_kernels
def test_an_interrupted_burst_runs_one_step(tiny_llama_dir, monkeypatch):
    """The flag a server sets when it must act between steps ends every burst after its first step."""
    params = [_greedy(n) for n in MAX_TOKENS]
    reference = _tokens(_engine(tiny_llama_dir, 1), params)
    bursting = _engine(tiny_llama_dir, 8)
    bursting.engine.end_bursts_early(True)
    calls = _count_bursts(monkeypatch)
    assert _tokens(bursting, params) == reference
    assert calls and set(calls) == {1}


@needs_kernels
def test_bursts_last_as_many_steps_as_the_pace_of_the_batch_size_fits(tiny_llama_dir):
    llm = LLM.from_config(EngineConfig(model=tiny_llama_dir, quantization="int8", greedy_burst=16, greedy_burst_ms=100))
    runner = llm.engine.runner
    seqs = [make_seq(3, params=_greedy(50))]
    assert runner.plan_burst(seqs) == 1  # no step timed yet: a plain step first
    runner.decode_step_seconds[1] = 0.030
    assert runner.plan_burst(seqs) == 3
    runner.decode_step_seconds[1] = 0.004
    assert runner.plan_burst(seqs) == 16
    runner.decode_step_seconds[1] = 0.2
    assert runner.plan_burst(seqs) == 1
    # A pace is a batch size's own: two sequences, never timed together, take a plain step first.
    runner.decode_step_seconds[1] = 0.004
    assert runner.plan_burst([*seqs, make_seq(4, params=_greedy(50))]) == 1


def test_the_scheduler_makes_room_for_a_burst_only_while_no_request_waits():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=1, plan_burst=lambda seqs: 4)
    seq = put_running(scheduler, make_seq(3, generated=[7]), 3)
    batch = scheduler.schedule()
    assert batch.burst == 4 and batch.num_draft_slots == [3]
    assert len(seq.block_tables[0]) == 4  # 2-token blocks for positions 0..6
    # Four tokens emitted: the sequence advances past all of them, the last one uncomputed.
    scheduler.update(batch, [EmittedTokens([8, 9, 10, 11], [None] * 4)])
    assert seq.token_ids[-5:] == [7, 8, 9, 10, 11] and seq.num_computed_tokens == len(seq.token_ids) - 1

    waiting = make_seq(2)
    scheduler.add(waiting)  # max_num_seqs=1: it waits, so the running sequence takes one step at a time
    batch = scheduler.schedule()
    assert batch.burst == 1 and batch.num_draft_slots == [0]


def test_a_burst_is_as_long_as_the_shortest_tokens_left_and_never_takes_blocks_it_cannot_get():
    scheduler = make_scheduler(num_blocks=64, plan_burst=lambda seqs: 8)
    short = put_running(scheduler, make_seq(3, generated=[7], params=SamplingParams(max_tokens=3)), 3)
    put_running(scheduler, make_seq(5, generated=[7]), 5)
    batch = scheduler.schedule()
    assert batch.burst == 2  # `short` may append 2 more tokens
    scheduler.update(batch, _emitted(2, 2))
    assert short.finish_reason == FINISH_LENGTH

    tight = make_scheduler(num_blocks=6, plan_burst=lambda seqs: 8)  # 5 usable blocks of 2 tokens
    seq = put_running(tight, make_seq(5, generated=[7]), 5)
    held = len(seq.block_tables[0])
    batch = tight.schedule()
    assert batch.burst == 1 and len(seq.block_tables[0]) == held  # 8 more positions do not fit: none taken


def _emitted(count: int, num_seqs: int) -> list[EmittedTokens]:
    return [EmittedTokens([20 + i for i in range(count)], [None] * count) for _ in range(num_seqs)]
