"""Does the toy task run as an agent harness learn as the built-in environment does, on the same seeds? And what does
the harness's endpoint cost per call against the built-in environment? (issue 37; appendix H of mt_grpo_trainer.py)

    .venv/bin/python bench/agent_harness.py --part overhead                 # the per-call cost, minutes
    .venv/bin/python bench/agent_harness.py --part learning                 # 12 runs of 100 steps, two at a time
    (both: [--out DIR] for the runs and results, [--set key=value ...] more overrides of every run)

Pre-registered: everything below was written and committed before any number of either part was seen.

Part `learning`
- Recipes: hf_recipes/toy/toy-kv--mt-grpo.yaml (built-in: the trainer's own loop, `tools: [tools/kv_lookup.py:lookup]`)
  and hf_recipes/toy/toy-kv-agent--mt-grpo.yaml (harness: tasks/toy_kv_agent.py's loop with the OpenAI client
  against the per-episode endpoint), which differ only in `agent`, `tools` and `output_dir`. Each run: 100 steps
  (the recipes' default) of 8 prompts x 8 episodes, the in-process sampler, `eval_steps=0` (no evaluation), and
  `save_steps=0` (only the final save, which is outside the step times; it changes nothing the run learns).
- Seeds 0-5, paired: seed s of both recipes draws the same training prompts at every step (`rows_for_step` depends
  on the seed and the step only) and seeds the sampler's generator the same way. The episodes are not expected to be
  bit-identical: the built-in environment samples every unfinished episode's turn in one batch, the harness's
  requests are batched as they arrive (SamplingQueue), so the same generator is drawn from in another order.
- Runs: bench/seed_runs.py's workers, two trainers at once, one thread each; a run that crashes is started again
  on the same seed (seed_runs does so once by itself), and the report says so. Harness episodes that raise are left
  out of training by the trainer and counted (`agent/agent_errors`, `agent/agent_timeouts`); they are reported,
  and no run is left out for them.
- Before the runs, each part is run once at a small size to check that the code runs (`--part overhead --repeats 1`,
  `--part learning --seeds 900 --steps 3`, into their own folders); none of their numbers enter anything here.

Metric and test
- Per run, the criteria of README's table for `bash run.sh`, from `reward/outcome` in metrics.jsonl
  (bench/server_vs_local.py's `curve`): the outcome reward at step 1, the means over steps 1-10 and 91-100, and the
  first step whose trailing-10 mean reaches 0.8.
- Primary statistic, per seed: d = harness minus built-in of the steps 91-100 mean. Reported: the mean of d over the
  six seeds, its 95% percentile bootstrap CI (bench/paired_stats.py's `bootstrap_ci`: resampling seeds, 10,000
  resamples, seed 0), and the two-sided exact Wilcoxon signed-rank p (zero differences dropped). paired_stats has
  only the one-sided test (`wilcoxon_greater`), so two-sided p = min(1, 2 * min(p_greater(d), p_greater(-d))).
- Decision rule, checked in this order: "learns as the built-in does" if the 95% CI lies within [-0.10, +0.10]
  (the equivalence margin; a CI inside it that also excludes 0 is still this verdict, with the small difference
  named); else "differs" if the CI excludes 0; else "undecided at this size".
- Reported beside, not tested: step 1, steps 1-10 and the step to 0.8 per seed; wall time per step of each recipe,
  split into rollout and train (`time/rollout`, `time/train`, `time/step`, means over the 100 steps; two trainers
  share the two cores, so these are times under that load), and each run's whole wall time; the agent/* counts.

Prediction: equivalent. The turns are the same code (`next_prompt`, the sampler, `step`); only the batching differs.

Part `overhead`
- The two recipes set up by the trainer's own `setup` (as bench/packing.py's `rollout` does), the in-process sampler
  on one thread. Both environments roll out with the built-in run's sampler (one model object, the same weights), on
  the same rows: seed 0's step-0 batch, 8 prompts x 8 episodes; each rollout with a fresh `run.generator(0)`.
- A rollout is `run.env.rollout(rows, sampler, generator)`. One warm-up rollout of each env (not counted), then
  K = 10 (`--repeats`) of each, alternating built-in and harness. Per rollout: its wall time, the time spent inside
  `sampler.generate` (a wrapper sums it), and the number of assistant turns (the prompts given to `generate`: one per
  request the harness made and was answered); also the number of `generate` calls (batches).
- Overhead per call, per rollout = (rollout time - generate time) / turns: for the built-in env, its loop, tool
  calls and bookkeeping; for the harness, the same plus the endpoint (HTTP, JSON both ways, the openai client, the
  thread hand-offs and SamplingQueue's batching waits). The difference: harness minus built-in of repeat k, per k.
- Two variants: `sampled` (the in-process sampler as trained), and `scripted`: a zero-cost sampler that returns
  fixed token ids at once (each episode's first turn a `lookup` tool call, its second an answer, by the request's
  session, as tests/test_env.py's ScriptedSampler scripts turns), which isolates the endpoint, HTTP and openai
  client from generation.
- Reported: ms per call, median and IQR over the K rollouts, of each env and of the difference, per variant; beside
  it the rollout seconds, generate seconds, turns and generate calls per rollout (medians).

Prediction: the harness costs more per call than the built-in environment, by milliseconds (one local HTTP round
trip and a client call per turn); no size was fixed in advance.

Added after the registered runs (issue 47): where an endpoint request's time goes. Each request's stages are timed in
its handler thread (wall, and that thread's CPU), from `parse_request` to the reply written (STAGES). The endpoint's
own cost: wall from `parse_request` to the start of the reply's last write, and the CPU of all stages, both less the
wait in `SamplingQueue.sample`; that wait, less the generate time of the request's batch, is the batching window's,
reported apart. Beside it, per request: the CPU of the harness (its threads in the
trainer, or its worker processes' with agent_processes) and of the trainer's process. `--baseline KEY=VALUE ...` adds a
second harness env with those overrides (another harness: `agent=FILE:fn`), and `--baseline-trainer FILE` one set up
by another copy of the trainer; it is rolled out in turn with the others, so a change is compared before and after in
one run.

Added before any run of it (issue 47), a new experiment with the same design: the learning part with the harness in
worker processes, `--set agent_processes=8 --out bench/runs/agent-harness-processes` (the built-in recipe has no
harness, so the key changes nothing there). The recipes are as they are now: since the registered runs above, both
decay their 5e-4 learning rate to 0 (the default's change, docs/benchmarks.md), and the toy harness builds one client a
process. The same seeds, test and decision rule on the steps 91-100 outcome. Added to the output, per seed: the
harness's mean time a step over the built-in's (`time/step`, and `time/rollout` beside it), two trainers at once as
before, so each pair's runs share the same load; reported as the median and range over seeds, against the issue's
target of 1.2x. Predictions: "learns as the built-in does"; a step 1.3-1.8x the built-in's, above the target: about
128 calls a step at ~5 ms each (the overhead part's whole call, processes) against 0.26 ms, on a built-in step of
about 2 s with two trainers on two cores, and 16 worker processes beside them.

Output: the tables, then the learning part's comparison line last; per-run folders and results.json under
bench/runs/agent-harness/ (learning/{builtin,harness}-seedS/, overhead/).
"""

