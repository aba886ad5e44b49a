"""The OpenAI wire format: request parsing and refusals, the mapping onto SamplingParams, chat
templates, the error handlers, and the response builders (checked against the openai client's types)."""
from __future__ import annotations

import json
import logging
import math

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from loraplex.sampling import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams, TokenLogprobs
from loraplex.server.errors import APIError, error_body, install_error_handlers
from loraplex.server.protocol import (
    MAX_CHOICES,
    MAX_COMPLETION_LOGPROBS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPTS,
    MAX_TOP_LOGPROBS,
    ChatCompletionRequest,
    CompletionRequest,
)
from loraplex.server.translate import chat_prompt, completion_prompt, completion_prompts, sampling_params
from loraplex.server.responses import (
    Choice,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    usage_chunk,
)

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
VOCAB = 320


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "Hello", **fields})


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def params(req, prompt_len: int = 10, max_model_len: int = 100, vocab_size: int = VOCAB) -> SamplingParams:
    return sampling_params(req, prompt_len=prompt_len, max_model_len=max_model_len, vocab_size=vocab_size)


def refused(call, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        call(*args, **kwargs)
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    return info.value


# ---- parsing ------------------------------------------------------------------------------------

def test_completion_request_parses_with_defaults():
    req = completion(unknown_field={"a": 1})
    assert req.model == "m" and req.prompt == "Hello"
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.n) == (16, 1.0, 1.0, None, 1)
    assert not req.stream and not req.echo and not req.ignore_eos and not req.include_usage
    assert req.logprobs is None and req.stop is None and req.logit_bias is None
    assert not hasattr(req, "unknown_field")


@pytest.mark.parametrize("prompt, expected", [
    ("text", "text"), ([5, 6, 7], [5, 6, 7]), (["one"], "one"), ([[8, 9]], [8, 9]), ([], []),
])
def test_completion_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompt == expected


def test_nulls_mean_defaults():
    req = completion(n=None, stream=None, echo=None, ignore_eos=None, temperature=None, top_p=None,
                     max_tokens=None)
    assert (req.n, req.stream, req.echo, req.ignore_eos) == (1, False, False, False)
    c = chat(n=None, logprobs=None, add_generation_prompt=None, stream=None)
    assert (c.n, c.logprobs, c.add_generation_prompt, c.stream) == (1, False, True, False)


def test_chat_request_parses():
    req = ChatCompletionRequest.model_validate({
        "model": "adapter-1", "stream": True, "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "developer", "content": "x", "name": "dev"},
        ],
        "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 3, "tools": [], "tool_choice": "none",
        "response_format": {"type": "text"}, "presence_penalty": 0, "frequency_penalty": 0.0,
    })
    assert req.include_usage and req.requested_max_tokens == 5
    assert [m.text() for m in req.messages] == ["Be brief.", "a\nb", "", "x"]
    assert chat().max_tokens is None and chat().requested_max_tokens is None


def test_include_usage_needs_stream():
    assert not completion(stream_options={"include_usage": True}).include_usage
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage


def test_best_of_equal_to_n_is_accepted():
    assert completion(n=2, best_of=2).best_of == 2


@pytest.mark.parametrize("fields, param, words", [
    ({"prompt": ["a"] * 20, "n": 8}, "n", f"more than {MAX_CHOICES} choices"),
    ({"echo": True}, "echo", "not supported"),
    ({"suffix": "tail"}, "suffix", "not supported"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"frequency_penalty": -1}, "frequency_penalty", "not supported"),
    ({"best_of": 3}, "best_of", "best_of"),
    ({"logprobs": MAX_COMPLETION_LOGPROBS + 1}, "logprobs", "logprobs"),
    ({"logprobs": -1}, "logprobs", "logprobs"),
    ({"n": 0}, "n", "n must be"),
    ({"n": MAX_N + 1}, "n", "n must be"),
])
def test_completion_refusals(fields, param, words):
    error = refused(completion, **fields)
    assert error.param == param
    assert words in error.message


