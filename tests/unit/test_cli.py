"""The serve command's flags: vLLM's bare booleans, and a flag beating vLLM's variables."""

from __future__ import annotations

import os

import pytest

from pyserver.cli import _prepare_engine_env, build_parser

_TOUCHED = (
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_HOST_IP",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "STREAMBATCH_KV_CACHE_GIB",
    "STREAMBATCH_ENGINE_PROCESS",
    "VLLM_CPU_OMP_THREADS_BIND",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """_prepare_engine_env writes os.environ: set-then-delete makes monkeypatch restore each
    variable as it was, whatever the test wrote."""
    for var in _TOUCHED:
        monkeypatch.setenv(var, "x")
        monkeypatch.delenv(var)


def _serve(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["serve", *argv])


def test_a_bare_boolean_flag_means_true_and_a_value_still_works() -> None:
    assert _serve("--enforce-eager", "--max-num-seqs", "4").enforce_eager is True
    assert _serve("--enforce-eager", "false").enforce_eager is False
    assert _serve("--enable-prefix-caching").enable_prefix_caching is True


@pytest.mark.parametrize(
    ("env", "argv", "expected"),
    [
        ({"VLLM_CPU_KVCACHE_SPACE": "3"}, ["--kv-cache-gib", "1"], "1"),  # the flag wins
        ({"VLLM_CPU_KVCACHE_SPACE": "3"}, [], "3"),  # the variable beats the default
        ({}, [], "1"),  # the default
        ({"STREAMBATCH_KV_CACHE_GIB": "2", "VLLM_CPU_KVCACHE_SPACE": "3"}, [], "2"),
    ],
)
def test_kv_cache_flag_beats_vllms_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], argv: list[str], expected: str
) -> None:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    _prepare_engine_env(_serve(*argv))
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == expected


@pytest.mark.parametrize(
    ("env", "argv", "expected"),
    [
        ({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, ["--engine-process", "inproc"], "0"),
        ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, ["--engine-process", "separate"], "1"),
        ({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, [], "1"),
        ({}, [], "0"),
    ],
)
def test_engine_process_flag_beats_vllms_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], argv: list[str], expected: str
) -> None:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    _prepare_engine_env(_serve(*argv))
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == expected


def test_a_separate_engine_core_on_the_cpu_binds_every_usable_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("pyserver.cli.has_cuda_device", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 5})
    _prepare_engine_env(_serve("--engine-process", "inproc"))
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # in-process: torch's own threads
    _prepare_engine_env(_serve("--engine-process", "separate"))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-2,5"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    _prepare_engine_env(_serve("--engine-process", "separate"))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1"  # the operator's binding stays


def test_bind_cores_pins_an_in_process_engine_to_every_usable_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("pyserver.cli.has_cuda_device", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 5})
    _prepare_engine_env(_serve("--engine-process", "inproc", "--bind-cores", "false"))
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    _prepare_engine_env(_serve("--engine-process", "inproc", "--bind-cores"))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-2,5"


def test_vllms_own_engine_flags_pass_through_in_vllms_spelling() -> None:
    from pyserver.engine import parse_vllm_flags

    vllm_only = ["--long-prefill-token-threshold", "64", "--enable-chunked-prefill"]
    args, rest = build_parser().parse_known_args(["serve", "--max-num-seqs", "4", *vllm_only])
    assert args.max_num_seqs == 4  # streambatch's own flag stays streambatch's
    assert parse_vllm_flags(rest) == {
        "long_prefill_token_threshold": 64,
        "enable_chunked_prefill": True,  # a bare boolean, as vLLM spells it
    }


@pytest.mark.parametrize(
    "argv",
    [
        ["--no-such-flag", "1"],
        ["--scheduling-policy", "fcfs"],  # set by streambatch, even to vLLM's default
        ["--additional-config.streambatch.top_priority=0"],
        ["--no-enforce-eager"],  # streambatch's own flag in vLLM's spelling
        ["--max_num_seqs", "64"],
    ],
)
def test_an_unknown_or_reserved_vllm_flag_is_a_usage_error(argv: list[str]) -> None:
    from pyserver.engine import parse_vllm_flags

    with pytest.raises(SystemExit) as exit_info:
        parse_vllm_flags(argv)
    assert exit_info.value.code == 2


