"""Images in requests (issue 36), the API side: each dialect's image shapes become a conversation's
images and the marks standing for them in its text; api/images.py decodes and checks them
(format, bytes, pixels, count) and fetches URLs only with --allow-image-urls, within a time and
byte limit; every failure is a 400 in the dialect's envelope and the server goes on serving. A
text-only model answers an image with a 400 through the official SDKs; a stand-in vision model
(its `prompt` returns the text prompt) stands for the engine side behind the HTTP layer."""

from __future__ import annotations

import base64
import hashlib
import io
import re
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, cast

import anthropic
import httpx2
import openai
import pytest
from anthropic.types import ContentBlockParam, ImageBlockParam
from openai.types.chat import ChatCompletionContentPartImageParam
from PIL import Image

from mlxgate import prompts
from mlxgate.api import images as api_images
from mlxgate.api.anthropic.requests import MessagesRequest
from mlxgate.api.anthropic.requests import conversation as anthropic_conversation
from mlxgate.api.errors import ApiError
from mlxgate.api.openai.requests import ChatCompletionRequest
from mlxgate.api.openai.requests import conversation as openai_conversation
from mlxgate.api.responses.requests import ResponsesRequest
from mlxgate.api.responses.requests import conversation as responses_conversation
from mlxgate.api.responses.requests import tools as responses_tools
from mlxgate.api.responses.routes import _kept_content
from mlxgate.api.vision_prompts import VisionPrompts
from mlxgate.config import Config
from support.servers import RunningServer

if TYPE_CHECKING:
    from mlxgate.app import App


def picture(size: tuple[int, int] = (4, 3), fmt: str = "PNG", color: str = "red") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, fmt)
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


def claiming(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header says it is `width` x `height` (a decompression bomb's)."""
    png = picture((1, 1))
    header = struct.pack(">II", width, height) + png[24:29]
    return png[:16] + header + struct.pack(">I", zlib.crc32(b"IHDR" + header)) + png[33:]


PNG = picture()
JPEG = picture((5, 5), "JPEG", "blue")
MARK = re.compile(prompts.IMAGE_MARK.pattern)


def marks(conversation: prompts.Conversation) -> list[int]:
    """The image indexes the messages' text marks, in order."""
    return [
        int(found[1])
        for message in conversation.messages
        for found in MARK.finditer(message.get("content") or "")
    ]


def anthropic_image(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": media_type, "data": b64(data)},
    }


def error_of(call: Any, *args: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args)
    return caught.value


# Conversion: each dialect's shapes as images and marks.


def test_anthropic_images_in_user_turns_and_tool_results() -> None:
    request = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Compare"},
                        anthropic_image(PNG),
                        {"type": "text", "text": "with"},
                        {"type": "image", "source": {"type": "url", "url": "https://x.test/a.jpg"}},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [
                                {"type": "text", "text": "the screenshot:"},
                                anthropic_image(JPEG, "image/jpeg"),
                            ],
                        }
                    ],
                },
            ],
        }
    )
    conversation = anthropic_conversation(request)
    first, *_ = conversation.messages
    assert first["content"] == f"Compare\n{prompts.image_mark(0)}\nwith\n{prompts.image_mark(1)}"
    tool = next(m for m in conversation.messages if m["role"] == "tool")
    assert tool["content"] == f"the screenshot:\n{prompts.image_mark(2)}"
    assert marks(conversation) == [0, 1, 2]
    png, url, jpeg = conversation.images
    assert (png.data, png.media_type, png.where) == (PNG, "image/png", "messages.0.content.1")
    assert (url.data, url.url) == (None, "https://x.test/a.jpg")
    assert url.where == "messages.0.content.3.source.url"
    assert (jpeg.data, jpeg.where) == (JPEG, "messages.2.content.0.content.1")


def test_anthropic_image_errors() -> None:
    def convert(content: list[dict[str, Any]], role: str = "user") -> prompts.Conversation:
        request = MessagesRequest.model_validate(
            {"model": "m", "max_tokens": 8, "messages": [{"role": role, "content": content}]}
        )
        return anthropic_conversation(request)

    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "%%"}}
    text = {"type": "text", "text": "hi"}
    assert error_of(convert, [text, bad]).message == (
        "messages.0.content.1.source.data: not valid base64"
    )
    document = {"type": "document", "source": {"type": "base64", "data": b64(b"%PDF")}}
    assert "document input is not supported" in error_of(convert, [document]).message
    assert "user messages" in error_of(convert, [anthropic_image(PNG)], "assistant").message
    by_file = {"type": "image", "source": {"type": "file", "file_id": "file_1"}}
    assert "file store" in error_of(convert, [by_file]).message
    ftp = {"type": "image", "source": {"type": "url", "url": "ftp://x.test/a.png"}}
    assert "http(s)" in error_of(convert, [ftp]).message


