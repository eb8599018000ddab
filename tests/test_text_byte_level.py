"""GPT-2's byte-level alphabet (`ninfer_core.text.byte_level`) against the `tokenizers`
library's own ByteLevel pre-tokenizer, which spells text in the same alphabet."""

from __future__ import annotations

from tokenizers.pre_tokenizers import ByteLevel

from ninfer_core.text.byte_level import byte_to_char, char_to_byte

TEXT = "".join(chr(c) for c in range(128)) + " héllo wörld, 世界 — ü\u00ad\u00a0😀"


def spelt_by_tokenizers(text: str) -> str:
    pieces = ByteLevel(add_prefix_space=False).pre_tokenize_str(text)
    return "".join(piece for piece, _ in pieces)


def test_every_byte_has_one_character_of_the_tokenizers_alphabet():
    table = byte_to_char()
    assert sorted(table) == list(range(256))
    assert sorted(table.values()) == sorted(ByteLevel.alphabet())
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("a")] == "a"


def test_text_is_spelt_as_the_tokenizers_library_spells_it():
    table = byte_to_char()
    ours = "".join(table[b] for b in TEXT.encode())
    assert ours == spelt_by_tokenizers(TEXT)


def test_char_to_byte_reads_a_spelt_entry_back_to_its_bytes():
    spelt = spelt_by_tokenizers(TEXT)
    decode = char_to_byte()
    assert bytes(decode[c] for c in spelt) == TEXT.encode()
