/*
 * test-tensor.c: the dtype vocabulary (sizes, names, DLPack codes) and the
 * tensor meta format (include/gpuipc/tensor.h, docs/tensor-meta.md):
 * round trips, what the encoder refuses, the decoder against hostile bytes
 * (every truncation, every byte flipped, random bytes behind a valid
 * header), the buffer bound, and the replay of the fuzz target's seed
 * corpus (tests/fuzz/corpus/tensor-meta).
 *
 * Also the helper tensor_meta_peer, the C side of the Python suite's
 * cross-language test (python/tests/test_tensor_meta.py): a C consumer of
 * what a Python producer sent, and a C producer for a Python consumer.
 */
#include "harness.h"

#include "tree.h"

#include <dirent.h>

/* ---- helpers ------------------------------------------------------------------- */

static gpuipc_tensor_meta meta_2d(int dtype, int64_t a, int64_t b) {
  gpuipc_tensor_meta m;
  memset(&m, 0, sizeof m);
  m.dtype = dtype;
  m.ndim = 2;
  m.shape[0] = a;
  m.shape[1] = b;
  gpuipc_tensor_meta_set_contiguous(&m);
  return m;
}

/* Encodes m, decodes it back, checks every field and that the decoded
 * meta encodes to the same bytes. Returns the encoded length. */
static size_t round_trip(const gpuipc_tensor_meta *m, uint8_t *buf, size_t cap) {
  size_t len = 0;
  ASSERT_OK(gpuipc_tensor_meta_encode(m, buf, cap, &len));
  gpuipc_tensor_meta d;
  ASSERT_OK(gpuipc_tensor_meta_decode(buf, len, &d));
  ASSERT_EQ(d.dtype, m->dtype);
  ASSERT_EQ(d.ndim, m->ndim);
  ASSERT_UEQ(d.offset, m->offset);
  ASSERT_EQ(d.has_strides, !gpuipc_tensor_meta_is_contiguous(m));
  gpuipc_tensor_meta want = *m;
  if (!want.has_strides)
    gpuipc_tensor_meta_set_contiguous(&want);
  for (int i = 0; i < m->ndim; i++) {
    ASSERT_EQ(d.shape[i], m->shape[i]);
    if (d.has_strides)
      ASSERT_EQ(d.strides[i], want.strides[i]);
  }
  ASSERT_UEQ(d.user_len, m->user_len);
  if (m->user_len)
    ASSERT_MEM_EQ(d.user, m->user, m->user_len);
  uint64_t e1, e2;
  ASSERT_OK(gpuipc_tensor_meta_get_extent(m, &e1));
  ASSERT_OK(gpuipc_tensor_meta_get_extent(&d, &e2));
  ASSERT_UEQ(e1, e2);
  uint8_t again[1024];
  size_t len2 = 0;
  ASSERT_OK(gpuipc_tensor_meta_encode(&d, again, sizeof again, &len2));
  ASSERT_UEQ(len2, len);
  ASSERT_MEM_EQ(again, buf, len);
  return len;
}