def test_openai_image_url_parts() -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "You see."},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(JPEG, "image/jpeg")}},
                        {"type": "text", "text": "and"},
                        {
                            "type": "image_url",
                            "image_url": {"url": "http://x.test/b.png", "detail": "low"},
                        },
                    ],
                },
                {"role": "assistant", "content": "ok", "tool_calls": None},
                {
                    "role": "tool",
                    "tool_call_id": "c1",
                    "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}}],
                },
            ]
        }
    )
    conversation = openai_conversation(request)
    user = conversation.messages[1]
    assert user["content"] == f"{prompts.image_mark(0)}\nand\n{prompts.image_mark(1)}"
    assert marks(conversation) == [0, 1, 2]
    jpeg, url, png = conversation.images
    assert (jpeg.data, jpeg.media_type) == (JPEG, "image/jpeg")
    assert jpeg.where == "messages.1.content.0.image_url.url"
    assert url.url == "http://x.test/b.png" and url.data is None
    assert png.data == PNG

    def convert(message: dict[str, Any]) -> prompts.Conversation:
        return openai_conversation(ChatCompletionRequest.model_validate({"messages": [message]}))

    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}
    assert error_of(convert, {"role": "user", "content": [broken]}).message == (
        "messages.0.content.0.image_url.url: not valid base64"
    )
    image = {"type": "image_url", "image_url": {"url": data_url(PNG)}}
    assert "user and tool" in error_of(convert, {"role": "system", "content": [image]}).message


def test_responses_input_image_in_messages_and_tool_outputs() -> None:
    request = ResponsesRequest.model_validate(
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is it?"},
                        {"type": "input_image", "image_url": data_url(PNG), "detail": "auto"},
                    ],
                },
                {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [
                        {"type": "input_image", "image_url": "https://x.test/shot.png"},
                        {"type": "input_text", "text": "a screenshot"},
                    ],
                },
            ]
        }
    )
    conversation = responses_conversation(request, [], responses_tools(request))
    user = next(m for m in conversation.messages if m["role"] == "user")
    assert user["content"] == f"What is it?\n{prompts.image_mark(0)}"
    tool = next(m for m in conversation.messages if m["role"] == "tool")
    assert tool["content"] == f"{prompts.image_mark(1)}\na screenshot"
    assert marks(conversation) == [0, 1]
    png, shot = conversation.images
    assert png.data == PNG and png.where == "input.0.content.1.image_url"
    assert shot.url == "https://x.test/shot.png" and shot.where == "input.2.output.0.image_url"

    def convert(part: dict[str, Any]) -> prompts.Conversation:
        given = ResponsesRequest.model_validate({"input": [{"role": "user", "content": [part]}]})
        return responses_conversation(given, [], responses_tools(given))

    assert "file store" in error_of(convert, {"type": "input_image", "file_id": "file-1"}).message
    assert error_of(convert, {"type": "input_image", "image_url": "data:,abc"}).message == (
        "input.0.content.0.image_url: a data URL's image must be base64 (data:image/png;base64,...)"
    )


def test_only_marked_images_are_kept_numbered_in_mark_order() -> None:
    one, two, three = (prompts.ImageInput(f"i{n}", data=PNG) for n in range(3))
    conversation = prompts.Conversation(
        [
            {"role": "user", "content": f"{prompts.image_mark(2)} then {prompts.image_mark(0)}"},
            {"role": "assistant", "content": "ok"},
        ],
        images=[one, two, three],
    )
    kept = api_images.marked(conversation)
    assert kept.messages[0]["content"] == f"{prompts.image_mark(0)} then {prompts.image_mark(1)}"
    assert kept.images == [three, one]
    unchanged = prompts.Conversation(
        [{"role": "user", "content": prompts.image_mark(0)}], images=[one]
    )
    assert api_images.marked(unchanged) is unchanged
    for text in (prompts.image_mark(1), prompts.image_mark(0) * 2):  # written by a client
        forged = prompts.Conversation([{"role": "user", "content": text}], images=[one])
        assert "stands for no image" in error_of(api_images.marked, forged).message


