"""Vision-language models through mlx-vlm: loading, and a prompt's images made into the model's
image tokens and inputs."""

from __future__ import annotations

from mlxgate import chat


class VisionPrompts:
    """How one vision model's prompts take images (see `prompt`)."""

    def prompt(self, rendered: chat.Prompt, images: list[chat.LoadedImage]) -> chat.Prompt:
        """`rendered` (its text marking images with `chat.image_mark`) with each mark made into
        the model's image tokens: the prompt's ids from the model's processor, and its images'
        spans and inputs."""
        raise NotImplementedError
