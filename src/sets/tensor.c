/*
 * tensor.c: the one dtype vocabulary (sizes, names, DLPack codes) and the
 * tensor meta format (include/gpuipc/tensor.h, docs/tensor-meta.md): a
 * tensor's dtype, shape, strides and offset in a buffer's meta bytes, the
 * same bytes whichever language wrote them. The extent computation here
 * is the only one: tensor-set tables (table.c) use it too.
 *
 * The decoder treats its input as hostile: it reads only the bytes it was
 * given, checks every field, and accepts exactly what the encoder writes
 * (one encoding per tensor: reserved bytes zero, strides omitted when they
 * are the row-major ones), so that a meta that decodes re-encodes to the
 * same bytes. Sizes and strides are bounded so that no product or sum in
 * the extent can overflow before the 2^62 check.
 */
#include "sets_int.h"

#include <stdio.h>
#include <string.h>

/* ---- dtypes ---------------------------------------------------------------- */

/* DLPack's type codes (dlpack.h, DLDataTypeCode, v1.0+). */
enum {
  DL_INT = 0, DL_UINT = 1, DL_FLOAT = 2, DL_BFLOAT = 4, DL_COMPLEX = 5,
  DL_BOOL = 6, DL_F8_E4M3FN = 10, DL_F8_E4M3FNUZ = 11, DL_F8_E5M2 = 12,
  DL_F8_E5M2FNUZ = 13, DL_F8_E8M0FNU = 14
};

static const struct {
  const char *name;
  uint8_t size;
  uint8_t dl_code;
} dtypes[] = {
    [GPUIPC_DTYPE_BOOL] = {"bool", 1, DL_BOOL},
    [GPUIPC_DTYPE_U8] = {"u8", 1, DL_UINT},
    [GPUIPC_DTYPE_I8] = {"i8", 1, DL_INT},
    [GPUIPC_DTYPE_U16] = {"u16", 2, DL_UINT},
    [GPUIPC_DTYPE_I16] = {"i16", 2, DL_INT},
    [GPUIPC_DTYPE_U32] = {"u32", 4, DL_UINT},
    [GPUIPC_DTYPE_I32] = {"i32", 4, DL_INT},
    [GPUIPC_DTYPE_U64] = {"u64", 8, DL_UINT},
    [GPUIPC_DTYPE_I64] = {"i64", 8, DL_INT},
    [GPUIPC_DTYPE_F16] = {"f16", 2, DL_FLOAT},
    [GPUIPC_DTYPE_BF16] = {"bf16", 2, DL_BFLOAT},
    [GPUIPC_DTYPE_F32] = {"f32", 4, DL_FLOAT},
    [GPUIPC_DTYPE_F64] = {"f64", 8, DL_FLOAT},
    [GPUIPC_DTYPE_C64] = {"c64", 8, DL_COMPLEX},
    [GPUIPC_DTYPE_C128] = {"c128", 16, DL_COMPLEX},
    [GPUIPC_DTYPE_F8_E4M3FN] = {"f8_e4m3fn", 1, DL_F8_E4M3FN},
    [GPUIPC_DTYPE_F8_E5M2] = {"f8_e5m2", 1, DL_F8_E5M2},
    [GPUIPC_DTYPE_F8_E4M3FNUZ] = {"f8_e4m3fnuz", 1, DL_F8_E4M3FNUZ},
    [GPUIPC_DTYPE_F8_E5M2FNUZ] = {"f8_e5m2fnuz", 1, DL_F8_E5M2FNUZ},
    [GPUIPC_DTYPE_F8_E8M0FNU] = {"f8_e8m0fnu", 1, DL_F8_E8M0FNU},
};

size_t gpuipc_dtype_get_size(int dtype) {
  if (dtype <= 0 || (size_t)dtype >= GPUIPC__ARRAY_SIZE(dtypes))
    return 0;
  return dtypes[dtype].size;
}

const char *gpuipc_dtype_name(int dtype) {
  if (gpuipc_dtype_get_size(dtype) == 0)
    return "unknown";
  return dtypes[dtype].name;
}

