"""check-template: simulate multi-turn episodes through the trainer's own environment code, before training.

    python mt_grpo_trainer.py check-template --tokenizer DIR_OR_HUB_ID [--chat-template FILE] [--json]
    python mt_grpo_trainer.py check-template --chat-template DIR/chat_template.jinja   (DIR's tokenizer)
    python check_template.py --tokenizer ...          (the same)

Its defaults are the trainer's (tool_format, thinking_retention). `--eos-token` names the token the model ends a turn
with where that is not the tokenizer's eos_token (Gemma 3's <end_of_turn>, Phi-3's <|end|>).

For a chat template and a `thinking_retention`, it reports whether extension (I4) holds at each turn
boundary, how many samples an episode makes, and every invariant violation (I1-I3, I5). It lives
beside the trainer, not in it, because training never needs it.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mt_grpo_trainer as M  # noqa: E402


def _sim_search(query: str) -> str:
    """Search the web for `query`.

    Args:
        query: what to search for
    """
    return f"Results for {query}: 42 is the answer."


# How a scripted turn writes a search call and a final answer in each tool format: what a model would sample. A format
# registered from outside the trainer gives its own: call_text(query), a call of _sim_search, and answer_text(answer).
SCRIPTED = {
    "xml": (
        lambda q: "<tool>" + json.dumps({"name": "_sim_search", "args": {"query": q}}) + "</tool>",
        lambda answer: f"<answer>{answer}</answer>",
    ),
    "native": (
        lambda q: "<tool_call>\n" + json.dumps({"name": "_sim_search", "arguments": {"query": q}}) + "\n</tool_call>",
        lambda answer: answer,
    ),
}


def simulate_episode(
    env: M.MultiTurnToolEnv, script: list[tuple[str, str]], eos_id: int | None
) -> tuple[M.Episode, list]:
    """Drive `env` with scripted turns: ("assistant", text) is 'sampled' as its canonical ids (plus EOS unless
    one of the format's stop strings ends it, as a sampler returns them), ("user", text) is a new user query.
    Returns the episode and the (prompt, sampled ids) pairs the sampler would have seen."""
    ep = env.new_episode({"prompt": "What is six times seven?"})
    seen = []
    for role, text in script:
        if role == "user":
            ep.messages.append({"role": "user", "content": text})
            continue
        prompt = env.next_prompt(ep)
        eos = [eos_id] if eos_id is not None and not text.endswith(env.fmt.stop) else []  # a stop string: no EOS
        ids = env.chat.tok.encode(text, add_special_tokens=False) + eos
        seen.append((prompt, ids))
        env.run_tools([(ep, call) for call in env.step(ep, M.Completion(ids, [0.0] * len(ids), "stop"))])
        ep.done = False
    return ep, seen


def check_invariants(ep: M.Episode, seen: list, env: M.MultiTurnToolEnv) -> list[str]:
    """I1-I3 and I5 on one simulated episode, as readable violations."""
    bad, untrained = [], {b["turn"] - 1: b["realigned"] for b in ep.boundaries}  # REALIGN's cut of a turn's tail
    for t, (prompt, full) in enumerate(seen):
        ids = full[: len(full) - untrained.get(t, 0)]
        s = next(
            (
                s
                for s in ep.samples
                if s.input_ids[: len(prompt)] == prompt and s.input_ids[len(prompt) : len(prompt) + len(ids)] == ids
            ),
            None,
        )
        if s is None:
            bad.append(f"I1: turn {t}'s sampled ids are not in any sample right after the prompt the sampler saw")
        elif s.loss_mask[len(prompt) : len(prompt) + len(ids)] != [1] * len(ids):
            bad.append(f"I3: turn {t}'s sampled ids are not all mask 1")
    for k, s in enumerate(ep.samples):
        if not len(s.input_ids) == len(s.loss_mask) == len(s.sampler_logprobs) == len(s.turn_idx):
            bad.append(f"I2: sample {k}'s per-token lists differ in length")
    trained = sum(sum(s.loss_mask) for s in ep.samples)
    if trained != sum(len(ids) for _, ids in seen) - ep.realigned_tokens:
        bad.append(
            f"I3: {trained} tokens have mask 1 but {sum(len(ids) for _, ids in seen)} were sampled "
            f"and {ep.realigned_tokens} realigned"
        )
    try:
        env.chat.check_tokenization(ep)
    except M.TokenizationMismatch as e:
        bad.append(f"I5: {e}")
    return bad


SYSTEM_PROMPT = "You are a helpful assistant."


def check_template(
    tokenizer, thinking_retention: str = "template", tool_format: str = "native", system_prompt: str = SYSTEM_PROMPT
) -> dict:
    """Simulate episodes with and without thinking: tool turns, then a new user turn after the tool
    cycle. Report, per setting, whether extension holds at each boundary, the samples a T-turn episode
    makes, and any invariant violation. A template that refuses the conversation raises its TemplateError."""
    cfg = M.Config(
        system_prompt=system_prompt,
        tool_format=tool_format,
        max_env_steps=100,
        thinking_retention=thinking_retention,
        tokenization_check="strict",
    )
    env = M.MultiTurnToolEnv(tokenizer, [_sim_search], cfg)
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token) if tokenizer.eos_token else None

    call, answer = SCRIPTED.get(tool_format) or (env.fmt.call_text, env.fmt.answer_text)  # another format: its own

    report = {"thinking_retention": thinking_retention, "tool_format": tool_format, "settings": {}}
    for setting, think in (("no_thinking", ""), ("thinking", "<think>\n{}\n</think>\n\n")):
        cfg.chat_template_kwargs = {} if think else {"enable_thinking": False}
        th = (lambda x: think.format(x)) if think else (lambda x: "")
        queries = ["six times seven", "multiplication", "why 42"]
        script = [
            ("assistant", th("I should search.") + call(queries[0])),
            ("assistant", th("Search once more.") + call(queries[1])),
            ("assistant", th("Both agree.") + answer("42")),
            ("user", "Why is that?"),
            ("assistant", th("Look it up.") + call(queries[2])),
            ("assistant", th("Now explain.") + answer("Because 6 x 7 = 42.")),
        ]
        ep, seen = simulate_episode(env, script, eos)
        violations = check_invariants(ep, seen, env)
        rendered = env.chat.render(ep.messages, ep.sampled_texts)
        results = [_sim_search(q) for q in queries]
        hidden = sum(r not in rendered for r in results)
        warnings = []
        if hidden:
            warnings.append(
                f"the chat template leaves {hidden} of the {len(results)} tool results out of the prompt: "
                "the model never sees them"
            )
        for b in ep.boundaries:
            if b["realigned"]:
                b["why"] = (
                    "the chat template re-renders only the previous turn's tail (whitespace or an end marker): "
                    "REALIGN keeps one sample, and those sampled tokens become context"
                )
            elif not b["extends"]:
                b["why"] = (
                    "the chat template renders earlier turns differently once a new user query arrives "
                    "(e.g. it drops past <think> blocks): the sample forks here"
                    if b["kind"] == "user"
                    else "the chat template re-renders the previous turn differently from what was sampled: the sample forks"
                )
        report["settings"][setting] = {
            "extension_holds": all(b["extends"] for b in ep.boundaries),
            "samples_per_episode": len(ep.samples),
            "turns": len(seen),
            "boundaries": ep.boundaries,
            "violations": violations,
            "warnings": warnings,
        }
    st = report["settings"].values()
    report.update(
        extension_holds=all(x["extension_holds"] for x in st),
        samples_per_episode=max(x["samples_per_episode"] for x in st),
        boundaries=[{"setting": k, **b} for k, x in report["settings"].items() for b in x["boundaries"]],
        violations=[f"{k}: {v}" for k, x in report["settings"].items() for v in x["violations"]],
        warnings=[f"{k}: {v}" for k, x in report["settings"].items() for v in x["warnings"]],
    )
    return report


class CheckError(ValueError):
    """A tokenizer or chat template that cannot be checked: one line, with what to give instead."""


def load_tokenizer(name: str | None, template: str | None, eos_token: str | None = None):
    """The tokenizer to check, with `template` (a .jinja file) as its chat template. Without `name`, the template's
    folder, where it holds a tokenizer (a model folder's chat_template.jinja). `eos_token`: the token a turn of the
    model ends with, made the tokenizer's eos_token (added as a special token where the tokenizer lacks it: a
    template checked with another family's tokenizer)."""
    from transformers import AutoTokenizer

    if template and not os.path.isfile(template):
        raise CheckError(f"--chat-template {template}: no such file")
    if not name:
        folder = os.path.dirname(os.path.abspath(template)) if template else ""
        if not template or not os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
            where = f"the folder of {template} holds no tokenizer" if template else "no tokenizer given"
            raise CheckError(
                f"{where}: add --tokenizer DIR_OR_HUB_ID, the tokenizer the template is for (a model folder, e.g. "
                ".cache/toy-kv-model-hd32, or a hub id, e.g. Qwen/Qwen3-0.6B)"
            )
        name = folder
    if not os.path.isdir(name) and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise CheckError(
            f"--tokenizer {name}: no such folder (nor a hub id, org/name); give a model or tokenizer folder"
        )
    try:
        tok = AutoTokenizer.from_pretrained(name)
    except Exception as e:  # a missing folder, a folder without a tokenizer, a hub id that is not there: one line
        why = " ".join(str(e).split())
        raise CheckError(
            f"--tokenizer {name}: no tokenizer loads from it ({why:.200}); give a model or tokenizer folder "
            "(with tokenizer_config.json) or a hub id (org/name)"
        ) from None
    if template:
        try:
            with open(template, encoding="utf-8") as f:
                tok.chat_template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckError(f"--chat-template {template}: cannot read it as UTF-8 text ({e})") from None
    if not tok.chat_template:
        raise CheckError(f"{name} has no chat template; pass --chat-template FILE")
    if eos_token:
        tok.add_tokens([eos_token], special_tokens=True)  # none added where the tokenizer has it
        tok.eos_token = eos_token
    return tok


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(
        prog="mt_grpo_trainer.py check-template", description="Check a chat template for multi-turn RL before training."
    )
    ap.add_argument("--tokenizer", help="tokenizer folder or hub id (default: the --chat-template file's folder)")
    ap.add_argument("--chat-template", help="a .jinja file that replaces the tokenizer's chat template")
    retention, tool_format = M.field_rules()["thinking_retention"], M.field_rules()["tool_format"]
    ap.add_argument("--thinking-retention", default=M.Config.thinking_retention, choices=retention)
    ap.add_argument("--tool-format", default=M.Config.tool_format, choices=tool_format, help="the trainer's default")
    ap.add_argument(
        "--eos-token",
        help="the token a turn of the model ends with, where it is not the tokenizer's eos_token (its generation "
        "config's: Gemma 3's <end_of_turn>, Phi-3's <|end|>); added as a special token where the tokenizer lacks it",
    )
    ap.add_argument("--system-prompt", default=SYSTEM_PROMPT, help="the system message ('' for none)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    from jinja2 import TemplateError

    try:
        tok = load_tokenizer(a.tokenizer, a.chat_template, a.eos_token)
    except CheckError as e:
        print(f"check-template: error: {e}", file=sys.stderr)
        return 1
    a.tokenizer = a.tokenizer or os.path.dirname(a.chat_template)
    try:
        r = check_template(tok, a.thinking_retention, a.tool_format, a.system_prompt)
    except TemplateError as e:
        print(
            f"check-template: error: the chat template refuses the simulated conversation (thinking_retention="
            f"{a.thinking_retention}, tool_format={a.tool_format}, as a rollout renders it): {e}",
            file=sys.stderr,
        )
        return 1
    if a.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"check-template: {a.tokenizer} (thinking_retention={a.thinking_retention}, tool_format={a.tool_format})")
        for name, x in r["settings"].items():
            marks = " ".join(
                f"{b['kind']}:{'extend' if b['extends'] else 'REALIGN' if b['realigned'] else 'FORK'}"
                for b in x["boundaries"]
            )
            print(f"  {name:<12} {x['turns']} turns -> {x['samples_per_episode']} sample(s) | boundaries: {marks}")
            for b in x["boundaries"]:
                if not b["extends"]:
                    print(f"      turn {b['turn']}: {b['why']}")
            for v in x["violations"]:
                print(f"      VIOLATION {v}")
            for w in x["warnings"]:
                print(f"      WARNING {w}")
        print(
            "  extension holds on every boundary"
            if r["extension_holds"]
            else "  extension breaks at the boundaries marked REALIGN (one sample; rollout/realigns in training) or FORK "
            "(a new sample; rollout/forks)"
        )
    return 1 if r["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