import argparse
import collections
import functools
import http.server
import json
import os
import socketserver
import socket
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paired_stats import bootstrap_ci, wilcoxon_greater  # noqa: E402
from seed_runs import ROOT, read_jsonl, start_worker, train_all  # noqa: E402
from server_vs_local import curve  # noqa: E402

RECIPES = {"builtin": "hf_recipes/toy/toy-kv--mt-grpo.yaml", "harness": "hf_recipes/toy/toy-kv-agent--mt-grpo.yaml"}
NAMES = {"builtin": "built-in environment", "harness": "agent harness", "baseline": "harness (--baseline)"}
RUNS_DIR = os.path.join(ROOT, "bench", "runs", "agent-harness")
MARGIN = 0.10  # the equivalence margin on the steps 91-100 outcome reward
KEY = "golf"  # the scripted sampler's lookup


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("learning", "overhead"), required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(6)), help="learning: paired training seeds")
    ap.add_argument("--steps", type=int, default=100, help="learning: training steps per run")
    ap.add_argument("--jobs", type=int, default=2, help="learning: trainers at once, one thread each")
    ap.add_argument("--repeats", type=int, default=10, help="overhead: rollouts of each env per variant")
    ap.add_argument(
        "--baseline",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="overhead: a second harness env with these overrides (e.g. another harness, agent=FILE:fn), rolled out "
        "alternately with the others, to compare before and after a change in one run",
    )
    ap.add_argument(
        "--baseline-trainer",
        metavar="FILE",
        help="overhead: the baseline harness env from another copy of the trainer (`git show REV:mt_grpo_trainer.py "
        "> FILE`), to compare a change of the endpoint before and after in one run",
    )
    ap.add_argument("--out", default=RUNS_DIR, help="the runs and results.json")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more overrides of every run")
    args = ap.parse_args(argv)
    args.out = os.path.abspath(args.out)
    return args


