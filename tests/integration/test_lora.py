"""LoRA adapters through streambatch: `streambatch serve --lora NAME=PATH` with a randomly
initialised adapter for the default model, made here with peft, served by a real server in its
own process over real gRPC."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from streambatch.v1 import generation_pb2 as pb

from integration.helpers import (
    free_port,
    request,
    run_stream,
    spawn_server,
    stop,
    stub,
    wait_serving,
)

pytestmark = pytest.mark.engine


def make_adapter(folder: Path) -> Path:
    """A rank-4 LoRA on the attention projections with random A and B (peft's default zeroes
    B, which would change nothing). Rank 4 is not one vLLM sizes for: the server rounds up."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pyserver.model import pull_default_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(pull_default_model()), dtype=torch.float32)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    get_peft_model(base, config).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def lora_server(live_server, tmp_path_factory):  # type: ignore[no-untyped-def]
    # live_server is idle while these run; the second engine gets the CPU to itself.
    folder = make_adapter(tmp_path_factory.mktemp("adapter") / "random-lora")
    log = tmp_path_factory.mktemp("lora-log") / "server.log"
    port = free_port()
    proc = spawn_server(port, log, "--lora", f"noisy={folder}")
    try:
        wait_serving(grpc.insecure_channel(f"127.0.0.1:{port}"), proc, log)
        yield f"127.0.0.1:{port}"
    finally:
        stop(proc)


def test_the_adapter_is_advertised_and_changes_greedy_output(lora_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(lora_server)
    info = s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert list(info.adapters) == ["noisy"] and "lora" in info.features
    base = s.Complete(request("The capital of France is", chat=False, max_tokens=12), timeout=60)
    req = request("The capital of France is", chat=False, max_tokens=12)
    req.adapter = "noisy"
    adapted = s.Complete(req, timeout=60)
    assert adapted.usage.completion_tokens >= 1
    assert list(adapted.tokens) != list(base.tokens), (base.text, adapted.text)
    # Deterministic per adapter: the same call again gives the same tokens.
    assert list(s.Complete(req, timeout=60).tokens) == list(adapted.tokens)


def test_base_and_adapter_calls_run_in_the_same_engine_steps(lora_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(lora_server)
    results: dict[str, object] = {}

    def call(name: str) -> None:
        req = request(f"Write a long story ({name}).", max_tokens=200, ignore_eos=True)
        req.adapter = name if name != "base" else ""
        results[name] = run_stream(s, req)

    threads = [threading.Thread(target=call, args=(n,)) for n in ("base", "noisy")]
    for t in threads:
        t.start()
    both_running = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        # The engine steps every running request each step: two running at once, one of them
        # on the adapter, is a step that mixes base and adapter rows.
        if s.GetLoad(pb.GetLoadRequest(), timeout=5).running == 2:
            both_running = True
            break
        time.sleep(0.05)
    for t in threads:
        t.join(120)
    assert both_running
    for name in ("base", "noisy"):
        r = results[name]
        assert r.code == grpc.StatusCode.OK, (name, r.details)  # type: ignore[attr-defined]
        assert r.last.usage.completion_tokens == 200  # type: ignore[attr-defined]


def test_an_unknown_adapter_is_refused_naming_it_and_the_known_one(lora_server) -> None:  # type: ignore[no-untyped-def]
    req = request("Hi", max_tokens=4)
    req.adapter = "sql-expert"
    r = run_stream(stub(lora_server), req)
    assert r.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sql-expert" in r.details and "noisy" in r.details
