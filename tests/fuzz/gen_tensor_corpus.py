#!/usr/bin/env python3
"""Writes the seed corpus of the tensor meta decoder's fuzz target.

Each file is named STATUS-what.bin, where STATUS is the gpuipc status that
decoding it must give (OK, E_TRUNCATED, ...): the corpus replay test
(tests/test-tensor.c, tensor_meta_fuzz_corpus_replay) checks it. Files the
fuzzer adds later may have any other name; for them the replay only checks
that decoding returns (and that a meta that decodes re-encodes the same).
Layout: docs/tensor-meta.md. Run: python3 tests/fuzz/gen_tensor_corpus.py
"""
import os
import struct

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "tensor-meta")


def meta(dtype=12, shape=(3, 4), strides=None, offset=0, user=b"", magic=b"GPTM",
         version=1, flags=None, reserved=0, ndim=None, ulen=None, extra=b""):
    if flags is None:
        flags = 1 if strides is not None else 0
    b = magic + struct.pack("<BBHHHIQ", version, len(shape) if ndim is None else ndim,
                            dtype, flags, len(user) if ulen is None else ulen,
                            reserved, offset)
    b += b"".join(struct.pack("<q", d) for d in shape)
    if strides is not None:
        b += b"".join(struct.pack("<q", d) for d in strides)
    return b + user + extra


CASES = {
    "OK-f32-3x4": meta(),
    "OK-scalar": meta(dtype=15, shape=()),
    "OK-f8-strided-user": meta(dtype=16, shape=(3, 4), strides=(1, 5), offset=8,
                               user=b"from-python"),
    "OK-bf16-16d": meta(dtype=11, shape=(2,) * 16),
    "OK-broadcast": meta(dtype=17, shape=(4, 4), strides=(0, 1)),
    "OK-empty": meta(dtype=2, shape=(0, 5)),
    "OK-e8m0": meta(dtype=20, shape=(7,), offset=1 << 40),
    "E_BAD_MAGIC-text": b"just some bytes of the application's own",
    "E_BAD_MAGIC-old-format": b"GP\x01\x01\x02\x20\x01\x00" + bytes(12),
    "E_BAD_MAGIC-short": b"GPT",
    "E_TRUNCATED-header": meta()[:20],
    "E_TRUNCATED-shape": meta()[:30],
    "E_TRUNCATED-user": meta(user=b"abc")[:-1],
    "E_BAD_VERSION-2": meta(version=2),
    "E_BAD_VERSION-0": meta(version=0),
    "E_PROTOCOL-ndim-17": meta(shape=(1,) * 17),
    "E_PROTOCOL-flags": meta(flags=2),
    "E_PROTOCOL-reserved": meta(reserved=1),
    "E_PROTOCOL-too-long": meta(extra=b"\0"),
    "E_PROTOCOL-rowmajor-strides": meta(shape=(3, 4), strides=(4, 1)),
    "E_PROTOCOL-empty-strides": meta(shape=(0, 4), strides=(9, 1)),
    "E_BAD_KIND-dtype-0": meta(dtype=0),
    "E_BAD_KIND-dtype-21": meta(dtype=21),
    "E_BAD_KIND-dtype-65535": meta(dtype=65535),
    "E_OUT_OF_RANGE-negative-size": meta(shape=(3, -4)),
    "E_OUT_OF_RANGE-negative-stride": meta(shape=(3, 4), strides=(-1, 1)),
    "E_OUT_OF_RANGE-huge": meta(shape=(1 << 31, 1 << 31, 4)),
    "E_OUT_OF_RANGE-stride-overflow": meta(shape=(3, 4), strides=(1 << 62, 1)),
    "E_OUT_OF_RANGE-offset": meta(offset=(1 << 64) - 8),
}


def main():
    os.makedirs(HERE, exist_ok=True)
    for name, data in CASES.items():
        with open(os.path.join(HERE, name + ".bin"), "wb") as f:
            f.write(data)
    print(f"{len(CASES)} files in {HERE}")


if __name__ == "__main__":
    main()
