#!/usr/bin/env python3
"""Writes the seed corpus of the descriptor decoder's fuzz target.

Each file is named STATUS-what.bin, where STATUS is the gpuipc status that
decoding it must give (OK, E_TRUNCATED, ...): the corpus replay test
(tests/test-handle-fuzz-corpus.c) checks it. Files the fuzzer adds later may
have any other name; for them the replay only checks that decoding returns.
Layout: docs/descriptor.md. Run: python3 tests/fuzz/gen_corpus.py
"""
import os
import struct

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "descriptor")


def crc32c(data, crc=0):
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def desc(type_=1, kind=3, nfds=0, flags=0, handle_len=None, exporter_fd=-1,
         device=bytes(range(16)), boot_id=bytes([0xB0] * 16), pidns=4026531836,
         pid=4242, reserved=0, start_time=123456, pool_id=0, buffer_id=7,
         generation=3, offset=256, size=1024, alloc_size=4096, handle=None,
         version=1, length=192, magic=0x43504947, extra=b"", fix_crc=True):
    if handle_len is None:
        handle_len = 64 if (type_ == 3 or kind in (1, 3)) and type_ != 2 else 0
    if handle is None:
        handle = bytes((i * 7 + 1) & 0xFF for i in range(handle_len)) + bytes(64 - handle_len)
    b = struct.pack("<IHBBIIBBHi16s16sQiIQQQQQQQ64s", magic, version, type_, kind,
                    length, 0, nfds, flags, handle_len, exporter_fd, device,
                    boot_id, pidns, pid, reserved, start_time, pool_id,
                    buffer_id, generation, offset, size, alloc_size, handle)
    assert len(b) == 192, len(b)
    b += extra
    if fix_crc:
        c = crc32c(b)
        b = b[:12] + struct.pack("<I", c) + b[16:]
    return b


def main():
    os.makedirs(HERE, exist_ok=True)
    files = {
        "OK-legacy-buffer": desc(),
        "OK-mempool-buffer": desc(kind=1, nfds=1, exporter_fd=5, pool_id=2),
        "OK-vmm-buffer": desc(kind=2, nfds=1, exporter_fd=6, offset=0, size=2 << 20, alloc_size=2 << 20),
        "OK-pinned-host-buffer": desc(kind=4, nfds=1, exporter_fd=7, offset=0, size=4096, alloc_size=4096),
        "OK-wrapped-legacy": desc(flags=1, generation=0, offset=100, size=28, alloc_size=4096),
        "OK-pool": desc(type_=2, kind=1, nfds=1, exporter_fd=9, pool_id=4, offset=0, size=0, alloc_size=0),
        "OK-event": desc(type_=3, kind=16, offset=0, size=0, alloc_size=0),
        "OK-longer-same-version": desc(length=200, extra=bytes(8)),
        "OK-live-key": desc(kind=4, nfds=1, exporter_fd=7, offset=0, size=4096, alloc_size=4096,
                            length=200, extra=struct.pack("<Q", 0x8d2f55e01c9a4b37)),
        "E_TRUNCATED-empty": b"",
        "E_TRUNCATED-3-bytes": desc()[:3],
        "E_TRUNCATED-header-only": desc()[:16],
        "E_TRUNCATED-half": desc()[:96],
        "E_TRUNCATED-one-short": desc()[:191],
        "E_BAD_MAGIC-zeros": bytes(192),
        "E_BAD_MAGIC-text": b"GPU-00000000-0000-0000-0000-000000000000",
        "E_BAD_MAGIC-swapped": desc(magic=0x47495043),
        "E_BAD_VERSION-2": desc(version=2),
        "E_BAD_VERSION-0": desc(version=0),
        "E_BAD_CHECKSUM-flipped-size": None,  # filled below
        "E_BAD_CHECKSUM-zero-crc": desc(fix_crc=False),
        "E_BAD_KIND-type-9": desc(type_=9),
        "E_BAD_KIND-kind-0": desc(kind=0),
        "E_BAD_KIND-pool-of-legacy": desc(type_=2, kind=3, handle_len=0, offset=0, size=0, alloc_size=0),
        "E_PROTOCOL-trailing": desc() + b"\x00",
        "E_PROTOCOL-length-small": desc(length=100)[:100] + bytes(92),
        "E_PROTOCOL-length-huge": desc(length=100000),
        "E_PROTOCOL-handle-len": desc(handle_len=12),
        "E_PROTOCOL-reserved": desc(reserved=1),
        "E_PROTOCOL-legacy-with-fd": desc(nfds=1),
        "E_PROTOCOL-flags": desc(flags=0x80),
        "E_PROTOCOL-pid-0": desc(pid=0),
        "E_OUT_OF_RANGE-size-beyond": desc(offset=4000, size=1024, alloc_size=4096),
        "E_OUT_OF_RANGE-overflow": desc(offset=2**64 - 16, size=32, alloc_size=4096),
        "E_OUT_OF_RANGE-empty": desc(size=0),
    }
    b = bytearray(desc())
    b[112] ^= 0x40
    files["E_BAD_CHECKSUM-flipped-size"] = bytes(b)
    # A declared length below the minimum must not be read past: lengths
    # check before the checksum.
    files["E_PROTOCOL-length-small"] = desc(length=100, fix_crc=False)
    for name, data in files.items():
        with open(os.path.join(HERE, name + ".bin"), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
