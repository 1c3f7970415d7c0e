"""What the load generator sends: workloads and the seeded prompts built from them.

Prompts of a given token length come from a seeded word list, sized with a token counter (the server's own
`/tokenize`, so every server sees the same token counts); rewrite and chat tasks build chat requests.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Common, mostly single-token English words: a prompt of them tokenizes predictably on any BPE vocabulary.
_WORDS_TEXT = """the of and to in is was for that on as with by he it at from his an were are which this be or had not
    but first one their its new after who they have her she two been other when there all during into school
    time may years more most only over city some world would where later up such used many can state about
    national out known university united then made also three city year people water house river game under
    long part home great team small found life best light book music street road family early name line war
    north south east west high world work old end day good place number group area point power market art
    story field system court night land town film local country side open round paper member order report
    show way king table window garden morning history letter simple green blue red black white stone tree
    bird horse ship train summer winter spring autumn voice friend mother father child doctor teacher farmer
    village island forest mountain valley bridge station church castle museum library kitchen bottle coffee
    bread apple orange silver golden quiet happy strong young ancient modern public private central common"""
WORDS: tuple[str, ...] = tuple(_WORDS_TEXT.split())
# The tasks a workload's prompts can be. words: a completion prompt of seeded words. rewrite: a chat
# request to rewrite a seeded passage with misspellings, correcting the spelling (the answer copies its
# input: what speculative decoding speeds up). chat: a free-form chat question (nothing to copy).
TASKS = ("words", "rewrite", "chat")
_ADJECTIVES = """quiet happy strong young ancient modern public private central common green blue red black white
    golden silver small great early old famous narrow busy""".split()
_NOUNS = """river garden teacher farmer village island forest mountain valley bridge station church castle museum
    library kitchen bottle horse ship train doctor letter window market tower""".split()
_VERBS = """visited crossed painted described followed remembered repaired opened watched found built left
    reached cleaned""".split()
_PLACES = (
    "near the harbour",
    "after the long winter",
    "before the storm",
    "behind the old mill",
    "along the northern road",
    "during the summer fair",
    "beside the quiet lake",
    "under the stone arch",
)
_CHAT_QUESTIONS = (
    "Write a short story about a {adj} {noun} and the people who live around it.",
    "Explain to a child why the {noun} in the {noun2} looks so {adj} in the evening.",
    "Give me five ideas for a weekend trip to a {adj} {noun}, with one sentence on each.",
    "What would you tell a {noun} who wants to become a {noun2}? Answer in a few paragraphs.",
    "Describe a day in the life of a {adj} {noun} in a small town.",
)
REWRITE_INSTRUCTION = "Rewrite the following text, correcting the spelling:\n\n"
# The structured workload's schema: one free string, so an output can be as long as an unconstrained one.
STRUCTURED_SCHEMA = json.dumps(
    {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"], "additionalProperties": False}
)


@dataclass(frozen=True)
class Workload:
    """What to send. Lengths are token counts; `*_max` > `*_len` draws each request's length uniformly
    from [len, max] with the seeded generator (fixed lengths otherwise)."""

    name: str = "custom"
    num_requests: int = 16
    concurrency: int = 1
    prompt_len: int = 110
    prompt_len_max: int | None = None
    output_len: int = 128
    output_len_max: int | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0
    warmup_requests: int = 1
    json_schema: str | None = None  # JSON text: every request's output must match it (`structured_outputs`)
    task: str = "words"  # one of TASKS; rewrite and chat go to /v1/chat/completions
    speculative: bool | None = None  # False: ask each request to opt out of speculative decoding

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}")
        if self.num_requests < 1 or self.concurrency < 1:
            raise ValueError("num_requests and concurrency must be >= 1")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError("prompt_len and output_len must be >= 1")
        if self.prompt_len_max is not None and self.prompt_len_max < self.prompt_len:
            raise ValueError("prompt_len_max must be >= prompt_len")
        if self.output_len_max is not None and self.output_len_max < self.output_len:
            raise ValueError("output_len_max must be >= output_len")


@dataclass(frozen=True)
class RequestSpec:
    prompt: str  # the completion prompt, or the one user message of a chat task
    prompt_tokens: int  # as counted by the tokenizer used to size it (-1: estimated, no tokenizer)
    max_tokens: int
    chat: bool = False  # send `prompt` as a user message to /v1/chat/completions


# --------------------------------------------------------------------------- workload generation


def draw_lengths(workload: Workload) -> list[tuple[int, int]]:
    """(prompt_len, output_len) per request, from the workload's seed."""
    rng = random.Random(workload.seed)
    out = []
    for _ in range(workload.num_requests):
        p = rng.randint(workload.prompt_len, workload.prompt_len_max or workload.prompt_len)
        o = rng.randint(workload.output_len, workload.output_len_max or workload.output_len)
        out.append((p, o))
    return out


