"""A request's images, from what it sent to decoded pictures: checked, and fetched where the
server may reach other hosts (--allow-image-urls)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import hashlib
import io
import re
from collections.abc import Sequence
from urllib.parse import urlsplit

import httpx
from PIL import Image

from mlxgate import prompts
from mlxgate.api.errors import ApiError, invalid
from mlxgate.config import Config
from mlxgate.prompts import ImageInput, LoadedImage

# The formats read, as PIL names what it finds in the file (whatever the request declared).
# MPO is a JPEG with more pictures after the first (many cameras' and phones' photos).
FORMATS = ("PNG", "JPEG", "MPO", "GIF", "WEBP")
# The most pixels an image may have: a small file can claim a huge picture (a decompression
# bomb), so the size its header gives is checked before any pixel is decoded.
MAX_PIXELS = 50_000_000

_DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),(.*)", re.DOTALL)


def mark(images: list[ImageInput], image: ImageInput) -> str:
    """`image` added to a conversation's `images`: the mark that stands for it in the text."""
    images.append(image)
    return prompts.image_mark(len(images) - 1)


def decode_base64(data: object, where: str) -> bytes:
    """Base64 text as bytes (line breaks allowed); a 400 naming `where` if it is not."""
    if not isinstance(data, str) or not data:
        raise invalid(f"{where}: an image's data must be base64 text", param=where)
    try:
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{where}: not valid base64", param=where) from None


def from_url(url: object, where: str) -> ImageInput:
    """An image given by URL: a `data:` URL's bytes, or an http(s) URL to fetch (when the server
    may: see `load_images`)."""
    if not isinstance(url, str) or not url:
        raise invalid(f"{where}: an image needs its URL", param=where)
    if url[:5].lower() == "data:":
        given = _DATA_URL.fullmatch(url)
        if given is None or "base64" not in given[2].lower().split(";"):
            raise invalid(f"{where}: a data URL's image must be base64 (data:image/png;base64,...)")
        return ImageInput(where, data=decode_base64(given[3], where), media_type=given[1] or None)
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise invalid(f"{where}: an image URL must be an http(s) URL or a base64 data URL")
    return ImageInput(where, url=url)


def marked(conversation: prompts.Conversation) -> prompts.Conversation:
    """`conversation` with only the images its text still marks (a context edit or a compaction
    can drop a turn that held one), numbered in the order the marks come. Each image is marked
    once: a second mark, or one of no image, can only be text a client wrote (a 400)."""
    order: dict[int, int] = {}
    for message in conversation.messages:
        content = message.get("content")
        for found in prompts.IMAGE_MARK.finditer(content if isinstance(content, str) else ""):
            index = int(found[1])
            if index >= len(conversation.images) or index in order:
                raise invalid("messages: the text holds an image mark that stands for no image")
            order[index] = len(order)
    if list(order) == list(range(len(conversation.images))):
        return conversation

    def renumbered(found: re.Match[str]) -> str:
        return prompts.image_mark(order[int(found[1])])

    messages = [
        {**m, "content": prompts.IMAGE_MARK.sub(renumbered, m["content"])}
        if isinstance(m.get("content"), str)
        else m
        for m in conversation.messages
    ]
    images = [conversation.images[i] for i in order]
    return dataclasses.replace(conversation, messages=messages, images=images)


def _too_large(image: ImageInput, size: int | str, config: Config) -> ApiError:
    return invalid(
        f"{image.where}: the image is {size} bytes, more than the {config.max_image_bytes} "
        "this server takes (--max-image-bytes)"
    )


def _decode(image: ImageInput, data: bytes) -> LoadedImage:
    try:
        with Image.open(io.BytesIO(data)) as opened:
            width, height = opened.size
            if opened.format not in FORMATS:
                raise invalid(
                    f"{image.where}: {opened.format} images are not read here: send PNG, JPEG, "
                    "GIF or WebP"
                )
            if width * height > MAX_PIXELS:
                raise _too_many_pixels(image, f"{width}x{height}")
            picture = opened.convert("RGB")
    except Image.DecompressionBombError:
        raise _too_many_pixels(image, "larger than that") from None
    except ApiError:
        raise
    except Exception as exc:  # a damaged file can make a decoder fail in any way
        raise invalid(f"{image.where}: not an image this server reads ({exc})") from None
    return LoadedImage(picture, hashlib.sha256(data).digest())


def _too_many_pixels(image: ImageInput, size: str) -> ApiError:
    return invalid(
        f"{image.where}: the image is {size} pixels, more than the {MAX_PIXELS:,} this server takes"
    )


async def _fetch(client: httpx.AsyncClient, image: ImageInput, config: Config) -> bytes:
    """The bytes at `image.url`, within the time and byte limits."""
    url, limit = image.url or "", config.max_image_bytes
    try:
        async with asyncio.timeout(config.image_url_timeout):
            async with client.stream("GET", url) as response:
                if not response.is_success:
                    raise invalid(
                        f"{image.where}: fetching the image at {url} got HTTP "
                        f"{response.status_code}"
                    )
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise _too_large(image, declared, config)
                body, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > limit:  # stop reading: the rest is never held
                        raise _too_large(image, f"more than {limit}", config)
                    body.append(chunk)
                return b"".join(body)
    except TimeoutError:
        raise invalid(
            f"{image.where}: fetching the image at {url} took more than "
            f"{config.image_url_timeout:g} s (--image-url-timeout)"
        ) from None
    except httpx.HTTPError as exc:
        raise invalid(f"{image.where}: fetching the image at {url} failed ({exc})") from None


async def _fetch_all(images: Sequence[ImageInput], config: Config) -> dict[int, bytes]:
    """The bytes of every image given by URL, by its index, fetched together."""
    wanted = [i for i, image in enumerate(images) if image.data is None]
    if not wanted:
        return {}
    if not config.allow_image_urls:
        raise invalid(
            f"{images[wanted[0]].where}: this server does not fetch image URLs (start it with "
            "--allow-image-urls to let it); send the image's bytes (base64) instead"
        )
    timeout = httpx.Timeout(config.image_url_timeout)
    async with httpx.AsyncClient(timeout=timeout, follow_redirects=True) as client:
        fetched = await asyncio.gather(
            *(_fetch(client, images[i], config) for i in wanted), return_exceptions=True
        )
    out = {}
    for i, result in zip(wanted, fetched, strict=True):
        if isinstance(result, BaseException):
            raise result
        out[i] = result
    return out


async def load_images(images: Sequence[ImageInput], config: Config) -> list[LoadedImage]:
    """Each image decoded (on a worker thread), in order; a 400 for any that cannot be."""
    if len(images) > config.max_images:
        raise invalid(
            f"the request holds {len(images)} images; this server takes at most "
            f"{config.max_images} (--max-images)"
        )
    for image in images:
        if image.data is not None and len(image.data) > config.max_image_bytes:
            raise _too_large(image, len(image.data), config)
    fetched = await _fetch_all(images, config)
    loaded = []
    for i, image in enumerate(images):
        data = image.data if image.data is not None else fetched[i]
        loaded.append(await asyncio.to_thread(_decode, image, data))
    return loaded
