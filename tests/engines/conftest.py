"""The engines tier: runs in the engines virtual environment (torch CPU, vLLM, SGLang,
transformers; see scripts/setup-engines). Every test here is marked `engines`."""

from __future__ import annotations

import os

import pytest

# Keep engine caches inside the build tree and everything offline.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
_cache = os.path.join(os.path.dirname(__file__), "..", "..", ".engines-cache")
for var, sub in (
    ("VLLM_CACHE_ROOT", "vllm"),
    ("SGLANG_CACHE_DIR", "sglang"),
    ("TORCH_EXTENSIONS_DIR", "torch_extensions"),
    ("HF_HOME", "hf"),
):
    os.environ.setdefault(var, os.path.abspath(os.path.join(_cache, sub)))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/engines/" in str(item.fspath):
            item.add_marker(pytest.mark.engines)
