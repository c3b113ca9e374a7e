"""The vLLM 0.33 stand-in itself: response shapes, real tokens and logprobs, stops, errors, faults, dev routes."""

import concurrent.futures

import pytest
import requests
import torch

from conftest import until
from vllm_standin import StandinServer

T = 10  # seconds: every HTTP call has a timeout


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    with StandinServer(tiny_model_dir) as s:
        yield s


@pytest.fixture(autouse=True)
def _clean(request):
    yield
    if "srv" in request.fixturenames:
        s = request.getfixturevalue("srv")
        s.faults.clear()
        requests.post(s.url + "/resume", timeout=T)


def post(s, path, body=None, **kw):
    return requests.post(s.url + path, json=body, timeout=T, **kw)


def complete(s, **body):
    return post(s, "/v1/completions", body)


def prompt_ids(tok, text="<|im_start|>user\nWhat is the value of golf?<|im_end|>\n<|im_start|>assistant\n"):
    return tok.encode(text)


def test_models_health_and_unknown_routes(srv, tiny_model_dir):
    assert requests.get(srv.url + "/health", timeout=T).status_code == 200
    card = requests.get(srv.url + "/v1/models", timeout=T).json()["data"][0]
    assert card["id"] == tiny_model_dir and card["root"] == tiny_model_dir and card["max_model_len"] == 512
    assert set(card) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
    r = requests.get(srv.url + "/nope", timeout=T)
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}


def test_completion_schema_real_token_ids_and_logprobs(srv, tiny, tok):
    model, _ = tiny
    p = prompt_ids(tok)
    r = complete(
        srv,
        model=srv.served_model_name,
        prompt=p,
        max_tokens=12,
        temperature=1.0,
        logprobs=0,
        return_token_ids=True,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        cache_salt="v3",
        ignore_eos=True,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    }
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
    c = out["choices"][0]
    assert set(c) == {
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "prompt_logprobs",
        "prompt_token_ids",
        "routed_experts",
    }  # vLLM 0.32 has no weight_versions
    ids, lps = c["token_ids"], c["logprobs"]["token_logprobs"]
    assert c["prompt_token_ids"] == p and len(ids) == len(lps) == 12 and c["finish_reason"] == "length"
    assert tok.decode(ids, skip_special_tokens=False) == c["text"]
    assert all(x <= 0 for x in lps) and c["logprobs"]["tokens"] == [tok.decode([t]) for t in ids]
    assert c["logprobs"]["top_logprobs"][0] == {c["logprobs"]["tokens"][0]: lps[0]}
    full = torch.tensor([p + ids])  # logprobs are the model's, at the sampling temperature
    with torch.no_grad():
        logits = model(input_ids=full).logits[0, len(p) - 1 : -1].float()  # directly, not the trainer's function
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1).tolist()
    torch.testing.assert_close(lps, ref, rtol=0, atol=1e-4)
    assert out["usage"] == {
        "prompt_tokens": len(p),
        "completion_tokens": 12,
        "total_tokens": len(p) + 12,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert srv.requests[-1]["cache_salt"] == "v3" and srv.requests[-1]["body"]["prompt"] == p


def test_defaults_null_fields_string_prompt_and_misspelt_fields(srv, tok):
    c = complete(srv, prompt="<|im_start|>user\nhi", max_tokens=3, return_tokens_ids=True).json()["choices"][0]
    assert c["token_ids"] is None and c["prompt_token_ids"] is None and c["logprobs"] is None  # typo ignored
    r = complete(srv, prompt=[5, 6], max_tokens=None, temperature=0, logprobs=True, ignore_eos=True).json()
    assert len(r["choices"][0]["logprobs"]["tokens"]) == 16  # max_tokens null means 16; true means 1


def test_n_choices_and_several_prompts(srv, tok):
    p1, p2 = prompt_ids(tok), [5, 6, 7]
    out = complete(srv, prompt=[p1, p2], n=3, max_tokens=4, return_token_ids=True, logprobs=0).json()
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert [c["prompt_token_ids"] for c in out["choices"]] == [p1] * 3 + [p2] * 3
    assert out["usage"]["prompt_tokens"] == len(p1) + len(p2)  # each prompt once, not n times
    assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in out["choices"])
    assert error(complete(srv, prompt=[], max_tokens=2)) == (
        400,
        {"message": "You must pass at least one prompt", "type": "BadRequestError", "param": None, "code": 400},
    )


