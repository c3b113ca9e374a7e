"""The multi-hop task (tasks/toy_chain.py): its tool, data, rewards (per turn and episode level), recipe and model."""

import json
import os
import random

import pytest

import mt_grpo_trainer as M
from rewards.toy_kv_reward import final_answer
from rewards.toy_chain_reward import (
    exact_answer_reward,
    first_hop_reward,
    format_reward,
    hop_reward,
    hops_reward,
)
from tasks import toy_chain as T
from tools.chain_lookup import ANSWERS, CHAINS, COLOURS, HOPS, KEYS, chain_lookup

RECIPE = "hf_recipes/toy/toy-chain--mt-grpo.yaml"


def rewards(episode_msgs, row):
    cols = {k: [v] for k, v in row.items()}
    return {
        fn.__name__: fn([episode_msgs], **cols)[0]
        for fn in (hop_reward, first_hop_reward, hops_reward, exact_answer_reward, format_reward)
    }


def lookup(key):
    call = json.dumps({"name": "chain_lookup", "args": {"key": key}})
    return [
        {"role": "assistant", "content": f"<reasoning>x</reasoning>\n<tool>{call}</tool>"},
        {"role": "user", "content": f"<result>\n{T.tool_reply(key)}\n</result>"},
    ]


def answer(text):
    return [{"role": "assistant", "content": f"<reasoning>x</reasoning>\n<answer>{text}</answer>"}]


def test_each_lookup_names_the_next_key_and_the_last_the_colour():
    first, second, third = CHAINS[0]
    assert chain_lookup(first) == f'"{first}" -> "{second}"'
    assert chain_lookup(second) == f'"{second}" -> "{third}"'
    assert chain_lookup(third) == f'"{third}" -> "{ANSWERS[first]}"'
    with pytest.raises(KeyError):
        chain_lookup("zzzz")
    assert T.tool_reply("zzzz").startswith("Error: KeyError")
    assert sorted(k for c in CHAINS for k in c) == sorted(KEYS) and all(len(c) == HOPS for c in CHAINS)


