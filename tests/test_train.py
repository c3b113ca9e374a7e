"""The whole loop: the default recipe end to end, the episode dump's schema, resume equality, wandb offline."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import mt_grpo_trainer as M
from conftest import ROOT, recipe_cfg

VARYING_REWARD = '''
def length_parity(completions, **_):
    """Turn reward that varies between episodes, so a random model still gets a learning signal."""
    return [float(len(c[0]["content"]) % 2) for c in completions]
'''


def check_episode_record(rec, tok):
    assert {"messages", "rewards", "turn_reward", "outcome_reward", "advantages", "first_result_turn", "samples",
            "end_reason"} <= set(rec)
    assistant = "".join(m["content"] for m in rec["messages"] if m["role"] == "assistant")
    for s in rec["samples"]:
        n = len(s["input_ids"])
        assert len(s["loss_mask"]) == len(s["sampler_logprobs"]) == len(s["advantages"]) == len(s["turn_idx"]) == n
        for t, m, a, lp in zip(s["turn_idx"], s["loss_mask"], s["advantages"], s["sampler_logprobs"]):
            if not m:
                assert a == 0 and lp == 0 and t == -1
            else:
                assert a == rec["advantages"][t] and lp <= 0, "a token's advantage is its turn's"
        # what was trained decodes to text the model wrote (its EOS aside)
        trained = tok.decode([i for i, m in zip(s["input_ids"], s["loss_mask"]) if m]).replace(tok.eos_token, "")
        assert trained.replace("\n", "") in assistant.replace("\n", "")


def test_default_recipe_runs_two_steps_from_the_command_line(tmp_path, toy_model_dir):
    """`bash run.sh`'s recipe, as a user runs it: trains, dumps, checkpoints. The model is the one the recipe's
    builder made (toy_model_dir, built by the same build_model_if_missing), whose report the run prints."""
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "mt_grpo_trainer.py", "hf_recipes/toy/toy-kv--mt-grpo.yaml", "max_steps=2",
                        f"model_name_or_path={toy_model_dir}", f"output_dir={run}", "log_episodes_steps=1"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "supervised warm-start of 300 steps" in r.stdout and "before/after" in r.stdout and str(run) in r.stdout
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0 <= m["reward/outcome"] <= 1 and m["rollout/sampled_tokens"] > 0 for m in metrics)
    saved = M.load_config(str(run / "config.yaml"))            # the resolved config reloads as a recipe
    assert saved.max_steps == 2 and saved.output_dir == str(run)
    ck = run / "checkpoint-2"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "trainer_state.pt"):
        assert (ck / f).is_file(), f
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(ck)
    recs = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    assert len(recs) == 2 * 64 and {r["step"] for r in recs} == {1, 2}
    for rec in recs:
        check_episode_record(rec, tok)


def run_cfg(tmp_path, model_dir, name, *extra):
    reward = tmp_path / "varying.py"
    reward.write_text(VARYING_REWARD)
    return recipe_cfg(tmp_path, f"model_name_or_path={model_dir}", "model_builder=", f"output_dir={tmp_path}/{name}",
                      f"turn_reward_funcs=[{reward}:length_parity]", "learning_rate=0.01", "prompts_per_step=2",
                      "num_generations=4", "max_tokens=12", "log_episodes_steps=0", *extra)


def test_a_missing_model_is_built_whole_or_not_at_all(tmp_path, capsys, monkeypatch):
    """model_builder runs into a temp folder that is renamed when it returns: a builder that fails leaves no model
    folder (the next run builds again), one that succeeds leaves the folder and its report, printed. (The toy model
    the other tests share is cached across runs, so this path is tested here on its own.)"""
    (tmp_path / "builder.py").write_text(
        "import json, os\n"
        "def build(path, system_prompt):\n"
        "    if os.environ.get('BUILD_FAILS'):\n"
        "        open(os.path.join(path, 'half'), 'w').close()\n"
        "        raise RuntimeError('out of disk')\n"
        "    json.dump({'builder': 'builder.py', 'params': 7, 'summary': 'prompt ' + repr(system_prompt[:5])},\n"
        "              open(os.path.join(path, 'build_report.json'), 'w'))\n")
    model = tmp_path / "model"
    cfg = recipe_cfg(tmp_path, f"model_name_or_path={model}", f"model_builder={tmp_path}/builder.py:build",
                     "system_prompt=Tools: {tools}")
    monkeypatch.setenv("BUILD_FAILS", "1")
    with pytest.raises(M.ConfigError, match=r"model builder .* failed: RuntimeError: out of disk \(.*builder.py, line 5\)"):
        M.build_model_if_missing(cfg, print)
    assert not model.exists() and not (tmp_path / "model.tmp").exists()
    monkeypatch.delenv("BUILD_FAILS")
    M.build_model_if_missing(cfg, print)
    assert sorted(os.listdir(model)) == ["build_report.json"] and not (tmp_path / "model.tmp").exists()
    assert "model built by builder.py: 7 params; prompt 'Tools'" in capsys.readouterr().out


def test_resumed_run_matches_an_uninterrupted_one(tmp_path, tiny_model_dir):
    full = M.train(run_cfg(tmp_path, tiny_model_dir, "full", "max_steps=3", "save_steps=2"))
    resumed = M.train(run_cfg(tmp_path, tiny_model_dir, "resumed", "max_steps=3",
                              f"resume_from_checkpoint={tmp_path}/full/checkpoint-2"))
    assert len(resumed) == 1 and resumed[0]["step"] == 3
    assert full[1]["loss/grad_norm"] > 0                        # the run really updated the model
    for k in ("reward/turn", "loss/policy", "loss/grad_norm", "rollout/sampled_tokens"):
        assert resumed[0][k] == pytest.approx(full[2][k], rel=1e-5, abs=1e-7), k
    a = load_file(f"{tmp_path}/full/checkpoint-3/model.safetensors")
    b = load_file(f"{tmp_path}/resumed/checkpoint-3/model.safetensors")
    two = load_file(f"{tmp_path}/full/checkpoint-2/model.safetensors")
    assert any(not torch.equal(a[k], two[k]) for k in a)      # step 3 changed the weights ...
    for k in a:                                                # ... identically in both runs
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
    # resuming into the same folder redoes step 3: its log lines are replaced, not duplicated
    M.train(run_cfg(tmp_path, tiny_model_dir, "full", "max_steps=3", f"resume_from_checkpoint={tmp_path}/full/checkpoint-2"))
    steps = [json.loads(line)["step"] for line in open(f"{tmp_path}/full/metrics.jsonl")]
    assert steps == [1, 2, 3]
    # auto: picks the newest complete checkpoint of output_dir; a finished run has nothing left to do
    auto = M.train(run_cfg(tmp_path, tiny_model_dir, "full", "max_steps=4", "resume_from_checkpoint=auto"))
    assert [h["step"] for h in auto] == [4]


def test_resume_applies_a_changed_learning_rate_schedule_and_adamw_and_says_so(tmp_path, tiny_model_dir, capsys):
    """The recipe's values are the ones used (and the ones config.yaml records), not the checkpoint's run's."""
    M.train(run_cfg(tmp_path, tiny_model_dir, "run", "max_steps=2", "lr_scheduler=linear"))   # lr 0.01, down to 0 at step 2
    cfg = run_cfg(tmp_path, tiny_model_dir, "run", "max_steps=4", "lr_scheduler=linear", "learning_rate=0.02",
                  "weight_decay=0.1", "adam_betas=[0.8,0.99]", "resume_from_checkpoint=auto")
    run = M.setup(cfg)
    try:
        assert run.start == 2 and run.scheduler.base_lrs == [0.02]
        g = run.optimizer.param_groups[0]
        assert g["lr"] == pytest.approx(0.02 * (1 - 2 / 4)), "step 3's rate, on the new schedule"
        assert g["initial_lr"] == 0.02 and g["weight_decay"] == 0.1 and g["betas"] == (0.8, 0.99)
        assert run.optimizer.state, "the moments were restored"
    finally:
        run.rollouts.close()
        run.close([])
    assert ("the recipe changes learning_rate 0.01 -> 0.02, max_steps 2 -> 4, weight_decay 0.0 -> 0.1, adam_betas "
            "[0.9, 0.999] -> [0.8, 0.99]") in capsys.readouterr().out
    hist = M.train(cfg)
    assert [h["loss/lr"] for h in hist] == pytest.approx([0.02 * (1 - 3 / 4), 0.0])
    assert M.load_config(f"{tmp_path}/run/config.yaml").learning_rate == 0.02


