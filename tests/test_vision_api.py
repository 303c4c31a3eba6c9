"""Images through a real server and the official SDKs to a tiny VLM (support/tiny_vlms.py): each
dialect's image shape gives the answer mlx-vlm gives on the same prompt and image; usage and
count_tokens count the image's tokens; turn 2 with the same screenshot reuses it; the real
Claude Code CLI sends a pasted image and gets an answer."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import mlx.core as mx
import openai
import pytest
from anthropic.types import ToolParam
from openai.types.chat import ChatCompletionContentPartParam, ChatCompletionMessageParam

from mlxgate import prompts
from mlxgate.api.openai.requests import ChatCompletionRequest, conversation
from mlxgate.models.tokenizer import ChatTokenizer
from support import tiny_vlms
from support.agents import run_claude_code
from support.servers import RunningServer, metric, start_server, stop_server

FAMILY = "qwen2_5_vl"
TOKENS = 8
QUESTION = "What is in this picture?"


def png(kind: int, width: int = 80, height: int = 64) -> bytes:
    data = io.BytesIO()
    tiny_vlms.image(kind, width, height).save(data, format="PNG")
    return data.getvalue()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A context that holds Claude Code's first request.
    text = {"max_position_embeddings": 32768}
    return tiny_vlms.write(FAMILY, tmp_path_factory.mktemp("vlm") / FAMILY, text=text)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[RunningServer]:
    server = start_server(tmp_path_factory.mktemp("vlm-server"), "--model", str(model_dir))
    yield server
    stop_server(server)


def reference(
    model_dir: Path, messages: list[ChatCompletionMessageParam], images: list[bytes]
) -> str:
    """mlx-vlm's greedy answer to the OpenAI `messages`, rendered as the server renders them."""
    from mlx_vlm import load
    from PIL import Image

    request = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    rendered = prompts.Renderer(ChatTokenizer.from_pretrained_dir(model_dir)).render(
        conversation(request)
    )
    model, processor = load(str(model_dir))
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    text = prompts.IMAGE_MARK.sub(placeholder, rendered.text)
    pictures = [Image.open(io.BytesIO(i)).convert("RGB") for i in images]
    tokens: list[int] = []
    for step in tiny_vlms.stream_generate(
        model, processor, text, image=pictures, max_tokens=TOKENS, temperature=0.0
    ):
        if len(tokens) == TOKENS or step.token in rendered.reply.eos_ids:
            break
        tokens.append(int(tiny_vlms.token(step)))
    mx.clear_cache()
    return str(processor.tokenizer.decode(tokens, skip_special_tokens=True))


def openai_messages(image: bytes, text: str = QUESTION) -> list[ChatCompletionMessageParam]:
    parts: list[ChatCompletionContentPartParam] = [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": text},
    ]
    return [{"role": "user", "content": parts}]


def test_each_dialect_gives_mlx_vlm_answer(vlm: RunningServer, model_dir: Path) -> None:
    image = png(0)
    want = reference(model_dir, openai_messages(image), [image])
    client = openai.OpenAI(base_url=f"{vlm.url}/v1", api_key="x", max_retries=0)
    chat_answer = client.chat.completions.create(
        model="m",
        messages=openai_messages(image),
        max_tokens=TOKENS,
        temperature=0,
    )
    assert chat_answer.choices[0].message.content == want
    prompt_tokens = chat_answer.usage.prompt_tokens if chat_answer.usage else 0

    streamed = client.chat.completions.create(
        model="m",
        messages=openai_messages(image),
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want

    responses = client.responses.create(
        model="m",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(image), "detail": "auto"},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ],
        max_output_tokens=TOKENS,
        temperature=0,
    )
    assert responses.output_text == want

    claude = anthropic.Anthropic(base_url=vlm.url, api_key="x", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}
    content: Any = [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]
    message = claude.messages.create(
        model="m", max_tokens=TOKENS, messages=[{"role": "user", "content": content}]
    )
    assert "".join(b.text for b in message.content if b.type == "text") == want
    # The image's tokens counted as the model sees them, alike everywhere.
    counted = claude.messages.count_tokens(
        model="m", messages=[{"role": "user", "content": content}]
    )
    usage = message.usage
    assert counted.input_tokens == prompt_tokens
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == prompt_tokens
    text_only = claude.messages.count_tokens(
        model="m", messages=[{"role": "user", "content": QUESTION}]
    )
    assert counted.input_tokens - text_only.input_tokens >= 4 + 2  # pads, and their markers

    other = png(1, 120, 100)
    assert client.chat.completions.create(
        model="m",
        messages=openai_messages(other),
        max_tokens=TOKENS,
        temperature=0,
    ).choices[0].message.content == reference(model_dir, openai_messages(other), [other])


