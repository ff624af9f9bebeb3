"""Structured output: replies constrained to a JSON schema, JSON object, regex or GBNF grammar,
through the official `openai` client against real servers on SmolLM2 (49k vocabulary, byte-level
BPE) and Gemma 3 270M (262k, SentencePiece); every reply checked by `jsonschema`, streamed and
not, alone and inside a batch of 4; errors name the field; and the grammar's state machine on
its own (coordinator/text/structured_output.py)."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import numpy as np
import openai
import pytest

from coordinator.text.structured_output import Constraint, GrammarError, TokenTable, grammar_for
from coordinator.text.tokenizer import GGUFTokenizer
from sparsecore.gguf_file import open_gguf
from tests.fixtures.http_server import launched

CITY = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Rome", "Paris", "Berlin", "Madrid"]},
    "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
    "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 1, "maxItems": 3},
    "country": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30}, "in_eu": {"type": "boolean"}},
                "required": ["name", "in_eu"], "additionalProperties": False}},
    "required": ["city", "population_millions", "landmarks", "country"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "pets": {"type": "array", "items": {"type": "object", "properties": {
        "kind": {"type": "string", "enum": ["cat", "dog", "fish"]}, "name": {"type": "string", "maxLength": 20}},
        "required": ["kind", "name"], "additionalProperties": False}, "maxItems": 2}},
    "required": ["name", "age", "pets"], "additionalProperties": False}
CASES = [("Describe the capital of Italy as JSON.", CITY), ("Invent a person who owns pets, as JSON.", PERSON)]


def _fmt(schema, name="reply"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def served(request, tmp_path_factory):
    path = request.getfixturevalue("smollm2_path" if request.param == "smollm2" else "gemma3_path")
    # dense: one token alone decodes sparsely, a batch densely, and greedy replies are compared across both
    with launched(path, tmp_path_factory.mktemp("so"), "--parallel", "4", "--sparsity", "0") as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        yield client, client.models.list().data[0].id


def _chat(client, model, prompt, stream=False, **kw):
    args = dict(model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=300)
    args.update(kw)
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **args):
        c = chunk.choices[0]
        text.append(c.delta.content or "")
        finish = c.finish_reason or finish
    return "".join(text), finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_replies_follow_the_json_schema(served, stream):
    client, model = served
    for prompt, schema in CASES:
        text, finish = _chat(client, model, prompt, stream, response_format=_fmt(schema))
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_inside_a_batch_of_four(served):
    """Two constrained and two free sequences decode together: the constrained replies follow
    their schemas, the free ones are not forced into JSON. (Greedy replies are not compared with
    the lone ones: on these models the worker threads' split of the work changes the summation
    order, which flips near-ties; tests/test_batching.py compares them on a deterministic model.)"""
    client, model = served
    jobs = [dict(prompt=CASES[0][0], response_format=_fmt(CITY)), dict(prompt=CASES[1][0], response_format=_fmt(PERSON)),
            dict(prompt="Name three colours.", max_tokens=24), dict(prompt="Say hello.", max_tokens=24, stream=True)]
    out = [None] * 4

    def one(i):
        job = dict(jobs[i])
        out[i] = _chat(client, model, job.pop("prompt"), **job)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for (text, finish), schema in zip(out[:2], (CITY, PERSON)):
        assert finish == "stop"
        jsonschema.validate(json.loads(text), schema)
    for text, finish in out[2:]:
        assert text.strip() and not text.lstrip().startswith("{")


def test_json_object(served):
    client, model = served
    text, finish = _chat(client, model, "Give me a JSON object about a cat.", response_format={"type": "json_object"},
                         max_tokens=400)
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: the start of an object, never claimed complete
        assert finish == "length" and text.lstrip().startswith("{")


def test_cut_by_max_tokens_is_length_not_stop(served):
    client, model = served
    text, finish = _chat(client, model, CASES[0][0], response_format=_fmt(CITY), max_tokens=6)
    assert finish == "length"
    assert text.lstrip().startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_completions_take_schema_regex_and_grammar(served):
    client, model = served

    def complete(prompt, max_tokens=40, **extra):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra)
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = complete("A person, as JSON:", max_tokens=200, response_format=_fmt(PERSON))
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    text, finish = complete("Is the sky blue? Answer:", regex=r" (yes|no)\.")
    assert finish == "stop" and re.fullmatch(r" (yes|no)\.", text), text
    text, finish = complete("My favourite number is", grammar='root ::= " " [1-9] [0-9]? "!"')
    assert finish == "stop" and re.fullmatch(r" [1-9][0-9]?!", text), text
    text, finish = complete("A colour:", json_schema={"type": "string", "enum": ["red", "green", "blue"]})
    assert finish == "stop" and json.loads(text) in ("red", "green", "blue")


@pytest.mark.parametrize("extra, param, says", [
    (dict(response_format=_fmt({"type": "foo"})), "response_format.json_schema.schema", "foo"),
    (dict(response_format=_fmt({"type": "string", "pattern": "(["})), "response_format.json_schema.schema", "regex"),
    (dict(response_format=_fmt({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"],
                                "additionalProperties": False})), "response_format.json_schema.schema", "unsatisfiable"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema", "schema"),
    (dict(response_format={"type": "xml"}), "response_format.type", "json_schema"),
    (dict(regex="[0-9"), "regex", ""),
    (dict(grammar="root ::= ("), "grammar", ""),
    (dict(regex="a", grammar='root ::= "a"'), None, "one constraint"),
    (dict(json_schema=[1, 2]), "json_schema", ""),
])
def test_unusable_constraints_are_400_naming_the_field(served, extra, param, says):
    client, model = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body=extra)
    err = e.value.body
    assert err["param"] == param and says.lower() in err["message"].lower(), err
    assert "Traceback" not in err["message"] and "\n" not in err["message"]


# ---- the grammar's state machine, on the tiny model's tokenizer ----------------------------

@pytest.fixture(scope="module")
def table(tiny_model):
    tk = GGUFTokenizer.from_reader(open_gguf(tiny_model))
    return tk, TokenTable.of(tk, tk.vocab_size)


def test_constraint_allows_each_token_of_a_valid_reply_and_ends_there(table):
    tk, tab = table
    text = json.dumps({"city": "Paris", "population_millions": 2, "landmarks": ["the tower"],
                       "country": {"name": "France", "in_eu": True}})
    c = Constraint(tab, grammar_for(json_schema=CITY))
    logits = np.zeros(tab.n_vocab, np.float32)
    for t in tk.encode(text, add_bos=False, add_eos=False):
        assert not c.complete
        allowed = c.restrict(logits) > -np.inf
        assert allowed[t] and not allowed.all()
        c.accept(t)
    assert c.complete
    assert all(c.restrict(logits)[i] == -np.inf for i in range(tab.n_vocab) if i not in tk.eos_ids)


def test_constraint_refuses_a_forbidden_token(table):
    tk, tab = table
    c = Constraint(tab, grammar_for(regex="[0-9]+"))
    letter = tk.encode("a", add_bos=False, add_eos=False)[0]
    assert c.restrict(np.zeros(tab.n_vocab, np.float32))[letter] == -np.inf
    with pytest.raises(GrammarError):
        c.accept(letter)


def test_text_format_is_no_constraint():
    assert grammar_for(response_format={"type": "text"}) is None
    assert grammar_for() is None
    with pytest.raises(GrammarError, match="characters"):
        grammar_for(regex="a" * 300_000)
