"""Files whose header lies about a tensor's XXH3-128: the bytes and their CRC32C untouched,
the header's own checksum made to match, so that the file is well-formed in every other way
(as a damaged or hostile file could be)."""

from __future__ import annotations

import json

from fastckpt.format.references import KEY_XXH3_128
from fastckpt.format.schema import KEY_HEADER_CRC, METADATA_KEY, canonical_crc


def record_false_xxh3(path: str, name: str, digest: str) -> None:
    """Rewrites ``path``'s header in place to record ``digest`` (32 hex digits) as tensor
    ``name``'s XXH3-128, and the header checksum that matches."""
    with open(path, "rb") as f:
        data = f.read()
    length = int.from_bytes(data[:8], "little")
    text = data[8 : 8 + length].decode()
    document = json.loads(text)
    meta = document[METADATA_KEY]
    recorded = json.loads(meta[KEY_XXH3_128])
    old_digest, old_crc = recorded[name], meta.pop(KEY_HEADER_CRC)
    recorded[name] = digest
    meta[KEY_XXH3_128] = json.dumps(recorded, separators=(",", ":"))
    new = text.replace(old_digest, digest).replace(old_crc, canonical_crc(document))
    assert len(new) == len(text) and new != text  # the same lengths: offsets unchanged
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(new.encode())