def test_resume_from_a_missing_checkpoint_is_a_clear_error(tmp_path, tiny_model_dir):
    with pytest.raises(M.ConfigError, match="no checkpoint at"):
        M.train(run_cfg(tmp_path, tiny_model_dir, "x", f"resume_from_checkpoint={tmp_path}/nope"))


def test_wandb_offline(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    h = M.train(run_cfg(tmp_path, tiny_model_dir, "wb", "max_steps=2", "report_to=wandb", "beta=0.1"))
    assert h[0]["loss/kl"] == 0.0 < h[1]["loss/kl"]    # KL to the frozen reference: 0 at first, then it grows
    runs = [d for d in os.listdir(tmp_path / "wb" / "wandb") if d.startswith("offline-run")]
    assert runs, "no offline wandb run was written"


def test_a_fresh_run_moves_an_earlier_run_aside(tmp_path, tiny_model_dir):
    common = [f"model_name_or_path={tiny_model_dir}", "model_builder=", "max_steps=1", "prompts_per_step=2",
              "num_generations=2", "max_tokens=8"]
    M.train(recipe_cfg(tmp_path, *common))
    M.train(recipe_cfg(tmp_path, *common, "seed=1"))
    runs = sorted(p.name for p in tmp_path.iterdir())
    assert runs[0] == "run" and len(runs) == 2 and runs[1].startswith("run.")
    for name in runs:   # each folder holds one run: one metrics line, its own config
        assert len((tmp_path / name / "metrics.jsonl").read_text().splitlines()) == 1
    assert "seed: 1" in (tmp_path / "run" / "config.yaml").read_text()


def start_long_run(tmp_path, tiny_model_dir, *overrides, script=("mt_grpo_trainer.py",)):
    import subprocess
    import sys
    import time
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, *script, "hf_recipes/toy/toy-kv--mt-grpo.yaml",
                          f"model_name_or_path={tiny_model_dir}", "model_builder=", f"output_dir={run}", "max_steps=200",
                          "prompts_per_step=2", "num_generations=2", "max_tokens=8", "save_steps=0", *overrides],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text()):
        time.sleep(0.2)
    return p, run


