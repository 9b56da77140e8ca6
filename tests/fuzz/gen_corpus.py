#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<name>/).

descriptor: each file is named STATUS-what.bin, where STATUS is the gpuipc status that
decoding it must give (OK, E_TRUNCATED, ...): the corpus replay test
(tests/test-handle-fuzz-corpus.c) checks it. Files the fuzzer adds later may
have any other name; for them the replay only checks that decoding returns.
Layout: docs/descriptor.md.

frames, handshake, xfer-header: inputs of fuzz_frames.c, fuzz_handshake.c
and fuzz_xfer_header.c (see their opening comments for the input format),
replayed by tests/test-fuzz-corpus.c, which checks that each one runs
through the target's harness without a crash or leak. Frame layout:
docs/protocol.md and src/conn/wire.h.

Run: python3 tests/fuzz/gen_corpus.py (rewrites the seeds, keeps the rest)
"""
import os
import struct

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
HERE = os.path.join(CORPUS, "descriptor")


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


# ---- connection frames -------------------------------------------------------

FRAME_MAGIC = 0x43504947
F = dict(HELLO=1, ACCEPT=2, REFUSE=3, MSG=4, CHUNK=5, CTL=6, BUF=7, REL=8,
         BYE=9, BUFD=10, EVD=11, ABANDON=12, BUFS=13, BUFW=14)


def frame(type_, payload=b"", nfds=0, magic=FRAME_MAGIC, version=1,
          length=None, check=None):
    n = len(payload) if length is None else length
    if check is None:
        check = (magic ^ n ^ ((type_ << 8) | nfds) ^ 0x5A5A5A5A) & 0xFFFFFFFF
    return struct.pack("<IBBHII", magic, version, type_, nfds, n, check) + payload


def hello(pid=4242, uid=1000, gid=1000, proto=2, max_outstanding=256):
    return struct.pack("<IIiIIIQ16s", proto, 0, pid, uid, gid,
                       max_outstanding, 123456, bytes([0xB0] * 16))


def w_chunk(arena=1, size=1 << 20, chunk=0, d=b""):
    return struct.pack("<QQII", arena, size, chunk, len(d)) + d


def w_ctl(arena=1, off=0, chunk=0, nslots=4):
    return struct.pack("<QQII", arena, off, chunk, nslots)


def w_buf(seq=1, arena=1, off=0, length=256, slot=0, chunk=0, flags=1, meta=b""):
    return struct.pack("<QQQQIIII", seq, arena, off, length, slot, chunk,
                       flags, len(meta)) + meta


def w_rel(seq=1, slot=0, flags=0):
    return struct.pack("<QII", seq, slot, flags)


def w_bufs(entries, metas=b"", ready=None, flags=0, pad=0):
    n = len(entries)
    return (struct.pack("<IIII", n, n - 1 if ready is None else ready, flags,
                        pad) + b"".join(entries) + metas)


def w_word(arena=1, off=0, chunk=0, value=5, pad=0):
    return struct.pack("<QQIIQ", arena, off, chunk, pad, value)


def w_evd(slot=0, which=0, d=b""):
    return struct.pack("<IIII", slot, which, len(d), 0) + d


def frames_corpus():
    pool_desc = desc(kind=1, nfds=1, exporter_fd=5, pool_id=2, offset=0,
                     size=1 << 20, alloc_size=1 << 20)
    ev_desc = desc(type_=3, kind=16, offset=0, size=0, alloc_size=0)
    chunk = frame(F["CHUNK"], w_chunk(d=pool_desc), nfds=1)
    ctl = frame(F["CTL"], w_ctl())
    buf = frame(F["BUF"], w_buf(meta=b"shape=4x4"))
    bufd = frame(F["BUFD"], w_buf(flags=3, meta=b"m")[:48] +
                 struct.pack("<II", len(pool_desc), 0) + pool_desc + b"m", nfds=1)
    # The first byte is the harness's control byte (fuzz_frames.c): bits
    # 0-2 descriptors to send, bit 3 raw checks, bits 4-5 order mode,
    # bit 6 keep the peer open, bit 7 the real exporter's
    # frames first.
    return {
        "nothing": b"\x00",
        "msg": b"\x00" + frame(F["MSG"], b"hello"),
        "msg-empty": b"\x00" + frame(F["MSG"]),
        "msg-two": b"\x00" + frame(F["MSG"], b"one") + frame(F["MSG"], b"two"),
        "msg-fd": b"\x01" + frame(F["MSG"], b"with fd", nfds=1),
        "msg-3fds": b"\x03" + frame(F["MSG"], b"fds", nfds=3),
        "msg-fd-missing": b"\x00" + frame(F["MSG"], b"x", nfds=1),
        "msg-surplus-fds": b"\x02" + frame(F["MSG"], b"x", nfds=1),
        # After the real exporter's recorded frames (bit 7): its chunk,
        # flag words and two buffers (slots 0, 1; sequence 1, 2).
        "real": b"\x80",
        "real-none": b"\x90",
        "real-event": b"\xa0",
        "real-open": b"\xc0",
        "real-then-msg": b"\xc0" + frame(F["MSG"], b"after"),
        "real-then-buf": b"\xc0" + frame(F["BUF"], w_buf(seq=3, slot=2, off=8192)),
        "real-then-buf-reused-slot": b"\xc0" + frame(F["BUF"], w_buf(seq=1, slot=0)),
        "real-then-buf-outside": b"\xc0" + frame(F["BUF"], w_buf(seq=3, slot=2, off=1 << 20)),
        "real-then-rel": b"\xc0" + frame(F["REL"], w_rel(1, 0)),
        "real-then-rel-by-next": b"\xc0" + frame(F["REL"], w_rel(1, 0, 1)),
        "real-then-buf-done": b"\xc0" + frame(F["BUF"], w_buf(seq=3, slot=2, off=8192, flags=9)),
        "real-then-buf-done-unordered": b"\xc0" + frame(F["BUF"], w_buf(seq=3, slot=2, flags=8)),
        "real-then-bufs": b"\xc0" + frame(F["BUFS"], w_bufs(
            [w_buf(seq=3, slot=2, off=8192, meta=b"")[:44] + struct.pack("<I", 2),
             w_buf(seq=4, slot=3, off=12288, flags=9)], metas=b"ab")),
        "real-then-bufs-dup-slot": b"\xc0" + frame(F["BUFS"], w_bufs(
            [w_buf(seq=3, slot=2), w_buf(seq=4, slot=2)])),
        "real-then-bufs-second-outside": b"\xc0" + frame(F["BUFS"], w_bufs(
            [w_buf(seq=3, slot=2), w_buf(seq=4, slot=3, off=1 << 20)])),
        "real-then-bufs-count-0": b"\xc0" + frame(F["BUFS"], struct.pack("<IIII", 0, 0, 0, 0)),
        "real-then-bufs-count-huge": b"\xc0" + frame(F["BUFS"], struct.pack("<IIII", 0xFFFFFFFF, 0xFFFFFFFE, 0, 0)),
        "real-then-bufs-meta-short": b"\xc0" + frame(F["BUFS"], w_bufs(
            [w_buf(seq=3, slot=2, meta=b"")[:44] + struct.pack("<I", 9)], metas=b"x")),
        "real-then-bufw": b"\xc0" + frame(F["BUFW"], w_buf(seq=3, slot=2, off=8192) + w_word(off=64)),
        "real-then-bufw-outside": b"\xc0" + frame(F["BUFW"], w_buf(seq=3, slot=2) + w_word(off=1 << 20)),
        "real-then-bufw-misaligned": b"\xc0" + frame(F["BUFW"], w_buf(seq=3, slot=2) + w_word(off=3)),
        "real-then-bufw-many-words": b"\xc0" + b"".join(
            frame(F["BUFW"], w_buf(seq=3 + i, slot=2 + i) + w_word(off=8 * i)) for i in range(9)),
        "real-then-ctl-again": b"\xc0" + ctl,
        "real-then-bye": b"\xc0" + frame(F["BYE"]),
        "msg-open-partial": b"\x40" + frame(F["MSG"], b"partial")[:12],
        "msg-too-long": b"\x00" + frame(F["MSG"], length=65537),
        "len-over-max": b"\x00" + frame(F["MSG"], length=0x7FFFFFFF),
        "bad-magic": b"\x00" + frame(F["MSG"], b"x", magic=0x12345678),
        "bad-version": b"\x00" + frame(F["MSG"], b"x", version=2),
        "bad-check": b"\x08" + frame(F["MSG"], b"x", check=0),
        "type-hello-late": b"\x00" + frame(F["HELLO"], hello()),
        "type-0": b"\x00" + frame(0),
        "type-12": b"\x00" + frame(12),
        "bye": b"\x00" + frame(F["BYE"]),
        "bye-then-msg": b"\x00" + frame(F["BYE"]) + frame(F["MSG"], b"late"),
        "chunk": b"\x01" + chunk,
        "chunk-no-fd": b"\x00" + frame(F["CHUNK"], w_chunk(d=pool_desc)),
        "chunk-short": b"\x00" + frame(F["CHUNK"], b"\x01" * 8),
        "chunk-twice": b"\x02" + chunk + chunk,
        "chunk-ctl-buf": b"\x01" + chunk + ctl + buf,
        "chunk-ctl-buf-none": b"\x11" + chunk + ctl + buf,
        "chunk-ctl-buf-event": b"\x21" + chunk + ctl +
                               frame(F["EVD"], w_evd(d=ev_desc)) +
                               frame(F["BUF"], w_buf(flags=5)),
        "ctl-first": b"\x00" + ctl,
        "buf-first": b"\x00" + buf,
        "bufd": b"\x01" + chunk + ctl + bufd,
        "rel-unsolicited": b"\x00" + frame(F["REL"], w_rel() + w_rel(2, 1)),
        "rel-odd-size": b"\x00" + frame(F["REL"], b"\x00" * 17),
        "evd": b"\x20" + frame(F["EVD"], w_evd(d=ev_desc)),
        "evd-bad-pad": b"\x20" + frame(F["EVD"], struct.pack("<IIII", 0, 0, 0, 1)),
        "fds-without-frame": b"\x01" + frame(F["MSG"], b"x")[:8],
    }


def handshake_corpus():
    acc = frame(F["ACCEPT"])
    h = frame(F["HELLO"], hello())
    return {
        "hello-accept": h + acc,
        "hello-accept-msg": h + acc + frame(F["MSG"], b"after"),
        "hello-only": h,
        "hello-refuse": h + frame(F["REFUSE"], b"no thanks"),
        "refuse-first": frame(F["REFUSE"], b"go away"),
        "hello-short": frame(F["HELLO"], hello()[:20]),
        "hello-long": frame(F["HELLO"], hello() + bytes(64)) + acc,
        "hello-proto-1": frame(F["HELLO"], hello(proto=1)) + acc,
        "hello-proto-3": frame(F["HELLO"], hello(proto=3)) + acc,
        "hello-max-out-0": frame(F["HELLO"], hello(max_outstanding=0)) + acc,
        "hello-max-out-huge": frame(F["HELLO"], hello(max_outstanding=0xFFFFFFFF)) + acc,
        "hello-513": frame(F["HELLO"], bytes(513)),
        "hello-with-fds": frame(F["HELLO"], hello(), nfds=1) + acc,
        "hello-bad-check": frame(F["HELLO"], hello(), check=1) + acc,
        "hello-bad-version": frame(F["HELLO"], hello(), version=9) + acc,
        "msg-first": frame(F["MSG"], b"x"),
        "accept-first": acc + h,
        "hello-hello": h + h,
        "hello-accept-garbage": h + acc + b"GARBAGE!" * 4,
        "truncated-header": h[:10],
        "empty": b"",
        "text": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    }


# ---- xfer shared segment header -------------------------------------------------

def xfer_header(magic=0x53585047, version=1, header_bytes=40, nslots=4,
                slot_bytes=1 << 16, data_offset=None, total=None, page=4096):
    if data_offset is None:
        ctrl_end = 256 + nslots * 128
        data_offset = (ctrl_end + page - 1) // page * page
    if total is None:
        total = (data_offset + slot_bytes * nslots) & (2**64 - 1)
    return struct.pack("<IIIIQQQ", magic, version, header_bytes, nslots,
                       slot_bytes, data_offset, total)


def xfer_corpus():
    return {
        "ok-4-slots": xfer_header(),
        "ok-1-slot": xfer_header(nslots=1, slot_bytes=4096),
        "ok-1024-slots": xfer_header(nslots=1024, slot_bytes=4096),
        "bad-magic": xfer_header(magic=0),
        "bad-version": xfer_header(version=2),
        "bad-header-bytes": xfer_header(header_bytes=48),
        "slots-0": xfer_header(nslots=0),
        "slots-1025": xfer_header(nslots=1025),
        "slot-bytes-0": xfer_header(slot_bytes=0),
        "slot-bytes-unaligned": xfer_header(slot_bytes=4097),
        "data-offset-wrong": xfer_header(data_offset=8192),
        "total-wrong": xfer_header(total=1),
        "overflow": xfer_header(nslots=2, slot_bytes=(1 << 63)),
        "truncated": xfer_header()[:39],
        "empty": b"",
        "with-tail": xfer_header() + bytes(64),
    }


def write_all(name, files):
    d = os.path.join(CORPUS, name)
    os.makedirs(d, exist_ok=True)
    for n, data in files.items():
        with open(os.path.join(d, n + ".bin"), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
    write_all("frames", frames_corpus())
    write_all("handshake", handshake_corpus())
    write_all("xfer-header", xfer_corpus())
