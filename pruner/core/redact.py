"""Hugging Face tokens never leave the process: masked in every message pruner prints or writes.

Error messages from the Hub client can echo request details (URLs, headers,
response bodies); anything pruner shows or saves that may hold such text goes
through `redact`: the token values of HF_TOKEN / HUGGING_FACE_HUB_TOKEN and of
the stored login, anything shaped like a user access token (`hf_...`), and the
value of any `Authorization:` header are replaced by `***`.
"""

from __future__ import annotations

import os
import re

ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
MASK = "***"
_SHAPED = re.compile(r"\bhf_[A-Za-z0-9]{16,}\b")
_HEADER = re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*['\"]?)(bearer\s+)?[^\s'\",;)\]}]+")


def secrets() -> list[str]:
    """The token values this process could send: from the environment and the stored login."""
    values = [os.environ.get(k, "") for k in ENV]
    try:
        from huggingface_hub import get_token

        values.append(get_token() or "")
    except Exception:  # noqa: BLE001 - no login, no huggingface_hub: nothing more to hide
        pass
    return sorted({v.strip() for v in values if len(v.strip()) >= 8}, key=len, reverse=True)


def redact(text: str) -> str:
    """`text` with every token masked."""
    for value in secrets():
        text = text.replace(value, MASK)
    text = _HEADER.sub(lambda m: m.group(1) + (m.group(2) or "") + MASK, text)
    return _SHAPED.sub(MASK, text)
