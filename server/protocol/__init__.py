"""Every HTTP shape the server speaks, as pydantic models: requests are validated once here.

Requests forbid unknown fields: a field kvserve does not know is a 400 naming it, never
silently ignored. Fields OpenAI defines but kvserve does not implement are declared and
rejected by the request's `unsupported_fields()` when set to a value that would change the result.

common.py: the request base, sampling and truncation fields, usage, prompt logprobs, /v1/models cards;
completions.py, chat.py, responses.py, embeddings.py, rerank.py, tokenize.py and structured.py: one
endpoint group (or shared field group) each.
"""
