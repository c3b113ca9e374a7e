"""A vLLM server that other hosts may reach, behind a front that asks for a token on every path.

    MTGRPO_VLLM_TOKEN=SECRET python vllm_front.py HOST PORT vllm serve MODEL ...

`run.sh` runs this when MTGRPO_VLLM_HOST is not a loopback address and MTGRPO_VLLM_TOKEN is set. It starts the
command given, bound to 127.0.0.1 on a free port (it appends `--host 127.0.0.1 --port N`), and listens on HOST:PORT.
Every request must carry `Authorization: Bearer SECRET`; any other gets 401 and never reaches vLLM. vLLM's own
`--api-key` guards only /v1, /v2, /inference and /cohere: the dev-mode routes the weight sync needs
(/collective_rpc, /pause, /resume, /update_weights, /init_weight_transfer_engine, /reset_prefix_cache) stay open,
and /collective_rpc can make the server load weights from any path. Replies are passed back whole (no streaming:
the trainer does not stream). The front ends when the server does, with its exit code.
"""

import hmac
import http.client
import http.server
import os
import socket
import subprocess
import sys
import threading

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization"}


class Front(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the trainer's sessions reuse their connections
    token = b""
    upstream = 0  # vLLM's port on 127.0.0.1

    def setup(self):
        super().setup()
        self.upstream_conn = None  # one connection to vLLM per client connection, opened at its first request

    def relay(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))  # read in any case: the connection goes on
        given = self.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, b"Bearer " + self.token):
            self.log_message("refused %s %s: no valid token", self.command, self.path)
            return self.reply(401, [("Content-Type", "application/json")], b'{"error": "Unauthorized"}')
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        try:
            if self.upstream_conn is None:
                self.upstream_conn = http.client.HTTPConnection("127.0.0.1", self.upstream)
            self.upstream_conn.request(self.command, self.path, body, headers)
            answer = self.upstream_conn.getresponse()
            data = answer.read()
        except OSError as e:  # vLLM still starting, or gone: the trainer retries a 5xx
            self.upstream_conn = None
            return self.reply(502, [("Content-Type", "text/plain")], f"vLLM behind the front: {e}".encode())
        kept = [(k, v) for k, v in answer.getheaders() if k.lower() not in HOP_BY_HOP | {"content-length"}]
        self.reply(answer.status, kept, data)

    def reply(self, status: int, headers: list, data: bytes):
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = relay

    def log_message(self, fmt, *args):  # refusals only, to the server's log
        print(f"[vllm_front] {self.client_address[0]}: {fmt % args}", file=sys.stderr, flush=True)


def main(argv: list[str]):
    host, port, command = argv[0], int(argv[1]), argv[2:]
    token = os.environ.get("MTGRPO_VLLM_TOKEN", "")
    if not token:
        sys.exit("vllm_front: error: set MTGRPO_VLLM_TOKEN, the token every request must carry")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        upstream = s.getsockname()[1]
    Front.token = token.encode()
    Front.upstream = upstream
    server = http.server.ThreadingHTTPServer((host, port), Front)
    server.daemon_threads = True
    vllm = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(upstream)])
    print(f"[vllm_front] {host}:{port} asks every request for the token; vLLM on 127.0.0.1:{upstream}", file=sys.stderr)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sys.exit(vllm.wait())


if __name__ == "__main__":
    main(sys.argv[1:])