def test_a_compaction_keeps_the_user_messages_images() -> None:
    image = {"type": "input_image", "image_url": data_url(PNG)}
    assert _kept_content([{"type": "input_text", "text": "see"}, image]) == [
        {"type": "input_text", "text": "see"},
        image,
    ]
    assert _kept_content("hi") == [{"type": "input_text", "text": "hi"}]


# Loading: formats, limits, URLs.


class Files(BaseHTTPRequestHandler):
    """A PNG at /cat.png, a body that trickles (/slow), one past the byte limit without a
    length (/big) and one that declares it (/declared), 404 elsewhere."""

    def do_GET(self) -> None:
        try:
            if self.path == "/cat.png":
                self._head(200, len(PNG))
                self.wfile.write(PNG)
            elif self.path == "/slow":
                self._head(200, 100)
                for _ in range(20):
                    self.wfile.write(b"x" * 5)
                    self.wfile.flush()
                    time.sleep(0.1)
            elif self.path == "/big":
                self._head(200, None)
                for _ in range(64):
                    self.wfile.write(b"x" * 16384)
            elif self.path == "/declared":
                self._head(200, 1 << 30)
            else:
                self._head(404, 0)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped reading: what the limits are for

    def _head(self, status: int, length: int | None) -> None:
        self.send_response(status)
        self.send_header("content-type", "image/png")
        if length is not None:
            self.send_header("content-length", str(length))
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def files() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Files)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


FETCHING = Config(allow_image_urls=True, image_url_timeout=0.5, max_image_bytes=100_000)


async def load(*images: prompts.ImageInput, config: Config = FETCHING) -> list[prompts.LoadedImage]:
    return await api_images.load_images(list(images), config)


async def refused(*images: prompts.ImageInput, config: Config = FETCHING) -> str:
    with pytest.raises(ApiError) as caught:
        await load(*images, config=config)
    return caught.value.message


def given(data: bytes, where: str = "image") -> prompts.ImageInput:
    return prompts.ImageInput(where, data=data)


@pytest.mark.anyio
async def test_the_four_formats_load_as_rgb_pictures() -> None:
    sent = [picture((3, 2), fmt) for fmt in ("PNG", "JPEG", "GIF", "WEBP")]
    loaded = await load(*(given(data) for data in sent))
    assert [(image.image.mode, image.image.size) for image in loaded] == [("RGB", (3, 2))] * 4
    assert loaded[0].digest == hashlib.sha256(sent[0]).digest()


