#!/usr/bin/env python3
"""Writes the seed corpus of fuzz-ring (tests/fuzz/corpus/ring/).

Each file is an input of fuzz_ring.c (see its opening comment): a mode
byte, then operations, each an opcode and its arguments, read in the order
fuzz_ring.c reads them (bytes past the end read as zeros). The seeds cover
each operation and each attack the target plays: forged records of the four
ring types, records whose length, flags or barrier lie, heads that run back,
past the ring or off a record's boundary, tails outside what was published,
a sleep word of garbage, WAKE frames, bytes rewritten after publishing, and
sends with honest and forged releases until both rings wrap. Replayed by
tests/test-fuzz-corpus.c (fuzz_corpus_ring), which checks that each runs
through the harness without a crash, hang or leak. Record and frame layout:
src/conn/wire.h, docs/protocol.md.

Run: python3 tests/fuzz/gen_ring_corpus.py (rewrites the seeds, keeps the
rest)
"""
import os
import struct

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus",
                    "ring")

# Opcodes (fuzz_ring.c, enum OP_*).
(REC, RAW, HEAD, TAIL, SLEEP, MSG, WAKE, SOCKRAW, DRIVE, SEND, REWRITE, SHUT,
 RELALL, CYCLE, SENDMSG) = range(15)

# Mode bits (byte 0).
MEMOP, NONE, EVENT = 3, 1, 2
POLLING, NS, SENDER, RAWCHECK, SPIN, BLOCKING = 0x04, 0x08, 0x10, 0x20, 0x40, 0x80

# Ring frame kinds of REC's selector (low two bits).
K_BUF, K_BUFS, K_BUFW, K_REL = 0, 1, 2, 3
# Barrier selectors: honest, ahead (+1..), given (u64 follows), one behind.
B_HONEST, B_AHEAD, B_GIVEN, B_BEHIND = 0, 1, 2, 3


def u32(v):
    return struct.pack("<I", v & 0xFFFFFFFF)


def u64(v):
    return struct.pack("<Q", v & 0xFFFFFFFFFFFFFFFF)


def w_buf(seq=1, arena=1, off=0, length=4096, slot=0, chunk=0, flags=1,
          meta_len=0):
    return struct.pack("<QQQQIIII", seq, arena, off, length, slot, chunk,
                       flags, meta_len)


def w_rel(seq=1, slot=0, flags=0):
    return struct.pack("<QII", seq, slot, flags)


def rec_buf(barrier=B_HONEST, meta=b"meta", **kw):
    return bytes([REC, K_BUF, barrier]) + w_buf(**kw) + bytes([len(meta)]) + meta


def rec_bufs(count=2, ready=1, barrier=B_HONEST, meta=b"ab"):
    ents = b"".join(w_buf(seq=i + 1, slot=i, meta_len=1) for i in range(count))
    return (bytes([REC, K_BUFS, barrier, count - 1, ready]) + ents +
            bytes([len(meta)]) + meta)


def rec_bufw(barrier=B_HONEST, value=1, meta=b"w"):
    word = struct.pack("<QQIIQ", 1, 64, 0, 0, value)
    return (bytes([REC, K_BUFW, barrier]) + w_buf() + word + bytes([len(meta)]) +
            meta)


def rec_rel(entries, barrier=B_HONEST, publish=True):
    """entries: a list of (how byte, optional 16 forged bytes)."""
    sel = K_REL | ((len(entries) - 1) << 2) | (0 if publish else 0x40)
    out = bytes([REC, sel, barrier])
    for how, forged in entries:
        out += bytes([how]) + (forged if how & 1 else b"")
    return out


REL_FORGED = [(1, w_rel(1, 0))]
REL_OF_SENT = [(0, b"")]


def raw(len_field, body, flags=None, barrier=B_HONEST, header=False,
        wide=False):
    sel = (1 if wide else 0) | (2 if flags is not None else 0) | (4 if header else 0)
    out = bytes([RAW, sel]) + (u32(len_field) if wide else struct.pack("<H", len_field))
    if flags is not None:
        out += u32(flags)
    return out + bytes([barrier, len(body)]) + body


