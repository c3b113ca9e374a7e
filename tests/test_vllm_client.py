"""VLLMServerClient against the vLLM 0.33 stand-in (tests/vllm_standin.py) on 127.0.0.1: the fields
it sends, n for a group's first turn, max_tokens clamping, every fault, weight sync, and training."""

import json
import math
import os
import re
import sys
import threading
import time

import pytest
import requests
import torch

import mt_grpo_trainer as M
from tests.conftest import HANG_S, moving_run, recipe_cfg, until
from tests.vllm_standin import StandinServer


@pytest.fixture()
def server(tiny_model_dir):
    with StandinServer(tiny_model_dir) as srv:
        yield srv


def client_for(srv, tmp_path, *overrides, vocab=None):
    cfg = M.load_config(
        None,
        [
            f"vllm_server_url={srv.url}",
            "request_deadline=6",
            "request_timeout=3",
            f"weight_sync_dir={tmp_path}/shm",
            f"output_dir={tmp_path}/run",
            *overrides,
        ],
    )
    return M.VLLMServerClient(cfg, vocab or srv.vocab_size, stop_token_ids={srv.eos_id} if srv.tok else ())


def completions(srv):
    return [r for r in srv.requests if r["path"] == "/v1/completions"]


def test_rollout_sends_token_prompts_with_vllm_fields_and_trains_the_returned_ids(server, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = recipe_cfg(tmp_path, f"vllm_server_url={server.url}", "max_tokens=12", "max_env_steps=1")
    client = M.VLLMServerClient(cfg, server.vocab_size, {tok.eos_token_id})
    env = M.MultiTurnToolEnv(tok, [M.load_object(s) for s in cfg.tools], cfg)
    rows = [{"prompt": "what is alpha?", "key": "alpha", "value": "x"}] * 4 + [
        {"prompt": "what is bravo?", "key": "bravo", "value": "y"}
    ] * 4
    eps = env.rollout(rows, client)
    reqs = completions(server)
    first = reqs[:2]
    assert sorted(r["body"]["n"] for r in first) == [4, 4], "a group's first turn is one request with n = G"
    for r in reqs:
        b = r["body"]
        assert b["return_token_ids"] is True and b["logprobs"] == 0 and b["skip_special_tokens"] is False
        assert all(isinstance(t, int) for t in b["prompt"]) and b["cache_salt"] == f"{client.run_tag}-v0"
        assert b["stop"] == ["</tool>", "</answer>"] and b["stop_token_ids"] == [tok.eos_token_id]
        assert b["top_k"] == 0 and b["temperature"] == cfg.temperature
    assert_trained_what_the_server_sent(eps, server)


def server_sent(server) -> list[tuple[list[int], list[float]]]:
    """Every choice's token_ids and logprobs as they were in the stand-in's raw replies (not as the client read them)."""
    choices = [c for reply in server.replies for c in reply["choices"]]
    return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]


def assert_trained_what_the_server_sent(eps, server):
    """I1 through the server: each trained turn is exactly one raw reply's token ids (with its logprobs), after
    exactly a prompt the server got, and only those ids are trained."""
    prompts = {tuple(r["body"]["prompt"]) for r in completions(server)}
    sent = server_sent(server)
    for ep in eps:
        for t in ep.turns:
            s = next(s for s in ep.samples if len(s.input_ids) >= t.prompt_len + t.sampled_len)
            assert tuple(s.input_ids[: t.prompt_len]) in prompts
            span = slice(t.prompt_len, t.prompt_len + t.sampled_len)
            assert (s.input_ids[span], s.sampler_logprobs[span]) in sent
            assert s.loss_mask[span] == [1] * t.sampled_len


