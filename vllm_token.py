"""A vLLM server that other hosts may reach asks every request for a token, inside vLLM's own app.

    MTGRPO_VLLM_TOKEN=SECRET vllm serve MODEL --host 0.0.0.0 --middleware vllm_token.TokenCheck   (this folder on
    PYTHONPATH)

`run.sh` adds `--middleware vllm_token.TokenCheck` when MTGRPO_VLLM_HOST is not a loopback address and
MTGRPO_VLLM_TOKEN is set. vLLM's own `--api-key` guards only /v1, /v2, /inference and /cohere: the dev-mode routes the
weight sync needs (/collective_rpc, /pause, /resume, /update_weights, /init_weight_transfer_engine,
/reset_prefix_cache) stay open with it, and /collective_rpc can make the server load weights from any path. This
middleware wraps the whole app instead (it is added last, so it runs first): every HTTP request and websocket, to any
path, must carry `Authorization: Bearer SECRET`; any other gets 401 (a websocket is closed) and never reaches a route.
It runs in vLLM's server process, so a request takes no second hop and streams as vLLM streams it; an earlier relay in
front of vLLM (a standard-library server) dropped connections under load.
"""

import hmac
import os


class TokenCheck:
    """ASGI middleware: a request without `Authorization: Bearer $MTGRPO_VLLM_TOKEN` is answered 401 here."""

    def __init__(self, app):
        token = os.environ.get("MTGRPO_VLLM_TOKEN", "")
        if not token:
            raise RuntimeError("vllm_token.TokenCheck: set MTGRPO_VLLM_TOKEN, the token every request must carry")
        self.app = app
        self.expected = b"Bearer " + token.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):  # lifespan: the app's start and stop
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})  # policy violation
        body = b'{"error": "Unauthorized"}'
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
