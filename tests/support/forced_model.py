"""A forced-output mlx-lm model: its greedy output is a scripted token sequence (tests only).

mlx-lm loads it as a custom architecture: the model directory's config.json names this file as
`model_file` (mlx-lm's own mechanism; mlxgate needs `--trust-remote-code` for it), and
`forced.forced_model_dir` writes such a directory.

It is a one-layer model with the interface of mlx-lm's model classes (`__call__(inputs,
cache)` -> logits [B, L, vocab], `layers`, `make_cache()`, a backbone at `.model`), so the engine
batches, pads, chunks and prefix-caches it like any model. Its only "attention" keeps each
token id in the KV cache and reads back, through the cache's own mask, exactly the tokens the
row has seen. The next token is then a pure function of that history:

- the script is the first entry of `config["scripts"]` whose `when` token sequence occurs in
  the history (an entry without `when` always applies); e.g. one script for a conversation
  that holds a tool result, another for one that does not;
- its progress is the longest prefix of the script that the history ends with; the model
  emits the next scripted token, or `end_token_id` once the script is done.

Being a function of the tokens seen, it is right under continuous batching, left padding,
prefill chunks and prefix reuse, and whatever other requests share the batch.
"""

# No `from __future__ import annotations`: mlx-lm runs this file as a module it does not put in
# sys.modules, where dataclasses cannot resolve string annotations.
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import BaseModelArgs, create_attention_mask
from mlx_lm.models.cache import KVCache

_SURE = 1e4  # the scripted token's logit; every other token gets -_SURE


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    end_token_id: int
    scripts: list[dict[str, Any]] = field(default_factory=list)
    num_hidden_layers: int = 1
    max_position_embeddings: int = 32768


def _digits(ids: mx.array) -> mx.array:
    """[B, L] ids -> [B, 1, L, 3] cache entries: each id as three base-256 digits, exact in any
    float dtype (for ids below 2**24)."""
    ids = ids.astype(mx.int32)
    return mx.stack([ids // 65536, (ids // 256) % 256, ids % 256], axis=-1)[:, None].astype(
        mx.float32
    )


class Layer(nn.Module):  # type: ignore[misc,name-defined]
    """Writes the tokens to its cache; returns every row's cached tokens (padding included)."""

    def __call__(self, h: mx.array, cache: Any) -> Any:
        keys, _ = cache.update_and_fetch(h, h)
        return keys


class Backbone(nn.Module):  # type: ignore[misc,name-defined]
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.layers = [Layer() for _ in range(args.num_hidden_layers)]
        self.scale = mx.ones((1,))  # a weight to load: mlx-lm wants one safetensors file

    def __call__(self, inputs: mx.array, cache: Any = None) -> tuple[Any, Any]:
        if cache is None:
            cache = [KVCache() for _ in self.layers]  # type: ignore[no-untyped-call]
        # Which cached columns each row attends to (computed before the cache grows, as mlx-lm's
        # models do): the row's own tokens, not its padding.
        mask = create_attention_mask(inputs, cache[0], return_array=True)
        h = _digits(inputs)
        keys: Any = h
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            keys = layer(h, layer_cache)
        return keys, mask


class Model(nn.Module):  # type: ignore[misc,name-defined]
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Backbone(args)
        self._scripts = _Scripts(
            [(list(s.get("when") or []), list(s["tokens"])) for s in args.scripts]
        )

    @property
    def layers(self) -> list[Layer]:
        return self.model.layers

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]  # type: ignore[no-untyped-call]

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        """Logits [B, L, vocab] at every position (a speculative verify pass reads them all;
        a prefill runs the backbone alone)."""
        keys, mask = self.model(inputs, cache=cache)
        length = inputs.shape[1]
        targets = [
            [self.next_token(history) for history in row] for row in _histories(keys, mask, length)
        ]
        hit = mx.arange(self.args.vocab_size)[None, None] == mx.array(targets)[..., None]
        return mx.where(hit, _SURE, -_SURE)

    def next_token(self, history: list[int]) -> int:
        script = self._script(history)
        for done in range(min(len(script), len(history)), 0, -1):
            if history[-done:] == script[:done]:
                return script[done] if done < len(script) else self.args.end_token_id
        return script[0] if script else self.args.end_token_id

    def _script(self, history: list[int]) -> list[int]:
        for when, tokens in self._scripts.entries:
            if not when or _contains(history, when):
                return tokens
        return []


@dataclass
class _Scripts:
    """Kept out of the module's parameter tree (an nn.Module would walk a plain list)."""

    entries: list[tuple[list[int], list[int]]]


def _contains(history: list[int], needle: list[int]) -> bool:
    first = needle[0]
    return any(
        history[i : i + len(needle)] == needle
        for i in range(len(history) - len(needle) + 1)
        if history[i] == first
    )


def _histories(keys: Any, mask: Any, length: int) -> list[list[list[int]]]:
    """Per row, per query position (the last `length` columns): the token ids that position
    attends to, its own included.

    `keys` is [B, 1, S, 3] (or, for a cache kept in bands of rows, one such array per band)."""
    if isinstance(keys, list):  # a banded cache: one (keys, mask) per band, rows in order
        masks = mask if isinstance(mask, list) else [mask] * len(keys)
        return [row for k, m in zip(keys, masks, strict=True) for row in _histories(k, m, length)]
    digits = np.array(keys[:, 0].astype(mx.float32))  # [B, S, 3]
    ids = (digits @ np.array([65536.0, 256.0, 1.0])).round().astype(np.int64)
    rows, columns = ids.shape
    if isinstance(mask, mx.array):
        m = np.array(mask if mask.dtype == mx.bool_ else mask == 0)  # additive: 0 where attended
        m = np.broadcast_to(m.reshape((-1, *m.shape[-2:]))[:, -length:, :], (rows, length, columns))
    else:  # None or "causal": each position attends to every column up to its own
        m = np.tril(np.ones((length, columns), dtype=np.bool_), k=columns - length)
        m = np.broadcast_to(m, (rows, length, columns))
    return [[ids[row][m[row, q]].tolist() for q in range(length)] for row in range(rows)]