def wait_for_file(path, timeout=120):
    import time
    deadline = time.time() + timeout
    while time.time() < deadline and not path.exists():
        time.sleep(0.1)
    assert path.exists(), f"{path} never appeared"


def kill_group(p):
    import signal
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_sigterm_or_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path, tiny_model_dir, sig):
    import signal
    p, run = start_long_run(tmp_path, tiny_model_dir)
    try:
        p.send_signal(getattr(signal, sig))
        out, err = p.communicate(timeout=60)
    finally:
        kill_group(p)
    assert p.returncode == 0, err[-2000:]
    steps = len((run / "metrics.jsonl").read_text().splitlines())
    assert 1 <= steps < 200 and f"{sig}: stopped after step {steps}" in out and "Traceback" not in err
    assert (run / f"checkpoint-{steps}" / "trainer_state.pt").is_file()
    hist = M.train(recipe_cfg(tmp_path, f"model_name_or_path={tiny_model_dir}", "model_builder=", f"max_steps={steps + 1}",
                              "prompts_per_step=2", "num_generations=2", "max_tokens=8", "resume_from_checkpoint=auto"))
    assert [h["step"] for h in hist] == [steps + 1]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_while_a_reward_function_hangs_saves_the_last_step_and_exits(tmp_path, tiny_model_dir, sig):
    """The reward function never returns (reward_timeout is far off): the signal ends the wait at once; the step is
    dropped and the one before it saved, since the weights have not changed since then."""
    import signal
    import time
    hang = tmp_path / "hang.py"
    hang.write_text(f"import threading\n\ncalls = []\n\n\ndef hang(completions, **_):\n    calls.append(1)\n"
                    f"    if len(calls) == 3:   # check_rewards, step 1, then step 2\n"
                    f"        open({str(tmp_path / 'hanging')!r}, 'w').close()\n        threading.Event().wait()\n"
                    f"    return [0.0] * len(completions)\n")
    p, run = start_long_run(tmp_path, tiny_model_dir, f"turn_reward_funcs=[{hang}:hang]", "reward_timeout=600")
    try:
        wait_for_file(tmp_path / "hanging")
        t = time.time()
        p.send_signal(getattr(signal, sig))
        out, err = p.communicate(timeout=60)
        took = time.time() - t
    finally:
        kill_group(p)
    assert p.returncode == 0 and took < 10, err[-2000:]
    assert f"{sig}: stopped after step 1 and saved {run}/checkpoint-1;" in out and "Traceback" not in err
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    assert (run / "checkpoint-1" / "trainer_state.pt").is_file() and not (run / "checkpoint-2").exists()


def slow_update(mark):
    """The trainer, with a second update that takes a minute (two Ctrl-C arrive inside it) and leaves a file `mark`.
    Short sleeps: a signal that the kernel hands to another thread runs its handler between the main thread's calls."""
    return ("import sys, time\nimport mt_grpo_trainer as M\nfast, calls = M.train_on_samples, []\n\n"
            "def slow(*a, **k):\n    calls.append(1)\n    if len(calls) == 2:\n"
            f"        open({str(mark)!r}, 'w').close()\n        for _ in range(1200):\n            time.sleep(0.05)\n"
            "    return fast(*a, **k)\n\nM.train_on_samples = slow\nM.main(sys.argv[1:])\n")


def test_a_second_ctrl_c_aborts_at_once_in_one_line(tmp_path, tiny_model_dir):
    """Two Ctrl-C in a row: the first asks to finish the step, the second aborts mid-step (within the exit's own
    seconds of teardown, not the minute the step would take)."""
    import signal
    import time
    p, run = start_long_run(tmp_path, tiny_model_dir, script=("-c", slow_update(tmp_path / "updating")))
    try:
        wait_for_file(tmp_path / "updating")     # inside step 2's update
        p.send_signal(signal.SIGINT)
        time.sleep(0.5)
        t = time.time()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        took = time.time() - t
    finally:
        kill_group(p)
    assert p.returncode == 130 and took < 20, err[-2000:]
    assert "Ctrl-C: finishing this step" in out and "aborted by a second Ctrl-C" in err and "Traceback" not in err
    assert "stopped after" not in out and not (run / "checkpoint-2").exists()
