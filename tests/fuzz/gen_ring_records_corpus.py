#!/usr/bin/env python3
"""Writes the seed corpus of fuzz-ring-records (corpus/ring-records): one
program per case the target's comment lists, in its byte language (byte 0:
bit 0 polling, bit 1 record lengths as written; then opcodes)."""
import os
import struct

REC, HEAD, TAIL, SLEEP, GET, PUT, WAKE, WAIT, POLL, POKE = range(10)


def rec(n, barrier=0, fill=0x41):
    return bytes([REC]) + struct.pack("<HQ", n, barrier) + bytes([fill]) * n


def lying_rec(n, hdr_len, flags, barrier=0):
    return bytes([REC]) + struct.pack("<HQ", n, barrier) + struct.pack("<HB", hdr_len, flags) + b"\x42" * n


def get(cap=4096):
    return bytes([GET]) + struct.pack("<H", cap)


def put(n):
    return bytes([PUT]) + struct.pack("<H", n)


def u64(op, v):
    return bytes([op]) + struct.pack("<Q", v & (2**64 - 1))


SEEDS = {
    "one-record": b"\0" + rec(24) + get(),
    "records-wrap": b"\0" + (rec(1000) + get()) * 12,
    "get-small-cap": b"\0" + rec(100) + get(50),
    "head-past-ring": b"\0" + u64(HEAD, 1 << 20) + get(),
    "head-runs-back": b"\0" + rec(64) + get() + u64(HEAD, 0) + get(),
    "length-lies": b"\2" + lying_rec(32, 4000, 0) + get(),
    "flags-set": b"\2" + lying_rec(32, 32, 1) + get(),
    "zero-length": b"\2" + lying_rec(0, 0, 0) + get(),
    "put-honest-tail": b"\0" + put(100) + u64(TAIL, 128) + put(3000) + put(3000),
    "put-tail-lies": b"\0" + put(100) + u64(TAIL, 1 << 40) + put(10),
    "put-until-full": b"\0" + put(2000) * 6,
    "wake-odd-even": b"\0" + u64(SLEEP, 3) + bytes([WAKE]) + bytes([WAKE]) + u64(SLEEP, 4) + bytes([WAKE]),
    "wait-and-poll": b"\1" + rec(16) + bytes([WAIT]) + get() + bytes([POLL, 0, WAIT, POLL, 1]),
    "rewritten": b"\0" + rec(64) + bytes([POKE]) + struct.pack("<HB", 0, 0xff) + get(),
    "many-small": b"\0" + (rec(8) * 20) + get() * 21,
}

out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "ring-records")
os.makedirs(out, exist_ok=True)
for name, data in SEEDS.items():
    with open(os.path.join(out, name), "wb") as f:
        f.write(data)
print(f"{len(SEEDS)} seeds in {out}")
