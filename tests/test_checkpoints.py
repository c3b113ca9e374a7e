"""Checkpoints and the run folder. Saving: a crash mid-save leaves the previous checkpoint usable; a save that
runs out of room is one line and leaves the earlier checkpoints as they were; a fresh run
moves an earlier one aside, and one that trains no step (its evaluation at step 0 aside) puts it back; a second run on a held output_dir is refused (a dead run's lock is taken over); an
output_dir that cannot be written is one line; a tool that changes the working folder moves no run file.
Resuming: a resumed run equals an unbroken one down to the weights; a changed optimiser or schedule applies; a
missing checkpoint is named; after a hard kill the run continues from the last checkpoint, with an unbroken run's
weights and AdamW state; a truncated, corrupt or incomplete checkpoint is skipped (auto) or named, also one saved
before the manifest; a torn last log line is dropped.
(LoRA checkpoints: test_lora.py; resuming with max_staleness: test_async.py.)"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import mt_grpo_trainer as M
from conftest import ROOT, TOY, cli, one_line_error, recipe_cfg, small_run_args, until
from test_env import ScriptedSampler, tool_call
from test_train import run_cfg


def one_small_step(tiny_model_dir) -> list[str]:
    """The toy recipe's overrides for one small step of the tiny model."""
    sizes = ["prompts_per_step=2", "num_generations=2", "max_tokens=8"]
    return [f"model_name_or_path={tiny_model_dir}", "model_builder=", "max_steps=1", *sizes]


def test_a_crash_mid_save_leaves_the_previous_checkpoint_usable(tiny_model_dir, tmp_path, monkeypatch):
    """A second Ctrl-C mid-save (nothing catches it): the half-written checkpoint-2.tmp stays, and resume skips it."""
    cfg = recipe_cfg(tmp_path, *one_small_step(tiny_model_dir))
    M.train(cfg)
    real_save = torch.save

    def crash(obj, path, *a, **k):  # the model and tokenizer are written, the trainer state is not
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(KeyboardInterrupt):
        M.save_checkpoint(
            cfg,
            2,
            model,
            AutoTokenizer.from_pretrained(tiny_model_dir),
            opt,
            torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1),
        )
    monkeypatch.setattr(torch, "save", real_save)
    assert (tmp_path / "run" / "checkpoint-2.tmp").is_dir() and not (tmp_path / "run" / "checkpoint-2").exists()
    resumed = M.load_config(None, [f"output_dir={tmp_path}/run", "resume_from_checkpoint=auto"])
    assert M.find_checkpoint(resumed) == os.path.join(f"{tmp_path}/run", "checkpoint-1")