def test_the_same_screenshot_next_turn_is_reused(vlm: RunningServer) -> None:
    client = openai.OpenAI(base_url=f"{vlm.url}/v1", api_key="x", max_retries=0)
    image = png(0, 96, 96)
    first = openai_messages(image, "Describe it.")
    answer = client.chat.completions.create(
        model="m",
        messages=first,
        max_tokens=TOKENS,
        temperature=0,
    )
    turn2: list[ChatCompletionMessageParam] = [
        *first,
        {"role": "assistant", "content": answer.choices[0].message.content},
        {"role": "user", "content": "And the colours?"},
    ]
    encoded = metric(vlm, "mlxgate_engine_vision_seconds_count")
    again = client.chat.completions.create(
        model="m",
        messages=turn2,
        max_tokens=TOKENS,
        temperature=0,
    )
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    first_tokens = answer.usage.prompt_tokens if answer.usage else 0
    # All of turn 1's prompt but its last token (the template's assistant opening, which runs
    # into the reply as turn 2 renders it): the image and everything after it.
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= first_tokens - 1
    assert metric(vlm, "mlxgate_engine_vision_seconds_count") == encoded  # not encoded again

    # Another image in the same place: nothing from the image on is reused.
    swapped = openai_messages(png(1, 96, 96), "Describe it.")  # turn 1's, another image
    other = client.chat.completions.create(
        model="m",
        messages=[*swapped, *turn2[1:]],
        max_tokens=TOKENS,
        temperature=0,
    )
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    cached = other.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached < 8  # the template's opening at most
    assert metric(vlm, "mlxgate_engine_vision_seconds_count") == encoded + 1


def test_a_tool_results_image_reaches_the_model(vlm: RunningServer) -> None:
    """Claude Code's Read tool returns an image inside a tool_result."""
    claude = anthropic.Anthropic(base_url=vlm.url, api_key="x", max_retries=0)
    tool: ToolParam = {
        "name": "Read",
        "description": "Read a file",
        "input_schema": {"type": "object"},
    }

    def ask(image: bytes) -> anthropic.types.Message:
        source = {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(image).decode(),
        }
        messages: Any = [
            {"role": "user", "content": "Look at shot.png"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "t1",
                        "name": "Read",
                        "input": {"file_path": "shot.png"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "image", "source": source}],
                    }
                ],
            },
        ]
        return claude.messages.create(
            model="m",
            max_tokens=TOKENS,
            tools=[tool],
            messages=messages,
        )

    encoded = metric(vlm, "mlxgate_engine_vision_seconds_count")
    small, large = ask(png(0, 56, 56)), ask(png(1, 112, 112))
    assert metric(vlm, "mlxgate_engine_vision_seconds_count") == encoded + 2
    # 56x56 is 4 image tokens, 112x112 is 16: the model saw each.
    total = [m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) for m in (small, large)]
    assert total[1] - total[0] == 12


def test_claude_code_sends_a_pasted_image(vlm: RunningServer, tmp_path: Path) -> None:
    """`claude -p --input-format stream-json`: a user message with an image block, as the
    Agent SDK sends one (and as a paste in the terminal is sent)."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    source = {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(png(0)).decode(),
    }
    message = {
        "type": "user",
        "message": {
            "role": "user",
            "content": [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}],
        },
    }
    encoded = metric(vlm, "mlxgate_engine_vision_seconds_count")
    run = run_claude_code(
        vlm,
        workdir,
        "--bare",
        "--system-prompt",
        "You are a helpful assistant.",
        "--tools",
        "",
        "-p",
        "--input-format",
        "stream-json",
        "--output-format",
        "stream-json",
        "--verbose",
        input=json.dumps(message) + "\n",
        # (A random model never ends its reply: Claude Code asks for short ones.)
        env={"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "16"},
    )
    events = [json.loads(line) for line in run.stdout.splitlines() if line.strip()]
    # (Claude Code's own messages, e.g. an error's, are the model `<synthetic>`.)
    answers = [
        e["message"]
        for e in events
        if e.get("type") == "assistant" and e["message"].get("model") == FAMILY
    ]
    assert answers, run.stdout[-3000:] + run.stderr
    assert answers[0]["content"][0]["text"].strip()
    # The image reached the model: its tokens in the prompt, its tower run once. (A random
    # model never ends its reply: Claude Code asks it to go on, three times, each turn reusing
    # the one before, the image included, from the prefix cache.)
    with_image = (
        answers[0]["usage"]["input_tokens"] + answers[0]["usage"]["cache_read_input_tokens"]
    )
    assert with_image >= 4 + 2 + len(QUESTION) // 8
    assert all(a["usage"]["cache_read_input_tokens"] >= with_image for a in answers[1:]), [
        a["usage"] for a in answers
    ]
    assert metric(vlm, "mlxgate_engine_vision_seconds_count") == encoded + 1
