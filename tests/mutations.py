"""Mutation testing: deliberate bugs, one at a time, in a copy of the project, each run against the tests that guard
it. A bug its tests pass has survived: the behaviour it breaks is not guarded. Not a test file (pytest collects only
test_*.py) and not run by CI; run it after changing a guarding test or the code a mutation names:

    .venv/bin/python tests/mutations.py                # every mutation, then the table
    .venv/bin/python tests/mutations.py sign greedy    # only those whose name holds one of the words
    .venv/bin/python tests/mutations.py --baseline     # first run each one's tests on the unchanged copy

A mutation replaces one exact snippet of one file. A snippet that is not in the file exactly once is reported stale
(the code moved: update the snippet), never skipped silently. Each mutation runs only its guarding tests, in one
pytest process that stops at the first failure, within LIMIT_S seconds; conftest's hang deadline (HANG_S) is
shortened, so a bug that makes a test hang fails it within a minute. Results:
  caught    a guarding test failed;
  SURVIVED  every guarding test passed;
  stale     the snippet is not in the file exactly once;
  error     pytest could not run the tests (no test collected, a usage error) or the limit was hit.
"""

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = "mt_grpo_trainer.py"
LIMIT_S = 420  # seconds for one mutation's tests; the slowest (test_signals, each test waiting out a hang) take ~150
HANG_S = "45"  # conftest's deadline for an event, in the copy


@dataclasses.dataclass
class Mutation:
    name: str
    old: str  # the exact snippet, found once in `file`
    new: str
    tests: list[str]  # pytest arguments: files, and -k expressions
    file: str = TRAINER