@pytest.mark.parametrize("fields, param, words", [
    ({"messages": []}, "messages", "at least one"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]", "only text content is supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text", "string"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "assistant"),
    ({"logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS + 1}, "top_logprobs", "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"tools": [{"type": "function"}]}, "tools", "not supported"),
    ({"tool_choice": "auto"}, "tool_choice", "not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", "max_tokens"),
    ({"n": MAX_N + 1}, "n", "n must be"),
    ({"presence_penalty": 1.0}, "presence_penalty", "not supported"),
])
def test_chat_refusals(fields, param, words):
    error = refused(chat, **fields)
    assert error.param == param
    assert words in error.message


@pytest.mark.parametrize("make, fields, loc", [
    (completion, {"prompt": 5}, ("prompt",)),
    (completion, {"prompt": [1, "a"]}, ("prompt",)),
    (completion, {"stop": 3}, ("stop",)),
    (completion, {"temperature": "hot"}, ("temperature",)),
    (chat, {"messages": [{"role": "wizard", "content": "x"}]}, ("messages", 0, "role")),
    (chat, {"messages": [{"role": "user", "content": 7}]}, ("messages", 0, "content")),
])
def test_wrong_types_are_one_validation_error(make, fields, loc):
    with pytest.raises(ValidationError) as info:
        make(**fields)
    errors = info.value.errors()
    assert len(errors) == 1 and errors[0]["loc"] == loc


@pytest.mark.parametrize("fields, loc", [
    ({"prompt": [True]}, ("prompt",)),                    # a bool is not a token id
    ({"prompt": [[1, False]]}, ("prompt",)),
    ({"prompt": ["1", 2]}, ("prompt",)),
    ({"prompt": [1.0]}, ("prompt",)),
    ({"stop_token_ids": ["1"]}, ("stop_token_ids", 0)),   # nor is a string
    ({"stop_token_ids": [True]}, ("stop_token_ids", 0)),
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, ("stop_token_ids",)),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, ("stop",)),
    ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, ("logit_bias",)),
    ({"prompt": ["a"] * (MAX_PROMPTS + 1)}, ("prompt",)),
    ({"n": True}, ("n",)),
    ({"max_tokens": True}, ("max_tokens",)),
    ({"seed": False}, ("seed",)),
])
def test_lax_inputs_are_refused(fields, loc):
    with pytest.raises(ValidationError) as info:
        completion(**fields)
    errors = info.value.errors()
    assert len(errors) == 1 and errors[0]["loc"] == loc, errors


def test_list_caps_are_inclusive_and_chat_caps_messages():
    completion(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)), stop=["x"] * MAX_STOP_STRINGS,
               logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS)}, prompt=["a"] * MAX_PROMPTS)
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1))
    with pytest.raises(ValidationError):
        chat(top_logprobs=True, logprobs=True)