def head(sel, k=0, value=None):
    return bytes([HEAD, sel, k]) + (u64(value) if value is not None else b"")


def tail(sel, k=0, value=None):
    return bytes([TAIL, sel, k]) + (u64(value) if value is not None else b"")


def drive(rounds=1):
    return bytes([DRIVE, rounds - 1])


def msg(body, nfds=0):
    return bytes([MSG, nfds, len(body)]) + body


def frame_hdr(type_, length, nfds=0):
    check = 0x43504947 ^ length ^ (type_ << 8 | nfds) ^ 0x5A5A5A5A
    return struct.pack("<IBBHII", 0x43504947, 1, type_, nfds, length, check)


SEEDS = {
    "drive-only": [0, drive(4)],
    "ns-polling": [NS | POLLING, drive(2)],
    "blocking": [BLOCKING, drive(2), msg(b"x"), drive()],
    "blocking-spin": [BLOCKING | SPIN, rec_rel(REL_FORGED), drive(2)],
    "rel-forged": [0, rec_rel(REL_FORGED), drive()],
    "rel-unpublished": [0, rec_rel(REL_FORGED, publish=False), drive(),
                        head(0), drive()],
    "buf-forged": [MEMOP, rec_buf(), drive()],
    "buf-meta-lies": [NONE, bytes([REC, K_BUF | 0x80, B_HONEST]) +
                      w_buf(meta_len=200) + bytes([4]) + b"meta", drive()],
    "bufs-forged": [MEMOP, rec_bufs(), drive()],
    "bufs-count-lies": [NONE, bytes([REC, K_BUFS | 0x80, B_HONEST, 1]) +
                        u64(100000) + bytes([0]) + w_buf() * 2 + bytes([0]),
                        drive()],
    "bufw-forged": [MEMOP, rec_bufw(), drive()],
    "head-past-ring": [0, head(3), drive()],
    "head-back": [0, msg(b"a"), rec_rel(REL_FORGED), head(1, 1), drive()],
    "head-rewound": [0, rec_rel(REL_FORGED, publish=False), head(5, 2),
                     rec_rel(REL_FORGED), drive()],
    "head-off-boundary": [0, head(6, 3), drive()],
    "head-anywhere": [0, head(4, 0, 0xFFFFFFFFFFFFFFF0), drive()],
    "head-behind-ring": [0, head(7), drive()],
    "raw-len-lies": [0, raw(1000, bytes(32)), drive()],
    "raw-len-zero": [0, raw(0, bytes(16)), drive()],
    "raw-len-huge": [0, raw(0xFFFFFFF0, bytes(16), wide=True), drive()],
    "raw-flags": [0, raw(32, frame_hdr(8, 16) + w_rel(), flags=1), drive()],
    "raw-short-frame": [0, raw(8, bytes(8)), drive()],
    "raw-header-checks": [0, raw(48, frame_hdr(4, 32) + bytes(32),
                                  header=True), drive()],
    "raw-msg-on-ring": [0, raw(18, frame_hdr(4, 2) + b"hi", header=True),
                        drive()],
    "raw-fds-on-ring": [0, raw(32, frame_hdr(8, 16, nfds=1) + w_rel()),
                        drive()],
    "raw-len-mismatch": [0, raw(32, frame_hdr(8, 32) + w_rel()), drive()],
    "bad-check": [RAWCHECK, rec_rel(REL_FORGED), drive()],
    "barrier-ahead": [0, rec_rel(REL_FORGED, barrier=B_AHEAD), drive(),
                      msg(b"late"), drive()],
    "barrier-never": [0, bytes([REC, K_REL, B_GIVEN]) + u64(1 << 40) + bytes([1]) +
                      w_rel(), drive(2)],
    "barrier-after-msg": [0, msg(b"first", 1), rec_rel(REL_FORGED), drive(2)],
    "barrier-behind": [0, msg(b"one"), msg(b"two"),
                       rec_rel(REL_FORGED, barrier=B_BEHIND), drive()],
    "wake-frames": [0, bytes([WAKE, 0, WAKE, 0]), drive(), bytes([WAKE, 1]),
                    drive()],
    "sleep-garbage": [0, bytes([SLEEP, 1]) + u64(0xDEADBEEFDEADBEEF),
                      bytes([SEND, 0]), drive()],
    "sleep-odd-sender": [MEMOP | SENDER, bytes([SLEEP, 1]) + u64(3), bytes([SEND, 0]),
                         bytes([SEND, 0]), drive()],
    "rewrite-after-publish": [0, rec_rel(REL_FORGED),
                              bytes([REWRITE, 31, 8]) + u64(0x10), drive()],
    "rewrite-length": [0, rec_rel(REL_FORGED), bytes([REWRITE, 47, 4]) +
                       u32(4096), drive()],
    "socket-garbage": [0, bytes([SOCKRAW, 24]) + frame_hdr(99, 8) + bytes(8),
                       drive()],
    "shut": [0, rec_rel(REL_FORGED), bytes([SHUT]), drive()],
    "sendmsg": [0, bytes([SENDMSG, 10]), drive()],
    "send-honest": [MEMOP | SENDER, bytes([SEND, 0]), drive(), bytes([RELALL, 0]),
                    drive()],
    "send-none-honest": [NONE | SENDER | NS, bytes([SEND, 0x21]), drive(),
                         bytes([RELALL, 1]), drive()],
    "send-event": [EVENT | SENDER, bytes([SEND, 0]), bytes([RELALL, 0]), drive()],
    "send-tail-ahead": [MEMOP | SENDER, bytes([SEND, 0]), tail(1, 1),
                        bytes([SEND, 0]), drive()],
    "send-tail-back": [NONE | SENDER, bytes([SEND, 0]), tail(0),
                       bytes([SEND, 0]), tail(3, 1), bytes([SEND, 0]), drive()],
    "send-tail-anywhere": [NONE | SENDER, tail(2, 0, 1 << 63), bytes([SEND, 0]),
                           drive()],
    "send-tail-behind-ring": [NONE | SENDER, bytes([SEND, 0]), tail(4),
                              bytes([SEND, 0])],
    "send-tail-inside": [NONE | SENDER, bytes([SEND, 2]), tail(5, 1),
                         bytes([SEND, 0]), drive()],
    "send-rel-mutated": [MEMOP | SENDER, bytes([SEND, 3]),
                         rec_rel([(0, b""), (2, b""), (0x40, b""), (0x80, b"")]),
                         drive()],
    "send-rel-by-next": [NONE | SENDER, bytes([SEND, 1]),
                         rec_rel([(0x20, b""), (2, b"")]), drive()],
    "send-rel-twice": [NONE | SENDER, bytes([SEND, 0]),
                       rec_rel([(0, b""), (0, b"")]), drive()],
    "send-then-shut": [MEMOP | SENDER, bytes([SEND, 1]), bytes([SHUT]),
                       bytes([SEND, 0]), drive()],
    "send-big-meta": [MEMOP | SENDER, bytes([SEND, 0xF8]), bytes([RELALL, 0]),
                      drive()],
    "cycle-wrap-none": [NONE | SENDER, bytes([CYCLE, 0]), rec_rel(REL_FORGED),
                        drive()],
    "cycle-wrap-memop": [MEMOP | SENDER, bytes([CYCLE, 2]), drive(),
                         raw(1000, bytes(64)), drive()],
    "cycle-wrap-head-back": [NONE | SENDER, bytes([CYCLE, 0]), head(1, 4),
                             drive()],
    "cycle-wrap-blocking": [NONE | SENDER | BLOCKING, bytes([CYCLE, 0]),
                            drive()],
}


def main():
    os.makedirs(HERE, exist_ok=True)
    for name, parts in SEEDS.items():
        data = bytes([parts[0]]) + b"".join(parts[1:])
        assert len(data) <= 1024, name
        with open(os.path.join(HERE, name + ".bin"), "wb") as f:
            f.write(data)
    print(f"wrote {len(SEEDS)} seeds to {HERE}")


if __name__ == "__main__":
    main()