MUTATIONS = [
    Mutation(
        "re-encode the sampled text instead of keeping its ids",
        "        chat.append(s, c.ids, mask=1, logprobs=c.logprobs, turn=t, version=c.version)",
        "        ids = chat.enc(chat.dec(c.ids))\n"
        "        chat.append(s, ids, mask=1, logprobs=(c.logprobs + [0.0] * len(ids))[: len(ids)], turn=t, version=c.version)",
        ["tests/test_env.py", "-k", "verbatim"],
    ),
    Mutation(
        "loss mask shifted by one token",
        "pad([s.weights or s.loss_mask for s in in_batch], 0.0, T)",
        "pad([[0] + (s.weights or s.loss_mask)[:-1] for s in in_batch], 0.0, T)",
        ["tests/test_loss.py"],
    ),
    Mutation(
        "importance weight dropped",
        "per_token = per_token * is_weight",
        "per_token = per_token",
        ["tests/test_loss.py", "-k", "direct_computation or importance"],
    ),
    Mutation(
        "importance weight not detached",
        "is_weight = torch.exp(old_logp - sampler_logp).clamp(",
        "is_weight = torch.exp(logp - logp.detach() + old_logp - sampler_logp).clamp(",
        ["tests/test_loss.py", "-k", "importance"],
    ),
    Mutation(
        "state-matched baseline includes the turn's own episode",
        "same_state = [q for j, q in reached[turn.state] if j != i and turn.state]",
        "same_state = [q for j, q in reached[turn.state] if turn.state]",
        ["tests/test_turn_credit.py", "-k", "exact_gradient and state_matched"],
    ),
    Mutation(
        "state-matched fallback includes the turn's own episode",
        "same_index = [q for j, q in reached[k] if j != i]",
        "same_index = [q for j, q in reached[k]]",
        ["tests/test_turn_credit.py", "-k", "exact_gradient and state_matched"],
    ),
    Mutation(
        "advantage sign flipped",
        '"adv": pad([s.advantages for s in in_batch], 0.0, T),',
        '"adv": pad([[-a for a in s.advantages] for s in in_batch], 0.0, T),',
        ["tests/test_loss.py"],
    ),
    Mutation(
        "MT-GRPO split moved one turn later",
        "split = ep.first_result_turn or len(ep.turns)",
        "split = min((ep.first_result_turn or len(ep.turns)) + 1, len(ep.turns))",
        ["tests/test_advantages.py"],
    ),
    Mutation(
        "resume without the optimizer state",
        '        optimizer.load_state_dict(state["optimizer"])',
        "        pass",
        ["tests/test_checkpoints.py", "-k", "resumed_run_matches or hard_kill"],
    ),
    Mutation(
        "a sample never forks",
        "extends = text.startswith(s.text)",
        "extends = True",
        ["tests/test_env.py", "-k", "forks"],
    ),
    Mutation(
        "branch copies keep their trained mask",
        "                s.loss_mask = [0] * n\n",
        "",
        ["tests/test_turn_credit.py", "-k", "branching_rollout"],
    ),
    Mutation(
        "node weights ignored in the loss mask",
        "pad([s.weights or s.loss_mask for s in in_batch], 0.0, T)",
        "pad([s.loss_mask for s in in_batch], 0.0, T)",
        ["tests/test_loss.py", "tests/test_turn_credit.py", "-k", "not server and not resumes_exactly"],
    ),
    Mutation(
        "node weights ignored in the token count",
        "weighted_tokens = sum(sum(s.weights or s.loss_mask) for s in samples)",
        "weighted_tokens = sum(sum(s.loss_mask) for s in samples)",
        ["tests/test_loss.py", "tests/test_turn_credit.py", "-k", "not server and not resumes_exactly"],
    ),
    Mutation(
        "the client drops the stop token from token_ids",
        '        return Completion(ids, [float(x) for x in lps], "stop" if c["finish_reason"] == "stop"',
        "        if ids and ids[-1] in self.stop_token_ids:\n"
        "            ids, lps = ids[:-1], lps[:-1]\n"
        '        return Completion(ids, [float(x) for x in lps], "stop" if c["finish_reason"] == "stop"',
        ["tests/test_vllm_client.py", "-k", "i1_keeps or trains_the_returned"],
    ),
    Mutation(
        "evaluation not greedy (it samples at the training temperature)",
        "temperature = eval_temperature if evaluating else self.cfg.temperature",
        "temperature = self.cfg.temperature",
        ["tests/test_eval.py", "-k", "greedy"],
    ),
    Mutation(
        "check-template prints FORK for a REALIGN",
        "else 'REALIGN' if b['realigned'] else 'FORK'}",
        "else 'FORK'}",
        ["tests/test_templates.py", "-k", "reports_realign"],
        file="check_template.py",
    ),
    # the behaviours whose tests were timing bounds, now events, counters or deadlines that only catch a hang
    Mutation(
        "a turn's tool calls run one at a time",
        "        return DaemonPool(32)",
        "        return DaemonPool(1)",
        ["tests/test_env.py", "-k", "run_at_once"],
    ),
    Mutation(
        "tool_timeout never cuts a tool off",
        "self.pool.wait(future, self.cfg.tool_timeout)",
        "self.pool.wait(future, math.inf)",
        ["tests/test_env.py", "-k", "hanging_tool"],
    ),
    Mutation(
        "max_staleness 1 rolls out only after the update (no overlap)",
        "threading.Semaphore(self.k + 1)",
        "threading.Semaphore(1)",
        ["tests/test_async.py", "-k", "overlaps_rollout"],
    ),
    Mutation(
        "request_deadline never ends the retries",
        "            if time.monotonic() + delay > end:",
        "            if False:",
        ["tests/test_vllm_client.py", "-k", "slow_server_times or unreachable"],
    ),
    Mutation(
        "new sessions all go to the first server",
        "s = min(usable, key=lambda x: (x.busy, (self.servers.index(x) - self.turn) % len(self.servers)))",
        "s = usable[0]",
        ["tests/test_servers.py", "-k", "twice_the_sequences or slow_server"],
    ),
    Mutation(
        "the client's workers are not daemons (exit waits for requests in flight)",
        'threading.Thread(target=self.work, daemon=True, name="tool").start()',
        'threading.Thread(target=self.work, daemon=False, name="tool").start()',
        ["tests/test_vllm_client.py", "-k", "exiting_never"],
    ),
    Mutation(
        "reward_timeout never cuts a reward function off",
        "err = reward_pool().wait(fut, timeout, stop_event)",
        "err = reward_pool().wait(fut, math.inf, stop_event)",
        ["tests/test_rewards.py", "-k", "never_returns"],
    ),
    Mutation(
        "a signal does not end the wait on a hanging reward function",
        "if stop_event is not None and stop_event.is_set():",
        "if False:",
        ["tests/test_signals.py", "-k", "reward_function_hangs"],
    ),
    Mutation(
        "the GPU's block mask is causal over the whole row, not over a token's ancestors",
        "        ancestor = (k <= q) & (q <= end[b, k])",
        "        ancestor = k <= q",
        ["tests/test_packing.py", "-k", "block_mask"],
    ),
    Mutation(
        "a family not checked exact in packed rows packs",
        "    if kind not in PACKED_MODEL_TYPES:",
        "    if False:",
        ["tests/test_models.py", "-k", "does_not_pack"],
    ),
    Mutation(
        "a layer's sliding window is dropped in the CPU's packed attention",
        '    window = kwargs.get("sliding_window")  # this layer\'s; None for full attention',
        "    window = None",
        ["tests/test_models.py", "-k", "sliding_window_packs"],
    ),
    Mutation(
        "gpt_oss's attention sinks are dropped on the CPU (packed rows and plain calls alike)",
        "    sinks = kwargs.get(\"s_aux\")  # gpt_oss's attention sinks, which transformers' SDPA does not compute",
        "    sinks = None",
        ["tests/test_models.py", "-k", "gpt_oss or sinks"],
    ),
    Mutation(
        "a GPU's windowed layer takes the full trie's block mask",
        '    window = kwargs.get("sliding_window")\n    rows = getattr(attention_mask, "trie_rows", None)',
        '    window = None\n    rows = getattr(attention_mask, "trie_rows", None)',
        ["tests/test_models.py", "-k", "gpu_block"],
    ),
    Mutation(
        "an agent harness's request is recorded as the list the episode's reply is appended to",
        "        ep.messages = list(messages)  # step appends the reply; the request stays as it came",
        "        ep.messages = messages",
        ["tests/test_agent.py", "-k", "built_in_environments_episodes"],
    ),
    Mutation(
        "a branch's replayed requests are not compared with the recorded ones",
        "        if k < len(recorded) and messages != recorded[k]:",
        "        if False:",
        ["tests/test_agent.py", "-k", "replayed_requests_differ"],
    ),
    Mutation(
        "the bridge is used after a harness edited its history",
        "            or ep.rewritten  # an agent harness edited what it was sent",
        "            or False",
        ["tests/test_agent.py", "-k", "edits_its_history"],
    ),
    Mutation(
        "a harness's error replaces the end the trainer gave its episode",
        "            if end and not trainer_ended:",
        "            if end:",
        ["tests/test_agent.py", "-k", "faults"],
    ),
    Mutation(
        "the endpoint closes without closing the connections harnesses keep alive",
        "                connection.shutdown(socket.SHUT_RDWR)",
        "                pass",
        ["tests/test_agent.py", "-k", "keeps_its_client"],
    ),
    Mutation(
        "a harness's own TimeoutError is taken for agent_timeout",
        '        if not done:\n            end = "agent_timeout"',
        '        if not done or isinstance(state.result.exception(), TimeoutError):\n            end = "agent_timeout"',
        ["tests/test_agent.py", "-k", "keeps_its_client"],
    ),
]