def test_a_save_that_runs_out_of_room_is_one_line_and_leaves_the_earlier_checkpoints(tmp_path, tiny_model_dir):
    """A real failed write: the run resumes under a file-size limit (RLIMIT_FSIZE, as `ulimit -f` sets) that every
    log fits but the checkpoint's weights do not; Python ignores SIGXFSZ, so the write fails with EFBIG. One line
    names the checkpoint and the cause; nothing of it is left, the earlier checkpoints are byte for byte as they
    were, and auto resumes from the newest of them."""
    import resource

    run = tmp_path / "run"
    common = [TOY, *small_run_args(tiny_model_dir, run, save_steps=1)]
    assert cli(*common, "max_steps=2").returncode == 0
    before = {p.relative_to(run): p.read_bytes() for p in run.glob("checkpoint-*/*")}
    weights = (run / "checkpoint-2" / "model.safetensors").stat().st_size
    logs = max(p.stat().st_size for p in run.iterdir() if p.is_file())
    assert logs < weights // 2, "the limit must let the logs through"
    limit = weights // 2

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    r = subprocess.run(
        [sys.executable, "mt_grpo_trainer.py", *common, "max_steps=3", "resume_from_checkpoint=auto"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=small_files,
    )
    one_line_error(r, f"could not save {run}/checkpoint-3 (", "File too large", "earlier checkpoints are as they were")
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert {p.relative_to(run): p.read_bytes() for p in run.glob("checkpoint-*/*")} == before
    resumed = M.load_config(None, [f"output_dir={run}", "resume_from_checkpoint=auto"])
    assert M.find_checkpoint(resumed) == str(run / "checkpoint-2")


def test_a_fresh_run_moves_an_earlier_run_aside(tmp_path, tiny_model_dir):
    common = one_small_step(tiny_model_dir)
    M.train(recipe_cfg(tmp_path, *common))
    M.train(recipe_cfg(tmp_path, *common, "seed=1"))
    runs = sorted(p.name for p in tmp_path.iterdir())
    assert runs[0] == "run" and len(runs) == 2 and runs[1].startswith("run.")
    for name in runs:  # each folder holds one run: one metrics line, its own config
        assert len((tmp_path / name / "metrics.jsonl").read_text().splitlines()) == 1
    assert "seed: 1" in (tmp_path / "run" / "config.yaml").read_text()


def test_a_run_that_fails_before_its_first_step_leaves_the_earlier_run_in_place_and_no_lock(tmp_path, tiny_model_dir):
    common = one_small_step(tiny_model_dir)
    M.train(recipe_cfg(tmp_path, *common))
    earlier = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(M.ConfigError, match="does not exist"):
        M.train(recipe_cfg(tmp_path, *common, f"model_name_or_path={tmp_path}/no-such-model", "seed=1"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], "nothing moved aside, no lock file left"
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == earlier
    assert "seed: 0" in (tmp_path / "run" / "config.yaml").read_text()
    reward = tmp_path.parent / f"{tmp_path.name}-reward.py"  # passes the load-time check, raises in the first step
    reward.write_text(
        "def picky(completions, **kw):\n    assert all(c[-1]['content'] == '.' for c in completions)\n"
        "    return [0.0] * len(completions)\n"
    )
    with pytest.raises(M.ConfigError, match="picky"):
        M.train(recipe_cfg(tmp_path, *common, f"outcome_reward_funcs=[{reward}:picky]", "seed=2"))
    assert (
        sorted(p.name for p in tmp_path.iterdir()) == ["run"]
        and (tmp_path / "run" / "metrics.jsonl").read_text() == earlier
    )


def test_a_run_that_evaluated_step_0_and_failed_in_its_first_step_leaves_the_earlier_run_in_place(
    tmp_path, tiny_model_dir, monkeypatch
):
    """Its evaluation at step 0 is a row of metrics.jsonl, but no trained step: the earlier run comes back. A run
    that trained a step (unsaved) and then failed stays."""
    common = one_small_step(tiny_model_dir)
    M.train(recipe_cfg(tmp_path, *common))
    earlier = (tmp_path / "run" / "metrics.jsonl").read_text()
    update = M.train_on_samples
    updates = []

    def fails_at(k):
        def train_on_samples(*a, **kw):
            updates.append(1)
            if len(updates) == k:
                raise RuntimeError(f"update {k} failed")
            return update(*a, **kw)

        return train_on_samples

    monkeypatch.setattr(M, "train_on_samples", fails_at(1))
    with pytest.raises(RuntimeError, match="update 1 failed"):
        M.train(recipe_cfg(tmp_path, *common, "eval_steps=1", "eval_max_examples=2", "seed=1"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == earlier
    assert "seed: 0" in (tmp_path / "run" / "config.yaml").read_text()
    updates.clear()
    monkeypatch.setattr(M, "train_on_samples", fails_at(2))
    with pytest.raises(RuntimeError, match="update 2 failed"):
        M.train(recipe_cfg(tmp_path, *common, "max_steps=2", "save_steps=0", "log_episodes_steps=0", "seed=2"))
    assert len(list(tmp_path.iterdir())) == 2 and "seed: 2" in (tmp_path / "run" / "config.yaml").read_text()


def test_a_second_run_on_a_held_output_dir_refuses_and_a_dead_runs_lock_is_taken_over(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    common = [TOY, *small_run_args(tiny_model_dir, run, save_steps=2)]
    first = subprocess.Popen(
        [sys.executable, "mt_grpo_trainer.py", *common, "max_steps=500"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "checkpoint-2").is_dir():
        time.sleep(0.2)
    second = cli(*common, "max_steps=3", "seed=1")
    one_line_error(second, f"output_dir '{run}' is in use by the run with PID {first.pid}", "choose another output_dir")
    assert "seed: 0" in (run / "config.yaml").read_text(), "the second run touched nothing"
    first.send_signal(signal.SIGKILL)  # a hard crash leaves its lock behind
    first.wait(timeout=30)
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)), "one run's steps only"
    third = cli(*common, "max_steps=3", "seed=1")
    assert third.returncode == 0, third.stderr[-2000:]
    assert f"was left by a run that is gone (PID {first.pid}): taking it over" in third.stdout
    assert not os.path.exists(f"{run}.lock"), "a finished run lets go of its folder"
    assert "seed: 1" in (run / "config.yaml").read_text() and any(p.name.startswith("run.") for p in tmp_path.iterdir())


def test_an_output_dir_that_cannot_be_written_is_one_line(tmp_path, tiny_model_dir):
    (tmp_path / "a_file").write_text("")
    r = cli(TOY, f"model_name_or_path={tiny_model_dir}", "model_builder=", f"output_dir={tmp_path}/a_file/run")
    one_line_error(
        r, f"cannot write the run folder '{tmp_path}/a_file/run'", "set output_dir to a folder you can write to"
    )


def test_a_tool_that_changes_the_working_folder_moves_no_run_file(tmp_path, tiny_model_dir, monkeypatch):
    """Every path the run writes later is made absolute at set-up: a relative output_dir stays where it was."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir(), elsewhere.mkdir()
    (tmp_path / "cd.py").write_text(
        f'import os\n\ndef lookup(key: str) -> str:\n    """Look up, then move away."""\n'
        f'    os.chdir({str(elsewhere)!r})\n    return "v"\n'
    )
    cfg = recipe_cfg(
        tmp_path,
        f"model_name_or_path={tiny_model_dir}",
        "model_builder=",
        "max_steps=2",
        f"tools=[{tmp_path}/cd.py:lookup]",
        "prompts_per_step=2",
        "num_generations=2",
        "log_episodes_steps=1",
    )
    script = [tool_call("a"), "<answer>v</answer>"]
    monkeypatch.setattr(M, "LocalSampler", lambda model, tok: ScriptedSampler(tok, script))
    monkeypatch.chdir(home)  # restored at teardown
    cfg.output_dir = "run"
    history = M.train(cfg)
    assert os.getcwd() == str(elsewhere) and all(h["rollout/tool_calls"] > 0 for h in history), "the tool moved us"
    run = home / "run"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert {json.loads(x)["step"] for x in (run / "episodes.jsonl").read_text().splitlines()} == {1, 2}
    assert (run / "checkpoint-2" / "trainer_state.pt").is_file() and not (elsewhere / "run").exists()
    assert not (home / "run.lock").exists(), "the lock was found again and removed"
    assert M.load_config(str(run / "config.yaml")).output_dir == str(run), "config.yaml records the folder used"


def test_resumed_run_matches_an_uninterrupted_one(tmp_path, tiny_model_dir):
    full = M.train(run_cfg(tmp_path, tiny_model_dir, "full", "max_steps=3", "save_steps=2"))
    resumed = M.train(
        run_cfg(
            tmp_path, tiny_model_dir, "resumed", "max_steps=3", f"resume_from_checkpoint={tmp_path}/full/checkpoint-2"
        )
    )
    assert len(resumed) == 1 and resumed[0]["step"] == 3
    assert full[1]["loss/grad_norm"] > 0  # the run really updated the model
    for k in ("reward/turn", "loss/policy", "loss/grad_norm", "rollout/sampled_tokens"):
        assert resumed[0][k] == pytest.approx(full[2][k], rel=1e-5, abs=1e-7), k
    a = load_file(f"{tmp_path}/full/checkpoint-3/model.safetensors")
    b = load_file(f"{tmp_path}/resumed/checkpoint-3/model.safetensors")
    two = load_file(f"{tmp_path}/full/checkpoint-2/model.safetensors")
    assert any(not torch.equal(a[k], two[k]) for k in a)  # step 3 changed the weights ...
    for k in a:  # ... identically in both runs
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
    # resuming into the same folder redoes step 3: its log lines are replaced, not duplicated
    M.train(
        run_cfg(tmp_path, tiny_model_dir, "full", "max_steps=3", f"resume_from_checkpoint={tmp_path}/full/checkpoint-2")
    )
    steps = [json.loads(line)["step"] for line in open(f"{tmp_path}/full/metrics.jsonl")]
    assert steps == [1, 2, 3]
    # auto: picks the newest complete checkpoint of output_dir; a finished run has nothing left to do
    auto = M.train(run_cfg(tmp_path, tiny_model_dir, "full", "max_steps=4", "resume_from_checkpoint=auto"))
    assert [h["step"] for h in auto] == [4]


def test_resume_applies_a_changed_learning_rate_schedule_and_adamw_and_says_so(tmp_path, tiny_model_dir, capsys):
    """The recipe's values are the ones used (and the ones config.yaml records), not the checkpoint's run's."""
    M.train(
        run_cfg(tmp_path, tiny_model_dir, "run", "max_steps=2", "lr_scheduler=linear")
    )  # lr 0.01, down to 0 at step 2
    cfg = run_cfg(
        tmp_path,
        tiny_model_dir,
        "run",
        "max_steps=4",
        "lr_scheduler=linear",
        "learning_rate=0.02",
        "weight_decay=0.1",
        "adam_betas=[0.8,0.99]",
        "num_iterations=2",
        "resume_from_checkpoint=auto",
    )
    run = M.setup(cfg)
    try:
        assert run.start == 2 and run.scheduler.base_lrs == [0.02] and run.scheduler.last_epoch == 2 * 2
        g = run.optimizer.param_groups[0]
        assert g["lr"] == pytest.approx(0.02 * (1 - 2 / 4)), "step 3's rate, on the new schedule (2 updates a step)"
        assert g["initial_lr"] == 0.02 and g["weight_decay"] == 0.1 and g["betas"] == (0.8, 0.99)
        assert run.optimizer.state, "the moments were restored"
    finally:
        run.rollouts.close()
        run.close([])
    assert (
        "the recipe changes learning_rate 0.01 -> 0.02, max_steps 2 -> 4, num_iterations 1 -> 2, weight_decay 0.0 -> "
        "0.1, adam_betas [0.9, 0.999] -> [0.8, 0.99]"
    ) in capsys.readouterr().out
    hist = M.train(cfg)
    assert [h["loss/lr"] for h in hist] == pytest.approx([0.02 * (1 - 3 / 4), 0.0]), "after each step's 2 updates"
    assert M.load_config(f"{tmp_path}/run/config.yaml").learning_rate == 0.02


def test_resume_from_a_missing_checkpoint_is_a_clear_error(tmp_path, tiny_model_dir):
    with pytest.raises(M.ConfigError, match="no checkpoint at"):
        M.train(run_cfg(tmp_path, tiny_model_dir, "x", f"resume_from_checkpoint={tmp_path}/nope"))


def test_resume_after_a_hard_kill_continues_from_the_last_checkpoint(tiny_model_dir, tmp_path):
    """SIGKILL at whatever step the run reached (a checkpoint every 2 steps; checkpoint-4 is the event waited for, its
    deadline of 300 s only catches a hang: the run's 4 steps take seconds, and its own start-up, not an event of
    this process, is in it), then resume: the next step's weights and AdamW state equal an unbroken run's."""
    run = tmp_path / "run"
    cfg = run_cfg(tmp_path, tiny_model_dir, "run", "save_steps=2")  # rewards that move the weights every step
    args = [TOY] + [f"{f.name}={getattr(cfg, f.name)}" for f in fields_set(cfg)]
    p = subprocess.Popen(
        [sys.executable, "mt_grpo_trainer.py", *args, "max_steps=500"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        until(lambda: (run / "checkpoint-4").is_dir() or p.poll() is not None, "checkpoint-4 saved", hang_s=300)
        assert p.poll() is None, "the run ended before it was killed"
    finally:
        p.send_signal(signal.SIGKILL)  # no handler runs: a crash
        p.wait(timeout=30)
    done = sorted(
        int(d.name.split("-")[1]) for d in run.iterdir() if d.name.startswith("checkpoint-") and d.name[11:].isdigit()
    )
    last = done[-1]
    hist = M.train(M.load_config(TOY, args[1:] + [f"max_steps={last + 1}", "resume_from_checkpoint=auto"]))
    assert [h["step"] for h in hist] == [last + 1]
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, last + 2)), "steps logged after the checkpoint are dropped, then redone once"
    M.train(run_cfg(tmp_path, tiny_model_dir, "unbroken", "save_steps=2", f"max_steps={last + 1}"))
    resumed = load_file(run / f"checkpoint-{last + 1}" / "model.safetensors")
    unbroken = load_file(tmp_path / "unbroken" / f"checkpoint-{last + 1}" / "model.safetensors")
    before = load_file(run / f"checkpoint-{last}" / "model.safetensors")
    assert any(not torch.equal(resumed[k], before[k]) for k in resumed), "the resumed step changed the weights"
    for k in unbroken:
        torch.testing.assert_close(resumed[k], unbroken[k], rtol=1e-5, atol=1e-6)
    moments = [
        torch.load(d / f"checkpoint-{last + 1}" / "trainer_state.pt", weights_only=False)["optimizer"]["state"]
        for d in (run, tmp_path / "unbroken")
    ]
    assert moments[0].keys() == moments[1].keys() and moments[1]
    for i in moments[1]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(moments[0][i][name], moments[1][i][name], rtol=1e-5, atol=1e-8)


def fields_set(cfg):
    """The Config fields whose value differs from the toy recipe's: what run_cfg set, as command-line overrides."""
    toy = M.load_config(TOY)
    return [f for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(toy, f.name)]


@pytest.fixture(scope="module")
def three_checkpoints(tiny_model_dir, tmp_path_factory):
    """A 3-step run that saved after every step and dumped every step's episodes, copied fresh by each test."""
    base = tmp_path_factory.mktemp("three")
    M.train(
        recipe_cfg(
            base,
            f"model_name_or_path={tiny_model_dir}",
            "model_builder=",
            "max_steps=3",
            "save_steps=1",
            "prompts_per_step=2",
            "num_generations=2",
            "max_tokens=8",
            "log_episodes_steps=1",
        )
    )
    return base / "run"


def copied_run(three_checkpoints, tmp_path):
    import shutil

    shutil.copytree(three_checkpoints, tmp_path / "run")
    return tmp_path / "run"


def resume_cfg(tmp_path, tiny_model_dir, ckpt="auto", *extra):
    return recipe_cfg(
        tmp_path,
        f"model_name_or_path={tiny_model_dir}",
        "model_builder=",
        "prompts_per_step=2",
        "num_generations=2",
        "max_tokens=8",
        "log_episodes_steps=1",
        f"resume_from_checkpoint={ckpt}",
        *extra,
    )


def cut(path, n=100):
    os.truncate(path, os.path.getsize(path) - n)


def test_auto_resume_falls_back_past_a_truncated_or_incomplete_checkpoint_and_says_why(
    three_checkpoints, tmp_path, tiny_model_dir, capsys
):
    run = copied_run(three_checkpoints, tmp_path)
    cut(run / "checkpoint-3" / "model.safetensors")  # corrupt weights
    cut(run / "checkpoint-2" / "trainer_state.pt")  # a truncated trainer state
    assert M.find_checkpoint(resume_cfg(tmp_path, tiny_model_dir)) == str(run / "checkpoint-1")
    out = capsys.readouterr().out
    assert (
        f"skipping {run}/checkpoint-3: model.safetensors" in out
        and f"skipping {run}/checkpoint-2: trainer_state.pt" in out
    )
    hist = M.train(resume_cfg(tmp_path, tiny_model_dir, "auto", "max_steps=2"))
    assert [h["step"] for h in hist] == [2] and "resumed from" in capsys.readouterr().out
    (run / "checkpoint-1" / "tokenizer.json").unlink()  # a missing file: now none is usable
    (run / "checkpoint-2" / "tokenizer.json").unlink()
    with pytest.raises(
        M.ConfigError, match=r"no checkpoint in .* can be resumed.*checkpoint-2: tokenizer.json is missing"
    ):
        M.find_checkpoint(resume_cfg(tmp_path, tiny_model_dir))


def test_resuming_a_named_checkpoint_that_fails_verification_is_one_line_naming_the_file(
    three_checkpoints, tmp_path, tiny_model_dir
):
    run = copied_run(three_checkpoints, tmp_path)
    cut(run / "checkpoint-3" / "model.safetensors")
    (run / "checkpoint-2" / "tokenizer.json").unlink()
    for ckpt, what in ((3, "model.safetensors has"), (2, "tokenizer.json is missing")):
        with pytest.raises(M.ConfigError, match=f"checkpoint-{ckpt}.*{what}") as e:
            M.train(resume_cfg(tmp_path, tiny_model_dir, run / f"checkpoint-{ckpt}", "max_steps=4"))
        assert "\n" not in str(e.value)


def test_a_checkpoint_without_a_manifest_still_resumes_and_is_still_checked(
    three_checkpoints, tmp_path, tiny_model_dir, capsys
):
    """Checkpoints saved before the manifest: what can be checked without it (the weights and the trainer state open)."""
    run = copied_run(three_checkpoints, tmp_path)
    for d in ("checkpoint-1", "checkpoint-2", "checkpoint-3"):
        (run / d / "manifest.json").unlink(missing_ok=True)
    assert M.find_checkpoint(resume_cfg(tmp_path, tiny_model_dir)) == str(run / "checkpoint-3")
    cut(run / "checkpoint-3" / "model.safetensors")
    cut(run / "checkpoint-2" / "trainer_state.pt")
    assert M.find_checkpoint(resume_cfg(tmp_path, tiny_model_dir)) == str(run / "checkpoint-1")
    out = capsys.readouterr().out
    assert (
        "checkpoint-3: model.safetensors does not load" in out and "checkpoint-2: trainer_state.pt does not load" in out
    )
    hist = M.train(resume_cfg(tmp_path, tiny_model_dir, "auto", "max_steps=2"))
    assert [h["step"] for h in hist] == [2]


def test_a_torn_last_log_line_is_dropped_on_resume_and_said(three_checkpoints, tmp_path, tiny_model_dir, capsys):
    """A crash while step 4's lines were written: resuming from checkpoint-3 drops the torn lines and redoes step 4."""
    run = copied_run(three_checkpoints, tmp_path)
    for name in ("metrics.jsonl", "episodes.jsonl"):
        with open(run / name, "a") as f:
            f.write('{"step": 4, "reward/outc')
    hist = M.train(resume_cfg(tmp_path, tiny_model_dir, "auto", "max_steps=4"))
    assert [h["step"] for h in hist] == [4]
    out = capsys.readouterr().out
    assert "metrics.jsonl ends in a torn line" in out and "episodes.jsonl ends in a torn line" in out
    import json

    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert {json.loads(x)["step"] for x in (run / "episodes.jsonl").read_text().splitlines()} == {1, 2, 3, 4}