static void put64le(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

/* ---- dtypes --------------------------------------------------------------------- */

TEST_IMPL(tensor_dtype_dlpack) {
  /* Every dtype maps to one DLPack type and back. */
  int n = 0;
  for (int d = -1; d < 64; d++) {
    uint8_t code = 0xEE, bits = 0xEE;
    uint16_t lanes = 0xEEEE;
    if (gpuipc_dtype_get_size(d) == 0) {
      ASSERT_STATUS(gpuipc_dtype_to_dlpack(d, &code, &bits, &lanes),
                    GPUIPC_E_BAD_KIND);
      ASSERT_EQ(code, 0xEE); /* untouched */
      ASSERT_STR_EQ(gpuipc_dtype_name(d), "unknown");
      continue;
    }
    n++;
    ASSERT_OK(gpuipc_dtype_to_dlpack(d, &code, &bits, &lanes));
    ASSERT_EQ(lanes, 1);
    ASSERT_EQ(bits, 8 * gpuipc_dtype_get_size(d));
    ASSERT_EQ(gpuipc_dtype_from_dlpack(code, bits, lanes), d);
    ASSERT(strcmp(gpuipc_dtype_name(d), "unknown") != 0);
  }
  ASSERT_EQ(n, 20);
  /* DLPack's own codes (dlpack.h v1.0+: kDLFloat8_e4m3fn = 10, ...). */
  ASSERT_EQ(gpuipc_dtype_from_dlpack(2, 32, 1), GPUIPC_DTYPE_F32);
  ASSERT_EQ(gpuipc_dtype_from_dlpack(4, 16, 1), GPUIPC_DTYPE_BF16);
  ASSERT_EQ(gpuipc_dtype_from_dlpack(6, 8, 1), GPUIPC_DTYPE_BOOL);
  ASSERT_EQ(gpuipc_dtype_from_dlpack(5, 128, 1), GPUIPC_DTYPE_C128);
  ASSERT_EQ(gpuipc_dtype_from_dlpack(10, 8, 1), GPUIPC_DTYPE_F8_E4M3FN);
  ASSERT_EQ(gpuipc_dtype_from_dlpack(11, 8, 1), GPUIPC_DTYPE_F8_E4M3FNUZ);
  ASSERT_EQ(gpuipc_dtype_from_dlpack(12, 8, 1), GPUIPC_DTYPE_F8_E5M2);
  ASSERT_EQ(gpuipc_dtype_from_dlpack(13, 8, 1), GPUIPC_DTYPE_F8_E5M2FNUZ);
  ASSERT_EQ(gpuipc_dtype_from_dlpack(14, 8, 1), GPUIPC_DTYPE_F8_E8M0FNU);
  /* No gpuipc_dtype: vectors, odd widths, sub-byte and opaque types. */
  ASSERT_EQ(gpuipc_dtype_from_dlpack(2, 32, 4), 0);
  ASSERT_EQ(gpuipc_dtype_from_dlpack(2, 8, 1), 0);
  ASSERT_EQ(gpuipc_dtype_from_dlpack(0, 4, 1), 0);
  ASSERT_EQ(gpuipc_dtype_from_dlpack(17, 4, 1), 0);
  ASSERT_EQ(gpuipc_dtype_from_dlpack(3, 64, 1), 0);
  ASSERT_EQ(gpuipc_dtype_from_dlpack(10, 16, 1), 0);
  ASSERT_STR_EQ(gpuipc_dtype_name(GPUIPC_DTYPE_F8_E5M2), "f8_e5m2");
  ASSERT_STR_EQ(gpuipc_dtype_name(GPUIPC_DTYPE_F8_E8M0FNU), "f8_e8m0fnu");
  ASSERT_OK(gpuipc_dtype_to_dlpack(GPUIPC_DTYPE_I64, NULL, NULL, NULL));
  return 0;
}

/* ---- encode and decode -------------------------------------------------------------- */

TEST_IMPL(tensor_meta_round_trip) {
  uint8_t buf[1024];
  /* Contiguous: no strides on the wire. */
  gpuipc_tensor_meta m = meta_2d(GPUIPC_DTYPE_F32, 3, 4);
  ASSERT_UEQ(round_trip(&m, buf, sizeof buf), GPUIPC_TENSOR_META_HDR + 16);
  ASSERT_MEM_EQ(buf, "GPTM\x01\x02\x0c\x00\x00\x00\x00\x00", 12);
  /* Strides given that are the row-major ones are not written. */
  m.has_strides = 1;
  ASSERT_UEQ(round_trip(&m, buf, sizeof buf), GPUIPC_TENSOR_META_HDR + 16);
  /* A strided float8 view at an offset, with application bytes. */
  m = meta_2d(GPUIPC_DTYPE_F8_E4M3FN, 3, 4);
  m.strides[0] = 1;
  m.strides[1] = 5;
  m.has_strides = 1;
  m.offset = 40;
  m.user = "req-17";
  m.user_len = 6;
  size_t len = round_trip(&m, buf, sizeof buf);
  ASSERT_UEQ(len, GPUIPC_TENSOR_META_HDR + 32 + 6);
  ASSERT_EQ(buf[8], 1); /* strides follow */
  uint64_t ext;
  ASSERT_OK(gpuipc_tensor_meta_get_extent(&m, &ext));
  ASSERT_UEQ(ext, 1 + 2 * 1 + 3 * 5);
  /* A scalar is one element. */
  memset(&m, 0, sizeof m);
  m.dtype = GPUIPC_DTYPE_C128;
  ASSERT_UEQ(round_trip(&m, buf, sizeof buf), GPUIPC_TENSOR_META_HDR);
  ASSERT_OK(gpuipc_tensor_meta_get_extent(&m, &ext));
  ASSERT_UEQ(ext, 16);
  /* An empty tensor spans nothing and has no layout to send. */
  m = meta_2d(GPUIPC_DTYPE_I64, 0, 9);
  m.strides[1] = 7;
  m.has_strides = 1;
  ASSERT_UEQ(round_trip(&m, buf, sizeof buf), GPUIPC_TENSOR_META_HDR + 16);
  ASSERT_OK(gpuipc_tensor_meta_get_extent(&m, &ext));
  ASSERT_UEQ(ext, 0);
  /* Broadcast (stride 0) and the most dimensions. */
  memset(&m, 0, sizeof m);
  m.dtype = GPUIPC_DTYPE_BF16;
  m.ndim = GPUIPC_TENSOR_NDIM_MAX;
  for (int i = 0; i < m.ndim; i++)
    m.shape[i] = 2;
  gpuipc_tensor_meta_set_contiguous(&m);
  ASSERT_EQ(m.strides[GPUIPC_TENSOR_NDIM_MAX - 1], 1);
  ASSERT_EQ(m.strides[0], 1 << 15);
  ASSERT_UEQ(round_trip(&m, buf, sizeof buf),
             GPUIPC_TENSOR_META_HDR + 8 * GPUIPC_TENSOR_NDIM_MAX);
  m.strides[3] = 0;
  m.has_strides = 1;
  len = round_trip(&m, buf, sizeof buf);
  ASSERT_UEQ(len, GPUIPC_TENSOR_META_HDR + 16 * GPUIPC_TENSOR_NDIM_MAX);
  ASSERT_GT(len, GPUIPC_META_MAX); /* documented: does not fit a send */
  /* Asking for the size; a cap too small writes nothing. */
  m = meta_2d(GPUIPC_DTYPE_U8, 5, 5);
  size_t need = 0;
  ASSERT_STATUS(gpuipc_tensor_meta_encode(&m, NULL, 0, &need), GPUIPC_E_LIMIT);
  ASSERT_UEQ(need, GPUIPC_TENSOR_META_HDR + 16);
  memset(buf, 0xAB, sizeof buf);
  ASSERT_STATUS(gpuipc_tensor_meta_encode(&m, buf, need - 1, &len),
                GPUIPC_E_LIMIT);
  ASSERT_UEQ(len, need);
  ASSERT_EQ(buf[0], 0xAB);
  ASSERT_OK(gpuipc_tensor_meta_encode(&m, buf, need, &len));
  /* The contiguity helper. */
  m = meta_2d(GPUIPC_DTYPE_U8, 1, 5);
  m.strides[0] = 99; /* a size-1 dimension's stride does not matter */
  m.has_strides = 1;
  ASSERT_EQ(gpuipc_tensor_meta_is_contiguous(&m), 1);
  m.strides[1] = 2;
  ASSERT_EQ(gpuipc_tensor_meta_is_contiguous(&m), 0);
  return 0;
}

TEST_IMPL(tensor_meta_encode_refuses) {
  uint8_t buf[512];
  size_t len = 7;
  gpuipc_tensor_meta m = meta_2d(GPUIPC_DTYPE_F16, 2, 2);
  gpuipc_tensor_meta bad = m;
  bad.dtype = 0;
  ASSERT_STATUS(gpuipc_tensor_meta_encode(&bad, buf, sizeof buf, &len),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "dtype");
  bad.dtype = GPUIPC_DTYPE_F8_E8M0FNU + 1;
  ASSERT_STATUS(gpuipc_tensor_meta_encode(&bad, buf, sizeof buf, &len),
                GPUIPC_E_INVALID_ARG);
  bad = m;
  bad.ndim = GPUIPC_TENSOR_NDIM_MAX + 1;
  ASSERT_STATUS(gpuipc_tensor_meta_encode(&bad, buf, sizeof buf, &len),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "ndim");
  bad.ndim = -1;
  ASSERT_STATUS(gpuipc_tensor_meta_encode(&bad, buf, sizeof buf, &len),
                GPUIPC_E_INVALID_ARG);
  bad = m;
  bad.shape[1] = -3;
  ASSERT_STATUS(gpuipc_tensor_meta_encode(&bad, buf, sizeof buf, &len),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "negative");
  bad = m;
  bad.strides[0] = -1;
  bad.has_strides = 1;
  ASSERT_STATUS(gpuipc_tensor_meta_encode(&bad, buf, sizeof buf, &len),
                GPUIPC_E_INVALID_ARG);
  bad = m;
  bad.shape[0] = bad.shape[1] = (int64_t)1 << 40; /* 2^80 elements */
  ASSERT_STATUS(gpuipc_tensor_meta_encode(&bad, buf, sizeof buf, &len),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "2^62");
  bad = m;
  bad.strides[0] = INT64_MAX;
  bad.has_strides = 1;
  ASSERT_STATUS(gpuipc_tensor_meta_encode(&bad, buf, sizeof buf, &len),
                GPUIPC_E_INVALID_ARG);
  bad = m;
  bad.offset = UINT64_MAX - 2;
  ASSERT_STATUS(gpuipc_tensor_meta_encode(&bad, buf, sizeof buf, &len),
                GPUIPC_E_INVALID_ARG);
  bad = m;
  bad.user_len = 3; /* user NULL */
  ASSERT_STATUS(gpuipc_tensor_meta_encode(&bad, buf, sizeof buf, &len),
                GPUIPC_E_INVALID_ARG);
  bad.user = buf;
  bad.user_len = GPUIPC_TENSOR_META_USER_MAX + 1;
  ASSERT_STATUS(gpuipc_tensor_meta_encode(&bad, buf, sizeof buf, &len),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_tensor_meta_encode(NULL, buf, sizeof buf, &len),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_tensor_meta_encode(&m, NULL, 5, &len),
                GPUIPC_E_INVALID_ARG);
  ASSERT_UEQ(len, 7); /* no failure above said a length */
  return 0;
}

/* A valid strided meta with user bytes, as bytes: the base of the hostile
 * cases below. */
static size_t sample(uint8_t *buf, size_t cap) {
  gpuipc_tensor_meta m = meta_2d(GPUIPC_DTYPE_F8_E5M2, 3, 4);
  m.strides[0] = 1;
  m.strides[1] = 6;
  m.has_strides = 1;
  m.offset = 8;
  m.user = "ab";
  m.user_len = 2;
  size_t len = 0;
  ASSERT_OK(gpuipc_tensor_meta_encode(&m, buf, cap, &len));
  return len;
}

static gpuipc_status decode_copy(const uint8_t *b, size_t n, gpuipc_tensor_meta *m) {
  /* An exact-size private copy, so that ASan sees any overread. */
  uint8_t *c = malloc(n ? n : 1);
  ASSERT_NOT_NULL(c);
  memcpy(c, b, n);
  gpuipc_status s = gpuipc_tensor_meta_decode(c, n, m);
  if (s == GPUIPC_OK) {
    uint8_t again[1024];
    size_t len = 0;
    ASSERT_OK(gpuipc_tensor_meta_encode(m, again, sizeof again, &len));
    ASSERT_UEQ(len, n);
    ASSERT_MEM_EQ(again, c, n);
    m->user = NULL; /* pointed into c */
  }
  free(c);
  return s;
}

TEST_IMPL(tensor_meta_decode_hostile) {
  uint8_t ok[256], b[256];
  size_t n = sample(ok, sizeof ok);
  gpuipc_tensor_meta m;
  ASSERT_OK(decode_copy(ok, n, &m));

  /* Every truncation. */
  for (size_t k = 0; k < n; k++) {
    gpuipc_status s = decode_copy(ok, k, &m);
    ASSERT_EQ(s, k < 4 ? GPUIPC_E_BAD_MAGIC : GPUIPC_E_TRUNCATED);
    ASSERT_EQ(m.dtype, 0); /* zeroed on failure */
  }
  /* One byte more. */
  memcpy(b, ok, n);
  b[n] = 0;
  ASSERT_STATUS(decode_copy(b, n + 1, &m), GPUIPC_E_PROTOCOL);
  /* Not a tensor meta at all. */
  ASSERT_STATUS(decode_copy((const uint8_t *)"hello, world: bytes of my own", 29, &m),
                GPUIPC_E_BAD_MAGIC);
  ASSERT_STATUS(gpuipc_tensor_meta_decode(NULL, 0, &m), GPUIPC_E_BAD_MAGIC);
  ASSERT_STATUS(gpuipc_tensor_meta_decode(ok, n, NULL), GPUIPC_E_INVALID_ARG);

#define HOSTILE(edit, want)                                                     \
  do {                                                                          \
    memcpy(b, ok, n);                                                           \
    edit;                                                                       \
    ASSERT_STATUS(decode_copy(b, n, &m), want);                                 \
  } while (0)
  HOSTILE(b[4] = 2, GPUIPC_E_BAD_VERSION);
  HOSTILE(b[4] = 0, GPUIPC_E_BAD_VERSION);
  HOSTILE(b[5] = GPUIPC_TENSOR_NDIM_MAX + 1, GPUIPC_E_PROTOCOL);
  HOSTILE(b[5] = 255, GPUIPC_E_PROTOCOL);
  HOSTILE(b[5] = 1, GPUIPC_E_PROTOCOL);    /* fewer fields than bytes */
  HOSTILE(b[5] = 3, GPUIPC_E_TRUNCATED);   /* more */
  HOSTILE(b[6] = 0, GPUIPC_E_BAD_KIND);
  HOSTILE(b[6] = 99, GPUIPC_E_BAD_KIND);
  HOSTILE(b[7] = 1, GPUIPC_E_BAD_KIND);    /* dtype 256 + 17 */
  HOSTILE(b[8] = 3, GPUIPC_E_PROTOCOL);    /* a reserved flag */
  HOSTILE(b[9] = 0x80, GPUIPC_E_PROTOCOL);
  HOSTILE(b[8] = 0, GPUIPC_E_PROTOCOL);    /* strides left: too long */
  HOSTILE(b[10] = 3, GPUIPC_E_TRUNCATED);  /* user_len beyond */
  HOSTILE(b[11] = 1, GPUIPC_E_TRUNCATED);
  HOSTILE(b[10] = 1, GPUIPC_E_PROTOCOL);
  HOSTILE(b[12] = 1, GPUIPC_E_PROTOCOL);   /* reserved bytes */
  HOSTILE(b[15] = 0x80, GPUIPC_E_PROTOCOL);
  HOSTILE(put64le(b + 24, (uint64_t)-1), GPUIPC_E_OUT_OF_RANGE); /* size -1 */
  HOSTILE(put64le(b + 40, (uint64_t)-5), GPUIPC_E_OUT_OF_RANGE); /* stride */
  HOSTILE(put64le(b + 48, (uint64_t)1 << 61), GPUIPC_E_OUT_OF_RANGE);
  HOSTILE(put64le(b + 24, (uint64_t)1 << 62), GPUIPC_E_OUT_OF_RANGE);
  HOSTILE(put64le(b + 16, (uint64_t)1 << 62), GPUIPC_E_OUT_OF_RANGE); /* offset */
  HOSTILE(put64le(b + 16, UINT64_MAX), GPUIPC_E_OUT_OF_RANGE);
  /* Strides sent that are the row-major ones: one encoding per tensor. */
  HOSTILE((put64le(b + 40, 4), put64le(b + 48, 1)), GPUIPC_E_PROTOCOL);
  /* An empty tensor's strides are no layout either. */
  HOSTILE(put64le(b + 24, 0), GPUIPC_E_PROTOCOL);
#undef HOSTILE

  /* Every byte flipped (each bit, and to 0xFF): some status, and a meta
   * that decodes re-encodes to the very same bytes (decode_copy checks). */
  int decoded = 0;
  for (size_t i = 0; i < n; i++)
    for (int v = 0; v < 9; v++) {
      memcpy(b, ok, n);
      b[i] = v < 8 ? (uint8_t)(b[i] ^ (1u << v)) : 0xFF;
      gpuipc_status s = decode_copy(b, n, &m);
      ASSERT(s >= 0 && s < GPUIPC__STATUS_END);
      decoded += s == GPUIPC_OK;
    }
  ASSERT_GT(decoded, 0); /* shape, offset and user bytes may change */

  /* Random bytes behind a valid magic and version, many lengths. */
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (int round = 0; round < 20000; round++) {
    size_t len = 4 + (size_t)(round % 200);
    for (size_t i = 0; i < len; i++) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      b[i] = (uint8_t)x;
    }
    memcpy(b, "GPTM\x01", 5 < len ? 5 : len);
    if (round & 1) { /* plausible header fields, so that more get deeper */
      if (len > 5) b[5] %= 4;
      if (len > 7) b[7] = 0;
      if (len > 9) { b[8] &= 1; b[9] = 0; }
      if (len > 11) b[11] = 0;
      if (len > 15) memset(b + 12, 0, 4);
    }
    gpuipc_status s = decode_copy(b, len, &m);
    ASSERT(s >= 0 && s < GPUIPC__STATUS_END);
  }
  return 0;
}