# --- part learning --------------------------------------------------------------------------------------------


def run_figures(run_dir: str, wall: dict) -> dict:
    steps = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    first, early, late, reached = curve(steps)
    mean = lambda key: statistics.mean(m[key] for m in steps)  # noqa: E731
    agent = collections.Counter()
    for m in steps:
        agent.update({k: v for k, v in m.items() if k.startswith("agent/")})
    return {
        "step1": first,
        "early": float(early),
        "late": float(late),
        "reached": reached,
        "rollout_s": mean("time/rollout"),
        "train_s": mean("time/train"),
        "step_s": mean("time/step"),
        "wall_s": wall["seconds"],
        "attempts": wall["attempts"],
        "turns": mean("rollout/turns"),
        "tokenization_mismatch": sum(m["rollout/tokenization_mismatch"] for m in steps),
        "agent": dict(agent),
    }


def verdict(ci: tuple) -> str:
    if -MARGIN <= ci[0] and ci[1] <= MARGIN:
        return "learns as the built-in does" + (
            " (a small difference: the CI excludes 0)" if ci[0] > 0 or ci[1] < 0 else ""
        )
    if ci[0] > 0 or ci[1] < 0:
        return "differs"
    return "undecided at this size"


def learning_tables(fig: dict, seeds: list[int], comp: dict) -> str:
    mean = statistics.mean
    out = ["Per seed: outcome reward, mean of the last 10 steps, and the first step whose trailing-10 mean >= 0.8:", ""]
    out += [
        "| seed | built-in last 10 | harness last 10 | d (harness - built-in) | built-in >= 0.8 at | harness >= 0.8 at |"
    ]
    out += ["|---|---|---|---|---|---|"]
    for s, d in zip(seeds, comp["diffs"]):
        b, h = fig[("builtin", s)], fig[("harness", s)]
        out.append(
            f"| {s} | {b['late']:.3f} | {h['late']:.3f} | {d:+.3f} | {b['reached'] or 'not reached'} | "
            f"{h['reached'] or 'not reached'} |"
        )
    out += [
        "",
        "Means over seeds (per step: rollout + train, each run's mean over its steps, two trainers at once):",
        "",
    ]
    out += [
        "| recipe | step 1 | first 10 | last 10 | >= 0.8 at (mean of reached) | per step (rollout + train) | whole run |"
    ]
    out += ["|---|---|---|---|---|---|---|"]
    for m in RECIPES:
        f = [fig[(m, s)] for s in seeds]
        reached = [x["reached"] for x in f if x["reached"]]
        at = f"{mean(reached):.1f}" if reached else "-"
        at += f" ({len(reached)} of {len(f)} reached)"
        per = f"{mean(x['step_s'] for x in f):.2f} s ({mean(x['rollout_s'] for x in f):.2f} + "
        per += f"{mean(x['train_s'] for x in f):.2f})"
        out.append(
            f"| {NAMES[m]} | {mean(x['step1'] for x in f):.3f} | {mean(x['early'] for x in f):.3f} | "
            f"{mean(x['late'] for x in f):.3f} | {at} | {per} | {mean(x['wall_s'] for x in f):.0f} s |"
        )
    out += ["", "Faults and checks, summed over each recipe's runs:", ""]
    for m in RECIPES:
        f = [fig[(m, s)] for s in seeds]
        agent = collections.Counter()
        for x in f:
            agent.update(x["agent"])
        restarts = sum(x["attempts"] - 1 for x in f)
        mismatches = sum(x["tokenization_mismatch"] for x in f)
        out.append(
            f"- {NAMES[m]}: agent/* {dict(agent) or 'none logged'}; tokenization mismatches {mismatches:.0f}; "
            f"restarted runs {restarts}; mean turns an episode {mean(x['turns'] for x in f):.2f}"
        )
    return "\n".join(out)


