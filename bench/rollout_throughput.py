"""Rollout throughput against a vLLM 0.33 stand-in with a fixed per-request latency.

    .venv/bin/python bench/rollout_throughput.py [--episodes 256] [--latency 2.0] [--seq-episodes 4]

256 episodes (32 prompts x 8) of 3 turns each (tool call, tool call, answer) through the real
MultiTurnToolEnv, with the toy task's tokenizer and tool. The server answers every request after
`--latency` seconds with a scripted completion, so the time is the client's: rendering, tokenizing,
tool calls, HTTP. Compared:
- ours: VLLMServerClient, every episode's request in flight at once, a group's first turn as one n=8 request;
- sequential: one request at a time, n=1, as the original MT-GRPO code sent them. Its time is
  measured on `--seq-episodes` episodes and scaled to all of them (it is linear by construction);
- ideal: the latency-bound time, 3 turns x latency, with zero client work.
Server and client share this machine's cores, so the overhead includes the stand-in's HTTP work.
"""

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mt_grpo_trainer as M  # noqa: E402
from bench.async_overlap import served  # noqa: E402
from tests.conftest import toy_tokenizer  # noqa: E402
from tests.vllm_standin import StandinServer  # noqa: E402
from tools.kv_lookup import lookup  # noqa: E402


class SequentialClient(M.VLLMServerClient):
    def generate(self, prompts, max_tokens, temperature=1.0, top_p=1.0, stop=(), generator=None, sessions=None):
        return [self.complete(p, 1, m, temperature, top_p, stop)[0] for p, m in zip(prompts, max_tokens)]


def scripted_backend(tok):
    """Tool, tool, then answer (3 turns); random words keep every episode's prompts distinct."""
    words = [tok.encode(f" {w}") for w in ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")]
    call = (
        tok.encode("<reasoning>look up"),
        tok.encode('</reasoning><tool>{"name": "lookup", "args": {"key": "alpha"}}</tool>'),
    )
    answer = (
        tok.encode("<reasoning>found"),
        tok.encode("</reasoning><answer>x</answer>") + [tok.convert_tokens_to_ids("<|im_end|>")],
    )
    result_id = tok.convert_tokens_to_ids("<result>")
    rng = random.Random(0)

    def backend(prompt, params):
        head, tail = call if prompt.count(result_id) < 2 else answer
        ids = head + [t for _ in range(4) for t in rng.choice(words)] + tail
        return ids, [-0.1] * len(ids), "stop"

    return backend


def serve(port: int, latency: float):
    """The stand-in in its own process, as vLLM would be: its HTTP threads do not share our GIL."""
    tok = toy_tokenizer()
    srv = StandinServer(backend=scripted_backend(tok), vocab_size=len(tok), max_model_len=4096, port=port).start()
    srv.faults.set_latency(latency)
    while True:
        time.sleep(3600)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=256)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--latency", type=float, default=2.0)
    ap.add_argument("--seq-episodes", type=int, default=4)
    ap.add_argument("--serve-port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_port:
        return serve(args.serve_port, args.latency)
    tok = toy_tokenizer()
    port = M.free_port()
    url = f"http://127.0.0.1:{port}"
    # its own process group, stopped however the bench ends (a SIGTERM too)
    with served(
        [sys.executable, os.path.abspath(__file__), "--serve-port", str(port), "--latency", str(args.latency)], url, 60
    ):
        rows = [
            {"prompt": f'What is the value of "k{i}"?', "key": "alpha", "answer": "x"}
            for i in range(args.episodes // args.group)
            for _ in range(args.group)
        ]
        with tempfile.TemporaryDirectory() as tmp:
            cfg = M.load_config(
                None,
                [
                    f"vllm_server_url={url}",
                    "max_env_steps=2",
                    "max_tokens=64",
                    "max_seq_len=4096",
                    "max_concurrent_requests=256",
                    f"output_dir={tmp}/run",
                    "tokenization_check=off",
                ],
            )
            env = M.MultiTurnToolEnv(tok, [lookup], cfg)
            timings = {}
            for name, cls, eps, reps in (
                ("ours", M.VLLMServerClient, rows, 2),
                ("sequential", SequentialClient, rows[: args.seq_episodes], 1),
            ):
                client = cls(cfg, len(tok), {tok.convert_tokens_to_ids("<|im_end|>")})
                for _ in range(reps):  # ours: the second rollout, with the client's threads up, as in training
                    t = time.perf_counter()
                    done = env.rollout(eps, client)
                    timings[name] = (time.perf_counter() - t) * len(rows) / len(eps)
                assert all(len(e.turns) == 3 and e.end_reason == "answer" for e in done), (
                    "every episode: tool, tool, answer"
                )
                print(
                    f"{name:>10}: {len(done)} episodes, {timings[name]:.2f} s"
                    f"{' (scaled to %d episodes)' % len(rows) if len(eps) < len(rows) else ''}"
                )
    ideal = 3 * args.latency
    print(f"\n{args.episodes} episodes x 3 turns, {args.latency:.1f} s per request, {os.cpu_count()} CPU cores")
    print(f"| client | time (s) | speedup over sequential | overhead vs ideal ({ideal:.1f} s) |\n|---|---|---|---|")
    for name in ("sequential", "ours"):
        print(
            f"| {name} | {timings[name]:.1f} | {timings['sequential'] / timings[name]:.1f}x | "
            f"{100 * (timings[name] / ideal - 1):.1f}% |"
        )


if __name__ == "__main__":
    main()