int gpuipc_dtype_from_dlpack(uint8_t code, uint8_t bits, uint16_t lanes) {
  if (lanes != 1)
    return 0;
  for (int d = 1; d < (int)GPUIPC__ARRAY_SIZE(dtypes); d++)
    if (dtypes[d].dl_code == code && (unsigned)dtypes[d].size * 8 == bits)
      return d;
  return 0;
}

gpuipc_status gpuipc_dtype_to_dlpack(int dtype, uint8_t *code, uint8_t *bits,
                                     uint16_t *lanes) {
  if (gpuipc_dtype_get_size(dtype) == 0)
    return gpuipc__fail(GPUIPC_E_BAD_KIND, "gpuipc_dtype_to_dlpack: dtype %d "
                        "is not one", dtype);
  if (code)
    *code = dtypes[dtype].dl_code;
  if (bits)
    *bits = (uint8_t)(dtypes[dtype].size * 8);
  if (lanes)
    *lanes = 1;
  return GPUIPC_OK;
}

/* ---- extents ------------------------------------------------------------------ */

#define EXTENT_MAX ((uint64_t)1 << 62)

/* Row-major strides of shape (a size 0 counts as 1, as torch has them);
 * 0 when they do not fit below 2^62 (the extent check refuses such a
 * shape before any stride is used). */
static void rowmajor(int ndim, const int64_t *shape, int64_t *out) {
  uint64_t s = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    out[i] = (int64_t)s;
    uint64_t n = shape[i] > 1 ? (uint64_t)shape[i] : 1;
    if (s > EXTENT_MAX / n)
      s = 0;
    else
      s *= n;
  }
}

gpuipc_status gpuipc__tensor_extent(int dtype, int ndim, const int64_t *shape,
                                    const int64_t *strides, uint64_t *out) {
  uint64_t elem = gpuipc_dtype_get_size(dtype);
  if (elem == 0)
    return gpuipc__fail(GPUIPC_E_BAD_KIND, "dtype %d is not one", dtype);
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0 || (strides && strides[i] < 0))
      return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                          "dimension %d: size %lld, stride %lld (negative)", i,
                          (long long)shape[i],
                          (long long)(strides ? strides[i] : 0));
  }
  for (int i = 0; i < ndim; i++)
    if (shape[i] == 0) {
      *out = 0;
      return GPUIPC_OK;
    }
  uint64_t span = 0; /* in elements, beyond the first */
  if (strides == NULL) {
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++) {
      if ((uint64_t)shape[i] > EXTENT_MAX / n)
        goto overflow;
      n *= (uint64_t)shape[i];
    }
    span = n - 1;
  } else {
    for (int i = 0; i < ndim; i++) {
      uint64_t n = (uint64_t)shape[i] - 1, s = (uint64_t)strides[i];
      if (n && s > EXTENT_MAX / n)
        goto overflow;
      span += n * s;
      if (span > EXTENT_MAX)
        goto overflow;
    }
  }
  if (span + 1 > EXTENT_MAX / elem)
    goto overflow;
  *out = (span + 1) * elem;
  return GPUIPC_OK;
overflow:
  return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE, "tensor extent beyond 2^62 bytes");
}

gpuipc_status gpuipc_tensor_meta_get_extent(const gpuipc_tensor_meta *m,
                                            uint64_t *bytes) {
  if (m == NULL || bytes == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tensor_meta_get_extent: "
                        "NULL argument");
  if (m->ndim < 0 || m->ndim > GPUIPC_TENSOR_NDIM_MAX)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "tensor meta: ndim %d (0 .. %d)",
                        m->ndim, GPUIPC_TENSOR_NDIM_MAX);
  return gpuipc__tensor_extent(m->dtype, m->ndim, m->shape,
                               m->has_strides ? m->strides : NULL, bytes);
}

gpuipc_status gpuipc_tensor_meta_check(const gpuipc_tensor_meta *m,
                                       size_t buffer_bytes) {
  uint64_t ext;
  gpuipc_status s = gpuipc_tensor_meta_get_extent(m, &ext);
  if (s != GPUIPC_OK)
    return s;
  if (m->offset > (uint64_t)buffer_bytes ||
      ext > (uint64_t)buffer_bytes - m->offset)
    return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                        "tensor meta: offset %llu + extent %llu bytes beyond "
                        "the buffer's %zu",
                        (unsigned long long)m->offset, (unsigned long long)ext,
                        buffer_bytes);
  return GPUIPC_OK;
}

