"""What stop-string matching costs per generated token, by the stop strings' length.

    python -m engine.bench.stop_strings [--num-tokens 5000] [--chars-per-token 4] [--repeats 5]

Prints a Markdown table: microseconds per token for the detokenizer's stop-string work
(`StopStringMatcher.feed` on the token's new text, then `held_back_length` for what may be
emitted) with one stop string of 5, 1,024 (the longest a request may send) and 20,000
characters, on two texts: ordinary text that never comes near the stop string, and text that
keeps extending a prefix of it (everything is held back; the worst case for rescanning).
"""

from __future__ import annotations

import argparse
import random
import time

from engine.text.detokenizer import StopStringMatcher

STOP_LENGTHS = (5, 1024, 20_000)


def ordinary_text(num_chars: int) -> str:
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "then", "some"]
    text = ""
    while len(text) < num_chars:
        text += rng.choice(words) + " "
    return text[:num_chars]


def stop_string(length: int) -> str:
    """`length` characters: "ab" repeated, ending in a character the texts never contain."""
    return ("ab" * length)[: length - 1] + "!"


def us_per_token(stop: str, text: str, chars_per_token: int, repeats: int) -> float:
    """Best of `repeats` runs over the whole text, per token of `chars_per_token` characters."""
    pieces = [text[i : i + chars_per_token] for i in range(0, len(text), chars_per_token)]
    best = float("inf")
    for _ in range(repeats):
        matcher = StopStringMatcher((stop,))
        started = time.perf_counter()
        for piece in pieces:
            matcher.feed(piece, counts=True)
            matcher.held_back_length()
        best = min(best, time.perf_counter() - started)
    return best * 1e6 / len(pieces)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-tokens", type=int, default=5000)
    parser.add_argument("--chars-per-token", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    num_chars = args.num_tokens * args.chars_per_token
    texts = {
        "ordinary text": ordinary_text(num_chars),
        "text extending a prefix of the stop string": ("ab" * num_chars)[:num_chars],
    }
    print(f"\nStop-string matching: {args.num_tokens} tokens of {args.chars_per_token} characters, one stop string\n")
    print("| text | " + " | ".join(f"{n:,}-char stop: µs/token" for n in STOP_LENGTHS) + " |")
    print("| --- |" + " ---: |" * len(STOP_LENGTHS))
    for name, text in texts.items():
        costs = [us_per_token(stop_string(n), text, args.chars_per_token, args.repeats) for n in STOP_LENGTHS]
        print(f"| {name} | " + " | ".join(f"{us:.2f}" for us in costs) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