TEST_IMPL(tensor_meta_check_bounds) {
  gpuipc_tensor_meta m = meta_2d(GPUIPC_DTYPE_F32, 3, 4); /* 48 bytes */
  ASSERT_OK(gpuipc_tensor_meta_check(&m, 48));
  ASSERT_STATUS(gpuipc_tensor_meta_check(&m, 47), GPUIPC_E_OUT_OF_RANGE);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "47");
  m.offset = 16;
  ASSERT_OK(gpuipc_tensor_meta_check(&m, 64));
  ASSERT_STATUS(gpuipc_tensor_meta_check(&m, 63), GPUIPC_E_OUT_OF_RANGE);
  m.offset = 1000;
  ASSERT_STATUS(gpuipc_tensor_meta_check(&m, 64), GPUIPC_E_OUT_OF_RANGE);
  ASSERT_OK(gpuipc_tensor_meta_check(&m, SIZE_MAX));
  /* Strided: the extent is from the strides, not the element count. */
  m = meta_2d(GPUIPC_DTYPE_U16, 2, 3);
  m.strides[0] = 100;
  m.strides[1] = 1;
  m.has_strides = 1;
  ASSERT_OK(gpuipc_tensor_meta_check(&m, 2 * 103));
  ASSERT_STATUS(gpuipc_tensor_meta_check(&m, 2 * 103 - 1), GPUIPC_E_OUT_OF_RANGE);
  /* An empty tensor fits anywhere, even at the end. */
  m = meta_2d(GPUIPC_DTYPE_U16, 0, 3);
  m.offset = 64;
  ASSERT_OK(gpuipc_tensor_meta_check(&m, 64));
  m.dtype = 0;
  ASSERT_STATUS(gpuipc_tensor_meta_check(&m, 64), GPUIPC_E_BAD_KIND);
  m.dtype = GPUIPC_DTYPE_U8;
  m.ndim = 40;
  ASSERT_STATUS(gpuipc_tensor_meta_check(&m, 64), GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_tensor_meta_check(NULL, 64), GPUIPC_E_INVALID_ARG);
  return 0;
}