void gpuipc_tensor_meta_set_contiguous(gpuipc_tensor_meta *m) {
  if (m == NULL || m->ndim < 0 || m->ndim > GPUIPC_TENSOR_NDIM_MAX)
    return;
  rowmajor(m->ndim, m->shape, m->strides);
  m->has_strides = 0;
}

/* Whether strides are the row-major ones where they matter: dimensions of
 * size 1 are skipped, and an empty tensor has no layout at all. */
static int contiguous(int ndim, const int64_t *shape, const int64_t *strides) {
  for (int i = 0; i < ndim; i++)
    if (shape[i] == 0)
      return 1;
  uint64_t want = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    if (shape[i] != 1 && (strides[i] < 0 || (uint64_t)strides[i] != want))
      return 0;
    if (shape[i] > 0 && want > EXTENT_MAX / (uint64_t)shape[i])
      return 0; /* not a layout the extent check lets through anyway */
    want *= (uint64_t)shape[i];
  }
  return 1;
}

int gpuipc_tensor_meta_is_contiguous(const gpuipc_tensor_meta *m) {
  if (m == NULL || m->ndim < 0 || m->ndim > GPUIPC_TENSOR_NDIM_MAX)
    return 0;
  return !m->has_strides || contiguous(m->ndim, m->shape, m->strides);
}

/* ---- the format ---------------------------------------------------------------- */

/* docs/tensor-meta.md:
 *   0 magic "GPTM"  4 version  5 ndim  6 dtype (u16)  8 flags (u16)
 *   10 user_len (u16)  12 reserved (u32, 0)  16 offset (u64)
 *   24 shape[ndim] (i64), strides[ndim] (i64) when flags & 1, user bytes */
#define F_STRIDES 1u

static void put16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get16(const uint8_t *p) {
  return (uint16_t)(p[0] | (uint16_t)p[1] << 8);
}
static uint32_t get32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}
static uint64_t get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++)
    v |= (uint64_t)p[i] << (8 * i);
  return v;
}

