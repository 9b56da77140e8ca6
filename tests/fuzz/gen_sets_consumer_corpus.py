#!/usr/bin/env python3
"""Writes the seed corpus of fuzz-sets-consumer (corpus/sets-consumer): one
program per case, in the target's op language (fuzz_sets_consumer.c says
it: byte 0 the consumer's behaviour, then ops). Deterministic; run:
python3 tests/fuzz/gen_sets_consumer_corpus.py

The items of the recording, by index: layout A (an owned set of three
tensors in two copies) 0 table chunk, 1-2 pieces, 3-4 versions 1 and 2,
5 END; layout B (a wrapped set in two allocations) 6 table chunk, 7-8
pieces, 9 version 1, 10 END; 11-18 spare blocks of 4096 bytes, whose meta
the ops rewrite."""
import os
import struct

A_CHUNK, A_P0, A_P1, A_V1, A_V2, A_END = range(6)
B_CHUNK, B_P0, B_P1, B_V1, B_END = range(6, 11)
SPARES = list(range(11, 19))
ITEMS = 19
A_TABLE_LEN, B_TABLE_LEN = 232, 240  # as the recording has them

PIECE, VERSION, END, REPLACE = 1, 2, 3, 4
KEEP, LA, LB, LZERO = 0, 1, 2, 3
KEEP8, MAX8 = 0xFF, 0xFE
KEEP16, FORGED16 = 0xFFFF, 0xFFFE

# byte 0
HOLD0, HOLD1, HOLD2, HOLD_ALL = 0, 1, 2, 3
NO_COPY, KEEP_CRC, KEEP_OPEN = 0x04, 0x08, 0x10
ORDER_NONE, ORDER_EVENT = 0x20, 0x40


def send(k):
    return bytes([(k << 3) | 0])


def nxt(n):
    out = b""
    while n > 0:
        m = min(n, 32)
        out += bytes([((m - 1) << 3) | 1])
        n -= m
    return out


def meta(k, kind, lay=KEEP, a=KEEP8, b=KEEP8, c=KEEP16):
    return bytes([(k << 3) | 2, kind, lay, a, b]) + struct.pack("<H", c)


def rawmeta(k, data):
    return bytes([(k << 3) | 3, len(data)]) + data


def table(src, index=0, lay=KEEP, off=0, length=0xFFFF, muts=(), bad_magic=False, fds=0):
    s = src | (4 if bad_magic else 0) | (fds << 3)
    out = bytes([4, s, index, lay]) + struct.pack("<HH", off, length)
    out += bytes([len(muts)])
    for pos, x in muts:
        out += struct.pack("<HB", pos, x)
    return out


def raw_table(data, index=0, lay=LA, fds=0):
    return bytes([4, 2 | (fds << 3), index, lay, len(data)]) + data + b"\0"


def recv(n=1):
    out = b""
    while n > 0:
        m = min(n, 32)
        out += bytes([((m - 1) << 3) | 5])
        n -= m
    return out


RELEASE, RELEASE_ALL, HANGUP = bytes([6]), bytes([14]), bytes([7])
TA, TB = 0, 1


def set_meta(kind, layout, a, b, c, magic=0x42535447, reserved=0):
    return struct.pack("<IHHQQII", magic, kind, reserved, layout, a, b, c)


A = send(A_CHUNK) + send(A_P0) + send(A_P1)          # layout A complete
A12 = A + send(A_V1) + send(A_V2)
B = send(B_CHUNK) + send(B_P0) + send(B_P1)


def spares_layout(first=11, c=A_TABLE_LEN):
    """Layout A's pieces from spares, after a forged copy of its table."""
    return (table(TA) + meta(first, PIECE, LA, 0, 2, c) +
            meta(first + 1, PIECE, LA, 1, 2, c))


