"""Real tokenizers of the model families (tests/fixtures/tokenizers) and forced-output models
built on them, for tests that need a model to write exactly what they say.

A test builds a model directory and serves it like any mlx-lm model:

    model = forced_model_dir(
        tmp_path,
        family="qwen3",
        script='<tool_call>\\n{"name": "Bash", "arguments": {"command": "ls"}}\\n</tool_call>',
    )
    server = start_server(tmp_path, *serve_args(model))

`family` names the vocabulary and its chat template (see `FAMILIES`). A script is text
(encoded with the family's tokenizer, so `<|call|>` and `<tool_call>` become their own token
ids) or token ids. With several scripts, `when` picks one from the conversation: the model
follows the first script whose `when` occurs in the tokens it has seen (the prompt and what
it has written), e.g. `Script("Done.", when="<tool_response>")` before the tool call's script
answers the turn that carries a tool result. After its script, the model writes `end` (the
family's end-of-turn token unless given). See forced_model.py for how it works.

`bash_call(family, command)` is a Bash call in the family's own format and
`TOOL_RESULT[family]` what its template writes before a tool result, so a tool round trip is
`scripts=[Script("Done.", when=TOOL_RESULT[family]), Script(bash_call(family, "ls"))]`.

Triggers match token ids, so write them as they encode inside the prompt: an added token
(`<tool_response>`), or the first words of a user message; and pick one only that situation's
prompt holds (Qwen3's tool instructions already contain `<tool_call>`). A prompt that ends with
the start of the script (a forced call's opening) is continued from there only if its tokens
are the script's own; BPE seldom cuts the two alike, so for a forced call script just the
continuation (`', "arguments": {...}}\n</tool_call>'`). `Script("...", when=[0])` first in
the list answers only for a row that took in a batch's padding (id 0): a cheap check that the
engine keeps each row's history exact.
"""

from __future__ import annotations

import json
import lzma
import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from mlxgate.models.tokenizer import ChatTokenizer

HERE = Path(__file__).resolve().parent
TOKENIZERS = HERE.parent / "fixtures" / "tokenizers"
TEMPLATES = HERE.parent / "fixtures" / "templates"
MODEL_FILE = HERE / "forced_model.py"


@dataclass(frozen=True)
class Family:
    files: str  # the folder with its tokenizer_config, generation_config (and chat template)
    vocab: str  # the folder whose tokenizer.json.xz it uses
    vocab_size: int  # the model's logits width (config.json vocab_size)
    context: int
    template: str | None = None  # a published template under fixtures/templates, else files'


FAMILIES = {
    "qwen3": Family("qwen3", "qwen3", 151936, 40960),
    "qwen3-coder": Family("qwen3-coder", "qwen3", 151936, 262144),
    "gpt-oss": Family("gpt-oss", "gpt-oss", 201088, 131072),
    "deepseek-v3.1": Family("deepseek-v3.1", "deepseek-v3.1", 129280, 163840),
    # Their own tokenizers are on the hub only: the Qwen3 vocabulary with the family's real
    # template, so their tags are plain text, not special tokens (the parser reads text);
    # Qwen3.5's tags are Qwen3's tokens.
    "qwen3.5": Family("qwen3", "qwen3", 151936, 262144, "qwen3_5.jinja"),
    "glm-4.6": Family("glm-4.6", "qwen3", 151936, 202752, "glm_4_6.jinja"),
    "kimi-k2": Family("kimi-k2", "qwen3", 151936, 262144, "kimi_k2_thinking.jinja"),
    "minimax-m2": Family("minimax-m2", "qwen3", 151936, 196608, "minimax_m2.jinja"),
    "seed-oss": Family("seed-oss", "qwen3", 151936, 524288, "seed_oss.jinja"),
}


@dataclass(frozen=True)
class Script:
    """What the model writes (text or token ids), and when (None: always)."""

    tokens: str | list[int]
    when: str | list[int] | None = None


def write_tokenizer(family: str, dest: Path) -> Path:
    """The family's tokenizer files (tokenizer.json, tokenizer_config.json, generation_config.json,
    chat_template.jinja) written into `dest`, a Hugging Face / mlx-lm model directory."""
    spec = FAMILIES[family]
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_bytes(_tokenizer_json(spec.vocab))
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(TOKENIZERS / spec.files / name, dest / name)
    own = TOKENIZERS / spec.files / "chat_template.jinja"
    shutil.copyfile(TEMPLATES / spec.template if spec.template else own, dest / own.name)
    return dest


@cache
def _tokenizer_json(vocab: str) -> bytes:
    return lzma.decompress((TOKENIZERS / vocab / "tokenizer.json.xz").read_bytes())


@cache
def tokenizer(family: str) -> ChatTokenizer:
    """The family's tokenizer as mlxgate loads it from a model directory."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return ChatTokenizer.from_pretrained_dir(write_tokenizer(family, Path(tmp)))


def encode(family: str, text: str | list[int]) -> list[int]:
    """Text as the family's token ids (special tokens written in it become their ids)."""
    return list(text) if isinstance(text, list) else tokenizer(family).encode(text)


