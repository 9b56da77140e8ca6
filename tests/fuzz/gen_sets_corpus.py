#!/usr/bin/env python3
"""Writes the seed corpus of the tensor-set table decoder's fuzz target.

Each file is named STATUS-what.bin, where STATUS is the gpuipc status that
decoding it must give (OK, E_TRUNCATED, ...): the corpus replay test
(tests/test-sets-fuzz-corpus.c) checks it. Files the fuzzer adds later may
have any other name; for them the replay only checks that decoding returns.
Layout: docs/sets.md. Run: python3 tests/fuzz/gen_sets_corpus.py
"""
import os
import struct

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "sets-table")

DTYPE_SIZE = {1: 1, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 4, 8: 8, 9: 8, 10: 2,
              11: 2, 12: 4, 13: 8, 14: 8, 15: 16, 16: 1, 17: 1, 18: 1,
              19: 1, 20: 1}


def crc32c(data, crc=0):
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def entry(name, dtype, shape, strides=None, piece=0, offset=0, nbytes=None,
          pad=0):
    name = name.encode() if isinstance(name, str) else name
    if strides is None:
        strides, s = [], 1
        for d in reversed(shape):
            strides.insert(0, s)
            s *= max(d, 1)
    if nbytes is None:
        if any(d == 0 for d in shape):
            nbytes = 0
        else:
            span = sum((d - 1) * st for d, st in zip(shape, strides))
            nbytes = (span + 1) * DTYPE_SIZE.get(dtype, 1)
    b = struct.pack("<HBBIQQ", len(name), dtype, len(shape), piece, offset, nbytes)
    b += b"".join(struct.pack("<q", d) for d in shape)
    b += b"".join(struct.pack("<q", d) for d in strides)
    b += name
    b += bytes((-len(b)) % 8)
    if pad:
        b = b[:-1] + bytes([pad])
    return b


def table(entries, pieces=(4096,), copies=1, layout=0x1234, version=1,
          magic=0x53545047, hdr_len=48, reserved=0, n_entries=None,
          fix_crc=True, length=None, extra=b""):
    body = b"".join(struct.pack("<Q", p) for p in pieces) + b"".join(entries)
    total = 48 + len(body) if length is None else length
    n = len(entries) if n_entries is None else n_entries
    h = struct.pack("<IHHIIQIIIIQ", magic, version, hdr_len, total, 0, layout,
                    n, len(pieces), copies, 0, reserved)
    b = bytearray(h + body + extra)
    if fix_crc:
        c = crc32c(bytes(b[:total]) if total <= len(b) else bytes(b))
        b[12:16] = struct.pack("<I", c)
    return bytes(b)


def main():
    os.makedirs(HERE, exist_ok=True)
    good = [entry("w0", 11, [4, 8]), entry("w1", 12, [3], offset=64),
            entry("b.\u00e9", 2, [], offset=128)]
    cases = {
        "OK-three": table(good),
        "OK-every-dtype": table([entry("t%d" % d, d, [2, 3], offset=256 * d)
                                 for d in range(1, 18)], pieces=(8192,)),
        "OK-8d-strided": table([entry("x", 12, [1, 2, 1, 2, 1, 2, 1, 2],
                                      strides=[0, 1, 0, 2, 0, 4, 0, 8])]),
        "OK-two-copies": table(good, pieces=(4096, 512), copies=2),
        "OK-empty-tensor": table([entry("e", 12, [0, 5]), entry("f", 12, [0])]),
        "E_TRUNCATED-header": table(good)[:20],
        "E_TRUNCATED-body": table(good)[:-8],
        "E_BAD_MAGIC-zeros": bytes(64),
        "E_BAD_MAGIC-text": b"this is not a tensor-set table at all, " * 2,
        "E_BAD_VERSION-2": table(good, version=2),
        "E_BAD_CHECKSUM-flip": table(good)[:60] + bytes([table(good)[60] ^ 1]) + table(good)[61:],
        "E_PROTOCOL-header-len": table(good, hdr_len=64),
        "E_PROTOCOL-reserved": table(good, reserved=1),
        "E_PROTOCOL-trailing": table(good) + bytes(8),
        "E_PROTOCOL-count-more": table(good, n_entries=4),
        "E_PROTOCOL-count-less": table(good, n_entries=2),
        "E_PROTOCOL-count-huge": table(good, n_entries=1000000),
        "E_PROTOCOL-no-entries": table([], n_entries=0),
        "E_PROTOCOL-three-copies": table(good, copies=3),
        "E_PROTOCOL-name-long": table([entry("n" * 300, 12, [1])]),
        "E_PROTOCOL-name-empty": table([entry("", 12, [1])]),
        "E_PROTOCOL-name-utf8": table([entry(b"\xc0\x80", 12, [1])]),
        "E_PROTOCOL-name-nul": table([entry(b"a\x00b", 12, [1])]),
        "E_PROTOCOL-name-dup": table([entry("a", 12, [1]), entry("a", 12, [1], offset=64)]),
        "E_PROTOCOL-padding": table([entry("abc", 12, [1], pad=1)]),
        "E_PROTOCOL-ndim-9": table([entry("a", 12, [1] * 9)]),
        "E_BAD_KIND-dtype-0": table([entry("a", 0, [1])]),
        "E_BAD_KIND-dtype-99": table([entry("a", 99, [1])]),
        "E_OUT_OF_RANGE-overlap": table([entry("a", 12, [4]), entry("b", 12, [4], offset=8)]),
        "E_OUT_OF_RANGE-outside": table([entry("a", 12, [4], offset=4090)]),
        "E_OUT_OF_RANGE-piece": table([entry("a", 12, [4], piece=1)]),
        "E_OUT_OF_RANGE-extent": table([entry("a", 12, [4], nbytes=12)]),
        "E_OUT_OF_RANGE-negative": table([entry("a", 12, [-4], nbytes=4)]),
        "E_OUT_OF_RANGE-huge": table([entry("a", 12, [1 << 40, 1 << 40], nbytes=0)]),
        "E_OUT_OF_RANGE-zero-piece": table(good, pieces=(0,)),
    }
    for name, data in cases.items():
        with open(os.path.join(HERE, name + ".bin"), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
