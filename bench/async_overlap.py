"""What overlapping rollouts with training buys, side by side in one run (the toy recipe, 2 CPU cores or more).

    .venv/bin/python bench/async_overlap.py                       # all three parts
    .venv/bin/python bench/async_overlap.py --part speed --steps 30
    .venv/bin/python bench/async_overlap.py --part learning --seeds 0 1 2 --steps 60
    .venv/bin/python bench/async_overlap.py --part filter --seeds 0 1 2 --steps 60
    (any part: [--out DIR] for the runs, [--set key=value ...] more overrides of every run and of the model's build)

- speed: the stand-in server (tests/vllm_standin.py), calibrated so that one step's rollouts take about as long as
  its update (train + weight sync): a fixed per-request latency where the update is the longer, more optimizer passes
  over each batch (num_iterations) where the rollout is. Steps per
  second at max_staleness 0, 1 and 2, twice: with the stand-in and the trainer sharing the cores (they compete),
  and split, one core each (as a server on its own hardware). The last line is the ratio of 1 to 0, split.
- learning: the real vLLM CPU build (one `bash run.sh serve`, each run joining it with --server-url), max_staleness
  1 against 0 per seed: the first step whose trailing 10-step outcome reward reaches 0.8, and the wall time.
- filter: the in-process sampler, filter_zero_spread_groups on against off per seed: steps to 0.8, wall time,
  and the extra prompts drawn.
"""

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import mt_grpo_trainer as M  # noqa: E402

RECIPE = "hf_recipes/toy/toy-kv--mt-grpo.yaml"