def learning(args):
    name = "learning" if (args.steps, args.seeds) == (100, list(range(6))) else f"learning-{args.steps}-steps"
    runs_dir = os.path.join(args.out, name)
    common = [f"max_steps={args.steps}", "eval_steps=0", "save_steps=0", *args.set]
    runs = {(m, s): [f"seed={s}", *common] for s in args.seeds for m in RECIPES}
    t0 = time.time()
    walls = train_all(RECIPES, runs, runs_dir, args.jobs)
    print(f"[bench] {len(runs)} runs, {args.jobs} at once: {time.time() - t0:.0f} s wall this invocation", flush=True)
    fig = {k: run_figures(os.path.join(runs_dir, f"{k[0]}-seed{k[1]}"), w) for k, w in walls.items()}
    diffs = [round(fig[("harness", s)]["late"] - fig[("builtin", s)]["late"], 12) for s in args.seeds]
    p_greater, p_less = wilcoxon_greater(diffs), wilcoxon_greater([-d for d in diffs])
    comp = {
        "diffs": diffs,
        "mean": float(np.mean(diffs)),
        "ci": bootstrap_ci(diffs),
        "p_greater": p_greater,
        "p_less": p_less,
        "p_two_sided": min(1.0, 2 * min(p_greater, p_less)),
    }
    comp["verdict"] = verdict(comp["ci"])
    for key in ("step_s", "rollout_s"):  # the harness's time over the built-in's, per seed
        comp[f"{key}_ratio"] = [fig[("harness", s)][key] / fig[("builtin", s)][key] for s in args.seeds]
    with open(os.path.join(runs_dir, "results.json"), "w") as f:
        per_run = {f"{m}-seed{s}": v for (m, s), v in fig.items()}
        json.dump({"args": vars(args), "runs": per_run, "comparison": comp}, f, indent=1)
    print("\n" + learning_tables(fig, args.seeds, comp))
    print(f"\nPer-run figures: {os.path.join(runs_dir, 'results.json')}\n")
    for key, what in (("rollout_s", "a rollout"), ("step_s", "a step")):
        r = comp[f"{key}_ratio"]
        print(
            f"harness / built-in, time {what}: median {statistics.median(r):.2f}x [{min(r):.2f}, {max(r):.2f}] over "
            f"{len(r)} seeds (each pair trained at once)"
        )
    print(
        f"harness - built-in, outcome over the last 10 steps: mean {comp['mean']:+.3f}, 95% CI "
        f"[{comp['ci'][0]:+.3f}, {comp['ci'][1]:+.3f}], Wilcoxon two-sided p = {comp['p_two_sided']:.3f} "
        f"(exact, n = {len(diffs)}; 2 x the smaller one-sided p): {comp['verdict']} (margin +-{MARGIN})"
    )


