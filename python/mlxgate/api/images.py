"""A request's images, from what it sent to decoded pictures: checked, and fetched where the
server may reach other hosts (--allow-image-urls)."""

from __future__ import annotations

import asyncio
import hashlib
import io
from collections.abc import Sequence

from PIL import Image

from mlxgate.api.errors import invalid
from mlxgate.chat import ImageInput, LoadedImage
from mlxgate.config import Config


def _decode(image: ImageInput, data: bytes) -> LoadedImage:
    try:
        with Image.open(io.BytesIO(data)) as opened:
            picture = opened.convert("RGB")
    except Exception as exc:
        raise invalid(f"{image.where}: not an image this server reads ({exc})") from None
    return LoadedImage(picture, hashlib.sha256(data).digest())


async def load_images(images: Sequence[ImageInput], config: Config) -> list[LoadedImage]:
    """Each image decoded (on a worker thread), in order; a 400 for any that cannot be."""
    loaded = []
    for image in images:
        if image.data is None:
            raise invalid(f"{image.where}: image URLs are not fetched by this server")
        loaded.append(await asyncio.to_thread(_decode, image, image.data))
    return loaded