@pytest.mark.anyio
async def test_what_is_not_a_readable_image_is_refused() -> None:
    assert (await refused(given(b"hello", "messages.0.content.1"))).startswith(
        "messages.0.content.1: not an image this server reads"
    )
    assert "BMP images are not read here" in await refused(given(picture(fmt="BMP")))
    assert "TIFF images are not read here" in await refused(given(picture(fmt="TIFF")))
    assert "not an image" in await refused(given(PNG[: len(PNG) // 2]))  # truncated


@pytest.mark.anyio
async def test_limits_on_count_bytes_and_pixels() -> None:
    few = Config(max_images=2)
    assert "3 images" in await refused(*[given(PNG)] * 3, config=few)
    assert len(await load(*[given(PNG)] * 2, config=few)) == 2
    small = Config(max_image_bytes=len(PNG) - 1)
    assert "--max-image-bytes" in await refused(given(PNG), config=small)
    assert "8000x7000 pixels" in await refused(given(claiming(8000, 7000)))
    assert "pixels" in await refused(given(claiming(30000, 30000)))  # past PIL's own bomb check


@pytest.mark.anyio
async def test_urls_are_fetched_only_when_allowed(files: str) -> None:
    cat = api_images.from_url(f"{files}/cat.png", "input.0.content.0.image_url")
    message = await refused(cat, config=Config())
    assert "--allow-image-urls" in message and message.startswith("input.0.content.0.image_url")
    (loaded,) = await load(cat)
    assert loaded.image.size == (4, 3)


@pytest.mark.anyio
async def test_url_failures_are_400s(files: str) -> None:
    def at(path: str) -> prompts.ImageInput:
        return api_images.from_url(f"{files}{path}", "url")

    assert "HTTP 404" in await refused(at("/missing.png"))
    started = time.monotonic()
    assert "took more than 0.5 s (--image-url-timeout)" in await refused(at("/slow"))
    assert time.monotonic() - started < 1.5
    assert "--max-image-bytes" in await refused(at("/big"))
    assert "--max-image-bytes" in await refused(at("/declared"))
    closed = api_images.from_url("http://127.0.0.1:9/none.png", "url")  # nothing listens
    assert "failed" in await refused(closed)


# Through HTTP: a text-only model (a real server) and a stand-in vision model (in process).


def test_a_text_only_model_answers_images_with_400_and_serves_on(server: RunningServer) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    image: list[ContentBlockParam] = [
        {"type": "text", "text": "What is it?"},
        cast("ImageBlockParam", anthropic_image(PNG)),
    ]
    with pytest.raises(anthropic.BadRequestError) as refused_anthropic:
        claude.messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": image}]
        )
    assert refused_anthropic.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "reads text only" in str(refused_anthropic.value)

    gpt = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    part: ChatCompletionContentPartImageParam = {
        "type": "image_url",
        "image_url": {"url": data_url(PNG)},
    }
    with pytest.raises(openai.BadRequestError) as refused_chat:
        gpt.chat.completions.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": [part]}]
        )
    assert "reads text only" in str(refused_chat.value)
    with pytest.raises(openai.BadRequestError) as refused_responses:
        gpt.responses.create(
            model="m",
            max_output_tokens=4,
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": data_url(PNG), "detail": "auto"}
                    ],
                }
            ],
        )
    assert "reads text only" in str(refused_responses.value)

    answer = claude.messages.create(
        model="m", max_tokens=4, messages=[{"role": "user", "content": "Hello"}]
    )
    assert answer.content


class EchoVision(VisionPrompts):
    """A vision model's stand-in: the prompt stays the text one (its marks as text), and the
    images it was given are kept for the test to see."""

    def __init__(self) -> None:
        self.seen: list[list[prompts.LoadedImage]] = []

    def prompt(self, rendered: prompts.Prompt, images: list[prompts.LoadedImage]) -> prompts.Prompt:
        self.seen.append(images)
        return rendered


@pytest.fixture(scope="module")
def vision_app() -> Iterator[tuple[App, EchoVision]]:
    """The embedded model in process, its prompts taking images through `EchoVision`; URLs
    allowed, within half a second, at most three images a request."""
    from mlxgate.app import build_app

    config = Config(
        allowed_hosts=("mlxgate.test",),
        allow_image_urls=True,
        image_url_timeout=0.5,
        max_images=3,
        max_image_bytes=100_000,
    )
    app = build_app(config)
    vision = EchoVision()
    served = app.models.default.served
    assert served is not None
    served.vision = vision
    yield app, vision
    app.engine.stop()


Part = str | tuple[str, str]  # text, ("b64", base64 text) or ("url", URL)


def part(dialect: str, given: Part) -> dict[str, Any]:
    if isinstance(given, str):
        return {"type": "input_text" if dialect == "responses" else "text", "text": given}
    kind, value = given
    url = f"data:image/png;base64,{value}" if kind == "b64" else value
    if dialect == "anthropic":
        source = (
            {"type": "base64", "media_type": "image/png", "data": value}
            if kind == "b64"
            else {"type": "url", "url": value}
        )
        return {"type": "image", "source": source}
    if dialect == "chat":
        return {"type": "image_url", "image_url": {"url": url}}
    return {"type": "input_image", "image_url": url}


async def ask(app: App, dialect: str, *parts: Part) -> str:
    """The embedded model's (4-token) answer to one user message of `parts` in `dialect`."""
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))
    content = [part(dialect, given) for given in parts]
    message: Any = {"role": "user", "content": content}
    if dialect == "anthropic":
        claude = anthropic.AsyncAnthropic(
            base_url="http://mlxgate.test", api_key="x", http_client=http, max_retries=0
        )
        reply = await claude.messages.create(model="m", max_tokens=4, messages=[message])
        return "".join(block.text for block in reply.content if block.type == "text")
    gpt = openai.AsyncOpenAI(
        base_url="http://mlxgate.test/v1", api_key="x", http_client=http, max_retries=0
    )
    if dialect == "chat":
        chat_reply = await gpt.chat.completions.create(model="m", max_tokens=4, messages=[message])
        return chat_reply.choices[0].message.content or ""
    response = await gpt.responses.create(model="m", max_output_tokens=4, input=[message])
    return response.output_text


