"""Long episodes: what `next_prompt` costs per turn as an episode grows, and what REALIGN saves on a template
that trims the tail of each assistant turn.

    .venv/bin/python bench/long_episodes.py [--turns 8 32 128]

1. The cost per turn (the real Qwen3 tokenizer and chat template, built by tasks/fixtures.py, native tool calls,
   thinking kept by the template, a tool result of about 500 tokens per call): `next_prompt` renders the whole
   conversation with the chat template and decodes the whole held sample every turn, so its time per turn
   grows with the history. Timed with time.perf_counter around each call, through the trainer's own env code.
2. REALIGN (Llama 3.1's chat template, which trims message content, on the Qwen3 tokenizer): T assistant
   answers that end with a blank line, each followed by a user question. The template drops the blank line
   when it renders the answer as history, so every boundary departs from the held text in the last turn's tail.
   With REALIGN the episode stays one sample; with realign_max_tokens=0 every boundary forks.
Seconds vary by machine; the table's ratios are what to compare.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import check_template as CT  # noqa: E402
import mt_grpo_trainer as M  # noqa: E402
from tasks import fixtures  # noqa: E402


def passage() -> str:
    """About 500 Qwen3 tokens of real Wikipedia text: what one search result might return."""
    with open(os.path.join(ROOT, "tasks", "data", "wiki18_sample_1000.jsonl")) as f:
        text = " ".join(json.loads(line)["contents"] for _, line in zip(range(6), f))
    return text[:2400]


def tool_episode(tok, turns: int, bridge: bool):
    """Per-turn next_prompt seconds of a `turns`-turn tool episode, its tokens and samples, and the prompts."""
    result = passage()

    def search(query: str) -> str:
        """Search.

        Args:
            query: what to search for
        """
        return result

    env = M.MultiTurnToolEnv(
        tok,
        [search],
        M.Config(system_prompt="", tool_format="native", max_env_steps=10**6, tokenization_check="strict"),
    )
    env.chat.bridge_checks = 0 if bridge else -1  # -1: the bridge is off, every prompt is a full render
    ep, times, prompts = env.new_episode({"prompt": "Find the answer."}), [], []
    for t in range(turns):
        t0 = time.perf_counter()
        prompts.append(env.next_prompt(ep))
        times.append(time.perf_counter() - t0)
        text = (
            f"<think>\nStep {t}.\n</think>\n\n<tool_call>\n"
            + json.dumps({"name": "search", "arguments": {"query": f"q{t}"}})
            + "\n</tool_call>"
        )
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        env.run_tools([(ep, c) for c in env.step(ep, M.Completion(ids, [0.0] * len(ids), "stop"))])
    assert env.chat.check_tokenization(ep) == 0, "the episode-end check agrees with every prompt"
    return times, sum(len(s.input_ids) for s in ep.samples), len(ep.samples), prompts


def realign_episode(tok, turns: int, realign: int):
    env = M.MultiTurnToolEnv(
        tok,
        [CT._sim_search],
        M.Config(system_prompt="", tool_format="native", realign_max_tokens=realign, tokenization_check="strict"),
    )
    script = [
        x for t in range(turns) for x in (("assistant", f"Answer {t} is {t * 7}.\n\n"), ("user", f"And {t + 1}?"))
    ]
    ep, seen = CT.simulate_episode(env, script[:-1], tok.eos_token_id)
    assert CT.check_invariants(ep, seen, env) == [], "the invariants hold either way"
    trained = sum(sum(s.loss_mask) for s in ep.samples)
    return len(ep.samples), sum(len(s.input_ids) for s in ep.samples), trained, ep.realigned_tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, nargs="+", default=[8, 32, 128])
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fixtures.path("qwen3_tokenizer"))
    tok.chat_template = open(fixtures.path("qwen3_chat_template.jinja")).read()
    print("## next_prompt per turn (Qwen3 template, native tools, ~500-token results): full render vs the bridge\n")
    print("| turns | tokens | samples | next_prompt | first turn | last turn | mean of the last 8 | whole episode |")
    print("|---|---|---|---|---|---|---|---|")
    for T in args.turns:
        runs = {name: tool_episode(tok, T, name == "bridge") for name in ("full render", "bridge")}
        assert runs["bridge"][3] == runs["full render"][3], "the bridge gives the sampler exactly the same prompts"
        for name, (times, tokens, samples, _) in runs.items():
            print(
                f"| {T} | {tokens / 1000:.1f}k | {samples} | {name} | {times[0] * 1e3:.1f} ms | {times[-1] * 1e3:.1f} ms | "
                f"{sum(times[-8:]) / len(times[-8:]) * 1e3:.2f} ms | {sum(times):.3f} s |"
            )
    llama = AutoTokenizer.from_pretrained(fixtures.path("qwen3_tokenizer"))
    llama.chat_template = open(fixtures.path("llama3_1_chat_template.jinja")).read()
    print("\n## REALIGN on a template that trims (Llama 3.1's, answers that end with a blank line)\n")
    print("| turns | mode | samples | tokens processed | tokens trained | sampled tokens untrained |")
    print("|---|---|---|---|---|---|")
    for T in args.turns:
        for name, n in (("REALIGN (16)", 16), ("fork (0)", 0)):
            samples, tokens, trained, gone = realign_episode(llama, T, n)
            print(f"| {T} | {name} | {samples} | {tokens} | {trained} | {gone} |")


if __name__ == "__main__":
    main()
