"""The paper-effect task (tasks/toy_flags.py): its tool, its rewards, its recipe, and bench/paper_effect.py's tables."""

import os
import random
import sys

import pytest

import mt_grpo_trainer as M
from conftest import ROOT
from rewards.toy_flags_reward import answer_in_result_reward, exact_answer_reward, format_reward, tool_execution_reward
from tasks import toy_flags as T
from tools.flag_registry import COLOURS, FLAGS, NAMES, flag_registry

sys.path.insert(0, f"{ROOT}/bench")
import paper_effect  # noqa: E402

RECIPE = "hf_recipes/toy/toy-flags--mt-grpo.yaml"


def rewards(episode_msgs, row):
    cols = {"name": [row["name"]], "answer": [row["answer"]]}
    return {
        fn.__name__: fn([episode_msgs], **cols)[0]
        for fn in (tool_execution_reward, answer_in_result_reward, exact_answer_reward, format_reward)
    }


def test_only_a_well_formed_query_naming_the_country_returns_its_colour():
    assert flag_registry("flag:kalo") == f"kalo: {FLAGS['kalo']}"
    with pytest.raises(ValueError):
        flag_registry("kalo")  # the bare name: wrong form
    with pytest.raises(ValueError):
        flag_registry("flag of kalo")
    with pytest.raises(KeyError):
        flag_registry("flag:kal")  # no such country
    other = next(n for n in NAMES if FLAGS[n] != FLAGS["kalo"])
    assert FLAGS["kalo"] not in flag_registry(f"flag:{other}")


def test_answers_are_balanced_and_the_eval_countries_are_held_out():
    assert sorted(FLAGS.values()) == sorted(COLOURS * 8)  # a guess is right 1 time in 4, whatever it guesses
    ev = T.make_eval_dataset()
    assert len(ev) == 24 and {r["name"] for r in ev} == set(T.EVAL_NAMES)
    assert sorted(FLAGS[n] for n in T.EVAL_NAMES) == sorted(COLOURS * 2)
    assert not {r["name"] for r in T.make_dataset(512)} & set(T.EVAL_NAMES)


def test_a_right_call_earns_every_column_and_a_wrong_one_loses_the_outcome():
    row, rng = T.make_dataset(1)[0], random.Random(0)
    right = T.demonstration(row, "", rng, p_tool=1.0, p_right_form=1.0)[1:]
    assert rewards(right, row) == {
        "tool_execution_reward": 1.0,
        "answer_in_result_reward": 1.0,
        "exact_answer_reward": 1.0,
        "format_reward": 1.0,
    }
    wrong = T.demonstration(row, "", rng, p_tool=1.0, p_right_form=0.0)[1:]
    assert "Error: ValueError" in wrong[1]["content"]
    assert rewards(wrong, row) == {
        "tool_execution_reward": 0.0,
        "answer_in_result_reward": 0.0,
        "exact_answer_reward": 0.0,
        "format_reward": 1.0,
    }


def test_a_call_that_runs_but_names_another_country_scores_execution_only():
    row = T.make_dataset(1)[0]
    other = next(n for n in NAMES if FLAGS[n] != row["answer"])
    eps = [
        {
            "role": "assistant",
            "content": '<reasoning>x</reasoning>\n<tool>{"name": "flag_registry", "args": {"query": "flag:%s"}}</tool>'
            % other,
        },
        {"role": "user", "content": f"<result>\n{flag_registry('flag:' + other)}\n</result>"},
        {"role": "assistant", "content": f"<reasoning>x</reasoning>\n<answer>{FLAGS[other]}</answer>"},
    ]
    r = rewards(eps, row)
    assert (r["tool_execution_reward"], r["answer_in_result_reward"], r["exact_answer_reward"]) == (1.0, 0.0, 0.0)


def test_a_direct_guess_sometimes_scores_and_earns_no_turn_reward():
    rng, rows = random.Random(1), T.make_dataset(400, seed=3)
    eps = [T.demonstration(r, "", rng, p_tool=0.0)[1:] for r in rows]
    cols = {"name": [r["name"] for r in rows], "answer": [r["answer"] for r in rows]}
    em = exact_answer_reward(eps, **cols)
    assert 0.15 < sum(em) / len(em) < 0.35  # right about 1 time in 4
    assert sum(tool_execution_reward(eps, **cols)) == sum(answer_in_result_reward(eps, **cols)) == 0
    assert all(format_reward(eps, **cols))


def test_format_reward_rejects_a_turn_outside_the_protocol():
    bad = [
        [{"role": "assistant", "content": "<answer>red</answer>"}],  # no reasoning
        [{"role": "assistant", "content": "<reasoning>x</reasoning>\n<tool>{}</tool>"}],  # never answers
        [{"role": "assistant", "content": "<reasoning>x</reasoning>\n<answer>red</answer> extra"}],
    ]
    assert format_reward(bad) == [0.0, 0.0, 0.0]


