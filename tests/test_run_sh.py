"""run.sh's GPU layout, on a CPU: a fake nvidia-smi, and a fake `vllm` that records how it was launched
and serves the vLLM 0.33 stand-in. torchrun then trains 2 gloo ranks with FSDP2 against it."""
import json
import os
import socket
import stat
import subprocess
import sys

import mt_grpo_trainer as M

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_bin(tmp_path, vllm_body: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\ncase \"$1\" in --query-gpu=memory.total) echo \"${FAKE_GPU_MIB:-81559}\"; exit;; esac\n"
                                        "echo 'GPU 0: Fake (UUID: GPU-0)'\necho 'GPU 1: Fake (UUID: GPU-1)'\n"
                                        "echo 'GPU 2: Fake (UUID: GPU-2)'\n")
    (bin_dir / "vllm").write_text(vllm_body)
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def run_sh(tmp_path, bin_dir, port, *args, timeout=300, extra_env=None):
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MTGRPO_REQUIREMENTS": "requirements.txt",
           "MTGRPO_VLLM": str(bin_dir / "vllm"), "MTGRPO_VLLM_PORT": str(port), "MTGRPO_VLLM_START_TIMEOUT": "60",
           "MTGRPO_VLLM_LOG": str(tmp_path / "vllm.log"), "MTGRPO_VENV": os.path.dirname(os.path.dirname(sys.executable)),
           "OMP_NUM_THREADS": "1", **(extra_env or {})}
    return subprocess.run(["bash", "run.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_gpu_layout_serves_vllm_and_trains_under_torchrun(tiny_model_dir, tmp_path):
    record = tmp_path / "vllm_launch.json"
    bin_dir = fake_bin(tmp_path, f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
json.dump({{"argv": args, "dev_mode": os.environ.get("VLLM_SERVER_DEV_MODE"),
           "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}}, open({str(record)!r}, "w"))
assert args[0] == "serve"
opt = dict(zip(args[2::2], args[3::2]))
cmd = [sys.executable, {os.path.join(ROOT, "tests", "vllm_standin.py")!r}, "--model", args[1], "--port", opt["--port"],
       "--max-model-len", opt["--max-model-len"]] + ([] if os.environ.get("VLLM_SERVER_DEV_MODE") == "1" else ["--no-dev-mode"])
os.execv(sys.executable, cmd)
""")
    port = M.free_port()
    run = tmp_path / "run"
    r = run_sh(tmp_path, bin_dir, port, "hf_recipes/toy/toy-kv--mt-grpo.yaml", f"model_name_or_path={tiny_model_dir}",
               "model_builder=", "vllm_gpus=2", "train_gpus=0,1", "fsdp=true", "max_steps=2", "prompts_per_step=2",
               "num_generations=2", "max_tokens=12", "save_steps=0", f"output_dir={run}", f"weight_sync_dir={tmp_path}/shm")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    launch = json.loads(record.read_text())
    assert launch["dev_mode"] == "1" and launch["gpus"] == "2"
    argv = launch["argv"]
    assert argv[1] == tiny_model_dir and argv[argv.index("--max-model-len") + 1] == "512"
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs" and "--enable-prefix-caching" in argv
    assert "torchrun: 2 training rank(s) on GPU(s) 0,1" in r.stdout
    metrics = [json.loads(x) for x in open(run / "metrics.jsonl")]
    assert len(metrics) == 2 and all(m["time/weight_sync"] > 0 for m in metrics)
    assert (run / "checkpoint-2" / "model.safetensors").is_file()
    assert not port_open(port), "run.sh stops the server when training ends"


def test_a_server_that_dies_at_start_is_a_readable_error(tmp_path, tiny_model_dir):
    bin_dir = fake_bin(tmp_path, "#!/bin/sh\necho 'CUDA error: no kernel image is available' >&2\nexit 1\n")
    r = run_sh(tmp_path, bin_dir, M.free_port(), "hf_recipes/toy/toy-kv--mt-grpo.yaml",
               f"model_name_or_path={tiny_model_dir}", "train_gpus=0,1", f"output_dir={tmp_path}/run", timeout=120)
    assert r.returncode != 0 and "[run.sh] layout: local" not in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert "the vLLM server exited before it was healthy" in r.stderr and "no kernel image" in r.stderr


def test_a_bad_recipe_fails_before_anything_is_launched(tmp_path):
    bin_dir = fake_bin(tmp_path, f"#!/bin/sh\ntouch {tmp_path}/launched\n")
    r = run_sh(tmp_path, bin_dir, M.free_port(), "hf_recipes/toy/toy-kv--mt-grpo.yaml", "train_gpu=0,1", timeout=120)
    assert r.returncode != 0 and "unknown config key 'train_gpu'" in r.stderr and "did you mean 'train_gpus'" in r.stderr
    assert not (tmp_path / "launched").exists()


def test_an_nvidia_smi_that_fails_is_said_not_taken_silently_for_no_gpu(tmp_path):
    bin_dir = fake_bin(tmp_path, f"#!/bin/sh\ntouch {tmp_path}/launched\n")
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate with "
                                        "the NVIDIA driver.\"\nexit 9\n")
    r = run_sh(tmp_path, bin_dir, M.free_port(), "eval", "hf_recipes/toy/toy-kv--mt-grpo.yaml", "eval_dataset=",
               f"output_dir={tmp_path}/run", timeout=120)
    assert "[run.sh] warning: nvidia-smi -L failed" in r.stderr and "communicate with the NVIDIA driver" in r.stderr
    assert "[run.sh] layout: local, one process (nvidia-smi sees no GPU)" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.returncode != 0 and "eval needs eval_dataset" in r.stderr and not (tmp_path / "launched").exists()


def test_a_server_that_never_gets_healthy_times_out_readably(tmp_path, tiny_model_dir):
    bin_dir = fake_bin(tmp_path, "#!/bin/sh\necho 'loading weights...'\nexec sleep 600\n")
    r = run_sh(tmp_path, bin_dir, M.free_port(), "hf_recipes/toy/toy-kv--mt-grpo.yaml", f"model_name_or_path={tiny_model_dir}",
               "train_gpus=0,1", f"output_dir={tmp_path}/run", timeout=120, extra_env={"MTGRPO_VLLM_START_TIMEOUT": "3"})
    assert r.returncode != 0
    assert "was not healthy" in r.stderr and "loading weights..." in r.stderr


def test_a_port_already_serving_is_refused_not_trained_against(tmp_path, tiny_model_dir):
    from tests.vllm_standin import StandinServer
    bin_dir = fake_bin(tmp_path, f"#!/bin/sh\ntouch {tmp_path}/launched\nexec sleep 600\n")
    with StandinServer(tiny_model_dir) as other:
        port = int(other.url.rsplit(":", 1)[1])
        r = run_sh(tmp_path, bin_dir, port, "hf_recipes/toy/toy-kv--mt-grpo.yaml", f"model_name_or_path={tiny_model_dir}",
                   "train_gpus=0,1", f"output_dir={tmp_path}/run", timeout=120)
    assert r.returncode != 0 and f"a server already answers on port {port}" in r.stderr
    assert not (tmp_path / "launched").exists()


def test_one_gpu_for_vllm_and_training_is_checked_before_launch(tmp_path, tiny_model_dir):
    """vllm_gpus = train_gpus: the server takes vllm_gpu_memory_utilization of the GPU, and run.sh says whether
    training's weights (and, fully fine-tuned, gradients and AdamW) fit in the rest, before it starts anything."""
    bin_dir = fake_bin(tmp_path, "#!/bin/sh\nexit 3\n")   # a server that dies at start: only the check matters here
    # the tiny model has 66,688 parameters: full fine-tuning needs 16 bytes each (1.0 MiB), LoRA 4 (0.25 MiB), and
    # vLLM 2 (bf16); a fake GPU of 1 MiB with half of it for vLLM fits the LoRA run only
    args = ("hf_recipes/toy/toy-kv--mt-grpo.yaml", f"model_name_or_path={tiny_model_dir}", "model_builder=",
            "vllm_gpus=0", "train_gpus=0", f"output_dir={tmp_path}/run")
    r = run_sh(tmp_path, bin_dir, M.free_port(), *args, "vllm_gpu_memory_utilization=0.5", extra_env={"FAKE_GPU_MIB": "1"})
    assert r.returncode != 0 and "error: training needs" in r.stderr and "set lora_rank" in r.stderr, r.stdout + r.stderr
    assert "vLLM serves" not in r.stdout, "nothing was launched"
    lora = run_sh(tmp_path, bin_dir, M.free_port(), *args, "vllm_gpu_memory_utilization=0.5", "lora_rank=4",
                  extra_env={"FAKE_GPU_MIB": "1"})
    assert "GPU 0 is shared: vLLM takes 0.0 GiB" in lora.stdout and "error: training needs" not in lora.stderr
    assert "exited before it was healthy" in lora.stderr, "LoRA fits (no gradients or AdamW for the base): the launch goes on"
    tight = run_sh(tmp_path, bin_dir, M.free_port(), *args, "vllm_gpu_memory_utilization=0.0001", "lora_rank=4",
                   extra_env={"FAKE_GPU_MIB": "1"})
    assert "cannot hold the model's bf16 weights" in tight.stderr and "raise vllm_gpu_memory_utilization" in tight.stderr
