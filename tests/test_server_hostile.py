"""A real server against the single requests that killed a stage (issue 18): each gets a
clean OpenAI-shaped error (or a real answer), the server stays ready, and a normal request
beside it still gets its reference answer. Also: request ids are safe (an id is never left
registered, and a client-chosen id is scoped to its caller)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from server_process import ServerProcess

CANARY = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess("--model", tiny_llama, "--max-num-batched-tokens", "256")
    yield srv
    assert srv.stop() == 0


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=120, **kw)


@pytest.fixture(scope="module")
def reference(server):
    r = post(server, "/v1/completions", CANARY)
    assert r.status_code == 200
    return r.json()["choices"][0]["text"]


def shaped(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


KILLERS = {
    # killed the tokenizer
    "template-bos": ("/v1/chat/completions", {"messages": HI,
                                              "chat_template_kwargs": {"bos_token": "x"}}),
    "template-messages": ("/v1/chat/completions", {"messages": HI,
                                                   "chat_template_kwargs": {"messages": []}}),
    # killed the scheduler
    "json-stop-outside-vocab": ("/v1/chat/completions", {
        "messages": HI, "response_format": {"type": "json_object"}, "stop_token_ids": [600]}),
    "json-stop-63-bits": ("/v1/chat/completions", {
        "messages": HI, "response_format": {"type": "json_object"},
        "stop_token_ids": [2 ** 63 + 5]}),
    # killed the detokenizer
    "megabyte-stop": ("/v1/completions", {"prompt": "hi", "stop": ["ab" * (1 << 19)]}),
    # left the request id registered forever
    "seed-64-bits": ("/v1/completions", {"prompt": "hi", "seed": 2 ** 64,
                                         "request_id": "seedy"}),
}


@pytest.mark.parametrize("name", list(KILLERS))
def test_a_killer_request_is_answered_and_the_engine_goes_on(server, reference, name):
    path, body = KILLERS[name]

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            canary = http.post(server.url + "/v1/completions", json=CANARY)
            hostile = http.post(server.url + path, json={"max_tokens": 4, **body})
            return await asyncio.gather(canary, hostile)

    canary, hostile = asyncio.run(run())
    assert hostile.status_code < 500, hostile.text
    if hostile.status_code != 200:
        shaped(hostile)
    assert httpx.get(server.url + "/ready").status_code == 200
    assert canary.status_code == 200 and canary.json()["choices"][0]["text"] == reference
    again = post(server, "/v1/completions", CANARY)
    assert again.json()["choices"][0]["text"] == reference


def test_the_template_override_names_its_field(server):
    _path, body = KILLERS["template-bos"]
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and shaped(r)["param"] == "chat_template_kwargs"


def test_a_grammar_that_matches_nothing_is_a_400(server, reference):
    body = {"prompt": "Go:", "max_tokens": 4,
            "response_format": {"type": "regex", "regex": "[^\\x00-\\U0010FFFF]"}}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = shaped(r)
    assert err["param"] == "response_format" and "can match no text" in err["message"]
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as s:
        assert s.status_code == 400  # refused before the stream started
    assert post(server, "/v1/completions", CANARY).json()["choices"][0]["text"] == reference


def test_a_failed_encode_leaves_the_id_free(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "seed": 2 ** 64, "request_id": "r1"})
    assert r.status_code == 400
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "request_id": "r1"})
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "r1"


# ---------------------------------------------------------------- scoped request ids


async def _first_chunk_then(server, rid: str, auth: str, during):
    """Stream a long request as ``auth``; after its first chunk run ``during``; return
    the finish reasons of its choices and what ``during`` returned."""
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", server.url + "/v1/completions",
                               headers={"Authorization": auth}, json={
                                   "prompt": "go on", "max_tokens": 300, "ignore_eos": True,
                                   "stream": True, "request_id": rid}) as r:
            assert r.status_code == 200 and r.headers["X-Request-Id"] == rid
            finishes, seen = [], None
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                if choice["finish_reason"]:
                    finishes.append(choice["finish_reason"])
                elif seen is None:
                    seen = await during(http)
            return finishes, seen


def test_another_caller_cannot_cancel_or_squat_an_id(server):
    async def during(http):
        other = await http.delete(server.url + "/v1/requests/mine",
                                  headers={"Authorization": "Bearer bob"})
        anonymous = await http.delete(server.url + "/v1/requests/mine")
        # another caller may use the same label at the same time...
        squat = await http.post(server.url + "/v1/completions",
                                headers={"Authorization": "Bearer bob"},
                                json={"prompt": "hi", "max_tokens": 2, "request_id": "mine"})
        # ...but the same caller may not
        twice = await http.post(server.url + "/v1/completions",
                                headers={"Authorization": "Bearer alice"},
                                json={"prompt": "hi", "max_tokens": 2, "request_id": "mine"})
        own = await http.delete(server.url + "/v1/requests/mine",
                                headers={"Authorization": "Bearer alice"})
        return other, anonymous, squat, twice, own

    finishes, (other, anonymous, squat, twice, own) = asyncio.run(
        _first_chunk_then(server, "mine", "Bearer alice", during))
    assert other.status_code == 404 and shaped(other)["code"] == "not_found"
    assert anonymous.status_code == 404
    assert squat.status_code == 200 and squat.json()["id"] == "cmpl-mine"
    assert twice.status_code == 409 and shaped(twice)["code"] == "request_id_in_use"
    assert own.status_code == 200
    assert finishes == ["abort"]
