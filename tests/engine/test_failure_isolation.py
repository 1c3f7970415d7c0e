"""One request never fails the others: a step failure pinned to a request fails that request only.

The failure is injected in the sampler after the real sampling ran (so every seeded
generator of the batch has drawn, as in a real failure mid-sampling): a row of the
poisoned request raises once it has generated a few tokens. The other requests must go
on with exactly the tokens they give alone, and the culprit must end with an error.
"""

from __future__ import annotations

import asyncio

import pytest

import engine.runner.model_runner as model_runner
from engine.config import EngineConfig
from engine.errors import EngineDeadError, EngineStepError
from engine.llm import LLM
from engine.outputs import FINISH_ERROR
from engine.params import SamplingParams
from engine.serving.async_engine import AsyncEngine
from tests.support.workloads import mixed_params, random_prompts

POISON_SEED = 4242
POISON_AFTER = 3  # the poisoned request's rows raise once it has generated this many tokens


def _poison_params() -> SamplingParams:
    return SamplingParams(temperature=0.9, seed=POISON_SEED, n=2, max_tokens=16, ignore_eos=True)


def _poison_the_sampler(monkeypatch) -> None:
    real_sample = model_runner.sample

    def sample(logits, rows):
        output = real_sample(logits, rows)  # every generator in the batch has drawn by now
        poisoned = [r for r in rows if r.params.seed == POISON_SEED]
        if any(len(r.token_ids) - r.num_prompt_tokens >= POISON_AFTER for r in poisoned):
            raise RuntimeError("poisoned row")
        return output

    monkeypatch.setattr(model_runner, "sample", sample)


def _llm(model_dir: str) -> LLM:
    return LLM.from_config(EngineConfig(model=model_dir, block_size=8, max_num_batched_tokens=64))


@pytest.mark.parametrize("culprits", [[3], [0, 5]], ids=["one-culprit", "two-culprits"])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_failing_requests_fail_alone_and_the_others_match_their_runs_alone(
    tiny_llama_dir, monkeypatch, seeded, culprits
):
    llm = _llm(tiny_llama_dir)
    prompts = random_prompts(llm, 8)
    params = [_poison_params() if i in culprits else mixed_params(i, seeded) for i in range(8)]
    alone = {i: llm.generate([prompts[i]], params[i])[0][0].token_ids for i in range(8) if i not in culprits}
    _poison_the_sampler(monkeypatch)

    together = llm.generate(prompts, params)

    for i, samples in enumerate(together):
        if i in culprits:
            assert [s.finish_reason for s in samples] == [FINISH_ERROR, FINISH_ERROR]
            assert len(samples[0].token_ids) == POISON_AFTER
        else:
            assert samples[0].token_ids == alone[i], i
            assert samples[0].finish_reason == "length"
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().num_used_blocks == 0
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks - 1


def test_the_failed_request_output_carries_the_error(tiny_llama_dir, monkeypatch):
    llm = _llm(tiny_llama_dir)
    prompts = random_prompts(llm, 2)
    llm.engine.add_request(prompts[0], mixed_params(0, seeded=False))
    bad = llm.engine.add_request(prompts[1], _poison_params())
    _poison_the_sampler(monkeypatch)
    failed = []
    while llm.engine.has_unfinished_requests():
        failed += [o for o in llm.engine.step() if o.error is not None]
    assert [o.request_id for o in failed] == [bad]
    assert failed[0].finished and "poisoned row" in failed[0].error
    assert {c.finish_reason for c in failed[0].outputs} == {FINISH_ERROR}
    assert llm.engine.stats().num_used_blocks == 0


def test_a_failure_no_request_explains_is_raised_and_nothing_advances(tiny_llama_dir, monkeypatch):
    llm = _llm(tiny_llama_dir)
    prompts = [llm.tokenizer.encode(text) for text in ("Hello world", "The quick brown fox", "paged cache")]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [llm.generate([p], params)[0][0].token_ids for p in prompts[:2]]
    first = llm.engine.add_request(prompts[0], params)
    second = llm.engine.add_request(prompts[1], params)
    aborted = llm.engine.add_request(prompts[2], params)
    outputs = llm.engine.step()  # every prompt fits one step: the next one decodes `first` and `second`
    llm.engine.abort(aborted)  # its notice is due with the next step

    calls = []

    def broken(batch):
        calls.append(len(batch.seqs))
        raise RuntimeError("the model is broken")

    seqs = [s for rid in (first, second) for s in llm.engine._requests[rid].seqs]
    before = [(s.num_computed_tokens, list(s.token_ids)) for s in seqs]
    monkeypatch.setattr(llm.engine.runner, "run_model", broken)
    with pytest.raises(RuntimeError, match="broken"):
        llm.engine.step()
    assert calls == [2, 1, 1]  # the batch, then each request alone: none explains it
    assert [(s.num_computed_tokens, list(s.token_ids)) for s in seqs] == before
    monkeypatch.undo()

    while llm.engine.has_unfinished_requests():
        outputs += llm.engine.step()
    assert any(o.request_id == aborted and o.outputs[0].finish_reason == "abort" for o in outputs)
    got = {
        rid: [t for o in outputs if o.request_id == rid for c in o.outputs for t in c.token_ids]
        for rid in (first, second)
    }
    assert [got[first], got[second]] == expected
    assert llm.engine.stats().num_used_blocks == 0


