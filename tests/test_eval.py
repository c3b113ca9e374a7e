"""The eval command, evaluation during training, and reward functions checked before any model work."""
import json
import time

import pytest

import mt_grpo_trainer as M
from tests.conftest import recipe_cfg


def test_eval_command_runs_greedy_episodes_and_writes_the_table(tiny_model_dir, tmp_path, capsys):
    M.main(["eval", "hf_recipes/toy/toy-kv--mt-grpo.yaml", f"model_name_or_path={tiny_model_dir}", "model_builder=",
            f"output_dir={tmp_path}/run", "eval_max_examples=6", "max_tokens=12"])
    out = capsys.readouterr().out
    assert "| exact_answer_reward |" in out and "| lookup_hit_reward |" in out
    rows = [json.loads(x) for x in open(tmp_path / "run" / "eval" / "step-0.jsonl")]
    assert [r["row"] for r in rows] == list(range(6))
    assert all(set(r["rewards"]) == {"exact_answer_reward", "lookup_hit_reward"} for r in rows)
    summary = json.loads(open(tmp_path / "run" / "eval" / "metrics.jsonl").readline())
    assert summary["model"] == tiny_model_dir and 0 <= summary["eval/exact_answer_reward"] <= 1
    # greedy: the same model gives the same episodes again
    M.main(["eval", "hf_recipes/toy/toy-kv--mt-grpo.yaml", f"model_name_or_path={tiny_model_dir}", "model_builder=",
            f"output_dir={tmp_path}/run", "eval_max_examples=6", "max_tokens=12"])
    again = [json.loads(x) for x in open(tmp_path / "run" / "eval" / "step-0.jsonl")]
    assert [r["messages"] for r in again] == [r["messages"] for r in rows]


def test_eval_without_an_eval_dataset_is_a_clear_error(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        M.main(["eval", "hf_recipes/toy/toy-kv--mt-grpo.yaml", f"model_name_or_path={tiny_model_dir}",
                "model_builder=", f"output_dir={tmp_path}/run", "eval_dataset="])
    assert "eval needs eval_dataset" in capsys.readouterr().err


def test_training_evaluates_every_eval_steps(tiny_model_dir, tmp_path):
    hist = M.train(recipe_cfg(tmp_path, f"model_name_or_path={tiny_model_dir}", "model_builder=", "max_steps=2",
                              "eval_steps=2", "eval_max_examples=4", "prompts_per_step=2", "num_generations=2",
                              "max_tokens=12"))
    assert "eval/exact_answer_reward" not in hist[0] and "eval/exact_answer_reward" in hist[1]
    assert (tmp_path / "run" / "eval" / "step-2.jsonl").is_file()


@pytest.mark.parametrize("body,message", [
    ("raise KeyError('answer')", "reward function 'bad' .* raised KeyError: 'answer'"),
    ("return [0.0]", "must return a list of 2 floats"),
    ("return [float('nan')] * len(completions)", "returned nan for episode 0"),
    ("return ['high'] * len(completions)", "returned 'high' for episode 0, not a number"),
])
def test_a_broken_reward_fails_before_any_model_work(tmp_path, body, message, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text(f"def bad(completions, **columns):\n    {body}\n")
    t = time.time()
    with pytest.raises(SystemExit):
        M.main(["hf_recipes/toy/toy-kv--mt-grpo.yaml", f"output_dir={tmp_path}/run", f"outcome_reward_funcs=[{bad}:bad]",
                f"model_name_or_path={tmp_path}/never_built", "model_builder="])
    err = capsys.readouterr().err
    assert __import__("re").search(message, err), err
    assert str(bad) in err and time.time() - t < 10
    assert not (tmp_path / "never_built").exists(), "no model work happened"


@pytest.mark.parametrize("make", ["functools.partial(score, 0)", "Score()"])
def test_a_reward_that_is_a_partial_or_a_callable_object_is_named_when_it_fails(tmp_path, make, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("import functools\ndef score(x, completions, **columns):\n    return ['high'] * len(completions)\n"
                   "class Score:\n    def __call__(self, completions, **columns):\n        return score(0, completions)\n"
                   f"bad = {make}\n")
    with pytest.raises(SystemExit):
        M.main(["hf_recipes/toy/toy-kv--mt-grpo.yaml", f"output_dir={tmp_path}/run", f"outcome_reward_funcs=[{bad}:bad]",
                f"model_name_or_path={tmp_path}/never_built", "model_builder="])
    err = capsys.readouterr().err
    assert "returned 'high' for episode 0, not a number" in err and "Traceback" not in err, err


def test_a_dataset_without_the_columns_a_reward_needs_is_named(tmp_path, capsys):
    needs = tmp_path / "needs.py"
    needs.write_text("def needs_gold(completions, gold, **columns):\n    return [0.0] * len(completions)\n")
    with pytest.raises(SystemExit):
        M.main(["hf_recipes/toy/toy-kv--mt-grpo.yaml", f"output_dir={tmp_path}/run", f"outcome_reward_funcs=[{needs}:needs_gold]",
                f"model_name_or_path={tmp_path}/never_built", "model_builder="])
    err = capsys.readouterr().err
    assert "needs_gold" in err and "'gold'" in err and "dataset columns: prompt, key, answer" in err
