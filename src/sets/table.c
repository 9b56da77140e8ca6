/*
 * table.c: the tensor-set table codec (docs/sets.md): encode, decode and
 * the checks both run, so that what a producer can send is exactly what a
 * consumer accepts. The decoder treats its input as hostile: every count
 * is bounded by the bytes that carry it before anything is allocated,
 * every field is checked, and a table is refused whole (nothing of it is
 * kept) at the first fault. Also the meta of the set's buffers (dtypes and
 * extents are tensor.c's).
 */
#include "sets_int.h"

#include <stdlib.h>
#include <string.h>

/* ---- checks ------------------------------------------------------------------ */

#define EXTENT_MAX ((uint64_t)1 << 62)
#define PIECE_LEN_MAX ((uint64_t)1 << 56)

gpuipc_status gpuipc__tset_extent(int dtype, int ndim, const int64_t *shape,
                                  const int64_t *strides, uint64_t *out) {
  if (gpuipc_dtype_get_size(dtype) == 0)
    return gpuipc__fail(GPUIPC_E_BAD_KIND, "dtype %d is not one", dtype);
  if (ndim < 0 || ndim > GPUIPC_TSET_NDIM_MAX)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "ndim %d (at most %d)", ndim,
                        GPUIPC_TSET_NDIM_MAX);
  /* The one extent computation (tensor.c): strides are always given here. */
  return gpuipc__tensor_extent(dtype, ndim, shape, strides, out);
}

/* Strict UTF-8: no overlong forms, no surrogates, nothing past U+10FFFF,
 * no NUL. */
static bool utf8_ok(const uint8_t *s, size_t n) {
  size_t i = 0;
  while (i < n) {
    uint8_t c = s[i];
    if (c == 0)
      return false;
    if (c < 0x80) {
      i++;
      continue;
    }
    int len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + (size_t)len > n)
      return false;
    for (int k = 1; k < len; k++) {
      if ((s[i + k] & 0xC0) != 0x80)
        return false;
      cp = cp << 6 | (s[i + k] & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) ||
        (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += (size_t)len;
  }
  return true;
}

static uint32_t name_hash(const char *s, size_t n) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; i++)
    h = (h ^ (uint8_t)s[i]) * 16777619u;
  return h;
}

long gpuipc__tset_table_find(const gpuipc__tset_table *t, const char *name,
                             size_t len) {
  if (t->hash_cap == 0)
    return -1;
  uint32_t mask = t->hash_cap - 1;
  for (uint32_t h = name_hash(name, len) & mask;; h = (h + 1) & mask) {
    uint32_t slot = t->hash[h];
    if (slot == 0)
      return -1;
    const gpuipc__tset_entry *e = &t->e[slot - 1];
    if (e->name_len == len && memcmp(t->names + e->name_off, name, len) == 0)
      return (long)(slot - 1);
  }
}

/* Sorting entries by (piece, offset) for the overlap check. */
static int by_place(const void *a, const void *b, void *arg) {
  const gpuipc__tset_entry *base = arg;
  const gpuipc__tset_entry *x = &base[*(const uint32_t *)a];
  const gpuipc__tset_entry *y = &base[*(const uint32_t *)b];
  if (x->piece != y->piece)
    return x->piece < y->piece ? -1 : 1;
  if (x->offset != y->offset)
    return x->offset < y->offset ? -1 : 1;
  return 0;
}

