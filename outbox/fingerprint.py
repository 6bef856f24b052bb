"""Input fingerprints: SHA-256 over the RFC 8785 (JCS) canonical form of an intent.

The fingerprint identifies *what* was decided, independent of how the agent spelled
it: key order, number formatting (``1.0`` vs ``1``, ``1e21``) and unicode escapes are
canonicalized by JCS, so equal inputs always hash equal. The tool name and version are
part of the hashed bytes, so the same input to another tool is another intent.
"""

from __future__ import annotations

import hashlib
from typing import Any

import rfc8785
from pydantic import BaseModel

from outbox.errors import InputRejected

SANITIZED_LENGTH = 12


def canonical_json(value: Any) -> bytes:
    """RFC 8785 canonical bytes of a JSON value; refuses what JSON cannot hold exactly."""
    try:
        return rfc8785.dumps(value)
    except rfc8785.IntegerDomainError:
        raise InputRejected(
            "input holds an integer outside the interoperable JSON range (|n| > 2**53 - 1); "
            "send it as a string",
            problems=["integer out of range"],
        ) from None
    except rfc8785.FloatDomainError:
        raise InputRejected(
            "input holds NaN or Infinity, which JSON cannot represent",
            problems=["non-finite number"],
        ) from None
    except RecursionError:
        # rfc8785 recurses once per level; inputs are depth-checked before this.
        raise InputRejected(
            "input is nested too deep to canonicalize", problems=["input nested too deep"]
        ) from None
    except rfc8785.CanonicalizationError as exc:
        raise InputRejected(
            f"input cannot be canonicalized as JSON ({type(exc).__name__})",
            problems=[type(exc).__name__],
        ) from None


def intent_fingerprint(tool_name: str, tool_version: int, input_json: Any) -> str:
    """Hex SHA-256 of ``<name>/v<version>\\n`` followed by the JCS form of the input."""
    digest = hashlib.sha256(f"{tool_name}/v{tool_version}\n".encode())
    digest.update(canonical_json(input_json))
    return digest.hexdigest()


def model_fingerprint(tool_name: str, tool_version: int, model: BaseModel) -> str:
    return intent_fingerprint(tool_name, tool_version, model.model_dump(mode="json"))


def sanitized(fingerprint: str) -> str:
    """A short prefix for logs and events: enough to correlate with the operation row."""
    return fingerprint[:SANITIZED_LENGTH]