def copy_project(dest: str):
    """The project's files (tracked, and untracked but not ignored) into dest/project, with .venv and .cache (shared
    builds) linked, as the tests find them."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    )
    project = os.path.join(dest, "project")
    for rel in filter(None, listed.stdout.decode().split("\0")):
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):  # deleted in the work tree
            continue
        os.makedirs(os.path.dirname(os.path.join(project, rel)), exist_ok=True)
        with open(src, "rb") as f, open(os.path.join(project, rel), "wb") as g:
            g.write(f.read())
        os.chmod(os.path.join(project, rel), os.stat(src).st_mode)
    for name in (".venv", ".cache"):
        if os.path.exists(os.path.join(ROOT, name)):
            os.symlink(os.path.realpath(os.path.join(ROOT, name)), os.path.join(project, name))
    return project


def run_tests(project: str, tests: list[str]) -> tuple[str, float, str]:
    """(result, seconds, the output's tail) of one pytest process over `tests`, in its own process group."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MTGRPO_TEST_HANG_S=HANG_S)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    t0 = time.monotonic()
    p = subprocess.Popen(
        cmd, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = p.communicate(timeout=LIMIT_S)
        result = {0: "SURVIVED", 1: "caught"}.get(p.returncode, f"error (pytest exit {p.returncode})")
    except subprocess.TimeoutExpired:
        out = ""
        result = f"error (over {LIMIT_S} s)"
    finally:
        with contextlib.suppress(ProcessLookupError):  # the whole group, however it ended: no server left behind
            os.killpg(p.pid, signal.SIGKILL)
    out = out or p.communicate()[0]
    return result, time.monotonic() - t0, out[-1500:]


def main(argv: list[str]) -> int:
    baseline = "--baseline" in argv
    words = [a for a in argv if not a.startswith("--")]
    chosen = [m for m in MUTATIONS if not words or any(w in m.name for w in words)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mtgrpo-mutations-") as dest:
        project = copy_project(dest)
        for m in chosen:
            path = os.path.join(project, m.file)
            with open(path) as f:
                original = f.read()
            base = ""
            if baseline:
                base, _, tail = run_tests(project, m.tests)
                base = {"SURVIVED": "passes", "caught": "FAILS"}.get(base, base)  # FAILS: "caught" below means nothing
                if base != "passes":
                    print(f"unmutated, {m.name}: {base}\n{tail}", flush=True)
            found = original.count(m.old)
            if found != 1:
                rows.append((m, f"stale (snippet found {found} times)", 0.0, base))
                continue
            with open(path, "w") as f:
                f.write(original.replace(m.old, m.new))
            try:
                result, took, tail = run_tests(project, m.tests)
            finally:
                with open(path, "w") as f:
                    f.write(original)
            rows.append((m, result, took, base))
            print(f"{result:<10} {took:6.0f} s  {m.name}", flush=True)
            if result.startswith("error"):
                print(tail, flush=True)
    print("\n| mutation | file | guarding tests | result | seconds |" + (" unmutated |" if baseline else ""))
    print("|---|---|---|---|---|" + ("---|" if baseline else ""))
    for m, result, took, base in rows:
        cells = [m.name, m.file, " ".join(m.tests), result, f"{took:.0f}"] + ([base] if baseline else [])
        print("| " + " | ".join(cells) + " |")
    return 1 if any(r[1] != "caught" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