SEEDS = {
    "all-in-order": bytes([HOLD0]) + nxt(ITEMS) + recv(32),
    "all-held-until-close": bytes([HOLD_ALL | NO_COPY]) + nxt(ITEMS) + recv(32),
    "all-hold-one": bytes([HOLD1]) + nxt(ITEMS),
    "all-order-none": bytes([HOLD0 | ORDER_NONE]) + nxt(ITEMS),
    "all-order-event": bytes([HOLD2 | ORDER_EVENT]) + nxt(ITEMS),
    "interleaved": bytes([HOLD_ALL | KEEP_OPEN]) + nxt(4) + recv() + nxt(1) +
    recv() + RELEASE + nxt(1) + recv() + RELEASE_ALL + nxt(5) + recv(4),
    "layout-b-only": bytes([HOLD0]) + B + send(B_V1) + recv(2) + send(B_END),
    "version-repeated": bytes([HOLD1]) + A + send(A_V1) + recv() +
    meta(11, VERSION, LA, 1, 0, 0) + recv() + meta(12, VERSION, LA, 7, 1, 0),
    "version-bad-copy": bytes([HOLD0]) + A + meta(11, VERSION, LA, 1, 2, 0) +
    meta(12, VERSION, LA, 2, MAX8, 0) + send(A_V1),
    "version-huge-number": bytes([HOLD0]) + A + meta(11, VERSION, LA, MAX8, 0, 0) +
    send(A_V2),
    "version-before-layout": bytes([HOLD0]) + send(A_V1) + A + send(A_V2),
    "version-of-other-layout": bytes([HOLD0]) + A + meta(11, VERSION, LB, 1, 0, 0) +
    meta(12, VERSION, 0x77, 1, 0, 0),
    "replace-valid": bytes([HOLD1]) + A12 + meta(11, REPLACE, LA, 0, 2, 1) +
    meta(12, VERSION, LA, 3, 0, 0) + meta(13, REPLACE, LA, 1, 2, 1) +
    meta(14, VERSION, LA, 4, 1, 0),
    "replace-while-held": bytes([HOLD_ALL]) + A12 + recv(2) +
    meta(11, REPLACE, LA, 0, 2, 1) + meta(12, VERSION, LA, 3, 0, 0) + recv() +
    RELEASE + meta(13, REPLACE, LA, 0, 2, 2) + recv() + RELEASE + RELEASE,
    "replace-refused": bytes([HOLD0]) + A12 + meta(11, REPLACE, LA, 0, 2, 1) +
    meta(12, REPLACE, LA, 0, 2, 1) + meta(13, REPLACE, LA, 2, 2, 2) +
    meta(14, REPLACE, LA, 1, 3, 2) + meta(15, REPLACE, LB, 0, 2, 3) +
    meta(16, REPLACE, LA, 1, 2, 0),
    "replace-wrapped-refused": bytes([HOLD0]) + B + send(B_V1) +
    meta(11, REPLACE, LB, 0, 2, 1) + meta(12, VERSION, LB, 2, 0, 0),
    "piece-shorter-than-table": bytes([HOLD0]) +
    table(TA, muts=[(49, 0x20)]) + meta(11, PIECE, LA, 0, 2, A_TABLE_LEN) +
    A12,
    "end-held": bytes([HOLD_ALL]) + A12 + meta(11, END, LA, 0, 1, 0) +
    meta(12, VERSION, LA, 3, 0, 0),
    "end-unknown-layout": bytes([HOLD0]) + meta(11, END, 0x55, 0, 0, 0) + A12 +
    meta(12, END, LB, 0, 0, 0) + send(A_END),
    "end-then-new-layout": bytes([HOLD1]) + A12 + send(A_END) + B + send(B_V1),
    "half-sent-layout": bytes([HOLD0]) + send(A_CHUNK) + send(A_P0) + B +
    send(B_V1) + send(A_P1) + send(A_V1),
    "half-sent-table": bytes([HOLD0]) + table(TA, length=100) + B + send(B_V1),
    "piece-out-of-order": bytes([HOLD0]) + send(A_CHUNK) + send(A_P1) +
    send(A_P0) + send(A_V1),
    "piece-without-table": bytes([HOLD0]) + send(A_P0) + send(A_P1) + send(A_V1) +
    B + send(B_V1),
    "piece-first-not-zero": bytes([HOLD0]) + send(A_CHUNK) +
    meta(11, PIECE, LA, 1, 2, A_TABLE_LEN) + send(A_P0),
    "piece-wrong-count": bytes([HOLD0]) + table(TA) +
    meta(11, PIECE, LA, 0, 3, A_TABLE_LEN) + A + send(A_V1),
    "piece-wrong-length-said": bytes([HOLD0]) + table(TA) +
    meta(11, PIECE, LA, 0, 2, 100) + table(TA) +
    meta(12, PIECE, LA, 0, 2, 300),
    "pieces-from-spares": bytes([HOLD1]) + spares_layout() +
    meta(13, VERSION, LA, 1, 0, 0) + meta(14, VERSION, LA, 2, 1, 0) + recv(2) +
    meta(15, REPLACE, LA, 1, 2, 5) + meta(16, VERSION, LA, 3, 1, 0),
    "table-in-two-chunks": bytes([HOLD0]) + table(TA, 0, off=0, length=100) +
    table(TA, 1, off=100, length=200) + send(A_P0) + send(A_P1) + send(A_V1),
    "table-chunks-out-of-order": bytes([HOLD0]) + table(TA, 0, off=0, length=100) +
    table(TA, 2, off=100, length=200) + send(A_P0) + send(A_P1) + send(A_V1),
    "table-chunk-of-other-layout": bytes([HOLD0]) + table(TA, 0, off=0, length=100) +
    table(TA, 1, LB, off=100, length=200) + send(A_P0),
    "table-chunks-beyond-its-end": bytes([HOLD0]) + table(TA) + table(TA, 1, off=0,
                                                                     length=40) +
    send(A_P0),
    "table-restarted": bytes([HOLD0]) + table(TB, 0, off=0, length=120) + A +
    send(A_V1),
    "table-bad-checksum": bytes([HOLD0 | KEEP_CRC]) + table(TA, muts=[(60, 1)]) +
    send(A_P0) + send(A_P1) + send(A_V1),
    "table-layout-mismatch": bytes([HOLD0]) + table(TA, lay=LB) +
    meta(11, PIECE, LB, 0, 2, A_TABLE_LEN) + send(B_P0),
    "table-copies-3": bytes([HOLD0]) + table(TA, muts=[(32, 1)]) +
    meta(11, PIECE, LA, 0, 3, A_TABLE_LEN) + meta(12, PIECE, LA, 1, 3, A_TABLE_LEN) +
    meta(13, PIECE, LA, 2, 3, A_TABLE_LEN) + meta(14, VERSION, LA, 1, 2, 0),
    "table-copies-1": bytes([HOLD0]) + table(TA, muts=[(32, 3)]) +
    meta(11, PIECE, LA, 0, 1, A_TABLE_LEN) + meta(12, VERSION, LA, 1, 0, 0) +
    meta(13, REPLACE, LA, 0, 1, 1) + meta(14, VERSION, LA, 2, 0, 0),
    "table-huge-length": bytes([HOLD0]) + table(TA, muts=[(11, 0x10)]) +
    send(A_P0),
    "table-short-first-chunk": bytes([HOLD0]) + table(TA, length=20) + send(A_P0),
    "table-bad-magic": bytes([HOLD0]) + table(TA, bad_magic=True) + send(A_P0) + A +
    send(A_V1),
    "table-chunk-with-fds": bytes([HOLD0]) + table(TA, fds=3) + send(A_P0) +
    send(A_P1) + send(A_V1),
    "table-raw-bytes": bytes([HOLD0]) + raw_table(b"GTSC" * 4) +
    raw_table(b"", fds=1) + send(A_P0),
    "message-not-a-chunk": bytes([HOLD0]) + raw_table(b"\x01" * 40) + A +
    send(A_V1),
    "refused-layout-versions": bytes([HOLD0]) + table(TA, muts=[(200, 0x40)]) +
    send(A_P0) + send(A_P1) + send(A_V1) + send(A_V2) + send(A_END) + B +
    send(B_V1),
    "meta-raw-bad": bytes([HOLD0]) + A + rawmeta(11, b"") +
    rawmeta(12, set_meta(VERSION, 0, 1, 0, 0, magic=0x12345678)) +
    rawmeta(13, set_meta(VERSION, 0, 1, 0, 0, reserved=1)) +
    rawmeta(14, set_meta(9, 0, 1, 0, 0)) +
    rawmeta(15, set_meta(VERSION, 0, 1, 0, 0)[:31]) + send(A_V1),
    "meta-unknown-kind": bytes([HOLD0]) + A + meta(11, 0) + meta(12, 200) +
    send(A_V1),
    "duplicate-buffer": bytes([HOLD0]) + A + send(A_V1) + send(A_V1) +
    send(A_V2),
    "hangup-mid-layout": bytes([HOLD0]) + send(A_CHUNK) + send(A_P0) + HANGUP,
    "hangup-while-held": bytes([HOLD_ALL | KEEP_OPEN]) + A12 + recv(2) + HANGUP,
    "keep-open": bytes([HOLD2 | KEEP_OPEN]) + A12 + recv(1),
}

out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "sets-consumer")
os.makedirs(out, exist_ok=True)
for name in os.listdir(out):
    if name.startswith("seed-"):
        os.remove(os.path.join(out, name))
for name, data in SEEDS.items():
    with open(os.path.join(out, "seed-" + name), "wb") as f:
        f.write(data)
print(f"{len(SEEDS)} seeds in {out}")