/* ---- the fuzz corpus ------------------------------------------------------------ */

/* The status named by a file's prefix ("E_TRUNCATED-..."), or -1. */
static int expected(const char *name) {
  const char *dash = strchr(name, '-');
  if (dash == NULL)
    return -1;
  char prefix[64] = "GPUIPC_";
  size_t n = (size_t)(dash - name);
  if (n + 8 > sizeof prefix)
    return -1;
  memcpy(prefix + 7, name, n);
  prefix[7 + n] = '\0';
  for (int s = 0; s < GPUIPC__STATUS_END; s++)
    if (strcmp(gpuipc_status_name((gpuipc_status)s), prefix) == 0)
      return s;
  return -1;
}

TEST_IMPL(tensor_meta_fuzz_corpus_replay) {
  char dir[1024];
  snprintf(dir, sizeof dir, "%s/tests/fuzz/corpus/tensor-meta", GPUIPC_SOURCE_DIR);
  DIR *d = opendir(dir);
  if (d == NULL)
    SKIP("no corpus at %s", dir);
  int files = 0, checked = 0;
  struct dirent *e;
  static uint8_t buf[1 << 16];
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    char path[2048];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    FILE *f = fopen(path, "rb");
    ASSERT_NOT_NULL(f);
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    gpuipc_tensor_meta m;
    gpuipc_status s = decode_copy(buf, n, &m);
    ASSERT(s >= 0 && s < GPUIPC__STATUS_END);
    int want = expected(e->d_name);
    if (want >= 0) {
      if ((int)s != want)
        harness_fail(__FILE__, __LINE__, "%s: decoded to %s, want %s (%s)",
                     e->d_name, gpuipc_status_name(s),
                     gpuipc_status_name((gpuipc_status)want),
                     gpuipc_last_error());
      checked++;
    }
    files++;
  }
  closedir(d);
  printf("replayed %d corpus file(s), %d with an expected status\n", files,
         checked);
  ASSERT_GE(checked, 10);
  return 0;
}