# --- part overhead --------------------------------------------------------------------------------------------


class Timed:
    """A sampler whose `generate` is timed: seconds inside it, the prompts it got (turns) and its calls (batches)."""

    policy_version = None  # both samplers sample from the weights in memory

    def __init__(self, sampler):
        self.sampler = sampler
        self.reset()

    def reset(self):
        self.seconds, self.turns, self.calls = 0.0, 0, 0
        self.prompt_seconds = 0.0  # each prompt's batch's generate time, summed over prompts

    def generate(self, prompts, max_tokens, **kw):
        t0 = time.perf_counter()
        try:
            return self.sampler.generate(prompts, max_tokens, **kw)
        finally:
            took = time.perf_counter() - t0
            self.seconds += took
            self.prompt_seconds += took * len(prompts)
            self.turns += len(prompts)
            self.calls += 1


class Scripted:
    """A zero-cost sampler: fixed token ids at once, each episode's first turn a lookup call, its later ones an answer
    (by the request's session)."""

    policy_version = None

    def __init__(self, tok, completion):
        from tools.kv_lookup import TABLE

        call = json.dumps({"name": "lookup", "args": {"key": KEY}})
        texts = (
            f"<reasoning>look</reasoning>\n<tool>{call}</tool>",
            f"<reasoning>done</reasoning>\n<answer>{TABLE[KEY]}</answer>",
        )
        self.ids = [tok.encode(t, add_special_tokens=False) for t in texts]
        self.completion = completion
        self.seen = collections.Counter()

    def generate(self, prompts, max_tokens, sessions=None, **_):
        outs = []
        for s in sessions:
            ids = self.ids[min(self.seen[s], 1)]
            self.seen[s] += 1
            outs.append(self.completion(list(ids), [-0.1] * len(ids), "stop"))
        return outs


# Where a request's time goes (added for issue 47, after the registered runs): each stage's exclusive wall and CPU
# (its thread's) seconds, over the requests of a rollout. A request runs in its handler thread from `parse_request` (its
# headers; the request line before it is read while the connection waits) to the end of `handle_one_request`.
STAGES = {  # (class or None for a module function, name) -> stage; a stage not named here is its caller's
    ("AgentEndpoint", "handle"): "reply: JSON, HTTP write",
    ("AgentEndpoint", "answer"): "parse: route, JSON body",
    ("AgentEndpoint", "turn"): "turn: lock, bookkeeping",
    ("AgentEnv", "turn"): "turn: lock, bookkeeping",
    ("AgentEnv", "replay_or_branch"): "turn: lock, bookkeeping",
    ("AgentEnv", "request_budget"): "validate: fields, messages",
    ("AgentEnv", "messages_from"): "validate: fields, messages",
    (None, "chat_request"): "validate: fields, messages",
    ("MultiTurnToolEnv", "next_prompt"): "next_prompt: bridge, render",
    ("ChatTemplate", "enc"): "next_prompt: tokenize",
    ("SamplingQueue", "sample"): "wait: batch, generate",
    ("MultiTurnToolEnv", "step"): "step: decode, parse the turn",
    (None, "completion_body"): "reply: build the body",
    (None, "response_body"): "reply: build the body",
    (None, "server_sent"): "reply: build the body",
}
HTTP = "HTTP: headers, body read, reply flushed"  # the request's own frame: from parse_request to the flush after do_*
WAIT = STAGES[("SamplingQueue", "sample")]


