"""The generated pages are renderings of the code (server/cli/reference.py): the configuration page's flag
table of the flags themselves (every flag has its words in FLAG_DOCS), the API reference of the app's OpenAPI
document; each committed page equals a fresh rendering."""

from __future__ import annotations

import pytest

from server.cli import reference
from server.cli.args import flag_defaults
from server.cli.flag_docs import FLAG_DOCS
from server.cli.flags import FLAGS


def test_every_flag_has_its_words_and_every_entry_names_a_flag():
    assert set(FLAG_DOCS) == {flag.name for flag in FLAGS}


def test_the_committed_configuration_page_is_the_rendering():
    page = reference.CONFIGURATION_PAGE.read_text()
    assert page == reference.render_page(page), "docs/serving/configuration.md is stale: run `make reference`"


def test_the_committed_api_reference_is_the_rendering():
    page = reference.ENDPOINTS_PAGE.read_text()
    assert page == reference.render_endpoints_page(page), "docs/api/reference.md is stale: run `make reference`"
    assert "| POST | `/v1/chat/completions` | [ChatCompletionRequest](#chatcompletionrequest) |" in page
    assert "\n### ChatCompletionRequest\n" in page


def test_defaults_render_as_typed_and_an_unset_one_as_its_note():
    flags = {flag.name: flag for flag in FLAGS}
    defaults = flag_defaults()
    assert reference.default_cell(flags["kv_cache_memory"], defaults["kv_cache_memory"]) == "`512MiB`"
    assert reference.default_cell(flags["enable_prefix_caching"], True) == "`true`"
    assert reference.default_cell(flags["request_timeout"], 600.0) == "`600`"
    assert reference.default_cell(flags["max_model_len"], None) == "the model's context"
    assert reference.default_cell(flags["api_key"], ()) == "none"
    assert reference.default_cell(flags["host"], "127.0.0.1") == "`127.0.0.1` (`0.0.0.0` in Docker)"
    # a changed default shows on the page: the rendering reads the configs, not the words
    assert reference.default_cell(flags["block_size"], 32) == "`32`"


def test_a_page_without_the_markers_is_refused():
    with pytest.raises(ValueError, match="markers"):
        reference.render_page("# Configuration\n")
    with pytest.raises(ValueError, match="markers"):
        reference.render_endpoints_page("# API reference\n")