/* ---- the C peer of the Python suite ---------------------------------------------- */

/* The pattern both sides write and check: byte i of a block is
 * (7 i + 3) mod 256. */
static uint8_t pattern(size_t i) { return (uint8_t)(7 * i + 3); }

static void print_meta(const gpuipc_tensor_meta *m) {
  printf("dtype=%s ndim=%d offset=%llu has_strides=%d shape=", gpuipc_dtype_name(m->dtype),
         m->ndim, (unsigned long long)m->offset, m->has_strides);
  for (int i = 0; i < m->ndim; i++)
    printf("%s%lld", i ? "," : "", (long long)m->shape[i]);
  printf(" strides=");
  for (int i = 0; i < m->ndim; i++)
    printf("%s%lld", i ? "," : "", (long long)m->strides[i]);
  printf(" user=");
  for (size_t i = 0; i < m->user_len; i++)
    printf("%02x", ((const uint8_t *)m->user)[i]);
}

/* The bytes of each element in row-major index order, in hex. */
static void print_elements(const gpuipc_tensor_meta *m, const uint8_t *base) {
  size_t esz = gpuipc_dtype_get_size(m->dtype);
  int64_t idx[GPUIPC_TENSOR_NDIM_MAX] = {0};
  printf(" data=");
  for (int i = 0; i < m->ndim; i++)
    if (m->shape[i] == 0)
      return;
  for (;;) {
    uint64_t off = m->offset;
    for (int i = 0; i < m->ndim; i++)
      off += (uint64_t)(idx[i] * m->strides[i]) * esz;
    for (size_t k = 0; k < esz; k++)
      printf("%02x", base[off + k]);
    int i = m->ndim - 1;
    while (i >= 0 && ++idx[i] == m->shape[i])
      idx[i--] = 0;
    if (i < 0)
      return;
  }
}

