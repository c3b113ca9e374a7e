"""Which model families vLLM's CPU build serves: each family that packs, as the tiny random model the packing tests
check, served by the real server and scored on a fixed sequence against the trainer's own logprobs (issue 46).

    .venv/bin/python bench/vllm_families.py                            # every family that packs, one after another
    .venv/bin/python bench/vllm_families.py --families mistral qwen3   # some of them
    .venv/bin/python bench/vllm_families.py --families olmoe --config tie_word_embeddings=false
    (--out DIR: the models, the servers' logs; default bench/runs/vllm_families/. --timeout S: per server start.
    --config KEY=VALUE ...: set in every family's tiny config, e.g. to see what a disagreement depends on)

What is measured, per family:
- The model: tests/test_models.py's tiny random config of the family (`tiny_config`: 2 layers, 2 heads sharing one
  KV head of size 32, the smallest vLLM's CPU attention accepts, and the family's extras as its PACKED gives them:
  4 experts for an MoE, SmolLM3's NoPE layer, gpt_oss's sinks and 128-token window on every other layer), with the
  weights `tiny_model` gives it (seed 0) and the toy tokenizer: the very model the packing tests check exact.
- Served: `bash run.sh serve` (the server layout's own launch code, vLLM's CPU build with the flags a run gets)
  answers GET /health within --timeout s, and then answers the weight-sync probe's request (prompt logprobs of every
  token). Refused: the server exits before it is healthy (the reason is the root exception line of its log: an
  architecture vLLM does not know, a limit of its CPU backend, ...), is not healthy in time, or fails the request.
  "vLLM runs it as": the class its log says it resolved the architecture to, its own implementation or
  TransformersForCausalLM (its backend that runs the transformers modeling code of its own venv, for an
  architecture it has no implementation of).
- Agreement, where served: the server's prompt logprobs of a fixed 219-token sequence (three toy-kv episodes with a
  tool call, rendered by the toy tokenizer's chat template; longer than gpt_oss's window) against the trainer's own
  logprobs of the same tokens, the model loaded as a run loads it (`load_models`: float32, packed attention for a
  family that packs). Both sides are the weight-sync check's own: the server's is `VLLMServerClient.probe_logprobs`
  (its request), the trainer's `token_logprobs` in eval mode at temperature 1, as `Run.sync` calls it. Printed: the
  largest and the mean |server - trainer| over the 218 scored tokens (the server computes in bf16, the trainer in
  float32), and whether the mean is within sync_check_max_diff (0.1), the bound every sync of a run must meet.
  The spread (standard deviation) of the trainer's logprobs gives the scale: a random model's logits are nearly
  flat, so a difference well below the spread says the server computes this architecture's forward as transformers
  does (embeddings, norms, rotary positions, attention, MLP or experts, the tied head), not more.
- After a sync: the trainer's own weight sync (`VLLMServerClient.sync_weights`: a safetensors folder the server
  reloads, `reload_weights`) of the very weights the server loaded at start, then the same comparison. The CPU build
  repeats its logprobs to the bit, so a reload that loads what the start loaded moves them by exactly 0; "moved by"
  is the largest change of a token's server logprob. A run syncs before its first rollout (`train`), so what it
  samples from is the server after a sync; the column `means <= 0.1` asks both means to be within the bound.

Families run one after another (2 CPU cores; a server start took 33-56 s here). Each server's process groups are
stopped however the bench ends (an error, SIGTERM, Ctrl-C), with a bounded wait (bench/async_overlap.py's `started`).
The table has a row per family; the last line is `served: N of M families (...), ...; refused: ...`.
"""

import argparse
import os
import random
import re
import subprocess
import sys
import time

import torch
import yaml
from transformers.utils import logging as transformers_logging

HERE = os.getcwd()  # tests/conftest.py changes folder to the project's when imported
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the packing tests' tiny configs, and their conftest
import mt_grpo_trainer as M  # noqa: E402
from async_overlap import RECIPE, healthy, started  # noqa: E402
from conftest import toy_tokenizer  # noqa: E402
from tasks import toy_kv  # noqa: E402
from test_models import PACKED, saved_model, tiny_config  # noqa: E402

