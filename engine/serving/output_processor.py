"""Token ids -> text: the async side's half of every RequestOutput.

The engine core works in token ids only: its RequestOutputs carry each sample's
new token ids, logprobs and any finish the core decided (EOS, stop token,
length, abort), with empty text. The output processor owns one detokenizer per
sample and turns those deltas into text deltas. Stop strings are text, so they
are found here: the sample is finished at once (its text cut at the stop) and
the processor reports it in `stopped_samples`, for its driver to stop the
sample in the core before the next step (the core may have computed more tokens
meanwhile: one, or up to k+1 with speculative decoding; they are dropped here,
and so are the tokens after the stop within the step that found it). A RequestOutput with an `error`
(the core failed that request alone) is passed on as the request's last output.

Each request's text state (`RequestTextState`: its samples' detokenizers) is held by
the processor's driver, next to what else it keeps per request; the processor
makes it (`new_request_text`) and is the only one to read or change it.

Runs on one thread only (the event loop in the server), so the tokenizer is
never used by two threads at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.outputs import FINISH_STOP, CompletionOutput, RequestOutput
from engine.params import SamplingParams
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class StoppedSample:
    """A sample that the processor finished on a stop string; the core must stop it too."""

    request_id: str
    index: int
    stop_string: str


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    stopped_samples: list[StoppedSample] = field(default_factory=list)


@dataclass
class _SampleText:
    detokenizer: IncrementalDetokenizer
    is_finished: bool = False  # later core deltas (after a stop string, or an abort notice) are dropped


@dataclass
class RequestTextState:
    """One request's text state: a detokenizer per sample. Opaque to its holder: only the processor uses it."""

    samples: list[_SampleText]

    @property
    def is_finished(self) -> bool:
        """Every sample has finished: the request's later core outputs are dropped."""
        return all(sample.is_finished for sample in self.samples)


class OutputProcessor:
    """Token ids -> text with one tokenizer, for requests whose text state (RequestTextState) its driver holds."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def new_request_text(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestTextState:
        """The text state of a request the core just accepted; its driver holds it until it forgets the request."""
        return RequestTextState(
            [_SampleText(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)) for _ in range(params.n)]
        )

    def process(
        self, core_outputs: list[RequestOutput], text_of: Callable[[str], RequestTextState | None]
    ) -> ProcessedOutputs:
        """Fill in text for one step's core outputs, each with its request's text state (`text_of(request_id)`).

        Outputs of requests without one (forgotten by the driver) or already finished are dropped.
        """
        processed = ProcessedOutputs()
        for core_output in core_outputs:
            request = text_of(core_output.request_id)
            if request is None or request.is_finished:
                continue
            if core_output.error is not None:
                # The core finished the request on an error: pass it on (samples not yet
                # finished here, no text) and finish its text state.
                unfinished = [c for c in core_output.outputs if not request.samples[c.index].is_finished]
                for sample in request.samples:
                    sample.is_finished = True
                processed.request_outputs.append(dataclasses.replace(core_output, outputs=unfinished, finished=True))
                continue
            completions = []
            for delta in core_output.outputs:
                completion = self._process_sample(core_output.request_id, request, delta, processed)
                if completion is not None:
                    completions.append(completion)
            finished = request.is_finished
            if completions or finished:
                processed.request_outputs.append(
                    dataclasses.replace(core_output, outputs=completions, finished=finished)
                )
        return processed

    def _process_sample(
        self, request_id: str, request: RequestTextState, delta: CompletionOutput, processed: ProcessedOutputs
    ) -> CompletionOutput | None:
        sample = request.samples[delta.index]
        if sample.is_finished:
            return None
        finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
        num_generated = delta.num_generated_tokens - len(delta.token_ids)
        for i, token_id in enumerate(delta.token_ids):
            num_generated += 1
            stop_string = sample.detokenizer.add_token(token_id, num_generated)
            if stop_string is not None:
                finish_reason, stop_reason = FINISH_STOP, stop_string
                if delta.finish_reason is None:  # the core does not know yet
                    processed.stopped_samples.append(StoppedSample(request_id, delta.index, stop_string))
                # A step may carry several tokens (accepted speculative drafts): the ones after the
                # stop are not output, in text, token ids, logprobs or counts.
                delta = dataclasses.replace(
                    delta,
                    token_ids=delta.token_ids[: i + 1],
                    logprobs=delta.logprobs[: i + 1] if delta.logprobs is not None else None,
                    num_generated_tokens=num_generated,
                )
                break
        if finish_reason is not None:
            sample.is_finished = True
        return dataclasses.replace(
            delta,
            text=sample.detokenizer.take_new_text(sample.is_finished),
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