def fit_prompt(words: Sequence[str], target: int, count_tokens: Callable[[str], int]) -> tuple[str, int]:
    """Longest prefix of `words` with at most `target` tokens, then padded with one-token words to hit it.

    Binary search over the number of words: about log2(len(words)) tokenizer calls.
    """
    lo, hi = 1, len(words)
    best_n, best_count = 1, count_tokens(" ".join(words[:1]))
    while lo <= hi:
        mid = (lo + hi) // 2
        n = count_tokens(" ".join(words[:mid]))
        if n <= target:
            best_n, best_count = mid, n
            lo = mid + 1
        else:
            hi = mid - 1
    text = " ".join(words[:best_n])
    # Pad with the words of the list after the prefix, keeping each only if it does not overshoot.
    for word in words[best_n : best_n + 4 * target]:
        if best_count >= target:
            break
        candidate = f"{text} {word}"
        n = count_tokens(candidate)
        if n <= target:
            text, best_count = candidate, n
    return text, best_count


def misspell(word: str, rng: random.Random, rate: float = 0.15) -> str:
    """The word with two neighbouring inner letters swapped, at `rate` for words of 4+ letters."""
    if len(word) < 4 or rng.random() >= rate:
        return word
    i = rng.randrange(1, len(word) - 2)
    return word[:i] + word[i + 1] + word[i] + word[i + 2 :]


def rewrite_passage(rng: random.Random, target: int, count_tokens: Callable[[str], int] | None) -> tuple[str, int]:
    """A seeded passage of simple sentences with misspelled words, about `target` tokens long.

    Sentences are added until the passage reaches the target (counted every few sentences; without a
    tokenizer, words stand in for tokens, at about 1.3 tokens each).
    """
    sentences: list[str] = []
    count = 0
    while count < target:
        for _ in range(4):
            sentence = (
                f"The {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} the "
                f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_PLACES)}."
            )
            sentences.append(" ".join(misspell(w, rng) for w in sentence.split()))
        text = " ".join(sentences)
        count = count_tokens(text) if count_tokens is not None else round(1.3 * len(text.split()))
    return text, count


def chat_question(rng: random.Random) -> str:
    """A seeded free-form question: the answer has nothing in the prompt to copy."""
    template = rng.choice(_CHAT_QUESTIONS)
    return template.format(adj=rng.choice(_ADJECTIVES), noun=rng.choice(_NOUNS), noun2=rng.choice(_NOUNS))


def build_requests(workload: Workload, count_tokens: Callable[[str], int] | None) -> list[RequestSpec]:
    """Deterministic prompts: the same seed gives the same word sequences on every server.

    Each prompt starts with a distinct request number so no server can reuse another request's prompt cache.
    Without a tokenizer the word count stands in for the token count (these words are mostly one token).
    A rewrite task's passage is about prompt_len tokens (the chat template and instruction come on top);
    a chat task's question is a sentence, whatever prompt_len says.
    """
    rng = random.Random(workload.seed + 1)
    if workload.task == "rewrite":
        specs = []
        for _, output_len in draw_lengths(workload):
            passage, n = rewrite_passage(rng, workload.prompt_len, count_tokens)
            specs.append(RequestSpec(REWRITE_INSTRUCTION + passage, n, output_len, chat=True))
        return specs
    if workload.task == "chat":
        return [RequestSpec(chat_question(rng), -1, output_len, chat=True) for _, output_len in draw_lengths(workload)]
    specs = []
    for i, (prompt_len, output_len) in enumerate(draw_lengths(workload)):
        # Twice the target in words is always enough text; each word is at least one token.
        words = [f"Request {i}:"] + [rng.choice(WORDS) for _ in range(2 * prompt_len + 8)]
        if count_tokens is None:
            specs.append(RequestSpec(" ".join(words[:prompt_len]), -1, output_len))
        else:
            text, n = fit_prompt(words, prompt_len, count_tokens)
            specs.append(RequestSpec(text, n, output_len))
    return specs
