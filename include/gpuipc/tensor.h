/*
 * gpuipc/tensor.h: the element types every part of gpuipc speaks (one
 * vocabulary: tensor sets, the tensor meta, the Python package) and the
 * tensor meta format: what a tensor is (dtype, shape, strides, offset)
 * written into the meta bytes of a buffer sent with gpuipc_conn_send, so
 * that a consumer in any language reads what a producer in any other sent.
 *
 * Included from gpuipc.h; do not include it on its own.
 *
 * Experimental: every function here is GPUIPC_EXPERIMENTAL (gpuipc.h) and
 * may still change in a minor release.
 *
 * The byte layout is in docs/tensor-meta.md. A producer fills a
 * gpuipc_tensor_meta, encodes it (gpuipc_tensor_meta_encode) and passes the
 * bytes as the send's meta; a consumer decodes the meta it received
 * (gpuipc_tensor_meta_decode: hostile input, every field checked) and
 * checks the tensor against the buffer it came with
 * (gpuipc_tensor_meta_check), then reads element (i0, i1, ...) at
 *
 *   buffer + offset + dtype_size * (i0 * strides[0] + i1 * strides[1] + ...)
 *
 * Meta bytes that do not start with the format's magic are not a tensor
 * meta (decode says GPUIPC_E_BAD_MAGIC): the producer sent bytes of its
 * own. Application bytes can travel behind the tensor (user, user_len).
 *
 * All functions here are pure: no driver, no allocation, any thread.
 */
#ifndef GPUIPC_TENSOR_H
#define GPUIPC_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- element types --------------------------------------------------------- */

/* Element types. Codes are part of the wire formats (the tensor meta, the
 * tensor-set table): never renumbered, only appended. Each maps to one
 * DLPack (code, bits, lanes = 1) (gpuipc_dtype_to_dlpack). */
typedef enum gpuipc_dtype {
  GPUIPC_DTYPE_BOOL = 1,
  GPUIPC_DTYPE_U8 = 2,
  GPUIPC_DTYPE_I8 = 3,
  GPUIPC_DTYPE_U16 = 4,
  GPUIPC_DTYPE_I16 = 5,
  GPUIPC_DTYPE_U32 = 6,
  GPUIPC_DTYPE_I32 = 7,
  GPUIPC_DTYPE_U64 = 8,
  GPUIPC_DTYPE_I64 = 9,
  GPUIPC_DTYPE_F16 = 10,
  GPUIPC_DTYPE_BF16 = 11,
  GPUIPC_DTYPE_F32 = 12,
  GPUIPC_DTYPE_F64 = 13,
  GPUIPC_DTYPE_C64 = 14,  /* complex of two f32 */
  GPUIPC_DTYPE_C128 = 15, /* complex of two f64 */
  GPUIPC_DTYPE_F8_E4M3FN = 16,   /* OCP FP8 E4M3 (torch.float8_e4m3fn) */
  GPUIPC_DTYPE_F8_E5M2 = 17,     /* OCP FP8 E5M2 (torch.float8_e5m2) */
  GPUIPC_DTYPE_F8_E4M3FNUZ = 18, /* torch.float8_e4m3fnuz */
  GPUIPC_DTYPE_F8_E5M2FNUZ = 19, /* torch.float8_e5m2fnuz */
  GPUIPC_DTYPE_F8_E8M0FNU = 20   /* MX scale (torch.float8_e8m0fnu) */
} gpuipc_dtype;

/* Bytes per element of a dtype; 0 for a code that is not one. */
GPUIPC_EXPERIMENTAL GPUIPC_API size_t gpuipc_dtype_get_size(int dtype);
/* "bool", "u8", ..., "bf16", "f8_e4m3fn"; "unknown" otherwise. Static. */
GPUIPC_EXPERIMENTAL GPUIPC_API const char *gpuipc_dtype_name(int dtype);
/* The dtype of a DLPack data type (dlpack.h's DLDataType: code, bits,
 * lanes), e.g. (kDLFloat = 2, 32, 1) -> GPUIPC_DTYPE_F32,
 * (kDLFloat8_e4m3fn = 10, 8, 1) -> GPUIPC_DTYPE_F8_E4M3FN; 0 for one that
 * has no gpuipc_dtype (vectors with lanes != 1, sub-byte types, opaque
 * handles). */
GPUIPC_EXPERIMENTAL GPUIPC_API int gpuipc_dtype_from_dlpack(uint8_t code, uint8_t bits,
                                        uint16_t lanes);
/* The DLPack data type of a dtype (lanes is always 1);
 * GPUIPC_E_BAD_KIND for a code that is not one (the outputs untouched). */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_dtype_to_dlpack(int dtype,
                                                uint8_t *code /* OUT */,
                                                uint8_t *bits /* OUT */,
                                                uint16_t *lanes /* OUT */);

/* ---- the tensor meta --------------------------------------------------------- */

/* Most dimensions of a tensor meta. (A strided tensor of more than 14
 * dimensions does not fit GPUIPC_META_MAX, the meta a send carries.) */