def test_other_commands_still_reject_unknown_flags() -> None:
    from pyserver.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["model", "pull", "--no-such-flag"])
    assert exit_info.value.code == 2


def test_lora_flags_name_adapters_and_size_vllms_lora_buffers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from pyserver.engine import EngineOptions
    from pyserver.engine.adapter.build import _engine_args

    small, big = tmp_path / "small", tmp_path / "big"
    for folder, config in ((small, {"r": 4}), (big, {"r": 8, "rank_pattern": {"q_proj": 24}})):
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps(config))
    args = build_parser().parse_args(["serve", "--lora", f"a={small}", "--lora", f"b={big}"])
    assert args.lora == [("a", str(small)), ("b", str(big))]
    kwargs = _engine_args(EngineOptions(model="m", lora_adapters=dict(args.lora)))
    # The largest rank (24, from rank_pattern) rounded up to one vLLM sizes for.
    assert kwargs["enable_lora"] and kwargs["max_lora_rank"] == 32 and kwargs["max_loras"] == 2
    for bad in ("noequals", f"x={tmp_path / 'missing'}", "=path"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--lora", bad])


def test_tensor_parallel_ranks_on_the_cpu_get_a_core_group_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pyserver.cli import UsageError

    monkeypatch.setattr("pyserver.cli.has_cuda_device", lambda: False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 7})
    _prepare_engine_env(_serve("--tensor-parallel-size", "2"))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"  # the odd core left out
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    _prepare_engine_env(_serve("--tensor-parallel-size", "2"))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"  # the operator's binding stays
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # one group for two ranks
    with pytest.raises(UsageError, match="1 core groups for 2 parallel ranks"):
        _prepare_engine_env(_serve("--tensor-parallel-size", "2"))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(UsageError, match="2 parallel ranks need at least 2"):
        _prepare_engine_env(_serve("--tensor-parallel-size", "2"))


def test_pipeline_parallel_on_the_cpu_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyserver.cli import UsageError, main

    monkeypatch.setattr("pyserver.cli.has_cuda_device", lambda: False)
    with pytest.raises(UsageError, match="pipeline-parallel-size"):
        _prepare_engine_env(_serve("--pipeline-parallel-size", "2"))
    assert main(["serve", "--pipeline-parallel-size", "2"]) == 2