gpuipc_status gpuipc__tset_table_check(gpuipc__tset_table *t) {
  if (t->n_entries == 0 || t->n_entries > GPUIPC_TSET_ENTRIES_MAX)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "%u entries (1 to %u)", t->n_entries,
                        GPUIPC_TSET_ENTRIES_MAX);
  if (t->copies < 1 || t->copies > 2)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "%u copies (1 or 2)", t->copies);
  if (t->n_pieces == 0 || t->n_pieces * t->copies > GPUIPC_TSET_PIECES_MAX ||
      t->n_pieces > t->n_entries)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "%u pieces per copy (1 to the number of entries, %u, "
                        "and at most %u in all copies)",
                        t->n_pieces, t->n_entries, GPUIPC_TSET_PIECES_MAX);
  for (uint32_t p = 0; p < t->n_pieces; p++)
    if (t->piece_len[p] == 0 || t->piece_len[p] > PIECE_LEN_MAX)
      return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE, "piece %u: %llu bytes", p,
                          (unsigned long long)t->piece_len[p]);
  for (uint32_t i = 0; i < t->n_entries; i++) {
    const gpuipc__tset_entry *e = &t->e[i];
    if (e->name_len == 0 || e->name_len > GPUIPC_TSET_NAME_MAX ||
        (size_t)e->name_off + e->name_len + 1 > t->names_len)
      return gpuipc__fail(GPUIPC_E_PROTOCOL, "entry %u: name of %u bytes "
                          "(1 to %d)", i, e->name_len, GPUIPC_TSET_NAME_MAX);
    const char *name = t->names + e->name_off;
    if (!utf8_ok((const uint8_t *)name, e->name_len))
      return gpuipc__fail(GPUIPC_E_PROTOCOL, "entry %u: name is not UTF-8 "
                          "(or holds a NUL)", i);
    uint64_t ext = 0;
    gpuipc_status s = gpuipc__tset_extent(e->dtype, e->ndim, e->shape,
                                          e->strides, &ext);
    if (s != GPUIPC_OK)
      return gpuipc__fail(s, "entry %u (%.*s): %s", i, (int)e->name_len, name,
                          gpuipc_last_error());
    if (ext != e->nbytes)
      return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                          "entry %u (%.*s): %llu bytes declared, its shape and "
                          "strides span %llu", i, (int)e->name_len, name,
                          (unsigned long long)e->nbytes, (unsigned long long)ext);
    if (e->piece >= t->n_pieces)
      return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE, "entry %u (%.*s): piece %u of %u",
                          i, (int)e->name_len, name, e->piece, t->n_pieces);
    uint64_t plen = t->piece_len[e->piece];
    if (e->offset > plen || e->nbytes > plen - e->offset)
      return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                          "entry %u (%.*s): bytes %llu+%llu outside piece %u "
                          "(%llu bytes)", i, (int)e->name_len, name,
                          (unsigned long long)e->offset,
                          (unsigned long long)e->nbytes, e->piece,
                          (unsigned long long)plen);
  }
  /* Entries may not overlap (empty ones occupy nothing). */
  uint32_t *ord = malloc((size_t)t->n_entries * sizeof *ord);
  if (ord == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "table check: %u entries",
                        t->n_entries);
  uint32_t m = 0;
  for (uint32_t i = 0; i < t->n_entries; i++)
    if (t->e[i].nbytes)
      ord[m++] = i;
  qsort_r(ord, m, sizeof *ord, by_place, t->e);
  for (uint32_t k = 1; k < m; k++) {
    const gpuipc__tset_entry *a = &t->e[ord[k - 1]], *b = &t->e[ord[k]];
    if (a->piece == b->piece && a->offset + a->nbytes > b->offset) {
      gpuipc_status s = gpuipc__fail(
          GPUIPC_E_OUT_OF_RANGE, "entries %u (%.*s) and %u (%.*s) overlap",
          ord[k - 1], (int)a->name_len, t->names + a->name_off, ord[k],
          (int)b->name_len, t->names + b->name_off);
      free(ord);
      return s;
    }
  }
  free(ord);
  /* Unique names, and the index that finds them. */
  uint32_t cap = 16;
  while (cap < 2 * t->n_entries)
    cap <<= 1;
  uint32_t *hash = calloc(cap, sizeof *hash);
  if (hash == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "table index: %u slots", cap);
  for (uint32_t i = 0; i < t->n_entries; i++) {
    const gpuipc__tset_entry *e = &t->e[i];
    const char *name = t->names + e->name_off;
    uint32_t h = name_hash(name, e->name_len) & (cap - 1);
    for (; hash[h]; h = (h + 1) & (cap - 1)) {
      const gpuipc__tset_entry *o = &t->e[hash[h] - 1];
      if (o->name_len == e->name_len &&
          memcmp(t->names + o->name_off, name, e->name_len) == 0) {
        uint32_t first = hash[h] - 1;
        free(hash);
        return gpuipc__fail(GPUIPC_E_PROTOCOL, "entries %u and %u are both "
                            "named \"%.*s\"", first, i, (int)e->name_len,
                            name);
      }
    }
    hash[h] = i + 1;
  }
  free(t->hash);
  t->hash = hash;
  t->hash_cap = cap;
  return GPUIPC_OK;
}

