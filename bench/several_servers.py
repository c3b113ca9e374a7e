"""Several vLLM servers, side by side in one run: rollout throughput with 1, 2 and 4 servers, and prefix-cache hits
with and without session affinity.

    .venv/bin/python bench/several_servers.py                     # all three parts
    .venv/bin/python bench/several_servers.py --part standin --latency 2 --capacity 32 [--servers 1 2 4] [--prompts 32]
    .venv/bin/python bench/several_servers.py --part real --rollouts 5

- standin: 256 episodes (32 prompts x 8, `--prompts`) of 3 turns (tool call, tool call, answer) through the real
  MultiTurnToolEnv and VLLMServerClient, against 1, 2 and 4 stand-in servers (`--servers`; tests/vllm_standin.py, each
  in a process of its own).
  Each answers a request after `--latency` s with a scripted completion and runs at most `--capacity` sequences at
  once (vLLM's max_num_seqs), so a turn of 256 sequences takes 256 / (capacity x servers) rounds: latency-bound.
- real: the warm-started toy model on vLLM's CPU build, started by `bash run.sh serve` (one server, then two with
  MTGRPO_VLLM_CPU_SERVERS=2, `--block-size 32` so that these short episodes fill whole cache blocks): episodes a
  second over `--rollouts` rollouts of 64 episodes (8 prompts x 8) each; then, on the two servers, the prefix-cache
  hit rate from their own GET /metrics counters with session affinity (an episode stays on one server) and without
  (each request to the server with the fewest in flight).
"""

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import mt_grpo_trainer as M  # noqa: E402
from bench.async_overlap import healthy, served  # noqa: E402
from bench.rollout_throughput import scripted_backend  # noqa: E402
from tests.conftest import toy_tokenizer  # noqa: E402
from tests.vllm_standin import StandinServer  # noqa: E402
from tools.kv_lookup import lookup  # noqa: E402

RECIPE = "hf_recipes/toy/toy-kv--mt-grpo.yaml"


class NoAffinity(M.VLLMServerClient):
    """Every request to the server with the fewest in flight, whatever its episode: no session is kept."""

    def generate(self, prompts, max_tokens, temperature=1.0, top_p=1.0, stop=(), generator=None, sessions=None):
        return super().generate(prompts, max_tokens, temperature, top_p, stop, generator, None)


def serve(port: int, latency: float, capacity: int):
    """A scripted stand-in in its own process, as vLLM would be: its HTTP threads do not share our GIL."""
    tok = toy_tokenizer()
    srv = StandinServer(backend=scripted_backend(tok), vocab_size=len(tok), max_model_len=4096, port=port).start()
    srv.faults.set_latency(latency, capacity)
    while True:
        time.sleep(3600)