class Stages:
    """Wraps the trainer module's endpoint methods (STAGES) and the standard library's `parse_request` and socket
    writes, and sums the time of each stage over the requests since `reset`. Only a request's handler thread is
    counted. A request's reply is sent at its last write's start: what that write waits for after it has handed its
    bytes to the kernel (the interpreter lock back) is counted apart, as the harness does not wait for it."""

    def __init__(self, modules: list):
        self.local = threading.local()
        self.lock = threading.Lock()
        self.reset()
        for M in modules:
            for (cls, name), stage in STAGES.items():
                owner = getattr(M, cls) if cls else M
                setattr(owner, name, self.wrap(getattr(owner, name), stage))
            M.run_harness = self.harness(M.run_harness)
        handler = http.server.BaseHTTPRequestHandler
        handler.parse_request = self.begin(handler.parse_request)
        handler.handle_one_request = self.end(handler.handle_one_request)
        socketserver._SocketWriter.write = self.sending(socketserver._SocketWriter.write)  # an unbuffered wfile
        socket.SocketIO.write = self.sending(socket.SocketIO.write)  # a buffered one's

    def reset(self):
        self.wall = collections.Counter()
        self.cpu = collections.Counter()
        self.requests = 0
        self.to_sent = 0.0  # from each request's start to its reply's last write
        self.after_sent = 0.0  # from that write to the request's end
        self.harness_cpu = 0.0  # the CPU seconds of harness threads in this process (harnesses in threads)

    def begin(self, fn):
        @functools.wraps(fn)
        def parse_request(handler):
            self.local.stack = [[HTTP, time.perf_counter(), time.thread_time(), 0.0, 0.0]]
            self.local.sent = None
            return fn(handler)

        return parse_request

    def end(self, fn):
        @functools.wraps(fn)
        def handle_one_request(handler):
            try:
                return fn(handler)
            finally:
                stack = getattr(self.local, "stack", None)
                if stack:  # the reply is written and flushed: the request ends
                    self.pop(stack)

        return handle_one_request

    def sending(self, fn):
        @functools.wraps(fn)
        def write(writer, data):
            self.local.sent = time.perf_counter()
            return fn(writer, data)

        return write

    def wrap(self, fn, stage):
        @functools.wraps(fn)
        def timed(*args, **kw):
            stack = getattr(self.local, "stack", None)
            if not stack:
                return fn(*args, **kw)
            stack.append([stage, time.perf_counter(), time.thread_time(), 0.0, 0.0])
            try:
                return fn(*args, **kw)
            finally:
                self.pop(stack)

        return timed

    def pop(self, stack):
        stage, wall0, cpu0, child_wall, child_cpu = stack.pop()
        end = time.perf_counter()
        cpu = time.thread_time() - cpu0
        with self.lock:
            self.wall[stage] += end - wall0 - child_wall
            self.cpu[stage] += cpu - child_cpu
            if stage == HTTP:
                sent = self.local.sent or end
                self.requests += 1
                self.to_sent += sent - wall0
                self.after_sent += end - sent
        if stack:
            stack[-1][3] += end - wall0
            stack[-1][4] += cpu

    def harness(self, fn):
        @functools.wraps(fn)
        def run_harness(*args):
            cpu0 = time.thread_time()
            try:
                return fn(*args)
            finally:
                with self.lock:
                    self.harness_cpu += time.thread_time() - cpu0

        return run_harness


