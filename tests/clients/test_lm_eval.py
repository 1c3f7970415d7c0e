"""lm-evaluation-harness scores a model through kvserve as transformers scores it in-process.

lm-eval's `local-completions` model asks `/v1/completions` for the echoed prompt's logprobs (echo,
logprobs=1, max_tokens=1) and tokenizes through the server (`/tokenizer_info`, `/tokenize`). The
task is the local multiple-choice file in tests/data/lm_eval (no dataset download). Every
loglikelihood is checked against transformers on the same float32 model, and so is the accuracy.
The model is a tiny random llama with a real tokenizer: transformers loads it in well under a
second, where dequantizing the default GGUF takes it half a minute (docs/api/logprobs-and-lm-eval.md gives the command
and the numbers for the default model).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.text.tokenizer import Tokenizer
from server.app import create_app
from tests.support.server_harness import ServerThread, make_server_config
from tests.support.tiny_models import load_reference, make_tiny_llama

pytestmark = pytest.mark.slow

lm_eval = pytest.importorskip("lm_eval")

REPO = Path(__file__).resolve().parents[2]
TASK_DIR = REPO / "tests" / "data" / "lm_eval"
SERVED_NAME = "tiny-llama"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return Path(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def server(model_path):
    with ServerThread(create_app(make_server_config(model_path))) as srv:  # float32, no quantization
        yield srv


def _reference_loglikelihoods(model_path: Path, pairs: list[tuple[str, str]]) -> list[float]:
    """sum log p(continuation | context) with transformers, split into tokens as lm-eval splits them."""
    tokenizer = Tokenizer.from_path(model_path)
    model = load_reference(str(model_path))
    scores = []
    for context, continuation in pairs:
        context_ids = tokenizer.encode(context, add_special_tokens=False)
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        with torch.no_grad():
            logprobs = model(torch.tensor([whole])).logits[0].float().log_softmax(dim=-1)
        scores.append(sum(float(logprobs[i - 1, whole[i]]) for i in range(len(context_ids), len(whole))))
    return scores


def test_lm_eval_local_completions_matches_transformers(server, model_path, monkeypatch, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(REPO)  # the task's data file path is relative to the repository root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    results = simple_evaluate(
        model="local-completions",
        model_args={
            "model": SERVED_NAME,
            "base_url": f"{server.base_url}/v1/completions",
            "num_concurrent": 2,
            "max_retries": 1,
        },
        tasks=["kvserve_facts"],
        task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
        log_samples=True,
    )
    samples = sorted(results["samples"]["kvserve_facts"], key=lambda s: s["doc_id"])
    assert len(samples) == 12

    pairs, served, correct = [], [], []
    for sample in samples:
        doc = sample["doc"]
        for choice, response in zip(doc["choices"], sample["resps"], strict=True):
            pairs.append((doc["question"], " " + choice))
            served.append(response[0][0])
    expected = _reference_loglikelihoods(model_path, pairs)
    assert served == pytest.approx(expected, abs=1e-4)

    at = 0
    for sample in samples:
        count = len(sample["doc"]["choices"])
        choice_scores = expected[at : at + count]
        correct.append(max(range(count), key=choice_scores.__getitem__) == sample["doc"]["answer"])
        at += count
    accuracy = results["results"]["kvserve_facts"]["acc,none"]
    assert accuracy == pytest.approx(sum(correct) / len(correct))