def test_i1_keeps_the_stop_string_and_eos_tokens_the_server_sent(tok, tmp_path):
    """Replies that end in a stop string's tokens (a tool call) and in EOS (the answer): vLLM's token_ids keep both,
    and so must the trained ids. Checked against the raw replies, so a client that drops a stop token is caught."""
    from bench.rollout_throughput import scripted_backend
    from tools.kv_lookup import lookup

    eos = tok.convert_tokens_to_ids("<|im_end|>")
    with StandinServer(backend=scripted_backend(tok), vocab_size=len(tok), max_model_len=4096) as srv:
        cfg = recipe_cfg(tmp_path, f"vllm_server_url={srv.url}", "max_seq_len=4096", "tokenization_check=off")
        client = M.VLLMServerClient(cfg, len(tok), {eos})
        env = M.MultiTurnToolEnv(tok, [lookup], cfg)
        eps = env.rollout([{"prompt": 'What is "k"?', "key": "alpha", "answer": "x"}] * 2, client)
        sent = server_sent(srv)
        assert any(ids[-1] == eos for ids, _ in sent), "some reply ends in EOS"
        assert any(tok.decode(ids).endswith("</tool>") for ids, _ in sent), "some reply ends in a stop string"
        assert all(len(ep.turns) == 3 for ep in eps)
        assert_trained_what_the_server_sent(eps, srv)


def test_max_tokens_is_clamped_to_the_servers_context(tiny_model_dir, tmp_path):
    with StandinServer(tiny_model_dir, max_model_len=40) as srv:
        client = client_for(srv, tmp_path)
        assert client.max_model_len == 40
        out = client.generate([list(range(5, 35))], [48], temperature=1.0)
        assert completions(srv)[-1]["body"]["max_tokens"] == 10
        assert len(out[0].ids) <= 10
        n = len(completions(srv))
        full = client.generate([list(range(5, 45))], [48])  # no room at all: no request, a truncated turn
        assert len(completions(srv)) == n and full[0].ids == [] and full[0].finish_reason == "length"


@pytest.mark.parametrize("fault", ["fail", "drop", "malformed"])
def test_transient_faults_are_retried(server, tmp_path, fault):
    client = client_for(server, tmp_path)
    getattr(server.faults, {"fail": "fail_next", "drop": "drop_next", "malformed": "malformed_next"}[fault])(2)
    out = client.generate([[5, 6, 7]], [4])
    assert len(out[0].ids) >= 1 and len(out[0].ids) == len(out[0].logprobs)
    assert len(completions(server)) == 3, "two failed attempts, then the good one"


def test_503_while_paused_is_retried_until_resume(server, tmp_path):
    client = client_for(server, tmp_path)
    requests.post(server.url + "/pause", params={"mode": "abort"}, timeout=5)
    threading.Timer(1.2, lambda: requests.post(server.url + "/resume", timeout=5)).start()
    t = time.time()
    out = client.generate([[5, 6, 7]], [4])
    assert out[0].ids and time.time() - t >= 1.0


@pytest.mark.parametrize(
    "fault,message",
    [
        ("omit_token_ids_next", "returned no token_ids"),
        ("omit_logprobs_next", "returned no logprobs"),
        ("bad_token_next", "outside the vocabulary"),
    ],
)
def test_replies_we_cannot_trust_are_errors_never_samples(server, tmp_path, fault, message):
    client = client_for(server, tmp_path)
    getattr(server.faults, fault)(1)
    with pytest.raises(M.SamplerError, match=message):
        client.generate([[5, 6, 7]], [4])


def raised_before_a_hang(fn) -> BaseException | None:
    """What fn raised, run in a thread; None if it returned. A client that retries past its deadline never returns
    here: the join's deadline (HANG_S, far beyond any request_deadline below) only catches that hang."""
    out = {}

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=HANG_S)
    assert not worker.is_alive(), f"still retrying after {HANG_S} s: the deadline is not kept"
    return out.get("error")


def test_persistent_5xx_ends_with_a_clear_error_within_the_deadline(server, tmp_path):
    """A counter, not a clock: the client gives up at request_deadline with failures still queued (it would
    succeed on the 101st attempt)."""
    client = client_for(server, tmp_path, "request_deadline=2")
    server.faults.fail_next(100, status=502)
    with pytest.raises(M.SamplerError, match=f"vLLM server at {server.url}.*HTTP 502"):
        client.generate([[5, 6, 7]], [4])
    assert len(completions(server)) < 100 and server.faults.left("fail") > 0


def test_slow_server_times_out_per_attempt_then_fails_by_the_deadline(server, tmp_path):
    """Events: the server holds every request (it never answers), so only request_timeout ends an attempt and only
    request_deadline the retries."""
    server.faults.hold()
    client = client_for(server, tmp_path, "request_timeout=0.5", "request_deadline=2")
    try:
        error = raised_before_a_hang(lambda: client.generate([[5, 6, 7]], [4]))
    finally:
        server.faults.release()
    assert isinstance(error, M.SamplerError) and "Timeout" in str(error), error