def worker_cpu(env) -> float:
    """The CPU seconds so far of the harness worker processes (agent_processes) that are alive."""
    total = 0.0
    workers = getattr(env, "workers", None)
    for worker in workers.workers if workers else ():
        try:
            with open(f"/proc/{worker.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def timed_rollout(run, sampler: Timed, rows: list[dict], stages: Stages | None = None) -> dict:
    sampler.reset()
    if stages:
        stages.reset()
    workers0 = worker_cpu(run.env)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    eps = run.env.rollout(rows, sampler, run.generator(0))
    wall = time.perf_counter() - t0
    out = {
        "rollout_s": wall,
        "generate_s": sampler.seconds,
        "turns": sampler.turns,
        "calls": sampler.calls,
        "episodes": len(eps),
        "per_call_ms": 1000 * (wall - sampler.seconds) / sampler.turns,
        "agent": getattr(run.env, "stats", dict)(),
    }
    if stages and stages.requests:  # ms per request
        per = lambda x: 1000 * x / stages.requests  # noqa: E731
        out["requests"] = stages.requests
        out["process_cpu_ms"] = per(time.process_time() - cpu0)
        out["harness_cpu_ms"] = per(stages.harness_cpu + worker_cpu(run.env) - workers0)
        out["stage_wall_ms"] = {k: per(v) for k, v in stages.wall.items()}
        out["stage_cpu_ms"] = {k: per(v) for k, v in stages.cpu.items()}
        # the wait less the generate time of the batch each request was in: the batching window, and the GIL
        out["batch_wait_ms"] = per(stages.wall[WAIT] - sampler.prompt_seconds)
        out["own_wall_ms"] = per(stages.to_sent - stages.wall[WAIT])  # from the request to its reply sent
        out["own_cpu_ms"] = per(sum(stages.cpu.values()) - stages.cpu[WAIT])
        out["after_sent_ms"] = per(stages.after_sent)
    return out


def quartiles(xs: list[float]) -> str:
    q1, q2, q3 = np.percentile(xs, [25, 50, 75])
    return f"{q2:.2f} [{q1:.2f}, {q3:.2f}]"


def overhead_table(results: dict) -> str:
    out = ["| variant | env | rollout s | generate s | turns | generate calls | ms per call, median [IQR] |"]
    out += ["|---|---|---|---|---|---|---|"]
    for variant, by_env in results.items():
        for m, rs in by_env.items():
            med = {k: statistics.median(r[k] for r in rs) for k in ("rollout_s", "generate_s", "turns", "calls")}
            out.append(
                f"| {variant} | {NAMES[m]} | {med['rollout_s']:.3f} | {med['generate_s']:.3f} | {med['turns']:.0f} | "
                f"{med['calls']:.0f} | {quartiles([r['per_call_ms'] for r in rs])} |"
            )
        diff = [h["per_call_ms"] - b["per_call_ms"] for b, h in zip(by_env["builtin"], by_env["harness"])]
        out.append(f"| {variant} | harness - built-in (per repeat) | | | | | {quartiles(diff)} |")
    return "\n".join(out)


def stage_table(results: dict) -> str:
    """Per request of the endpoint, ms, medians over the rollouts: each stage's wall and CPU (its handler thread's);
    the endpoint's own cost, wall from the request to its reply sent and CPU of all stages, both less the wait; the
    time after the reply is sent; the batching wait; and the CPU of the harness and of the trainer's process."""
    envs = [(variant, m, rs) for variant, by_env in results.items() for m, rs in by_env.items() if "requests" in rs[0]]
    med = lambda rs, key: statistics.median(key(r) for r in rs)  # noqa: E731
    out = ["| ms per request, wall / CPU | " + " | ".join(f"{v} {NAMES[m]}" for v, m, _ in envs) + " |"]
    out += ["|---|" + "---|" * len(envs)]
    for stage in dict.fromkeys([HTTP, *STAGES.values()]):
        if stage == WAIT:
            continue
        wall = [med(rs, lambda r: r["stage_wall_ms"].get(stage, 0)) for _, _, rs in envs]
        cpu = [med(rs, lambda r: r["stage_cpu_ms"].get(stage, 0)) for _, _, rs in envs]
        out.append(f"| {stage} | " + " | ".join(f"{w:.2f} / {c:.2f}" for w, c in zip(wall, cpu)) + " |")
    wall = [med(rs, lambda r: r["own_wall_ms"]) for _, _, rs in envs]
    cpu = [med(rs, lambda r: r["own_cpu_ms"]) for _, _, rs in envs]
    cells = [f"**{w:.2f} / {c:.2f}**" for w, c in zip(wall, cpu)]
    out.append("| **the endpoint's own cost** (wall: to the reply sent) | " + " | ".join(cells) + " |")
    rows = {
        "after the reply is sent: its write gets the interpreter lock back": "after_sent_ms",
        "wait: the batching window (the wait less generate)": "batch_wait_ms",
        "harness: its threads' or worker processes' CPU": "harness_cpu_ms",
        "the trainer process's CPU": "process_cpu_ms",
    }
    for name, key in rows.items():
        out.append(f"| {name} | " + " | ".join(f"{med(rs, lambda r: r[key]):.2f}" for _, _, rs in envs) + " |")
    return "\n".join(out)


def load_trainer(path: str):
    """Another copy of the trainer, as a module of its own."""
    import importlib.util
    import itertools

    spec = importlib.util.spec_from_file_location("mt_grpo_baseline", path)
    B = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = B  # its dataclasses look their module up
    spec.loader.exec_module(B)
    B.SESSIONS = itertools.count(10**9)  # the scripted sampler scripts by session: none shared with this trainer's
    return B


def overhead(args):
    start_worker()  # one torch thread, as a trainer of the learning part
    import mt_grpo_trainer as M

    out = os.path.join(args.out, "overhead" if args.repeats == 10 else f"overhead-{args.repeats}-repeats")
    recipes = dict(RECIPES)
    if args.baseline or args.baseline_trainer:
        recipes["baseline"] = RECIPES["harness"]
    B = M  # the baseline's trainer
    if args.baseline_trainer:
        B = load_trainer(args.baseline_trainer)
    runs = {}
    try:
        for m, recipe in recipes.items():
            overrides = ["seed=0", f"output_dir={out}/{m}", "resume_from_checkpoint=", "log_episodes_steps=0"]
            overrides += ["eval_steps=0", *args.set]
            trainer = M
            if m == "baseline":
                overrides += args.baseline
                trainer = B
            runs[m] = trainer.setup(trainer.load_config(recipe, overrides))
        stages = Stages(list(dict.fromkeys([M, B])))
        rows = runs["builtin"].batch(0)
        samplers = {
            "sampled": Timed(runs["builtin"].sampler),
            "scripted": Timed(Scripted(runs["builtin"].tokenizer, M.Completion)),
        }
        results = {}
        for variant, sampler in samplers.items():
            for m in runs:  # a warm-up rollout of each, not counted
                timed_rollout(runs[m], sampler, rows)
            results[variant] = {m: [] for m in runs}
            for k in range(args.repeats):
                for m in runs:
                    results[variant][m].append(timed_rollout(runs[m], sampler, rows, stages))
                    r = results[variant][m][-1]
                    own = ""
                    if "requests" in r:
                        own = f", own {r['own_wall_ms']:.2f} ms (CPU {r['own_cpu_ms']:.2f}), wait "
                        own += f"{r['batch_wait_ms']:.2f} ms"
                    print(
                        f"[bench] {variant} {m} {k + 1}/{args.repeats}: {r['rollout_s']:.3f} s, generate "
                        f"{r['generate_s']:.3f} s, {r['turns']} turns in {r['calls']} calls, {r['per_call_ms']:.2f} ms "
                        f"a call{own} {r['agent'] or ''}",
                        flush=True,
                    )
    finally:
        for run in runs.values():
            run.release()
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "rows": len(rows), "results": results}, f, indent=1)
    print(
        f"\nOverhead per call = (rollout - generate) / turns, {len(rows)} episodes a rollout, {args.repeats} rollouts"
    )
    print("of each env per variant, alternating (medians of rollout s, generate s, turns, calls):\n")
    print(overhead_table(results))
    print("\nWhere an endpoint request's time goes (ms per request, medians over the rollouts):\n")
    print(stage_table(results))
    print(f"\nPer-rollout figures: {os.path.join(out, 'results.json')}")


def main(argv=None):
    args = parse_args(argv)
    learning(args) if args.part == "learning" else overhead(args)


if __name__ == "__main__":
    main()
