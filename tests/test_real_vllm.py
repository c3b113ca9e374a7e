"""The real vLLM server (its CPU build, started by run.sh's own launch code) in the loop: token faithfulness
across turns, sampler/trainer agreement, weight sync and its self-check, pauses, n, stops, the context
clamp, cache_salt, greedy eval, agent harnesses (the openai client against the trainer's endpoint, the server
sampling), and training runs through `MTGRPO_LAYOUT=server bash run.sh`: the agent recipe on this server, 3 LoRA steps.

The server serves the warm-started toy model; tests that need known weights on it sync them first."""

import collections
import contextlib
import copy
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import requests
import torch

import mt_grpo_trainer as M
from conftest import (
    ROOT,
    free_ports,
    moving_run,
    only_the_token_gets_in,
    recipe_cfg,
    second_host,
    server_layout_env,
    start_real_server,
    stop_real_server,
    tiny_sizes,
    until,
    vllm_api_process,
)
from tasks import toy_kv

TOY = "hf_recipes/toy/toy-kv--mt-grpo.yaml"
AGREE = 2e-3  # mean |sampler - trainer| logprob over sampled tokens: bf16 server, float32 trainer


@pytest.fixture(scope="module")
def toy(toy_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(
        toy_model_dir, dtype=torch.float32
    ).eval(), AutoTokenizer.from_pretrained(toy_model_dir)


def client_for(srv, tmp_path, tok, *overrides):
    cfg = recipe_cfg(
        tmp_path,
        f"vllm_server_url={srv.url}",
        f"model_name_or_path={srv.model_dir}",
        f"weight_sync_dir={tmp_path}/shm",
        "request_deadline=120",
        *overrides,
    )
    return M.VLLMServerClient(cfg, len(tok), {tok.eos_token_id})


def recording(client):
    """Every call the client makes, with its reply, as seen on the wire."""
    calls, real = [], client.request

    def request(method, path, deadline=None, **kw):
        out = real(method, path, deadline, **kw)
        calls.append({"path": path, "query": kw.get("params"), "body": kw.get("json"), "reply": out})
        return out

    client.request = request
    return calls


def choices(calls):
    return [c for call in calls if call["path"] == "/v1/completions" for c in call["reply"]["choices"]]


def wire_replies(calls):
    """(prompt ids, sampled ids) -> the token logprobs of every choice the server answered with them. Two choices may
    sample the same ids after the same prompt, their logprobs a little apart (~1e-6: a batch's numerics)."""
    out = collections.defaultdict(list)
    for c in choices(calls):
        out[tuple(c["prompt_token_ids"]), tuple(c["token_ids"])].append(c["logprobs"]["token_logprobs"])
    return out


def trainer_logprobs(model, prompt, ids, temperature, top_p=1.0):
    """The trainer's float32 logprobs of `ids` after `prompt`, processed as the sampler's are."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float() / temperature
    lp = torch.log_softmax(logits, -1)
    lp = M.top_p_filter(lp, top_p) if top_p < 1 else lp
    return lp.gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)


def serve(client, model, version):
    client.sync_weights(model, {k: v.detach() for k, v in model.state_dict().items()}, version)


def toy_prompts(env, n, seed=0):
    return [env.next_prompt(env.new_episode(r)) for r in toy_kv.make_dataset(n, seed=seed)]


def mean_abs_diff(model, outs, prompts, temperature, top_p=1.0):
    diffs = [
        (trainer_logprobs(model, p, c.ids, temperature, top_p) - torch.tensor(c.logprobs)).abs()
        for p, c in zip(prompts, outs)
        if c.ids
    ]
    return float(torch.cat(diffs).mean()), sum(len(d) for d in diffs)


def test_trained_ids_are_exactly_the_ids_vllm_returned_across_turns(real_vllm, toy, tmp_path):
    model, tok = toy
    client = client_for(real_vllm, tmp_path, tok)
    serve(client, model, 1)
    calls = recording(client)
    env = M.MultiTurnToolEnv(tok, [M.load_object("tools/kv_lookup.py:lookup")], client.cfg)
    eps = env.rollout([r for r in toy_kv.make_dataset(8, seed=3) for _ in range(4)], client)
    returned = wire_replies(calls)
    with_tools = [ep for ep in eps if ep.tool_calls and len(ep.turns) >= 2]
    assert len(with_tools) >= 3, "the warm-started policy looks up about a quarter of the time"
    for ep in eps:
        [s] = ep.samples  # ChatML extends: one sample per episode (I4)
        for t in ep.turns:
            span = slice(t.prompt_len, t.prompt_len + t.sampled_len)
            key = (tuple(s.input_ids[: t.prompt_len]), tuple(s.input_ids[span]))
            assert key in returned, (
                "I1: each turn is one reply's token_ids, after exactly that reply's prompt_token_ids"
            )
            assert s.loss_mask[span] == [1] * t.sampled_len and s.sampler_logprobs[span] in returned[key]
        assert sum(s.loss_mask) == sum(t.sampled_len for t in ep.turns), "I3: nothing else is trained"
    masked = tok.decode(
        [i for i, m in zip(with_tools[0].samples[0].input_ids, with_tools[0].samples[0].loss_mask) if not m]
    )
    assert "<result>" in masked, "the tool result is context, mask 0"


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampler_and_trainer_logprobs_agree(real_vllm, toy, tmp_path, temperature, top_p):
    model, tok = toy
    client = client_for(real_vllm, tmp_path, tok)
    serve(client, model, 2)
    env = M.MultiTurnToolEnv(tok, [M.load_object("tools/kv_lookup.py:lookup")], client.cfg)
    prompts = [p for p in toy_prompts(env, 16) for _ in range(4)]
    outs = client.generate(prompts, [48] * len(prompts), temperature, top_p, env.stop)
    diff, n = mean_abs_diff(model, outs, prompts, temperature, top_p)
    print(f"T={temperature} top_p={top_p}: mean |sampler - trainer| = {diff:.5f} over {n} sampled tokens")
    assert n > 300 and diff < AGREE


def test_a_weight_sync_takes_and_its_check_catches_a_skipped_one(real_vllm, toy, tmp_path, monkeypatch):
    model, tok = toy
    client = client_for(real_vllm, tmp_path, tok)
    env = M.MultiTurnToolEnv(tok, [M.load_object("tools/kv_lookup.py:lookup")], client.cfg)
    prompts = [p for p in toy_prompts(env, 8, seed=5) for _ in range(4)]
    changed = type(model).from_pretrained(real_vllm.model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn_like(p) * 0.4 * p.std().clamp(min=1e-3))  # enough that stale logprobs stand out
    serve(client, changed, 3)
    outs = client.generate(prompts, [48] * len(prompts), 1.0, 1.0, env.stop)
    follows, n = mean_abs_diff(changed, outs, prompts, 1.0)
    stale, _ = mean_abs_diff(model, outs, prompts, 1.0)
    assert follows < AGREE < 10 * AGREE < stale, (follows, stale, n)
    # The trainer's own checks after every sync, on the warm-started model at learning rates whose first one-step
    # changes on the probe are below the bf16 gap (and far below sync_check_max_diff, the bound that gap needs), then
    # grow (a warmup from 1e-5 to 8e-5): a sync is judged once the change since the last judged one is about twice
    # the gap, and passes when the weights arrive, also with requests in flight (max_staleness 1) ...
    serve(client, model, 4)
    common = [
        moving_run(tmp_path, real_vllm.model_dir)[0],  # rewards 0, 1, 0, 1 in every group: every step moves the weights
        f"model_name_or_path={real_vllm.model_dir}",
        "model_builder=",
        f"vllm_server_url={real_vllm.url}",
        f"weight_sync_dir={tmp_path}/shm",
        "prompts_per_step=4",  # a step whose every group sampled 4 equal episodes would not move the weights
        "num_generations=4",
        "learning_rate=8e-5",
        "lr_scheduler=constant",
        "warmup_steps=7",  # step k at (k + 1) / 8 of it: 1e-5 at the first, 2e-5 at the second (the skip below)
        "log_episodes_steps=0",
        "max_steps=8",
    ]
    hist = M.train(recipe_cfg(tmp_path, *common, "max_staleness=1", f"output_dir={tmp_path}/synced"))
    for m in hist:
        print({k: round(v, 5) for k, v in m.items() if k.startswith("sync/")})
        assert m["sync/probe_logprob_diff"] < M.Config.sync_check_max_diff
        assert abs(m.get("sync/probe_follow", 1) - 1) < 0.5, "where judged, the server's moved as the trainer's did"
    # The server samples unseeded (its probe texts, every step's batch), so one step's change varies from run to run
    # (0.003-0.006 at 2e-5 against a gap of about 0.0055; at a constant 2e-5 six steps once ended with 0.010 added up,
    # none judged): what is asserted is that both paths ran, not a step's size.
    assert any("sync/probe_follow" not in m for m in hist), "a sync too small to judge: its change adds up"
    assert any("sync/probe_follow" in m for m in hist), "judged once the change since the last judged is large enough"
    # ... and stop the run at the first sync whose reload did nothing (skipped after step 1).
    skip_after_step_0 = M.VLLMServerClient.sync_weights
    monkeypatch.setattr(
        M.VLLMServerClient, "sync_weights", lambda self, m, sd, v: v == 0 and skip_after_step_0(self, m, sd, v)
    )
    with pytest.raises(
        M.SyncCheckError, match=r"after step 1 on http://\S+: since step 0 the server's .* moved -?0\.\d\d times as far"
    ) as e:
        M.train(recipe_cfg(tmp_path, *common, f"output_dir={tmp_path}/skipped"))
    print(e.value)


def test_the_sync_check_passes_noisy_correct_syncs_and_stops_a_partial_reload(real_vllm, tmp_path, monkeypatch):
    """Faults in front of the real server: Gaussian noise (sigma 1e-3) on every probe logprob, as a GPU server that is
    not batch-invariant gives, on correct syncs passes; a reload that leaves the last layer's MLP at the first sync's
    weights (every reload after it skips those tensors) stops the run with the slope it measured."""
    common = [
        moving_run(tmp_path, real_vllm.model_dir)[0],
        f"model_name_or_path={real_vllm.model_dir}",
        "model_builder=",
        f"vllm_server_url={real_vllm.url}",
        f"weight_sync_dir={tmp_path}/shm",
        "prompts_per_step=4",
        "num_generations=4",
        "learning_rate=1e-4",
        "log_episodes_steps=0",
        "max_steps=6",
    ]
    probe = M.VLLMServerClient.probe_logprobs
    rng = np.random.default_rng(0)
    noisy = lambda self, ids: {u: list(lp + rng.normal(0, 1e-3, len(lp))) for u, lp in probe(self, ids).items()}
    monkeypatch.setattr(M.VLLMServerClient, "probe_logprobs", noisy)
    hist = M.train(recipe_cfg(tmp_path, *common, f"output_dir={tmp_path}/noisy"))
    assert len(hist) == 6 and any("sync/probe_follow" in m for m in hist)
    monkeypatch.setattr(M.VLLMServerClient, "probe_logprobs", probe)
    reload = M.VLLMServerClient.sync_weights
    first = {}

    def last_mlp_stays(self, model, state_dict, version):
        last = max(int(k.split("layers.")[1].split(".")[0]) for k in state_dict if "layers." in k)
        stale = [k for k in state_dict if f"layers.{last}.mlp." in k]
        first.update({k: state_dict[k].clone() for k in stale if k not in first})
        return reload(self, model, {**state_dict, **first}, version)

    monkeypatch.setattr(M.VLLMServerClient, "sync_weights", last_mlp_stays)
    with pytest.raises(
        M.SyncCheckError, match=r"since step 0 the server's .* moved 0\.\d\d times as far .*partial"
    ) as e:
        M.train(recipe_cfg(tmp_path, *common, "max_steps=20", f"output_dir={tmp_path}/partial"))
    print(e.value)


def test_a_server_started_without_processed_logprobs_stops_the_run_at_set_up(real_vllm, tmp_path):
    """By hand without `--logprobs-mode processed_logprobs`, vLLM returns its logprobs at temperature 1 without top-p,
    while the trainer scores at the recipe's temperature: set-up samples a little, compares, and names the flag."""
    common = [
        f"model_name_or_path={real_vllm.model_dir}",
        "model_builder=",
        f"weight_sync_dir={tmp_path}/shm",
        "prompts_per_step=2",
        "num_generations=4",
        "max_steps=1",
        "log_episodes_steps=0",
    ]
    M.train(recipe_cfg(tmp_path, *common, "temperature=0.7", "top_p=0.9", f"vllm_server_url={real_vllm.url}"))
    raw = start_real_server(
        real_vllm.model_dir,
        tmp_path / "raw.log",
        vllm_flags=[  # run.sh's flags but that one
            "--max-model-len",
            "512",
            "--enable-prefix-caching",
            "--generation-config",
            "vllm",
        ],
    )
    try:
        for t, p in ((0.7, 1.0), (1.0, 0.9)):
            with pytest.raises(
                M.SamplerError,
                match=rf"temperature 1 without top-p, not at temperature={t}, top_p={p} .*"
                r"Restart it with `--logprobs-mode processed_logprobs`",
            ) as e:
                M.train(
                    recipe_cfg(
                        tmp_path,
                        *common,
                        f"temperature={t}",
                        f"top_p={p}",
                        f"vllm_server_url={raw.url}",
                        f"output_dir={tmp_path}/raw{t}",
                    )
                )
            print(e.value)
    finally:
        stop_real_server(raw.proc)


def metric(url, name):
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def endless(client):
    """Every completion the client asks for runs to its max_tokens, whatever the weights sample: EOS and the stop
    tokens do not end it (vLLM's ignore_eos). A generation's length is then known before it starts."""
    real = client.request

    def request(method, path, deadline=None, **kw):
        if path == "/v1/completions":
            kw["json"] = {**kw["json"], "ignore_eos": True, "stop_token_ids": []}
        return real(method, path, deadline, **kw)

    client.request = request


def generating(url, worker, total: int):
    """Start worker, whose requests sample `total` tokens in all, and return once the server generates them: its
    generated-token counter has grown, so the engine has taken a step with them. Returns how many of the `total` tokens
    are still to come, read from the counter when called."""
    before = metric(url, "vllm:generation_tokens_total")
    worker.start()
    until(lambda: metric(url, "vllm:generation_tokens_total") > before, "the server generating the requests")
    return lambda: total - (metric(url, "vllm:generation_tokens_total") - before)


def at_pause(client, to_come) -> list:
    """A list that gets, at each /pause the client sends, to_come() read as soon as the server is paused (when nothing
    generates)."""
    seen, real = [], client.request

    def request(method, path, deadline=None, **kw):
        out = real(method, path, deadline, **kw)
        if path == "/pause":
            seen.append(to_come())
        return out

    client.request = request
    return seen


def test_a_pause_mid_generation_aborts_and_the_request_is_sent_again(real_vllm, toy, tmp_path):
    """The pause lands inside the generation by construction: 512 sequences (16 requests of n = 32, sent at once: four
    times what the server's batch holds, the rest waiting) each run to the end of the server's context (ignore_eos),
    over a thousand decoding steps (about 16 s on two quiet cores: a pause sent late by seconds under load still lands
    inside), and the pause is sent once the server generates them."""
    model, tok = toy
    client = client_for(real_vllm, tmp_path, tok)
    env = M.MultiTurnToolEnv(tok, [M.load_object("tools/kv_lookup.py:lookup")], client.cfg)
    prompts = [p + [i + 20] for i, p in enumerate(toy_prompts(env, 16, seed=7)) for _ in range(32)]
    budgets = [client.max_model_len - len(p) for p in prompts]  # what generate clamps max_tokens to
    endless(client)
    calls, out = recording(client), {}
    asked = [client.max_model_len] * len(prompts)
    worker = threading.Thread(target=lambda: out.setdefault("c", client.generate(prompts, asked, 1.0)))
    to_come = generating(real_vllm.url, worker, sum(budgets))
    with client.weight_update(list(client.servers), 10):  # pause (abort) ... resume, as a sync does
        left = to_come()  # read while paused: nothing generates
    worker.join(timeout=300)
    print(f"{left} of {sum(budgets)} tokens to come at the pause")
    assert left > 0, "every token was generated before the pause: it came after the sequences, not inside them"
    aborted = [c for c in choices(calls) if c["finish_reason"] == "abort"]
    assert aborted, f"the server was paused with {left} tokens to come, and no request came back aborted"
    assert len(out["c"]) == len(prompts)
    for c, budget in zip(out["c"], budgets):  # every completion handed back is whole: sent again after the resume
        assert c.finish_reason == "length" and len(c.ids) == len(c.logprobs) == budget


def test_partial_rollouts_requests_frozen_by_a_keep_pause_finish_after_a_real_reload(real_vllm, toy, tmp_path):
    """max_staleness >= 1: a sync pauses with mode=keep; the requests in flight are neither aborted nor sent again,
    they finish after vLLM reloads the weights, and each token's logprob is that of the weights that sampled it. The
    sync lands inside the generation by construction: 128 sequences (4 requests of n = 32, sent at once: the server's
    whole batch) each run to the end of the server's context (ignore_eos), hundreds of decoding steps, and the sync
    starts once the server generates them."""
    import copy

    model, tok = toy
    client = client_for(real_vllm, tmp_path, tok, "max_staleness=1")
    env = M.MultiTurnToolEnv(tok, [M.load_object("tools/kv_lookup.py:lookup")], client.cfg)
    prompts = [p + [i + 20] for i, p in enumerate(toy_prompts(env, 4, seed=11)) for _ in range(32)]
    torch.manual_seed(2)
    old = type(model)(model.config)  # near-uniform: each token's logprob about -log(vocab)
    new = copy.deepcopy(old)
    with torch.no_grad():  # only the final norm differs: a frozen request's KV cache is the same under both,
        new.model.norm.weight.mul_(30)  # and the new weights' next-token distributions are peaked
    endless(client)
    try:
        serve(client, old, 1)
        calls, out = recording(client), {}
        asked = [client.max_model_len] * len(prompts)
        worker = threading.Thread(target=lambda: out.setdefault("c", client.generate(prompts, asked, 1.0)))
        total = sum(client.max_model_len - len(p) for p in prompts)
        to_come = generating(client.servers[0].url, worker, total)
        left = at_pause(client, to_come)
        serve(client, new, 2)  # weights written, then the keep pause, the reload and the resume
        worker.join(timeout=300)
        assert left[0] > 0, "every token was generated before the sync: it came after the sequences, not inside them"
        assert [c["query"] for c in calls if c["path"] == "/pause"] == [{"mode": "keep", "clear_cache": "false"}]
        sent = [c for c in calls if c["path"] == "/v1/completions"]
        assert len(sent) == 4 and not [c for c in choices(calls) if c["finish_reason"] == "abort"], (
            "a keep pause aborts nothing and nothing is sent again"
        )
        for p, c in zip(prompts, out["c"]):  # whole: frozen, then finished, never cut short
            assert c.finish_reason == "length" and len(c.ids) == len(c.logprobs) == client.max_model_len - len(p)
        assert all(c.version in (1, 2) for c in out["c"])  # 2: on a loaded machine, a request first sent after the sync
        by_new = []
        seqs = torch.tensor([p + c.ids for p, c in zip(prompts, out["c"])])  # each max_model_len long: one batch
        with torch.no_grad():
            batch_old, batch_new = (torch.log_softmax(m(input_ids=seqs).logits.float(), -1) for m in (old, new))
        for i, (p, c) in enumerate(zip(prompts, out["c"])):
            at = torch.arange(len(p) - 1, seqs.shape[1] - 1)  # each sampled token's position, scored a step before
            lp = torch.tensor(c.logprobs)
            lp_old = batch_old[i, at, seqs[i, at + 1]]
            lp_new = batch_new[i, at, seqs[i, at + 1]]
            assert torch.minimum((lp - lp_old).abs(), (lp - lp_new).abs()).max() < 0.5, "each token is one model's"
            clear = (lp_old - lp_new).abs() > 1.0
            by_new.append(((lp - lp_new).abs() < (lp - lp_old).abs())[clear].tolist())
        assert all(flags == sorted(flags) for flags in by_new), "old weights' tokens, then the new weights', never back"
        assert all(all(flags) for c, flags in zip(out["c"], by_new) if c.version == 2), "a new request is all new"
        assert any(flags and flags[0] < flags[-1] for flags in by_new), (
            f"the server paused with {left[0]} tokens to come, and no sequence has the old weights' tokens, then the new"
        )
        [c] = client.generate([prompts[0]], [4], 1.0)
        assert c.version == 2
    finally:
        serve(client, model, 10)  # the warm-started weights again, for the tests after this one


def test_n_for_a_groups_first_turn_and_what_stop_strings_and_eos_leave_in_token_ids(real_vllm, toy, tmp_path):
    model, tok = toy
    client = client_for(real_vllm, tmp_path, tok)
    calls = recording(client)
    env = M.MultiTurnToolEnv(tok, [M.load_object("tools/kv_lookup.py:lookup")], client.cfg)
    [prompt] = toy_prompts(env, 1, seed=9)
    torch.manual_seed(0)
    serve(client, type(model)(model.config), 1)  # fresh random weights: near-uniform, so 8 draws differ
    spread = client.generate([prompt] * 8, [16] * 8, 1.0)
    assert [c["body"]["n"] for c in calls if c["path"] == "/v1/completions"] == [8], "one request with n=8"
    assert len({tuple(c.ids) for c in spread}) == 8, "n gives eight independent samples, not one copied"
    serve(client, model, 2)  # the warm-started weights, which stop at </tool> and end with EOS
    xml = client.generate([prompt] * 8, [48] * 8, 1.0, 1.0, ("</tool>", "</answer>"))
    stopped = [c for c in xml if c.finish_reason == "stop" and c.ids[-1] != tok.eos_token_id]  # not an EOS stop
    assert stopped and all(tok.decode(c.ids).endswith(("</tool>", "</answer>")) for c in stopped), (
        "token_ids keep the tokens of the stop string the server cut the text at"
    )
    native = client.generate([prompt] * 8, [48] * 8, 1.0, 1.0, ())
    ended = [c for c in native if c.finish_reason == "stop"]
    assert ended and all(c.ids[-1] == tok.eos_token_id for c in ended), "an EOS stop keeps the EOS id"


def test_max_tokens_is_clamped_to_the_servers_max_model_len(real_vllm, toy, tmp_path):
    model, tok = toy
    client = client_for(real_vllm, tmp_path, tok)
    calls = recording(client)
    assert client.max_model_len == 512
    [c] = client.generate([[20 + i % 300 for i in range(500)]], [48], 1.0)
    assert calls[-1]["body"]["max_tokens"] == 12 and 1 <= len(c.ids) <= 12
    [full] = client.generate([[20] * 512], [48], 1.0)
    assert len(calls) == 1 and full.ids == [] and full.finish_reason == "length"


def test_cache_salt_keeps_other_weights_kv_out_of_the_prefix_cache(real_vllm, toy, tmp_path):
    model, tok = toy
    client = client_for(real_vllm, tmp_path, tok)
    prompt = [20 + (i * 7) % 300 for i in range(200)]
    client.generate([prompt], [4], 1.0)
    before = metric(real_vllm.url, "vllm:prefix_cache_hits_total")
    client.generate([prompt], [4], 1.0)  # same salt: the prompt's KV blocks are reused
    reused = metric(real_vllm.url, "vllm:prefix_cache_hits_total") - before
    client.policy_version = client.servers[0].version = 1  # as after a weight sync: a new salt
    before = metric(real_vllm.url, "vllm:prefix_cache_hits_total")
    client.generate([prompt], [4], 1.0)
    assert reused >= 100 and metric(real_vllm.url, "vllm:prefix_cache_hits_total") - before == 0


def test_greedy_eval_through_the_real_server(real_vllm, tmp_path, monkeypatch):
    """Every completion request the evaluation sends is greedy (the sync check's own probe, sampled at set-up at
    temperature 1, is not the evaluation's)."""
    calls = []
    evaluating = []
    real_request = M.VLLMServerClient.request
    real_eval_episodes = M.eval_episodes

    def request(self, method, path, deadline=None, **kw):
        if evaluating:
            calls.append(kw.get("json"))
        return real_request(self, method, path, deadline, **kw)

    def eval_episodes(*args, **kwargs):
        evaluating.append(True)
        try:
            return real_eval_episodes(*args, **kwargs)
        finally:
            evaluating.clear()

    monkeypatch.setattr(M, "eval_episodes", eval_episodes)

    cfg = recipe_cfg(
        tmp_path,
        f"model_name_or_path={real_vllm.model_dir}",
        "model_builder=",
        f"vllm_server_url={real_vllm.url}",
        f"weight_sync_dir={tmp_path}/shm",
        "eval_max_examples=12",
    )
    M.VLLMServerClient.request = request
    try:
        [m] = M.train(cfg, eval_only=True)
    finally:
        M.VLLMServerClient.request = real_request
    sent = [b for b in calls if b and "n" in b and "prompt_logprobs" not in b]
    assert sent and all(b["temperature"] == 0.0 and b["n"] == 1 for b in sent)
    rows = [json.loads(x) for x in open(tmp_path / "run" / "eval" / "step-0.jsonl")]
    assert len(rows) == 12 and 0.0 <= m["eval/exact_answer_reward"] <= 1.0 and "eval/lookup_hit_reward" in m


# --- agent harnesses (appendix H): the openai client's requests to the trainer's endpoint, the real server sampling --

AGENT = "hf_recipes/toy/toy-kv-agent--mt-grpo.yaml"


def agent_env(srv, tmp_path, tok, agent, *overrides):
    cfg = M.load_config(
        AGENT,
        [f"output_dir={tmp_path}/agent", f"model_name_or_path={srv.model_dir}", "model_builder=", *overrides],
    )
    return M.AgentEnv(tok, agent, cfg)


def sampled_per_episode(client):
    """Every request the rollout's sampler was given, per episode (its session), in order: (prompt ids, Completion)."""
    seen, real = collections.defaultdict(list), client.generate

    def generate(prompts, max_tokens, *args, sessions=None, **kw):
        outs = real(prompts, max_tokens, *args, sessions=sessions, **kw)
        for p, c, s in zip(prompts, outs, sessions, strict=True):
            seen[s].append((list(p), c))
        return outs

    client.generate = generate
    return seen


def harness_requests(monkeypatch):
    """Every chat completion the harnesses ask for with the openai client, per base_url: (messages sent, reply)."""
    import openai

    seen, real = collections.defaultdict(list), openai.resources.chat.completions.Completions.create

    def create(self, **kw):
        reply = real(self, **kw)
        seen[str(self._client.base_url).rstrip("/")].append((copy.deepcopy(kw["messages"]), reply.choices[0].message))
        return reply

    monkeypatch.setattr(openai.resources.chat.completions.Completions, "create", create)
    return seen


def assert_trained_as_sampled(ep, requests, returned):
    """I1 per sample: its loss-masked ids are the ids the server returned for the turns it holds, in order, each right
    after exactly the prompt ids the server was given, with the server's logprobs; nothing else is trained (I3)."""
    assert len(ep.turns) == len(requests), "one turn per request"
    for prompt, c in requests:
        assert c.logprobs in returned[tuple(prompt), tuple(c.ids)], "the client hands on the server's reply verbatim"
    held = []
    for s in ep.samples:
        turns = sorted({t for t in s.turn_idx if t >= 0})
        held += turns
        for t in turns:
            prompt, c = requests[t]
            p, span = ep.turns[t].prompt_len, slice(ep.turns[t].prompt_len, ep.turns[t].prompt_len + len(c.ids))
            assert s.input_ids[:p] == prompt, f"turn {t}'s ids follow exactly the prompt the server was given"
            assert s.input_ids[span] == c.ids and s.loss_mask[span] == [1] * len(c.ids), f"turn {t}: its ids"
        mask = np.array(s.loss_mask, bool)
        assert np.array(s.input_ids)[mask].tolist() == [i for t in turns for i in requests[t][1].ids]
        assert np.array(s.sampler_logprobs)[mask].tolist() == [lp for t in turns for lp in requests[t][1].logprobs]
    assert sorted(held) == [t for t, (_, c) in enumerate(requests) if c.ids], "every turn in one sample"


def test_the_toy_harness_through_the_endpoint_trains_exactly_what_vllm_returned(real_vllm, toy, tmp_path, monkeypatch):
    """tasks/toy_kv_agent.py:agent (the openai client in its own loop, its tool results sent back as role `tool`)
    against AgentEnv's endpoint, the real server sampling: every request is one turn, trained as the server sampled
    it (I1), the conversation holds the results as the XML format's <result> messages, the harness's return value is
    the row's agent_result, ChatML extends (no fork), and the endpoint is gone once the rollout returns."""
    from tasks.toy_kv_agent import agent

    model, tok = toy
    client = client_for(real_vllm, tmp_path, tok)
    serve(client, model, 30)  # the warm-started weights, which call the tool
    calls, sampled, asked = recording(client), sampled_per_episode(client), harness_requests(monkeypatch)
    env = agent_env(real_vllm, tmp_path, tok, agent)
    eps = env.rollout([r for r in toy_kv.make_dataset(16, seed=3) for _ in range(2)], client)
    returned = wire_replies(calls)
    by_row = {int(re.search(r"/episodes/e(\d+)/v1$", url).group(1)): turns for url, turns in asked.items()}
    assert len(eps) == 32 and M.rollout_metrics(eps)["rollout/forks"] == 0
    with_tools = [ep for ep in eps if ep.tool_calls and len(ep.turns) >= 2]
    assert with_tools, "the warm-started policy looks up about a quarter of the time"
    for i, ep in enumerate(eps):  # the endpoint numbers episodes in the order of their rows
        requests, harness = sampled[ep.session], by_row[i]
        assert len(ep.samples) == 1, "ChatML extends: one sample per episode (I4)"
        assert_trained_as_sampled(ep, requests, returned)
        assert len(harness) == len(ep.turns), "each request of the harness is one turn"
        for (sent, answer), (_, c) in zip(harness, requests):
            ids = c.ids[:-1] if c.ids[-1:] == [tok.eos_token_id] else c.ids
            assert answer.content == tok.decode(ids) == ep.messages[len(sent)]["content"], (
                "the reply is what it sampled"
            )
        messages, reply = harness[-1]
        as_sent = [
            {"role": "user", "content": f"<result>\n{m['content']}\n</result>"} if m["role"] == "tool" else m
            for m in messages
        ]
        assert ep.messages == as_sent + [{"role": "assistant", "content": reply.content}]
        assert ep.row["agent_result"] == reply.content, "the harness's return value"
    masked = tok.decode(
        [i for i, m in zip(with_tools[0].samples[0].input_ids, with_tools[0].samples[0].loss_mask) if not m]
    )
    assert "<result>" in masked, "a tool result is context, mask 0"
    port = int(re.search(r":(\d+)/episodes/", next(iter(asked))).group(1))
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "the endpoint stopped with its rollout"


def rewriting_agent(row: dict, base_url: str) -> str:
    """A harness that edits its history before every request: a new system prompt each turn, and every tool result but
    the last summarised. Three turns, whatever the policy answers (a turn without a call gets a nudge as its result)."""
    import openai

    from tasks.toy_kv_agent import TOOL, run_tool

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    history = [{"role": "user", "content": row["prompt"]}]
    for k in range(3):
        last = max((i for i, m in enumerate(history) if m["role"] == "tool"), default=-1)
        older = [
            {**m, "content": "(looked up)"} if m["role"] == "tool" and i < last else m for i, m in enumerate(history)
        ]
        messages = [{"role": "system", "content": f"Turn {k + 1} of 3."}, *older]
        try:
            text = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
        except openai.APIStatusError as e:
            assert e.status_code == 410, e  # the trainer ended the episode (its max_env_steps, a cut turn)
            return "ended by the trainer"
        call = TOOL.search(text)
        history += [
            {"role": "assistant", "content": text},
            {"role": "tool", "content": run_tool(call.group(1)) if call else "Call lookup."},
        ]
    return text


def test_a_harness_that_rewrites_its_history_forks_and_each_sample_is_still_as_sampled(real_vllm, toy, tmp_path):
    """Every request of this harness changes what it sent before (its system prompt, its older tool results): each
    turn after the first forks a new sample, every sample holds its turns as the real server sampled them (I1), and
    the tokenization check, run on each sample before the harness's edit and at the episode's end, finds no mismatch."""
    model, tok = toy
    client = client_for(real_vllm, tmp_path, tok)
    serve(client, model, 31)
    calls, sampled = recording(client), sampled_per_episode(client)
    env = agent_env(real_vllm, tmp_path, tok, rewriting_agent, "max_env_steps=3")
    checked, check = [], env.chat.check_tokenization

    def checking(ep):
        checked.append((len(ep.samples), check(ep)))
        return checked[-1][1]

    env.chat.check_tokenization = checking
    eps = env.rollout([r for r in toy_kv.make_dataset(4, seed=4) for _ in range(2)], client)
    returned = wire_replies(calls)
    assert all(ep.end_reason != "agent_error" for ep in eps)
    assert sum(len(ep.turns) == 3 for ep in eps) >= len(eps) - 1, "three turns (a turn cut at max_tokens ends one)"
    for ep in eps:
        assert ep.forks == len(ep.turns) - 1 and len(ep.samples) == len(ep.turns), (
            "a new system prompt: no held text is a prefix of the next prompt"
        )
        assert_trained_as_sampled(ep, sampled[ep.session], returned)
        assert ep.tokenization_mismatches == 0
    assert sum(n for n, _ in checked) == sum(len(ep.samples) for ep in eps) and not any(f for _, f in checked), (
        "every sample checked once, none mismatched"
    )
    assert (
        env.stats()["agent/history_edits"]
        == sum(ep.forks for ep in eps)
        == M.rollout_metrics(eps)["rollout/forks"] * len(eps)
    )


def run_sh(args, env, timeout):
    """`bash run.sh ARGS`; however it ends, run.sh's process group and that of the torchrun it starts in a session of
    its own are stopped."""
    import signal

    proc = subprocess.Popen(
        ["bash", "run.sh", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                children = [int(pid) for pid in f.read().split()]
            stop_real_server(proc)  # SIGTERM: run.sh's trap stops the ranks; then whatever is left of its group
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    if os.getpgid(pid) == pid:  # torchrun, under setsid
                        os.killpg(pid, signal.SIGKILL)
    return proc.returncode, out, err


def test_the_agent_recipe_trains_through_run_sh_on_the_running_server(real_vllm, toy, tmp_path):
    """`MTGRPO_LAYOUT=server bash run.sh hf_recipes/toy/toy-kv-agent--mt-grpo.yaml --server-url URL`, 2 small steps on
    this file's server (run.sh starts none): the harness's episodes train, each sample's trained tokens are its
    assistant messages, nothing forks or mismatches, and every weight sync passes its check."""
    from tasks.toy_kv_agent import TOOL, run_tool

    model, tok = toy
    args = [
        AGENT,
        "--server-url",
        real_vllm.url,
        f"model_name_or_path={real_vllm.model_dir}",
        "model_builder=",
        "max_steps=2",
        "prompts_per_step=4",  # 32 episodes: some call the tool (the warm-started policy, about a quarter of them)
        "num_generations=4",
        "log_episodes_steps=1",
        "eval_steps=0",
        f"output_dir={tmp_path}/run",
        f"weight_sync_dir={tmp_path}/shm",
    ]
    try:
        code, out, err = run_sh(args, server_layout_env(M.free_port(), tmp_path / "none.log"), timeout=600)
    finally:
        serve(client_for(real_vllm, tmp_path, tok), model, 40)  # the warm-started weights again, for the tests after
    assert code == 0, out[-2000:] + err[-3000:]
    assert f"vLLM is healthy at {real_vllm.url}" in out and "torchrun: 1 training rank(s) on the CPU" in out
    assert not (tmp_path / "none.log").exists(), "run.sh started no server"
    metrics = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["rollout/forks"] == 0 and m["rollout/tokenization_mismatch"] == 0 and m["rollout/turns"] >= 1
        assert m["sync/probe_logprob_diff"] < M.Config.sync_check_max_diff and m["time/weight_sync"] > 0
        assert m["rollout/sampler_logprob_diff"] < 10 * AGREE
    episodes = [json.loads(x) for x in open(tmp_path / "run" / "episodes.jsonl")]
    assert len(episodes) == 32 and sum(ep["tool_calls"] for ep in episodes) > 0
    for ep in episodes:
        [s] = ep["samples"]
        trained = tok.decode([i for i, m in zip(s["input_ids"], s["loss_mask"]) if m], skip_special_tokens=True)
        assert trained == "".join(m["content"] for m in ep["messages"] if m["role"] == "assistant")
        for before, m in zip(ep["messages"], ep["messages"][1:]):
            if m["content"].startswith("<result>"):  # the harness's own tool ran (the recipe lists none)
                assert m["content"] == f"<result>\n{run_tool(TOOL.search(before['content']).group(1))}\n</result>"


def test_lora_through_run_sh_server_layout(toy_model_dir, tmp_path):
    """`MTGRPO_LAYOUT=server bash run.sh` on the toy recipe for 3 small steps with lora_rank > 0: run.sh starts vLLM
    with LoRA enabled, trains under torchrun and stops the server at the end. Every sync loads the step's adapter under
    a new name (never a full reload: that path is the session server's, above), requests sample from it, the probe
    check holds, and the run unloads its adapters at the end."""
    port = M.free_port()
    env = server_layout_env(port, tmp_path / "vllm.log")
    r = subprocess.run(
        [
            "bash",
            "run.sh",
            "hf_recipes/toy/toy-kv--mt-grpo.yaml",
            *moving_run(tmp_path, toy_model_dir),
            "model_builder=",
            "max_steps=3",
            "prompts_per_step=4",
            "num_generations=4",
            "eval_steps=0",
            f"output_dir={tmp_path}/run",
            f"weight_sync_dir={tmp_path}/shm",
            "lora_rank=4",
            "learning_rate=0.01",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = open(tmp_path / "vllm.log").read()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:] + log[-3000:]
    assert "vLLM is healthy at" in r.stdout and "torchrun: 1 training rank(s) on the CPU" in r.stdout
    assert "'enable_lora': True" in log and "'max_lora_rank': 8" in log, (
        "run.sh rounds lora_rank up to a rank vLLM takes"
    )
    metrics = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["loss/grad_norm"] > 0.01 for m in metrics)
    assert all(
        m["time/weight_sync"] > 0 and m["sync/probe_logprob_diff"] < M.Config.sync_check_max_diff for m in metrics
    )
    assert all(m["rollout/sampler_logprob_diff"] < 10 * AGREE for m in metrics)
    loaded = [line for line in log.splitlines() if "Loaded new LoRA adapter" in line]
    assert len(loaded) == 4 and all(f"-v{v}'" in line for v, line in enumerate(loaded)), "one adapter per sync, v0-v3"
    assert "Reloading weights" not in log, "the base weights are never sent"
    assert log.count("Removed LoRA adapter") == 4, "older adapters go after each sync, the rest when the run ends"
    assert "adapter_model.safetensors" in os.listdir(tmp_path / "run" / "checkpoint-3")
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "run.sh stopped the server when training ended"


# --- two real servers, started as `bash run.sh serve` starts them on a CPU (MTGRPO_VLLM_CPU_SERVERS=2) ---------


@pytest.fixture(scope="module")
def two_servers(toy_model_dir, tmp_path_factory):
    """Two vLLM CPU servers of the warm-started toy model, 1 GB of KV cache each, from one `bash run.sh serve`."""
    logs, port = tmp_path_factory.mktemp("two"), free_ports(2)
    env = server_layout_env(port, logs / "vllm.log", MTGRPO_VLLM_CPU_SERVERS="2", MTGRPO_VLLM_CPU_KVCACHE_GB="1")
    cmd = ["bash", "run.sh", "serve", "hf_recipes/toy/toy-kv--mt-grpo.yaml", f"model_name_or_path={toy_model_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stdout:  # run.sh says so once every server answers /health
            if line.startswith("[run.sh] serving at "):
                urls = line.split()[3].split(",")
                break
        else:
            pytest.fail(f"run.sh serve stopped (exit {proc.wait()}): {[f.read_text()[-2000:] for f in logs.iterdir()]}")
        assert urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
        yield urls, [str(logs / f"vllm-{p}.log") for p in (port, port + 1)]
    finally:
        stop_real_server(proc)


def wire(monkeypatch):
    """Every completion request the clients of this process send, as (server, body, reply)."""
    sent, real = [], M.VLLMServerClient.request

    def request(self, method, path, deadline=None, **kw):
        out = real(self, method, path, deadline, **kw)
        if path == "/v1/completions":
            sent.append((kw["server"].url, kw["json"], out))
        return out

    monkeypatch.setattr(M.VLLMServerClient, "request", request)
    return sent


def two_server_run(urls, model_dir, tmp_path, *overrides):
    return [
        f"model_name_or_path={model_dir}",
        "model_builder=",
        f"vllm_server_url={','.join(urls)}",
        f"weight_sync_dir={tmp_path}/shm",
        f"output_dir={tmp_path}/run",
        "prompts_per_step=4",
        "num_generations=4",
        "log_episodes_steps=0",
        "eval_steps=0",
        *overrides,
    ]


def test_a_run_on_two_real_servers_keeps_each_episode_on_one_and_checks_every_sync_on_both(
    two_servers, toy_model_dir, tmp_path, monkeypatch
):
    from transformers import AutoTokenizer

    urls, _ = two_servers
    sent = wire(monkeypatch)
    hist = M.train(M.load_config(TOY, two_server_run(urls, toy_model_dir, tmp_path, "max_steps=3")))
    turns = [(url, b["prompt"], c["token_ids"]) for url, b, r in sent if "n" in b for c in r["choices"]]
    assert {url for url, _, _ in turns} == set(urls), "both servers sampled"
    result = AutoTokenizer.from_pretrained(toy_model_dir).convert_tokens_to_ids("<result>")
    later = [(url, p) for url, p, _ in turns if result in p]  # turns after a tool result
    assert len(later) >= 8, "the warm-started policy looks up often enough for multi-turn episodes"
    for url, prompt in later:  # the turn before it: a prompt + completion it extends, on the same server
        before = [
            u for u, p, ids in turns if len(p) + len(ids) <= len(prompt) and prompt[: len(p) + len(ids)] == p + ids
        ]
        assert before and set(before) == {url}, "an episode's turns all go to one server"
    probes = [(url, b["cache_salt"].rsplit("-", 1)[1]) for url, b, _ in sent if "prompt_logprobs" in b]
    assert sorted(probes) == sorted((u, f"v{v}") for u in urls for v in range(4)), (
        "every sync (set-up, then after each of 3 steps) checked on both servers, once"
    )
    assert all(m["sync/servers_checked"] == 2 and m["sync/probe_logprob_diff"] < 0.05 for m in hist)
    assert all(m["rollout/server_balance"] > 0.6 and m["rollout/servers_lost"] == 0 for m in hist), hist


def test_killing_one_real_server_mid_run_leaves_the_run_finishing_on_the_other(two_servers, toy_model_dir, tmp_path):
    """(Kills one of the two servers: the last test to use them.)"""
    import signal

    urls, logs = two_servers
    args = two_server_run(urls, toy_model_dir, tmp_path, "max_steps=6", "save_steps=2")
    env = {**os.environ, "MTGRPO_VLLM_LOG": ",".join(logs)}
    cmd = [sys.executable, "mt_grpo_trainer.py", TOY, *args]
    trainer = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 600
    while (
        time.time() < deadline
        and trainer.poll() is None
        and len(metrics.read_text().splitlines() if metrics.exists() else []) < 2
    ):
        time.sleep(0.2)
    api = vllm_api_process(urls[1].rsplit(":", 1)[1])  # the second server's API process
    os.killpg(os.getpgid(api), signal.SIGKILL)  # its whole group, EngineCore and all
    out, err = trainer.communicate(timeout=600)
    assert trainer.returncode == 0, err[-3000:]
    hist = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [m["step"] for m in hist] == list(range(1, 7)) and (tmp_path / "run" / "checkpoint-6").is_dir()
    assert out.count(f"the vLLM server at {urls[1]} is down") == 1 and sum(m["rollout/servers_lost"] for m in hist) == 1
    after = [m for m in hist if m["rollout/servers_up"] == 1]  # from the step it was found down in
    assert len(after) >= 2 and all(m["rollout/server0_request_share"] == 1 for m in after[1:]), hist
    assert all(m["sync/servers_checked"] == 1 for m in after), "a server found down is not synced"


# --- the stand-in answers as the real server does: the same battery of requests against both ---------


def battery(model, vocab, max_len):
    ok = {
        "model": model,
        "prompt": [20, 21, 22, 23],
        "max_tokens": 4,
        "temperature": 1.0,
        "logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    c = "/v1/completions"
    return {
        "a valid request": ("POST", c, ok),
        "n > 1 and a stop string": ("POST", c, {**ok, "n": 3, "stop": ["</tool>"], "stop_token_ids": [1]}),
        "prompt_logprobs": ("POST", c, {**ok, "prompt_logprobs": 0}),
        "an unknown field is ignored": ("POST", c, {**ok, "return_tokens_ids": True}),
        "five stop strings": ("POST", c, {**ok, "stop": ["a", "b", "c", "d", "e"]}),
        "greedy with n > 1": ("POST", c, {**ok, "n": 2, "temperature": 0.0}),
        "top_p 0": ("POST", c, {**ok, "top_p": 0.0}),
        "negative temperature": ("POST", c, {**ok, "temperature": -1.0}),
        "logprobs over the cap": ("POST", c, {**ok, "logprobs": 25}),
        "a token id outside the vocabulary": ("POST", c, {**ok, "prompt": [20, vocab + 5]}),
        "an empty prompt": ("POST", c, {**ok, "prompt": []}),
        "a cache_salt with a slash": ("POST", c, {**ok, "cache_salt": "a/b"}),
        "an empty cache_salt": ("POST", c, {**ok, "cache_salt": ""}),
        "max_tokens over max_model_len": ("POST", c, {**ok, "max_tokens": max_len + 1}),
        "a prompt over max_model_len": ("POST", c, {**ok, "prompt": [20] * (max_len + 1)}),
        "prompt plus max_tokens over max_model_len (clamped)": (
            "POST",
            c,
            {**ok, "prompt": [20] * (max_len - 2), "max_tokens": 8},
        ),
        "another model": ("POST", c, {**ok, "model": "nope"}),
        "a float token id": ("POST", c, {**ok, "prompt": [20, 21.5]}),
        "a negative token id": ("POST", c, {**ok, "prompt": [20, -1]}),
        "models": ("GET", "/v1/models", None),
        "health": ("GET", "/health", None),
        "reset_prefix_cache": ("POST", "/reset_prefix_cache", None),
        "collective_rpc without a method": ("POST", "/collective_rpc", {}),
        "an unknown collective_rpc method": ("POST", "/collective_rpc", {"method": "frobnicate"}),
        "an unknown route": ("GET", "/nope", None),
    }


def ask(url, method, path, body):
    r = requests.request(method, url + path, json=body, timeout=60)
    try:
        data = r.json()
    except ValueError:
        data = None
    return r.status_code, data


def shape(status, data):
    """What a client may rely on: the status, the error's type and param, and the keys of a reply and its choices."""
    if status >= 400 and isinstance(data, dict) and "error" in data:
        return status, data["error"].get("type"), data["error"].get("param")
    if isinstance(data, dict) and isinstance(data.get("choices"), list):
        ch = data["choices"][0] if data["choices"] else {}
        return (
            status,
            sorted(data),
            sorted(ch),
            sorted(ch.get("logprobs") or {}),
            len(data["choices"]),
            [type(c.get("prompt_logprobs")).__name__ for c in data["choices"]],
            [len(c["token_ids"]) <= 8 for c in data["choices"] if c.get("token_ids") is not None],
        )
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        return status, sorted(data), sorted(data["data"][0])
    return status, sorted(data) if isinstance(data, dict) else data


def test_the_standin_answers_as_the_real_server_does(real_vllm):
    from tests.vllm_standin import StandinServer

    with StandinServer(real_vllm.model_dir, max_model_len=512, served_model_name=real_vllm.model_dir) as standin:
        cases = battery(real_vllm.model_dir, standin.vocab_size, 512)
        differ = {}
        for name, (method, path, body) in cases.items():
            real, ours = shape(*ask(real_vllm.url, method, path, body)), shape(*ask(standin.url, method, path, body))
            if real != ours:
                differ[name] = {"real vLLM": real, "stand-in": ours}
    assert not differ, json.dumps(differ, indent=1, default=str)


def test_a_failed_reload_stops_the_sync_at_once_and_the_standin_dies_as_vllm_does(
    real_vllm, toy, tmp_path, monkeypatch
):
    """vLLM 0.32 answers a reload that fails with a 500, and its model is then half-loaded: the next forward kills
    the engine. So the client never retries a reload; the stand-in must do as vLLM does. (This test kills the
    session's server: it comes last, and the fixture restarts the server for any test after it.)"""
    from tests.vllm_standin import StandinServer

    model, tok = toy
    monkeypatch.setattr(
        type(model), "save_pretrained", lambda self, path, **kw: os.makedirs(path)
    )  # a folder, no weights
    body = {"model": real_vllm.model_dir, "prompt": [20, 21, 22], "max_tokens": 2}
    with StandinServer(real_vllm.model_dir, max_model_len=512, served_model_name=real_vllm.model_dir) as standin:
        for srv in (real_vllm, standin):
            client = client_for(srv, tmp_path / srv.url.rsplit(":", 1)[1], tok)
            t = time.time()
            with pytest.raises(
                M.SamplerError, match=r"could not reload the weights of step 7 .*Cannot find any model weights"
            ):
                client.sync_weights(model, model.state_dict(), 7)
            assert time.time() - t < 20, "a failed reload is not retried"
            r = requests.post(srv.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 500 and "EngineCore encountered an issue" in r.json()["error"]["message"], srv.url


# --- a server other hosts may reach: vLLM's dev routes behind a front that asks for a token -------------------


def test_a_server_for_other_hosts_refuses_every_route_without_the_token(tiny_model_dir, tmp_path, monkeypatch):
    """`MTGRPO_VLLM_HOST` another host can reach, with `MTGRPO_VLLM_TOKEN`: `bash run.sh serve` puts vLLM (its CPU
    build, real) on that address with vllm_token.py's middleware in its app. From the other host every route, the
    dev-mode ones that change the weights included, answers 401 without the token or with a wrong one, and 256
    completions at once are all answered with it; with the token the trainer trains through it, weight syncs and
    their checks included; without it the trainer stops at once with one line."""
    token = "s3cret-for-this-test"
    with second_host() as (there, address):
        port = free_ports(1)
        log = tmp_path / "vllm.log"
        env = server_layout_env(port, log, MTGRPO_VLLM_HOST=address, MTGRPO_VLLM_TOKEN=token)
        cmd = ["bash", "run.sh", "serve", TOY, f"model_name_or_path={tiny_model_dir}", "model_builder="]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            served = next((line for line in proc.stdout if line.startswith("[run.sh] serving at ")), None)
            assert served, f"run.sh serve stopped (exit {proc.wait()}): {log.read_text()[-3000:]}"
            url = served.split()[3]
            only_the_token_gets_in(there, url, token)
            args = [
                f"model_name_or_path={tiny_model_dir}",
                "model_builder=",
                f"vllm_server_url={url}",
                f"weight_sync_dir={tmp_path}/shm",
                "prompts_per_step=2",
                "num_generations=2",
                "max_tokens=8",
                "max_steps=2",
                "log_episodes_steps=0",
            ]
            monkeypatch.delenv("MTGRPO_VLLM_TOKEN", raising=False)
            with pytest.raises(M.SamplerError, match="HTTP 401"):
                M.train(recipe_cfg(tmp_path / "without", *args))
            monkeypatch.setenv("MTGRPO_VLLM_TOKEN", token)
            hist = M.train(recipe_cfg(tmp_path / "with", *args))
            assert [h["step"] for h in hist] == [1, 2] and all(h["sync/servers_checked"] == 1 for h in hist)
        finally:
            stop_real_server(proc)


def test_a_mistral_model_with_a_sliding_window_trains_two_steps_through_the_real_server(tok, tmp_path):
    """A family other than Qwen and Llama, in the server layout: a random 2-layer Mistral (the toy tokenizer, a
    sliding window of 16 tokens, shorter than its prompts) served by vLLM's CPU build, 2 steps trained in packed rows
    with the window in the trie mask, each sync checked on the server. (A random model's logits are nearly flat, so
    the logprob agreement here does not show that vLLM applies the window as the trainer does: tests/test_models.py
    checks the trainer's window against transformers'.)"""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(**tiny_sizes(tok), num_hidden_layers=2, sliding_window=16)
    model_dir = tmp_path / "mistral"
    MistralForCausalLM(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    srv = start_real_server(str(model_dir), tmp_path / "vllm.log")
    try:
        cfg = recipe_cfg(
            tmp_path,
            moving_run(tmp_path, str(model_dir))[0],  # rewards 0, 1, 0, 1 in every group: the weights move
            f"model_name_or_path={model_dir}",
            "model_builder=",
            f"vllm_server_url={srv.url}",
            f"weight_sync_dir={tmp_path}/shm",
            "prompts_per_step=2",
            "num_generations=4",
            "max_tokens=24",
            "learning_rate=1e-3",
            "max_steps=2",
        )
        hist = M.train(cfg)
    finally:
        stop_real_server(srv.proc)
    assert [m["step"] for m in hist] == [1, 2]
    assert all(m["loss/grad_norm"] > 0 and m["sync/probe_change"] > 0 for m in hist), "every step moved the weights"
    assert all(m["sync/probe_logprob_diff"] < M.Config.sync_check_max_diff for m in hist), "and the server followed"
    assert all(m["rollout/sampler_logprob_diff"] < 10 * AGREE for m in hist), "sampler and trainer agree"
