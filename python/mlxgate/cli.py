"""The `mlxgate` command line."""

from __future__ import annotations

import argparse
import sys

from mlxgate.config import Config


def _alias(value: str) -> tuple[str, str]:
    name, _, model = value.partition("=")
    if not name.strip() or not model.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=MODEL, got {value!r}")
    return name.strip(), model.strip()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxgate", description=__doc__)
    commands = parser.add_subparsers(dest="command")
    serve = commands.add_parser("serve", help="serve a model over the Anthropic and OpenAI APIs")
    defaults = Config()
    serve.add_argument(
        "--host", default=defaults.host, help="address to bind (default %(default)s)"
    )
    serve.add_argument("--port", type=int, default=defaults.port, help="port (default %(default)s)")
    serve.add_argument(
        "--model",
        default=None,
        help="a .gguf file, an mlx-lm model directory or a Hugging Face org/repo id "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    serve.add_argument(
        "--model-alias",
        type=_alias,
        action="append",
        default=[],
        metavar="NAME=MODEL",
        help="also answer to NAME: listed in /v1/models and found at /v1/models/NAME; MODEL "
        "names the served model (its name or the --model value). Repeatable",
    )
    serve.add_argument(
        "--strict-models",
        action="store_true",
        help="answer only the served model's name and its aliases; other names get 404 "
        "(default: any model name is answered by the served model)",
    )
    serve.add_argument(
        "--temperature",
        type=float,
        default=defaults.temperature,
        help="sampling temperature for requests that set none; 0 is greedy (default %(default)s)",
    )
    serve.add_argument(
        "--top-p", type=float, default=defaults.top_p, help="default top-p (default %(default)s)"
    )
    serve.add_argument(
        "--top-k",
        type=int,
        default=defaults.top_k,
        help="default top-k, 0 = off (default %(default)s)",
    )
    serve.add_argument(
        "--max-queued",
        type=int,
        default=defaults.max_queued,
        help="requests that may wait (default %(default)s)",
    )
    serve.add_argument(
        "--max-running",
        type=int,
        default=defaults.max_running,
        help="sequences decoded together (default %(default)s)",
    )
    serve.add_argument(
        "--step-token-budget",
        type=int,
        default=defaults.step_token_budget,
        help="tokens one engine step may process, decode rows plus prefill; bounds how long a "
        "long prompt can delay running streams (default: adapt so a step with prefill takes at "
        "most 3x a decode-only step)",
    )
    serve.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=defaults.prefix_cache_mb,
        help="memory for reusing KV of shared prompt prefixes, 0 = off (default %(default)s)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="require this key as x-api-key or Authorization: Bearer (default: no key checked)",
    )
    serve.add_argument(
        "--max-per-client",
        type=int,
        default=0,
        help="concurrent requests one client (API key or address) may have; beyond them: 429 "
        "(default: no limit)",
    )
    serve.add_argument(
        "--max-output-tokens",
        type=int,
        default=None,
        help="refuse larger max_tokens with the 400 that Claude Code retries with the limit "
        "(default: clamp max_tokens to the context instead)",
    )
    serve.add_argument(
        "--log-level", default=defaults.log_level, choices=["debug", "info", "warning", "error"]
    )
    return parser


def parse_config(argv: list[str]) -> Config:
    """The settings a command line asks for; exits with a usage error on a bad one."""
    if not argv or argv[0] not in ("serve", "-h", "--help"):
        argv = ["serve", *argv]  # `mlxgate` and `python -m mlxgate` serve by default
    parser = _parser()
    args = parser.parse_args(argv)
    aliases = dict(args.model_alias)
    if len(aliases) < len(args.model_alias):
        parser.error("--model-alias: the same NAME is given twice")
    return Config(
        host=args.host,
        port=args.port,
        model=args.model,
        model_aliases=aliases,
        strict_models=args.strict_models,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_queued=args.max_queued,
        max_running=args.max_running,
        step_token_budget=args.step_token_budget,
        prefix_cache_mb=args.prefix_cache_mb,
        api_key=args.api_key,
        max_per_client=args.max_per_client,
        max_output_tokens=args.max_output_tokens,
        log_level=args.log_level,
    )


def main(argv: list[str] | None = None) -> None:
    config = parse_config(sys.argv[1:] if argv is None else argv)
    from mlxgate.server import serve

    serve(config)
