"""The command line: one flag per declared setting, its defaults, and the Config it builds."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from operator import attrgetter
from pathlib import Path

import pytest

from mlxgate import cli
from mlxgate.config import Config
from mlxgate.engine import EngineSettings

CLI_DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"

# Every setting away from its default (test_every_flag_round_trips checks that it is).
CHANGED = Config(
    host="0.0.0.0",
    port=9001,
    model=("models/tiny.gguf", "small=models/small"),
    models_config="models.toml",
    max_model_memory=12.5,
    model_ttl=300.0,
    draft_model="models/draft",
    context_length=16384,
    rope_scaling="linear",
    weights="float32",
    no_cpu_kernels=True,
    int8_activations=True,
    trust_remote_code=True,
    model_aliases={"claude-local": "tiny", "gpt-local": "tiny"},
    strict_models=True,
    tool_format="qwen3_coder",
    reasoning_format="think",
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    repetition_penalty=1.1,
    repetition_context_size=64,
    sampling_defaults="server",
    engine=EngineSettings(
        max_queued=3,
        max_running=5,
        step_token_budget=512,
        max_step_ratio=2.5,
        max_prefill_tokens=1024,
        max_prefill_chunk=128,
        min_prefill_chunk=8,
        prefix_cache_mb=0,
        kv_memory_gb=2.5,
        kv_bits=8,
        kv_group_size=32,
        prefix_cache_dir="/var/cache/mlxgate",
        prefix_cache_disk_gb=2.5,
        ping_interval_s=2.5,
        stall_timeout_s=1.5,
        max_draft_tokens=12,
        speculation_max_rows=2,
        loop_guard_tokens=200,
    ),
    api_key="sk-test",
    insecure_public=True,
    allowed_hosts=("box.lan", "box"),
    cors_origins=("https://app.example",),
    rate_limit=30.0,
    drain_timeout=4.5,
    resume_window=60.0,
    record_trace="agents.jsonl",
    log_format="json",
    ranks=2,
    pipeline=True,
    rank_timeout=9.5,
    max_per_client=2,
    max_output_tokens=4096,
    max_body_bytes=1 << 20,
    max_images=4,
    max_image_bytes=1 << 16,
    allow_image_urls=True,
    image_url_timeout=2.5,
    responses_store_mb=16,
    log_level="debug",
)
CHANGED_ARGV = [
    "--host", "0.0.0.0",
    "--port", "9001",
    "--model", "models/tiny.gguf",
    "--model", "small=models/small",
    "--models-config", "models.toml",
    "--max-model-memory", "12.5",
    "--model-ttl", "300",
    "--draft-model", "models/draft",
    "--context-length", "16384",
    "--rope-scaling", "linear",
    "--weights", "float32",
    "--no-cpu-kernels",
    "--int8-activations",
    "--trust-remote-code",
    "--model-alias", "claude-local=tiny",
    "--model-alias", "gpt-local=tiny",
    "--strict-models",
    "--tool-format", "qwen3_coder",
    "--reasoning-format", "think",
    "--temperature", "0.7",
    "--top-p", "0.9",
    "--top-k", "40",
    "--repetition-penalty", "1.1",
    "--repetition-context-size", "64",
    "--sampling-defaults", "server",
    "--max-queued", "3",
    "--max-running", "5",
    "--step-token-budget", "512",
    "--max-step-ratio", "2.5",
    "--max-prefill-tokens", "1024",
    "--max-prefill-chunk", "128",
    "--min-prefill-chunk", "8",
    "--prefix-cache-mb", "0",
    "--kv-memory-gb", "2.5",
    "--kv-bits", "8",
    "--kv-group-size", "32",
    "--prefix-cache-dir", "/var/cache/mlxgate",
    "--prefix-cache-disk-gb", "2.5",
    "--ping-interval-s", "2.5",
    "--stall-timeout-s", "1.5",
    "--max-draft-tokens", "12",
    "--speculation-max-rows", "2",
    "--loop-guard-tokens", "200",
    "--api-key", "sk-test",
    "--insecure-public",
    "--allowed-hosts", "box.lan,box",
    "--cors-origins", "https://app.example",
    "--rate-limit", "30",
    "--drain-timeout", "4.5",
    "--resume-window", "60",
    "--record-trace", "agents.jsonl",
    "--log-format", "json",
    "--ranks", "2",
    "--pipeline",
    "--rank-timeout", "9.5",
    "--max-per-client", "2",
    "--max-output-tokens", "4096",
    "--max-body-bytes", "1048576",
    "--max-images", "4",
    "--max-image-bytes", "65536",
    "--allow-image-urls",
    "--image-url-timeout", "2.5",
    "--responses-store-mb", "16",
    "--log-level", "debug",
]  # fmt: skip


def setting_paths(cls: type = Config, prefix: str = "") -> Iterator[str]:
    """Every setting as a dotted path, nested dataclasses walked into."""
    for field in dataclasses.fields(cls):
        default = getattr(cls(), field.name)
        if dataclasses.is_dataclass(default):
            yield from setting_paths(type(default), f"{prefix}{field.name}.")
        else:
            yield prefix + field.name


def serve_parser() -> argparse.ArgumentParser:
    (commands,) = (a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = commands.choices["serve"]
    return parser


def test_every_setting_has_a_flag_with_help() -> None:
    flags = {a.dest: a for a in serve_parser()._actions if a.dest != "help"}
    assert sorted(flags) == sorted(setting_paths())
    for path, action in flags.items():
        assert action.help and len(action.help) > len("(default: x)"), path
        assert action.option_strings, path


def test_parser_defaults_are_the_dataclass_defaults() -> None:
    parser, defaults = serve_parser(), Config()
    for path in setting_paths():
        assert parser.get_default(path) == attrgetter(path)(defaults), path
    assert cli.parse_config([]) == defaults  # `mlxgate` with no subcommand serves the defaults
    assert cli.parse_config(["serve"]) == defaults


def test_every_flag_round_trips() -> None:
    defaults = Config()
    for path in setting_paths():
        assert attrgetter(path)(CHANGED) != attrgetter(path)(defaults), path
    assert cli.parse_config(CHANGED_ARGV) == CHANGED
    assert cli.parse_config(["serve", *CHANGED_ARGV]) == CHANGED


@pytest.mark.parametrize(
    "argv",
    [
        ["--model-alias", "a=one", "--model-alias", "a=two"],
        ["--model-alias", "no-equals-sign"],
        ["--log-level", "loud"],
        ["--max-queued", "many"],
        ["--tool-format", "json"],
        ["--rope-scaling", "ntk"],
        ["--context-length", "32k"],
    ],
)
def test_bad_command_lines_are_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.parse_config(argv)
    assert exited.value.code == 2
    assert "usage: mlxgate serve" in capsys.readouterr().err


def test_an_alias_given_twice_is_named_in_the_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.parse_config(["--model-alias", "a=one", "--model-alias", "a=two"])
    assert "argument --model-alias: 'a' is given twice" in capsys.readouterr().err


def test_the_env_round_trips_the_nested_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXGATE_CONFIG", "")  # restored after the test; empty: the defaults
    assert Config.from_env() == Config()
    for config in (CHANGED, Config()):
        config.to_env()
        assert Config.from_env() == config
        assert isinstance(Config.from_env().engine, EngineSettings)


def test_the_cli_doc_shows_the_current_help(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        cli.parse_config(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert shown in " ".join(CLI_DOC.read_text().split()), (
        "docs/cli.md's flag list is stale: paste `COLUMNS=100 mlxgate serve --help` into it"
    )


def test_the_command_line_does_not_import_mlx() -> None:
    """`mlxgate --help` and granian's main process stay fast: only the worker loads MLX."""
    code = "import json, sys, mlxgate.cli; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert [m for m in json.loads(out.stdout) if m.split(".")[0] in ("mlx", "mlx_lm")] == []
