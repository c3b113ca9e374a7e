"""Several vLLM servers, against stand-ins (tests/vllm_standin.py): the recipe key, session affinity and load balance,
latency, a slow server, weight sync to every server with its check, LoRA on all of them, and a server that dies and
is taken back once restarted. The same against two real vLLM CPU servers is in tests/test_real_vllm.py."""

import contextlib
import json
import os
import threading
import time

import pytest

import mt_grpo_trainer as M
from bench.rollout_throughput import scripted_backend
from tests.conftest import HANG_S, recipe_cfg, until
from tests.test_vllm_client import completions, standin_process, trainer_against, wait_for
from tests.vllm_standin import StandinServer
from tools.kv_lookup import lookup


@contextlib.contextmanager
def scripted_servers(tok, n, latency=0.0, capacity=0):
    """n stand-ins answering tool call, tool call, answer (3 turns an episode), after `latency` s, `capacity`
    sequences at a time."""
    with contextlib.ExitStack() as stack:
        servers = []
        for _ in range(n):
            srv = StandinServer(backend=scripted_backend(tok), vocab_size=len(tok), max_model_len=4096)
            servers.append(stack.enter_context(srv))
            srv.faults.set_latency(latency, capacity)
        yield servers


def client_for(tmp_path, servers, *overrides):
    urls = ",".join(s.url for s in servers)
    cfg = recipe_cfg(tmp_path, f"vllm_server_url={urls}", "max_seq_len=4096", "tokenization_check=off", *overrides)
    return M.VLLMServerClient(cfg, servers[0].vocab_size, {servers[0].vocab_size - 1})


def rows(groups, per_group):
    return [
        {"prompt": f'What is "k{i}"?', "key": "alpha", "answer": "x"} for i in range(groups) for _ in range(per_group)
    ]


def moved(servers):
    """Requests whose prompt extends one sent to another server: an episode (or a branch) that changed server."""
    sent = [(i, r["body"]["prompt"]) for i, srv in enumerate(servers) for r in completions(srv)]
    return [(i, j) for i, p in sent for j, q in sent if i != j and len(q) < len(p) and p[: len(q)] == q]


def test_the_recipe_names_one_server_or_several(tmp_path):
    assert recipe_cfg(tmp_path, "vllm_server_url=http://a:8000").vllm_server_url == ["http://a:8000"]
    both = ["http://a:8000", "http://b:8000/"]
    assert recipe_cfg(tmp_path, "vllm_server_url=http://a:8000, http://b:8000/").vllm_server_url == both
    (tmp_path / "r.yaml").write_text("vllm_server_url: [http://a:8000, http://b:8000/]\n")
    assert M.load_config(str(tmp_path / "r.yaml")).vllm_server_url == both
    assert recipe_cfg(tmp_path, "vllm_server_url=").vllm_server_url == []
    for bad in ("a:8000", "http://a:8000,http://a:8000", "http://a:8000/v1"):
        with pytest.raises(M.ConfigError, match=r"vllm_server_url: '.*' is not a server URL or is there twice"):
            recipe_cfg(tmp_path, f"vllm_server_url={bad}")


def test_an_episode_stays_on_one_server_new_ones_spread_and_the_shares_are_logged(tok, tmp_path):
    # 0.5 s a request: every group's first turn is in flight before any returns, so "the fewest in flight" alternates.
    # Answered at once, on a loaded machine a server could be free again before the next group was routed.
    with scripted_servers(tok, 2, latency=0.5) as servers:
        client = client_for(tmp_path, servers)
        env = M.MultiTurnToolEnv(tok, [lookup], client.cfg)
        eps = env.rollout(rows(8, 4), client)
        assert all(len(ep.turns) == 3 for ep in eps)
        assert moved(servers) == [], "every turn of an episode went to the server of its first turn"
        assert [sum(r["body"]["n"] for r in completions(s) if r["body"]["n"] > 1) for s in servers] == [16, 16], (
            "a group's first turn is one request: 4 groups of 4 episodes to each server"
        )
        m = client.stats()
        print(m)
        assert m["rollout/servers_up"] == 2 and m["rollout/servers_lost"] == 0
        assert all(0.4 < m[f"rollout/server{i}_{k}_share"] < 0.6 for i in (0, 1) for k in ("request", "token"))
        assert m["rollout/server_balance"] > 0.8
        assert client.stats()["rollout/server0_request_share"] == 0, "counted since the last call"
        for srv in servers:
            srv.requests.clear()
        tree = ["branch_width=2", "branch_depth=1", "advantage_mode=tree", "num_generations=4"]
        env = M.MultiTurnToolEnv(tok, [lookup], client_for(tmp_path, servers, *tree).cfg)
        eps = env.rollout(rows(4, 2), client)  # 2 roots a prompt, each branching in 2 at its first tool result
        assert len(eps) == 16 and len({ep.session for ep in eps}) == 8
        assert moved(servers) == [], "a branch stays on its root's server"
        assert all(completions(s) for s in servers)


