"""Rollouts that overlap training (max_staleness), partial rollouts across a sync, and dynamic sampling
(filter_zero_spread_groups): against the stand-in server, in-process, and under torchrun."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

import mt_grpo_trainer as M
from tests.conftest import HANG_S, ROOT, recipe_cfg, until
from tests.vllm_standin import StandinServer


@pytest.fixture()
def server(tiny_model_dir):
    with StandinServer(tiny_model_dir) as srv:
        yield srv


def server_args(srv, tmp_path, tiny_model_dir, *extra):
    return [
        f"model_name_or_path={tiny_model_dir}",
        "model_builder=",
        f"vllm_server_url={srv.url}",
        f"weight_sync_dir={tmp_path}/shm",
        "prompts_per_step=2",
        "num_generations=2",
        "max_tokens=12",
        "log_episodes_steps=1",
        "eval_steps=0",
        *extra,
    ]


def episodes(run_dir):
    return [json.loads(x) for x in open(os.path.join(run_dir, "episodes.jsonl"))]


def trained_versions(ep):
    return [v for s in ep["samples"] for v, m in zip(s["versions"], s["loss_mask"]) if m]


def test_max_staleness_needs_a_server_and_sync_every_1(tmp_path, tiny_model_dir):
    common = [f"model_name_or_path={tiny_model_dir}", "model_builder=", "max_staleness=1", "max_steps=1"]
    with pytest.raises(
        M.ConfigError, match="max_staleness=1 needs a vLLM server .* in-process sampler shares the weights"
    ):
        M.train(recipe_cfg(tmp_path, *common))
    with pytest.raises(M.ConfigError, match="sync_every=1"):
        M.train(recipe_cfg(tmp_path, *common, "vllm_server_url=http://127.0.0.1:9", "sync_every=2"))
    with pytest.raises(M.ConfigError, match="max_staleness"):
        recipe_cfg(tmp_path, "max_staleness=9")


def test_max_staleness_0_trains_every_token_on_the_policy_that_sampled_it(server, tmp_path, tiny_model_dir):
    hist = M.train(recipe_cfg(tmp_path, *server_args(server, tmp_path, tiny_model_dir, "max_steps=3")))
    assert not [t for t in threading.enumerate() if t.name == "mt-grpo-rollouts"], "k = 0 runs no producer thread"
    for ep in episodes(tmp_path / "run"):
        assert set(trained_versions(ep)) <= {ep["step"] - 1}, "step s trains tokens of the weights after s - 1 updates"
    assert not [k for m in hist for k in m if "staleness" in k or "filter" in k or "draws" in k]


def test_max_staleness_1_overlaps_rollout_and_update_and_bounds_staleness(
    server, tmp_path, tiny_model_dir, monkeypatch
):
    """The overlap is an event, not a time: each update (but the last) waits until the producer has begun the next
    step's rollout, which only a producer running beside the update can do (run in turn, the run would hang, and
    `until` fails on a deadline that only catches a hang)."""
    collect = M.collect
    started = []  # the steps whose rollout began
    monkeypatch.setattr(M, "collect", lambda run, step: (started.append(step), collect(run, step))[1])
    update = M.train_on_samples
    updates = []

    def update_once_the_next_rollout_began(*a, **k):
        step = len(updates)  # collect's step of this update (0-based)
        updates.append(step)
        if step + 1 < 5:
            until(lambda: step + 1 in started, f"the rollout of step {step + 2} began during update {step + 1}")
        return update(*a, **k)

    monkeypatch.setattr(M, "train_on_samples", update_once_the_next_rollout_began)
    hist = M.train(
        recipe_cfg(tmp_path, *server_args(server, tmp_path, tiny_model_dir, "max_steps=5", "max_staleness=1"))
    )
    assert [m["step"] for m in hist] == [1, 2, 3, 4, 5] and updates == [0, 1, 2, 3, 4]
    assert all(m["rollout/staleness_max"] <= 1 for m in hist)
    assert max(m["rollout/staleness_mean"] for m in hist) > 0, "rollouts ran ahead of the update (off-policy by 1)"
    for ep in episodes(tmp_path / "run"):  # every trained token knows its version, and none is older than allowed
        assert all(ep["step"] - 2 <= v <= ep["step"] - 1 for v in trained_versions(ep))
    syncs = [r for r in server.requests if r["path"] == "/pause"]
    assert syncs and all(r["query"] == {"mode": "keep", "clear_cache": "false"} for r in syncs), (
        "a sync freezes requests in flight (partial rollouts) rather than aborting them"
    )
    assert not [t for t in threading.enumerate() if t.name == "mt-grpo-rollouts" and t.is_alive()]


def test_take_hands_back_every_group_and_the_staleness_of_every_trained_token():
    """take() at step 5 with k = 1 drops nothing (the permits keep tokens within k versions): a token from version 3,
    2 versions old, would be a bug in the permits, and shows in rollout/staleness_max instead of vanishing."""

    class FakeRun:
        cfg = M.Config(num_generations=2, max_staleness=1, max_steps=10)

    producer = M.RolloutProducer.__new__(M.RolloutProducer)
    producer.run, producer.k, producer.ready = FakeRun(), 1, queue.Queue()

    def ep(versions):
        s = M.Sample()
        s.append([1, 2], mask=0)
        for v in versions:
            s.append([7], mask=1, logprobs=[-1.0], turn=0, version=v)
        return M.Episode(row={}, messages=[], n_prompt_messages=0, samples=[s])

    groups = [ep([4, 4]), ep([5]), ep([4]), ep([3, 5])]  # trained tokens 1, 1, 0, 1, 2 and 0 versions old
    producer.ready.put((groups, {"time/rollout": 1.0}))
    taken, m = producer.take(5)
    assert taken == groups and "rollout/groups_dropped_stale" not in m
    assert m["rollout/staleness_max"] == 2 and m["rollout/staleness_mean"] == pytest.approx(5 / 6)


def test_a_sync_under_max_staleness_freezes_requests_and_salts_new_ones_before_the_resume(server, tiny, tmp_path):
    """Partial rollouts: a generation in flight at a sync is not aborted and sent again; it finishes, and keeps the
    version it was requested under (its oldest tokens); requests after the resume carry the new version's salt."""
    model, _ = tiny
    cfg = M.load_config(
        None,
        [
            f"vllm_server_url={server.url}",
            f"weight_sync_dir={tmp_path}/shm",
            f"output_dir={tmp_path}/run",
            "max_staleness=1",
        ],
    )
    client = M.VLLMServerClient(cfg, server.vocab_size, {server.eos_id})
    server.faults.hold()  # events, not times: the request is in flight (held) through the whole sync
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("c", client.generate([[5, 6, 7]], [8], 1.0)))
    worker.start()
    try:
        until(lambda: server.faults.busy() == 1, "the request reached the server")
        client.sync_weights(model, {k: v.detach() for k, v in model.state_dict().items()}, 1)
    finally:
        server.faults.release()
        worker.join(timeout=HANG_S)
    [c] = out["c"]
    assert c.version == 0 and c.finish_reason in ("stop", "length") and len(c.ids) >= 1
    paths = [r["path"] for r in server.requests]
    assert paths.count("/v1/completions") == 1, "the frozen request was not aborted and sent again"
    assert "/reset_prefix_cache" not in paths, "keep mode: the per-version salt, not a reset, keeps old KV out"
    [c2] = client.generate([[5, 6, 7]], [4], 1.0)
    assert c2.version == 1 and server.requests[-1]["body"]["cache_salt"].endswith("-v1")