def free_run(s, p, seed, **kw):
    body = dict(
        dict(
            prompt=p,
            max_tokens=24,
            seed=seed,
            return_token_ids=True,
            logprobs=0,
            ignore_eos=True,
            skip_special_tokens=False,
        ),
        **kw,
    )
    return complete(s, **body).json()["choices"][0]


def test_stop_string_cuts_text_but_token_ids_keep_the_stop_tokens(srv, tok):
    p = prompt_ids(tok)
    free = free_run(srv, p, 7)
    text = tok.decode(free["token_ids"])
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    c = free_run(srv, p, 7, stop=[stop])
    ids = c["token_ids"]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop and ids == free["token_ids"][: len(ids)]
    assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])
    assert c["text"] == text[: text.find(stop)] and len(c["logprobs"]["token_logprobs"]) == len(ids)
    c2 = free_run(srv, p, 7, stop=[stop], include_stop_str_in_output=True)
    assert c2["token_ids"] == ids and c2["text"] == text[: text.find(stop) + len(stop)]


def test_stop_token_ids_and_eos(srv, tok):
    p = prompt_ids(tok)
    free = free_run(srv, p, 11)["token_ids"]
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    c = free_run(srv, p, 11, stop_token_ids=[free[k]])
    assert c["token_ids"] == free[: k + 1] and c["finish_reason"] == "stop" and c["stop_reason"] == free[k]
    assert c["text"] == tok.decode(free[:k])  # the stop token's text is not in `text`
    c = free_run(srv, p, 11, stop_token_ids=[free[k]], include_stop_str_in_output=True)
    assert c["text"] == tok.decode(free[: k + 1])
    # EOS: a model whose EOS is the token it samples at step k finishes there with stop_reason null
    eos = srv.eos_id
    srv.eos_id, srv.sampler.eos_ids = free[k], {free[k]}
    try:
        c = free_run(srv, p, 11, ignore_eos=False)
    finally:
        srv.eos_id, srv.sampler.eos_ids = eos, {eos}
    assert c["token_ids"] == free[: k + 1] and c["finish_reason"] == "stop" and c["stop_reason"] is None


def error(r):
    return r.status_code, r.json()["error"]


def test_request_errors_match_vllm(srv, tok):
    status, e = error(complete(srv, prompt=[5] * 513, max_tokens=4))
    assert status == 400 and e["type"] == "BadRequestError" and e["param"] == "input_tokens" and e["code"] == 400
    assert e["message"].startswith(
        "This model's maximum context length is 512 tokens. However, your prompt "
        "contains 513 input tokens, which exceeds this limit even without any output tokens."
    )
    status, e = error(complete(srv, prompt=[5], max_tokens=600))
    assert status == 400 and e["message"].startswith("max_tokens=600 cannot be greater than max_model_len=512.")
    status, e = error(complete(srv, prompt=[5] * 512, max_tokens=4))
    assert status == 400 and e["message"].startswith("max_tokens must be at least 1, got 0.")
    c = complete(srv, prompt=[5] * 508, max_tokens=100, ignore_eos=True, return_token_ids=True).json()["choices"][0]
    assert len(c["token_ids"]) == 4 and c["finish_reason"] == "length"  # prompt + max_tokens > 512: clamped
    assert error(complete(srv, prompt=[[]]))[1]["message"] == "The decoder prompt cannot be empty"
    status, e = error(complete(srv, prompt=""))
    assert status == 400 and e["type"] == "BadRequestError" and e["param"] == "prompt"  # 0.32: not a validation list
    status, e = error(complete(srv, prompt=[5], stop=list("abcde")))
    assert status == 400 and e["param"] == "body.stop" and "at most 4 items" in e["message"]
    assert error(complete(srv, prompt=[5, 100000]))[1]["message"] == "Token id 100000 is out of vocabulary"
    for salt in ("policy/17", "", "x" * 129, "a@b"):
        status, e = error(complete(srv, prompt=[5], cache_salt=salt))
        assert status == 400 and e["param"] == "cache_salt" and "'cache_salt' must be" in e["message"]
    status, e = error(complete(srv, prompt=[5], model="other"))
    assert status == 404 and e["type"] == "NotFoundError" and "does not exist" in e["message"]
    assert (
        error(complete(srv, prompt=[5], n=2, temperature=0))[1]["message"]
        == "n must be 1 when using greedy sampling, got 2."
    )
    r = requests.post(srv.url + "/v1/completions", data="{}", headers={"Content-Type": "text/plain"}, timeout=T)
    assert r.status_code == 400 and "Only 'application/json' is allowed" in r.json()["error"]["message"]


