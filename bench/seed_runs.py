"""Run a learning bench's (method, seed) trainings, a few at once with one thread each, and read back what they
logged (bench/turn_credit.py, bench/paper_effect.py).

Each run is `mt_grpo_trainer.py RECIPE overrides... output_dir=DIR`, its console in DIR/train.log and its wall time
in DIR/wall.json. `jobs` worker processes (one torch thread each) run them in turn, in-process: torch, transformers
and the model classes are imported once per worker, not once per run (on the loaded 2-core machine a fresh process
took about 30 s to import them and load the model). A finished run (wall.json written) is reused. A run that fails is
started again once on the same seed, from nothing (the trainer is deterministic in-process, so a rerun of a crash is
the run it would have been); the number of attempts is kept in wall.json.
"""

import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import shutil
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_worker():
    """A worker's set-up: one thread, the trainer importable, the repository as the working folder."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    os.chdir(ROOT)
    sys.path.insert(0, ROOT)
    import torch

    torch.set_num_threads(1)


def run_trainer(argv: list[str], log_path: str) -> int:
    """In a worker: `mt_grpo_trainer.py argv`, its console to log_path; returns its exit status."""
    import mt_grpo_trainer

    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            mt_grpo_trainer.main(argv)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1
        except Exception:
            traceback.print_exc()
            return 1
    return 0


def train_one(pool, recipe: str, overrides: list[str], out: str) -> dict:
    """Train once into `out` (reused when finished) on a worker of `pool`; returns wall.json's figures."""
    wall_path = os.path.join(out, "wall.json")
    if os.path.isfile(wall_path):
        with open(wall_path) as f:
            return json.load(f)
    argv = [recipe, *overrides, f"output_dir={out}", "resume_from_checkpoint="]
    for attempt in (1, 2):
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        t0 = time.time()
        status = pool.submit(run_trainer, argv, os.path.join(out, "train.log")).result()
        if status == 0:
            figures = {"seconds": time.time() - t0, "attempts": attempt}
            with open(wall_path, "w") as f:
                json.dump(figures, f)
            return figures
        print(f"[bench] {out} failed (exit {status}, attempt {attempt}); see its train.log", flush=True)
    raise RuntimeError(f"{out} failed twice on the same seed; see {out}/train.log")


def train_all(recipe: str | dict, runs: dict[tuple, list[str]], runs_dir: str, jobs: int) -> dict[tuple, dict]:
    """Train every (method, seed) of `runs` (its overrides) into runs_dir/METHOD-seedS, `jobs` at a time, in the
    order given; `recipe` is every run's, or {method: its recipe}. Returns {(method, seed): wall.json's figures}."""
    spawn = multiprocessing.get_context("spawn")  # no fork of a process that holds threads
    with (
        concurrent.futures.ProcessPoolExecutor(jobs, mp_context=spawn, initializer=start_worker) as workers,
        concurrent.futures.ThreadPoolExecutor(jobs) as waiting,
    ):
        futures = {}
        for (method, seed), overrides in runs.items():
            out = os.path.join(runs_dir, f"{method}-seed{seed}")
            own = recipe[method] if isinstance(recipe, dict) else recipe
            futures[(method, seed)] = waiting.submit(train_one, workers, own, overrides, out)
        walls = {}
        for key, fut in futures.items():
            walls[key] = fut.result()
            print(f"[bench] {key[0]} seed {key[1]}: {walls[key]['seconds']:.0f} s", flush=True)
    return walls


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def trained_steps(run_dir: str) -> list[dict]:
    """The rows of metrics.jsonl for trained steps (a row at step 0 holds the evaluation before training only)."""
    return [m for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if m["step"] > 0]


def eval_points(run_dir: str) -> dict[int, dict]:
    """{step: the eval/ means and time/eval} for every evaluation of a run, step 0 included (a row of metrics.jsonl;
    runs of an older trainer logged it in eval/metrics.jsonl)."""
    points = {}
    older = os.path.join(run_dir, "eval", "metrics.jsonl")
    if os.path.isfile(older):
        points = {r["step"]: r for r in read_jsonl(older)}
    for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl")):
        if any(k.startswith("eval/") for k in m):
            points[m["step"]] = m
    return dict(sorted(points.items()))


def time_split(run_dir: str, wall: dict) -> dict:
    """Where a run's wall time went: training steps (rollout + update), evaluation, and the rest (start-up: imports,
    model load; the final save; exit)."""
    steps = trained_steps(run_dir)
    training = sum(m["time/step"] for m in steps)
    evaluation = sum(p.get("time/eval", 0.0) for p in eval_points(run_dir).values())
    return {
        "wall": wall["seconds"],
        "training": training,
        "evaluation": evaluation,
        "other": wall["seconds"] - training - evaluation,
        "attempts": wall["attempts"],
    }