#define GPUIPC_TENSOR_NDIM_MAX 16
/* The encoded meta starts with these 4 bytes ("GPTM"), then its version. */
#define GPUIPC_TENSOR_META_MAGIC "GPTM"
#define GPUIPC_TENSOR_META_VERSION 1
/* Bytes of the fixed header; a meta is GPUIPC_TENSOR_META_HDR + 8 * ndim
 * (shape) [+ 8 * ndim (strides)] + user_len bytes. */
#define GPUIPC_TENSOR_META_HDR 24
/* Largest user_len the format carries. */
#define GPUIPC_TENSOR_META_USER_MAX 65535

/* One tensor in a buffer. */
typedef struct gpuipc_tensor_meta {
  int dtype;   /* a gpuipc_dtype */
  int ndim;    /* 0 .. GPUIPC_TENSOR_NDIM_MAX (0: a scalar, one element) */
  int64_t shape[GPUIPC_TENSOR_NDIM_MAX]; /* the first ndim, each >= 0 */
  /* Strides in elements (not bytes), each >= 0, the first ndim. Read on
   * encode only when has_strides is set; decode always fills them (the
   * row-major ones when the producer sent none). */
  int64_t strides[GPUIPC_TENSOR_NDIM_MAX];
  /* Encode: 1 when strides[] says the layout, 0 for row-major contiguous
   * (strides[] ignored). Strides equal to the row-major ones are not
   * written (one encoding per layout): decode sets has_strides only for a
   * tensor that is not row-major contiguous. */
  int has_strides;
  uint64_t offset; /* bytes from the buffer's start to element 0 */
  /* Application bytes carried behind the tensor (0 ..
   * GPUIPC_TENSOR_META_USER_MAX; user may be NULL when user_len is 0).
   * Encode copies them; decode points user into its input (valid as long
   * as the input is). */
  const void *user;
  size_t user_len;
} gpuipc_tensor_meta;

/* Writes the encoded meta into out (cap bytes) and its length into *len.
 * The meta is checked first (as gpuipc_tensor_meta_check with no buffer
 * bound): GPUIPC_E_INVALID_ARG for a dtype that is not one, ndim outside
 * 0 .. GPUIPC_TENSOR_NDIM_MAX, a negative size or stride, an extent that
 * overflows, user_len above GPUIPC_TENSOR_META_USER_MAX (or user NULL
 * with a length); the message says which. GPUIPC_E_LIMIT when cap is too
 * small: *len then says how many bytes it takes (out may be NULL with cap
 * 0 to ask). Nothing is written to out on failure. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tensor_meta_encode(const gpuipc_tensor_meta *m,
                                                   void *out, size_t cap,
                                                   size_t *len /* OUT */);

/* Decodes len bytes (hostile input: nothing outside them is read) into
 * *out. GPUIPC_E_BAD_MAGIC: not a tensor meta (the bytes are the
 * producer's own); GPUIPC_E_TRUNCATED: shorter than its header or than
 * its fields say; GPUIPC_E_BAD_VERSION; GPUIPC_E_PROTOCOL: longer than its
 * fields say, reserved bits or bytes not zero, ndim above
 * GPUIPC_TENSOR_NDIM_MAX, strides sent for a row-major tensor;
 * GPUIPC_E_BAD_KIND: a dtype that is not one; GPUIPC_E_OUT_OF_RANGE: a
 * negative size or stride, an extent (offset included) beyond 2^62 bytes.
 * On failure *out is zeroed. A meta that decodes re-encodes to the same
 * bytes. Check it against its buffer (gpuipc_tensor_meta_check) before
 * reading through it. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tensor_meta_decode(const void *in, size_t len,
                                                   gpuipc_tensor_meta *out /* OUT */);

/* The bytes the tensor spans from element 0: 0 when a size is 0, else
 * dtype_size * (1 + sum over i of (shape[i] - 1) * strides[i]) (the
 * row-major strides when has_strides is 0). GPUIPC_E_BAD_KIND (dtype),
 * GPUIPC_E_INVALID_ARG (ndim), GPUIPC_E_OUT_OF_RANGE (a negative size or
 * stride, beyond 2^62). */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tensor_meta_get_extent(const gpuipc_tensor_meta *m,
                                                       uint64_t *bytes /* OUT */);

/* Checks that the tensor lies inside a buffer of buffer_bytes bytes:
 * offset + extent <= buffer_bytes (SIZE_MAX: no bound), with the checks of
 * gpuipc_tensor_meta_get_extent first. GPUIPC_E_OUT_OF_RANGE otherwise,
 * the message giving both. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tensor_meta_check(const gpuipc_tensor_meta *m,
                                                  size_t buffer_bytes);

/* Fills strides[] with the row-major strides of shape[] (a size 0 counts
 * as 1) and sets has_strides to 0. */
GPUIPC_EXPERIMENTAL GPUIPC_API void gpuipc_tensor_meta_set_contiguous(gpuipc_tensor_meta *m);

/* 1 when the layout is row-major contiguous (sizes of 1 and of 0
 * allowed any stride), else 0. */
GPUIPC_EXPERIMENTAL GPUIPC_API int gpuipc_tensor_meta_is_contiguous(const gpuipc_tensor_meta *m);

#ifdef __cplusplus
}
#endif

#endif /* GPUIPC_TENSOR_H */