def forced_model_dir(
    tmp_path: Path,
    family: str = "qwen3",
    scripts: list[Script] | None = None,
    end: str | int | None = None,
    name: str | None = None,
    script: str | list[int] | None = None,
) -> Path:
    """A model directory `mlxgate serve --model DIR --trust-remote-code` serves, whose greedy
    output is the first matching script (see the module docstring), then `end` for ever.
    `script` is short for `scripts=[Script(script)]`."""
    spec = FAMILIES[family]
    if script is not None:
        scripts = [*(scripts or []), Script(script)]
    chat = tokenizer(family)
    if end is None:
        end_id = chat.tokenizer.token_to_id(chat.eos_token)
    elif isinstance(end, str):
        end_id = chat.tokenizer.token_to_id(end)
    else:
        end_id = end
    assert end_id is not None, f"{family}: no end token {end!r}"
    directory = write_tokenizer(family, tmp_path / (name or f"forced-{family}"))
    config = {
        "model_type": "forced",
        "model_file": MODEL_FILE.name,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.context,
        "end_token_id": end_id,
        "scripts": [
            {
                "tokens": encode(family, s.tokens),
                **({"when": encode(family, s.when)} if s.when is not None else {}),
            }
            for s in scripts or []
        ],
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    shutil.copyfile(MODEL_FILE, directory / MODEL_FILE.name)
    import mlx.core as mx

    mx.save_safetensors(str(directory / "model.safetensors"), {"model.scale": mx.ones((1,))})
    return directory


def bash_call(family: str, command: str, **arguments: Any) -> str:
    """A Bash tool call of `command` (and any other `arguments`) as `family`'s model writes it
    after the generation prompt: its reasoning lead-in (`LEAD_IN`) and its chat template's
    rendering of an earlier call (`call_markup`, checked in test_forced_model.py), or for
    gpt-oss harmony's documented reply form (the template renders the recipient elsewhere)."""
    return tool_call(family, "Bash", {"command": command, **arguments})


def tool_call(family: str, name: str, arguments: dict[str, Any]) -> str:
    """A call of tool `name` as `family`'s model writes it after the generation prompt."""
    return LEAD_IN.get(family, "") + call_markup(family, name, arguments)


def call_markup(family: str, name: str, arguments: dict[str, Any]) -> str:
    """The call alone, as `family`'s template renders an earlier call (the XML formats write
    strings as they are, other values as JSON)."""
    text = json.dumps(arguments)
    values = {k: v if isinstance(v, str) else json.dumps(v) for k, v in arguments.items()}
    if family == "qwen3":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {text}}}\n</tool_call>'
    if family in ("qwen3-coder", "qwen3.5"):
        params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    if family == "deepseek-v3.1":
        bar = "\uff5c"  # DeepSeek's tags use the fullwidth bar
        return (
            f"<{bar}tool▁calls▁begin{bar}><{bar}tool▁call▁begin{bar}>{name}<{bar}tool▁sep{bar}>"
            f"{text}<{bar}tool▁call▁end{bar}><{bar}tool▁calls▁end{bar}>"
        )
    if family == "gpt-oss":
        return (
            f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{text}<|call|>"
        )
    if family == "glm-4.6":
        params = "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in values.items()
        )
        return f"\n<tool_call>{name}\n{params}</tool_call>"
    if family == "kimi-k2":
        return (
            f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0"
            f"<|tool_call_argument_begin|>{text}<|tool_call_end|><|tool_calls_section_end|>"
        )
    if family == "minimax-m2":
        params = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in values.items())
        invoke = f'<invoke name="{name}">\n{params}</invoke>'
        return f"\n<minimax:tool_call>\n{invoke}\n</minimax:tool_call>"
    if family == "seed-oss":
        params = "".join(f"<parameter={k}>{v}</parameter>\n" for k, v in values.items())
        return f"<seed:tool_call>\n<function={name}>\n{params}</function>\n</seed:tool_call>"
    raise ValueError(f"no call written for {family}")


THOUGHT = "The user wants a command run."
# What a family's model thinks before a call, as its template renders kept reasoning (these
# templates keep the reasoning of the turns after the last user message). MiniMax M2's
# and Qwen3.5's generation prompts open the block (`<think>\n`): the model closes it.
LEAD_IN = {
    "qwen3.5": f"{THOUGHT}\n</think>\n\n",
    "glm-4.6": f"\n<think>{THOUGHT}</think>",
    "kimi-k2": f"<think>{THOUGHT}</think>",
    "minimax-m2": f"{THOUGHT}\n</think>\n\n",
    "seed-oss": f"<seed:think>{THOUGHT}</seed:think>\n",
}


def answer(family: str, text: str) -> str:
    """A plain reply as `family`'s model writes it (gpt-oss: in harmony's final channel;
    MiniMax M2, Qwen3.5: after closing the reasoning their prompts opened)."""
    if family == "gpt-oss":
        return f"<|channel|>final<|message|>{text}<|return|>"
    if family in ("minimax-m2", "qwen3.5"):
        return f"{THOUGHT}\n</think>\n\n{text}"
    return text


# What each family's template writes before a tool result: a trigger for the script that
# answers the turn after a tool call (on the Qwen3 vocabulary, text that encodes the same at
# that place in the prompt and occurs in no first turn).
TOOL_RESULT = {
    "qwen3": "<tool_response>",
    "qwen3-coder": "<tool_response>",
    "qwen3.5": "<tool_response>",
    "deepseek-v3.1": "<\uff5ctool▁output▁begin\uff5c>",
    "gpt-oss": "<|start|>functions",
    "glm-4.6": "<tool_response>",
    "kimi-k2": "## Return of functions",
    "minimax-m2": "<response",  # its `>` merges with the result's first letter
    "seed-oss": ":bos>tool",  # after `<seed:eos><`, which BPE merges with `<seed`
}


def serve_args(model_dir: Path) -> list[str]:
    """The `mlxgate serve` flags for a forced model."""
    return ["--model", str(model_dir), "--trust-remote-code"]
