"""Reward functions: checked on two dummy episodes before any model work (one that raises, returns the wrong
length, NaN or a non-number, or needs a column the dataset lacks, named even as a partial or a callable object);
what they may return; each gets its own copy of what it scores; one that never returns is bounded by
reward_timeout. (Rewards that are async def or generators, refused at load: test_config.py.)"""

import copy
import signal

import numpy as np
import pytest
import torch

import mt_grpo_trainer as M
from conftest import HANG_S, TOY


@pytest.mark.parametrize(
    "body,message",
    [
        ("raise KeyError('answer')", "reward function 'bad' .* raised KeyError: 'answer'"),
        ("return [0.0]", "must return a list of 2 floats"),
        ("return [float('nan')] * len(completions)", "returned nan for episode 0"),
        ("return ['high'] * len(completions)", "returned 'high' for episode 0, not a number"),
    ],
)
def test_a_broken_reward_fails_before_any_model_work(tmp_path, body, message, capsys, monkeypatch):
    """No clock: a counter of model loads (none) and the model folder never built show no model work happened."""
    import transformers

    loads = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(a))
    bad = tmp_path / "bad.py"
    bad.write_text(f"def bad(completions, **columns):\n    {body}\n")
    with pytest.raises(SystemExit):
        M.main(
            [
                "hf_recipes/toy/toy-kv--mt-grpo.yaml",
                f"output_dir={tmp_path}/run",
                f"outcome_reward_funcs=[{bad}:bad]",
                f"model_name_or_path={tmp_path}/never_built",
                "model_builder=",
            ]
        )
    err = capsys.readouterr().err
    assert __import__("re").search(message, err), err
    assert str(bad) in err
    assert not loads and not (tmp_path / "never_built").exists(), "no model work happened"


@pytest.mark.parametrize("make", ["functools.partial(score, 0)", "Score()"])
def test_a_reward_that_is_a_partial_or_a_callable_object_is_named_when_it_fails(tmp_path, make, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import functools\ndef score(x, completions, **columns):\n    return ['high'] * len(completions)\n"
        "class Score:\n    def __call__(self, completions, **columns):\n        return score(0, completions)\n"
        f"bad = {make}\n"
    )
    with pytest.raises(SystemExit):
        M.main(
            [
                "hf_recipes/toy/toy-kv--mt-grpo.yaml",
                f"output_dir={tmp_path}/run",
                f"outcome_reward_funcs=[{bad}:bad]",
                f"model_name_or_path={tmp_path}/never_built",
                "model_builder=",
            ]
        )
    err = capsys.readouterr().err
    assert "returned 'high' for episode 0, not a number" in err and "Traceback" not in err, err


def test_a_dataset_without_the_columns_a_reward_needs_is_named(tmp_path, capsys):
    needs = tmp_path / "needs.py"
    needs.write_text("def needs_gold(completions, gold, **columns):\n    return [0.0] * len(completions)\n")
    with pytest.raises(SystemExit):
        M.main(
            [
                "hf_recipes/toy/toy-kv--mt-grpo.yaml",
                f"output_dir={tmp_path}/run",
                f"outcome_reward_funcs=[{needs}:needs_gold]",
                f"model_name_or_path={tmp_path}/never_built",
                "model_builder=",
            ]
        )
    err = capsys.readouterr().err
    assert "needs_gold" in err and "'gold'" in err and "dataset columns: prompt, key, answer" in err


def test_rewards_must_be_real_numbers(tmp_path):
    eps = [M.new_episode({"prompt": "q"}, "") for _ in range(4)]
    ok = lambda completions, **_: [1, 0.5, np.float32(0.25), torch.tensor(True)]
    assert M.score(eps, [ok], [1.0], 60) == [1.0, 0.5, 0.25, 1.0]
    assert M.score(eps, [lambda completions, **_: [np.bool_(True), np.int64(2), False, 3]], [1.0], 60) == [
        1.0,
        2.0,
        0.0,
        3.0,
    ]
    for junk in ("1.0", None, torch.tensor([1.0, 2.0]), [1.0]):
        with pytest.raises(M.RewardError, match="not a number but a"):
            M.score(eps, [lambda completions, **_: [junk] * 4], [1.0], 60)


def test_a_reward_function_that_edits_what_it_is_given_changes_nothing_else():
    row = {"prompt": "q", "answer": "v", "aliases": ["v", "w"]}
    eps = [M.new_episode(row, "") for _ in range(2)]  # a group's episodes share their dataset row, as in training
    for ep in eps:
        ep.messages.append({"role": "assistant", "content": "<answer>v</answer>"})
    before, seen = copy.deepcopy([(ep.messages, ep.row) for ep in eps]), []

    def vandal(completions, answer, aliases, **columns):
        completions[0][0]["content"] = "edited"
        completions[1].append({"role": "user", "content": "added"})
        answer[0], columns["prompt"][1] = "x", "y"
        aliases[0].append("z")
        return [0.0, 0.0]

    def witness(completions, **columns):
        seen.append((completions, columns))
        return [1.0, 1.0]

    assert M.score(eps, [vandal, witness], [1.0, 1.0], 60) == [1.0, 1.0]
    assert [(ep.messages, ep.row) for ep in eps] == before, "what episodes.jsonl records is what was sampled"
    done = [{"role": "assistant", "content": "<answer>v</answer>"}]
    assert seen == [([done, done], {"prompt": ["q", "q"], "answer": ["v", "v"], "aliases": [["v", "w"], ["v", "w"]]})]


def test_a_reward_function_that_never_returns_stops_the_run_in_one_line(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """Bounded by reward_timeout at start-up (check_rewards scores two episodes) and in the loop (four). No clock:
    the stuck function returns only after HANG_S (a deadline that only catches a hang), so an error naming
    reward_timeout shows the run did not wait for it."""
    stuck = tmp_path / "stuck.py"
    stuck.write_text(
        "import os\nimport threading\n\nrelease = threading.Event()\n\n\ndef stuck(completions, **_):\n"
        f"    if len(completions) > int(os.environ['STUCK_ABOVE']):\n        release.wait({HANG_S})\n"
        "    return [0.0] * len(completions)\n"
    )
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # a failed train() keeps its own
    try:
        for above, model in (("0", tmp_path / "never_built"), ("2", tiny_model_dir)):
            monkeypatch.setenv("STUCK_ABOVE", above)
            with pytest.raises(SystemExit):
                M.main(
                    [
                        TOY,
                        f"output_dir={tmp_path}/run{above}",
                        f"outcome_reward_funcs=[{stuck}:stuck]",
                        "reward_timeout=1",
                        f"model_name_or_path={model}",
                        "model_builder=",
                        "prompts_per_step=2",
                        "num_generations=2",
                        "max_tokens=8",
                        "eval_steps=0",
                    ]
                )
            err = capsys.readouterr().err
            assert [x for x in err.splitlines() if x.startswith("mt-grpo: error")] == [
                f"mt-grpo: error: reward function 'stuck' ({stuck}) did not return within reward_timeout=1.0s; "
                "saved checkpoints are unaffected"
            ] and "Traceback" not in err, err
        assert not (tmp_path / "never_built").exists(), "at start-up: before any model work"
    finally:
        M.load_object(f"{stuck}:release").set()
        for s, h in handlers.items():
            signal.signal(s, h)
