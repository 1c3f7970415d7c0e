"""LangChain's ChatOpenAI against kvserve: with_structured_output by JSON schema and by function
calling, and bind_tools with a tool call read back (a tiny random model: the shapes, not the wit)."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

from server.app import create_app
from tests.support.server_harness import ServerThread, make_server_config
from tests.support.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow

langchain_openai = pytest.importorskip("langchain_openai")

MODEL = "tiny-llama"


class Ticket(BaseModel):
    """A support ticket."""

    title: str = Field(max_length=10)
    priority: Literal["low", "high"]
    hours: int = Field(ge=0, le=48)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=2048)
    with ServerThread(create_app(make_server_config(model_dir, max_model_len=2048))) as srv:
        yield langchain_openai.ChatOpenAI(
            model=MODEL, base_url=f"{srv.base_url}/v1", api_key="unused", temperature=0.7, seed=1, max_retries=0
        )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_pydantic_object(chat_model, method):
    structured = chat_model.with_structured_output(Ticket, method=method)
    ticket = structured.invoke("The printer is on fire. File a ticket.")
    assert isinstance(ticket, Ticket)


def test_bind_tools_gives_tool_calls(chat_model):
    def lookup_order(order_id: int) -> str:
        """Look an order up by its id."""
        return "shipped"

    message = chat_model.bind_tools([lookup_order], tool_choice="required").invoke("Where is order 42?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "lookup_order"
    assert isinstance(message.tool_calls[0]["args"]["order_id"], int)