SPREAD = (
    "def spread_for_some_keys(completions, key, **_):\n"
    "    # groups of rows whose key starts with a-m get rewards 0, 1, 0, 1 (spread); the others all 1 (none)\n"
    "    return [float(i % 2) if k[0] <= 'm' else 1.0 for i, k in enumerate(key)]\n"
)


@pytest.mark.parametrize("draws", [0, 3])
def test_dynamic_sampling_drops_groups_without_spread_and_draws_more(tmp_path, tiny_model_dir, draws):
    reward = tmp_path / "spread.py"
    reward.write_text(SPREAD)
    hist = M.train(
        recipe_cfg(
            tmp_path,
            f"model_name_or_path={tiny_model_dir}",
            "model_builder=",
            "max_steps=3",
            "prompts_per_step=4",
            "num_generations=2",
            "max_tokens=6",
            "log_episodes_steps=1",
            f"outcome_reward_funcs=[{reward}:spread_for_some_keys]",
            "turn_reward_funcs=[]",
            "filter_zero_spread_groups=true",
            f"max_filter_draws={draws}",
        )
    )
    eps = episodes(tmp_path / "run")
    for m in hist:
        step = [e for e in eps if e["step"] == m["step"]]
        assert len(step) == 8, "a step always trains prompts_per_step groups"
        flat = {e["group"] for e in step if e["messages"] and not any(e["advantages"])}
        assert m["rollout/extra_draws"] <= 4 * draws and m["rollout/groups_filtered"] >= len(flat)
        assert m["reward/outcome_before_filter"] >= m["reward/outcome"], (
            "filtered groups (all 1.0) count before the filter"
        )
        if draws == 0:
            assert m["rollout/extra_draws"] == 0 and len(flat) == m["rollout/groups_filtered"], "filled back in"
    if draws:
        assert sum(m["rollout/groups_filtered"] for m in hist) > 0 and sum(m["rollout/extra_draws"] for m in hist) > 0
        flat_trained = [e for e in eps if not any(e["advantages"])]
        assert len(flat_trained) < len(eps) / 4, "with redraws, most trained groups have spread"