# An exception's line in a vLLM log (maybe after the logger's prefix): its type and message.
EXCEPTION = re.compile(r"(?:^|[\]\)] )((?:\w+\.)*[A-Z]\w*(?:Error|Exception)): (.*)$")
WRAPPERS = ("Engine core initialization failed", "EngineCore failed to start")  # a cause's wrappers, said after it


def quiet(*_):
    pass


def probe_ids(tok) -> list[int]:
    """The fixed sequence: three toy-kv episodes with a tool call, each rendered by the toy tokenizer's template."""
    rng = random.Random(0)
    episodes = [toy_kv.demonstration(row, "", rng, p_tool=1.0) for row in toy_kv.make_dataset(3)]
    return [i for ep in episodes for i in tok.apply_chat_template(ep, tokenize=True)["input_ids"]]


def log_lines(log: str) -> list[str]:
    return open(log, errors="replace").read().splitlines() if os.path.exists(log) else []


def why_not(log: str, said: str) -> str:
    """One line: the first exception in the server's log that is not a wrapper of another (a pydantic error with its
    next line, which says what), else run.sh's last line."""
    lines = log_lines(log)
    for i, line in enumerate(lines):
        found = EXCEPTION.search(line.strip())
        if not found or any(w in found[2] for w in WRAPPERS):
            continue
        what = found[2]
        if re.search(r"validation errors? for", what) and i + 1 < len(lines):
            what += ": " + re.sub(r"^.*?\] ", "", lines[i + 1]).strip()
        what = re.sub(r" (Supported architectures|\[type=).*", "", what)  # the list of every architecture; pydantic's
        return f"{found[1]}: {what}"[:240]
    last = [line.strip() for line in said.splitlines() if line.strip()]
    return (last[-1] if last else "the server exited without a word")[:240]


def from_log(log: str, pattern: str) -> str:
    """The first match of `pattern`'s group in the server's log: its dtype, the class vLLM runs the model as."""
    found = [m[1] for line in log_lines(log) if (m := re.search(pattern, line))]
    return found[0] if found else "?"


def server_logprobs(client, ids, url) -> torch.Tensor:
    """The sync check's server side on `ids`: the server's prompt logprobs."""
    return torch.tensor(client.probe_logprobs(ids)[url], dtype=torch.float64)


def agreement(model, client, ids, url) -> dict:
    """Server and trainer compared at load, then after one weight sync of the very weights the server loaded."""
    x = torch.tensor([ids])
    with torch.no_grad():  # the sync check's trainer side
        own = M.token_logprobs(model.eval(), x, torch.ones_like(x), 1.0)[0, 1:].double()
    srv = server_logprobs(client, ids, url)
    diff = (srv - own).abs()
    out = {"max": float(diff.max()), "mean": float(diff.mean()), "spread": float(own.std())}
    state, _ = M.full_state(model)  # what Run.sync sends
    client.sync_weights(model, state, 1)
    after = server_logprobs(client, ids, url)
    out["after_mean"] = float((after - own).abs().mean())
    out["moved"] = float((after - srv).abs().max())  # 0: the CPU build repeats its logprobs to the bit
    return out


def family(a, name: str, tok, ids) -> dict:
    """One family: its tiny model saved, served by `bash run.sh serve`, and scored; the server stopped on return."""
    folder = os.path.join(a.out, name)
    config = tiny_config(name, len(tok), **PACKED[name])
    for key, value in a.config.items():  # --config: every family's config changed alike
        setattr(config, key, value)
    model_dir = saved_model(config, tok, os.path.join(folder, "model"))
    out = {"family": name, "architecture": config.architectures[0], "served": False}
    port = M.free_port()
    url = f"http://127.0.0.1:{port}"
    log = os.path.join(folder, "vllm.log")
    env = {
        "MTGRPO_LAYOUT": "server",
        "MTGRPO_VLLM_PORT": str(port),
        "MTGRPO_VLLM_LOG": log,
        "MTGRPO_VLLM_START_TIMEOUT": str(a.timeout),
    }
    cmd = ["bash", "run.sh", "serve", RECIPE, f"model_name_or_path={model_dir}", "model_builder="]
    t = time.time()
    with (
        open(os.path.join(folder, "run.log"), "w+") as said,
        started(cmd, env, stdout=said, stderr=subprocess.STDOUT) as p,
    ):
        while not healthy(url):
            if p.poll() is not None:
                said.seek(0)
                out["why"] = why_not(log, said.read())
                return out
            if time.time() - t > a.timeout:
                out["why"] = f"not healthy within {a.timeout} s (see {log})"
                return out
            time.sleep(1)
        out["start"] = time.time() - t
        out["dtype"] = from_log(log, r"\bdtype=torch\.(\w+)")
        out["runs_as"] = from_log(log, r"Resolved architecture: (\w+)")  # TransformersForCausalLM: not native
        overrides = [
            f"model_name_or_path={model_dir}",
            "model_builder=",
            f"vllm_server_url={url}",
            f"output_dir={folder}/run",
            f"weight_sync_dir={folder}/sync",
            "request_deadline=120",
        ]
        cfg = M.load_config(RECIPE, overrides)
        _, model, *_ = M.load_models(cfg, model_dir, torch.device("cpu"), say=quiet)
        try:
            client = M.VLLMServerClient(cfg, len(tok), say=quiet)
            out.update(agreement(model, client, ids, url))
        except M.SamplerError as e:
            out["why"] = "healthy, but a request failed: " + " ".join(str(e).split())[:200]
            return out
    out["served"] = True
    return out


