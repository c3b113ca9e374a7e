"""run.sh's GPU layout, on a CPU: a fake nvidia-smi, and a fake `vllm` that records how it was launched
and serves the vLLM 0.33 stand-in. torchrun then trains 2 gloo ranks with FSDP2 against it. Then how run.sh and
the benchmarks stop what they started: a clean stop under torchrun, and no server process left behind."""

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

import mt_grpo_trainer as M
from conftest import free_ports, vllm_api_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_bin(tmp_path, vllm_body: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(
        '#!/bin/sh\ncase "$1" in --query-gpu=memory.total) echo "${FAKE_GPU_MIB:-81559}"; exit;; esac\n'
        "echo 'GPU 0: Fake (UUID: GPU-0)'\necho 'GPU 1: Fake (UUID: GPU-1)'\n"
        "echo 'GPU 2: Fake (UUID: GPU-2)'\n"
    )
    (bin_dir / "vllm").write_text(vllm_body)
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def sh_env(tmp_path, bin_dir, port, extra_env=None):
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "MTGRPO_REQUIREMENTS": "requirements.txt",
        "MTGRPO_VLLM": str(bin_dir / "vllm"),
        "MTGRPO_VLLM_PORT": str(port),
        "MTGRPO_VLLM_START_TIMEOUT": "60",
        "MTGRPO_VLLM_LOG": str(tmp_path / "vllm.log"),
        "MTGRPO_VENV": os.path.dirname(os.path.dirname(sys.executable)),
        "OMP_NUM_THREADS": "1",
        **(extra_env or {}),
    }


