"""LangChain's ChatAnthropic and ChatOllama against kvserve's Messages and Ollama APIs, on a tiny model whose
greedy answer is a fixed script (tests/support/thinking_model.py): invoke and stream give the answer,
thinking comes apart, and bound tools come back as tool calls."""

from __future__ import annotations

import pytest

from server.app import create_app
from tests.support.server_harness import ServerThread
from tests.support.thinking_model import thinking_server_config

pytestmark = pytest.mark.slow

langchain_anthropic = pytest.importorskip("langchain_anthropic")
langchain_ollama = pytest.importorskip("langchain_ollama")

THOUGHT, ANSWER = "quick fox", "Hello world"
SCRIPT = f"<think>{THOUGHT}</think>{ANSWER}"  # all of it the answer when thinking is off (the prompt closed it)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    config = thinking_server_config(tmp_path_factory.mktemp("thinker"), SCRIPT, served_model_name="tiny-thinker")
    with ServerThread(create_app(config)) as srv:
        yield srv.base_url


def add(a: int, b: int) -> int:
    """Adds two numbers."""
    return a + b


def test_chat_anthropic(base_url):
    model = langchain_anthropic.ChatAnthropic(
        model="tiny-thinker", base_url=base_url, api_key="unused", temperature=0, max_tokens=40, max_retries=0
    )
    assert model.invoke("What is 2 + 3?").content == SCRIPT
    assert "".join(chunk.text for chunk in model.stream("What is 2 + 3?")) == SCRIPT
    thinking = langchain_anthropic.ChatAnthropic(
        model="tiny-thinker",
        base_url=base_url,
        api_key="unused",
        max_tokens=1500,
        thinking={"type": "enabled", "budget_tokens": 1024},
        temperature=0,
        max_retries=0,
    )
    blocks = thinking.invoke("What is 2 + 3?").content
    assert [(b["type"], b.get("thinking") or b.get("text")) for b in blocks] == [
        ("thinking", THOUGHT),
        ("text", ANSWER),
    ]
    longer = model.model_copy(update={"max_tokens": 200})
    called = longer.bind_tools([add], tool_choice="any", parallel_tool_calls=False).invoke("What is 1 + 3?")
    assert called.tool_calls and called.tool_calls[0]["name"] == "add"
    assert set(called.tool_calls[0]["args"]) == {"a", "b"}


def test_chat_ollama(base_url):
    model = langchain_ollama.ChatOllama(model="tiny-thinker", base_url=base_url, temperature=0, num_predict=40)
    assert model.invoke("What is 2 + 3?").content == SCRIPT
    assert "".join(chunk.text for chunk in model.stream("What is 2 + 3?")) == SCRIPT
    thinking = langchain_ollama.ChatOllama(
        model="tiny-thinker", base_url=base_url, temperature=0, num_predict=40, reasoning=True
    )
    answer = thinking.invoke("What is 2 + 3?")
    assert answer.content == ANSWER and answer.additional_kwargs["reasoning_content"] == THOUGHT
