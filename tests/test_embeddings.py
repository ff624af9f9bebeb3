"""Embeddings (coordinator/runtime/embedding.py, POST /v1/embeddings, `sparseinfer embed`,
LLM.embed): a text's vector is the same alone and inside a batch, pooled as the model's
metadata says, unit length; the endpoint speaks OpenAI's shape to the official client, and
refuses bad bodies in OpenAI's error shape. Also /metrics' speculative decoding counters."""
from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from coordinator.runtime.embedding import pool, pooling_of
from coordinator.runtime.engine import Engine, EngineOptions
from tests.fixtures.openai_server import (  # noqa: F401 (fixtures)
    KEY, client, model_id, run_cli, served)

TEXTS = ["the lazy dog", "a quick brown fox jumps over the lazy dog and runs far away into the woods",
         "x", "hello world, hello", "once upon a time there was a tiny model"]


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/embeddings", data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("tensor_type", ["Q4_0", "F16"])
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_a_text_embeds_the_same_alone_and_inside_a_batch(tiny_model_factory, tensor_type, fast, no_leaks):
    path = tiny_model_factory(tensor_type=tensor_type, seed=3)
    with Engine(path, EngineOptions(threads=2, cpu_workers=1, fast=fast)) as eng:
        ids = [eng.tokenizer.encode(t) for t in TEXTS]
        assert any(len(i) > 16 for i in ids) and any(len(i) <= 2 for i in ids)  # chunks of 16, one-token texts
        alone = [eng.embed([i])[0] for i in ids]
        together = eng.embed(ids)
        backwards = eng.embed(ids[::-1])[::-1]
        many = eng.embed(ids * 40)  # several passes (embedding.MAX_PASS_TOKENS rows each)
    for k, v in enumerate(alone):
        np.testing.assert_array_equal(together[k], v)
        np.testing.assert_array_equal(backwards[k], v)
        np.testing.assert_array_equal(many[k + len(TEXTS) * 39], v)
        assert abs(np.linalg.norm(v) - 1.0) < 1e-5
    assert not np.allclose(together[0], together[1])  # different texts, different vectors


class _Field:
    def __init__(self, v):
        self.v = v

    def contents(self):
        return self.v


class _Reader:
    def __init__(self, **fields):
        self.fields = {k.replace("__", "."): _Field(v) for k, v in fields.items()}


def test_pooling_follows_the_files_metadata():
    assert pooling_of(_Reader(), "llama") == "mean"  # a decoder model's file says nothing
    assert pooling_of(_Reader(llama__pooling_type=0), "llama") == "mean"
    assert pooling_of(_Reader(bert__pooling_type=2), "bert") == "cls"
    assert pooling_of(_Reader(llama__pooling_type=3), "llama") == "last"
    with pytest.raises(ValueError, match="reranker"):
        pooling_of(_Reader(llama__pooling_type=4), "llama")
    with pytest.raises(ValueError, match="pooling_type 9"):
        pooling_of(_Reader(llama__pooling_type=9), "llama")
    states = np.array([[3.0, 4.0], [0.0, 1.0], [1.0, 0.0]], np.float32)
    np.testing.assert_allclose(pool(states, "cls"), [0.6, 0.8])
    np.testing.assert_allclose(pool(states, "last"), [1.0, 0.0])
    np.testing.assert_allclose(pool(states, "mean"), np.array([4.0, 5.0]) / np.sqrt(41), rtol=1e-6)


def test_the_openai_client_gets_embeddings_alone_and_batched_alike(served, client, model_id):
    batch = client.embeddings.create(model=model_id, input=TEXTS)  # the client asks for base64
    assert [d.index for d in batch.data] == list(range(len(TEXTS)))
    assert batch.usage.prompt_tokens > len(TEXTS) and batch.usage.total_tokens == batch.usage.prompt_tokens
    for k, text in enumerate(TEXTS):
        alone = client.embeddings.create(model=model_id, input=text, encoding_format="float").data[0].embedding
        assert alone == batch.data[k].embedding
        assert abs(np.linalg.norm(alone) - 1.0) < 1e-5
    # token arrays, and base64 as little-endian float32
    status, body = _post(served[1], {"input": [[5, 9, 30], [7, 8]], "encoding_format": "base64"})
    assert status == 200 and body["usage"]["prompt_tokens"] == 5
    vec = np.frombuffer(base64.b64decode(body["data"][1]["embedding"]), "<f4")
    status, one = _post(served[1], {"input": [7, 8]})
    assert status == 200 and vec.tolist() == one["data"][0]["embedding"]


@pytest.mark.parametrize("body, status, param", [
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": [[1, 2], [10 ** 9]]}, 400, "input"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "hi", "dimensions": 3}, 400, "dimensions"),
    ({"input": "hi", "model": "gpt-4"}, 404, "model"),
    ({"input": 5}, 400, "input"),
])
def test_bad_embedding_bodies_get_openai_errors(served, body, status, param):
    got, err = _post(served[1], body)
    assert got == status
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["param"].startswith(param)
    assert "\n" not in err["error"]["message"]


def test_metrics_count_speculative_decoding(served, client, model_id):
    client.completions.create(model=model_id, prompt="a b c a b c a b c a b c", max_tokens=24, temperature=0,
                              extra_body={"ignore_eos": True})
    req = urllib.request.Request(served[1] + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["sparseinfer_spec_step_tokens_total"] >= 23  # tokens after the prompt's own
    assert 0 < samples["sparseinfer_spec_sequence_steps_total"] <= samples["sparseinfer_spec_step_tokens_total"]
    assert samples["sparseinfer_spec_accepted_tokens_total"] <= samples["sparseinfer_spec_drafted_tokens_total"]
    assert "sparseinfer_spec_acceptance" in samples and "sparseinfer_spec_tokens_per_step" in samples


def test_the_command_line_and_python_embed(tiny_model, no_leaks):
    r = run_cli(["embed", "-m", str(tiny_model), "-t", "2", "the lazy dog", "x"])
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 2 and all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in rows)
    import sparseinfer

    with sparseinfer.LLM(tiny_model, threads=2) as llm:
        one = llm.embed("the lazy dog")
        both = llm.embed(["the lazy dog", "x"])
        with pytest.raises(TypeError):
            llm.embed([1, 2])
    assert one.shape == (len(rows[0]),) and np.array_equal(both[0], one)
    np.testing.assert_array_equal(np.asarray(rows, np.float32), both)
    bad = run_cli(["embed", "-m", str(tiny_model), ""])
    assert bad.returncode == 1 and bad.stderr.strip().count("\n") == 0


@pytest.mark.smollm2
def test_smollm2_paraphrases_sit_closer_than_unrelated_texts(smollm2_path, no_leaks):
    pairs = ["The cat sat on the mat.", "A cat was sitting on the rug.",
             "Quarterly revenue rose by eight percent.", "The committee will vote on the budget tomorrow."]
    with Engine(smollm2_path, EngineOptions()) as eng:
        ids = [eng.tokenizer.encode(t) for t in pairs]
        v = eng.embed(ids)
        alone = [eng.embed([i])[0] for i in ids]
    for k in range(len(pairs)):
        np.testing.assert_array_equal(v[k], alone[k])
    paraphrase = float(v[0] @ v[1])
    unrelated = max(float(v[0] @ v[2]), float(v[0] @ v[3]), float(v[1] @ v[2]), float(v[1] @ v[3]))
    assert paraphrase > unrelated, (paraphrase, unrelated)