def test_the_demonstrations_show_the_tool_reply_the_environment_gives():
    cfg = M.load_config(RECIPE)
    env = M.MultiTurnToolEnv(None, [M.load_object(s, "tool") for s in cfg.tools], cfg)
    for query in ("flag:kalo", "kalo", "flag:zz"):
        ep = M.Episode(row={}, messages=[], n_prompt_messages=0)
        env.run_tools([(ep, {"name": "flag_registry", "args": {"query": query}})])
        assert ep.messages[-1]["content"] == f"<result>\n{T.tool_reply(query)}\n</result>"


def test_recipe_loads_and_its_reward_functions_are_the_papers_columns():
    cfg = M.load_config(RECIPE)
    names = [s.split(":")[1] for s in cfg.turn_reward_funcs + cfg.outcome_reward_funcs]
    assert names[:2] == ["tool_execution_reward", "answer_in_result_reward"]  # turn level: the tool turn
    assert set(names) == set(paper_effect.COLUMNS)
    assert (
        os.path.relpath(cfg.eval_dataset, os.path.dirname(os.path.abspath(M.__file__)))
        == "tasks/toy_flags.py:make_eval_dataset"
        and os.path.relpath(cfg.model_builder, os.path.dirname(os.path.abspath(M.__file__)))
        == "tasks/toy_flags.py:build_model"
    )


def synthetic_run(rate, em_train, final_eval, steps=12):
    rows = [
        {"step": i + 1, "rollout/tool_rate_turn0": rate(i), "reward/exact_answer_reward": em_train(i)}
        for i in range(steps)
    ]
    rows[-1].update({f"eval/{k}": v for k, v in final_eval.items()})
    return rows


def test_bench_arguments_and_tables():
    args = paper_effect.parse_args(["--seeds", "3", "4", "--max-steps", "12", "--target", "0.6"])
    assert (args.seeds, args.max_steps, args.target) == ([3, 4], 12, 0.6)
    assert paper_effect.parse_args([]).seeds == list(range(100, 108))

    def ev(em, tool):
        return {
            "tool_execution_reward": tool,
            "answer_in_result_reward": tool,
            "format_reward": 1.0,
            "exact_answer_reward": em,
        }

    runs = {
        ("mt_grpo", 3): synthetic_run(lambda i: 0.5 + i / 24, lambda i: i / 10, ev(0.9, 1.0)),
        ("mt_grpo", 4): synthetic_run(lambda i: 0.5, lambda i: 0.2, ev(0.2, 0.0)),
        ("grpo_outcome", 3): synthetic_run(lambda i: 0.5 - i / 24, lambda i: 0.25, ev(0.25, 0.0)),
        ("grpo_outcome", 4): synthetic_run(lambda i: 0.5 - i / 24, lambda i: 0.25, ev(0.5, 0.0)),
        ("grpo_merged", 3): synthetic_run(lambda i: 0.5, lambda i: 0.3, ev(0.3, 0.5)),
        ("grpo_merged", 4): synthetic_run(lambda i: 0.5, lambda i: 0.3, ev(0.3, 0.5)),
    }
    out = paper_effect.tables(runs, [3, 4], 0.6, warm=ev(0.25, 0.0), window=2)
    first = out.split("Exact match per seed")[0]
    rows = {line.split(" | ")[0].strip("| "): line for line in first.splitlines() if line.startswith("| ")}
    # MT-GRPO: exact match mean (0.9 + 0.2) / 2; tool rate first two steps 0.52 (seed 3 0.52, seed 4 0.5) ...
    assert rows["MT-GRPO"].startswith("| MT-GRPO | 0.500 | 0.500 | 1.000 | 0.550 | 0.51 -> ")
    # ... trailing-2 training exact match of seed 3 reaches 0.6 at step 8 (0.6, 0.7 -> 0.65); seed 4 never
    assert rows["MT-GRPO"].endswith("| 8 - |")
    assert "| 0.48 -> 0.06 |" in rows["GRPO-OR"]  # the falling tool-call rate shows
    assert rows["warm-start (step 0)"].startswith("| warm-start (step 0) | 0.000 | 0.000 | 1.000 | 0.250 |")
    assert "| GRPO-OR | 0.250 | 0.500 |" in out  # exact match per seed
    assert out.endswith("on 1 of 2 seeds.")
    # a step in which no episode called the tool has no rollout/tool_rate_turn0 key: it counts as 0
    for row in runs[("grpo_outcome", 3)] + runs[("grpo_outcome", 4)]:
        del row["rollout/tool_rate_turn0"]
    assert "| 0.00 -> 0.00 |" in paper_effect.tables(runs, [3, 4], 0.6, window=2).split("| GRPO-OR |")[1].split("\n")[0]
