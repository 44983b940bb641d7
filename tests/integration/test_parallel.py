"""vLLM's own parallelism through streambatch on the CPU: tensor parallelism over two ranks
(processes, one core each) gives the greedy output of one rank, over real gRPC; pipeline
parallelism, which vLLM's CPU backend fails, is refused at start with one line."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from streambatch.v1 import generation_pb2 as pb

from integration.helpers import free_port, refusal_line, spawn_server, stop, stub, wait_serving

pytestmark = pytest.mark.engine

PROMPTS = ("The capital of France is", "Once upon a time", "def fibonacci(n):")


def make_tiny_llama(folder: Path) -> Path:
    """A random-weight Llama with 4 attention heads (2 divides them; the default model's 9 it
    does not), with the default model's tokenizer, in fp32."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pyserver.model import pull_default_model

    tokenizer = AutoTokenizer.from_pretrained(str(pull_default_model()))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def greedy_tokens(target: str) -> list[list[int]]:
    s = stub(target)
    out = []
    for text in PROMPTS:
        req = pb.GenerateRequest(text=text)
        req.sampling.max_tokens = 16
        req.sampling.temperature = 0.0
        req.sampling.ignore_eos = True
        out.append(list(s.Complete(req, timeout=120).tokens))
    return out


def serve_and_generate(model: Path, log: Path, *flags: str) -> list[list[int]]:
    port = free_port()
    env_bind = os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # streambatch's to choose
    try:
        proc = spawn_server(port, log, "--model", str(model), "--dtype", "float32", *flags)
    finally:
        if env_bind is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = env_bind
    try:
        wait_serving(grpc.insecure_channel(f"127.0.0.1:{port}"), proc, log)
        return greedy_tokens(f"127.0.0.1:{port}")
    finally:
        stop(proc)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")
@pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="CPU parallelism; a GPU runs vLLM's own")
def test_tensor_parallel_2_matches_1(live_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # live_server is idle while this runs; the other engines get the CPU to themselves.
    model = make_tiny_llama(tmp_path / "tiny-llama")
    one = serve_and_generate(model, tmp_path / "tp1.log")
    two = serve_and_generate(model, tmp_path / "tp2.log", "--tensor-parallel-size", "2")
    assert all(len(t) == 16 for t in one)
    assert (
        len({t for tokens in one for t in tokens}) > 3
    )  # not a constant: the match means something
    assert two == one
    log = (tmp_path / "tp2.log").read_text(errors="replace")
    assert "tensor_parallel_size=2" in log
    # Each rank on its own core, as streambatch bound them (vLLM logs its binding).
    cores = sorted(os.sched_getaffinity(0))
    assert f"VLLM_CPU_OMP_THREADS_BIND='{cores[0]}|{cores[1]}'" in log or len(cores) > 2
    assert "local_rank=0, core ids=" in log and "local_rank=1, core ids=" in log


@pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="refused on the CPU only")
def test_pipeline_parallel_on_the_cpu_is_refused_with_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    last = refusal_line(tmp_path / "pp.log", "--pipeline-parallel-size", "2", limit_s=120)
    assert last.startswith("streambatch serve: error: --pipeline-parallel-size"), last