def run_sh(tmp_path, bin_dir, port, *args, timeout=300, extra_env=None):
    return subprocess.run(
        ["bash", "run.sh", *args],
        cwd=ROOT,
        env=sh_env(tmp_path, bin_dir, port, extra_env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_gpu_layout_serves_vllm_and_trains_under_torchrun(tiny_model_dir, tmp_path):
    record = tmp_path / "vllm_launch.json"
    bin_dir = fake_bin(
        tmp_path,
        f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
json.dump({{"argv": args, "dev_mode": os.environ.get("VLLM_SERVER_DEV_MODE"),
           "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}}, open({str(record)!r}, "w"))
assert args[0] == "serve"
opt = {{a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}}  # a flag: the word after it
cmd = [sys.executable, {os.path.join(ROOT, "tests", "vllm_standin.py")!r}, "--model", args[1], "--port", opt["--port"],
       "--max-model-len", opt["--max-model-len"]] + ([] if os.environ.get("VLLM_SERVER_DEV_MODE") == "1" else ["--no-dev-mode"])
os.execv(sys.executable, cmd)
""",
    )
    port = M.free_port()
    run = tmp_path / "run"
    r = run_sh(
        tmp_path,
        bin_dir,
        port,
        "hf_recipes/toy/toy-kv--mt-grpo.yaml",
        f"model_name_or_path={tiny_model_dir}",
        "model_builder=",
        "vllm_gpus=2",
        "train_gpus=0,1",
        "fsdp=true",
        "max_steps=2",
        "prompts_per_step=2",
        "num_generations=2",
        "max_tokens=12",
        "save_steps=0",
        f"output_dir={run}",
        f"weight_sync_dir={tmp_path}/shm",
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    launch = json.loads(record.read_text())
    assert launch["dev_mode"] == "1" and launch["gpus"] == "2"
    argv = launch["argv"]
    assert argv[1] == tiny_model_dir and argv[argv.index("--max-model-len") + 1] == "512"
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs" and "--enable-prefix-caching" in argv
    assert "torchrun: 2 training rank(s) on GPU(s) 0,1" in r.stdout
    metrics = [json.loads(x) for x in open(run / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [0, 1, 2], "the evaluation at step 0 logged once, by rank 0"
    assert all(m["time/weight_sync"] > 0 for m in metrics[1:])
    assert (run / "checkpoint-2" / "model.safetensors").is_file()
    assert not port_open(port), "run.sh stops the server when training ends"


def test_a_server_that_dies_at_start_is_a_readable_error(tmp_path, tiny_model_dir):
    bin_dir = fake_bin(tmp_path, "#!/bin/sh\necho 'CUDA error: no kernel image is available' >&2\nexit 1\n")
    r = run_sh(
        tmp_path,
        bin_dir,
        M.free_port(),
        "hf_recipes/toy/toy-kv--mt-grpo.yaml",
        f"model_name_or_path={tiny_model_dir}",
        "train_gpus=0,1",
        f"output_dir={tmp_path}/run",
        timeout=120,
        extra_env={"MTGRPO_VLLM_LOG": str(tmp_path / "new-folder" / "vllm.log")},  # run.sh makes the log's folder
    )
    assert r.returncode != 0 and "[run.sh] layout: local" not in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert "the vLLM server exited before it was healthy" in r.stderr and "no kernel image" in r.stderr


def test_a_bad_recipe_fails_before_anything_is_launched(tmp_path):
    bin_dir = fake_bin(tmp_path, f"#!/bin/sh\ntouch {tmp_path}/launched\n")
    r = run_sh(tmp_path, bin_dir, M.free_port(), "hf_recipes/toy/toy-kv--mt-grpo.yaml", "train_gpu=0,1", timeout=120)
    assert (
        r.returncode != 0 and "unknown config key 'train_gpu'" in r.stderr and "did you mean 'train_gpus'" in r.stderr
    )
    assert not (tmp_path / "launched").exists()


def test_a_model_builder_that_does_not_import_is_one_line_before_the_server_starts(tmp_path):
    bin_dir = fake_bin(tmp_path, f"#!/bin/sh\ntouch {tmp_path}/launched\n")
    (tmp_path / "builder.py").write_text("import json\ndef build(:\n")
    r = run_sh(
        tmp_path,
        bin_dir,
        M.free_port(),
        "hf_recipes/toy/toy-kv--mt-grpo.yaml",
        f"model_name_or_path={tmp_path}/m",
        f"model_builder={tmp_path}/builder.py:build",
        timeout=120,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert [
        line for line in r.stderr.splitlines() if line.startswith("mt-grpo: error:")
    ] == r.stderr.strip().splitlines()[-1:]
    assert "builder.py" in r.stderr and "SyntaxError" in r.stderr and not (tmp_path / "launched").exists()


def test_a_model_whose_builder_changed_is_one_line_before_the_server_starts(tmp_path):
    """The server would load the model folder as it is: run.sh checks what built it first (build_report.json)."""
    bin_dir = fake_bin(tmp_path, f"#!/bin/sh\ntouch {tmp_path}/launched\n")
    (tmp_path / "builder.py").write_text("def build(path, system_prompt):\n    open(path + '/weights', 'w').close()\n")
    model = [f"model_name_or_path={tmp_path}/m", f"model_builder={tmp_path}/builder.py:build"]
    M.build_model_if_missing(M.load_config("hf_recipes/toy/toy-kv--mt-grpo.yaml", model), print)
    (tmp_path / "builder.py").write_text("def build(path, system_prompt):\n    pass\n")
    r = run_sh(tmp_path, bin_dir, M.free_port(), "hf_recipes/toy/toy-kv--mt-grpo.yaml", *model, timeout=120)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert f"{tmp_path}/m was built by another model_builder" in r.stderr and "(changed since: builder.py)" in r.stderr
    assert not (tmp_path / "launched").exists()


def test_an_nvidia_smi_that_fails_is_said_not_taken_silently_for_no_gpu(tmp_path):
    bin_dir = fake_bin(tmp_path, f"#!/bin/sh\ntouch {tmp_path}/launched\n")
    (bin_dir / "nvidia-smi").write_text(
        '#!/bin/sh\necho "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."\nexit 9\n'
    )
    r = run_sh(
        tmp_path,
        bin_dir,
        M.free_port(),
        "eval",
        "hf_recipes/toy/toy-kv--mt-grpo.yaml",
        "eval_dataset=",
        f"output_dir={tmp_path}/run",
        timeout=120,
    )
    assert "[run.sh] warning: nvidia-smi -L failed" in r.stderr and "communicate with the NVIDIA driver" in r.stderr
    assert "[run.sh] layout: local, one process (nvidia-smi sees no GPU)" in r.stdout, (
        r.stdout[-2000:] + r.stderr[-2000:]
    )
    assert r.returncode != 0 and "eval needs eval_dataset" in r.stderr and not (tmp_path / "launched").exists()


def test_a_server_that_never_gets_healthy_times_out_readably(tmp_path, tiny_model_dir):
    bin_dir = fake_bin(tmp_path, "#!/bin/sh\necho 'loading weights...'\nexec sleep 600\n")
    r = run_sh(
        tmp_path,
        bin_dir,
        M.free_port(),
        "hf_recipes/toy/toy-kv--mt-grpo.yaml",
        f"model_name_or_path={tiny_model_dir}",
        "train_gpus=0,1",
        f"output_dir={tmp_path}/run",
        timeout=120,
        extra_env={"MTGRPO_VLLM_START_TIMEOUT": "3"},
    )
    assert r.returncode != 0
    assert "was not healthy" in r.stderr and "loading weights..." in r.stderr


def test_a_port_already_serving_is_refused_not_trained_against(tmp_path, tiny_model_dir):
    from tests.vllm_standin import StandinServer

    bin_dir = fake_bin(tmp_path, f"#!/bin/sh\ntouch {tmp_path}/launched\nexec sleep 600\n")
    with StandinServer(tiny_model_dir) as other:
        port = int(other.url.rsplit(":", 1)[1])
        r = run_sh(
            tmp_path,
            bin_dir,
            port,
            "hf_recipes/toy/toy-kv--mt-grpo.yaml",
            f"model_name_or_path={tiny_model_dir}",
            "train_gpus=0,1",
            f"output_dir={tmp_path}/run",
            timeout=120,
        )
    assert r.returncode != 0 and f"a server already answers on port {port}" in r.stderr
    assert not (tmp_path / "launched").exists()


def test_one_gpu_for_vllm_and_training_is_checked_before_launch(tmp_path, tiny_model_dir):
    """vllm_gpus = train_gpus: the server takes vllm_gpu_memory_utilization of the GPU, and run.sh says whether
    training's weights (and, fully fine-tuned, gradients and AdamW) fit in the rest, before it starts anything."""
    bin_dir = fake_bin(tmp_path, "#!/bin/sh\nexit 3\n")  # a server that dies at start: only the check matters here
    # the tiny model has 66,688 parameters: full fine-tuning needs 16 bytes each (1.0 MiB), LoRA 4 (0.25 MiB), and
    # vLLM 2 (bf16); a fake GPU of 1 MiB with half of it for vLLM fits the LoRA run only
    args = (
        "hf_recipes/toy/toy-kv--mt-grpo.yaml",
        f"model_name_or_path={tiny_model_dir}",
        "model_builder=",
        "vllm_gpus=0",
        "train_gpus=0",
        f"output_dir={tmp_path}/run",
    )
    r = run_sh(
        tmp_path, bin_dir, M.free_port(), *args, "vllm_gpu_memory_utilization=0.5", extra_env={"FAKE_GPU_MIB": "1"}
    )
    assert r.returncode != 0 and "error: training needs" in r.stderr and "set lora_rank" in r.stderr, (
        r.stdout + r.stderr
    )
    assert "vLLM serves" not in r.stdout, "nothing was launched"
    lora = run_sh(
        tmp_path,
        bin_dir,
        M.free_port(),
        *args,
        "vllm_gpu_memory_utilization=0.5",
        "lora_rank=4",
        extra_env={"FAKE_GPU_MIB": "1"},
    )
    assert "GPU 0 is shared: vLLM takes 0.0 GiB" in lora.stdout and "error: training needs" not in lora.stderr
    assert "exited before it was healthy" in lora.stderr, (
        "LoRA fits (no gradients or AdamW for the base): the launch goes on"
    )
    tight = run_sh(
        tmp_path,
        bin_dir,
        M.free_port(),
        *args,
        "vllm_gpu_memory_utilization=0.0001",
        "lora_rank=4",
        extra_env={"FAKE_GPU_MIB": "1"},
    )
    assert (
        "cannot hold the model's bf16 weights" in tight.stderr and "raise vllm_gpu_memory_utilization" in tight.stderr
    )


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_sigterm_or_ctrl_c_to_run_sh_under_torchrun_saves_and_exits_0(tmp_path, tiny_model_dir, sig):
    """A clean stop of the server layout: the ranks get the signal (torchrun, signalled, would exit 1 with a
    traceback), finish the step, save, and torchrun exits 0."""
    from tests.vllm_standin import StandinServer

    run = tmp_path / "run"
    with StandinServer(tiny_model_dir) as srv:
        p = subprocess.Popen(
            [
                "bash",
                "run.sh",
                "hf_recipes/toy/toy-kv--mt-grpo.yaml",
                "--server-url",
                srv.url,
                f"model_name_or_path={tiny_model_dir}",
                "model_builder=",
                f"output_dir={run}",
                "max_steps=500",
                f"weight_sync_dir={tmp_path}/shm",
                "prompts_per_step=2",
                "num_generations=2",
                "max_tokens=8",
                "eval_steps=0",  # each line of metrics.jsonl a trained step
            ],
            cwd=ROOT,
            env=sh_env(tmp_path, tmp_path, M.free_port(), {"MTGRPO_LAYOUT": "server"}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            deadline = time.time() + 120
            while (
                time.time() < deadline
                and p.poll() is None
                and not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text())
            ):
                time.sleep(0.2)
            p.send_signal(getattr(signal, sig))
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    steps = len((run / "metrics.jsonl").read_text().splitlines())
    assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert f"{sig}: stopped after step {steps}" in out and (run / f"checkpoint-{steps}" / "trainer_state.pt").is_file()


def group_of(pgid: int, wait: float = 0) -> list[int]:
    """The live processes of a process group, read from /proc; with `wait`, once it is empty or `wait` s have passed."""
    deadline = time.time() + wait
    while True:
        pids = []
        for d in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                with open(f"/proc/{d}/stat") as f:
                    state, _, group = f.read().rsplit(")", 1)[1].split()[:3]
                if int(group) == pgid and state != "Z":
                    pids.append(int(d))
        if not pids or time.time() > deadline:
            return pids
        time.sleep(0.5)


def vllm_group(server) -> tuple[int, int]:
    """The API server run.sh started (found by the test's unique port) and its process group, checked to hold more
    than the API server (vLLM's EngineCore), so that the test below proves something."""
    api = vllm_api_process(server.url.rsplit(":", 1)[1])
    pgid, deadline = os.getpgid(api), time.time() + 30
    while len(group_of(pgid)) < 2 and time.time() < deadline:
        time.sleep(0.5)
    assert len(group_of(pgid)) >= 2, "the server started no EngineCore process"
    return api, pgid


def test_run_sh_stops_the_whole_vllm_server_on_sigterm_and_when_the_server_dies(tiny_model_dir, tmp_path):
    """vLLM's CPU build, started by `bash run.sh serve`: stopping run.sh (SIGTERM) leaves no process of the server's
    group behind, and neither does a server whose API process dies alone (SIGKILL), which left its EngineCore."""
    from conftest import start_real_server

    for case in ("sigterm run.sh", "kill the api server"):
        srv, pgid = start_real_server(tiny_model_dir, tmp_path / f"{case[:4]}.log"), None
        try:
            api, pgid = vllm_group(srv)
            if case == "sigterm run.sh":
                srv.proc.send_signal(signal.SIGTERM)
            else:
                os.kill(api, signal.SIGKILL)
            srv.proc.communicate(timeout=60)
            left = {p: open(f"/proc/{p}/cmdline", "rb").read()[:80] for p in group_of(pgid, wait=30)}
            assert not left, f"{case}: run.sh left these processes of the server behind: {left}"
        finally:  # whatever the test found, nothing it started outlives it
            for group in {srv.proc.pid, pgid} - {None}:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
            srv.proc.wait()


def test_no_server_outlives_a_run_sh_killed_outright(tmp_path, tiny_model_dir):
    """SIGKILL runs no trap: run.sh's watcher in each server's process group stops that server (here two stand-ins
    behind a fake `vllm serve`, one per GPU of vllm_gpus, each with a child of its own) once run.sh is gone."""
    bin_dir = fake_bin(
        tmp_path,
        "#!/bin/sh\nsleep 600 &\nport=$(echo \"$@\" | sed 's/.*--port \\([0-9]*\\).*/\\1/')\n"
        f'exec {sys.executable} {ROOT}/tests/vllm_standin.py --model "$2" --port "$port" --max-model-len 512\n',
    )
    port = free_ports(2)
    p = subprocess.Popen(
        [
            "bash",
            "run.sh",
            "serve",
            "hf_recipes/toy/toy-kv--mt-grpo.yaml",
            f"model_name_or_path={tiny_model_dir}",
            "model_builder=",
            "vllm_gpus=1,2",
            "train_gpus=0",
        ],
        cwd=ROOT,
        env=sh_env(tmp_path, bin_dir, port),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    groups = []
    try:
        assert any(line.startswith("[run.sh] serving at ") for line in p.stdout), "run.sh did not serve"
        for served in (port, port + 1):
            mine = b"\0".join(
                [b"vllm_standin.py", b"--model", tiny_model_dir.encode(), b"--port", str(served).encode()]
            )
            groups.append(
                next(
                    os.getpgid(int(d))
                    for d in filter(str.isdigit, os.listdir("/proc"))
                    if os.path.exists(f"/proc/{d}/cmdline") and mine in open(f"/proc/{d}/cmdline", "rb").read()
                )
            )
        for group in groups:  # a watcher, a stand-in and its child each, apart from run.sh's and each other's
            assert group not in (os.getpgid(p.pid), os.getpgid(0)) and len(group_of(group)) >= 3
        assert groups[0] != groups[1]
        p.kill()
        p.wait(timeout=10)
        assert not any(group_of(group, wait=15) for group in groups), "a server outlived run.sh"
    finally:
        for g in {p.pid, *groups} - {os.getpgid(0)}:  # never this test's own group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(g, signal.SIGKILL)
        p.wait()


STANDIN_VLLM = """#!{python}
import json, os, sys
args = sys.argv[1:]
opt = {{a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}}  # a flag: the word after it
json.dump({{"argv": args, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}}, open(f"{record}-{{opt['--port']}}.json", "w"))
os.execv(sys.executable, [sys.executable, {standin!r}, "--model", args[1], "--port", opt["--port"], "--max-model-len",
         opt["--max-model-len"]])
"""


def test_the_gpu_layout_serves_one_server_per_group_of_vllm_gpus_and_trains_with_all(tiny_model_dir, tmp_path):
    record = tmp_path / "launch"
    body = STANDIN_VLLM.format(
        python=sys.executable, record=record, standin=os.path.join(ROOT, "tests", "vllm_standin.py")
    )
    bin_dir, port, run = fake_bin(tmp_path, body), free_ports(2), tmp_path / "run"
    common = ("hf_recipes/toy/toy-kv--mt-grpo.yaml", f"model_name_or_path={tiny_model_dir}", "model_builder=")
    bad = run_sh(tmp_path, bin_dir, port, *common, "vllm_gpus=0,1,2", "vllm_tensor_parallel_size=2", timeout=120)
    assert bad.returncode != 0 and "vllm_gpus=0,1,2 holds 3 GPU(s), not a multiple of vllm_tensor_parallel_size=2" in (
        bad.stderr
    )
    assert not list(tmp_path.glob("launch-*")), "nothing was launched"
    r = run_sh(
        tmp_path,
        bin_dir,
        port,
        *common,
        "vllm_gpus=1,2",
        "train_gpus=0",
        "max_steps=2",
        "prompts_per_step=4",
        "num_generations=2",
        "max_tokens=12",
        "eval_steps=0",
        f"output_dir={run}",
        f"weight_sync_dir={tmp_path}/shm",
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    launches = [json.loads((tmp_path / f"launch-{p}.json").read_text()) for p in (port, port + 1)]
    assert [(x["gpus"], x["argv"][x["argv"].index("--tensor-parallel-size") + 1]) for x in launches] == [
        ("1", "1"),
        ("2", "1"),
    ], "data parallel: one server per GPU, each on its own port"
    assert r.stdout.count("[run.sh] vLLM is healthy at") == 2 and "torchrun: 1 training rank(s) on GPU(s) 0" in r.stdout
    metrics = [json.loads(x) for x in open(run / "metrics.jsonl")]
    assert all(m["sync/servers_checked"] == 2 for m in metrics), "every sync reached and checked both"
    assert all(sum(m[f"rollout/server{i}_request_share"] for m in metrics) > 0 for i in (0, 1)), "both sampled"
    assert not port_open(port) and not port_open(port + 1), "run.sh stops both servers when training ends"
    p = subprocess.Popen(  # tensor parallel within a group: one server on GPUs 1 and 2
        ["bash", "run.sh", "serve", *common, "vllm_gpus=1,2", "vllm_tensor_parallel_size=2", "train_gpus=0"],
        cwd=ROOT,
        env=sh_env(tmp_path, bin_dir, port),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert any(line.startswith(f"[run.sh] serving at http://127.0.0.1:{port} ") for line in p.stdout)
        launch = json.loads((tmp_path / f"launch-{port}.json").read_text())
        assert launch["gpus"] == "1,2" and launch["argv"][launch["argv"].index("--tensor-parallel-size") + 1] == "2"
    finally:
        p.terminate()
        p.wait(timeout=60)
    assert not port_open(port)


def test_two_nodes_each_run_sh_with_every_servers_url_train_one_run(tiny_model_dir, tmp_path):
    """Several nodes, on one machine: two run.sh, each a node of `torchrun --nnodes 2` with one CPU rank, both given
    the two servers' URLs with --server-url (servers that run elsewhere: each node's `bash run.sh serve`)."""
    from tests.vllm_standin import StandinServer

    run = tmp_path / "run"
    with StandinServer(tiny_model_dir) as a, StandinServer(tiny_model_dir) as b:
        args = [
            "hf_recipes/toy/toy-kv--mt-grpo.yaml",
            "--server-url",
            f"{a.url},{b.url}",
            f"model_name_or_path={tiny_model_dir}",
            "model_builder=",
            "max_steps=2",
            "prompts_per_step=2",
            "num_generations=2",
            "max_tokens=12",
            "eval_steps=0",
            f"output_dir={run}",
            f"weight_sync_dir={tmp_path}/shm",
        ]
        nodes = {"MTGRPO_LAYOUT": "server", "MTGRPO_NNODES": "2", "MTGRPO_MASTER_ADDR": "127.0.0.1"}
        nodes["MTGRPO_MASTER_PORT"] = str(M.free_port())
        alone = run_sh(
            tmp_path,
            tmp_path,
            M.free_port(),
            *[x for x in args if x not in ("--server-url", f"{a.url},{b.url}")],
            extra_env={**nodes, "MTGRPO_NODE_RANK": "0"},
            timeout=120,
        )
        assert alone.returncode != 0 and "MTGRPO_NNODES=2 needs --server-url with every node's servers" in alone.stderr
        procs = [
            subprocess.Popen(
                ["bash", "run.sh", *args],
                cwd=ROOT,
                env=sh_env(tmp_path, tmp_path, M.free_port(), {**nodes, "MTGRPO_NODE_RANK": str(k)}),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            for k in (0, 1)
        ]
        try:
            outs = [p.communicate(timeout=600) for p in procs]
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        sampled = [sum(1 for r in s.requests if r["path"] == "/v1/completions") for s in (a, b)]
    assert all(p.returncode == 0 for p in procs), [o[1][-3000:] for o in outs]
    assert all("torchrun: 1 training rank(s) on the CPU" in out for out, _ in outs)
    metrics = [json.loads(x) for x in open(run / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["sync/servers_checked"] == 2 for m in metrics)
    assert all(n > 0 for n in sampled), "every rank samples from both servers"


def test_a_bench_stopped_by_sigterm_stops_its_servers_and_training_runs_whole_process_groups(tmp_path):
    """bench/async_overlap.py starts every process (`bash run.sh serve`, the stand-in, `bash run.sh --server-url`) in
    `started`: a SIGTERM to the bench's process group, as `timeout` sends, stops each one's whole group too, and the
    groups they started in sessions of their own (here a server with a child process, and a run.sh that starts one
    in a session of its own, as run.sh starts torchrun)."""
    port = M.free_port()
    server = tmp_path / "server.py"
    server.write_text(
        "import http.server, os, subprocess\n"
        f"open({str(tmp_path / 'pids')!r}, 'w').write(f\"{{os.getpid()}} {{subprocess.Popen(['sleep', '600']).pid}}\")\n"
        "class Health(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200)\n"
        "        self.end_headers()\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), Health).serve_forever()\n"
    )
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "run.sh").write_text(f"setsid sleep 600 &\necho $$ $! > {tmp_path / 'train'}\nwait\n")
    bench = (
        f"import sys, time, types\nsys.path.insert(0, 'bench')\nimport async_overlap as B\n"
        f"with B.served([sys.executable, {str(server)!r}], 'http://127.0.0.1:{port}', 120):\n"
        "    print('healthy', flush=True)\n"
        f"    B.ROOT = {str(tmp_path / 'root')!r}\n"
        f"    B.train(types.SimpleNamespace(set=[]), {str(tmp_path / 'run')!r}, server='http://127.0.0.1:{port}')\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", bench], cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    pids, train = [], []
    try:
        assert p.stdout.readline() == "healthy\n"
        pids = [int(x) for x in (tmp_path / "pids").read_text().split()]
        assert group_of(pids[0]) == sorted(pids), "the server and its child form a process group of their own"
        deadline = time.time() + 60
        while len(train) < 2 and time.time() < deadline:
            time.sleep(0.2)
            with contextlib.suppress(FileNotFoundError, ValueError):
                train = [int(x) for x in (tmp_path / "train").read_text().split()]
        assert group_of(train[0]) == train[:1] and group_of(train[1]) == train[1:], "run.sh and its own session"
        os.killpg(p.pid, signal.SIGTERM)
        assert p.wait(timeout=60) == 143
        assert not group_of(pids[0], wait=10), "the bench left its server running"
        assert not group_of(train[0], wait=10) and not group_of(train[1]), "the bench left its training run running"
    finally:
        for group in (p.pid, *pids[:1], *train):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        p.wait()


def test_a_server_for_other_hosts_needs_a_token_or_an_opt_in_that_names_the_risk(tmp_path, tiny_model_dir):
    """MTGRPO_VLLM_HOST beyond loopback: refused in one line naming what it would open, before anything starts; with
    MTGRPO_VLLM_OPEN=1 vLLM binds that address itself (the dev routes open, as chosen); with MTGRPO_VLLM_TOKEN it
    binds it with vllm_token.py's middleware in its app. (The middleware in the real server, from a second host:
    test_real_vllm.)"""
    bin_dir = fake_bin(tmp_path, f'#!/bin/sh\necho "$@" > {tmp_path}/launched\n')
    serve = ["serve", "hf_recipes/toy/toy-kv--mt-grpo.yaml", f"model_name_or_path={tiny_model_dir}", "model_builder="]
    serve += ["vllm_gpus=1", "train_gpus=0"]
    host = {"MTGRPO_VLLM_HOST": "0.0.0.0", "MTGRPO_VLLM_START_TIMEOUT": "5"}
    r = run_sh(tmp_path, bin_dir, M.free_port(), *serve, timeout=120, extra_env=host)
    line = [x for x in r.stderr.splitlines() if "error" in x]
    assert r.returncode == 1 and len(line) == 1 and not (tmp_path / "launched").exists(), r.stderr[-2000:]
    assert all(s in line[0] for s in ("/collective_rpc", "replace the policy's weights", "MTGRPO_VLLM_TOKEN"))
    assert "MTGRPO_VLLM_OPEN=1" in line[0]
    run_sh(tmp_path, bin_dir, M.free_port(), *serve, timeout=120, extra_env={**host, "MTGRPO_VLLM_OPEN": "1"})
    assert "--host 0.0.0.0" in (tmp_path / "launched").read_text()
    assert "--middleware" not in (tmp_path / "launched").read_text()
    (tmp_path / "launched").unlink()
    run_sh(tmp_path, bin_dir, M.free_port(), *serve, timeout=120, extra_env={**host, "MTGRPO_VLLM_TOKEN": "t"})
    assert "--middleware vllm_token.TokenCheck" in (tmp_path / "launched").read_text()
    assert "--host 0.0.0.0" in (tmp_path / "launched").read_text()


def recording_python(path, log, version_ok=True):
    """A stand-in for a venv's python that appends each command line to `log` and, for run.sh's version check,
    answers as Python 3.11 (or as 3.12)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f'#!/bin/sh\ncase "$1" in -c) exit {0 if version_ok else 1};; --version) echo Python 3.12.1; exit;; esac\n'
        f'echo "$*" >> {log}\n'
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("gpu", [False, True])
def test_run_sh_takes_torch_from_the_cpu_index_where_there_is_no_gpu(tmp_path, gpu):
    """Plain pip on a CPU-only Linux resolves PyPI's torch==2.13.0 to the CUDA build and ~15 nvidia-* wheels: without
    a GPU run.sh installs torch first, alone, from PyTorch's CPU index, then the rest (torch then is satisfied)."""
    log = tmp_path / "calls"
    recording_python(tmp_path / "venv" / "bin" / "python", log)
    bin_dir = fake_bin(tmp_path, "#!/bin/sh\nexit 1\n")
    if not gpu:
        (bin_dir / "nvidia-smi").unlink()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MTGRPO_VENV": str(tmp_path / "venv")}
    env.pop("MTGRPO_TORCH_INDEX", None)
    env.pop("MTGRPO_REQUIREMENTS", None)
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "run.sh"), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    calls = [line.split() for line in log.read_text().splitlines()]
    installs = [c for c in calls if c[:3] == ["-m", "pip", "install"]]
    if gpu:
        assert len(installs) == 1 and installs[0][-1] == os.path.join(ROOT, "requirements-gpu.txt")
        assert "--index-url" not in installs[0]
    else:
        torch_pin = [c for c in installs if "torch==2.13.0" in c]
        assert len(installs) == 2 and installs[0] == torch_pin[0], installs
        # only the CPU index: with --extra-index-url, one pip cannot reach falls back to PyPI's CUDA build, silently
        assert installs[0][installs[0].index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"
        assert "--no-deps" in installs[0] and "--extra-index-url" not in installs[0]
        assert installs[1][-2:] == ["-r", os.path.join(ROOT, "requirements.txt")]
        assert "--index-url" not in installs[1]
    assert calls[-1] == [os.path.join(ROOT, "mt_grpo_trainer.py"), "--help"]  # run from another folder


@pytest.mark.parametrize("failure", ["index unreachable", "not the cpu build"])
def test_run_sh_says_in_one_line_what_to_do_when_torch_is_not_the_cpu_build(tmp_path, failure):
    """PyTorch's CPU index out of reach (a proxy, no network) fails the torch step; a torch that is not +cpu after the
    install (pip took it from elsewhere) fails the check after it: each one line that says what to do, and the
    requirements are not marked installed, so the next run tries again."""
    log = tmp_path / "calls"
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    pip_rc = 1 if failure == "index unreachable" else 0
    python.write_text(
        '#!/bin/sh\ncase "$1" in\n'
        '  -c) case "$2" in *importlib.metadata*) echo "2.13.0" >&2; exit 1;; esac; exit 0;;\n'
        "  --version) echo Python 3.11.9; exit;;\nesac\n"
        f'echo "$*" >> {log}\n'
        f'case "$*" in *--index-url*) echo "ERROR: No matching distribution found for torch==2.13.0" >&2; exit {pip_rc};; esac\n'
    )
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    bin_dir = fake_bin(tmp_path, "#!/bin/sh\nexit 1\n")
    (bin_dir / "nvidia-smi").unlink()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MTGRPO_VENV": str(tmp_path / "venv")}
    env.pop("MTGRPO_TORCH_INDEX", None)
    env.pop("MTGRPO_REQUIREMENTS", None)
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "run.sh"), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    ours = [line for line in r.stderr.splitlines() if line.startswith("[run.sh]")]
    assert r.returncode == 1 and len(ours) == 1 and r.stderr.splitlines()[-1] == ours[0], r.stderr
    index = "https://download.pytorch.org/whl/cpu"
    installs = [line for line in log.read_text().splitlines() if line.startswith("-m pip install")]
    if failure == "index unreachable":
        assert f"torch did not install from PyTorch's CPU index {index}" in ours[0]
        assert all(w in ours[0] for w in ("HTTPS_PROXY", "MTGRPO_TORCH_INDEX to a mirror", "MTGRPO_TORCH_INDEX= to"))
        assert len(installs) == 1, "nothing else is installed without torch"
    else:
        assert f"{python} has torch 2.13.0, not PyTorch's CPU build (+cpu)" in ours[0], ours[0]
        fix = f"{python} -m pip install --force-reinstall --no-deps --index-url {index} torch==2.13.0"
        assert ours[0].endswith(fix), ours[0]
    assert not (tmp_path / "venv" / ".requirements.sha256").exists()


def test_run_sh_needs_python_3_11_and_says_so_in_one_line(tmp_path):
    log = tmp_path / "calls"
    recording_python(tmp_path / "py312" / "python3", log, version_ok=False)
    env = {**os.environ, "MTGRPO_PYTHON": str(tmp_path / "py312" / "python3"), "MTGRPO_VENV": str(tmp_path / "venv")}
    r = subprocess.run(["bash", "run.sh", "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "needs Python 3.11" in r.stderr and "Python 3.12.1" in r.stderr and "MTGRPO_PYTHON" in r.stderr
    assert not (tmp_path / "venv").exists() and not log.exists()


def test_run_sh_train_recipe_works_as_the_usage_says(tmp_path):
    bin_dir = fake_bin(tmp_path, f"#!/bin/sh\ntouch {tmp_path}/launched\n")
    (bin_dir / "nvidia-smi").unlink()
    r = run_sh(
        tmp_path, bin_dir, M.free_port(), "train", "hf_recipes/toy/toy-kv--mt-grpo.yaml", "train_gpu=0", timeout=120
    )
    assert r.returncode == 1 and "recipe not found" not in r.stderr, r.stderr
    assert "unknown config key 'train_gpu' in the override 'train_gpu=0' on the command line" in r.stderr


def test_a_mistyped_command_is_one_line_with_the_commands_and_the_nearest(tmp_path):
    bin_dir = fake_bin(tmp_path, f"#!/bin/sh\ntouch {tmp_path}/launched\n")
    (bin_dir / "nvidia-smi").unlink()
    r = run_sh(tmp_path, bin_dir, M.free_port(), "evl", timeout=120)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "recipe not found: evl (did you mean 'eval'?)" in r.stderr and "Commands: train, eval" in r.stderr


def test_a_gpu_recipe_on_a_machine_without_a_gpu_says_so_before_any_download(tmp_path):
    bin_dir = fake_bin(tmp_path, f"#!/bin/sh\ntouch {tmp_path}/launched\n")
    (bin_dir / "nvidia-smi").unlink()
    r = run_sh(tmp_path, bin_dir, M.free_port(), "hf_recipes/Qwen/Qwen3-1.7B--mt-grpo-1gpu.yaml", timeout=120)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "is a GPU recipe" in r.stderr and "nvidia-smi sees no GPU" in r.stderr and "mixed_precision=no" in r.stderr
    assert "layout" not in r.stdout and not (tmp_path / "launched").exists()


def test_a_server_url_run_names_its_servers_in_the_header_not_local_one_process(tmp_path):
    bin_dir = fake_bin(tmp_path, f"#!/bin/sh\ntouch {tmp_path}/launched\n")
    (bin_dir / "nvidia-smi").unlink()
    url = f"http://127.0.0.1:{M.free_port()}"
    r = run_sh(
        tmp_path,
        bin_dir,
        M.free_port(),
        "eval",
        "hf_recipes/toy/toy-kv--mt-grpo.yaml",
        "--server-url",
        url,
        "eval_dataset=",
        f"output_dir={tmp_path}/run",
        timeout=120,
    )
    assert f"[run.sh] layout: one process, sampling from the vLLM server(s) at {url}" in r.stdout, r.stdout + r.stderr
    assert "local, one process" not in r.stdout and "eval needs eval_dataset" in r.stderr
