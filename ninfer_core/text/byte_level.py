"""GPT-2's byte-level alphabet: the printable character each byte is spelt as in a
byte-level BPE vocabulary (`Ġthe` is the bytes of " the").

Such vocabularies store every token as a string over 256 printable stand-ins, one per byte.
Building one (the built-in model's tokenizer) and reading one back to bytes (a grammar
library's vocabulary) need the same table, so it is written once, here.
"""

from __future__ import annotations

#: Bytes that stand for themselves; the other 68 are spelt from U+0100 up, in byte order.
_PRINTABLE = frozenset([*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)])


def byte_to_char() -> dict[int, str]:
    """Each byte (0-255) -> the character byte-level BPE spells it with."""
    chars, extra = {}, 0
    for b in range(256):
        if b in _PRINTABLE:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def char_to_byte() -> dict[str, int]:
    """The inverse of `byte_to_char`: a vocabulary entry's characters -> its bytes."""
    return {c: b for b, c in byte_to_char().items()}