def test_an_unreachable_server_names_the_url(tmp_path):
    url = f"http://127.0.0.1:{M.free_port()}"
    cfg = M.load_config(None, [f"vllm_server_url={url}", "request_deadline=1.5"])
    error = raised_before_a_hang(lambda: M.VLLMServerClient(cfg, 100))
    assert isinstance(error, M.SamplerError), error
    assert re.search(f"vLLM server at {url}.*GET /v1/models.*ConnectionError", str(error)), error


def test_a_refused_request_is_not_retried(server, tmp_path):
    client = client_for(server, tmp_path)
    with pytest.raises(M.SamplerError, match="HTTP 400"):
        client.generate([[5, 6, 7]], [4], stop=("a", "b", "c", "d", "e"))  # vLLM allows 4 stop strings
    assert len(completions(server)) == 1


def test_all_requests_are_in_flight_at_once(tmp_path):
    """Counted at the server, not timed (a loaded machine stretches any timing): every prompt of a batch is in flight
    at once, and max_concurrent_requests caps that."""
    lock, in_flight, peak = threading.Lock(), [0], [0]

    def backend(prompt, params):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        time.sleep(1.0)
        with lock:
            in_flight[0] -= 1
        return [1, 2], [-0.5, -0.5], "stop"

    with StandinServer(backend=backend, vocab_size=100, max_model_len=64) as srv:
        prompts = [[3, i] for i in range(24)]
        client_for(srv, tmp_path).generate(prompts, [4] * 24)
        together, peak[0] = peak[0], 0
        client_for(srv, tmp_path, "max_concurrent_requests=4").generate(prompts, [4] * 24)
    assert together >= 20 and peak[0] == 4, (together, peak[0])


