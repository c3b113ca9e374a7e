"""A stand-in for a vLLM 0.32 OpenAI-compatible server (`VLLM_SERVER_DEV_MODE=1 vllm serve`), for tests and
benchmarks of HTTP clients. Standard-library HTTP; completions and logprobs come from a real (tiny) HF model.

    with StandinServer(model_dir) as srv:        # or: python tests/vllm_standin.py --model DIR --port 8000
        requests.post(srv.url + "/v1/completions", json={...})

What each part mirrors (paths inside the vllm-0.33.0 wheel, under `vllm/`; tests/test_real_vllm.py checks the
answers against the real 0.32 CPU build, the version run.sh pins, which has no `weight_versions`):
- GET /health: entrypoints/serve/instrumentator/health.py (200; 503 with an empty body when the engine is dead).
- GET /v1/models: entrypoints/openai/models/{api_router,serving}.py; ModelCard in entrypoints/serve/engine/protocol.py.
- POST /v1/completions: entrypoints/openai/completion/{api_router,protocol,serving}.py (request fields and their
  validators, response fields); entrypoints/generate/base/protocol.py (cache_salt rules, at most 4 stop strings);
  renderers/params.py (context-length checks) and entrypoints/serve/utils/api_utils.py (get_max_tokens: a prompt
  plus max_tokens beyond max_model_len is *clamped*, not refused); sampling_params.py (parameter checks);
  v1/engine/input_processor.py + renderers/base.py (empty prompt, out-of-vocabulary ids); v1/core/sched/utils.py
  and v1/engine/detokenizer.py (stop tokens and stop strings: what token_ids and text keep).
- Errors: entrypoints/serve/exception_handling/ -> {"error": {message, type, param, code}}; request-validation
  errors have type "Bad Request", serving errors "BadRequestError"/"NotFoundError"/...; messages go through
  sanitize_message (paths become "<path>"). An unknown route gets FastAPI's {"detail": "Not Found"}.
- Dev mode only (entrypoints/launchers/api_server/routers.py): /pause /resume /is_paused /get_world_size and the
  weight-transfer routes (entrypoints/rl/online/api_router.py; worker side v1/worker/gpu_worker.py and
  distributed/weight_transfer/{base,nccl_engine,nccl_common}.py), /collective_rpc (entrypoints/serve/dev/rpc/
  api_router.py; a worker exception reaches the client as 500 "Call to collective_rpc method failed: ..." per
  v1/engine/core.py), /reset_prefix_cache (entrypoints/serve/dev/cache/api_router.py). reload_weights follows
  v1/worker/gpu_model_runner.py and model_executor/model_loader/{reload/inplace,default_loader}.py. While paused
  in abort|wait mode new completions get 503 (v1/engine/core.py _reject_add_while_paused).

Simplifications: logprobs are those of the sampling distribution (like `--logprobs-mode processed_logprobs`) and
top_logprobs holds only the sampled token; no streaming, chat, prefix cache or NCCL; /pause does not interrupt a
batch already running (its requests still come back as "abort"); pydantic messages are approximations (status,
type and param are exact); a `backend=` callable runs in each request's own thread and produces no text.
"""

import argparse, contextlib, dataclasses, glob, hashlib, json, os, re, socket, sys, threading, time, uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_STOP_STRINGS, MAX_PROMPTS, MAX_LOGPROBS = 4, 1024, 20  # envs.py, config/model.py defaults
DEFAULTS = {
    "n": 1,
    "max_tokens": 16,
    "seed": None,
    "logprobs": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "ignore_eos": False,
    "return_token_ids": False,
    "return_tokens_as_token_ids": False,
    "prompt_logprobs": None,
    "add_special_tokens": True,
}