def test_dynamic_sampling_off_changes_nothing(tmp_path, tiny_model_dir):
    common = [
        f"model_name_or_path={tiny_model_dir}",
        "model_builder=",
        "max_steps=2",
        "prompts_per_step=2",
        "num_generations=2",
        "max_tokens=6",
    ]
    a = M.train(recipe_cfg(tmp_path / "a", *common))
    b = M.train(recipe_cfg(tmp_path / "b", *common, "max_filter_draws=5"))
    strip = lambda h: [{k: v for k, v in m.items() if not k.startswith("time/")} for m in h]
    assert strip(a) == strip(b)


def test_a_resumed_run_with_staleness_rolls_out_the_same_prompts_as_an_unbroken_one(server, tmp_path, tiny_model_dir):
    """Prompts depend only on (seed, step, draw): the rollouts in flight at a save are regenerated after the resume,
    for the same prompts, so nothing is repeated or skipped."""
    args = server_args(server, tmp_path, tiny_model_dir, "max_staleness=1", "save_steps=2")
    M.train(recipe_cfg(tmp_path / "unbroken", *args, "max_steps=4"))
    M.train(recipe_cfg(tmp_path / "broken", *args, "max_steps=2"))
    M.train(recipe_cfg(tmp_path / "broken", *args, "max_steps=4", "resume_from_checkpoint=auto"))
    prompts = lambda d: [
        (e["step"], next(m["content"] for m in e["messages"] if m["role"] == "user")) for e in episodes(d / "run")
    ]
    assert prompts(tmp_path / "unbroken") == prompts(tmp_path / "broken")
    assert [e["step"] for e in episodes(tmp_path / "broken" / "run")] == [s for s in (1, 2, 3, 4) for _ in range(4)]