/* ---- encoding --------------------------------------------------------------- */

static size_t entry_len(const gpuipc__tset_entry *e) {
  size_t n = 24 + 16 * (size_t)e->ndim + e->name_len;
  return (n + 7) & ~(size_t)7;
}

gpuipc_status gpuipc__tset_table_encode(gpuipc__tset_table *t, uint8_t **out,
                                        size_t *len) {
  GPUIPC__CHECK(gpuipc__tset_table_check(t));
  size_t total = GPUIPC__TSET_HDR_LEN + 8 * (size_t)t->n_pieces;
  for (uint32_t i = 0; i < t->n_entries; i++)
    total += entry_len(&t->e[i]);
  if (total > GPUIPC_TSET_TABLE_MAX)
    return gpuipc__fail(GPUIPC_E_LIMIT, "table of %zu bytes (at most %zu)",
                        total, GPUIPC_TSET_TABLE_MAX);
  uint8_t *b = calloc(1, total);
  if (b == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "table of %zu bytes", total);
  gpuipc__put_le32(b, GPUIPC__TSET_MAGIC);
  gpuipc__put_le16(b + 4, GPUIPC__TSET_VERSION);
  gpuipc__put_le16(b + 6, GPUIPC__TSET_HDR_LEN);
  gpuipc__put_le32(b + 8, (uint32_t)total);
  gpuipc__put_le64(b + 16, t->layout_id);
  gpuipc__put_le32(b + 24, t->n_entries);
  gpuipc__put_le32(b + 28, t->n_pieces);
  gpuipc__put_le32(b + 32, t->copies);
  size_t pos = GPUIPC__TSET_HDR_LEN;
  for (uint32_t p = 0; p < t->n_pieces; p++, pos += 8)
    gpuipc__put_le64(b + pos, t->piece_len[p]);
  for (uint32_t i = 0; i < t->n_entries; i++) {
    const gpuipc__tset_entry *e = &t->e[i];
    uint8_t *q = b + pos;
    gpuipc__put_le16(q, e->name_len);
    q[2] = e->dtype;
    q[3] = e->ndim;
    gpuipc__put_le32(q + 4, e->piece);
    gpuipc__put_le64(q + 8, e->offset);
    gpuipc__put_le64(q + 16, e->nbytes);
    for (int d = 0; d < e->ndim; d++) {
      gpuipc__put_le64(q + 24 + 8 * d, (uint64_t)e->shape[d]);
      gpuipc__put_le64(q + 24 + 8 * (e->ndim + d), (uint64_t)e->strides[d]);
    }
    memcpy(q + 24 + 16 * e->ndim, t->names + e->name_off, e->name_len);
    pos += entry_len(e);
  }
  gpuipc__put_le32(b + 12, gpuipc__crc32c(0, b, total));
  *out = b;
  *len = total;
  return GPUIPC_OK;
}

/* ---- decoding --------------------------------------------------------------- */

void gpuipc__tset_table_free(gpuipc__tset_table *t) {
  if (t == NULL)
    return;
  free(t->piece_len);
  free(t->e);
  free(t->names);
  free(t->hash);
  memset(t, 0, sizeof *t);
}