def test_batches_of_prompts():
    req = completion(prompt=["a", "b"], n=2)
    assert req.is_batch and req.prompts == ["a", "b"]
    assert completion_prompts(req, vocab_size=VOCAB) == ["a", "b"]
    assert completion_prompts(completion(prompt=[[1, 2], [3]]), vocab_size=VOCAB) == [[1, 2], [3]]
    assert completion(prompt=[[1, 2]]).prompts == [[1, 2]] and not completion(prompt=[1, 2]).is_batch
    error = refused(completion_prompts, completion(prompt=[[1], [2, VOCAB]]), vocab_size=VOCAB)
    assert error.param == "prompt" and "prompt[1][1]" in error.message
    assert "prompt[1] is empty" in refused(completion_prompts, completion(prompt=["a", ""]), vocab_size=VOCAB).message
    with pytest.raises(ValueError):
        completion_prompt(req, vocab_size=VOCAB)
    completion(prompt=["a"] * MAX_PROMPTS, n=MAX_CHOICES // MAX_PROMPTS)


def test_model_is_required():
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x"})


# ---- sampling_params ----------------------------------------------------------------------------

def test_completion_fields_map_onto_sampling_params():
    p = params(completion(max_tokens=20, temperature=0.5, top_p=0.9, top_k=40, seed=7, stop=["x", "yz"],
                          stop_token_ids=[2, 5], ignore_eos=True, logprobs=3))
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (20, 0.5, 0.9, 40, 7)
    assert p.stop == ("x", "yz") and p.stop_token_ids == (2, 5) and p.ignore_eos and p.logprobs == 3


def test_nulls_map_onto_defaults():
    p = params(completion(temperature=None, top_p=None, top_k=None, stop="end"))
    assert (p.temperature, p.top_p, p.top_k, p.stop, p.seed, p.logprobs) == (1.0, 1.0, -1, ("end",), None, None)
    assert params(completion(temperature=0)).greedy


def test_chat_logprobs_mapping():
    assert params(chat()).logprobs is None
    assert params(chat(logprobs=True)).logprobs == 0
    assert params(chat(logprobs=True, top_logprobs=4)).logprobs == 4


def test_chat_max_tokens_either_name_and_default():
    assert params(chat(max_tokens=7)).max_tokens == 7
    assert params(chat(max_completion_tokens=9)).max_tokens == 9
    assert params(chat(), prompt_len=37, max_model_len=100).max_tokens == 63
    # A null max_tokens in completions also means "the rest of the context".
    assert params(completion(max_tokens=None), prompt_len=30, max_model_len=100).max_tokens == 70


def test_context_length_boundary_completions():
    assert params(completion(max_tokens=10), prompt_len=90, max_model_len=100).max_tokens == 10
    error = refused(params, completion(max_tokens=11), prompt_len=90, max_model_len=100)
    assert error.param == "max_tokens"
    assert all(str(n) in error.message for n in (100, 90, 11, 101))


def test_context_length_boundary_chat():
    assert params(chat(max_completion_tokens=1), prompt_len=99, max_model_len=100).max_tokens == 1
    error = refused(params, chat(max_completion_tokens=2), prompt_len=99, max_model_len=100)
    assert error.param == "max_completion_tokens" and "100" in error.message and "99" in error.message


@pytest.mark.parametrize("make, param", [(completion, "prompt"), (chat, "messages")])
def test_prompt_filling_the_context_is_refused(make, param):
    error = refused(params, make(), prompt_len=3000, max_model_len=2048)
    assert error.param == param
    assert "maximum context length is 2048 tokens" in error.message and "3000" in error.message
    assert refused(params, make(), prompt_len=2048, max_model_len=2048).param == param


@pytest.mark.parametrize("make, fields, param", [
    (completion, {"max_tokens": 0}, "max_tokens"),
    (completion, {"max_tokens": -3}, "max_tokens"),
    (chat, {"max_tokens": 0}, "max_tokens"),
    (chat, {"max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_max_tokens_below_one(make, fields, param):
    error = refused(params, make(**fields))
    assert error.param == param and param in error.message


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"stop": [""]}, "stop"),
])
def test_sampling_params_errors_name_the_request_field(fields, param):
    error = refused(params, completion(**fields))
    assert error.param == param
    assert error.message.startswith(param) and "SamplingParams" not in error.message


@pytest.mark.parametrize("ids, bad", [([2, VOCAB], VOCAB), ([-1], -1)])
def test_stop_token_ids_outside_the_vocabulary(ids, bad):
    error = refused(params, completion(stop_token_ids=ids))
    assert error.param == "stop_token_ids" and str(bad) in error.message and str(VOCAB) in error.message


@pytest.mark.parametrize("key", ["abc", "1.5", " 7", "0x10", ""])
def test_logit_bias_keys_must_be_integers(key):
    error = refused(params, completion(logit_bias={key: 1.0}))
    assert error.param == "logit_bias"


@pytest.mark.parametrize("key", [str(VOCAB), "-1", "100000"])
def test_logit_bias_keys_outside_the_vocabulary(key):
    error = refused(params, completion(logit_bias={key: 1.0}))
    assert error.param == "logit_bias" and key in error.message


def test_logit_bias_rejects_non_finite_values_at_parse():
    with pytest.raises(ValidationError):
        completion(logit_bias={"5": math.inf})


def test_logit_bias_maps_to_int_keys():
    assert params(completion(logit_bias={"5": 2.5, "0": -100})).logit_bias == {5: 2.5, 0: -100.0}
    assert params(chat(logit_bias={"7": 1})).logit_bias == {7: 1.0}


def test_logit_bias_value_errors_name_the_field():
    assert refused(params, completion(logit_bias={"5": 101})).param == "logit_bias"


def test_server_side_arguments_are_checked():
    with pytest.raises(ValueError):
        sampling_params(completion(), prompt_len=-1, max_model_len=100, vocab_size=VOCAB)
    with pytest.raises(ValueError):
        sampling_params(completion(), prompt_len=1, max_model_len=100, vocab_size=0)


# ---- prompts ------------------------------------------------------------------------------------

def test_completion_prompt():
    assert completion_prompt(completion(prompt="hi"), vocab_size=VOCAB) == "hi"
    assert completion_prompt(completion(prompt=[0, VOCAB - 1]), vocab_size=VOCAB) == [0, VOCAB - 1]
    error = refused(completion_prompt, completion(prompt=[3, VOCAB]), vocab_size=VOCAB)
    assert error.param == "prompt" and "prompt[1]" in error.message and str(VOCAB) in error.message
    assert "prompt[0]" in refused(completion_prompt, completion(prompt=[-2]), vocab_size=VOCAB).message
    for empty in ("", [], [""], [[]]):
        assert refused(completion_prompt, completion(prompt=empty), vocab_size=VOCAB).param == "prompt"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizer_fixtures import make_tokenizer
    from transformers import AutoTokenizer

    folder = make_tokenizer(tmp_path_factory.mktemp("tok"), "byte_bpe", vocab_size=VOCAB)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture
def chat_tokenizer(tokenizer):
    tokenizer.chat_template = TEMPLATE
    yield tokenizer
    tokenizer.chat_template = None


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_prompt_renders_the_template(chat_tokenizer, add_generation_prompt):
    tok = chat_tokenizer
    req = chat(messages=[{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                      {"type": "text", "text": "world"}]}],
               add_generation_prompt=add_generation_prompt)
    expected = "<|system|>Be brief.\n<|user|>Hello\nworld\n" + ("<|assistant|>" if add_generation_prompt else "")
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nworld"}],
        add_generation_prompt=add_generation_prompt, tokenize=False)
    assert rendered == expected
    assert chat_prompt(req, tok) == tok.encode(expected, add_special_tokens=False)