def test_held_requests_overlap_and_capacity_queues_the_rest(srv):
    """A counter, not a clock: all 6 requests wait at the held gate at once (busy() reaches 6); with a capacity of 4
    sequences, only 4 do and the rest queue. `until` fails only on a hang."""
    srv.faults.hold()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(complete, srv, prompt=[5, 6], max_tokens=2) for _ in range(6)]
        until(lambda: srv.faults.busy() == 6, "6 requests held at once")
        srv.faults.release()
        assert [f.result(timeout=T).status_code for f in futs] == [200] * 6
    srv.faults.hold()
    srv.faults.set_latency(0.0, capacity=4)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(complete, srv, prompt=[5, 6], max_tokens=2, n=2) for _ in range(3)]
        until(lambda: srv.faults.busy() == 4, "two requests of n=2 fill the capacity")
        assert not any(f.done() for f in futs) and srv.faults.busy() == 4, "the third waits for room"
        srv.faults.release()
        assert [f.result(timeout=T).status_code for f in futs] == [200] * 3


def test_fault_counters(srv):
    body = dict(prompt=[5, 6], max_tokens=3, return_token_ids=True, logprobs=0)
    srv.faults.fail_next(2)
    assert [complete(srv, **body).status_code for _ in range(3)] == [500, 500, 200]
    srv.faults.fail_next(1, status=503)
    status, e = error(complete(srv, **body))
    assert status == 503 and e["type"] == "ServiceUnavailableError"
    srv.faults.drop_next(1)
    with pytest.raises(requests.ConnectionError):
        complete(srv, **body)
    srv.faults.malformed_next(1)
    r = complete(srv, **body)
    assert r.status_code == 200
    with pytest.raises(requests.exceptions.JSONDecodeError):
        r.json()
    srv.faults.omit_token_ids_next(1)
    assert complete(srv, **body).json()["choices"][0]["token_ids"] is None
    srv.faults.omit_logprobs_next(1)
    assert complete(srv, **body).json()["choices"][0]["logprobs"] is None
    srv.faults.bad_token_next(1)
    assert max(complete(srv, **body).json()["choices"][0]["token_ids"]) >= srv.vocab_size
    c = complete(srv, **body).json()["choices"][0]  # every counter is used up
    assert max(c["token_ids"]) < srv.vocab_size and c["logprobs"] is not None
    srv.faults.set_engine_dead()
    assert requests.get(srv.url + "/health", timeout=T).status_code == 503
    status, e = error(complete(srv, **body))
    assert (
        status == 500 and e["message"] == "EngineCore encountered an issue. See stack trace (above) for the root cause."
    )
    srv.faults.clear()
    assert requests.get(srv.url + "/health", timeout=T).status_code == 200


def test_pause_resume(srv):
    body = dict(prompt=[5, 6], max_tokens=2)
    assert post(srv, "/pause", params={"mode": "abort", "clear_cache": "true"}).json() == {"status": "paused"}
    assert requests.get(srv.url + "/is_paused", timeout=T).json() == {"is_paused": True}
    status, e = error(complete(srv, **body))
    assert status == 503 and e["message"] == "Generation is paused. Please retry after it resumes."
    assert post(srv, "/resume").json() == {"status": "resumed"}
    assert requests.get(srv.url + "/is_paused", timeout=T).json() == {"is_paused": False}
    assert complete(srv, **body).status_code == 200
    assert post(srv, "/pause", params={"mode": "sometimes"}).status_code == 400
    assert post(srv, "/reset_prefix_cache").json() == {"success": True} and srv.prefix_cache_resets == 1


def run_concurrently(s, n, body):
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: complete(s, **body), range(n)))


