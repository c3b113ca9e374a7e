"""Weight-sync time against model size, through the filesystem path, against the vLLM 0.33 stand-in.

    .venv/bin/python bench/weight_sync.py [--sizes 25 100 400] [--dir /dev/shm/mt-grpo-bench]

For each size (millions of parameters, a Qwen3-architecture model), rank 0's part is timed as the
trainer runs it: gather the state dict, write bf16 safetensors to a fresh folder, then pause ->
/collective_rpc reload_weights -> /reset_prefix_cache -> resume. The stand-in's reload reads the
safetensors into its CPU model, as vLLM's layerwise reload reads them onto the GPU. Reported:
seconds for the write, for the server calls (mostly the reload), total, and GB/s of bf16 weights.
"""

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mt_grpo_trainer as M  # noqa: E402
from tests.vllm_standin import StandinServer  # noqa: E402


def model_of(millions: int, tmp: str):
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    from tokenizers import Tokenizer, models

    hidden = {25: 512, 100: 1024, 400: 1536}.get(millions, 512)
    layers = max(1, round((millions * 1e6 - 2 * 32000 * hidden) / (12 * hidden * hidden)))
    cfg = Qwen3Config(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        head_dim=64,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    path = os.path.join(tmp, f"model-{millions}m")
    model.save_pretrained(path)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")), eos_token="<unk>"
    )
    tok.save_pretrained(path)
    return model, path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[25, 100, 400])
    ap.add_argument("--dir", default="/dev/shm/mt-grpo-bench" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sync_dir = args.dir or os.path.join(tmp, "sync")
        for millions in args.sizes:
            model, path = model_of(millions, tmp)
            n = sum(p.numel() for p in model.parameters())
            with StandinServer(path) as srv:
                cfg = M.load_config(
                    None, [f"vllm_server_url={srv.url}", f"weight_sync_dir={sync_dir}", f"output_dir={tmp}/run"]
                )
                client = M.VLLMServerClient(cfg, 32000)
                best = None
                for k in range(args.repeats):
                    t0 = time.perf_counter()
                    sd, _ = M.full_state(model)
                    real = client.request  # split the write from the server calls
                    marks = []
                    client.request = lambda *a, **kw: (marks.append(time.perf_counter()), real(*a, **kw))[1]
                    client.sync_weights(model, sd, version=k + 1)
                    client.request = real
                    t1 = time.perf_counter()
                    write, server = marks[0] - t0, t1 - marks[0]
                    best = min(best or (1e9, 0, 0), (t1 - t0, write, server))
                assert srv.reloads == args.repeats
                client.cleanup()
            total, write, server = best
            rows.append((millions, n, write, server, total, 2 * n / total / 1e9))
            print(f"{n / 1e6:.0f}M params: write {write:.2f} s, server {server:.2f} s, total {total:.2f} s", flush=True)
    print(f"\nfilesystem weight sync ({sync_dir}), best of {args.repeats}, {os.cpu_count()} CPU cores")
    print("| params | bf16 size | write (s) | pause/reload/resume (s) | total (s) | GB/s |\n|---|---|---|---|---|---|")
    for _, n, write, server, total, gbs in rows:
        print(f"| {n / 1e6:.0f}M | {2 * n / 1e9:.2f} GB | {write:.2f} | {server:.2f} | {total:.2f} | {gbs:.2f} |")


if __name__ == "__main__":
    main()
