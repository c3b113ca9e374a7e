"""The whole loop: the default recipe end to end from the command line, the episode dump's schema, a missing
model built whole or not at all, wandb offline. (Checkpoints and resume: test_checkpoints.py; signals:
test_signals.py.)"""

import json
import os
import re
import subprocess
import sys
import time

import pytest

import mt_grpo_trainer as M
from conftest import ROOT, recipe_cfg

VARYING_REWARD = '''
def length_parity(completions, **_):
    """Turn reward that varies between episodes, so a random model still gets a learning signal."""
    return [float(len(c[0]["content"]) % 2) for c in completions]
'''


def check_episode_record(rec, tok):
    assert {
        "messages",
        "rewards",
        "turn_reward",
        "outcome_reward",
        "advantages",
        "first_result_turn",
        "samples",
        "end_reason",
    } <= set(rec)
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
    builder made (toy_model_dir, built by the same build_model_if_missing) before this run, which does not report
    it as built."""
    run = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "mt_grpo_trainer.py",
            "hf_recipes/toy/toy-kv--mt-grpo.yaml",
            "max_steps=2",
            f"model_name_or_path={toy_model_dir}",
            f"output_dir={run}",
            "log_episodes_steps=1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "model built" not in r.stdout and "before/after" in r.stdout and str(run) in r.stdout
    assert re.search(r"eval/exact_answer_reward +\d\.\d{3} \(step 0\)\n", r.stdout), "the baseline, in the summary"
    for noise in ("Writing model shards", "Loading weights", "it/s]", "Warning"):  # output to a file: step lines only
        assert noise not in r.stdout + r.stderr, r.stderr[-3000:]
    baseline, *metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert baseline["step"] == 0 and 0 <= baseline["eval/exact_answer_reward"] <= 1, "the recipe's step-0 evaluation"
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0 <= m["reward/outcome"] <= 1 and m["rollout/sampled_tokens"] > 0 for m in metrics)
    saved = M.load_config(str(run / "config.yaml"))  # the resolved config reloads as a recipe
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
    return recipe_cfg(
        tmp_path,
        f"model_name_or_path={model_dir}",
        "model_builder=",
        f"output_dir={tmp_path}/{name}",
        f"turn_reward_funcs=[{reward}:length_parity]",
        "learning_rate=0.01",
        "lr_scheduler=constant",  # the toy recipe decays it to 0 at max_steps, which these runs change
        "prompts_per_step=2",
        "num_generations=4",
        "max_tokens=12",
        "log_episodes_steps=0",
        *extra,
    )


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
        "              open(os.path.join(path, 'build_report.json'), 'w'))\n"
    )
    model = tmp_path / "model"
    cfg = recipe_cfg(
        tmp_path,
        f"model_name_or_path={model}",
        f"model_builder={tmp_path}/builder.py:build",
        "system_prompt=Tools: {tools}",
    )
    monkeypatch.setenv("BUILD_FAILS", "1")
    with pytest.raises(
        M.ConfigError, match=r"model builder .* failed: RuntimeError: out of disk \(.*builder.py, line 5\)"
    ):
        M.build_model_if_missing(cfg, print)
    assert not model.exists() and not (tmp_path / "model.tmp").exists()
    monkeypatch.delenv("BUILD_FAILS")
    M.build_model_if_missing(cfg, print)
    assert sorted(os.listdir(model)) == ["build_report.json"] and not (tmp_path / "model.tmp").exists()
    assert "model built by builder.py: 7 params; prompt 'Tools'" in capsys.readouterr().out


def test_runs_started_together_build_a_missing_model_once(tmp_path):
    """Two trainers on one missing model (a sweep): the second to come says it waits while the first builds, then
    finds the model built; neither builds into the other's temp folder."""
    (tmp_path / "builder.py").write_text(
        "import os, time\n"
        "def build(path, system_prompt):\n"
        "    open(os.path.join(os.path.dirname(path), f'built-by-{os.getpid()}'), 'w').close()\n"
        "    go = os.path.join(os.path.dirname(path), 'go')\n"
        "    for _ in range(300):\n"
        "        if os.path.exists(go):\n"
        "            break\n"
        "        time.sleep(0.1)\n"
        "    open(os.path.join(path, 'weights'), 'w').close()\n"
    )
    overrides = [f"model_name_or_path={tmp_path}/model", f"model_builder={tmp_path}/builder.py:build"]
    script = f"import mt_grpo_trainer as M\nM.build_model_if_missing(M.load_config(None, {overrides!r}), print)\n"
    env = {**os.environ, "PYTHONPATH": ROOT}
    first = subprocess.Popen([sys.executable, "-u", "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("built-by-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    second = subprocess.Popen([sys.executable, "-u", "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    waited = ""
    for line in second.stdout:  # ends at the second's exit, if it never waits (the builder gives up after 30 s)
        if "another run is building" in line:
            waited = line
            break
    (tmp_path / "go").touch()
    outs = [p.communicate(timeout=120)[0] for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0]
    assert waited, f"the second run did not wait for the first: {outs[1]}"
    assert len(list(tmp_path.glob("built-by-*"))) == 1, "the model was built once"
    assert sorted(os.listdir(tmp_path / "model")) == ["build_report.json", "weights"]
    assert not (tmp_path / "model.tmp").exists()
    assert "building" not in outs[1], "the second run does not say it builds"


def test_wandb_offline(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    h = M.train(run_cfg(tmp_path, tiny_model_dir, "wb", "max_steps=2", "report_to=wandb", "beta=0.1"))
    assert h[0]["loss/kl"] == 0.0 < h[1]["loss/kl"]  # KL to the frozen reference: 0 at first, then it grows
    runs = [d for d in os.listdir(tmp_path / "wb" / "wandb") if d.startswith("offline-run")]
    assert runs, "no offline wandb run was written"