@pytest.mark.parametrize("flag", ["--drain-accept-s", "--drain-quiet-s", "--drain-grace-s"])
def test_negative_seconds_are_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    from pyserver.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", flag, "-1"])
    assert exit_.value.code == 2
    assert "expected seconds >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag",
    [
        "--batch-window-ms",
        "--max-wait-ms",
        "--aging-interval-ms",
        "--lifo-after-ms",
        "--oldest-first-after-ms",
        "--lifo-backlog-ms",
    ],
)
@pytest.mark.parametrize("value", ["-1", "nan", "soon", "1e13"])
def test_bad_queue_durations_are_refused_before_the_engine_loads(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pyserver.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", flag, value])
    assert exit_.value.code == 2
    assert "expected milliseconds >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "wanted"),
    [("--preempt-after-ms", v, "(negative: never)") for v in ("nan", "inf", "later", "1e13")]
    + [
        ("--oldest-first-turns", v, "expected a multiple >= 0 and < 1e+06")
        for v in ("-1", "nan", "inf", "twice", "1e6")
    ],
)
def test_a_preemption_delay_and_the_oldest_first_turns_must_be_numbers_in_range(
    flag: str, value: str, wanted: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pyserver.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", flag, value])
    assert exit_.value.code == 2
    assert wanted in capsys.readouterr().err


def test_a_backlog_span_over_an_hour_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pyserver import cli

    monkeypatch.setattr(cli, "_prepare_engine_env", _must_not_run)
    for span in ("3600001", "3600000.4"):
        assert cli.main(["serve", "--lifo-backlog-ms", span]) == 2
        assert f"--lifo-backlog-ms ({span}) must be at most 3600000" in capsys.readouterr().err


def test_an_oldest_first_bound_at_or_below_lifo_after_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pyserver import cli

    # Refused before anything loads: the engine set-up must not be reached.
    monkeypatch.setattr(cli, "_prepare_engine_env", _must_not_run)
    for bound in ("5000", "4000"):
        argv = ["serve", "--lifo-after-ms", "5000", "--oldest-first-after-ms", bound]
        assert cli.main(argv) == 2
        assert "must be above --lifo-after-ms" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--lifo-after-ms", "90000", "--oldest-first-after-ms", "0"],
        ["--lifo-after-ms", "0", "--oldest-first-after-ms", "1"],
        ["--lifo-backlog-ms", "0"],
        ["--lifo-backlog-ms", "250"],
        ["--lifo-backlog-ms", "3600000"],
        ["--preempt-after-ms", "-1"],
        ["--preempt-after-ms=-inf"],
    ],
)
def test_valid_queue_settings_get_past_the_checks(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pyserver import cli

    class Reached(Exception):
        pass

    def reached(*_: object) -> None:
        raise Reached

    monkeypatch.setattr(cli, "_prepare_engine_env", reached)
    with pytest.raises(Reached):
        cli.main(["serve", *argv])


def _must_not_run(*_: object) -> None:
    raise AssertionError("the engine set-up ran")


def test_a_negative_prefix_affinity_is_refused_before_the_engine_loads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pyserver.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--prefix-affinity", "-1"])
    assert exit_.value.code == 2
    assert "expected a count >= 0" in capsys.readouterr().err


def _help(*argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_serve_help_shows_each_default_as_a_user_would_type_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = _help("serve", capsys=capsys)
    assert "--lifo-backlog-ms LIFO_BACKLOG_MS" in text and "(default: 5000)" in text
    assert "(default: 60000)" in text  # --oldest-first-after-ms
    assert "--oldest-first-turns OLDEST_FIRST_TURNS" in text and "(default: 2)" in text
    assert "(default: true)" in text  # --enable-prefix-caching
    # A help that already says its default is not repeated.
    assert "(default: embedded SmolLM2)" in text and text.count("SmolLM2) (default") == 0


def test_help_names_a_default_from_the_environment_without_printing_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STREAMBATCH_TOKEN", "s3cret-value")
    monkeypatch.setenv("STREAMBATCH_QUEUE_CAPACITY", "77")
    text = _help("info", capsys=capsys)
    assert "s3cret" not in text and "(default: $STREAMBATCH_TOKEN)" in text
    text = _help("serve", capsys=capsys)
    assert "(default: $STREAMBATCH_QUEUE_CAPACITY, else 1024)" in text


def test_a_default_with_a_percent_sign_does_not_break_help() -> None:
    import argparse

    from pyserver.cli import _add

    p = argparse.ArgumentParser()
    _add(p, "--some-path", str, "/data/100%", "where")
    assert "(default: /data/100%)" in " ".join(p.format_help().split())


def test_a_choice_flag_shows_its_default_and_refuses_an_unknown_value_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert build_parser().parse_args(["serve"]).deadline_admission == "shadow"
    assert "(default: shadow)" in _help("serve", capsys=capsys)
    monkeypatch.setenv("STREAMBATCH_DEADLINE_ADMISSION", "on")
    assert build_parser().parse_args(["serve"]).deadline_admission == "on"
    assert "(default: $STREAMBATCH_DEADLINE_ADMISSION, else shadow)" in _help(
        "serve", capsys=capsys
    )
    monkeypatch.setenv("STREAMBATCH_DEADLINE_ADMISSION", "bogus")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])
    assert "'bogus' is not one of on, shadow, off" in capsys.readouterr().err
    monkeypatch.delenv("STREAMBATCH_DEADLINE_ADMISSION")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--deadline-admission", "maybe"])
    assert "'maybe' is not one of on, shadow, off" in capsys.readouterr().err


def test_the_choice_flags_offer_what_the_server_accepts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pyserver.engine.deadlines import MODES
    from pyserver.scheduling import METRICS

    text = _help("serve", capsys=capsys)
    for flag, accepted in (
        ("--deadline-admission", MODES),
        ("--controller-metric", METRICS),
        ("--controller-knob", ("concurrency", "step_tokens")),
        ("--engine-process", ("inproc", "separate")),
    ):
        assert f"{flag} {{{','.join(accepted)}}}" in text
