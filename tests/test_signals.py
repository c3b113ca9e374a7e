"""Stopping a run from outside: SIGTERM and a first Ctrl-C finish the step, save and exit 0 (at once, with the
last completed step, while a reward function hangs); at any point of a step, whatever save_steps, the message names
the checkpoint that holds the last completed step, saved once; a second Ctrl-C aborts at once in one line. (Under run.sh
and torchrun: test_run_sh.py; with max_staleness: test_async.py; while server requests are retried:
test_vllm_client.py.)"""

import os

import pytest
import torch

import mt_grpo_trainer as M
from conftest import TOY, recipe_cfg, small_run_args


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
            "eval_steps=0",  # each line of metrics.jsonl a trained step
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
    hang_on = [f"turn_reward_funcs=[{hang}:hang]", "reward_timeout=600", "eval_steps=0"]  # no eval: no other call
    p, run = start_long_run(tmp_path, tiny_model_dir, *hang_on)
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


STOP_AT = ("rollout", "reward", "update", "logged", "saved")


@pytest.fixture(scope="module")
def two_saved_steps(tmp_path_factory, tiny_model_dir):
    """A run folder holding checkpoint-2 (saved by save_steps=2), for the runs that resume from it."""
    out = tmp_path_factory.mktemp("two") / "run"
    M.train(M.load_config(TOY, [*small_run_args(tiny_model_dir, out, 2), "max_steps=2"]))
    return out


def last_done(when: str, resumed: bool) -> int:
    """The last step whose update completes when the signal lands at `when`: in the first resumed step (resumed from
    checkpoint-2) or the second of a fresh run."""
    k = 2 if resumed else 1  # the step (0-based) the signal lands in
    if when == "reward":
        return k
    return k + 1


SIGNAL_CASES = [  # every point, save_steps and start; "saved" only where a regular save follows that step
    pytest.param(when, save_steps, resumed, id=f"{when}-{save_steps}-{'resumed' if resumed else 'fresh'}")
    for resumed in (False, True)
    for save_steps in (1, 2, 3)
    for when in STOP_AT
    if when != "saved" or last_done(when, resumed) % save_steps == 0
]


@pytest.mark.parametrize("when, save_steps, resumed", SIGNAL_CASES)
def test_a_signal_at_any_point_saves_the_last_step_once_and_says_what_it_saved(
    tmp_path, tiny_model_dir, two_saved_steps, monkeypatch, capsys, when, save_steps, resumed
):
    """SIGTERM (a real one, to this process) during the rollout of a step, while its reward function runs (the step
    is dropped), during its update, after it is logged, or after its regular save; with save_steps dividing that step
    or not; on the second step of a fresh run or the first of a resumed one. The message names a checkpoint that
    exists and holds the step it names, the last completed one; no step is saved twice."""
    import shutil
    import signal
    import threading

    out = tmp_path / "run"
    start = 2 if resumed else 0
    if resumed:
        shutil.copytree(two_saved_steps, out)
    k = start if resumed else 1  # the step (0-based) the signal lands in: the first resumed, or the second
    done = last_done(when, resumed)  # the last step whose update completed
    now = {}  # the step being run
    saves = []  # the steps save_checkpoint wrote, in order
    release = threading.Event()  # lets the hanging reward function return once the test is done
    real = {name: getattr(M, name) for name in ("collect", "train_on_samples", "save_checkpoint")}
    real_log = M.MetricsLogger.log

    def stop():
        os.kill(os.getpid(), signal.SIGTERM)

    def signal_and_hang(completions, **_):
        stop()
        release.wait(60)
        return [0.0] * len(completions)

    def collect(run, step):
        now["step"] = step
        if step == k and when == "rollout":
            stop()
        if step == k and when == "reward":
            run.turn_fns = [signal_and_hang]
        return real["collect"](run, step)

    def train_on_samples(*a, **kw):
        if now["step"] == k and when == "update":
            stop()
        return real["train_on_samples"](*a, **kw)

    def log(self, step, *a, **kw):
        real_log(self, step, *a, **kw)
        if step == k + 1 and when == "logged":
            stop()

    def save_checkpoint(cfg, step, *a):
        saves.append(step)
        path = real["save_checkpoint"](cfg, step, *a)
        if step == k + 1 and when == "saved":
            stop()
        return path

    for name, fn in (
        ("collect", collect),
        ("train_on_samples", train_on_samples),
        ("save_checkpoint", save_checkpoint),
    ):
        monkeypatch.setattr(M, name, fn)
    monkeypatch.setattr(M.MetricsLogger, "log", log)
    capsys.readouterr()
    try:
        cfg = M.load_config(TOY, [*small_run_args(tiny_model_dir, out, save_steps), "max_steps=6"])
        if resumed:
            cfg.resume_from_checkpoint = "auto"
        hist = M.train(cfg)
    finally:
        release.set()
    said = [x for x in capsys.readouterr().out.splitlines() if "stopped after" in x]
    assert [h["step"] for h in hist] == list(range(start + 1, done + 1))
    assert len(said) == 1 and f"SIGTERM: stopped after step {done} and saved {out}/checkpoint-{done};" in said[0], said
    state = torch.load(out / f"checkpoint-{done}" / "trainer_state.pt", weights_only=False)
    assert state["step"] == done
    assert len(saves) == len(set(saves)), f"a step saved twice: {saves}"
    regular = {s for s in range(start + 1, done + 1) if s % save_steps == 0}
    kept = {int(p.name[11:]) for p in out.iterdir() if p.name.startswith("checkpoint-")}
    assert kept == regular | {done} | ({2} if resumed else set())
