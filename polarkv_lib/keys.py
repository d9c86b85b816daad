"""Keys: 32 lowercase hex characters (128 bits), and the chained chunk keys of a prompt.

key_0 = H(root(namespace) || tokens_0), key_i = H(key_{i-1} || tokens_i), where H is
blake2b with a 16-byte digest and root(namespace) is itself a domain-separated hash of
the namespace, so namespaces of any length cannot run into the token bytes. Tokens are
little-endian uint32; a chunk holding any token >= 2**32 is encoded as a one-byte tag
followed by little-endian uint64 (its length differs from every uint32 encoding, so the
two can never collide). Only full chunks are keyed.
"""

from __future__ import annotations

import re
import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b
from typing import Any

KEY_LENGTH = 32
_KEY_RE = re.compile(r"[0-9a-f]{32}")
_U64_TAG = b"\x08"
# A tenant's name (security.tenants): also part of its entries' identities and file names.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_IDENT_RE = re.compile(r"[0-9a-f]{32}(?:\.[A-Za-z0-9][A-Za-z0-9._-]{0,63})?")


def is_valid_key(key: object) -> bool:
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None


def all_valid_keys(values: list[Any]) -> bool:
    """Whether every value is a key: one pass in C over a request's batch (a lookup of
    64 keys checked one call at a time cost as much as serving it from the table)."""
    try:
        return all(map(_KEY_RE.fullmatch, values))
    except TypeError:  # not a string
        return False


# An entry is its tenant's: two tenants storing the same key have two entries. Its
# identity is the key for the default tenant ("") and `key.tenant` for the others, one
# string (as cheap a dict key as the key itself) that the manager files it under and a
# disk role names its file by; the key is always its first 32 characters.


def ident(tenant: str, key: str) -> str:
    return f"{key}.{tenant}" if tenant else key


def split_ident(value: str) -> tuple[str, str]:
    """(tenant, key) of an identity."""
    return value[KEY_LENGTH + 1 :], value[:KEY_LENGTH]


def is_valid_ident(value: object) -> bool:
    return isinstance(value, str) and _IDENT_RE.fullmatch(value) is not None


def check_key(key: object) -> str:
    if not is_valid_key(key):
        raise ValueError(f"a key is 32 lowercase hex characters, got {key!r:.60}")
    return key  # type: ignore[return-value]


def _namespace_root(namespace: str) -> bytes:
    return blake2b(namespace.encode(), digest_size=16, person=b"polarkv-ns").digest()


def _token_bytes(chunk: Sequence[int]) -> bytes:
    try:
        packed = array("I", chunk)
        if packed.itemsize != 4:  # pragma: no cover - exotic platforms
            raise OverflowError
    except OverflowError:
        if any(t < 0 or t >= 2**64 for t in chunk):
            raise ValueError("token ids must be in [0, 2**64)") from None
        wide = array("Q", chunk)
        if sys.byteorder != "little":  # pragma: no cover
            wide.byteswap()
        return _U64_TAG + wide.tobytes()
    if sys.byteorder != "little":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def token_list(tokens: Any) -> list[int]:
    """Accept a list/tuple/array of ints, or anything with .tolist() (numpy, torch)."""
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    if not isinstance(tokens, Sequence) or isinstance(tokens, str | bytes):
        raise TypeError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    out = list(tokens)
    if set(map(type, out)) <= {int}:  # the common case, checked in one C-level pass
        return out
    for t in out:
        if not isinstance(t, int) or isinstance(t, bool):
            raise TypeError(f"tokens must be ints, got {type(t).__name__}")
    return out


def chunk_keys(tokens: Any, namespace: str, chunk_tokens: int = 256) -> list[str]:
    """The chained keys of every full chunk of `tokens`."""
    if not isinstance(namespace, str):
        raise TypeError("namespace must be a str")
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError("chunk_tokens must be a positive int")
    ids = token_list(tokens)
    prev = _namespace_root(namespace)
    keys = []
    for start in range(0, len(ids) - chunk_tokens + 1, chunk_tokens):
        prev = blake2b(
            prev + _token_bytes(ids[start : start + chunk_tokens]), digest_size=16
        ).digest()
        keys.append(prev.hex())
    return keys