def config_value(kv: str) -> tuple:
    """KEY=VALUE, its value read as YAML (false, 16, null, [1, 0])."""
    key, sep, value = kv.partition("=")
    if not sep:
        sys.exit(f"--config {kv}: write KEY=VALUE, e.g. tie_word_embeddings=false")
    return key, yaml.safe_load(value)


def agrees_within(r: dict, bound: float) -> bool:
    """A served family's mean difference from the trainer, at load and after a sync, within the sync check's bound."""
    return max(r["mean"], r["after_mean"]) <= bound


def row(r: dict, bound: float) -> str:
    if not r["served"]:
        return f"| `{r['family']}` | {r['architecture']} | no | - | - | - | - | - | - | - | - | {r['why'].replace('|', '/')} |"
    agrees = "yes" if agrees_within(r, bound) else "no"
    figures = [f"{r['max']:.4f}", f"{r['mean']:.4f}", f"{r['after_mean']:.4f}", f"{r['moved']:.4f}"]
    figures += [f"{r['spread']:.3f}", agrees, f"{r['start']:.0f}"]
    return f"| `{r['family']}` | {r['architecture']} | yes | {r['runs_as']} | {' | '.join(figures)} | |"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", nargs="+", default=list(PACKED), choices=list(PACKED), metavar="FAMILY")
    ap.add_argument("--out", default="bench/runs/vllm_families")
    ap.add_argument("--timeout", type=int, default=600, help="seconds a server start may take")
    ap.add_argument("--config", nargs="+", default=[], metavar="KEY=VALUE", help="set in every family's tiny config")
    a = ap.parse_args()
    a.config = dict(config_value(kv) for kv in a.config)
    a.out = os.path.join(HERE, a.out)
    t = time.time()
    transformers_logging.disable_progress_bar()  # no "Writing model shards" bar per family
    tok = toy_tokenizer()
    ids = probe_ids(tok)
    bound = M.Config.sync_check_max_diff
    print(
        "| family | architecture | served | vLLM runs it as | max \\|server - trainer\\| | mean | mean after a sync "
        f"| the sync moved the server by | trainer's spread | means <= {bound} | start (s) | why not |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for name in a.families:
        results.append(family(a, name, tok, ids))
        print(row(results[-1], bound), flush=True)
    served = [r["family"] for r in results if r["served"]]
    agree = [r["family"] for r in results if r["served"] and agrees_within(r, bound)]
    refused = [r["family"] for r in results if not r["served"]]
    dtypes = sorted({r["dtype"] for r in results if r["served"]}) or ["-"]
    print(
        f"\n{len(ids)}-token probe; the server computes in {', '.join(dtypes)}, the trainer in float32; "
        f"{time.time() - t:.0f} s wall"
    )
    moved = [r["family"] for r in results if r["served"] and r["moved"] > 0]
    print(
        f"served: {len(served)} of {len(results)} families ({', '.join(served) or 'none'}), {len(agree)} of them "
        f"within {bound} at load and after a sync; a sync of the same weights moved the server in: "
        f"{', '.join(moved) or 'none'}; refused: {', '.join(refused) or 'none'}"
    )


if __name__ == "__main__":
    main()
