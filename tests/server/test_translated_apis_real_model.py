"""The real default model (SmolLM2, its own chat template) through Anthropic's and Ollama's clients: every
greedy answer equals chat's for the same conversation, token for token, streamed and whole, and the
prompt counts agree (skipped if the model is not pulled)."""

from __future__ import annotations

import anthropic
import ollama
import openai
import pytest

from tests.support.server_harness import smollm2_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
SYSTEM = "You answer in one short sentence."
QUESTION = "Why is the sky blue?"
TOKENS = 24


def test_smollm2_answers_equal_chats_through_anthropic_and_ollama():
    # A float32 cache: later requests continue a cached prefix, whose last-bit difference from the first
    # request's a 16-bit cache can carry into an answer near a tie.
    with smollm2_server(max_model_len=1024, kv_cache="64MiB", kv_cache_dtype="float32") as srv:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        chat = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0
        )
        expected, prompt_tokens = chat.choices[0].message.content, chat.usage.prompt_tokens
        assert expected

        claude = anthropic.Anthropic(base_url=srv.base_url, api_key="unused", max_retries=0)
        fields = {"model": MODEL, "max_tokens": TOKENS, "system": SYSTEM, "extra_body": {"temperature": 0}}
        ask = [{"role": "user", "content": QUESTION}]
        message = claude.messages.create(messages=ask, **fields)
        assert message.content[0].text == expected and message.usage.input_tokens == prompt_tokens
        with claude.messages.stream(messages=ask, **fields) as stream:
            assert "".join(stream.text_stream) == expected
        assert claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ask).input_tokens == prompt_tokens

        local = ollama.Client(host=srv.base_url)
        options = {"temperature": 0, "num_predict": TOKENS}
        answer = local.chat(model=MODEL, messages=messages, options=options, stream=False)
        assert answer.message.content == expected and answer.prompt_eval_count == prompt_tokens
        streamed = local.chat(model=f"{MODEL}:latest", messages=messages, options=options, stream=True)
        assert "".join(line.message.content for line in streamed) == expected
        generated = local.generate(model=MODEL, system=SYSTEM, prompt=QUESTION, options=options, stream=False)
        assert generated.response == expected and generated.prompt_eval_count == prompt_tokens