def standin(a):
    tok, out = toy_tokenizer(), {}
    rows = [{"prompt": f'What is the value of "k{i}"?', "key": "alpha", "answer": "x"} for i in range(a.prompts)]
    rows = [r for r in rows for _ in range(8)]
    for n in a.servers:
        ports = [M.free_port() for _ in range(n)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
            for port, url in zip(ports, urls):
                cmd = [sys.executable, __file__, "--serve-port", str(port), "--latency", str(a.latency)]
                stack.enter_context(served([*cmd, "--capacity", str(a.capacity)], url, 60))
            overrides = [f"vllm_server_url={','.join(urls)}", "max_tokens=64", "max_seq_len=4096"]
            cfg = M.load_config(RECIPE, [*overrides, f"output_dir={tmp}/run", "tokenization_check=off"])
            client = M.VLLMServerClient(cfg, len(tok), {tok.convert_tokens_to_ids("<|im_end|>")})
            env = M.MultiTurnToolEnv(tok, [lookup], cfg)
            env.rollout(rows[:8], client)  # the client's threads up, as in training
            t = time.perf_counter()
            eps = env.rollout(rows, client)
            out[n] = time.perf_counter() - t
            assert all(len(ep.turns) == 3 for ep in eps), "every episode: tool, tool, answer"
            print(f"  {n} stand-in server(s): {out[n]:.1f} s, {client.stats()}", flush=True)
    ideal = 3 * a.latency * len(rows) / a.capacity
    print(
        f"\nstand-ins: {len(rows)} episodes x 3 turns, {a.latency:g} s a request, {a.capacity} sequences at a time "
        f"per server, {os.cpu_count()} CPU cores\n"
    )
    print(f"| servers | rollout (s) | ideal (s) | speed-up over {a.servers[0]} |\n|---|---|---|---|")
    for n, took in out.items():
        print(f"| {n} | {took:.1f} | {ideal / n:.1f} | {out[a.servers[0]] / took:.2f}x |")
    return out


@contextlib.contextmanager
def real_servers(model, n):
    port = M.free_port()
    urls = [f"http://127.0.0.1:{port + i}" for i in range(n)]
    env = [
        "env",
        "MTGRPO_LAYOUT=server",
        f"MTGRPO_VLLM_PORT={port}",
        f"MTGRPO_VLLM_CPU_SERVERS={n}",
        "MTGRPO_VLLM_ARGS=--block-size 32",
        f"MTGRPO_VLLM_LOG={tempfile.gettempdir()}/several-servers.log",
    ]
    t = time.time()
    with served([*env, "bash", "run.sh", "serve", RECIPE, f"model_name_or_path={model}"], urls[0], 1200):
        while not all(healthy(url) for url in urls):  # run.sh starts them together
            time.sleep(1)
        print(f"  {n} vLLM CPU server(s) healthy after {time.time() - t:.0f} s", flush=True)
        yield urls


def conversations(client, prompts, turns, result, affinity):
    """Each prompt a conversation of `turns` turns, all in flight at once, each turn's prompt the last one plus its
    completion and a tool result, as an episode's turns are; with `affinity` each is a session of its own."""
    sessions = [next(M.SESSIONS) for _ in prompts] if affinity else None
    for _ in range(turns):
        outs = client.generate(prompts, [16] * len(prompts), 1.0, 1.0, (), None, sessions)
        prompts = [p + c.ids + result for p, c in zip(prompts, outs)]


def real(a, model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    data = M.load_rows(M.load_config(RECIPE).dataset)
    rates, hits, used = {}, {}, [0]

    def take(k):  # rows not used before: no hit from an earlier rollout's prompts
        used[0] += k
        return data[used[0] - k : used[0]]

    for n in (1, 2):
        with real_servers(model, n) as urls, tempfile.TemporaryDirectory() as tmp:
            overrides = [f"vllm_server_url={','.join(urls)}", f"model_name_or_path={model}", f"output_dir={tmp}/run"]
            cfg = M.load_config(RECIPE, overrides)
            env = M.MultiTurnToolEnv(tok, [lookup], cfg)
            result = tok.encode("<|im_end|>\n<|im_start|>user\n<result>\nthe value is 42\n</result><|im_end|>\n")
            for kind, cls in {"affinity": M.VLLMServerClient, "none": NoAffinity}.items():
                client = cls(cfg, len(tok), {tok.eos_token_id})
                rows = lambda: [r for r in take(8) for _ in range(8)]
                env.rollout(rows(), client)  # warm-up: the servers' first requests compile
                if kind == "affinity":  # throughput: the client as the trainer uses it
                    took = []
                    for _ in range(a.rollouts):
                        t = time.perf_counter()
                        eps = env.rollout(rows(), client)
                        took.append(time.perf_counter() - t)
                    turns = sum(len(ep.turns) for ep in eps) / len(eps)
                    rates[n] = 64 / statistics.median(took)
                    print(
                        f"  {n} server(s): {rates[n]:.1f} episodes/s (median of {a.rollouts} rollouts, "
                        f"{turns:.2f} turns an episode)",
                        flush=True,
                    )
                prompts = [env.next_prompt(env.new_episode(r)) for r in take(64)]
                client.stats()  # the servers' counters from here (their GET /metrics)
                conversations(client, prompts, 4, result, kind == "affinity")
                hits[n, kind] = client.stats().get("rollout/prefix_cache_hit_rate", 0.0)
                print(f"  {n} server(s), {kind}: prefix-cache hit rate {hits[n, kind]:.3f}", flush=True)
    print(f"\nreal vLLM CPU build, toy model, {os.cpu_count()} CPU cores: rollouts of 64 episodes (8 prompts x 8);")
    print("64 conversations of 4 turns (16 sampled tokens and a tool result each), from the servers' GET /metrics\n")
    print("| servers | episodes/s | over 1 server | hit rate, affinity | hit rate, none |\n|---|---|---|---|---|")
    for n, rate in rates.items():
        print(f"| {n} | {rate:.1f} | {rate / rates[1]:.2f}x | {hits[n, 'affinity']:.3f} | {hits[n, 'none']:.3f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["standin", "real", "all"], default="all")
    ap.add_argument("--latency", type=float, default=2.0)
    ap.add_argument("--capacity", type=int, default=32)
    ap.add_argument("--rollouts", type=int, default=5)
    ap.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4], help="standin: how many stand-ins, each")
    ap.add_argument("--prompts", type=int, default=32, help="standin: prompts of 8 episodes a rollout")
    ap.add_argument("--serve-port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_port:
        return serve(a.serve_port, a.latency, a.capacity)
    if a.part in ("standin", "all"):
        standin(a)
    if a.part in ("real", "all"):
        cfg = M.load_config(RECIPE)
        M.build_model_if_missing(cfg, print)
        real(a, os.path.abspath(cfg.model_name_or_path))


if __name__ == "__main__":
    main()