def test_requests_are_batched(srv):
    b0 = srv.engine_batches
    rs = run_concurrently(srv, 32, dict(prompt=[5, 6, 7], max_tokens=8, ignore_eos=True))
    assert all(r.status_code == 200 for r in rs)
    # a counter: each request ran in exactly one batch (how many batches depends on when they arrived, so the
    # batching itself is shown below, with the arrivals made certain by a keep-pause)
    assert sum(srv.batch_sizes[b0:]) == 32
    # keep-paused, requests wait in the queue; on resume they run as one batch
    post(srv, "/pause", params={"mode": "keep"})
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futs = [pool.submit(complete, srv, prompt=[5, 6], max_tokens=4) for _ in range(16)]
        until(lambda: srv.pending() == 16, "16 requests queued")
        assert not any(f.done() for f in futs)
        b0 = srv.engine_batches
        post(srv, "/resume")
        assert all(f.result(timeout=T).status_code == 200 for f in futs)
    assert srv.engine_batches - b0 == 1 and srv.batch_sizes[-1] == 16


def test_256_concurrent_requests(srv):
    b0 = srv.engine_batches
    rs = run_concurrently(srv, 256, dict(prompt=[5, 6, 7], max_tokens=4, return_token_ids=True))  # T: a hang
    assert all(r.status_code == 200 and r.json()["choices"][0]["token_ids"] for r in rs)
    assert sum(srv.batch_sizes[b0:]) == 256, "a counter: every request ran, in exactly one batch"


def test_pause_abort_reports_queued_requests_as_aborted(srv):
    post(srv, "/pause", params={"mode": "keep"})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(complete, srv, prompt=[5, 6], max_tokens=4, n=2, return_token_ids=True) for _ in range(2)]
        until(lambda: srv.pending() == 2, "2 requests queued")
        post(srv, "/pause", params={"mode": "abort"})
        outs = [f.result(timeout=T).json() for f in futs]
    assert all(c["finish_reason"] == "abort" and c["token_ids"] == [] for o in outs for c in o["choices"])
    assert all(len(o["choices"]) == 2 for o in outs)


def greedy(s, prompts):
    out = complete(s, prompt=prompts, max_tokens=8, temperature=0, return_token_ids=True, ignore_eos=True).json()
    return [c["token_ids"] for c in out["choices"]]