def pinned(core):
    """Run on one CPU core with one thread (split: the server and the trainer each get their own core)."""
    return (
        (["taskset", "-c", str(core)], {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        if core is not None
        else ([], {})
    )


def train(a, out, *overrides, server=None, core=None):
    """One run as a user starts it, with the bench's --set last; returns its metrics and wall time."""
    prefix, threads = pinned(core)
    cmd = [*prefix, "bash", "run.sh", RECIPE, *(["--server-url", server] if server else [])]
    env = {"MTGRPO_LAYOUT": "server" if server else "local", **threads}
    t = time.time()
    args = [*cmd, f"output_dir={out}", "save_steps=0", "log_episodes_steps=0", "eval_steps=0", *overrides, *a.set]
    with started(args, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        stdout, stderr = p.communicate()
    if p.returncode:
        sys.exit(f"run {out} failed:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))], time.time() - t


def reached(h, threshold=0.8):
    o = [m.get("reward/outcome_before_filter", m["reward/outcome"]) for m in h]  # the filter biases reward/outcome
    return next((i + 1 for i in range(9, len(o)) if np.mean(o[i - 9 : i + 1]) >= threshold), None)


@contextlib.contextmanager
def started(cmd, env=None, **kw):
    """`cmd` in a session of its own, for the block. However the block ends (SIGTERM, as `timeout` sends, or SIGHUP
    becomes SystemExit; Ctrl-C KeyboardInterrupt), its process group is stopped, and with it the groups its processes
    started in sessions of their own (run.sh's torchrun and vLLM server): SIGTERM, then SIGKILL to what is left after
    30 s. A SIGKILL to the bench itself leaves them running: nothing can run then."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: sys.exit(128 + signum))
    p = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, env={**os.environ, **(env or {})}, **kw)
    try:
        yield p
    finally:  # no signal cuts the stop short; the bench's handlers are back once it is done
        kept = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
        groups = process_groups(p.pid)  # before any of them ends: a child of an ended process has another parent
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for group in groups:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)  # run.sh's ranks finish their step and save on SIGTERM
            groups = [g for g in groups if alive(g)]
        for sig, handler in kept.items():
            signal.signal(sig, handler)


def process_groups(pid):
    """The process group of `pid` and those of the processes it started, and they started (read from /proc)."""
    procs = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{d}/stat") as f:
            procs[int(d)] = [int(x) for x in f.read().rsplit(")", 1)[1].split()[1:3]]  # its parent, its group
    groups, todo = {pid}, [pid]
    while todo:
        parent = todo.pop()
        kids = [c for c, (ppid, _) in procs.items() if ppid == parent]
        groups.update(procs[c][1] for c in kids)
        todo += kids
    return sorted(groups)


def alive(group):
    try:
        os.killpg(group, 0)
        return True
    except (ProcessLookupError, PermissionError):  # gone (its number is not ours to signal if another took it)
        return False


@contextlib.contextmanager
def served(cmd, url, timeout, env=None):
    """A server (`bash run.sh serve`, the stand-in), `started`, healthy within `timeout` s, for the block."""
    with started(cmd, env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as p:
        end = time.time() + timeout
        while not healthy(url):
            if time.time() > end or p.poll() is not None:
                sys.exit(f"the server ({' '.join(cmd[:4])} ...) was not healthy within {timeout} s")
            time.sleep(1)
        yield


def healthy(url):
    try:
        return requests.get(url + "/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def standin(model, latency, core=None):
    """The stand-in server (pinned to `core`), to use in a `with` block, and its URL."""
    port = M.free_port()
    url = f"http://127.0.0.1:{port}"
    prefix, threads = pinned(core)
    return served(
        [
            *prefix,
            sys.executable,
            "tests/vllm_standin.py",
            "--model",
            model,
            "--port",
            str(port),
            "--max-model-len",
            "1024",
            "--latency",
            str(latency),
        ],
        url,
        120,
        threads,
    ), url


def speed(a, model, split):
    """split: the stand-in on core 1 and the trainer on core 0, one thread each, as a server on its own hardware;
    else both share every core, so generating and training compete for them."""
    runs, cores = os.path.join(a.out, "speed-split" if split else "speed-shared"), (1, 0) if split else (None, None)
    # calibration: rollout time at two latencies gives the sequential request rounds per step; the update is the rest
    cal = {}
    for lat in (0.0, 0.2):
        server, url = standin(model, lat, cores[0])
        with server:
            cal[lat], _ = train(
                a, os.path.join(runs, f"cal{lat}"), "max_steps=4", f"seed={a.seeds[0]}", server=url, core=cores[1]
            )
    mean = lambda h, k: float(np.mean([m[k] for m in h[1:]]))
    rollout = mean(cal[0.0], "time/rollout")
    rounds = (mean(cal[0.2], "time/rollout") - rollout) / 0.2
    train_s = mean(cal[0.0], "time/train")
    sync_s = mean(cal[0.0], "time/weight_sync")
    # The two sides are balanced by slowing the faster one: rollouts by a per-request latency, or the update by more
    # optimizer passes over the batch (num_iterations), which trains more per step but syncs and rolls out the same.
    iterations = max(1, round((rollout - sync_s) / train_s))
    update = iterations * train_s + sync_s
    latency = max(0.0, (update - rollout) / max(rounds, 1.0))
    print(
        f"calibration: update {train_s + sync_s:.2f} s, rollout {rollout:.2f} s at no latency, "
        f"{rounds:.1f} request rounds per step -> num_iterations {iterations} (update about {update:.2f} s), "
        f"latency {latency:.3f} s per request",
        flush=True,
    )
    rows = {}
    server, url = standin(model, latency, cores[0])
    with server:
        for k in (0, 1, 2):
            h, wall = train(
                a,
                os.path.join(runs, f"k{k}"),
                f"max_steps={a.steps}",
                f"max_staleness={k}",
                f"seed={a.seeds[0]}",
                f"num_iterations={iterations}",
                server=url,
                core=cores[1],
            )
            rows[k] = h, wall
    how = "split: the stand-in on one core, the trainer on the other" if split else "shared: both on every core"
    print(f"\nspeed, {how}; {latency:.3f} s per request, {a.steps} steps (per-step means, s)\n")
    print(
        "| max_staleness | steps/s | rollout | wait_rollout | train | weight_sync | staleness mean | outcome last 10 | wall (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    sps = {}
    for k, (h, wall) in rows.items():
        sps[k] = len(h) / sum(m["time/step"] for m in h)
        print(
            f"| {k} | {sps[k]:.2f} | {mean(h, 'time/rollout'):.2f} | {mean(h, 'time/wait_rollout'):.2f} | "
            f"{mean(h, 'time/train'):.2f} | {mean(h, 'time/weight_sync'):.2f} | "
            f"{np.mean([m.get('rollout/staleness_mean', 0.0) for m in h]):.2f} | "
            f"{np.mean([m['reward/outcome'] for m in h[-10:]]):.3f} | {wall:.0f} |"
        )
    return sps


def learning(a, model):
    port = M.free_port()
    url = f"http://127.0.0.1:{port}"
    env_cmd = ["env", "MTGRPO_LAYOUT=server", f"MTGRPO_VLLM_PORT={port}"]  # run.sh finds the vLLM CPU build's venv
    t = time.time()
    rows = []
    with served([*env_cmd, "bash", "run.sh", "serve", RECIPE, *a.set, f"model_name_or_path={model}"], url, 1200):
        print(f"learning: vLLM CPU build healthy after {time.time() - t:.0f} s", flush=True)
        for seed in a.seeds:
            for k in (0, 1):
                h, wall = train(
                    a,
                    os.path.join(a.out, "learning", f"s{seed}k{k}"),
                    f"max_steps={a.steps}",
                    f"max_staleness={k}",
                    f"seed={seed}",
                    server=url,
                )
                rows.append((seed, k, h, wall))
                print(f"  seed {seed} max_staleness {k}: reached {reached(h)}, {wall:.0f} s", flush=True)
    print(f"\nlearning: real vLLM CPU build, {a.steps} steps; trailing-10 outcome >= 0.8 at step (wall s)\n")
    print(
        "| max_staleness | "
        + " | ".join(f"seed {s}" for s in a.seeds)
        + " | mean step time (s) | mean wait_rollout (s) |"
    )
    print("|---|" + "---|" * (len(a.seeds) + 2))
    for k in (0, 1):
        mine = [r for r in rows if r[1] == k]
        print(
            f"| {k} | "
            + " | ".join(f"{reached(h) or 'not reached'} ({wall:.0f})" for _, _, h, wall in mine)
            + f" | {np.mean([m['time/step'] for r in mine for m in r[2]]):.2f}"
            + f" | {np.mean([m['time/wait_rollout'] for r in mine for m in r[2]]):.2f} |"
        )


def dynamic_sampling(a):
    rows = []
    for seed in a.seeds:
        for on in (False, True):
            h, wall = train(
                a,
                os.path.join(a.out, "filter", f"s{seed}f{int(on)}"),
                f"max_steps={a.steps}",
                f"filter_zero_spread_groups={str(on).lower()}",
                f"seed={seed}",
            )
            rows.append((seed, on, h, wall))
            print(f"  seed {seed} filter {on}: reached {reached(h)}, {wall:.0f} s", flush=True)
    print(f"\ndynamic sampling: in-process sampler, {a.steps} steps; trailing-10 outcome >= 0.8 at step (wall s)\n")
    print(
        "| filter_zero_spread_groups | "
        + " | ".join(f"seed {s}" for s in a.seeds)
        + " | groups filtered per step | extra prompts per step |"
    )
    print("|---|" + "---|" * (len(a.seeds) + 2))
    for on in (False, True):
        mine = [r for r in rows if r[1] == on]
        per = lambda k: np.mean([m.get(k, 0.0) for r in mine for m in r[2]])
        print(
            f"| {str(on).lower()} | "
            + " | ".join(f"{reached(h) or 'not reached'} ({wall:.0f})" for _, _, h, wall in mine)
            + f" | {per('rollout/groups_filtered'):.2f} | {per('rollout/extra_draws'):.2f} |"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["speed", "learning", "filter", "all"], default="all")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: speed 30, learning/filter 60)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", default="bench/runs/async_overlap")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more overrides of every run")
    a = ap.parse_args()
    cfg = M.load_config(RECIPE, [f"output_dir={a.out}/build", *a.set])
    M.build_model_if_missing(cfg, print)
    model = os.path.abspath(cfg.model_name_or_path)
    steps = a.steps
    if a.part in ("filter", "all"):
        a.steps = steps or 60
        dynamic_sampling(a)
    if a.part in ("learning", "all"):
        a.steps = steps or 60
        learning(a, model)
    if a.part in ("speed", "all"):
        a.steps = steps or 30
        shared = speed(a, model, split=False)
        split = speed(a, model, split=True) if (os.cpu_count() or 1) >= 2 else None
        print(
            f"\nshared cores: max_staleness 1 / 0 steps per second {shared[1] / shared[0]:.2f}x, 2 / 0 {shared[2] / shared[0]:.2f}x"
        )
        if split:
            print(
                f"split cores: max_staleness 1 / 0 steps per second {split[1] / split[0]:.2f}x, 2 / 0 {split[2] / split[0]:.2f}x"
            )
        last = split or shared
        print(
            f"max_staleness 1 / 0, steps per second ({'split' if split else 'shared'} cores): {last[1] / last[0]:.2f}x"
        )


if __name__ == "__main__":
    main()