def test_chat_prompt_without_template(tokenizer):
    assert tokenizer.chat_template is None
    error = refused(chat_prompt, chat(), tokenizer)
    assert "no chat template" in error.message and "/v1/completions" in error.message
    error = refused(chat_prompt, chat(), None)   # no tokenizer at all: said so, not "no template"
    assert "no tokenizer" in error.message and "/v1/completions" in error.message


def test_chat_prompt_template_errors_are_400(chat_tokenizer):
    chat_tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    error = refused(chat_prompt, chat(), chat_tokenizer)
    assert error.param == "messages" and "roles must alternate" in error.message


class _ListTokenizer:
    """apply_chat_template returning a plain list (older transformers) or a dict of input_ids."""

    chat_template = "anything"

    def __init__(self, as_dict: bool) -> None:
        self.as_dict = as_dict
        self.calls = []

    def apply_chat_template(self, conversation, add_generation_prompt, tokenize):
        self.calls.append((conversation, add_generation_prompt, tokenize))
        ids = [4, 5, 6]
        return {"input_ids": ids} if self.as_dict else ids


@pytest.mark.parametrize("as_dict", [False, True])
def test_chat_prompt_handles_both_return_types(as_dict):
    tok = _ListTokenizer(as_dict)
    assert chat_prompt(chat(add_generation_prompt=False), tok) == [4, 5, 6]
    assert tok.calls == [([{"role": "user", "content": "Hello"}], False, True)]


