"""Worst-day scenarios on the real engine: cancellation storms, stalled and vanished consumers,
an engine fault, and a short overload burst (the long soak is `make soak`)."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest

from integration.helpers import (
    free_port,
    request,
    run_stream,
    seconds_until,
    spawn_server,
    stop,
    stub,
    wait_serving,
)

pytestmark = pytest.mark.engine


def _settled(live_server) -> bool:  # type: ignore[no-untyped-def]
    w = live_server.worker
    return (
        live_server.engine_idle()
        and w.kv.usage == 0.0
        and w.engine_kv_usage() == 0.0
        and w.queue.size() == 0
    )


def test_cancellation_storm_leaves_no_work_and_frees_kv(live_server) -> None:  # type: ignore[no-untyped-def]
    assert seconds_until(lambda: _settled(live_server), 30) is not None, "not idle before the storm"
    rng = random.Random(11)
    s = stub(live_server.target)
    codes: list[grpc.StatusCode] = []
    received: list[int] = []
    lock = threading.Lock()

    def client(i: int, cancel_after: int) -> None:
        call = s.Generate(request(f"Storm {i}: tell a long tale.", max_tokens=64, ignore_eos=True))
        got = 0
        try:
            for _ in call:
                got += 1
                if got >= cancel_after:
                    call.cancel()
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
        if cancel_after == 0:
            call.cancel()
        with lock:
            codes.append(code)
            received.append(got)

    threads = [
        threading.Thread(target=client, args=(i, rng.choice([0, 1, 2, 3, 5, 8, 13])))
        for i in range(20)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(codes) == 20
    assert all(c == grpc.StatusCode.CANCELLED for c in codes), codes
    settle_s = seconds_until(lambda: _settled(live_server), 1.0)
    assert settle_s is not None, (
        f"1 s after the storm: running={live_server.worker.running} "
        f"kv={live_server.worker.engine_kv_usage()} queued={live_server.worker.queue.size()}"
    )
    print(f"cancellation storm: 20 clients, settled {settle_s * 1e3:.0f} ms after the last cancel")


def test_stalled_reader_does_not_stall_other_streams(live_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(live_server.target)
    stalled = s.Generate(request("Write about rivers.", max_tokens=48, ignore_eos=True))
    first = next(stalled)  # admitted and streaming; now stop reading
    other = run_stream(s, request("Name three colors.", max_tokens=24, ignore_eos=True))
    assert other.code == grpc.StatusCode.OK and other.last.usage.completion_tokens == 24
    # The stalled stream finished in the engine meanwhile and frees its slot; its data waits.
    assert seconds_until(lambda: live_server.worker.running == 0, 30) is not None
    rest = list(stalled)
    assert rest[-1].usage.completion_tokens == 48
    streamed = len(first.token_ids) + sum(len(m.token_ids) for m in rest)
    assert streamed == 48, "a stalled reader lost tokens"


VANISHING_CLIENT = textwrap.dedent(
    """
    import sys, grpc
    from streambatch.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
    req = pb.GenerateRequest(text="Once upon a time")
    req.sampling.max_tokens = 1500
    req.sampling.ignore_eos = True
    call = pb_grpc.GenerationStub(grpc.insecure_channel(sys.argv[1])).Generate(req)
    next(call)
    print("streaming", flush=True)
    sys.stdin.read()  # hold the stream open until killed
    """
)


def test_vanished_client_is_noticed_and_aborted(live_server) -> None:  # type: ignore[no-untyped-def]
    assert seconds_until(lambda: _settled(live_server), 30) is not None
    proc = subprocess.Popen(
        [sys.executable, "-c", VANISHING_CLIENT, live_server.target],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"streaming"
        assert live_server.worker.running == 1
        proc.send_signal(signal.SIGKILL)  # no cancel, no goodbye: the socket just closes
        proc.wait(10)
        gone_s = seconds_until(lambda: _settled(live_server), 5.0)
        assert gone_s is not None, "the engine kept generating for a client that vanished"
        print(f"vanished client: aborted {gone_s * 1e3:.0f} ms after its process died")
    finally:
        stop(proc)  # type: ignore[arg-type]


def test_overload_burst_ends_every_call_precisely(live_server) -> None:  # type: ignore[no-untyped-def]
    """~3x what the queue and engine hold, at once: each call completes or is refused with
    RESOURCE_EXHAUSTED (with a retry hint); none hangs; health answers throughout."""
    from grpc_health.v1 import health_pb2

    from integration.helpers import health_status

    s = stub(live_server.target)
    results = []
    lock = threading.Lock()
    health: list[int | None] = []
    done = threading.Event()

    def probe() -> None:
        ch = grpc.insecure_channel(live_server.target)
        while not done.is_set():
            health.append(health_status(ch))
            time.sleep(0.2)

    def client(i: int) -> None:
        r = run_stream(s, request(f"Burst {i}", max_tokens=8, ignore_eos=True), timeout=180)
        with lock:
            results.append(r)

    prober = threading.Thread(target=probe)
    prober.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(96)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    done.set()
    prober.join()
    assert len(results) == 96, "a call hung"
    codes = [r.code for r in results]
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, set(codes)
    refused = [r for r in results if r.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert refused and all(int(r.trailers["retry-after-ms"]) > 0 for r in refused)
    assert all(r.last.usage.completion_tokens == 8 for r in results if r.code.name == "OK")
    assert health and all(h == health_pb2.HealthCheckResponse.SERVING for h in health), health


def test_engine_fault_ends_every_stream_unavailable_and_exits(live_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    target = f"127.0.0.1:{port}"
    log = tmp_path / "server.log"
    proc = spawn_server(port, log, fault_after_steps=25)
    try:
        wait_serving(grpc.insecure_channel(target), proc, log)
        s = stub(target)
        last_msg: list[float] = []
        ended: list[tuple[grpc.StatusCode, float]] = []
        lock = threading.Lock()

        def client(i: int) -> None:
            # 6 calls on a 4-sequence engine: 4 run, 2 wait in the queue.
            call = s.Generate(request(f"Fault {i}", max_tokens=200, ignore_eos=True), timeout=120)
            seen = 0.0
            try:
                for _ in call:
                    seen = time.monotonic()
                code = grpc.StatusCode.OK
            except grpc.RpcError as err:
                code = err.code()
            with lock:
                last_msg.append(seen)
                ended.append((code, time.monotonic()))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        assert len(ended) == 6, "a client hung after the engine fault"
        assert [c for c, _ in ended] == [grpc.StatusCode.UNAVAILABLE] * 6, ended
        # The fault struck on the step after the last one that produced tokens.
        fault_at = max(last_msg)
        lag = max(t for _, t in ended) - fault_at
        assert lag < 1.0, f"streams ended {lag:.2f} s after the fault"
        assert proc.wait(60) == 1, "the server should exit 1 for its supervisor"
        assert "injected fault" in log.read_text(errors="replace")
        print(f"engine fault: 6 calls ended UNAVAILABLE within {lag * 1e3:.0f} ms; exit 1")
    finally:
        stop(proc)


def test_a_request_the_engine_refuses_fails_alone(live_server) -> None:  # type: ignore[no-untyped-def]
    """vLLM validates requests itself (VLLMValidationError) on add_request; such a refusal must
    end that one call INVALID_ARGUMENT, not fail the engine for everyone. An empty prompt,
    which the servicer never lets through, is one vLLM refuses."""
    import asyncio

    from pyserver.domain import ErrorKind, Mailbox, Sampling, WorkItem

    worker = live_server.worker

    async def submit_and_wait():  # type: ignore[no-untyped-def]
        box = Mailbox()
        worker.submit(
            WorkItem(
                handle=worker.new_handle(),
                request_id="refused-by-engine",
                prompt_token_ids=[],
                sampling=Sampling(max_tokens=2),
                priority=0,
                deadline_ns=0,
                accepted_ns=time.monotonic_ns(),
                mailbox=box,
            )
        )
        return await asyncio.wait_for(box.get(), 30)

    delta = asyncio.run_coroutine_threadsafe(submit_and_wait(), live_server.loop).result(60)
    assert delta.error is not None and delta.error.kind == ErrorKind.INVALID, delta
    assert "prompt" in delta.error.message
    assert worker.failed is None
    assert stub(live_server.target).Complete(request("Say hi.", max_tokens=2), timeout=60).tokens
