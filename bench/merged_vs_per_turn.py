"""Tokens the trainer processes per episode: merged samples (extension) vs one sample per turn.

    .venv/bin/python bench/merged_vs_per_turn.py [--tokenizer DIR] [--chat-template FILE]

Simulates T-turn episodes (T = 2, 4, 8, 16; tool calls, or a new user query every turn) with the real Qwen3 tokenizer and chat template
(built by tasks/fixtures.py), with thinking, through the trainer's own env code. "merged" is what the trainer
processes (sum of its sample lengths); "per turn" is what training one sample per turn would cost
(each turn's whole prompt plus its completion). Extension makes the first O(T), the second is O(T^2).
Token counts, not seconds: the table does not depend on the machine.
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import check_template as CT  # noqa: E402
import mt_grpo_trainer as M  # noqa: E402
from tasks import fixtures  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=None, help="default: the Qwen3 tokenizer tasks/fixtures.py builds")
    ap.add_argument("--chat-template", default=None, help="default: the Qwen3 chat template tasks/fixtures.py builds")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    args.tokenizer = args.tokenizer or fixtures.path("qwen3_tokenizer")
    args.chat_template = args.chat_template or fixtures.path("qwen3_chat_template.jinja")
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    tok.chat_template = open(args.chat_template).read()
    print(f"tokenizer {args.tokenizer}\n")
    print("| episode | turns T | retention | samples | merged tokens | per-turn tokens | per-turn / merged |")
    print("|---|---|---|---|---|---|---|")
    for scenario in ("tool calls", "user turns"):
        for retention in ("template", "all"):
            for T in (2, 4, 8, 16):
                cfg = M.Config(
                    system_prompt="You are a helpful assistant.",
                    tool_format="native",
                    max_env_steps=100,
                    thinking_retention=retention,
                    tokenization_check="strict",
                )
                env = M.MultiTurnToolEnv(tok, [CT._sim_search], cfg)
                script = []
                for t in range(T - 1):
                    if scenario == "tool calls":
                        script.append(
                            (
                                "assistant",
                                f"<think>\nStep {t}: I should search for part {t} of the question.\n</think>\n\n"
                                '<tool_call>\n{"name": "_sim_search", "arguments": {"query": "part %d"}}\n</tool_call>'
                                % t,
                            )
                        )
                    else:
                        script += [
                            (
                                "assistant",
                                f"<think>\nStep {t}: the user asks about part {t}.\n</think>\n\nPart {t} is done.",
                            ),
                            ("user", f"Now do part {t + 1}."),
                        ]
                script.append(("assistant", "<think>\nI have everything now.\n</think>\n\nThe answer is 42."))
                ep, seen = CT.simulate_episode(env, script, tok.eos_token_id)
                assert CT.check_invariants(ep, seen, env) == []
                merged = sum(len(s.input_ids) for s in ep.samples)
                per_turn = sum(len(p) + len(ids) for p, ids in seen)
                print(
                    f"| {scenario} | {T} | {retention} | {len(ep.samples)} | {merged} | {per_turn} | {per_turn / merged:.2f}x |"
                )
    print(
        "\nQwen3's template keeps past thinking inside a tool cycle (one sample either way) and drops it at every "
        "new user query: under `template` each user turn forks, under `all` the episode stays one sample."
    )


if __name__ == "__main__":
    main()
