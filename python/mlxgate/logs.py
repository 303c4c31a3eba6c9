"""The server's log: human one-liners, or one JSON object per line (`--log-format json`), and
the line each request leaves when it ends (`request_ended`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import orjson

from mlxgate._native import Reader

requests_log = logging.getLogger("mlxgate.requests")


# A stream's end (`Reader.end`) as the request log words it.
_ENDS = {
    "finished": "finished",
    "cancelled": "cancelled",
    "running": "cancelled",  # the client left; the engine has not dropped the stream yet
    "overloaded": "stalled",  # the client stopped reading
    "unavailable": "drained",  # the server shut down first
}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if (fields := getattr(record, "fields", None)) is not None:
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


def configure(level: str, form: str) -> None:
    handler = logging.StreamHandler()
    if form == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def request_ended(fields: dict[str, Any], readers: Sequence[Reader]) -> None:
    """Log one request: `fields` (id, method, route, dialect, model, status, duration_s, and
    model_wait_s: the seconds it waited for its model to load, if it did) and what its streams
    came to. The time to the first token counts the wait for the model."""
    status = fields["status"]
    waited = fields.get("model_wait_s")
    if readers:
        prompt, cached = readers[0].prompt_tokens
        tier = readers[0].cached_from
        ttfts = [r.ttft_s for r in readers if r.ttft_s is not None]
        ends = {_ENDS.get(r.end, "error") for r in readers}
        drafter, guessed, kept = readers[0].guesses  # a response's choices share one record
        fields |= {
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "cached_from": tier or None,
            "output_tokens": sum(r.output_tokens for r in readers),
            "ttft_s": round(min(ttfts) + (waited or 0.0), 4) if ttfts else None,
            "end": min(ends, key=["error", "drained", "stalled", "cancelled", "finished"].index),
            "drafter": drafter or None,
            "guessed_tokens": guessed,
            "guesses_kept": kept,
        }
    else:
        fields["end"] = "finished" if 0 < status < 400 else "cancelled" if not status else "error"
    text = f"{fields['method']} {fields['route']} {status or '-'} {fields['end']}"
    if readers:
        text += (
            f": {fields['prompt_tokens']} prompt tokens ({fields['cached_tokens']} cached"
            f"{' from ' + tier if tier else ''}), "
            f"{fields['output_tokens']} generated"
            + (f" ({kept} of {guessed} guesses kept, {drafter})" if guessed else "")
            + f", first after {fields['ttft_s']} s"
            + (f" ({fields['model_wait_s']} s loading the model)," if waited is not None else ",")
        )
    text += f" {fields['duration_s']:.3f} s [{fields['id']}]"
    probe = fields["route"] in ("/health", "/metrics")  # polled: only at debug
    requests_log.log(logging.DEBUG if probe else logging.INFO, text, extra={"fields": fields})
