"""Engine admission errors; the API layers turn each into their own dialect's envelope."""

from __future__ import annotations


class AdmissionError(Exception):
    """The request cannot be admitted; `status` is the HTTP status to answer with."""

    status = 400


class PromptTooLong(AdmissionError):
    def __init__(self, prompt_tokens: int, context_length: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length
        # Exact wording: Claude Code parses the two numbers to decide whether to compact.
        super().__init__(f"prompt is too long: {prompt_tokens} tokens > {context_length} maximum")


class QueueFull(AdmissionError):
    status = 529

    def __init__(self, retry_after_s: int) -> None:
        self.retry_after_s = retry_after_s
        super().__init__("the server is overloaded: too many requests waiting, retry later")


class EngineStopped(AdmissionError):
    status = 503

    def __init__(self) -> None:
        super().__init__("the engine is not running")