def test_a_reward_error_in_the_producer_ends_the_run_with_it(server, tmp_path, tiny_model_dir):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "calls = []\n\ndef reward(completions, **_):\n    calls.append(1)\n"
        "    if len(calls) == 3:\n        raise ValueError('reward exploded at its third call')\n"
        "    return [0.0] * len(completions)\n"
    )
    with pytest.raises(M.RewardError, match="reward exploded at its third call"):
        M.train(
            recipe_cfg(
                tmp_path,
                *server_args(
                    server,
                    tmp_path,
                    tiny_model_dir,
                    "max_steps=6",
                    "max_staleness=1",
                    f"outcome_reward_funcs=[{bad}:reward]",
                ),
            )
        )
    time.sleep(0.5)
    assert not [t for t in threading.enumerate() if t.name == "mt-grpo-rollouts" and t.is_alive()]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_with_staleness_saves_and_exits_without_waiting_for_the_producer(
    server, tmp_path, tiny_model_dir, sig
):
    server.faults.set_latency(0.3)
    run = tmp_path / "run"
    p = subprocess.Popen(
        [
            sys.executable,
            "mt_grpo_trainer.py",
            "hf_recipes/toy/toy-kv--mt-grpo.yaml",
            f"output_dir={run}",
            *server_args(server, tmp_path, tiny_model_dir, "max_steps=200", "max_staleness=2"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text()):
        time.sleep(0.2)
    p.send_signal(getattr(signal, sig))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-2000:]
    steps = len((run / "metrics.jsonl").read_text().splitlines())
    assert f"{sig}: stopped after step {steps}" in out and "Traceback" not in err
    assert (run / f"checkpoint-{steps}" / "trainer_state.pt").is_file()


def test_under_torchrun_each_rank_runs_its_own_producer(server, tmp_path, tiny_model_dir):
    from tests.test_distributed import torchrun

    run = tmp_path / "run"
    r = torchrun(
        [
            "mt_grpo_trainer.py",
            "hf_recipes/toy/toy-kv--mt-grpo.yaml",
            f"output_dir={run}",
            *server_args(server, tmp_path, tiny_model_dir, "max_steps=3", "max_staleness=1", "save_steps=0"),
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    hist = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(hist) == 3 and all(m["rollout/staleness_max"] <= 1 for m in hist)
    assert sorted({e["episode"] for e in episodes(run) if e["step"] == 3}) == [0, 1, 2, 3], "both ranks' groups"


def test_max_staleness_0_is_the_plain_sequential_loop_step_for_step(tmp_path, tiny_model_dir):
    """train() at the default against the loop written out by hand: rollout, reward, advantage, update, in turn."""
    reward = tmp_path / "spread.py"
    reward.write_text(SPREAD)
    common = [
        f"model_name_or_path={tiny_model_dir}",
        "model_builder=",
        "max_steps=3",
        "prompts_per_step=2",
        "num_generations=4",
        "max_tokens=8",
        "learning_rate=0.05",
        f"turn_reward_funcs=[{reward}:spread_for_some_keys]",
    ]
    hist = M.train(recipe_cfg(tmp_path / "a", *common))
    run = M.setup(recipe_cfg(tmp_path / "b", *common))
    by_hand = []
    for step in range(3):
        eps = run.env.rollout(run.batch(step), run.sampler, run.generator(step))
        turn_R = M.score(eps, run.turn_fns, run.turn_w, run.cfg.reward_timeout, per_turn=True)
        M.assign_advantages(eps, turn_R, M.score(eps, run.outcome_fns, run.outcome_w, run.cfg.reward_timeout), run.cfg)
        samples, _ = M.trainable_samples(eps, run.cfg)
        m = M.train_on_samples(run.policy, run.ref_model, run.optimizer, run.scheduler, samples, run.cfg, run.pad_id)
        by_hand.append({**m, **M.episode_metrics(eps)})
    run.rollouts.close()
    run.close([])
    for h, m in zip(hist, by_hand):
        assert {k: h[k] for k in m} == m
    assert len({h["loss/grad_norm"] for h in hist}) == 3, "the steps differ, so equality means something"


def test_an_exception_in_one_ranks_producer_ends_every_rank(server, tmp_path, tiny_model_dir):
    from tests.test_distributed import torchrun

    bad = tmp_path / "bad_reward.py"
    bad.write_text(
        "import os\n\ncalls = []\n\ndef reward(completions, **kw):\n    calls.append(1)\n"
        "    if os.environ.get('RANK') == '1' and len(calls) == 3:\n"
        "        raise RuntimeError('reward exploded on rank 1 in the producer')\n"
        "    return [0.0] * len(completions)\n"
    )
    t = time.time()
    r = torchrun(
        [
            "mt_grpo_trainer.py",
            "hf_recipes/toy/toy-kv--mt-grpo.yaml",
            f"output_dir={tmp_path}/run",
            *server_args(
                server,
                tmp_path,
                tiny_model_dir,
                "max_steps=8",
                "max_staleness=1",
                "distributed_timeout=60",
                f"outcome_reward_funcs=[{bad}:reward]",
            ),
        ],
        timeout=200,
    )
    assert r.returncode != 0 and "reward exploded on rank 1 in the producer" in r.stderr, r.stderr[-3000:]
    assert time.time() - t < 150, "the healthy rank must not wait out the collective timeout"