gpuipc_status gpuipc_tensor_meta_encode(const gpuipc_tensor_meta *m, void *out,
                                        size_t cap, size_t *len) {
  if (m == NULL || len == NULL || (out == NULL && cap != 0))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tensor_meta_encode: "
                        "NULL argument");
  if (gpuipc_dtype_get_size(m->dtype) == 0)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "tensor meta: dtype %d is not "
                        "one", m->dtype);
  uint64_t ext;
  if (gpuipc_tensor_meta_get_extent(m, &ext) != GPUIPC_OK) {
    char why[256]; /* the message is rewritten below: copy it first */
    snprintf(why, sizeof why, "%s", gpuipc_last_error());
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "tensor meta: %s", why);
  }
  if (m->offset > EXTENT_MAX - ext)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "tensor meta: offset %llu + "
                        "extent beyond 2^62 bytes",
                        (unsigned long long)m->offset);
  if (m->user_len > GPUIPC_TENSOR_META_USER_MAX ||
      (m->user == NULL && m->user_len != 0))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "tensor meta: %zu user bytes "
                        "(at most %d, and not NULL)", m->user_len,
                        GPUIPC_TENSOR_META_USER_MAX);
  int strided = !gpuipc_tensor_meta_is_contiguous(m);
  size_t need = GPUIPC_TENSOR_META_HDR + 8 * (size_t)m->ndim * (strided ? 2 : 1) +
                m->user_len;
  *len = need;
  if (need > cap)
    return gpuipc__fail(GPUIPC_E_LIMIT, "tensor meta: %zu bytes do not fit %zu",
                        need, cap);
  uint8_t *p = out;
  memcpy(p, GPUIPC_TENSOR_META_MAGIC, 4);
  p[4] = GPUIPC_TENSOR_META_VERSION;
  p[5] = (uint8_t)m->ndim;
  put16(p + 6, (uint16_t)m->dtype);
  put16(p + 8, strided ? F_STRIDES : 0);
  put16(p + 10, (uint16_t)m->user_len);
  memset(p + 12, 0, 4);
  put64(p + 16, m->offset);
  p += GPUIPC_TENSOR_META_HDR;
  for (int i = 0; i < m->ndim; i++, p += 8)
    put64(p, (uint64_t)m->shape[i]);
  if (strided)
    for (int i = 0; i < m->ndim; i++, p += 8)
      put64(p, (uint64_t)m->strides[i]);
  if (m->user_len)
    memcpy(p, m->user, m->user_len);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_tensor_meta_decode(const void *in, size_t len,
                                        gpuipc_tensor_meta *out) {
  if (out == NULL || (in == NULL && len != 0))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tensor_meta_decode: "
                        "NULL argument");
  memset(out, 0, sizeof *out);
  const uint8_t *b = in;
  /* The magic first, on what is there: bytes of the producer's own that
   * are shorter than a header are not a truncated meta. */
  if (len < 4 || memcmp(b, GPUIPC_TENSOR_META_MAGIC, 4) != 0)
    return gpuipc__fail(GPUIPC_E_BAD_MAGIC, "tensor meta: no magic (%zu bytes "
                        "of the producer's own)", len);
  if (len < GPUIPC_TENSOR_META_HDR)
    return gpuipc__fail(GPUIPC_E_TRUNCATED, "tensor meta: %zu bytes, the "
                        "header alone is %d", len, GPUIPC_TENSOR_META_HDR);
  if (b[4] != GPUIPC_TENSOR_META_VERSION)
    return gpuipc__fail(GPUIPC_E_BAD_VERSION, "tensor meta: version %u (this "
                        "library reads %d)", b[4], GPUIPC_TENSOR_META_VERSION);
  int ndim = b[5];
  int dtype = get16(b + 6);
  unsigned flags = get16(b + 8);
  size_t ulen = get16(b + 10);
  uint64_t offset = get64(b + 16);
  if (ndim > GPUIPC_TENSOR_NDIM_MAX)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor meta: ndim %d (at most %d)",
                        ndim, GPUIPC_TENSOR_NDIM_MAX);
  if ((flags & ~F_STRIDES) != 0 || get32(b + 12) != 0)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor meta: reserved bits set "
                        "(flags 0x%x)", flags);
  int strided = (flags & F_STRIDES) != 0;
  size_t need = GPUIPC_TENSOR_META_HDR + 8 * (size_t)ndim * (strided ? 2 : 1) + ulen;
  if (len < need)
    return gpuipc__fail(GPUIPC_E_TRUNCATED, "tensor meta: %zu bytes, its "
                        "fields say %zu", len, need);
  if (len > need)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor meta: %zu bytes, its "
                        "fields say %zu", len, need);
  if (gpuipc_dtype_get_size(dtype) == 0)
    return gpuipc__fail(GPUIPC_E_BAD_KIND, "tensor meta: dtype %d is not one",
                        dtype);
  gpuipc_tensor_meta m;
  memset(&m, 0, sizeof m);
  m.dtype = dtype;
  m.ndim = ndim;
  m.offset = offset;
  const uint8_t *p = b + GPUIPC_TENSOR_META_HDR;
  for (int i = 0; i < ndim; i++, p += 8)
    m.shape[i] = (int64_t)get64(p);
  if (strided) {
    for (int i = 0; i < ndim; i++, p += 8)
      m.strides[i] = (int64_t)get64(p);
    m.has_strides = 1;
  }
  uint64_t ext;
  gpuipc_status s = gpuipc_tensor_meta_get_extent(&m, &ext);
  if (s != GPUIPC_OK)
    return s; /* BAD_KIND cannot come here; OUT_OF_RANGE */
  if (offset > EXTENT_MAX - ext)
    return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE, "tensor meta: offset %llu + "
                        "extent %llu beyond 2^62 bytes",
                        (unsigned long long)offset, (unsigned long long)ext);
  if (strided && contiguous(ndim, m.shape, m.strides))
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor meta: strides sent for a "
                        "row-major tensor (they are left out)");
  if (!strided)
    rowmajor(ndim, m.shape, m.strides);
  m.user = ulen ? p : NULL;
  m.user_len = ulen;
  *out = m;
  return GPUIPC_OK;
}
