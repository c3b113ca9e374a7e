"""The eval command (greedy episodes, its table and files) and evaluation during training every eval_steps.
(Reward functions checked before any model work: test_rewards.py.)"""

import json

import pytest
import torch

import mt_grpo_trainer as M
from tests.conftest import main_error, recipe_cfg


def test_eval_command_runs_greedy_episodes_and_writes_the_table(tiny_model_dir, tmp_path, capsys, monkeypatch):
    generate = M.LocalSampler.generate
    calls = []  # every batch the sampler drew: its model, prompts and completions

    def recorded(self, prompts, *a, **k):
        out = generate(self, prompts, *a, **k)
        calls.append((self.model, prompts, out))
        return out

    monkeypatch.setattr(M.LocalSampler, "generate", recorded)
    M.main(
        [
            "eval",
            "hf_recipes/toy/toy-kv--mt-grpo.yaml",
            f"model_name_or_path={tiny_model_dir}",
            "model_builder=",
            f"output_dir={tmp_path}/run",
            "eval_max_examples=6",
            "max_tokens=12",
        ]
    )
    out = capsys.readouterr().out
    assert "| exact_answer_reward |" in out and "| lookup_hit_reward |" in out
    rows = [json.loads(x) for x in open(tmp_path / "run" / "eval" / "step-0.jsonl")]
    assert [r["row"] for r in rows] == list(range(6))
    assert all(set(r["rewards"]) == {"exact_answer_reward", "lookup_hit_reward"} for r in rows)
    summary = json.loads(open(tmp_path / "run" / "eval" / "metrics.jsonl").readline())
    assert summary["model"] == tiny_model_dir and 0 <= summary["eval/exact_answer_reward"] <= 1
    # greedy: every sampled token is the argmax of a teacher-forced pass over what came before it (the random model's
    # next-token distribution is near uniform, so a sampled turn would differ; two seeded runs would not tell)
    assert calls and sum(len(c.ids) for _, _, out in calls for c in out) > 6
    for model, prompts, out in calls:
        for prompt, c in zip(prompts, out):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + c.ids])).logits[0, len(prompt) - 1 : -1].float()
            picked = logits.gather(-1, torch.tensor(c.ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(picked, logits.max(-1).values, rtol=0, atol=1e-4)


def test_eval_without_an_eval_dataset_is_a_clear_error(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        M.main(
            [
                "eval",
                "hf_recipes/toy/toy-kv--mt-grpo.yaml",
                f"model_name_or_path={tiny_model_dir}",
                "model_builder=",
                f"output_dir={tmp_path}/run",
                "eval_dataset=",
            ]
        )
    assert "eval needs eval_dataset" in capsys.readouterr().err


def test_eval_of_the_newest_checkpoint_where_there_is_none_stops_and_says_so(tmp_path, capsys):
    err = main_error(
        capsys,
        "eval",
        "hf_recipes/toy/toy-kv--mt-grpo.yaml",
        f"model_name_or_path={tmp_path}/none",
        "model_builder=",
        f"output_dir={tmp_path}/run",
        "resume_from_checkpoint=auto",
    )
    assert f"'{tmp_path}/run' holds no checkpoint, so it would evaluate the untrained {tmp_path}/none" in err, err
    assert not (tmp_path / "run").exists(), "nothing evaluated, nothing written"


def test_training_evaluates_every_eval_steps(tiny_model_dir, tmp_path):
    hist = M.train(
        recipe_cfg(
            tmp_path,
            f"model_name_or_path={tiny_model_dir}",
            "model_builder=",
            "max_steps=2",
            "eval_steps=2",
            "eval_max_examples=4",
            "prompts_per_step=2",
            "num_generations=2",
            "max_tokens=12",
        )
    )
    assert [h["step"] for h in hist] == [0, 1, 2], "step 0: the evaluation before training, a row of its own"
    assert ["eval/exact_answer_reward" in h for h in hist] == [True, False, True]
    assert (tmp_path / "run" / "eval" / "step-2.jsonl").is_file()


def test_a_run_without_evaluation_writes_no_eval_folder(tiny_model_dir, tmp_path):
    M.train(
        recipe_cfg(
            tmp_path,
            f"model_name_or_path={tiny_model_dir}",
            "model_builder=",
            "max_steps=1",
            "eval_steps=0",
            "prompts_per_step=2",
            "num_generations=2",
            "max_tokens=12",
        )
    )
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    assert not (tmp_path / "run" / "eval").exists()


def eval_command(tiny_model_dir, out, *extra):
    M.main(
        [
            "eval",
            "hf_recipes/toy/toy-kv--mt-grpo.yaml",
            f"model_name_or_path={tiny_model_dir}",
            "model_builder=",
            f"output_dir={out}",
            "eval_max_examples=4",
            "max_tokens=12",
            *extra,
        ]
    )
    return [json.loads(x) for x in open(out / "eval" / "step-0.jsonl")]


def test_sampled_eval_is_seeded_so_a_rerun_gives_the_same_episodes(tiny_model_dir, tmp_path, capsys):
    sampled = ("eval_temperature=1.0", "eval_samples=2")
    rows = eval_command(tiny_model_dir, tmp_path / "a", *sampled)
    assert [(r["row"], r["sample"]) for r in rows] == [(i, j) for i in range(4) for j in range(2)]
    assert any(a["messages"] != b["messages"] for a, b in zip(rows[::2], rows[1::2]))  # sampled, not greedy copies
    again = eval_command(tiny_model_dir, tmp_path / "b", *sampled)
    assert [r["messages"] for r in again] == [r["messages"] for r in rows]
    other_seed = eval_command(tiny_model_dir, tmp_path / "c", *sampled, "seed=1")
    assert [r["messages"] for r in other_seed] != [r["messages"] for r in rows]
    # greedy exact match beside it: one episode a row, the same as a greedy eval's
    beside = [json.loads(x) for x in open(tmp_path / "a" / "eval" / "step-0-greedy.jsonl")]
    greedy = eval_command(tiny_model_dir, tmp_path / "d")
    assert [r["messages"] for r in beside] == [r["messages"] for r in greedy]
    summary = json.loads(open(tmp_path / "a" / "eval" / "metrics.jsonl").readline())
    assert {"eval/exact_answer_reward", "eval/greedy_exact_answer_reward"} <= set(summary)
    assert "temperature 1.0, seeded" in capsys.readouterr().out


def test_the_evaluation_at_step_0_is_a_metrics_row_kept_once_on_resume_and_in_the_summary(
    tiny_model_dir, tmp_path, capsys
):
    """The model before training is a row of metrics.jsonl (its eval/ keys at step 0), which the closing summary
    compares with the last evaluation; a run resumed from a checkpoint keeps it once and logs every later step once."""
    common = [
        f"model_name_or_path={tiny_model_dir}",
        "model_builder=",
        "eval_steps=2",
        "eval_max_examples=2",
        "prompts_per_step=2",
        "num_generations=2",
        "max_tokens=12",
        "save_steps=1",
        "log_episodes_steps=0",
    ]
    M.train(recipe_cfg(tmp_path, *common, "max_steps=2"))
    assert (tmp_path / "run" / "eval" / "step-0.jsonl").is_file()
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert {k for k in rows[0] if k.startswith("eval/")} == {k for k in rows[2] if k.startswith("eval/")} != set()
    assert "reward/outcome" not in rows[0], "step 0 trained nothing"
    out = capsys.readouterr().out
    first, last = (r["eval/exact_answer_reward"] for r in (rows[0], rows[2]))
    assert f"eval/exact_answer_reward {first:.3f} (step 0) -> {last:.3f} (step 2)" in out, out
    assert "before/after: step 1 -> step 2" in out
    M.train(recipe_cfg(tmp_path, *common, "max_steps=2", f"resume_from_checkpoint={tmp_path}/run/checkpoint-1"))
    again = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in again] == [0, 1, 2] and again[:2] == rows[:2]