def test_two_servers_run_twice_the_sequences_at_once_of_one(tok, tmp_path):
    """Latency-bound rollouts go faster on more servers because more sequences run at once. A counter, not a clock:
    each server runs 8 sequences at a time and holds them at its gate; 16 groups of 4 fill both servers (8 + 8 held
    at once) before any is answered. Were new groups not spread, the second would stay empty and `until` would fail
    on its deadline, which only catches a hang."""
    with scripted_servers(tok, 2, capacity=8) as servers:
        client = client_for(tmp_path, servers)
        env = M.MultiTurnToolEnv(tok, [lookup], client.cfg)
        for srv in servers:
            srv.faults.hold()
        out = {}
        worker = threading.Thread(target=lambda: out.setdefault("eps", env.rollout(rows(16, 4), client)))
        worker.start()
        try:
            until(lambda: [s.faults.busy() for s in servers] == [8, 8], "both servers full at once")
        finally:
            for srv in servers:
                srv.faults.release()
            worker.join(timeout=HANG_S)
        assert len(out["eps"]) == 64 and all(len(ep.turns) == 3 for ep in out["eps"])


def test_a_slow_server_is_not_down_keeps_its_sessions_and_new_ones_go_to_the_free_one(tok, tmp_path):
    """Events, not a clock: the slow server holds its requests at its gate until released, and the test waits for
    counts (`until` fails only on a hang)."""
    with scripted_servers(tok, 2) as (slow, fast):
        slow.faults.hold()
        client, said = client_for(tmp_path, [slow, fast]), []
        client.say = said.append
        prompts = [[5, 6, i] for i in range(8)]
        first = threading.Thread(target=client.generate, args=(prompts[:4], [4] * 4), kwargs={"sessions": [1, 2, 3, 4]})
        first.start()
        try:
            # the fast server answered its two; the slow one holds two in flight
            until(lambda: len(fast.replies) == 2 and slow.faults.busy() == 2, "2 answered, 2 held")
            assert [len(completions(s)) for s in (slow, fast)] == [2, 2]
            for i in range(4, 8):  # new sessions, one at a time: to the server with fewer in flight
                client.generate([prompts[i]], [4], sessions=[i + 1])
        finally:
            slow.faults.release()
            first.join(timeout=HANG_S)
        assert [len(completions(s)) for s in (slow, fast)] == [2, 2 + 4]
        client.generate([p + [9] for p in prompts[:4]], [4] * 4, sessions=[1, 2, 3, 4])  # their next turns
        assert [len(completions(s)) for s in (slow, fast)] == [2 + 2, 6 + 2], "each session stays where it was"
        assert client.stats()["rollout/servers_lost"] == 0 and not said, "slow is not down"


def test_every_sync_reaches_every_server_at_once_and_each_is_checked(tiny_model_dir, tmp_path):
    with StandinServer(tiny_model_dir) as a, StandinServer(tiny_model_dir) as b:
        common = [
            f"model_name_or_path={tiny_model_dir}",
            "model_builder=",
            f"vllm_server_url={a.url},{b.url}",
            f"weight_sync_dir={tmp_path}/shm",
            "prompts_per_step=4",
            "num_generations=2",
            "max_tokens=12",
            "max_steps=2",
            "max_staleness=1",
        ]
        hist = M.train(recipe_cfg(tmp_path, *common))
        calls = sorted((r["time"], r["path"], s) for s in (a, b) for r in s.requests if r["path"] != "/v1/completions")
    for srv in (a, b):
        assert srv.reloads == 3, "set-up, then after each step"
        assert [r["query"]["mode"] for r in srv.requests if r["path"] == "/pause"] == ["keep"] * 3, "partial rollouts"
        probes = [r["cache_salt"] for r in completions(srv) if "-probe-" in r["cache_salt"]]
        assert [p.split("-")[-1] for p in probes] == ["v0", "v1", "v2"], "each server checked, once a sync"
    syncs = [path for _, path, _ in calls if path in ("/pause", "/collective_rpc", "/resume")]
    assert syncs == ["/pause", "/pause", "/collective_rpc", "/collective_rpc", "/resume", "/resume"] * 3, (
        "both servers pause before either reloads, and resume once both hold the weights"
    )
    assert all(m["sync/servers_checked"] == 2 and m["rollout/servers_up"] == 2 for m in hist)
    assert all(any("-probe-" not in r["cache_salt"] for r in completions(s)) for s in (a, b)), "both sampled"