gpuipc_status gpuipc__tset_table_decode(const uint8_t *in, size_t len,
                                        gpuipc__tset_table *t) {
  memset(t, 0, sizeof *t);
  if (in == NULL || len < GPUIPC__TSET_HDR_LEN)
    return gpuipc__fail(GPUIPC_E_TRUNCATED, "tensor-set table: %zu bytes, the "
                        "header alone is %d", len, GPUIPC__TSET_HDR_LEN);
  if (gpuipc__get_le32(in) != GPUIPC__TSET_MAGIC)
    return gpuipc__fail(GPUIPC_E_BAD_MAGIC, "not a tensor-set table");
  if (gpuipc__get_le16(in + 4) != GPUIPC__TSET_VERSION)
    return gpuipc__fail(GPUIPC_E_BAD_VERSION, "tensor-set table version %u "
                        "(this library reads %d)", gpuipc__get_le16(in + 4),
                        GPUIPC__TSET_VERSION);
  if (gpuipc__get_le16(in + 6) != GPUIPC__TSET_HDR_LEN)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor-set table: header of %u "
                        "bytes (version 1 has %d)", gpuipc__get_le16(in + 6),
                        GPUIPC__TSET_HDR_LEN);
  uint32_t total = gpuipc__get_le32(in + 8);
  if (total > len)
    return gpuipc__fail(GPUIPC_E_TRUNCATED, "tensor-set table: %zu of its %u "
                        "bytes", len, total);
  if (total < len)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor-set table: %zu bytes after "
                        "its end", len - total);
  if (total > GPUIPC_TSET_TABLE_MAX)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor-set table of %u bytes "
                        "(at most %zu)", total, GPUIPC_TSET_TABLE_MAX);
  {
    uint8_t hdr[GPUIPC__TSET_HDR_LEN];
    memcpy(hdr, in, sizeof hdr);
    memset(hdr + 12, 0, 4);
    uint32_t c = gpuipc__crc32c(0, hdr, sizeof hdr);
    c = gpuipc__crc32c(c, in + sizeof hdr, total - sizeof hdr);
    if (c != gpuipc__get_le32(in + 12))
      return gpuipc__fail(GPUIPC_E_BAD_CHECKSUM, "tensor-set table: checksum "
                          "%08x, computed %08x", gpuipc__get_le32(in + 12), c);
  }
  if (gpuipc__get_le32(in + 36) != 0 || gpuipc__get_le64(in + 40) != 0)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor-set table: reserved fields "
                        "not zero");
  uint32_t ne = gpuipc__get_le32(in + 24), np = gpuipc__get_le32(in + 28), nc = gpuipc__get_le32(in + 32);
  if (ne == 0 || ne > GPUIPC_TSET_ENTRIES_MAX || np == 0 ||
      np > GPUIPC_TSET_PIECES_MAX || nc < 1 || nc > 2)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor-set table: %u entries, %u "
                        "pieces, %u copies", ne, np, nc);
  /* Every entry takes at least 32 bytes: the counts must fit the bytes
   * before anything is allocated for them. */
  if ((uint64_t)GPUIPC__TSET_HDR_LEN + 8ull * np + 32ull * ne > total)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor-set table: %u entries and "
                        "%u pieces cannot fit in %u bytes", ne, np, total);
  gpuipc_status s = GPUIPC_OK;
  t->layout_id = gpuipc__get_le64(in + 16);
  t->n_entries = ne;
  t->n_pieces = np;
  t->copies = nc;
  t->piece_len = malloc(8 * (size_t)np);
  t->e = calloc(ne, sizeof *t->e);
  /* Names take at most the bytes of the entries, plus a NUL each. */
  t->names = malloc(total + (size_t)ne);
  if (!t->piece_len || !t->e || !t->names) {
    s = gpuipc__fail(GPUIPC_E_NO_MEMORY, "tensor-set table of %u entries", ne);
    goto fail;
  }
  size_t pos = GPUIPC__TSET_HDR_LEN;
  for (uint32_t p = 0; p < np; p++, pos += 8)
    t->piece_len[p] = gpuipc__get_le64(in + pos);
  size_t names = 0;
  for (uint32_t i = 0; i < ne; i++) {
    if (total - pos < 24) {
      s = gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor-set table: %u entries "
                       "declared, the bytes end in entry %u", ne, i);
      goto fail;
    }
    const uint8_t *q = in + pos;
    gpuipc__tset_entry *e = &t->e[i];
    e->name_len = gpuipc__get_le16(q);
    e->dtype = q[2];
    e->ndim = q[3];
    e->piece = gpuipc__get_le32(q + 4);
    e->offset = gpuipc__get_le64(q + 8);
    e->nbytes = gpuipc__get_le64(q + 16);
    if (e->ndim > GPUIPC_TSET_NDIM_MAX || e->name_len == 0 ||
        e->name_len > GPUIPC_TSET_NAME_MAX) {
      s = gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor-set table: entry %u: ndim "
                       "%u (at most %d), name of %u bytes (1 to %d)", i, e->ndim,
                       GPUIPC_TSET_NDIM_MAX, e->name_len, GPUIPC_TSET_NAME_MAX);
      goto fail;
    }
    size_t el = entry_len(e);
    if (total - pos < el) {
      s = gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor-set table: %u entries "
                       "declared, the bytes end in entry %u", ne, i);
      goto fail;
    }
    for (int d = 0; d < e->ndim; d++) {
      e->shape[d] = (int64_t)gpuipc__get_le64(q + 24 + 8 * d);
      e->strides[d] = (int64_t)gpuipc__get_le64(q + 24 + 8 * (e->ndim + d));
    }
    size_t nstart = 24 + 16 * (size_t)e->ndim;
    for (size_t k = nstart + e->name_len; k < el; k++)
      if (q[k] != 0) {
        s = gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor-set table: entry %u: "
                         "padding not zero", i);
        goto fail;
      }
    memcpy(t->names + names, q + nstart, e->name_len);
    e->name_off = (uint32_t)names;
    names += e->name_len;
    t->names[names++] = '\0';
    pos += el;
  }
  if (pos != total) {
    s = gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor-set table: %u entries "
                     "declared, %zu bytes remain after them", ne, total - pos);
    goto fail;
  }
  t->names_len = names;
  s = gpuipc__tset_table_check(t);
  if (s != GPUIPC_OK)
    goto fail;
  return GPUIPC_OK;