DIALECT_NAMES = ["anthropic", "chat", "responses"]


@pytest.mark.anyio
@pytest.mark.parametrize("dialect", DIALECT_NAMES)
async def test_a_vision_model_gets_the_images_decoded_in_order(
    dialect: str, vision_app: tuple[App, EchoVision], files: str
) -> None:
    app, vision = vision_app
    wide = b64(picture((6, 2)))
    answer = await ask(app, dialect, "Compare", ("b64", wide), "with", ("url", f"{files}/cat.png"))
    assert isinstance(answer, str)
    assert [image.image.size for image in vision.seen[-1]] == [(6, 2), (4, 3)]


BAD: list[tuple[list[Part], str]] = [
    ([("b64", "%%%")], "not valid base64"),
    ([("b64", b64(b"hello"))], "not an image this server reads"),
    ([("b64", b64(picture(fmt="BMP")))], "BMP images are not read here"),
    ([("b64", b64(PNG))] * 4, "4 images"),
    ([("b64", b64(picture((400, 300), "BMP")))], "--max-image-bytes"),
    ([("url", "/missing.png")], "HTTP 404"),
    ([("url", "/slow")], "--image-url-timeout"),
    ([("url", "/big")], "--max-image-bytes"),
]


@pytest.mark.anyio
@pytest.mark.parametrize("dialect", DIALECT_NAMES)
async def test_bad_images_are_400s_in_each_dialect_and_serving_goes_on(
    dialect: str, vision_app: tuple[App, EchoVision], files: str
) -> None:
    app, _ = vision_app
    error = anthropic.BadRequestError if dialect == "anthropic" else openai.BadRequestError
    for parts, said in BAD:
        parts = [(p[0], f"{files}{p[1]}") if p[0] == "url" else p for p in parts]
        with pytest.raises(error) as caught:
            await ask(app, dialect, "Look:", *parts)
        assert isinstance(caught.value, anthropic.BadRequestError | openai.BadRequestError)
        assert caught.value.status_code == 400, said
        assert said in str(caught.value), (said, str(caught.value))
        body: Any = caught.value.body
        kind = body["error"]["type"] if dialect == "anthropic" else body["type"]
        assert kind == "invalid_request_error"
    if dialect == "responses":
        with pytest.raises(openai.BadRequestError, match="file store"):
            http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))
            gpt = openai.AsyncOpenAI(
                base_url="http://mlxgate.test/v1", api_key="x", http_client=http, max_retries=0
            )
            # No `detail`, which the SDK's input image requires and mlxgate does not: Any.
            stored: Any = {"type": "input_image", "file_id": "f-1"}
            await gpt.responses.create(
                model="m",
                max_output_tokens=4,
                input=[{"role": "user", "content": [stored]}],
            )
    assert isinstance(await ask(app, dialect, "Hello"), str)


@pytest.mark.anyio
async def test_count_tokens_and_a_tool_results_image_reach_the_vision_model(
    vision_app: tuple[App, EchoVision],
) -> None:
    """Claude Code's Read tool returns a screenshot inside tool_result content."""
    app, vision = vision_app
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))
    claude = anthropic.AsyncAnthropic(
        base_url="http://mlxgate.test", api_key="x", http_client=http, max_retries=0
    )
    read = {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "a.png"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [anthropic_image(JPEG)]}
    messages: Any = [
        {"role": "user", "content": "Read a.png"},
        {"role": "assistant", "content": [read]},
        {"role": "user", "content": [result]},
    ]
    tools: Any = [{"name": "Read", "input_schema": {"type": "object", "properties": {}}}]
    counted = await claude.messages.count_tokens(model="m", messages=messages, tools=tools)
    assert counted.input_tokens > 0
    assert [image.image.size for image in vision.seen[-1]] == [(5, 5)]
    await claude.messages.create(model="m", max_tokens=4, messages=messages, tools=tools)
    assert [image.image.size for image in vision.seen[-1]] == [(5, 5)]