# ---- error handlers -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def complete(req: CompletionRequest):
        return {"prompt": req.prompt}

    @app.get("/quota")
    async def quota():
        raise APIError(429, "too many requests", headers={"Retry-After": "3"})

    @app.get("/boom")
    async def boom():
        raise RuntimeError("secret internal detail")

    return TestClient(app, raise_server_exceptions=False)


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


JSON = {"content-type": "application/json"}


def test_valid_request_goes_through(client):
    assert client.post("/v1/completions", json={"model": "m", "prompt": "x"}).json() == {"prompt": "x"}


@pytest.mark.parametrize("body, words", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'"a string"', "must be a JSON object"),
    (b"null", "must be a JSON object"),
    (b"", "body is missing"),
])
def test_malformed_bodies(client, body, words):
    error = error_of(client.post("/v1/completions", content=body, headers=JSON), 400)
    assert words in error["message"] and error["type"] == "invalid_request_error"


def test_missing_field(client):
    error = error_of(client.post("/v1/completions", json={"prompt": "x"}), 400)
    assert error["param"] == "model" and "body.model" in error["message"]


def test_wrong_type_names_the_field_not_the_value(client):
    response = client.post("/v1/completions", json={"model": "m", "prompt": "x", "temperature": "x" * 5000})
    error = error_of(response, 400)
    assert error["param"] == "temperature" and "body.temperature" in error["message"]
    assert "xxxx" not in response.text and len(response.content) < 600


def test_many_problems_are_counted(client):
    bad = {"model": 1, "prompt": 2, "temperature": "a", "top_p": "b", "n": "c"}
    error = error_of(client.post("/v1/completions", json=bad), 400)
    assert error["message"].count("; ") == 2 and "(and 2 more)" in error["message"]


def test_refusal_from_parsing_is_an_api_error(client):
    error = error_of(client.post("/v1/completions", json={"model": "m", "prompt": "x", "echo": True}), 400)
    assert error["param"] == "echo" and "not supported" in error["message"]


def test_api_error_route(client):
    response = client.get("/quota")
    error = error_of(response, 429)
    assert error["type"] == "rate_limit_error" and error["message"] == "too many requests"
    assert response.headers["retry-after"] == "3"


def test_unknown_route_and_wrong_method(client):
    error = error_of(client.post("/v1/nothing-here", json={}), 404)
    assert error["type"] == "not_found_error" and "/v1/nothing-here" in error["message"]
    error = error_of(client.get("/v1/completions"), 405)
    assert "GET" in error["message"]


def test_unexpected_exception_is_500_without_details(client, caplog):
    with caplog.at_level(logging.ERROR, logger="loraplex.server"):
        response = client.get("/boom")
    error = error_of(response, 500)
    assert error["message"] == "internal server error" and error["type"] == "server_error"
    assert "secret" not in response.text and "Traceback" not in response.text
    assert any(r.name == "loraplex.server" and r.exc_info for r in caplog.records)


def test_error_body_truncates_and_types_by_status():
    body = error_body(400, "y" * 10_000)
    assert len(body["error"]["message"]) <= 500
    expected = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 502: "server_error", 503: "service_unavailable"}
    for status, kind in expected.items():
        assert APIError(status, "x").type == kind == error_body(status, "x")["error"]["type"]
    assert APIError(400, "x", type="custom", code="c").body()["error"] == {
        "message": "x", "type": "custom", "param": None, "code": "c"}
    with pytest.raises(ValueError):
        APIError(200, "not an error")


# ---- responses ----------------------------------------------------------------------------------

def _dumps(obj) -> str:
    return json.dumps(obj, allow_nan=False)  # fails on any -inf / NaN left in


