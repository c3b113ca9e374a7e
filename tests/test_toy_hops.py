"""The multi-hop task where credit decides (tasks/toy_hops.py): its splits, keys, tool, rewards on hand-made
episodes, recipe and model."""

import json
import random
import re

import pytest

import mt_grpo_trainer as M
from rewards.toy_hops_reward import (
    chain_completed_reward,
    exact_answer_reward,
    first_hop_reward,
    format_reward,
    hop_reward,
    hops_reward,
)
from tasks import toy_hops as T
from tools.hop_lookup import ANSWERS, CHAINS, COLOURS, KEYS, hop_lookup

RECIPE = "hf_recipes/toy/toy-hops--mt-grpo.yaml"


def rewards(episode_msgs, row):
    cols = {k: [v] for k, v in row.items()}
    fns = (hop_reward, first_hop_reward, hops_reward, chain_completed_reward, exact_answer_reward, format_reward)
    return {fn.__name__: fn([episode_msgs], **cols)[0] for fn in fns}


def lookup(key):
    call = json.dumps({"name": "hop_lookup", "args": {"key": key}})
    return [
        {"role": "assistant", "content": f"<reasoning>x</reasoning>\n<tool>{call}</tool>"},
        {"role": "user", "content": f"<result>\n{T.tool_reply(key)}\n</result>"},
    ]


def answer(text):
    return [{"role": "assistant", "content": f"<reasoning>x</reasoning>\n<answer>{text}</answer>"}]


