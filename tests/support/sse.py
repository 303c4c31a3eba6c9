"""SSE bodies as the tests compare them."""

from __future__ import annotations


def last_frames(sse: str, count: int) -> list[str]:
    """The last `count` frames of an SSE body, without their `id:` lines."""
    return [without_id(frame) for frame in sse.split("\n\n") if frame][-count:]


def without_id(frame: str) -> str:
    """An SSE frame without the `id:` line every event starts with."""
    assert frame.startswith(("id: ", ":")), frame
    return frame.split("\n", 1)[1] if frame.startswith("id: ") else frame