STEPS = [TokenLogprobs(token_id=5, logprob=-0.5, top=[(5, -0.5), (6, -math.inf)]),
         TokenLogprobs(token_id=7, logprob=-math.inf, top=[(8, -1.25), (7, -math.inf)])]


def test_completion_response(tokenizer):
    from openai.types import Completion

    choices = [Choice(0, "ab", [5, 7], "stop", STEPS), Choice(1, "c", [9], "length")]
    out = completion_response("cmpl-1", "m", 1700000000, choices, prompt_tokens=4, tokenizer=None)
    _dumps(out)
    assert out["object"] == "text_completion" and out["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    first = out["choices"][0]
    assert first["logprobs"] == {
        "tokens": ["token_id:5", "token_id:7"], "token_logprobs": [-0.5, -9999.0],
        "top_logprobs": [{"token_id:5": -0.5, "token_id:6": -9999.0}, {"token_id:8": -1.25, "token_id:7": -9999.0}],
        "text_offset": [0, 10]}
    assert out["choices"][1]["logprobs"] is None and out["choices"][1]["finish_reason"] == "length"
    Completion.model_validate(out)
    # With a tokenizer, tokens are its decoded texts.
    texts = completion_response("c", "m", 1, choices[:1], 4, tokenizer)["choices"][0]["logprobs"]["tokens"]
    assert texts == [tokenizer.decode([5]), tokenizer.decode([7])]


def test_chat_response():
    from openai.types.chat import ChatCompletion

    out = chat_response("chatcmpl-1", "m", 1700000000, [Choice(0, "hi", [5, 7], "stop", STEPS)], 3, None)
    _dumps(out)
    assert out["object"] == "chat.completion" and out["usage"]["total_tokens"] == 5
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "hi"}
    content = choice["logprobs"]["content"]
    assert content[1] == {"token": "token_id:7", "logprob": -9999.0, "bytes": list(b"token_id:7"),
                          "top_logprobs": [
                              {"token": "token_id:8", "logprob": -1.25, "bytes": list(b"token_id:8")},
                              {"token": "token_id:7", "logprob": -9999.0, "bytes": list(b"token_id:7")}]}
    ChatCompletion.model_validate(out)


def test_streaming_chunks():
    from openai.types import Completion
    from openai.types.chat import ChatCompletionChunk

    chunk = completion_chunk("c", "m", 5, 1, "ab", None, STEPS, None, text_offset=12)
    assert chunk["object"] == "text_completion" and "usage" not in chunk
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [12, 22] and chunk["choices"][0]["finish_reason"] is None
    _dumps(chunk)
    # The client's type wants a finish_reason (it builds streamed chunks without validating them).
    Completion.model_validate(completion_chunk("c", "m", 5, 1, "", "stop"))

    first = chat_chunk("c", "m", 5, 0, role="assistant", content="")
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = chat_chunk("c", "m", 5, 0, content="x", finish_reason="length", logprobs=STEPS[:1])
    assert last["choices"][0]["delta"] == {"content": "x"} and last["choices"][0]["finish_reason"] == "length"
    assert last["choices"][0]["logprobs"]["content"][0]["token"] == "token_id:5"
    for c in (first, last):
        _dumps(c)
        ChatCompletionChunk.model_validate(c)

    for name in ("text_completion", "chat.completion.chunk"):
        tail = usage_chunk("c", "m", 5, name, 3, 4)
        assert tail["choices"] == [] and tail["usage"] == {"prompt_tokens": 3, "completion_tokens": 4,
                                                           "total_tokens": 7}
    with pytest.raises(ValueError):
        usage_chunk("c", "m", 5, "chat.completion", 3, 4)


def test_finish_reasons():
    assert Choice(0, "", [], "abort").finish_reason == "abort"
    assert chat_chunk("c", "m", 1, 0, finish_reason="error")["choices"][0]["finish_reason"] == "error"
    with pytest.raises(ValueError):
        Choice(0, "", [], "eos")
    with pytest.raises(ValueError):
        completion_chunk("c", "m", 1, 0, "", "done")
