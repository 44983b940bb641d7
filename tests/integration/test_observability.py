"""Traces and metrics of the live server: span tree in the client's trace, Prometheus metrics."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest

from integration.helpers import request, stub

pytestmark = pytest.mark.engine

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN = "b7ad6b7169203331"


def wait_for(cond, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    return cond()


def test_span_tree_continues_the_client_trace_in_memory_and_over_otlp(live_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(live_server.target)
    traceparent = f"00-{TRACE_ID}-{PARENT_SPAN}-01"
    req = request("What is the capital of France?", max_tokens=8)
    req.request_id = "traced-1"
    list(s.Generate(req, timeout=60, metadata=(("traceparent", traceparent),)))

    def memory_tree():  # type: ignore[no-untyped-def]
        spans = [
            sp
            for sp in live_server.memory_spans.get_finished_spans()
            if format(sp.context.trace_id, "032x") == TRACE_ID
        ]
        return spans if len(spans) >= 4 else None

    spans = wait_for(memory_tree)
    assert spans, "no spans in the client's trace"
    by_name = {sp.name: sp for sp in spans}
    rpc = by_name["streambatch.v1.Generation/Generate"]
    assert format(rpc.parent.span_id, "016x") == PARENT_SPAN
    assert rpc.attributes["streambatch.request_id"] == "traced-1"
    assert rpc.attributes["gen_ai.request.max_tokens"] == 8
    assert rpc.attributes["gen_ai.usage.output_tokens"] >= 1
    assert rpc.attributes["streambatch.preemptions"] == 0
    assert rpc.attributes["gen_ai.response.finish_reasons"] in (("stop",), ("length",))
    for phase in ("queue", "prefill", "decode"):
        child = by_name[phase]
        assert child.parent.span_id == rpc.context.span_id
        assert rpc.start_time <= child.start_time <= child.end_time <= rpc.end_time + 1_000_000
    assert by_name["queue"].end_time <= by_name["prefill"].start_time + 1_000
    steps = [
        sp
        for sp in live_server.memory_spans.get_finished_spans()
        if sp.name == "engine.step"
        and any(link.context.span_id == rpc.context.span_id for link in sp.links)
    ]
    assert steps, "no engine.step span links to the call"
    assert all(sp.attributes["streambatch.batch_size"] >= 1 for sp in steps)
    # Prompt text is never recorded by default.
    assert all("France" not in str(v) for sp in spans for v in sp.attributes.values())

    def otlp_tree():  # type: ignore[no-untyped-def]
        got = [sp for sp in live_server.otlp.spans() if sp.trace_id.hex() == TRACE_ID]
        return got if len(got) >= 4 else None

    exported = wait_for(otlp_tree, 15)
    assert exported, "the OTLP receiver saw no spans of the client's trace"
    names = {sp.name: sp for sp in exported}
    rpc_id = names["streambatch.v1.Generation/Generate"].span_id
    assert names["streambatch.v1.Generation/Generate"].parent_span_id.hex() == PARENT_SPAN
    assert all(names[p].parent_span_id == rpc_id for p in ("queue", "prefill", "decode"))


def test_failed_call_span_carries_the_grpc_code(live_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(live_server.target)
    trace_id = "1" * 32
    bad = request("hi", max_tokens=4)
    bad.priority = 9
    with pytest.raises(grpc.RpcError):
        s.Complete(bad, timeout=30, metadata=(("traceparent", f"00-{trace_id}-{'2' * 16}-01"),))
    spans = wait_for(
        lambda: [
            sp
            for sp in live_server.memory_spans.get_finished_spans()
            if format(sp.context.trace_id, "032x") == trace_id
        ]
    )
    assert spans
    assert spans[0].attributes["rpc.grpc.status_code_name"] == "INVALID_ARGUMENT"
    assert spans[0].status.status_code.name == "ERROR"


def scrape(url: str, openmetrics: bool = False) -> str:
    headers = {"Accept": "application/openmetrics-text; version=1.0.0"} if openmetrics else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
        return r.read().decode()


def sample(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)", text, re.M)
    assert m, f"{name}{labels} missing from /metrics"
    return float(m.group(1))


def test_metrics_after_one_call(live_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(live_server.target)
    list(
        s.Generate(
            request("Say hi.", max_tokens=8),
            timeout=60,
            metadata=(("traceparent", f"00-{'3' * 32}-{'4' * 16}-01"),),
        )
    )
    text = scrape(live_server.metrics_url)
    for name in (
        "streambatch_batch_size_count",
        "streambatch_engine_step_seconds_count",
        "streambatch_request_latency_seconds_count",
        "streambatch_time_to_first_token_seconds_count",
        "streambatch_inter_token_latency_seconds_count",
        "streambatch_generated_tokens_total",
        "streambatch_prompt_tokens_total",
        "streambatch_engine_busy_seconds_total",
        "streambatch_engine_busy_ratio",  # the call above stepped within the last 10 s
    ):
        assert sample(text, name) > 0, name
    assert sample(text, "streambatch_queue_time_seconds_count", '{priority="0"}') > 0
    assert sample(text, "streambatch_requests_total", '{code="OK",method="Generate"}') > 0
    for gauge in (
        "streambatch_queue_length",
        "streambatch_running_requests",
        "streambatch_kv_cache_usage_ratio",
        "streambatch_concurrency_limit",
        "streambatch_waiting_requests",
    ):
        assert gauge in text
    assert sample(text, "streambatch_concurrency_limit") == 8
    om = scrape(live_server.metrics_url, openmetrics=True)
    assert re.search(
        r"streambatch_request_latency_seconds_bucket\{.*\} \d+(\.\d+)? "
        r'# \{trace_id="[0-9a-f]{32}"\}',
        om,
    ), "latency histogram carries no trace-id exemplar"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_real_prometheus_scrapes_and_answers_histogram_quantile(live_server) -> None:  # type: ignore[no-untyped-def]
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus is needed (apt-get install prometheus; .ci/run does it)"
    s = stub(live_server.target)
    for i in range(3):
        s.Complete(request(f"Count to {i + 2}.", max_tokens=6), timeout=60)
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n"
            "scrape_configs:\n  - job_name: streambatch\n"
            "    static_configs:\n"
            f"      - targets: ['127.0.0.1:{live_server.server.metrics_port}']\n"
        )
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp}/data",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            query = (
                "histogram_quantile(0.5, sum by (le) (streambatch_request_latency_seconds_bucket))"
            )
            url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode(
                {"query": query}
            )

            def answer():  # type: ignore[no-untyped-def]
                try:
                    with urllib.request.urlopen(url, timeout=5) as r:
                        body = json.loads(r.read())
                except OSError:
                    return None
                result = body.get("data", {}).get("result", [])
                return result if result and result[0]["value"][1] not in ("NaN",) else None

            result = wait_for(answer, 60)
            assert result, "Prometheus gave no histogram_quantile answer"
            assert 0 < float(result[0]["value"][1]) < 60
        finally:
            proc.terminate()
            proc.wait(10)


def test_complete_is_counted_ok_not_cancelled(live_server) -> None:  # type: ignore[no-untyped-def]
    def count(code: str) -> float:
        text = scrape(live_server.metrics_url)
        m = re.search(
            rf'^streambatch_requests_total\{{code="{code}",method="Complete"\}} (\S+)', text, re.M
        )
        return float(m.group(1)) if m else 0.0

    ok, cancelled = count("OK"), count("CANCELLED")
    stub(live_server.target).Complete(request("Hi", max_tokens=2), timeout=60)
    assert count("OK") == ok + 1
    assert count("CANCELLED") == cancelled


def test_prefix_cache_hits_are_reported_to_the_caller_and_counted(live_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(live_server.target)
    # Several full KV blocks of one prompt, sent twice: the second admission finds them cached.
    prompt = "Notes: " + " ".join(f"lantern {i} river {i}." for i in range(60)) + " Summarize."

    def cached() -> float:
        return sample(scrape(live_server.metrics_url), "streambatch_prompt_tokens_cached_total")

    first = list(s.Generate(request(prompt, max_tokens=4), timeout=60))
    # Earlier tests' calls (cancelled streams among them) must be out of the engine: the
    # counter then moves by this call's hits alone, once per admission, not once per token.
    assert wait_for(live_server.engine_idle, 30)
    before = cached()
    second = list(s.Generate(request(prompt, max_tokens=4), timeout=60))
    after = cached()
    hits = second[-1].usage.cached_prompt_tokens
    assert second[-1].usage.prompt_tokens == first[-1].usage.prompt_tokens > 200
    assert hits >= second[-1].usage.prompt_tokens // 2, (hits, second[-1].usage)
    assert after - before == hits, (before, after, hits)