# ---- through the AsyncEngine ----


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _tokens(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens = []
    async for output in engine.generate(prompt, params):
        tokens.extend(output.outputs[0].token_ids)
    return tokens


def test_only_the_culprits_stream_raises(tiny_llama_dir, monkeypatch):
    llm = _llm(tiny_llama_dir)
    prompts = random_prompts(llm, 6)
    params = [mixed_params(i, seeded=True) for i in range(6)]
    params[2] = _poison_params()
    expected = [llm.generate([p], sp)[0][0].token_ids for p, sp in zip(prompts, params)]
    _poison_the_sampler(monkeypatch)

    async def main():
        engine = AsyncEngine(llm.engine, llm.tokenizer)
        await engine.start()
        results = await asyncio.gather(
            *(_tokens(engine, p, sp) for p, sp in zip(prompts, params)), return_exceptions=True
        )
        healthy = engine.is_healthy
        stats = engine.stats()
        await engine.stop()
        return results, healthy, stats

    results, healthy, stats = run(main())
    assert isinstance(results[2], EngineStepError) and "poisoned row" in str(results[2])
    assert [r for i, r in enumerate(results) if i != 2] == [e for i, e in enumerate(expected) if i != 2]
    assert healthy and stats.num_used_blocks == 0


def _break_the_model(monkeypatch, llm: LLM) -> None:
    def broken(batch):
        raise RuntimeError("the model is broken")

    monkeypatch.setattr(llm.engine.runner, "run_model", broken)


def test_a_broken_model_trips_the_dead_engine_switch(tiny_llama_dir, monkeypatch):
    """Each failure fails its request and leaves only abort notices; the next request's failure still adds up."""
    llm = _llm(tiny_llama_dir)
    params = SamplingParams(temperature=0, max_tokens=4)
    _break_the_model(monkeypatch, llm)

    async def main():
        engine = AsyncEngine(llm.engine, llm.tokenizer, max_consecutive_step_failures=3)
        await engine.start()
        errors = []
        for _ in range(3):
            with pytest.raises((EngineStepError, EngineDeadError)) as error:
                await _tokens(engine, [5, 6, 7], params)
            errors.append(type(error.value))
            await asyncio.sleep(0.02)  # the gap until the next request is not idleness that forgives
        healthy = engine.is_healthy
        with pytest.raises(EngineDeadError):
            await engine.submit([5, 6, 7], params)
        await engine.stop()
        return errors, healthy

    errors, healthy = run(main())
    assert errors == [EngineStepError, EngineStepError, EngineDeadError]
    assert not healthy


def test_rare_failures_far_apart_do_not_kill_the_engine(tiny_llama_dir, monkeypatch):
    llm = _llm(tiny_llama_dir)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([[5, 6, 7]], params)[0][0].token_ids

    async def main():
        engine = AsyncEngine(llm.engine, llm.tokenizer, max_consecutive_step_failures=2, failure_reset_idle_s=0.05)
        await engine.start()
        for _ in range(3):
            _break_the_model(monkeypatch, llm)
            with pytest.raises(EngineStepError):
                await _tokens(engine, [5, 6, 7], params)
            monkeypatch.undo()
            await asyncio.sleep(0.1)  # idle for longer than failure_reset_idle_s
        healthy = engine.is_healthy
        tokens = await _tokens(engine, [5, 6, 7], params)
        await engine.stop()
        return healthy, tokens

    healthy, tokens = run(main())
    assert healthy and tokens == expected


def test_the_probe_computes_alone_and_leaves_no_trace(tiny_llama_dir, monkeypatch):
    llm = _llm(tiny_llama_dir)
    core = llm.engine
    core.add_request([5, 6, 7], SamplingParams(max_tokens=2), "gone")
    core.abort("gone")  # its abort notice waits for the next step
    before = core.stats()
    core.probe()
    assert core.stats() == before and before.num_used_blocks == 0
    notices = core.step()
    assert [o.request_id for o in notices] == ["gone"]
    _break_the_model(monkeypatch, llm)
    with pytest.raises(RuntimeError, match="the model is broken"):
        core.probe()
    assert core.stats().num_used_blocks == 0 and not core.has_unfinished_requests()


def test_requests_that_fail_alone_one_after_another_never_kill_the_engine(tiny_llama_dir, monkeypatch):
    """Each poisoned request runs alone, so its step cannot blame it; the probe can. Before, the
    third such request in a row marked the engine dead for everyone."""
    llm = _llm(tiny_llama_dir)
    _poison_the_sampler(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([[5, 6, 7]], params)[0][0].token_ids

    async def main():
        engine = AsyncEngine(llm.engine, llm.tokenizer, max_consecutive_step_failures=2)
        await engine.start()
        for _ in range(4):
            with pytest.raises(EngineStepError):
                await _tokens(engine, [5, 6, 7], _poison_params())
        healthy = engine.is_healthy
        tokens = await _tokens(engine, [5, 6, 7], params)
        await engine.stop()
        return healthy, tokens

    healthy, tokens = run(main())
    assert healthy and tokens == expected