def test_reload_weights_changes_completions(tiny_model_dir, tok, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config
    cfg.initializer_range = 0.5  # at the default 0.02 a tied-embedding random model greedily repeats its input
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(cfg)
    other.to(torch.bfloat16).save_pretrained(tmp_path / "step_1")  # as the trainer saves it
    prompts = [prompt_ids(tok), [5, 6, 7]]
    with StandinServer(tiny_model_dir) as s:
        before = greedy(s, prompts)
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "step_1")}, "timeout": 60}
        assert post(s, "/collective_rpc", rpc).json() == {"results": [None]}
        after = greedy(s, prompts)
        assert after != before and s.reloads == 1 and s.last_weights_path == str(tmp_path / "step_1")
        assert (
            post(s, "/collective_rpc", {"method": "reload_weights", "args": [None, tiny_model_dir]}).status_code == 200
        )
        assert greedy(s, prompts) == before and s.reloads == 2
        assert (
            error(post(s, "/collective_rpc", {"method": "frobnicate"}))[1]["message"]
            == "Call to collective_rpc method failed: Worker failed with error ''CPUWorker' object has no attribute "
            "'frobnicate'', please check the stack trace above for the root cause"
        )
        assert error(post(s, "/collective_rpc", {"args": []}))[0] == 400
        assert s.reloads == 2 and greedy(s, prompts) == before, (
            "a failed call of another method leaves the model as it was"
        )
        reload = lambda path: error(
            post(s, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
        )
        status, e = reload(str(tmp_path / "nope"))
        assert status == 500 and e == {
            "message": "Call to collective_rpc method failed: Worker failed with error 'Repo id "
            "must be in the form 'repo_name' or 'namespace/repo_name': '<path>'. Use `repo_type` "
            "argument if needed.', please check the stack trace above for the root cause",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
        (tmp_path / "empty").mkdir()
        assert "Cannot find any model weights with `<path>`" in reload(str(tmp_path / "empty"))[1]["message"]
        assert error(post(s, "/collective_rpc", {"method": "reload_weights", "args": [str(tmp_path)]}))[0] == 500
        # as in vLLM 0.32: a failed reload leaves the model half-loaded, and the next forward kills the engine
        dead = complete(s, prompt=prompts[0], max_tokens=4)
        assert dead.status_code == 500 and "EngineCore encountered an issue" in dead.json()["error"]["message"]
        assert requests.get(s.url + "/health", timeout=5).status_code == 503 and s.reloads == 2


def test_dev_routes_are_404_without_dev_mode(tiny_model_dir):
    with StandinServer(tiny_model_dir, dev_mode=False) as s:
        for path in (
            "/pause",
            "/resume",
            "/collective_rpc",
            "/reset_prefix_cache",
            "/init_weight_transfer_engine",
            "/update_weights",
        ):
            r = post(s, path, {})
            assert r.status_code == 404 and r.json() == {"detail": "Not Found"}, path
        assert requests.get(s.url + "/is_paused", timeout=T).status_code == 404
        assert complete(s, prompt=[5, 6], max_tokens=2).status_code == 200


def test_weight_transfer_routes(srv, tiny_model_dir):
    not_configured = (
        "Call to collective_rpc method failed: Worker failed with error 'Weight transfer not configured. "
        "Please set weight_transfer_config to enable weight transfer.', please check the stack trace above "
        "for the root cause"
    )
    status, e = error(post(srv, "/start_weight_update"))
    assert status == 500 and e["message"] == not_configured and e["type"] == "InternalServerError"
    assert requests.get(srv.url + "/get_world_size", timeout=T).json() == {"world_size": 1}
    init = {"master_address": "127.0.0.1", "master_port": 29600, "rank_offset": 1, "world_size": 2, "packed": True}
    update = {"names": ["lm_head.weight"], "dtype_names": ["bfloat16"], "shapes": [[8, 4]]}
    with StandinServer(tiny_model_dir, weight_transfer=True) as s:
        assert error(post(s, "/init_weight_transfer_engine", {}))[0] == 400  # init_info is required
        status, e = error(post(s, "/init_weight_transfer_engine", {"init_info": {"master_address": "x"}}))
        assert status == 500 and "Invalid init_info for NCCLWeightTransferEngine" in e["message"]
        assert post(s, "/init_weight_transfer_engine", {"init_info": init}).json() == {
            "message": "Weight transfer initialized"
        }
        assert (
            "start_weight_update must be called"
            in error(post(s, "/update_weights", {"update_info": update}))[1]["message"]
        )
        assert post(s, "/start_weight_update").json() == {"message": "Weight update started"}
        status, e = error(post(s, "/update_weights", {"update_info": dict(update, packed=True)}))
        assert status == 500 and "unexpected keyword argument 'packed'" in e["message"]
        post(s, "/start_weight_update")  # the failed update ended the session
        assert post(s, "/update_weights", {"update_info": update}).json() == {"message": "Weights updated"}
        assert post(s, "/finish_weight_update", {"weight_version": "3"}).json() == {"message": "Weight update finished"}
        assert s.weight_version == "3" and [c["route"] for c in s.weight_transfer_calls][-3:] == [
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
        ]
        c = complete(s, prompt=[5], max_tokens=2, ignore_eos=True, return_weight_versions=True).json()["choices"][0]
        assert "weight_versions" not in c, "vLLM 0.32 ignores return_weight_versions (an unknown field)"


def test_callable_backend(tiny_model_dir):
    seen = []

    def backend(prompt, params):
        seen.append((prompt, params["max_tokens"], params["temperature"]))
        return [7, 8, 9, 10], [-0.5] * 4, "length"

    with StandinServer(backend=backend, vocab_size=100, max_model_len=10) as s:
        c = complete(
            s,
            prompt=[1, 2, 3],
            max_tokens=9,
            temperature=0.5,
            n=2,
            return_token_ids=True,
            logprobs=0,
            stop_token_ids=[9],
        ).json()["choices"]
        assert len(c) == 2 and c[0]["token_ids"] == [7, 8, 9] and c[0]["stop_reason"] == 9
        assert c[0]["logprobs"]["tokens"] == ["token_id:7", "token_id:8", "token_id:9"]
        assert seen == [([1, 2, 3], 7, 0.5)] * 2  # max_tokens clamped to 10 - 3
        assert error(complete(s, prompt=[100], max_tokens=2))[1]["message"] == "Token id 100 is out of vocabulary"
