"""A model that mixes full and sliding-window layers, end to end: each layer's own mask, one block table per
attention group, exact against transformers under chunking, batching, the prefix cache, preemption and
speculative decoding.

The model is a tiny Qwen2 with use_sliding_window: layers below max_window_layers attend to every key,
the others to a window of 8 (shorter than the prompts), as transformers computes it.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.block_pool import NULL_BLOCK
from engine.llm import LLM
from engine.model_info import read_model_info
from engine.params import SamplingParams
from tests.support.tiny_models import load_reference, make_tiny_model

WINDOW = 8
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Hello world!",
    "A paged KV cache stores keys and values in blocks.",
    "def main():\n    return 42\n",
    "Continuous batching lets requests join and leave every step. 0123456789",
]


@pytest.fixture(scope="module")
def qwen2_mixed_dir(tmp_path_factory) -> str:
    # 4 layers: 0 full, 1-3 sliding (three sliding layers to one full, so three groups of one layer each).
    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("tiny-mixed"),
            "qwen2",
            num_hidden_layers=4,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        )
    )


@pytest.fixture(scope="module", params=["qwen2-mixed", "gemma2", "gemma3_text"])
def mixed_dir(request, qwen2_mixed_dir, tiny_model_dirs) -> str:
    """Each mixed-window model: the Qwen2 above, Gemma 2 (alternating, softcaps) and Gemma 3 (five to one)."""
    if request.param == "qwen2-mixed":
        return qwen2_mixed_dir
    return tiny_model_dirs[request.param]


@pytest.fixture(scope="module")
def reference(mixed_dir):
    return load_reference(mixed_dir)


def _engine(model_dir: str, **overrides) -> LLM:
    return LLM.from_config(EngineConfig(model=model_dir, block_size=4, **overrides))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n)


def _expected(reference, prompt_ids: list[int], n: int) -> list[int]:
    out = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def test_the_layers_attend_in_groups_by_kind(mixed_dir, reference):
    engine = _engine(mixed_dir)
    windows = tuple(WINDOW if kind == "sliding_attention" else None for kind in reference.config.layer_types)
    assert None in windows and WINDOW in windows
    assert engine.engine.model_config.windows() == windows
    layout = engine.engine.layout
    for layer, window in enumerate(windows):
        assert layout.window_of_layer(layer) == window
    assert len({len(g.layers) for g in layout.groups}) == 1  # equal groups
    kinds = read_model_info(engine.engine).attention_kinds
    assert kinds == tuple("full" if w is None else "sliding" for w in windows)


def test_prompt_logits_and_greedy_tokens_match_transformers(mixed_dir, reference):
    # A 5-token budget chunks every prompt across steps past the window.
    engine = _engine(mixed_dir, max_num_batched_tokens=5)
    prompt_ids = engine.tokenizer.encode(PROMPTS[0])
    assert len(prompt_ids) > 2 * WINDOW
    engine.engine.add_request(prompt_ids, SamplingParams(max_tokens=1))
    batch = engine.engine.scheduler.schedule()
    ours = engine.engine.runner.compute_logits(batch, all_positions=True)
    engine.engine.abort(batch.seqs[0].request_id)
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt_ids[: batch.num_tokens]])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)

    result = engine.generate([prompt_ids], _greedy(24))[0][0]
    assert result.token_ids == _expected(reference, prompt_ids, 24)


def test_sliding_groups_release_blocks_and_the_full_group_keeps_them(mixed_dir):
    engine = _engine(mixed_dir, max_num_batched_tokens=4)  # one block of new tokens a step
    prompt_ids = engine.tokenizer.encode(PROMPTS[0])
    engine.engine.add_request(prompt_ids, _greedy(20))
    groups = engine.engine.layout.groups
    held = []
    snapshots = []
    while engine.engine.has_unfinished_requests():
        engine.engine.step()
        snapshots.append(engine.engine.kv_snapshot())
        for seq in engine.engine.scheduler.running:
            held.append([sum(b != NULL_BLOCK for b in table) for table in seq.block_tables])
            assert len({len(table) for table in seq.block_tables}) == 1  # every table covers every position
    for g, group in enumerate(groups):
        most = max(h[g] for h in held)
        if group.is_sliding:
            assert most <= WINDOW // 4 + 1  # the window and one block
        else:
            assert most == -(-(len(prompt_ids) + 19) // 4)  # the whole context
    assert engine.engine.stats().num_used_blocks == 0
    # The snapshot (/kv_cache) shows every group's table; late in the run the sliding ones hold released entries.
    late = next(snap for snap in reversed(snapshots) if snap.sequences)
    assert late.attention_groups == engine.engine.layout.groups
    (seq,) = late.sequences
    for group, blocks in zip(late.attention_groups, seq.groups, strict=True):
        assert (NULL_BLOCK in blocks.block_table) == group.is_sliding


def test_batched_equals_one_at_a_time_and_prefix_cache_on_equals_off(mixed_dir):
    cached = _engine(mixed_dir, max_num_batched_tokens=16)
    prompts = [cached.tokenizer.encode(p) for p in PROMPTS]
    shared = prompts[0][:14]
    prompts += [shared + prompts[1][:6], shared + prompts[2][:5]]  # a prefix hit past the window
    params = [_greedy(12 + i) for i in range(len(prompts))]
    alone = [cached.generate([p], [q])[0][0].token_ids for p, q in zip(prompts, params)]
    assert cached.engine.stats().prefix_cache_hits > 0
    batched = [out[0].token_ids for out in cached.generate(prompts, params)]
    uncached = _engine(mixed_dir, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert batched == alone
    assert [out[0].token_ids for out in uncached.generate(prompts, params)] == alone


def test_a_prefix_hit_needs_only_the_window_of_each_sliding_group(mixed_dir, reference):
    """While a 40-token prompt decodes, its sliding groups have released what left their window, and every
    released block is handed out again; the same prompt still hits all 40 tokens (the full group holds
    them all, each sliding group the blocks its window sees from position 40), and decodes as transformers."""
    engine = _engine(mixed_dir)
    core = engine.engine
    prompt = [(7 * i) % 300 + 10 for i in range(40)]
    first = core.add_request(prompt, _greedy(20))
    core.step()  # the whole prompt
    core.step()  # one token; the sliding groups gave back the blocks before the window
    pool = core.pool
    for block in [*iter(pool.allocate, None)]:
        pool.release(block)  # handed out once: no released block is findable any more
    hits = core.stats().prefix_cache_hits
    again = prompt + [prompt[3]]
    second = core.add_request(again, _greedy(6))
    tokens: dict[str, list[int]] = {first: [], second: []}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id].extend(token for sample in out.outputs for token in sample.token_ids)
    assert core.stats().prefix_cache_hits - hits == 40
    assert tokens[second] == _expected(reference, again, 6)
    assert tokens[first] == _expected(reference, prompt, 20)[2:]  # its first two tokens came before the loop


def test_preemption_in_the_middle_changes_no_token(mixed_dir):
    roomy = _engine(mixed_dir)
    prompts = [roomy.tokenizer.encode(p) for p in PROMPTS]
    params = [_greedy(60) for _ in prompts]
    expected = [out[0].token_ids for out in roomy.generate(prompts, params)]
    # 71 blocks: a sequence needs at most 40 (22 full, 6 in each sliding group), the four together ~120.
    tight = _engine(mixed_dir, num_blocks=72, max_num_batched_tokens=8)
    got = [out[0].token_ids for out in tight.generate(prompts, params)]
    assert tight.engine.stats().num_preemptions > 0
    assert got == expected
    assert tight.engine.stats().num_used_blocks == 0


def test_speculative_decoding_equals_plain_decoding(mixed_dir):
    """n-gram drafts (mostly rejected) and the model as its own draft (always accepted): the tables of every
    group are trimmed and grown alike, and the tokens are plain decoding's."""
    plain = _engine(mixed_dir)
    text = "one two three one two three one two three one two"
    prompts = [plain.tokenizer.encode(text), plain.tokenizer.encode(PROMPTS[1])]
    params = [_greedy(24) for _ in prompts]
    expected = [out[0].token_ids for out in plain.generate(prompts, params)]
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=2)
    itself = SpeculativeConfig(method="draft", draft_model=mixed_dir, num_speculative_tokens=3)
    for method in (ngram, itself):
        spec = _engine(mixed_dir, speculative=method)
        assert [out[0].token_ids for out in spec.generate(prompts, params)] == expected
        assert spec.engine.stats().num_spec_draft_tokens > 0
        assert spec.engine.stats().num_used_blocks == 0
    assert spec.engine.stats().num_spec_accepted_tokens == spec.engine.stats().num_spec_draft_tokens


def test_seeded_sampling_is_the_same_in_any_batch(mixed_dir):
    engine = _engine(mixed_dir)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=16, ignore_eos=True) for i in range(len(prompts))]
    alone = [engine.generate([p], [q])[0][0].token_ids for p, q in zip(prompts, params)]
    assert [out[0].token_ids for out in engine.generate(prompts, params)] == alone
