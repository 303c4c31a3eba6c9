"""The served model's tokenizer and chat template, independent of where the model came from."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import SandboxedEnvironment
from tokenizers import Tokenizer

from mlxgate._native import Vocab

VocabKind = Literal["byte_level", "sentencepiece"]


class TemplateError(ValueError):
    """The chat template refused the conversation (raise_exception in the template)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter (Jinja's own escapes HTML characters).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@dataclass
class ChatTokenizer:
    """Encodes text, renders conversations with the model's own chat template."""

    tokenizer: Tokenizer
    chat_template: str
    vocab_kind: VocabKind
    eos_ids: frozenset[int]
    bos_token: str = ""
    eos_token: str = ""
    special_ids: frozenset[int] = field(default_factory=frozenset)

    @cached_property
    def _template(self) -> jinja2.Template:
        # transformers' environment (its filters and globals; tests/test_templates.py holds the
        # prompts to `apply_chat_template`), but mutable: templates keep state in lists they
        # build, which transformers' immutable sandbox refuses (Kimi K2 appends to one when a
        # conversation has tool calls); the messages they read are rebuilt for every render.
        env = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    @cached_property
    def trims_leading_space(self) -> bool:
        """Whether decoding drops the text's first space (a SentencePiece decoder ending in
        `Strip(" ", 1, 0)`, as Llama 2's and Mistral's do): a reply then reads as the
        tokenizer's `decode` of its tokens, as mlx-lm's streaming detokenizer trims it."""
        decoder = self.tokenizer.decoder
        steps = json.loads(decoder.__getstate__()).get("decoders", []) if decoder else []
        return bool(steps) and steps[-1] == {"type": "Strip", "content": " ", "start": 1, "stop": 0}

    def native_vocab(self) -> Vocab:
        """The vocabulary the native router detokenizes with, as this tokenizer decodes."""
        return Vocab.from_token_strings(
            self.token_strings(),
            self.vocab_kind,
            sorted(self.special_ids),
            trim_leading_space=self.trims_leading_space,
        )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_strings(self) -> list[str]:
        """Token id -> token string, for the native incremental detokenizer."""
        by_id = {i: t for t, i in self.tokenizer.get_vocab(with_added_tokens=True).items()}
        return [by_id.get(i, "") for i in range(max(by_id) + 1)]

    def encode(self, text: str) -> list[int]:
        # The chat template already writes BOS where the model wants it.
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        return self._template.render(
            messages=messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **template_kwargs,
        )

    @classmethod
    def from_pretrained_dir(cls, path: Path) -> ChatTokenizer:
        """A Hugging Face / mlx-lm model directory, as mlx-lm loads its tokenizer (which finds
        the chat template as transformers does: chat_template.jinja, tokenizer_config.json)."""
        from mlx_lm.utils import load_tokenizer

        # The model's own end tokens: config.json (as mlx-lm reads them) and
        # generation_config.json list them, often more than the tokenizer's one eos_token.
        eos_ids: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            if (path / name).exists():
                eos = json.loads((path / name).read_text()).get("eos_token_id")
                eos_ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        wrapper = load_tokenizer(path, eos_token_ids=sorted(eos_ids))
        hf = wrapper._tokenizer
        tokenizer: Tokenizer = hf.backend_tokenizer
        template = hf.chat_template or ""
        if isinstance(template, dict):  # named templates: {"default": ..., "tool_use": ...}
            template = template.get("default", "")
        # (Read off the model: its tokenizer.json can be tens of megabytes to parse.)
        byte_fallback = getattr(tokenizer.model, "byte_fallback", False)
        kind: VocabKind = "sentencepiece" if byte_fallback else "byte_level"
        special = {i for i, t in hf.added_tokens_decoder.items() if t.special}
        return cls(
            tokenizer=tokenizer,
            chat_template=template or DEFAULT_CHATML_TEMPLATE,
            vocab_kind=kind,
            eos_ids=frozenset(wrapper.eos_token_ids),
            bos_token=hf.bos_token or "",
            eos_token=hf.eos_token or "",
            special_ids=frozenset(special),
        )


# Used only when a model ships no template at all.
DEFAULT_CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