fail:
  gpuipc__tset_table_free(t);
  return s;
}

/* ---- buffer meta -------------------------------------------------------------- */

void gpuipc__tset_meta_encode(const gpuipc__tset_meta *m,
                              uint8_t out[GPUIPC__TSET_META_LEN]) {
  memset(out, 0, GPUIPC__TSET_META_LEN);
  gpuipc__put_le32(out, GPUIPC__TSET_META_MAGIC);
  gpuipc__put_le16(out + 4, m->kind);
  gpuipc__put_le64(out + 8, m->layout_id);
  gpuipc__put_le64(out + 16, m->a);
  gpuipc__put_le32(out + 24, m->b);
  gpuipc__put_le32(out + 28, m->c);
}

gpuipc_status gpuipc__tset_meta_decode(const uint8_t *in, size_t len,
                                       gpuipc__tset_meta *m) {
  if (len != GPUIPC__TSET_META_LEN || gpuipc__get_le32(in) != GPUIPC__TSET_META_MAGIC)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "a buffer that is not of a tensor "
                        "set (%zu bytes of meta) came on a subscribed "
                        "connection", len);
  m->kind = gpuipc__get_le16(in + 4);
  m->layout_id = gpuipc__get_le64(in + 8);
  m->a = gpuipc__get_le64(in + 16);
  m->b = gpuipc__get_le32(in + 24);
  m->c = gpuipc__get_le32(in + 28);
  if (gpuipc__get_le16(in + 6) != 0 || m->kind < GPUIPC__TSET_PIECE ||
      m->kind > GPUIPC__TSET_REPLACE)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor-set buffer of kind %u",
                        m->kind);
  return GPUIPC_OK;
}
