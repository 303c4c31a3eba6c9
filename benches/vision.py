"""Images on this CPU: what a vision tower costs per image at each family's default resolution,
and what an image request does to the streams decoding beside it.

    PYTHONPATH=tests .venv/bin/python benches/vision.py \
        [--families qwen2_5_vl gemma3 ...] [--skip-towers]

No real vision-language weights can be had offline, so the models are mlx-vlm's own classes
with random weights (tests/support/tiny_vlms.py) at real models' sizes: the cost of a tower
depends on its shape, not its weights.

1. Towers, in process: each family's vision tower at the size of a model people run (Qwen2.5-VL
   3B, Qwen3-VL 4B, Gemma 3 4B's SigLIP, Mistral Small 3.1's Pixtral) on one image at the
   resolution its processor makes of a 640x480 screenshot: `get_input_embeddings`, what the
   engine's vision job runs (engine/vision_jobs.py), twice; the median.
2. Served: `mlxgate serve` with Qwen2.5-VL 3B's tower and a SmolLM2-135M-sized language model.
   C clients stream text requests in a closed loop (OpenAI, 64 tokens each): alone, then while
   one client sends an image request (the 640x480 image, as a data URL), then alone again (the
   machine's speed drifts). Reported: the text streams' tokens a second and their gaps between
   tokens, and the image request's first token.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from report import log, publish

import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
from mlxgate.bench.load import Prompt, make_client, send_prompt, story_prompt
from mlxgate.bench.records import Record
from mlxgate.bench.spawn import Server, free_port, mlxgate_command, stop_all
from support import tiny_vlms

BENCHES = Path(__file__).resolve().parent

SCREENSHOT = (640, 480)
# Real models' vision towers (their Hugging Face configs), on the tiny language models.
TOWERS: dict[str, tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "qwen2_5_vl": (
        "Qwen2.5-VL 3B",
        {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
        },
        {},
        {"min_pixels": 3136, "max_pixels": 12845056},
    ),
    "qwen3_vl": (
        "Qwen3-VL 4B",
        {
            "depth": 24,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_heads": 16,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [5, 11, 17],
        },
        {},
        {"min_pixels": 65536, "max_pixels": 16777216},
    ),
    "gemma3": (
        "Gemma 3 4B (SigLIP 400M, 896x896)",
        {
            "num_hidden_layers": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_attention_heads": 16,
            "image_size": 896,
        },
        {"mm_tokens_per_image": 256},
        {"size": {"height": 896, "width": 896}, "image_seq_length": 256},
    ),
    "mistral3": (
        "Mistral Small 3.1 (Pixtral tower)",
        {
            "num_hidden_layers": 24,
            "hidden_size": 1024,
            "head_dim": 64,
            "intermediate_size": 4096,
            "num_attention_heads": 16,
            "image_size": 1540,
        },
        {},
        {"size": {"longest_edge": 1540}},
    ),
}
# SmolLM2-135M's shape, for the served model's language model.
SMALL_TEXT = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
}


def write_model(family: str, dest: Path, text: dict[str, Any] | None = None) -> Path:
    _, vision, text_changes, preprocessor = TOWERS[family]
    text = {**text_changes, **(text or {})}
    if family.startswith("qwen"):
        vision = {**vision, "out_hidden_size": text.get("hidden_size", 64)}
    return tiny_vlms.write(family, dest, text=text, vision=vision, preprocessor=preprocessor)


def tower_seconds(family: str, work: Path, repeats: int) -> tuple[int, list[float]]:
    """The family's image tokens for the screenshot and its tower's seconds, each run."""
    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.utils import prepare_inputs

    model, processor = load(str(write_model(family, work / family)))
    prompt = tiny_vlms.PROMPTS[family].format(text="What is on the screen?")
    inputs = prepare_inputs(processor, images=[tiny_vlms.image(0, *SCREENSHOT)], prompts=[prompt])
    ids = inputs.pop("input_ids")
    pixels = inputs.pop("pixel_values")
    mask = inputs.pop("attention_mask")
    tokens = int((np.array(ids) == tiny_vlms.image_token_id(family)).sum())
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        out = model.get_input_embeddings(ids, pixels, mask=mask, **inputs)
        mx.eval(out.inputs_embeds)
        times.append(time.perf_counter() - started)
        log(f"{family}: {tokens} image tokens, {times[-1]:.1f} s")
    return tokens, times


def screenshot_url() -> str:
    data = io.BytesIO()
    tiny_vlms.image(0, *SCREENSHOT).save(data, format="PNG")
    return "data:image/png;base64," + base64.b64encode(data.getvalue()).decode()


async def text_load(url: str, clients: int, tokens: int, until: asyncio.Event) -> list[Record]:
    """`clients` clients each sending text requests one after another until `until` is set."""
    records: list[Record] = []
    async with make_client(clients + 1, 600) as client:

        async def one(slot: int) -> None:
            index = slot
            while not until.is_set():
                record = await send_prompt(
                    client, url, "openai", story_prompt(index), tokens, index=index
                )
                if record.error:
                    raise RuntimeError(record.error)
                records.append(record)
                index += clients

        await asyncio.gather(*(one(slot) for slot in range(clients)))
    return records


async def text_for(url: str, clients: int, tokens: int, seconds: float) -> list[Record]:
    until = asyncio.Event()
    asyncio.get_running_loop().call_later(seconds, until.set)
    return await text_load(url, clients, tokens, until)


async def mixed(url: str, clients: int, tokens: int) -> tuple[list[Record], Record]:
    """The text load while one image request runs (started once the text streams decode)."""
    until = asyncio.Event()
    load = asyncio.ensure_future(text_load(url, clients, tokens, until))
    await asyncio.sleep(2.0)
    async with make_client(1, 600) as client:
        prompt = Prompt("What is on the screen?", images=(screenshot_url(),))
        image = await send_prompt(client, url, "openai", prompt, 16)
    until.set()
    records = await load
    if image.error:
        raise RuntimeError(image.error)
    return records, image


def gaps(records: list[Record]) -> np.ndarray:
    return np.concatenate([np.diff(r.delta_times) for r in records if len(r.delta_times) > 1])


def rate(records: list[Record]) -> float:
    started = min(r.sent_at for r in records)
    ended = max(r.ended_at for r in records)
    return sum(r.output_tokens or 0 for r in records) / (ended - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=list(TOWERS), choices=list(TOWERS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-towers", action="store_true")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=BENCHES / "results")
    args = parser.parse_args()

    lines = [
        f"# Images on this CPU ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`benches/vision.py`: random-weight mlx-vlm models at real sizes; the image is "
        f"{SCREENSHOT[0]}x{SCREENSHOT[1]} (what each processor makes of it).",
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if not args.skip_towers:
            lines += [
                "## A vision tower, one image",
                "",
                "| family | tower as in | image tokens | seconds (median) | each | ms / token |",
                "| --- | --- | ---: | ---: | --- | ---: |",
            ]
            for family in args.families:
                tokens, times = tower_seconds(family, work / "towers", args.repeats)
                median = statistics.median(times)
                lines.append(
                    f"| {family} | {TOWERS[family][0]} | {tokens} | {median:.1f} | "
                    + ", ".join(f"{t:.1f}" for t in times)
                    + f" | {1000 * median / tokens:.0f} |"
                )
            lines.append("")
        served = write_model("qwen2_5_vl", work / "served", SMALL_TEXT)
        try:
            port = free_port()
            server = Server(
                "mlxgate", mlxgate_command(port, ["--model", str(served)]), port, work / "log"
            )
            server.start()
            url = server.url
            log("text only")
            before = asyncio.run(text_for(url, args.clients, args.max_tokens, 30.0))
            log("text and an image")
            during, image = asyncio.run(mixed(url, args.clients, args.max_tokens))
            log("text only, again")
            after = asyncio.run(text_for(url, args.clients, args.max_tokens, 30.0))
            server.stop()
        finally:
            stop_all()
    alone = statistics.mean([rate(before), rate(after)])
    lines += [
        f"## Served: {args.clients} text streams, and one image request beside them",
        "",
        "`mlxgate serve` of Qwen2.5-VL 3B's vision tower on a SmolLM2-135M-sized language "
        f"model; text requests of {args.max_tokens} tokens in a closed loop (OpenAI, streamed).",
        "",
        "| run | text tok/s | x alone | gap p50 | gap p99 | gap max | requests |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, records in (
        ("text only", before),
        ("text + one image request", during),
        ("text only, again", after),
    ):
        g = gaps(records) * 1000
        lines.append(
            f"| {name} | {rate(records):.1f} | {rate(records) / alone:.2f} | "
            f"{np.percentile(g, 50):.0f} ms | {np.percentile(g, 99):.0f} ms | {g.max():.0f} ms | "
            f"{len(records)} |"
        )
    lines += [
        "",
        f"The image request: first token after {image.ttft_s:.1f} s "
        f"({image.input_tokens} prompt tokens), {image.output_tokens} tokens.",
    ]
    publish(lines, args.out, "vision")


if __name__ == "__main__":
    main()
