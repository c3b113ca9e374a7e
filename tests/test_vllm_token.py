"""vllm_token.TokenCheck, the ASGI middleware run.sh loads into vLLM's app for a server other hosts reach: only a
request with the token reaches the app, on every path and for websockets too. (In the real vLLM server, from a second
host: test_real_vllm::test_a_server_for_other_hosts_*.)"""

import asyncio

import pytest

import vllm_token


def call(middleware, scope):
    """What the middleware sends for one request, and whether the app behind it was reached."""
    sent = []
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    asyncio.run(middleware(app)(scope, receive, send))
    return sent, reached


def request(kind="http", path="/collective_rpc", authorization=None):
    headers = [(b"host", b"10.0.0.7:8000")]
    if authorization is not None:
        headers.append((b"authorization", authorization))
    return {"type": kind, "path": path, "headers": headers}


def test_only_a_request_with_the_token_reaches_vllm(monkeypatch):
    monkeypatch.setenv("MTGRPO_VLLM_TOKEN", "s3cret")
    for path in ("/collective_rpc", "/pause", "/health", "/v1/completions", "/metrics"):
        for given in (None, b"Bearer wrong", b"s3cret", b"Bearer s3cret2", b"bearer s3cret"):
            sent, reached = call(vllm_token.TokenCheck, request(path=path, authorization=given))
            assert not reached and sent[0]["status"] == 401, (path, given)
            assert sent[1]["body"] == b'{"error": "Unauthorized"}'
        sent, reached = call(vllm_token.TokenCheck, request(path=path, authorization=b"Bearer s3cret"))
        assert reached == [path] and sent[0]["status"] == 200
    sent, reached = call(vllm_token.TokenCheck, request("websocket", "/v1/realtime"))
    assert not reached and sent == [{"type": "websocket.close", "code": 1008}]
    sent, reached = call(vllm_token.TokenCheck, {"type": "lifespan", "path": "startup", "headers": []})
    assert reached == ["startup"], "the app's start and stop are not requests"


def test_without_a_token_the_server_does_not_start(monkeypatch):
    monkeypatch.delenv("MTGRPO_VLLM_TOKEN", raising=False)
    with pytest.raises(RuntimeError, match="set MTGRPO_VLLM_TOKEN"):
        vllm_token.TokenCheck(None)