def test_answers_are_balanced_and_the_eval_chains_are_held_out():
    assert sorted(ANSWERS.values()) == sorted(COLOURS * (len(CHAINS) // 4))  # a guess is right 1 time in 4
    ev = T.make_eval_dataset()
    assert len(ev) == 24 and {r["start"] for r in ev} == set(T.EVAL_CHAINS)
    assert sorted(ANSWERS[k] for k in T.EVAL_CHAINS) == sorted(COLOURS * 2)
    train = T.make_dataset(512)
    assert not {r["start"] for r in train} & set(T.EVAL_CHAINS)
    assert all(r["chain"][0] == r["start"] and r["answer"] == ANSWERS[r["start"]] for r in train + ev)
    assert all(f'"{r["start"]}"' in r["prompt"] for r in train)  # quoted: the same token as in a query


def test_a_right_chain_earns_every_hop_and_the_outcome():
    row = T.make_dataset(1)[0]
    demo = T.demonstration(row, "", random.Random(0), p_call=1.0)[1:]
    assert [m["role"] for m in demo] == ["assistant", "user"] * HOPS + ["assistant"]
    assert [m["content"] for m in demo[1::2]] == [f"<result>\n{chain_lookup(k)}\n</result>" for k in row["chain"]]
    assert rewards(demo, row) == {
        "hop_reward": [1.0, 1.0, 1.0, 0.0],  # one entry per assistant message
        "first_hop_reward": 1.0,
        "hops_reward": 3.0,
        "exact_answer_reward": 1.0,
        "format_reward": 1.0,
    }


def test_a_repeated_or_off_chain_lookup_earns_nothing_for_its_turn():
    row = T.make_dataset(1)[0]
    start, second, _ = row["chain"]
    loop = lookup(start) + lookup(start) + answer("red")  # the key just looked up, copied from the result again
    r = rewards(loop, row)
    assert (r["hop_reward"], r["first_hop_reward"], r["hops_reward"]) == ([1.0, 0.0, 0.0], 1.0, 1.0)
    other = next(c for c in CHAINS if c[0] != start)
    off = lookup(start) + lookup(other[1]) + lookup(second) + answer(row["answer"])
    r = rewards(off, row)
    # a later lookup of the right key still takes the chain a hop further
    assert r["hop_reward"] == [1.0, 0.0, 1.0, 0.0] and r["hops_reward"] == 2.0 and r["exact_answer_reward"] == 1.0
    skip = lookup(second) + answer(row["answer"])  # skipping a hop is no hop
    assert rewards(skip, row)["hop_reward"] == [0.0, 0.0] and rewards(skip, row)["first_hop_reward"] == 0.0
    error = lookup("zzzz") + answer("red")
    assert rewards(error, row)["hop_reward"] == [0.0, 0.0]


def test_a_guess_sometimes_pays_and_earns_no_hop():
    rng, rows = random.Random(1), T.make_dataset(400, seed=3)
    eps = [T.demonstration(r, "", rng, p_call=0.0)[1:] for r in rows]
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    em = exact_answer_reward(eps, **cols)
    assert 0.15 < sum(em) / len(em) < 0.35  # right about 1 time in 4
    assert hop_reward(eps, **cols) == [[0.0]] * len(eps) and not any(first_hop_reward(eps, **cols))
    assert all(format_reward(eps, **cols))


def test_the_demonstration_mix_stops_at_each_hop_at_its_rate():
    rng, rows = random.Random(2), T.make_dataset(3000, seed=4)
    eps = [T.demonstration(r, "", rng)[1:] for r in rows]
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    hops = hops_reward(eps, **cols)
    for k, p in enumerate(T.WARMSTART["p_call"]):  # of the episodes that reached lookup turn k, those that looked up
        reached = [h for h in hops if h >= k]
        assert abs(sum(h > k for h in reached) / len(reached) - p) < 0.06
    # each demonstration writes the colour it answers in its reasoning first, and after the last hop it is right
    assert all(final_answer(e) in e[-1]["content"].split("</reasoning>")[0] for e in eps)
    assert all(em == 1.0 for em, h in zip(exact_answer_reward(eps, **cols), hops) if h == HOPS)
    assert all(format_reward(eps, **cols))


def test_the_demonstrations_show_the_tool_reply_the_environment_gives():
    cfg = M.load_config(RECIPE)
    env = M.MultiTurnToolEnv(None, [M.load_object(s, "tool") for s in cfg.tools], cfg)
    for key in (CHAINS[0][0], CHAINS[0][-1], "zzzz"):
        ep = M.Episode(row={}, messages=[], n_prompt_messages=0)
        env.run_tools([(ep, {"name": "chain_lookup", "args": {"key": key}})])
        assert ep.messages[-1]["content"] == f"<result>\n{T.tool_reply(key)}\n</result>"


def test_recipe_loads_with_room_for_the_whole_chain():
    cfg = M.load_config(RECIPE)
    assert cfg.max_env_steps == HOPS and cfg.tool_format == "xml"
    root = os.path.dirname(os.path.abspath(M.__file__))  # recipe paths are made absolute where they were found
    assert [os.path.relpath(s, root) for s in cfg.turn_reward_funcs] == ["rewards/toy_chain_reward.py:first_hop_reward"]
    assert (os.path.relpath(cfg.model_builder, root), os.path.relpath(cfg.eval_dataset, root)) == (
        "tasks/toy_chain.py:build_model",
        "tasks/toy_chain.py:make_eval_dataset",
    )


def test_the_model_builds_and_every_key_is_one_token(tmp_path, monkeypatch):
    monkeypatch.setitem(T.WARMSTART, "steps", 2)
    monkeypatch.setitem(T.WARMSTART, "lookup_only_steps", 1)
    monkeypatch.setitem(T.WARMSTART, "demonstrations", 32)
    report = T.build_model(str(tmp_path / "m"))
    assert report["builder"] == "tasks/toy_chain.py" and report["warmstart"]["steps"] == 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    # a key is one token after a quote in the question, the query and a result alike, so a lookup can copy it
    for k in KEYS:
        assert tok.tokenize(f'"{k}"') == ['"', k, '"']