def test_lora_adapters_load_on_every_server_and_leave_every_server(tmp_path, monkeypatch):
    calls = []

    def request(self, method, path, **kw):
        calls.append((kw["server"].url, path, (kw.get("json") or {}).get("lora_name")))
        return {"data": [{"id": "base", "max_model_len": 64}]} if path == "/v1/models" else {"text": ""}

    monkeypatch.setattr(M.VLLMServerClient, "request", request)
    adapter = type("Adapter", (), {"save_pretrained": lambda self, path, state_dict: os.makedirs(path)})()
    urls = "http://127.0.0.1:9,http://127.0.0.1:10"
    cfg = recipe_cfg(tmp_path, f"vllm_server_url={urls}", f"weight_sync_dir={tmp_path}/shm", "lora_rank=4")
    client = M.VLLMServerClient(cfg, 100)
    for version in (1, 2, 3):
        client.sync_weights(adapter, {}, version)
    client.close()
    for url in urls.split(","):
        mine = [(path, name[-2:]) for u, path, name in calls if u == url and path != "/v1/models"]
        loads = [("/v1/load_lora_adapter", f"v{v}") for v in (1, 2, 3)]
        assert mine == loads[:3] + [("/v1/unload_lora_adapter", "v1")] + [
            ("/v1/unload_lora_adapter", f"v{v}") for v in (3, 2)
        ], mine
    assert "/pause" not in [path for _, path, _ in calls]


def test_the_other_ranks_take_a_server_back_one_sync_after_it_answers_again(tiny_model_dir, tmp_path):
    """Rank 0 syncs every server that answers at its sync; a rank that follows takes a server it found down back only
    if it answered at its previous sync too: by then rank 0 has surely synced it."""
    with StandinServer(tiny_model_dir) as a, StandinServer(tiny_model_dir) as b:
        cfg = recipe_cfg(tmp_path, f"vllm_server_url={a.url},{b.url}")
        rank1 = M.VLLMServerClient(cfg, a.vocab_size)
        _, down = rank1.servers
        down.down_since = time.monotonic()
        for version, back in ((1, False), (2, True), (3, True)):
            down.checked = -1e9  # no 2-second memory of the last /health between these calls
            rank1.sync_weights(None, None, version)
            assert (down.down_since is None, down.version == version == rank1.policy_version) == (back, back)
        b.faults.set_engine_dead()  # /health fails: never taken back
        down.down_since, down.checked = time.monotonic(), -1e9
        for version in (4, 5):
            rank1.sync_weights(None, None, version)
            down.checked = -1e9
        assert down.down_since is not None and down.version == 3


def test_a_server_that_dies_is_left_and_once_restarted_is_synced_and_sampled_from_again(tiny_model_dir, tmp_path):
    (a, url_a, _), (b, url_b, _) = (standin_process(tiny_model_dir, tmp_path, name) for name in ("a", "b"))
    trainer = trainer_against(f"{url_a},{url_b}", tiny_model_dir, tmp_path, logs="a.log,b.log")
    try:
        wait_for(tmp_path / "run" / "checkpoint-2")
        b.kill()
        metrics = tmp_path / "run" / "metrics.jsonl"
        lines = lambda: [json.loads(x) for x in metrics.read_text().splitlines()]
        deadline = time.time() + 60
        while time.time() < deadline and not any(m["rollout/servers_up"] == 1 for m in lines()):
            time.sleep(0.2)
        killed_at = len(lines())
        b, _, _ = standin_process(tiny_model_dir, tmp_path, "b-again", port=int(url_b.rsplit(":", 1)[1]))
        deadline = time.time() + 120
        while time.time() < deadline and not any(m["rollout/server1_request_share"] > 0 for m in lines()[killed_at:]):
            time.sleep(0.2)
        trainer.terminate()  # SIGTERM: finish the step, save, stop
        out, err = trainer.communicate(timeout=120)
    finally:
        for p in (a, b, trainer):
            p.kill()
    assert trainer.returncode == 0, err[-3000:]
    hist = lines()
    assert sum(m["rollout/servers_lost"] for m in hist) == 1 and out.count(f"the vLLM server at {url_b} is down") == 1
    gone = [m for m in hist[killed_at:] if m["rollout/servers_up"] == 1]
    back = [m for m in hist[killed_at:] if m["rollout/server1_request_share"] > 0]
    assert gone and all(m["rollout/server0_request_share"] == 1 for m in gone), "the run went on on the other"
    assert back and all(m["sync/servers_checked"] == 2 for m in back), "synced, checked, sampled from again"
