"""Stopping a run from outside: SIGTERM and a first Ctrl-C finish the step, save and exit 0 (at once, with the
last completed step, while a reward function hangs); a second Ctrl-C aborts at once in one line. (Under run.sh
and torchrun: test_run_sh.py; with max_staleness: test_async.py; while server requests are retried:
test_vllm_client.py.)"""

import os

import pytest

import mt_grpo_trainer as M
from conftest import recipe_cfg


def start_long_run(tmp_path, tiny_model_dir, *overrides, script=("mt_grpo_trainer.py",)):
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    p = subprocess.Popen(
        [
            sys.executable,
            *script,
            "hf_recipes/toy/toy-kv--mt-grpo.yaml",
            f"model_name_or_path={tiny_model_dir}",
            "model_builder=",
            f"output_dir={run}",
            "max_steps=200",
            "prompts_per_step=2",
            "num_generations=2",
            "max_tokens=8",
            "save_steps=0",
            *overrides,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
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
    hist = M.train(
        recipe_cfg(
            tmp_path,
            f"model_name_or_path={tiny_model_dir}",
            "model_builder=",
            f"max_steps={steps + 1}",
            "prompts_per_step=2",
            "num_generations=2",
            "max_tokens=8",
            "resume_from_checkpoint=auto",
        )
    )
    assert [h["step"] for h in hist] == [steps + 1]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_while_a_reward_function_hangs_saves_the_last_step_and_exits(tmp_path, tiny_model_dir, sig):
    """The reward function never returns (reward_timeout is far off): the signal ends the wait at once; the step is
    dropped and the one before it saved, since the weights have not changed since then. No clock: the run must exit
    within communicate's 60 s, a deadline that only catches a hang, ten times shorter than reward_timeout=600."""
    import signal

    hang = tmp_path / "hang.py"
    hang.write_text(
        f"import threading\n\ncalls = []\n\n\ndef hang(completions, **_):\n    calls.append(1)\n"
        f"    if len(calls) == 3:   # check_rewards, step 1, then step 2\n"
        f"        open({str(tmp_path / 'hanging')!r}, 'w').close()\n        threading.Event().wait()\n"
        f"    return [0.0] * len(completions)\n"
    )
    p, run = start_long_run(tmp_path, tiny_model_dir, f"turn_reward_funcs=[{hang}:hang]", "reward_timeout=600")
    try:
        wait_for_file(tmp_path / "hanging")
        p.send_signal(getattr(signal, sig))
        out, err = p.communicate(timeout=60)
    finally:
        kill_group(p)
    assert p.returncode == 0, err[-2000:]
    assert f"{sig}: stopped after step 1 and saved {run}/checkpoint-1;" in out and "Traceback" not in err
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    assert (run / "checkpoint-1" / "trainer_state.pt").is_file() and not (run / "checkpoint-2").exists()


def slow_update(mark):
    """The trainer, with a second update that takes a minute (two Ctrl-C arrive inside it) and leaves a file `mark`.
    Short sleeps: a signal that the kernel hands to another thread runs its handler between the main thread's calls."""
    return (
        "import sys, time\nimport mt_grpo_trainer as M\nfast, calls = M.train_on_samples, []\n\n"
        "def slow(*a, **k):\n    calls.append(1)\n    if len(calls) == 2:\n"
        f"        open({str(mark)!r}, 'w').close()\n        for _ in range(1200):\n            time.sleep(0.05)\n"
        "    return fast(*a, **k)\n\nM.train_on_samples = slow\nM.main(sys.argv[1:])\n"
    )


def test_a_second_ctrl_c_aborts_at_once_in_one_line(tmp_path, tiny_model_dir):
    """Two Ctrl-C in a row: the first asks to finish the step, the second aborts mid-step (within the exit's own
    seconds of teardown, not the minute the step would take)."""
    import signal
    import time

    p, run = start_long_run(tmp_path, tiny_model_dir, script=("-c", slow_update(tmp_path / "updating")))
    try:
        wait_for_file(tmp_path / "updating")  # inside step 2's update
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