@pytest.mark.parametrize("hops", [3, 4])
def test_no_chain_is_in_both_splits_and_each_split_is_balanced(hops):
    train, held_out = T.split(hops)
    assert len(train) >= 64 and len(held_out) >= 16 and not set(train) & set(held_out)
    assert {c[0] for c in CHAINS[hops]} == set(train) | set(held_out)
    keys_of = {k: set(T.CHAIN_OF[k]) for k in train + held_out}
    assert not set().union(*(keys_of[k] for k in train)) & set().union(*(keys_of[k] for k in held_out))
    assert sorted(ANSWERS[k] for k in held_out) == sorted(COLOURS * (len(held_out) // len(COLOURS)))
    rows = T.make_dataset(4096, hops=hops)
    assert {r["start"] for r in rows} == set(train)  # every training chain is drawn, no held-out one
    ev = T.make_eval_dataset(hops)
    assert len(ev) >= 64 and {r["start"] for r in ev} == set(held_out)
    assert all(len(r["chain"]) == hops and r["answer"] == ANSWERS[r["start"]] for r in rows + ev)
    assert len(KEYS) == len(set(KEYS))  # no key in two chains, of either variant


def test_each_lookup_names_the_next_key_and_the_last_the_colour():
    first, second, third = CHAINS[3][0]
    assert hop_lookup(first) == f'"{first}" -> "{second}"'
    assert hop_lookup(third) == f'"{third}" -> "{ANSWERS[first]}"'
    with pytest.raises(KeyError):
        hop_lookup("zzzz")
    assert T.tool_reply("zzzz").startswith("Error: KeyError")


def test_a_right_chain_earns_every_hop_the_outcome_and_the_completion():
    row = T.make_dataset(1)[0]
    demo = T.demonstration(row, "", random.Random(0), p_call=1.0)[1:]
    assert rewards(demo, row) == {
        "hop_reward": [1.0, 1.0, 1.0, 0.0],  # one entry per assistant message
        "first_hop_reward": 1.0,
        "hops_reward": 3.0,
        "chain_completed_reward": 1.0,
        "exact_answer_reward": 1.0,
        "format_reward": 1.0,
    }


def test_a_stray_call_earns_nothing_for_its_turn_and_the_chain_goes_on_after_it():
    row = T.make_dataset(1)[0]
    start, second, third = row["chain"]
    other = next(c for c in CHAINS[3] if c[0] != start)
    stray = lookup(start) + lookup(other[1]) + lookup(second) + lookup(third) + answer(row["answer"])
    r = rewards(stray, row)
    assert r["hop_reward"] == [1.0, 0.0, 1.0, 1.0, 0.0] and r["chain_completed_reward"] == 1.0
    again = lookup(start) + lookup(start) + answer(row["answer"])  # the key just looked up, again
    assert rewards(again, row)["hop_reward"] == [1.0, 0.0, 0.0]
    skip = lookup(second) + lookup(third) + answer(row["answer"])  # a right colour without the first hop
    r = rewards(skip, row)
    assert (r["hop_reward"], r["first_hop_reward"], r["chain_completed_reward"]) == ([0.0, 0.0, 0.0], 0.0, 0.0)
    assert r["exact_answer_reward"] == 1.0
    wrong = lookup(start) + lookup(second) + lookup(third) + answer(next(c for c in COLOURS if c != row["answer"]))
    assert rewards(wrong, row)["hops_reward"] == 3.0 and rewards(wrong, row)["chain_completed_reward"] == 0.0


def test_the_noisy_tool_varies_its_results_and_the_rewards_score_them_as_the_exact_ones():
    """tools/hop_lookup_noisy.py (the variant where states rarely repeat): the same record, then 1 to 16 dots."""
    from tools import hop_lookup_noisy

    row = T.make_dataset(1)[0]
    replies = [hop_lookup_noisy.hop_lookup(row["start"]) for _ in range(64)]
    assert all(r.startswith(hop_lookup(row["start"]) + " .") for r in replies)
    assert len(set(replies)) == 16
    exact = T.demonstration(row, "", random.Random(0), p_call=1.0)[1:]
    noisy = [dict(m) for m in exact]
    for m, key in zip(noisy[1::2], row["chain"]):
        m["content"] = m["content"].replace(hop_lookup(key), hop_lookup_noisy.hop_lookup(key))
    assert noisy != exact and rewards(noisy, row) == rewards(exact, row)
    assert M.load_object("tools/hop_lookup_noisy.py:hop_lookup").__name__ == "hop_lookup", "the name the model calls"


def test_a_guess_pays_1_time_in_8_and_never_completes_a_chain():
    rng = random.Random(1)
    rows = T.make_dataset(1600, seed=3)
    eps = [T.demonstration(r, "", rng, p_call=0.0)[1:] for r in rows]
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    em = exact_answer_reward(eps, **cols)
    assert 0.09 < sum(em) / len(em) < 0.16
    assert not any(chain_completed_reward(eps, **cols)) and not any(first_hop_reward(eps, **cols))
    assert all(format_reward(eps, **cols))


def test_recipe_weights_exact_match_alone_and_leaves_room_for_a_stray_call():
    cfg = M.load_config(RECIPE)
    weights = dict(zip((s.split(":")[1] for s in cfg.outcome_reward_funcs), cfg.outcome_reward_weights))
    assert weights == {
        "exact_answer_reward": 1.0,
        "format_reward": 0.0,
        "hops_reward": 0.0,
        "chain_completed_reward": 0.0,
    }
    assert cfg.max_env_steps >= 3 + 1
    assert (cfg.eval_temperature, cfg.eval_samples) == (1.0, 2)


def test_the_model_builds_and_every_key_is_one_token(tmp_path, monkeypatch):
    monkeypatch.setitem(T.WARMSTART, "steps", 2)
    monkeypatch.setitem(T.WARMSTART, "lookup_only_steps", 1)
    monkeypatch.setitem(T.WARMSTART, "demonstrations", 32)
    report = T.build_model(str(tmp_path / "m"))
    assert report["builder"] == "tasks/toy_hops.py" and report["warmstart"]["hops"] == 3
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    for k in (k for c in CHAINS[3] for k in c):  # after a quote, as in a question, a query and a result
        assert tok.tokenize(f'"{k}"') == ['"', k, '"']
    # a key is a whole word: no word of the task's fixed text is one, and a longer word is not split around one
    text = " ".join(T.QUESTIONS) + " Look it up. A guess: The chain ends at Error: KeyError: no key"
    assert not set(re.findall(r"[a-z]+", text.lower())) & set(KEYS)
    assert CHAINS[3][0][0] not in tok.tokenize(f"x{CHAINS[3][0][0]}y")
