"""OutputProcessor: token ids -> text, with each request's text state held by its driver."""

from __future__ import annotations

from engine.outputs import CompletionOutput, RequestOutput
from engine.params import SamplingParams
from engine.serving.output_processor import OutputProcessor, RequestTextState, StoppedSample


class ScriptedTokenizer:
    """Token t reads "<t>"."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{t}>" for t in token_ids)


def _delta(token_ids: list[int], num_generated: int, index: int = 0, finish_reason: str | None = None):
    return CompletionOutput(index, "", token_ids, None, finish_reason=finish_reason, num_generated_tokens=num_generated)


def _output(request_id: str, *deltas: CompletionOutput, finished: bool = False, error: str | None = None):
    return RequestOutput(request_id, list(deltas), [1], finished, error=error)


def test_text_state_lives_with_the_driver_and_unknown_requests_are_dropped():
    processor = OutputProcessor(ScriptedTokenizer())
    texts: dict[str, RequestTextState] = {"a": processor.new_request_text([1], SamplingParams(max_tokens=4))}
    processed = processor.process([_output("a", _delta([2, 3], 2)), _output("gone", _delta([9], 1))], texts.get)
    assert [(o.request_id, o.outputs[0].text) for o in processed.request_outputs] == [("a", "<2><3>")]
    processed = processor.process([_output("a", _delta([4], 3, finish_reason="length"), finished=True)], texts.get)
    assert processed.request_outputs[0].finished and processed.request_outputs[0].outputs[0].text == "<4>"
    assert texts["a"].is_finished


def test_a_stop_string_finishes_the_sample_and_drops_its_later_tokens():
    processor = OutputProcessor(ScriptedTokenizer())
    texts = {"a": processor.new_request_text([1], SamplingParams(max_tokens=10, stop=["<3>"]))}
    processed = processor.process([_output("a", _delta([2, 3, 4], 3))], texts.get)  # a step of 3 tokens
    (output,) = processed.request_outputs
    assert output.finished and output.outputs[0].text == "<2>" and output.outputs[0].token_ids == [2, 3]
    assert processed.stopped_samples == [StoppedSample("a", 0, "<3>")]
    # The core computed one more token before it heard of the stop: nothing comes out for it.
    assert processor.process([_output("a", _delta([5], 4))], texts.get).request_outputs == []


def test_an_error_ends_the_request_with_its_unfinished_samples():
    processor = OutputProcessor(ScriptedTokenizer())
    texts = {"a": processor.new_request_text([1], SamplingParams(max_tokens=10, n=2))}
    first = _output("a", _delta([2], 1, index=0, finish_reason="length"), _delta([7], 1, index=1))
    processor.process([first], texts.get)
    processed = processor.process([_output("a", _delta([], 1), _delta([], 1, index=1), error="boom")], texts.get)
    (output,) = processed.request_outputs
    assert output.finished and output.error == "boom" and [c.index for c in output.outputs] == [1]
    assert texts["a"].is_finished
    assert processor.process([_output("a", _delta([8], 2, index=1))], texts.get).request_outputs == []
