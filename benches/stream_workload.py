"""What the stream benchmarks feed both routers: the default model's tokenizer and a text replayed
as generated tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import mlxgate  # noqa: F401  (preloads OpenBLAS before mlx.core)
from mlxgate._native import Vocab
from mlxgate.models import LoadedModel, load

# Plain prose with paragraph breaks (the "\n" that may begin a stop sequence is held back), some
# punctuation and quotes that JSON escapes, and multi-byte characters split across tokens.
GENERATED_TEXT = """\
The lighthouse keeper found the bottle on a grey morning, wedged between two rocks below the \
tower. Inside was a letter, folded four times, the ink faded to the colour of weak tea. "To \
whoever reads this," it began, "the light on the northern point has gone dark."

He read it twice, then climbed the spiral stairs — all 117 of them — and looked north. The sea \
was calm; the horizon, empty. Still, he packed a lantern, a coil of rope, bread and cheese, and \
set out along the cliff path before the tide turned.

By noon he reached the old village. A café sign still hung above the square (« Café du Port »), \
and a child chalked 你好 and a smiling sun 🌞 on the steps of the church. "Nobody goes to the \
point any more," the child said. "Not since the storm of '98."

The keeper thanked her, shared his bread, and walked on. At the point, the lamp room was \
shattered: glass on the floor, the brass lens cracked in three places. He worked until dusk, \
patching what he could, and when the first star rose he lit the wick. The beam swept out across \
the water, steady and bright, and somewhere far off a ship answered with three short blasts.
"""

# Present in neither the text nor its tokens: every stream runs to max_tokens.
STOP_SEQUENCES = ["</answer>", "\n\nUser:"]


@dataclass
class Workload:
    loaded: LoadedModel
    vocab: Vocab
    token_ids: np.ndarray  # GENERATED_TEXT's tokens, replayed in a loop

    def tokens_at(self, positions: np.ndarray) -> np.ndarray:
        """The token each stream generates at its position in the replayed text."""
        return self.token_ids[positions % len(self.token_ids)]


def load_workload() -> Workload:
    loaded = load(None)
    tokenizer = loaded.tokenizer
    vocab = tokenizer.native_vocab()
    token_ids = np.array(tokenizer.encode(GENERATED_TEXT), dtype=np.uint32)
    return Workload(loaded, vocab, token_ids)
