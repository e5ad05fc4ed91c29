"""GPT-2's byte-level alphabet: each byte spelled as one printable character, so a
byte-level BPE vocabulary is text. Printable Latin-1 bytes map to themselves, the other
68 bytes to U+0100 onwards, in byte order. The GGUF vocabulary loader spells tokens with
it; the detokenizer reads a token's exact bytes back through it."""

from __future__ import annotations


def _byte_to_char() -> dict[int, str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


BYTE_TO_CHAR: dict[int, str] = _byte_to_char()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}