def sanitize_message(m: str) -> str:
    """entrypoints/serve/exception_handling/utils.py: no addresses, tracebacks or file paths reach the client."""
    m = re.sub(r" at 0x[0-9a-fA-F]+>", ">", m)
    m = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", m)
    m = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", m)
    return re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", m).strip()


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self):
        if self.status == 503 and not self.message:  # /health: a bare status
            return None
        return {
            "error": {
                "message": sanitize_message(self.message),
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


def invalid(msg: str, param: str | None = None, value=None) -> ApiError:
    """A VLLMValidationError raised while serving; its str() appends "(parameter=..., value=...)"."""
    extras = [f"parameter={param}"] * (param is not None) + [f"value={value}"] * (value is not None)
    return ApiError(400, f"{msg} ({', '.join(extras)})" if extras else msg, "BadRequestError", param)


def request_invalid(errors: list, param: str | None) -> ApiError:
    """A FastAPI RequestValidationError, worded as vLLM's handler does (handlers/validation.py)."""
    label = "error" if len(errors) == 1 else "errors"
    return ApiError(
        400, f"{len(errors)} validation {label}:\n" + "\n".join(f"  {e}" for e in errors), "Bad Request", param
    )


def validator_error(msg: str, param: str, body: dict, value=None) -> ApiError:
    """A CompletionRequest model_validator(mode="before") that raised VLLMValidationError: vLLM 0.32 answers it as a
    plain BadRequestError, not wrapped in a validation-error list (checked against the real server)."""
    return invalid(msg, param, value)


def field_error(name: str, kind: str, msg: str, value) -> ApiError:
    shown = f"<{type(value).__name__} of {len(value)} items>" if isinstance(value, (list, dict)) else value
    return request_invalid([{"type": kind, "loc": f"body.{name}", "msg": msg, "input": shown}], f"body.{name}")


def rpc_failed(msg: str) -> ApiError:
    """A worker method raised: EngineCore hands the API server a plain Exception, hence 500 (wording of vLLM 0.32)."""
    return ApiError(
        500,
        f"Call to collective_rpc method failed: Worker failed with error '{msg}', please check the "
        "stack trace above for the root cause",
        "InternalServerError",
    )


@dataclasses.dataclass(kw_only=True)
class NCCLWeightTransferInitInfo:  # as in nccl_common.py, so that TypeErrors read the same
    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int
    world_size: int
    nccl_unique_id_b64: str | None = None
    packed: bool = False
    packed_buffer_size_bytes: int = 1024**3
    packed_num_buffers: int = 2


@dataclasses.dataclass
class NCCLWeightTransferUpdateInfo:  # nccl_engine.py: `packed` moved to init_info in 0.28
    names: list = dataclasses.field(default_factory=list)
    dtype_names: list = dataclasses.field(default_factory=list)
    shapes: list = dataclasses.field(default_factory=list)


class Faults:
    """Fault injection, changeable while serving. fail/drop count the next K POST /v1/completions; the
    response-mangling kinds count the next K successful completion responses."""

    KINDS = ("fail", "drop", "malformed", "omit_token_ids", "omit_logprobs", "omit_prompt_logprobs", "bad_token")

    def __init__(self):
        self._lock, self._slots, self._busy = threading.Lock(), threading.Condition(), 0
        self.gate = threading.Event()  # cleared by hold(): completion requests wait at it, counted in busy()
        self.clear()

    def clear(self):
        with self._lock:
            self._left = dict.fromkeys(self.KINDS, 0)
            self.fail_status, self.latency_s, self.capacity, self.engine_dead = 500, 0.0, 0, False
        self.gate.set()

    def set_latency(self, seconds: float, capacity: int = 0):
        """`seconds` added to every completion request. With `capacity`, at most that many sequences (n per request)
        wait them out at once and the rest queue: an engine that runs so many at a time (vLLM's max_num_seqs)."""
        self.latency_s, self.capacity = float(seconds), capacity

    def hold(self):
        """From now on every completion request waits (occupying its sequences) until release(): a test waits for an
        event (busy() reaching a count) instead of a time."""
        self.gate.clear()

    def release(self):
        self.gate.set()

    def busy(self) -> int:
        """Sequences waiting out the latency or held at the gate right now."""
        with self._slots:
            return self._busy

    @contextlib.contextmanager
    def occupying(self, n: int):
        """n sequences of the capacity, for the block (one request larger than the capacity runs alone)."""
        with self._slots:
            self._slots.wait_for(lambda: not self.capacity or self._busy == 0 or self._busy + n <= self.capacity)
            self._busy += n
        try:
            yield
        finally:
            with self._slots:
                self._busy -= n
                self._slots.notify_all()

    def set_engine_dead(self, dead: bool = True):
        self.engine_dead = dead  # /health 503, completions 500

    def fail_next(self, k=1, status=500):
        self.fail_status = status
        self._add("fail", k)  # a 5xx error body

    def drop_next(self, k=1):
        self._add("drop", k)  # close the socket, no response at all

    def malformed_next(self, k=1):
        self._add("malformed", k)  # 200 with a truncated JSON body

    def omit_token_ids_next(self, k=1):
        self._add("omit_token_ids", k)  # null, as if return_token_ids were misspelt

    def omit_logprobs_next(self, k=1):
        self._add("omit_logprobs", k)  # logprobs null

    def omit_prompt_logprobs_next(self, k=1):
        self._add("omit_prompt_logprobs", k)  # prompt_logprobs null where asked for (a proxy that drops the field)

    def bad_token_next(self, k=1):
        self._add("bad_token", k)  # a token id == vocab size in token_ids

    def left(self, kind: str) -> int:
        return self._left[kind]

    def _add(self, kind, k):
        with self._lock:
            self._left[kind] += k

    def take(self, kind: str) -> bool:
        with self._lock:
            hit = self._left[kind] > 0
            self._left[kind] -= hit
            return hit


class _Job:
    """One completion request for the engine thread: its prompts, each to be sampled n times."""

    def __init__(self, prompts, max_tokens, r):
        self.prompts, self.max_tokens, self.n, self.params = prompts, max_tokens, r["n"], r
        self.key = (
            r["temperature"],
            r["top_p"],
            tuple(r["stop"]),
            r["ignore_eos"],
            None if r["seed"] is None else id(self),
        )  # a seeded request is sampled on its own
        self.done, self.aborted, self.result = threading.Event(), False, None


class _Drop(Exception):
    pass


class _HTTPServer(ThreadingHTTPServer):
    request_queue_size = 1024  # listen backlog: hundreds of clients connect at once
    daemon_threads = True


class StandinServer:
    def __init__(
        self,
        model_dir=None,
        *,
        backend=None,
        vocab_size=None,
        max_model_len=None,
        served_model_name=None,
        port=0,
        dev_mode=True,
        weight_transfer=False,
        batch_window_s=0.005,
        max_num_seqs=256,
        seed=0,
    ):
        if (model_dir is None) == (backend is None):
            raise ValueError("give exactly one of model_dir and backend")
        self.model_dir, self.backend, self.port, self.weight_transfer = model_dir, backend, port, weight_transfer
        self.batch_window_s, self.max_num_seqs = batch_window_s, max_num_seqs
        self.model = self.tok = self.sampler = None
        if model_dir is not None:
            from transformers import AutoModelForCausalLM, AutoTokenizer
            from mt_grpo_trainer import LocalSampler

            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            self.tok = AutoTokenizer.from_pretrained(model_dir)
            self.sampler = LocalSampler(self.model, self.tok)
            vocab_size = self.model.config.vocab_size
            max_model_len = max_model_len or self.model.config.max_position_embeddings
            # EOS ids of generation_config other than the tokenizer's act as stop_token_ids (sampling_params.py)
            self.eos_id, self.extra_eos = self.tok.eos_token_id, self.sampler.eos_ids - {self.tok.eos_token_id}
        if not vocab_size or not max_model_len:
            raise ValueError("a backend callable needs vocab_size and max_model_len")
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.max_token_id = max(vocab_size, len(self.tok) if self.tok else 0) - 1  # renderers/base.py
        self.served_model_name = served_model_name or model_dir or "standin"
        self.fingerprint = "vllm-0.32.0-" + hashlib.sha256(self.served_model_name.encode()).hexdigest()[:8]
        self.faults, self.requests, self.weight_transfer_calls = Faults(), [], []
        self.replies = []  # every /v1/completions response body sent, as sent (after any fault mangled it)
        self.reloads, self.last_weights_path, self.prefix_cache_resets, self.model_broken = 0, None, 0, False
        self.weights_path, self.weight_version = model_dir, "default"
        self.engine_batches, self.batch_sizes = 0, []
        self._lock, self._cv, self._model_lock = threading.Lock(), threading.Condition(), threading.Lock()
        self._pending, self._running, self._pause_mode, self._stopping = [], [], None, False
        self._wt = {"initialized": False, "active": False}
        self._generator = torch.Generator().manual_seed(seed)
        self._httpd, self._threads = None, []
        self._routes = {
            ("GET", "/health"): self._health,
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/completions"): self._completions,
        }
        if dev_mode:
            self._routes.update(
                {
                    ("POST", "/pause"): self._pause,
                    ("POST", "/resume"): self._resume,
                    ("GET", "/is_paused"): lambda b, q: {"is_paused": self._pause_mode is not None},
                    ("POST", "/collective_rpc"): self._collective_rpc,
                    ("POST", "/reset_prefix_cache"): self._reset_prefix_cache,
                    ("GET", "/get_world_size"): lambda b, q: {"world_size": 1},
                }
            )
            for name in (
                "init_weight_transfer_engine",
                "start_weight_update",
                "update_weights",
                "finish_weight_update",
            ):
                self._routes[("POST", "/" + name)] = lambda b, q, name=name: self._weight_transfer(name, b)

    # ------------------------------------------------------------------ lifecycle
    def start(self):
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn
            disable_nagle_algorithm = True  # TCP_NODELAY, as uvicorn: no 40 ms delayed-ACK stall per reply

            def do_GET(self):
                standin._dispatch(self, "GET")

            def do_POST(self):
                standin._dispatch(self, "POST")

            def log_message(self, *args):
                pass

        self._httpd = _HTTPServer(("127.0.0.1", self.port), Handler)
        self._threads = [threading.Thread(target=self._httpd.serve_forever, daemon=True, name="standin-http")]
        if self.sampler is not None:
            self._threads.append(threading.Thread(target=self._engine_loop, daemon=True, name="standin-engine"))
        for t in self._threads:
            t.start()
        return self

    def stop(self):
        with self._cv:
            self._stopping = True
            for job in self._pending:  # release request threads still waiting
                job.result = RuntimeError("server stopped")
                job.done.set()
            self._cv.notify_all()
        if self._httpd:
            self._httpd.shutdown()
            self._httpd.server_close()
        for t in self._threads:
            t.join(timeout=10)

    __enter__ = start

    def __exit__(self, *exc):
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def pending(self) -> int:
        """Requests queued for the engine (e.g. held by /pause?mode=keep)."""
        return len(self._pending)

    # ------------------------------------------------------------------ HTTP plumbing
    def _dispatch(self, h, method):
        url = urlsplit(h.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        raw = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        with self._lock:
            self.requests.append(
                {
                    "method": method,
                    "path": url.path,
                    "query": query,
                    "body": body,
                    "time": time.time(),
                    "cache_salt": body.get("cache_salt") if isinstance(body, dict) else None,
                }
            )
        route, status = self._routes.get((method, url.path)), 200
        try:
            if route is None:
                known = any(path == url.path for _, path in self._routes)
                status, payload = (405, {"detail": "Method Not Allowed"}) if known else (404, {"detail": "Not Found"})
            elif route == self._completions:
                payload = self._completions(body, h.headers.get("Content-Type", ""))
                with self._lock:
                    self.replies.append(payload)
            else:
                payload = route(body, query)
        except ApiError as e:
            status, payload = e.status, e.body()
        except _Drop:  # no response: the client sees the connection close
            h.close_connection = True
            try:
                h.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        data = payload if isinstance(payload, bytes) else b"" if payload is None else json.dumps(payload).encode()
        h.send_response(status)
        if payload is not None:
            h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _health(self, body, query):
        if self.faults.engine_dead:
            raise ApiError(503, "")
        return None

    def _models(self, body, query):
        now = int(time.time())
        perm = {
            "id": f"modelperm-{uuid.uuid4().hex}",
            "object": "model_permission",
            "created": now,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "object": "list",
            "data": [
                {
                    "id": self.served_model_name,
                    "object": "model",
                    "created": now,
                    "owned_by": "vllm",
                    "root": self.model_dir or self.served_model_name,
                    "parent": None,
                    "max_model_len": self.max_model_len,
                    "permission": [perm],
                }
            ],
        }

    # ------------------------------------------------------------------ /v1/completions
    def _completions(self, body, content_type):
        if self.faults.latency_s > 0 or not self.faults.gate.is_set():  # holding no lock: requests overlap
            with self.faults.occupying(int(body.get("n") or 1) if isinstance(body, dict) else 1):
                self.faults.gate.wait(timeout=600)  # held by hold(); the timeout only ends a test that never releases
                time.sleep(self.faults.latency_s)
        if self.faults.take("drop"):
            raise _Drop()
        if self.faults.take("fail"):
            s = HTTPStatus(self.faults.fail_status)
            raise ApiError(
                int(s),
                *{
                    500: ("Internal server error", "InternalServerError"),
                    503: ("Request failed; please retry", "ServiceUnavailableError"),
                }.get(s, (s.phrase, s.phrase.replace(" ", "") + "Error")),
            )
        # Checks in vLLM's order: request validation, served model, engine, renderer, SamplingParams, input processor.
        if content_type.split(";")[0].strip().lower() != "application/json":
            raise request_invalid(["Unsupported Media Type: Only 'application/json' is allowed"], None)
        r, prompts = self._parse(body)
        if r["model"] and r["model"] != self.served_model_name:
            raise ApiError(
                404,
                f"The model `{r['model']}` does not exist. Valid aliases: {self.served_model_name}.",
                "NotFoundError",
                "model",
            )
        if self.faults.engine_dead or self.model_broken:
            self.faults.engine_dead = True  # vLLM 0.32: the first forward after a failed reload kills the engine
            raise ApiError(
                500,
                "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                "InternalServerError",
            )
        if r["max_tokens"] > self.max_model_len:
            raise invalid(
                f"max_tokens={r['max_tokens']} cannot be greater than max_model_len={self.max_model_len}. "
                "Please request fewer output tokens.",
                "max_tokens",
                r["max_tokens"],
            )
        if not prompts:  # renderers/base.py render_prompts
            raise invalid("You must pass at least one prompt")
        if any(isinstance(p, str) for p in prompts) and self.tok is None:
            raise invalid("Text prompts need a tokenizer; this stand-in runs a backend callable", "prompt")
        prompts = [
            self.tok.encode(p, add_special_tokens=r["add_special_tokens"]) if isinstance(p, str) else p for p in prompts
        ]
        for p in prompts:
            if len(p) > self.max_model_len:
                raise invalid(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                    f"prompt contains {len(p)} input tokens, which exceeds this limit even without any "
                    "output tokens. Please reduce the length of the input prompt.",
                    "input_tokens",
                    len(p),
                )
        max_tokens = [min(self.max_model_len - len(p), r["max_tokens"]) for p in prompts]
        self._check_sampling(r, max_tokens, prompts)
        outs, aborted = [], False
        if self.backend is not None:
            outs = [
                [self.backend(list(p), dict(r, max_tokens=m)) for _ in range(r["n"])]
                for p, m in zip(prompts, max_tokens)
            ]
        elif prompts:
            job = _Job(prompts, max_tokens, r)
            with self._cv:
                if self._pause_mode in ("abort", "wait"):
                    raise ApiError(
                        503, "Generation is paused. Please retry after it resumes.", "ServiceUnavailableError"
                    )
                self._pending.append(job)
                self._cv.notify_all()
            job.done.wait()
            if isinstance(job.result, Exception):
                raise ApiError(500, "Internal server error", "InternalServerError")
            outs, aborted = job.result, job.aborted
        r["prompt_lps"] = [self._prompt_logprobs(p) for p in prompts] if r["prompt_logprobs"] is not None else None
        payload = self._response(r, prompts, outs, aborted)
        if self.faults.take("malformed"):
            data = json.dumps(payload).encode()
            return data[: len(data) // 2]  # correctly framed, but not JSON
        return payload

    def _parse(self, body):
        """CompletionRequest's field types and model validators (entrypoints/openai/completion/protocol.py)."""
        if not isinstance(body, dict):
            raise request_invalid(
                [
                    {
                        "type": "model_attributes_type",
                        "loc": "body",
                        "msg": "Input should be a valid dictionary or object to extract fields from",
                    }
                ],
                "body",
            )
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise validator_error("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt", body)
        if salt is not None and (len(salt) > 128 or any(c in "@/\\\x00" for c in salt)):
            raise validator_error(
                "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL.",
                "cache_salt",
                body,
            )
        lp = body.get("logprobs")
        if lp is not None and (not isinstance(lp, (int, float)) or (lp < 0 and lp != -1)):
            what = "an integer" if not isinstance(lp, (int, float)) else "a positive value or -1"
            raise validator_error(f"`logprobs` must be {what}.", "logprobs", body, lp)
        prompt = body.get("prompt")
        if prompt is None or prompt == "":
            raise validator_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt", body)
        is_id = lambda x: isinstance(x, int) and not isinstance(x, bool) or isinstance(x, float) and x.is_integer()
        if isinstance(prompt, list) and all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in prompt):
            for i, t in enumerate(prompt):  # pydantic names the first item that is no token id
                if not is_id(t):
                    raise field_error(
                        f"prompt.{i}",
                        "int_from_float",
                        "Input should be a valid integer, got a number with a fractional part",
                        t,
                    )
                if t < 0:
                    raise field_error(
                        f"prompt.{i}", "greater_than_equal", "Input should be greater than or equal to 0", t
                    )
        if isinstance(prompt, str) or isinstance(prompt, list) and prompt and all(is_id(t) for t in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and (
            all(isinstance(p, str) for p in prompt)
            or all(isinstance(p, list) and all(is_id(t) for t in p) for p in prompt)
        ):
            prompts = prompt
            if len(prompts) > MAX_PROMPTS:
                raise validator_error(
                    f"prompt list length {len(prompts)} exceeds the maximum allowed count of "
                    f"{MAX_PROMPTS}. To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS "
                    "environment variable.",
                    "prompt",
                    body,
                )
        else:
            raise field_error(
                "prompt",
                "union_error",
                "Input should be a list of token ids, a list of such lists, a string or a list of strings",
                prompt,
            )
        prompts = [p if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        if any(not isinstance(p, str) and p and min(p) < 0 for p in prompts):
            raise field_error("prompt", "greater_than_equal", "Input should be greater than or equal to 0", prompt)
        r = {"model": body.get("model")}
        for name, default in DEFAULTS.items():  # pydantic's lax mode: true is 1, 2.0 is 2
            v = body.get(name)
            kind = type(default) if default is not None else int
            ok = v is None or (
                isinstance(v, bool)
                if kind is bool
                else isinstance(v, (int, float)) and (kind is float or float(v).is_integer())
            )
            if not ok:
                raise field_error(name, f"{kind.__name__}_parsing", f"Input should be a valid {kind.__name__}", v)
            r[name] = default if v is None else kind(v)  # `max_tokens: null` means 16
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise field_error("stop", "list_type", "Input should be a valid list", stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise field_error(
                "stop",
                "too_long",
                f"List should have at most {MAX_STOP_STRINGS} items after validation, not {len(stop)}",
                stop,
            )
        stop_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(is_id(t) for t in stop_ids):
            raise field_error("stop_token_ids", "list_type", "Input should be a valid list of integers", stop_ids)
        r.update(
            stop=stop,
            stop_token_ids=[int(t) for t in stop_ids],
            cache_salt=salt,
            request_id=str(body.get("request_id") or uuid.uuid4().hex),
        )
        return r, prompts

    def _check_sampling(self, r, max_tokens, prompts):
        """SamplingParams._verify_args (sampling_params.py), then the engine's input checks."""
        t, lp = r["temperature"], r["logprobs"]
        if r["n"] < 1:
            raise invalid(f"n must be at least 1, got {r['n']}.")
        if not 0 <= t <= 2:
            raise invalid(f"temperature must be {'non-negative' if t < 0 else 'in [0, 2]'}, got {t}.", "temperature", t)
        if not 0.0 < r["top_p"] <= 1.0:
            raise invalid(f"top_p must be in (0, 1], got {r['top_p']}.", "top_p", r["top_p"])
        for m in max_tokens:
            if m < 1:  # prompt_len == max_model_len leaves no room
                raise invalid(f"max_tokens must be at least 1, got {m}.", "max_tokens", m)
        if t < 1e-5 and r["n"] > 1:
            raise invalid(f"n must be 1 when using greedy sampling, got {r['n']}.")
        for p in prompts:
            if not p:
                raise invalid("The decoder prompt cannot be empty")
            if lp and (self.vocab_size if lp == -1 else lp) > MAX_LOGPROBS:
                k = self.vocab_size if lp == -1 else lp
                raise invalid(
                    f"Requested sample logprobs of {k}, which is greater than max allowed: {MAX_LOGPROBS}",
                    "logprobs",
                    k,
                )
            if min(p) < 0 or max(p) > self.max_token_id:
                raise invalid(f"Token id {max(p)} is out of vocabulary")

    def _finish(self, ids, lps, finish_reason, r):
        """Stops as vLLM applies them: token_ids keep every sampled token (EOS, the stop token, the tokens of a
        stop string); `text` leaves out a final EOS/stop token unless include_stop_str_in_output, and is cut
        at a stop string."""
        stop_ids = set(r["stop_token_ids"]) | (
            self.extra_eos if self.tok is not None and not r["ignore_eos"] else set()
        )
        cut = next((i for i, t in enumerate(ids) if t in stop_ids), None)
        stop_reason, by_token = None, False
        if cut is not None:  # LocalSampler knows no stop_token_ids: cut after the fact
            ids, lps, finish_reason, stop_reason, by_token = ids[: cut + 1], lps[: cut + 1], "stop", ids[cut], True
        elif (
            finish_reason == "stop" and self.tok is not None and ids and ids[-1] == self.eos_id and not r["ignore_eos"]
        ):
            by_token = True  # EOS: stop_reason stays null
        if self.tok is None:
            return ids, lps, finish_reason, stop_reason, ""
        kept = ids[:-1] if by_token and not r["include_stop_str_in_output"] else ids
        decode = lambda t: self.tok.decode(t, skip_special_tokens=r["skip_special_tokens"])
        text = decode(kept)
        hits = [(text.find(s) + len(s), text.find(s), s) for s in r["stop"] if s and s in text]
        if hits and not by_token:
            end, start, s = min(hits)  # the stop string that completes first
            n_keep = next((k for k in range(1, len(kept) + 1) if len(decode(kept[:k])) >= end), len(kept))
            ids, lps, finish_reason, stop_reason = ids[:n_keep], lps[:n_keep], "stop", s
            text = text[:end] if r["include_stop_str_in_output"] else text[:start]
        return ids, lps, finish_reason, stop_reason, text

    def _response(self, r, prompts, outs, aborted):
        choices, n_gen = [], 0
        omit_lps = r["logprobs"] is not None and self.faults.take("omit_logprobs")
        if r["prompt_lps"] and self.faults.take("omit_prompt_logprobs"):
            r["prompt_lps"] = None
        for k, (p, per_prompt) in enumerate(zip(prompts, outs)):
            for ids, lps, fr in per_prompt:
                ids, lps, fr, stop_reason, text = self._finish(list(ids), list(lps), fr, r)
                if aborted:  # what was sampled so far, finish_reason "abort"
                    fr, stop_reason = "abort", None
                n_gen += len(ids)
                logprobs = None
                if r["logprobs"] is not None and not omit_lps:
                    toks = [
                        f"token_id:{t}" if r["return_tokens_as_token_ids"] or self.tok is None else self.tok.decode([t])
                        for t in ids
                    ]
                    lps = [max(float(x), -9999.0) for x in lps]
                    logprobs = {
                        "text_offset": [sum(len(t) for t in toks[:i]) for i in range(len(toks))],
                        "token_logprobs": lps,
                        "tokens": toks,
                        "top_logprobs": [{t: x} for t, x in zip(toks, lps)],
                    }
                choices.append(
                    {
                        "index": len(choices),
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": fr,
                        "stop_reason": stop_reason,
                        "token_ids": list(ids) if r["return_token_ids"] else None,
                        "prompt_logprobs": r["prompt_lps"][k] if r["prompt_lps"] else None,
                        "prompt_token_ids": list(p) if r["return_token_ids"] else None,
                        "routed_experts": None,
                    }
                )
        if r["return_token_ids"] and choices and self.faults.take("omit_token_ids"):
            for c in choices:
                c["token_ids"] = c["prompt_token_ids"] = None
        if r["return_token_ids"] and choices and self.faults.take("bad_token"):
            for c in choices:
                c["token_ids"] = c["token_ids"][:-1] + [self.vocab_size]
        n_prompt = sum(len(p) for p in prompts)  # each prompt once, not n times
        return {
            "id": f"cmpl-{r['request_id']}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served_model_name,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": {
                "prompt_tokens": n_prompt,
                "total_tokens": n_prompt + n_gen,
                "completion_tokens": n_gen,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _prompt_logprobs(self, p):
        """prompt_logprobs: 0 -> [None, {id: {logprob, rank, decoded_token}}, ...], from raw logits (no temperature),
        as vLLM computes them (v1/sample/sampler.py gathers prompt logprobs before any sampling processing)."""
        if self.model is None:
            raise invalid("prompt_logprobs needs a model; this stand-in runs a backend callable", "prompt_logprobs")
        with self._model_lock, torch.no_grad():
            lp = torch.log_softmax(self.model(input_ids=torch.tensor([p])).logits[0, :-1].float(), -1)
        out = [None]
        for t, row in zip(p[1:], lp):
            out.append(
                {
                    str(t): {
                        "logprob": float(row[t]),
                        "rank": int((row > row[t]).sum()) + 1,
                        "decoded_token": self.tok.decode([t]),
                    }
                }
            )
        return out

    # ------------------------------------------------------------------ engine thread: batches concurrent requests
    def _engine_loop(self):
        runnable = lambda: self._pending and self._pause_mode != "keep"
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopping or runnable(), timeout=0.5)
                if self._stopping:
                    return
                if not runnable():
                    continue
            time.sleep(self.batch_window_s)  # let requests arriving together join one batch
            with self._cv:
                if not runnable():
                    continue
                key, batch, seqs = self._pending[0].key, [], 0
                for job in list(self._pending):  # same sampling settings, up to max_num_seqs sequences
                    if job.key == key and (not batch or seqs + len(job.prompts) * job.n <= self.max_num_seqs):
                        batch.append(job)
                        seqs += len(job.prompts) * job.n
                        self._pending.remove(job)
                self._running = batch
            try:
                self._run_batch(batch)
            finally:
                with self._cv:
                    self._running = []
                    self._cv.notify_all()
                for job in batch:
                    job.done.set()

    def _run_batch(self, batch):
        p = batch[0].params
        prompts = [pr for j in batch for pr in j.prompts for _ in range(j.n)]
        max_tokens = [m for j in batch for m in j.max_tokens for _ in range(j.n)]
        gen = self._generator if p["seed"] is None else torch.Generator().manual_seed(p["seed"])
        try:
            with self._model_lock:
                eos = self.sampler.eos_ids
                self.sampler.eos_ids = set() if p["ignore_eos"] else eos
                try:
                    outs = self.sampler.generate(
                        prompts,
                        max_tokens,
                        temperature=p["temperature"],
                        top_p=p["top_p"],
                        stop=tuple(p["stop"]),
                        generator=gen,
                    )
                finally:
                    self.sampler.eos_ids = eos
        except Exception as e:  # fails this batch's requests, not the server
            for job in batch:
                job.result = e
            return
        self.engine_batches += 1
        self.batch_sizes.append(len(prompts))
        outs = [(c.ids, c.logprobs, c.finish_reason) for c in outs]
        for job in batch:
            job.result = [outs[i * job.n : (i + 1) * job.n] for i in range(len(job.prompts))]
            outs = outs[len(job.prompts) * job.n :]

    # ------------------------------------------------------------------ dev-mode routes
    def _pause(self, body, query):
        mode = query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            raise request_invalid(
                [
                    {
                        "type": "literal_error",
                        "loc": "query.mode",
                        "msg": "Input should be 'abort', 'wait' or 'keep'",
                        "input": mode,
                    }
                ],
                "query.mode",
            )
        with self._cv:
            self._pause_mode = mode
            if mode == "abort":  # queued and running requests come back as "abort"
                for job in self._pending + self._running:
                    job.aborted = True
                for job in self._pending:
                    job.result = [[([], [], "abort")] * job.n for _ in job.prompts]
                    job.done.set()
                self._pending = []
            if mode != "keep":  # abort|wait return once the engine is idle
                self._cv.wait_for(lambda: not self._running and not self._pending, timeout=600)
        return {"status": "paused"}

    def _resume(self, body, query):
        with self._cv:
            self._pause_mode = None
            self._cv.notify_all()
        return {"status": "resumed"}

    def _reset_prefix_cache(self, body, query):
        self.prefix_cache_resets += 1
        return {"success": True}

    def _collective_rpc(self, body, query):
        if not isinstance(body, dict):
            raise ApiError(400, "Request body must be a JSON object", "Bad Request")
        if body.get("method") is None:
            raise ApiError(400, "Missing 'method' in request body", "Bad Request")
        if body["method"] != "reload_weights" or self.model is None:
            raise rpc_failed(f"'CPUWorker' object has no attribute {body['method']!r}")
        try:
            self._reload_weights(*(body.get("args") or []), **(body.get("kwargs") or {}))
        except TypeError as e:
            raise rpc_failed(str(e).replace("StandinServer._reload_weights", "GPUModelRunner.reload_weights"))
        except ApiError:  # vLLM 0.32 reloads layer by layer: a failure leaves the model
            self.model_broken = True  # half-loaded, and the next forward crashes the engine
            raise
        return {"results": [None]}  # one per worker; reload_weights returns None

    def _reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        """From `weights_path` (which then becomes the model's path), else from the current path. Over JSON a
        weights_iterator can only be junk, e.g. a path passed as the first positional argument."""
        from safetensors.torch import load_file

        if weights_iterator is not None:
            raise rpc_failed("not enough values to unpack (expected 2, got 1)")
        path = weights_path or self.weights_path
        if not os.path.isdir(path):  # not a folder: vLLM takes it for a Hub repo id
            raise rpc_failed(
                f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{path}'. "
                "Use `repo_type` argument if needed."
            )
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise rpc_failed(f"Cannot find any model weights with `{path}`")
        state = {k: v for f in files for k, v in load_file(f).items()}
        with self._model_lock:  # never between two decode steps of a batch
            own = set(self.model.state_dict())
            tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
            unknown, missing = sorted(set(state) - own), sorted(own - set(state) - tied)
            if unknown or missing:
                raise rpc_failed(f"checkpoint does not fit the model: unexpected {unknown[:3]}, missing {missing[:3]}")
            try:
                self.model.load_state_dict(state, strict=False)  # copies in place, bf16 -> float32
            except RuntimeError as e:
                raise rpc_failed(str(e).split("\n")[0])
        self.weights_path = self.last_weights_path = path
        self.reloads += 1

    def _weight_transfer(self, name, body):
        """Native weight transfer: bodies checked as the API router and Worker do; no NCCL."""
        body = body if isinstance(body, dict) else {}
        arg = {"init_weight_transfer_engine": "init_info", "update_weights": "update_info"}.get(name)
        if arg and arg not in body:
            raise request_invalid(
                [{"type": "missing", "loc": f"body.{arg}", "msg": "Field required", "input": None}], f"body.{arg}"
            )
        with self._lock:
            self.weight_transfer_calls.append({"route": name, "body": body})
        if not self.weight_transfer:  # started without --weight-transfer-config
            raise rpc_failed(
                "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."
            )
        wt = self._wt
        if name == "init_weight_transfer_engine":
            try:
                info = NCCLWeightTransferInitInfo(**body["init_info"])
            except TypeError as e:
                raise rpc_failed(f"Invalid init_info for NCCLWeightTransferEngine: {e}")
            uid, addr, ctx = (
                info.nccl_unique_id_b64,
                (info.master_address, info.master_port),
                "NCCLWeightTransferInitInfo",
            )
            if uid is not None and addr != (None, None):
                raise rpc_failed(f"{ctx}: pass nccl_unique_id_b64 OR master_address/master_port, not both")
            if uid is None and None in addr:
                raise rpc_failed(
                    f"{ctx}: need nccl_unique_id_b64, or both master_address and master_port "
                    f"(got master_address={addr[0]!r}, master_port={addr[1]!r})"
                )
            wt["initialized"] = True
            return {"message": "Weight transfer initialized"}
        if name == "start_weight_update":
            if wt["active"]:
                raise rpc_failed(
                    "start_weight_update called while a weight update is already active. "
                    "Call finish_weight_update first."
                )
            wt["active"] = True
            return {"message": "Weight update started"}
        if name == "update_weights":
            if not wt["active"]:
                raise rpc_failed("start_weight_update must be called before update_weights.")
            info = body["update_info"]
            info = info[0] if isinstance(info, list) else info  # a per-rank list; this server has one rank
            try:
                try:
                    info = NCCLWeightTransferUpdateInfo(**info)
                except TypeError as e:
                    raise ValueError(f"Invalid update_info for NCCLWeightTransferEngine: {e}")
                for field in ("dtype_names", "shapes"):
                    if len(getattr(info, field)) != len(info.names):
                        raise ValueError(
                            f"`{field}` should be of the same size as `names`: "
                            f"got {len(getattr(info, field))} and {len(info.names)}"
                        )
                if not wt["initialized"]:
                    raise ValueError("NCCL weight transfer not initialized. Call init_transfer_engine() first.")
            except ValueError as e:
                wt["active"] = False  # a failed update ends the session
                raise rpc_failed(str(e))
            return {"message": "Weights updated"}
        if not wt["active"]:
            raise rpc_failed("finish_weight_update called without a matching start_weight_update.")
        wt["active"] = False
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return {"message": "Weight update finished"}


def main():
    ap = argparse.ArgumentParser(description="Serve a vLLM 0.32 stand-in until Ctrl-C.")
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1", choices=["127.0.0.1"], help="it listens on loopback only")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--served-model-name")
    ap.add_argument("--no-dev-mode", action="store_true", help="as without VLLM_SERVER_DEV_MODE=1")
    ap.add_argument("--weight-transfer", action="store_true", help="as with --weight-transfer-config")
    ap.add_argument("--latency", type=float, default=0.0, help="seconds added to every completion request")
    ap.add_argument("--capacity", type=int, default=0, help="sequences that wait out --latency at once (0: all)")
    a = ap.parse_args()
    srv = StandinServer(
        a.model,
        port=a.port,
        max_model_len=a.max_model_len,
        served_model_name=a.served_model_name,
        dev_mode=not a.no_dev_mode,
        weight_transfer=a.weight_transfer,
    ).start()
    srv.faults.set_latency(a.latency, a.capacity)
    print(f"vLLM 0.32 stand-in: {srv.served_model_name} at {srv.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        srv.stop()


if __name__ == "__main__":
    main()