def test_weight_sync_reloads_new_weights_resets_the_cache_and_salts_by_version(server, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = client_for(server, tmp_path)
    prompt = AutoTokenizer.from_pretrained(tiny_model_dir).encode("what is alpha?")
    before = client.generate([prompt], [8], temperature=0.0)[0].ids
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    mark = len(server.requests)
    client.sync_weights(other, {k: v.detach() for k, v in other.state_dict().items()}, version=1)
    calls = [r["path"] for r in server.requests[mark:]]
    assert calls == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    rpc = server.requests[mark + 1]["body"]
    assert rpc["method"] == "reload_weights" and rpc["kwargs"]["weights_path"] == server.last_weights_path
    assert server.requests[mark]["query"]["mode"] == "abort"
    after = client.generate([prompt], [8], temperature=0.0)[0].ids
    ref = M.LocalSampler(other.to(torch.bfloat16).float(), server.tok).generate([prompt], [8], temperature=0.0)[0].ids
    assert after == ref and after != before, "the server samples from the synced weights"
    assert completions(server)[-1]["cache_salt"] == f"{client.run_tag}-v1"
    client.sync_weights(other, other.state_dict(), version=2)
    assert sorted(os.listdir(client.sync_dir)) == ["step_2"], "old weight folders are removed"
    client.cleanup()
    assert os.listdir(client.sync_dir) == []


def test_nccl_sync_follows_vllms_native_weight_transfer_protocol(tiny_model_dir, tmp_path, monkeypatch):
    """No NCCL here: vLLM's two trainer-side helpers are replaced, the HTTP protocol is the stand-in's."""
    import types

    sent = []
    fake_common = types.SimpleNamespace(trainer_init=lambda info: ("group", info))
    fake_packed = types.SimpleNamespace(
        packed_nccl_broadcast_producer=lambda it, group, src, post: sent.extend(post(kv) for kv in it)
    )
    for name, mod in {
        "vllm": types.ModuleType("vllm"),
        "vllm.distributed": types.ModuleType("d"),
        "vllm.distributed.weight_transfer": types.ModuleType("w"),
        "vllm.distributed.weight_transfer.nccl_common": fake_common,
        "vllm.distributed.weight_transfer.packed_tensor": fake_packed,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with StandinServer(tiny_model_dir, weight_transfer=True) as srv:
        client = client_for(srv, tmp_path, "weight_sync=nccl")
        for version in (1, 2):
            client.sync_weights(model, model.state_dict(), version)
        calls = [r["path"] for r in srv.requests if r["path"] != "/v1/models"]
    assert calls[:2] == ["/get_world_size", "/init_weight_transfer_engine"], "the group is set up once"
    one_sync = [
        "/pause",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/reset_prefix_cache",
        "/resume",
    ]
    assert calls[2:] == one_sync * 2
    assert len(sent) == 2 * len(model.state_dict()) and all(t.dtype == torch.bfloat16 for t in sent)
    assert client.policy_version == 2


def test_a_lora_sync_and_the_other_ranks_change_only_the_version_and_pause_nothing(tmp_path, monkeypatch):
    """policy_version changes in one place (weight_update), after what the server needs: a LoRA sync (the new adapter
    loads beside the old ones) and the other ranks' call (None: rank 0's already returned) pause nothing, and a load
    the server refuses leaves the version as it was."""
    calls, refuse = [], []

    def request(self, method, path, **kw):
        calls.append(path)
        if path == "/v1/load_lora_adapter" and refuse:
            raise M.SamplerError("HTTP 404")
        return {"data": [{"id": "base", "max_model_len": 64}]} if path == "/v1/models" else {"text": ""}

    monkeypatch.setattr(M.VLLMServerClient, "request", request)
    adapter = type("Adapter", (), {"save_pretrained": lambda self, path, state_dict: os.makedirs(path)})()
    cfg = M.load_config(
        None,
        [
            "vllm_server_url=http://127.0.0.1:9",
            f"weight_sync_dir={tmp_path}/shm",
            f"output_dir={tmp_path}/run",
            "lora_rank=4",
        ],
    )
    rank0, rank1 = M.VLLMServerClient(cfg, 100), M.VLLMServerClient(cfg, 100)
    rank0.sync_weights(adapter, {}, 1)
    rank1.sync_weights(None, None, 1)
    assert calls == ["/v1/models", "/v1/models", "/v1/load_lora_adapter"]
    assert rank0.policy_version == rank1.policy_version == 1 and rank0.model_for(1) == rank0.adapters[-1][0]
    refuse.append(1)
    with pytest.raises(M.SamplerError, match="needs a server started with --enable-lora"):
        rank0.sync_weights(adapter, {}, 2)
    assert rank0.policy_version == 1 and "/pause" not in calls


def test_exiting_never_waits_for_requests_in_flight(server, tmp_path):
    """A run that stops on an error while requests are in flight exits at once: the client's workers are
    daemons, so the interpreter does not wait out their request_timeout. Events, not a clock: the server holds the
    request (it never answers), the script exits once the request is held, and the exit must come within HANG_S,
    a deadline that only catches a hang: waiting out request_timeout (600 s) would overrun it."""
    import subprocess

    server.faults.hold()
    script = (
        f"import sys, threading\nsys.path.insert(0, {os.getcwd()!r})\nimport mt_grpo_trainer as M\n"
        f"cfg = M.load_config(None, ['vllm_server_url={server.url}', 'output_dir={tmp_path}/run'])\n"
        "c = M.VLLMServerClient(cfg, 100)\n"
        "threading.Thread(target=c.generate, args=([[5, 6, 7]], [4]), daemon=True).start()\n"
        "sys.stdin.readline()\nsys.exit(3)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        until(lambda: server.faults.busy() == 1 or p.poll() is not None, "the request is in flight")
        p.stdin.write("exit\n")
        p.stdin.flush()
        err = p.communicate(timeout=HANG_S)[1]
    finally:
        p.kill()
        server.faults.release()
    assert p.returncode == 3, err[-1000:]


def test_training_against_the_server_syncs_every_step_and_before_generating_after_a_resume(
    server, tiny_model_dir, tmp_path, capsys
):
    common = [
        f"model_name_or_path={tiny_model_dir}",
        "model_builder=",
        f"vllm_server_url={server.url}",
        f"weight_sync_dir={tmp_path}/shm",
        "prompts_per_step=2",
        "num_generations=2",
        "max_tokens=12",
        "save_steps=1",
        "max_seq_len=600",
    ]
    M.train(recipe_cfg(tmp_path, *common, "max_steps=2"))
    assert "the server's max_model_len is below max_seq_len 600: it bounds episodes" in capsys.readouterr().out
    assert server.reloads == 3, "once before step 1 (the server may hold other weights), then after each step"
    lines = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert all(m["time/weight_sync"] > 0 for m in lines)
    assert {r["cache_salt"].split("-")[1] for r in completions(server)} == {
        "v0",
        "v1",
        "probe",
    }  # probe: the sync check
    assert len({r["cache_salt"].split("-")[0] for r in completions(server)}) == 1, "one run, one salt prefix"
    mark = len(server.requests)
    M.train(recipe_cfg(tmp_path, *common, "max_steps=3", "resume_from_checkpoint=auto"))
    after = [r["path"] for r in server.requests[mark:] if r["path"] in ("/collective_rpc", "/v1/completions")]
    assert after[0] == "/collective_rpc", "the resumed run syncs its weights before any generation"
    assert server.last_weights_path.endswith("step_3")


def test_the_sync_check_judges_one_small_step_and_stops_a_run_whose_reload_did_nothing(
    server, tiny_model_dir, tmp_path, monkeypatch
):
    """At a small learning rate (the stand-in serves the bf16 weights, in float32) most syncs are judged: the server's
    logprobs on the probe moved as far as the trainer's (a slope within 0.2 of 1); a run whose reload after step 1
    does nothing stops there, the server's logprobs as they were to the bit."""
    common = [
        *moving_run(tmp_path, tiny_model_dir),
        "model_builder=",
        f"vllm_server_url={server.url}",
        f"weight_sync_dir={tmp_path}/shm",
        "prompts_per_step=2",
        "num_generations=4",
        "max_tokens=12",
        "learning_rate=2e-6",
        "lr_scheduler=constant",  # every step as small (the toy recipe decays it to 0)
        "max_steps=4",
        "log_episodes_steps=0",
    ]
    hist = M.train(recipe_cfg(tmp_path / "synced", *common))
    seen = [(m["sync/probe_logprob_diff"], m["sync/probe_change"], m.get("sync/probe_follow")) for m in hist]
    assert all(abs(m.get("sync/probe_follow", 1) - 1) < 0.2 for m in hist), f"moved as the trainer's: {seen}"
    assert sum("sync/probe_follow" in m for m in hist) >= 2, f"judged once a step's change stands out: {seen}"
    probes = [r["cache_salt"] for r in completions(server) if "-probe" in r["cache_salt"]]
    salt = probes[0].split("-")[0]
    assert probes[-2:] == [f"{salt}-probe-v{v}" for v in (3, 4)], "probed once a sync, never on KV of older weights"
    skip_after_step_0 = M.VLLMServerClient.sync_weights
    monkeypatch.setattr(
        M.VLLMServerClient, "sync_weights", lambda self, m, sd, v: v == 0 and skip_after_step_0(self, m, sd, v)
    )
    with pytest.raises(
        M.SyncCheckError, match=r"after step 1 on http://\S+: since step 0 the server's .* moved -?0\.\d\d times as far"
    ):
        M.train(recipe_cfg(tmp_path / "skipped", *common))


def test_a_server_without_prompt_logprobs_stops_at_its_first_sync_naming_sync_check_which_turns_the_probe_off(
    server, tiny_model_dir, tmp_path, capsys
):
    """A proxy in front of vLLM, or another engine, that drops prompt_logprobs: the probe cannot be scored, and the
    error names the key that turns it off; with it off the run trains past its syncs, and says at start what is then
    unchecked."""
    common = [
        f"model_name_or_path={tiny_model_dir}",
        "model_builder=",
        f"vllm_server_url={server.url}",
        f"weight_sync_dir={tmp_path}/shm",
        "prompts_per_step=2",
        "num_generations=2",
        "max_tokens=12",
        "max_steps=2",
    ]
    server.faults.omit_prompt_logprobs_next(1)
    with pytest.raises(M.SamplerError, match=r"returned no prompt_logprobs .*needs sync_check: false"):
        M.train(recipe_cfg(tmp_path / "checked", *common))
    server.faults.omit_prompt_logprobs_next(1)
    hist = M.train(recipe_cfg(tmp_path / "unchecked", *common, "sync_check=false"))
    assert [m["step"] for m in hist] == [1, 2] and server.reloads == 1 + 3, "synced before step 1 and after each step"
    assert all(m["time/weight_sync"] > 0 and not any(k.startswith("sync/") for k in m) for m in hist)
    assert server.faults.left("omit_prompt_logprobs") == 1, "no probe was sent"
    assert "sync_check: false: no weight sync is checked" in capsys.readouterr().out


def test_greedy_duplicates_go_as_one_n1_request(server, tmp_path):
    """vLLM refuses n > 1 with temperature 0; greedy copies are identical, so one request serves all."""
    client = client_for(server, tmp_path)
    out = client.generate([[5, 6, 7]] * 3, [6] * 3, temperature=0.0)
    assert [r["body"]["n"] for r in completions(server)] == [1]
    assert out[0].ids == out[1].ids == out[2].ids and out[0].ids


def standin_process(model_dir, tmp_path, name="server", port=None, latency=0.0):
    """The stand-in in a process of its own, so that a test can kill it like a crashed server (and start it again on
    its port), its output in NAME.log; `latency` s added to each completion."""
    import subprocess

    port, log = port or M.free_port(), tmp_path / f"{name}.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(os.path.dirname(__file__), "vllm_standin.py"),
            "--model",
            model_dir,
            "--port",
            str(port),
            "--latency",
            str(latency),
        ],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    url, deadline = f"http://127.0.0.1:{port}", time.time() + 60
    while time.time() < deadline:
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, log
        except requests.RequestException:
            time.sleep(0.2)
    proc.kill()  # a stand-in late to start is not left running
    proc.wait()
    raise AssertionError("the stand-in did not start: " + log.read_text())


def trainer_against(url, model_dir, tmp_path, *overrides, logs="server.log"):
    """The trainer on the toy recipe against the servers at `url` (comma-separated), whose logs are `logs`."""
    import subprocess

    return subprocess.Popen(
        [
            sys.executable,
            "mt_grpo_trainer.py",
            "hf_recipes/toy/toy-kv--mt-grpo.yaml",
            f"model_name_or_path={model_dir}",
            "model_builder=",
            f"vllm_server_url={url}",
            f"output_dir={tmp_path}/run",
            f"weight_sync_dir={tmp_path}/shm",
            "prompts_per_step=2",
            "num_generations=2",
            "max_tokens=8",
            "max_steps=500",
            "save_steps=2",
            "request_deadline=1800",
            "eval_steps=0",
            *overrides,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "MTGRPO_VLLM_LOG": ",".join(str(tmp_path / log) for log in logs.split(","))},
    )


def wait_for(path, timeout=120, poll=0.2):
    deadline = time.time() + timeout
    while time.time() < deadline and not path.exists():
        time.sleep(poll)
    assert path.exists(), f"{path} never appeared"


def test_when_every_server_is_gone_the_run_stops_within_server_dead_timeout_with_each_log(tiny_model_dir, tmp_path):
    (a, url_a, _), (b, url_b, _) = (standin_process(tiny_model_dir, tmp_path, name) for name in ("a", "b"))
    trainer = trainer_against(f"{url_a},{url_b}", tiny_model_dir, tmp_path, "server_dead_timeout=5", logs="a.log,b.log")
    wait_for(tmp_path / "run" / "checkpoint-2")
    a.kill()  # the processes are gone: connections are refused from now on
    b.kill()
    t = time.time()
    out, err = trainer.communicate(timeout=120)
    assert trainer.returncode == 1, err[-2000:]
    assert time.time() - t < 5 + 25, "stopped after server_dead_timeout, not after request_deadline (1800 s)"
    assert "no vLLM server is left" in err, err[-3000:]
    for url, log in ((url_a, "a.log"), (url_b, "b.log")):  # each server's log tail is part of the error
        assert (
            f"Last lines of the log of {url} ({tmp_path / log}):\n" in err
            and f"stand-in: {tiny_model_dir} at {url}" in err
        )
    assert out.count("is down (") == 2, "each server's loss is said once"
    done = M.find_checkpoint(M.load_config(None, [f"output_dir={tmp_path}/run", "resume_from_checkpoint=auto"]))
    assert done and os.path.isfile(os.path.join(done, "model.safetensors")), "the last checkpoint stays usable"


def test_the_server_log_is_found_after_the_working_folder_moved(tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "vllm.log").write_text("the engine died: out of memory\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MTGRPO_VLLM_LOG", "vllm.log")  # run.sh's default is relative, too
    with StandinServer(tiny_model_dir) as srv:
        client = M.VLLMServerClient(
            M.load_config(None, [f"vllm_server_url={srv.url}", "server_dead_timeout=1", f"output_dir={tmp_path}/run"]),
            srv.vocab_size,
        )
    os.chdir(tmp_path.parent)
    with pytest.raises(
        M.SamplerError, match=r"no vLLM server is left to sample from after 1s \(server_dead_timeout\)"
    ) as e:
        client.generate([[5, 6, 7]], [4])  # the server is gone
    assert f"Last lines of the log of {srv.url} ({tmp_path}/vllm.log):\nthe engine died" in str(e.value)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_while_requests_are_retried_stops_the_run_at_once(tiny_model_dir, tmp_path, sig):
    import signal

    server, url, log = standin_process(tiny_model_dir, tmp_path, latency=2.0)
    trainer = trainer_against(url, tiny_model_dir, tmp_path, "server_dead_timeout=600")
    wait_for(tmp_path / "run" / "checkpoint-2", poll=0.05)
    server.kill()  # within step 3's rollout (2 s a request), not a sync: its requests wait for a server to come back
    time.sleep(3)
    t = time.time()
    trainer.send_signal(getattr(signal, sig))
    out, err = trainer.communicate(timeout=60)
    assert time.time() - t < 15 and trainer.returncode == 1, err[-2000:]
    assert "SIGTERM or Ctrl-C" in err and "saved checkpoints are unaffected" in err
    assert "Traceback" not in err
    done = M.find_checkpoint(M.load_config(None, [f"output_dir={tmp_path}/run", "resume_from_checkpoint=auto"]))
    assert done and os.path.isfile(os.path.join(done, "trainer_state.pt"))


def test_lora_against_a_server_without_lora_stops_at_the_first_sync_and_says_how_to_start_it(
    server, tiny_model_dir, tmp_path
):
    """A server started without --enable-lora has no /v1/load_lora_adapter (the stand-in answers 404, as vLLM does):
    the first adapter sync stops the run with the server's answer and the flags it needs, nothing is retried."""
    cfg = M.load_config(
        "hf_recipes/toy/toy-kv--mt-grpo.yaml",
        [
            f"model_name_or_path={tiny_model_dir}",
            "model_builder=",
            f"vllm_server_url={server.url}",
            "lora_rank=4",
            f"weight_sync_dir={tmp_path}/shm",
            f"output_dir={tmp_path}/run",
            "max_steps=1",
            "request_deadline=6",
        ],
    )
    with pytest.raises(M.SamplerError, match="needs a server started with --enable-lora") as e:
        M.train(cfg)
    assert "HTTP 404" in str(e.value) and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in str(e.value)
    assert [r["path"] for r in server.requests].count("/v1/load_lora_adapter") == 1
    assert not completions(server), "nothing was sampled from weights the server does not have"


def test_the_logprobs_mode_check_passes_a_token_at_the_edge_of_the_trainers_nucleus(tiny, tmp_path):
    """The server draws from its own (bf16) nucleus: a token just outside the trainer's gets -inf there and must not
    make a server that returns processed logprobs look like one that returns raw ones."""
    model, tok = tiny
    cfg = recipe_cfg(tmp_path, "temperature=0.7", "top_p=0.9")
    prompt = tok.encode("hello there", add_special_tokens=False)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    lp, raw = torch.log_softmax(logits / 0.7, -1), torch.log_softmax(logits, -1)
    kept = M.top_p_filter(lp, 0.9)
    inside, edge = int(lp.argmax()), int(lp.masked_fill(kept.isfinite(), -math.inf).argmax())  # the best one left out
    replies = {
        "processed": [(inside, kept[inside]), (edge, lp[edge]), (inside, kept[inside]), (inside, kept[inside])],
        "raw": [(inside, raw[inside])] * 4,
    }

    class Sampler:  # a server whose nucleus held one token more than the trainer's
        url, mode = "http://server", "processed"

        def generate(self, prompts, max_tokens, temperature, top_p):
            return [M.Completion([t], [float(x)], "length") for t, x in replies[self.mode]]

    run = M.Run(cfg, 0, 1, torch.device("cpu"))
    run.sampler, run.model = Sampler(), model
    run.check_logprobs_mode(prompt)  # before: the edge token's infinite distance refused this server
    run.sampler.mode = "raw"
    with pytest.raises(M.SamplerError, match="--logprobs-mode processed_logprobs"):
        run.check_logprobs_mode(prompt)
