"""A vision model's prompts taking images: each image mark of a rendered prompt made into the
family's placeholder, the model's processor expanding it into the image's tokens and pixel
values, and each image's span of tokens found (the engine's `PromptImages`). On a worker thread;
what the model says about its images is models/vision.py's `ImageTokens`."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mlxgate import prompts
from mlxgate.engine.contract import ImageSpan, PromptImages
from mlxgate.models.vision import ImageTokens


@dataclass(frozen=True)
class Prepared:
    """A prompt's ids and images as the processor made them."""

    ids: list[int]
    images: PromptImages


class VisionPrompts:
    """How one vision model's prompts take images (its `ImageTokens`: processor, placeholder,
    image token)."""

    def __init__(self, tokens: ImageTokens) -> None:
        self.tokens = tokens
        self.processor = tokens.processor
        self.placeholder = tokens.placeholder

    def prompt(self, rendered: prompts.Prompt, images: list[prompts.LoadedImage]) -> prompts.Prompt:
        """`rendered` (its text marking images with `prompts.image_mark`) with each mark made into
        the model's image tokens: the prompt's ids from the model's processor, and its images'
        spans and inputs."""
        order: list[prompts.LoadedImage] = []

        def placeholder(mark: Any) -> str:
            order.append(images[int(mark.group(1))])  # (api/images.py `marked` numbered them)
            return self.placeholder

        text = prompts.IMAGE_MARK.sub(placeholder, rendered.text)
        if not order:
            return rendered
        prepared = self.prepare(text, order)
        return prompts.Prompt(
            text, prepared.ids, rendered.reply, rendered.call_grammar, prepared.images
        )

    def prepare(self, text: str, images: Sequence[prompts.LoadedImage]) -> Prepared:
        """The processor's expansion of `text` (one placeholder per image, in order)."""
        from mlx_vlm.utils import prepare_inputs

        outputs = prepare_inputs(
            self.processor, images=[i.image for i in images], prompts=[text], padding=False
        )
        arrays = {k: np.array(v) for k, v in outputs.items() if isinstance(v, mx.array)}
        ids = arrays.pop("input_ids").reshape(-1)
        arrays.pop("attention_mask", None)
        spans = self._spans(ids)
        if len(spans) != len(images):
            raise prompts.ConversationError(
                f"the prompt's {len(images)} images became {len(spans)} runs of image tokens "
                "(is an image placeholder written in the text?)"
            )
        # The same file makes the same pixels here (one processor): its hash and its tokens'
        # count identify what the model sees, whatever else the prompt holds.
        keyed = tuple(
            ImageSpan(start, length, hashlib.sha256(image.digest + length.to_bytes(8)).digest())
            for (start, length), image in zip(spans, images, strict=True)
        )
        return Prepared(ids.tolist(), PromptImages(keyed, arrays))

    def _spans(self, ids: np.ndarray) -> list[tuple[int, int]]:
        """(start, length) of each image's tokens: runs of the image token, joined across a row
        break."""
        image_token, row_breaks = self.tokens.image_token, self.tokens.row_breaks
        positions = np.flatnonzero(ids == image_token)
        spans: list[tuple[int, int]] = []
        for position in positions.tolist():
            if spans:
                start, length = spans[-1]
                end = start + length
                if position == end or (position == end + 1 and int(ids[end]) in row_breaks):
                    spans[-1] = (start, position + 1 - start)
                    continue
            spans.append((position, 1))
        return spans