/* tensor_meta_peer consume NAME RUNTIME_DIR COUNT
 *   connects, receives COUNT buffers; for each prints one line
 *   "dtype=... ndim=... offset=... has_strides=... shape=a,b strides=c,d
 *   user=HEX data=HEX" (the meta as this C consumer decoded and checked
 *   it, and the bytes of each element read through it), or "error
 *   STATUS MESSAGE"; releases it.
 * tensor_meta_peer produce NAME RUNTIME_DIR
 *   connects, sends three blocks of 256 bytes filled with pattern(): a
 *   strided f8_e4m3fn view (shape 3,4, strides 1,5, offset 8, user
 *   "from-c"), a contiguous bf16 one (shape 2,3,4, offset 32, no user
 *   bytes), and one whose meta is the bytes "plain bytes" (no tensor
 *   meta); waits until the peer closes. */
HELPER_IMPL(tensor_meta_peer) {
  ASSERT(argc >= 3);
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 30000;
  o.runtime_dir = argv[2];
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_connect(argv[1], &o, &c));
  if (strcmp(argv[0], "consume") == 0) {
    ASSERT(argc >= 4);
    int count = atoi(argv[3]);
    for (int k = 0; k < count; k++) {
      gpuipc_received r = GPUIPC_RECEIVED_INIT;
      ASSERT_OK(gpuipc_conn_recv(c, NULL, &r));
      gpuipc_tensor_meta m;
      gpuipc_status s = gpuipc_tensor_meta_decode(r.meta, r.meta_len, &m);
      if (s == GPUIPC_OK)
        s = gpuipc_tensor_meta_check(&m, r.length);
      if (s != GPUIPC_OK) {
        printf("error %s %s\n", gpuipc_status_name(s), gpuipc_last_error());
      } else {
        uint8_t *host = malloc(r.length ? r.length : 1);
        ASSERT_NOT_NULL(host);
        gpuipc__ctx_guard g;
        ASSERT_OK(gpuipc__ctx_enter(&g, r.device));
        ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
        ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(host, (CUdeviceptr)(uintptr_t)r.ptr,
                                          r.length));
        gpuipc__ctx_leave(&g);
        print_meta(&m);
        print_elements(&m, host);
        printf("\n");
        free(host);
      }
      fflush(stdout);
      ASSERT_OK(gpuipc_conn_release(c, r.id, NULL));
    }
  } else {
    ASSERT_STR_EQ(argv[0], "produce");
    gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
    ao.chunk_bytes = (size_t)1 << 20;
    gpuipc_arena *a = NULL;
    ASSERT_OK(gpuipc_arena_create(&ao, &a));
    gpuipc_block *blk[3];
    uint8_t host[256];
    for (size_t i = 0; i < sizeof host; i++)
      host[i] = pattern(i);
    gpuipc_tensor_meta m[2];
    m[0] = meta_2d(GPUIPC_DTYPE_F8_E4M3FN, 3, 4);
    m[0].strides[0] = 1;
    m[0].strides[1] = 5;
    m[0].has_strides = 1;
    m[0].offset = 8;
    m[0].user = "from-c";
    m[0].user_len = 6;
    memset(&m[1], 0, sizeof m[1]);
    m[1].dtype = GPUIPC_DTYPE_BF16;
    m[1].ndim = 3;
    m[1].shape[0] = 2;
    m[1].shape[1] = 3;
    m[1].shape[2] = 4;
    m[1].offset = 32;
    for (int k = 0; k < 3; k++) {
      ASSERT_OK(gpuipc_arena_alloc(a, sizeof host, NULL, &blk[k]));
      gpuipc__ctx_guard g;
      ASSERT_OK(gpuipc__ctx_enter(&g, 0));
      ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(
          (CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(blk[k]), host, sizeof host));
      ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
      gpuipc__ctx_leave(&g);
      if (k == 2) {
        ASSERT_OK(gpuipc_conn_send(c, blk[k], NULL, "plain bytes", 11));
        continue;
      }
      ASSERT_OK(gpuipc_tensor_meta_check(&m[k], gpuipc_block_get_size(blk[k])));
      uint8_t wire[GPUIPC_META_MAX];
      size_t wlen = 0;
      ASSERT_OK(gpuipc_tensor_meta_encode(&m[k], wire, sizeof wire, &wlen));
      ASSERT_OK(gpuipc_conn_send(c, blk[k], NULL, wire, wlen));
    }
    /* Until the peer closes (its releases come on the way). */
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    gpuipc_status s = gpuipc_conn_recv(c, NULL, &r);
    ASSERT(s == GPUIPC_E_CLOSED || s == GPUIPC_E_PEER_GONE);
    for (int k = 0; k < 3; k++)
      ASSERT_OK(gpuipc_block_free(blk[k], NULL));
    gpuipc_conn_close(c);
    c = NULL;
    (void)gpuipc_arena_destroy(a); /* BUSY only while leases linger: the exit frees it */
    printf("produced\n");
    fflush(stdout);
  }
  gpuipc_conn_close(c);
  return 0;
}
