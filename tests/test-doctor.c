/*
 * test-doctor.c: `gpuipc doctor`: the JSON shape (checked with a strict JSON
 * parser written here), the human report's sections, --quiet, exit statuses,
 * the no-driver path and the runtime-directory check.
 *
 * The same tests run on the emulator (make test) and on the real driver
 * (make gpu-test): facts about devices are compared with what the library
 * itself reports, never with the emulator's particular values. Tests that
 * set GPUIPC_EMU_* skip on the real driver.
 */
#include "harness.h"

#include "tree.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdarg.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define OUT_CAP (1u << 20)

/* ---- a strict JSON parser (RFC 8259) -------------------------------------- */

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype;

typedef struct jval {
  jtype t;
  bool b;
  double num;
  char *str;           /* J_STR: decoded UTF-8 (no NUL inside: \u0000 refused) */
  size_t n;            /* J_ARR/J_OBJ: number of members */
  struct jval **items; /* J_ARR/J_OBJ: members */
  char **keys;         /* J_OBJ: keys */
} jval;

typedef struct jparser {
  const char *p, *end;
  int depth;
  char err[160];
} jparser;

static void jfree(jval *v) {
  if (v == NULL)
    return;
  free(v->str);
  for (size_t i = 0; i < v->n; i++) {
    jfree(v->items[i]);
    if (v->keys)
      free(v->keys[i]);
  }
  free(v->items);
  free(v->keys);
  free(v);
}

static bool jfail(jparser *ps, const char *fmt, ...) {
  if (ps->err[0] == '\0') {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ps->err, sizeof ps->err, fmt, ap);
    va_end(ap);
  }
  return false;
}

static void jskip_ws(jparser *ps) {
  while (ps->p < ps->end &&
         (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
    ps->p++;
}

static jval *jnew(jtype t) {
  jval *v = calloc(1, sizeof *v);
  ASSERT_NOT_NULL(v);
  v->t = t;
  return v;
}

static int hexval(char c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  if (c >= 'A' && c <= 'F')
    return c - 'A' + 10;
  return -1;
}

static bool jhex4(jparser *ps, unsigned *out) {
  if (ps->end - ps->p < 4)
    return jfail(ps, "short \\u escape");
  unsigned v = 0;
  for (int i = 0; i < 4; i++) {
    int h = hexval(ps->p[i]);
    if (h < 0)
      return jfail(ps, "bad hex digit in \\u escape");
    v = v * 16 + (unsigned)h;
  }
  ps->p += 4;
  *out = v;
  return true;
}

/* Length of a valid UTF-8 sequence at p (0 if invalid). */
static int utf8_len(const unsigned char *p, const unsigned char *end) {
  unsigned c = p[0];
  int n = (c >= 0xc2 && c <= 0xdf) ? 2 : (c >= 0xe0 && c <= 0xef) ? 3
          : (c >= 0xf0 && c <= 0xf4) ? 4 : 0;
  if (n == 0 || end - p < n)
    return 0;
  for (int k = 1; k < n; k++)
    if ((p[k] & 0xc0) != 0x80)
      return 0;
  if (n == 3 && ((c == 0xe0 && p[1] < 0xa0) || (c == 0xed && p[1] >= 0xa0)))
    return 0;
  if (n == 4 && ((c == 0xf0 && p[1] < 0x90) || (c == 0xf4 && p[1] >= 0x90)))
    return 0;
  return n;
}

static char *jstring(jparser *ps) {
  /* ps->p is at the opening quote. */
  ps->p++;
  size_t cap = 64, len = 0;
  char *s = malloc(cap);
  ASSERT_NOT_NULL(s);
  for (;;) {
    if (ps->p >= ps->end) {
      jfail(ps, "unterminated string");
      goto bad;
    }
    if (len + 8 >= cap) {
      cap *= 2;
      s = realloc(s, cap);
      ASSERT_NOT_NULL(s);
    }
    unsigned char c = (unsigned char)*ps->p;
    if (c == '"') {
      ps->p++;
      s[len] = '\0';
      return s;
    }
    if (c < 0x20) {
      jfail(ps, "raw control character 0x%02x in string", c);
      goto bad;
    }
    if (c == '\\') {
      ps->p++;
      if (ps->p >= ps->end) {
        jfail(ps, "unterminated escape");
        goto bad;
      }
      char e = *ps->p++;
      unsigned cp;
      switch (e) {
      case '"': s[len++] = '"'; continue;
      case '\\': s[len++] = '\\'; continue;
      case '/': s[len++] = '/'; continue;
      case 'b': s[len++] = '\b'; continue;
      case 'f': s[len++] = '\f'; continue;
      case 'n': s[len++] = '\n'; continue;
      case 'r': s[len++] = '\r'; continue;
      case 't': s[len++] = '\t'; continue;
      case 'u':
        if (!jhex4(ps, &cp))
          goto bad;
        if (cp >= 0xd800 && cp <= 0xdbff) {
          unsigned lo;
          if (ps->end - ps->p < 2 || ps->p[0] != '\\' || ps->p[1] != 'u') {
            jfail(ps, "lone high surrogate");
            goto bad;
          }
          ps->p += 2;
          if (!jhex4(ps, &lo))
            goto bad;
          if (lo < 0xdc00 || lo > 0xdfff) {
            jfail(ps, "bad low surrogate");
            goto bad;
          }
          cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
        } else if (cp >= 0xdc00 && cp <= 0xdfff) {
          jfail(ps, "lone low surrogate");
          goto bad;
        }
        if (cp == 0) {
          jfail(ps, "\\u0000 in string");
          goto bad;
        }
        if (cp < 0x80) {
          s[len++] = (char)cp;
        } else if (cp < 0x800) {
          s[len++] = (char)(0xc0 | (cp >> 6));
          s[len++] = (char)(0x80 | (cp & 0x3f));
        } else if (cp < 0x10000) {
          s[len++] = (char)(0xe0 | (cp >> 12));
          s[len++] = (char)(0x80 | ((cp >> 6) & 0x3f));
          s[len++] = (char)(0x80 | (cp & 0x3f));
        } else {
          s[len++] = (char)(0xf0 | (cp >> 18));
          s[len++] = (char)(0x80 | ((cp >> 12) & 0x3f));
          s[len++] = (char)(0x80 | ((cp >> 6) & 0x3f));
          s[len++] = (char)(0x80 | (cp & 0x3f));
        }
        continue;
      default:
        jfail(ps, "bad escape \\%c", e);
        goto bad;
      }
    }
    if (c < 0x80) {
      s[len++] = (char)c;
      ps->p++;
      continue;
    }
    int n = utf8_len((const unsigned char *)ps->p, (const unsigned char *)ps->end);
    if (n == 0) {
      jfail(ps, "invalid UTF-8 in string");
      goto bad;
    }
    memcpy(s + len, ps->p, (size_t)n);
    len += (size_t)n;
    ps->p += n;
  }
bad:
  free(s);
  return NULL;
}

static bool jnumber(jparser *ps, double *out) {
  const char *start = ps->p;
  const char *q = ps->p;
  if (q < ps->end && *q == '-')
    q++;
  if (q >= ps->end)
    return jfail(ps, "bad number");
  if (*q == '0') {
    q++;
  } else if (*q >= '1' && *q <= '9') {
    while (q < ps->end && *q >= '0' && *q <= '9')
      q++;
  } else {
    return jfail(ps, "bad number");
  }
  if (q < ps->end && *q == '.') {
    q++;
    if (q >= ps->end || *q < '0' || *q > '9')
      return jfail(ps, "bad fraction");
    while (q < ps->end && *q >= '0' && *q <= '9')
      q++;
  }
  if (q < ps->end && (*q == 'e' || *q == 'E')) {
    q++;
    if (q < ps->end && (*q == '+' || *q == '-'))
      q++;
    if (q >= ps->end || *q < '0' || *q > '9')
      return jfail(ps, "bad exponent");
    while (q < ps->end && *q >= '0' && *q <= '9')
      q++;
  }
  char buf[64];
  size_t n = (size_t)(q - start);
  if (n >= sizeof buf)
    return jfail(ps, "number too long");
  memcpy(buf, start, n);
  buf[n] = '\0';
  *out = strtod(buf, NULL);
  ps->p = q;
  return true;
}

static bool jliteral(jparser *ps, const char *lit) {
  size_t n = strlen(lit);
  if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, lit, n) != 0)
    return jfail(ps, "unexpected character '%c'", *ps->p);
  ps->p += n;
  return true;
}

static void jpush(jval *v, char *key, jval *item) {
  v->items = realloc(v->items, (v->n + 1) * sizeof *v->items);
  ASSERT_NOT_NULL(v->items);
  if (v->t == J_OBJ) {
    v->keys = realloc(v->keys, (v->n + 1) * sizeof *v->keys);
    ASSERT_NOT_NULL(v->keys);
    v->keys[v->n] = key;
  }
  v->items[v->n++] = item;
}

static jval *jvalue(jparser *ps) {
  jskip_ws(ps);
  if (ps->p >= ps->end) {
    jfail(ps, "unexpected end of input");
    return NULL;
  }
  if (++ps->depth > 64) {
    jfail(ps, "nesting too deep");
    return NULL;
  }
  jval *v = NULL;
  char c = *ps->p;
  if (c == '{' || c == '[') {
    bool obj = c == '{';
    char close = obj ? '}' : ']';
    v = jnew(obj ? J_OBJ : J_ARR);
    ps->p++;
    jskip_ws(ps);
    if (ps->p < ps->end && *ps->p == close) {
      ps->p++;
      goto done;
    }
    for (;;) {
      char *key = NULL;
      if (obj) {
        jskip_ws(ps);
        if (ps->p >= ps->end || *ps->p != '"') {
          jfail(ps, "expected a key");
          goto bad;
        }
        key = jstring(ps);
        if (key == NULL)
          goto bad;
        for (size_t i = 0; i < v->n; i++)
          if (strcmp(v->keys[i], key) == 0) {
            jfail(ps, "duplicate key \"%s\"", key);
            free(key);
            goto bad;
          }
        jskip_ws(ps);
        if (ps->p >= ps->end || *ps->p != ':') {
          jfail(ps, "expected ':' after key \"%s\"", key);
          free(key);
          goto bad;
        }
        ps->p++;
      }
      jval *item = jvalue(ps);
      if (item == NULL) {
        free(key);
        goto bad;
      }
      jpush(v, key, item);
      jskip_ws(ps);
      if (ps->p < ps->end && *ps->p == ',') {
        ps->p++;
        continue;
      }
      if (ps->p < ps->end && *ps->p == close) {
        ps->p++;
        goto done;
      }
      jfail(ps, "expected ',' or '%c'", close);
      goto bad;
    }
  } else if (c == '"') {
    v = jnew(J_STR);
    v->str = jstring(ps);
    if (v->str == NULL)
      goto bad;
  } else if (c == 't' || c == 'f') {
    v = jnew(J_BOOL);
    v->b = c == 't';
    if (!jliteral(ps, v->b ? "true" : "false"))
      goto bad;
  } else if (c == 'n') {
    v = jnew(J_NULL);
    if (!jliteral(ps, "null"))
      goto bad;
  } else {
    v = jnew(J_NUM);
    if (!jnumber(ps, &v->num))
      goto bad;
  }
done:
  ps->depth--;
  return v;
bad:
  jfree(v);
  return NULL;
}

/* Parses text that must be exactly one JSON object (and whitespace).
 * Returns NULL with the reason in err. */
static jval *jparse_object(const char *text, char *err, size_t errcap) {
  jparser ps = {.p = text, .end = text + strlen(text)};
  jskip_ws(&ps);
  jval *v = NULL;
  if (ps.p >= ps.end || *ps.p != '{')
    jfail(&ps, "not an object");
  else
    v = jvalue(&ps);
  if (v) {
    jskip_ws(&ps);
    if (ps.p != ps.end) {
      jfail(&ps, "trailing characters after the object");
      jfree(v);
      v = NULL;
    }
  }
  if (v == NULL)
    snprintf(err, errcap, "%s at offset %ld", ps.err, (long)(ps.p - text));
  return v;
}

/* Member of an object by a dotted path ("driver.version"); NULL if absent. */
static jval *jget(jval *v, const char *path) {
  char buf[256];
  snprintf(buf, sizeof buf, "%s", path);
  char *save = NULL;
  for (char *k = strtok_r(buf, ".", &save); k; k = strtok_r(NULL, ".", &save)) {
    if (v == NULL || v->t != J_OBJ)
      return NULL;
    jval *next = NULL;
    for (size_t i = 0; i < v->n; i++)
      if (strcmp(v->keys[i], k) == 0)
        next = v->items[i];
    v = next;
  }
  return v;
}

static const char *jtype_name(jtype t) {
  static const char *names[] = {"null", "bool", "number", "string", "array", "object"};
  return names[t];
}

/* The member at path, which must exist with type t. */
static jval *jreq_at(jval *root, const char *path, jtype t, const char *file, int line) {
  jval *v = jget(root, path);
  if (v == NULL)
    harness_fail(file, line, "JSON: missing key \"%s\"", path);
  if (v->t != t)
    harness_fail(file, line, "JSON: \"%s\" is a %s, want a %s", path, jtype_name(v->t),
                 jtype_name(t));
  return v;
}
#define JREQ(root, path, t) jreq_at((root), (path), (t), __FILE__, __LINE__)

/* Same, but null is also allowed. */
static jval *jreq_or_null_at(jval *root, const char *path, jtype t, const char *file,
                             int line) {
  jval *v = jget(root, path);
  if (v == NULL)
    harness_fail(file, line, "JSON: missing key \"%s\"", path);
  if (v->t != t && v->t != J_NULL)
    harness_fail(file, line, "JSON: \"%s\" is a %s, want a %s or null", path,
                 jtype_name(v->t), jtype_name(t));
  return v;
}
#define JREQ_OR_NULL(root, path, t) jreq_or_null_at((root), (path), (t), __FILE__, __LINE__)

/* ---- running the command ---------------------------------------------------- */

typedef struct doctor_run {
  int status;
  char *out; /* stdout */
  jval *json;
} doctor_run;

/* Runs `gpuipc doctor ARGS...` with extra environment entries (NULL-ended).
 * With --json among the arguments the output must parse as one object. */
static doctor_run run_doctor(char *const env[], const char *a1, const char *a2) {
  doctor_run r = {0};
  char *argv[] = {GPUIPC_CLI_PATH, "doctor", (char *)a1, (char *)a2, NULL};
  r.out = malloc(OUT_CAP);
  ASSERT_NOT_NULL(r.out);
  r.status = harness_run(argv, env, r.out, OUT_CAP);
  ASSERT_LT(strlen(r.out), OUT_CAP - 1); /* not truncated */
  bool json = (a1 && strcmp(a1, "--json") == 0) || (a2 && strcmp(a2, "--json") == 0);
  bool quiet = (a1 && strcmp(a1, "--quiet") == 0) || (a2 && strcmp(a2, "--quiet") == 0);
  if (json && !quiet) {
    char err[256];
    r.json = jparse_object(r.out, err, sizeof err);
    if (r.json == NULL)
      harness_fail(__FILE__, __LINE__, "doctor --json output is not one JSON object: %s\n%s",
                   err, r.out);
  }
  return r;
}

static void doctor_run_free(doctor_run *r) {
  free(r->out);
  jfree(r->json);
}

static const char *const mechanisms[] = {"legacy_handles", "pool_fds", "vmm_fds",
                                         "ipc_events", "stream_memops", "peer_access"};

/* One path of the fabric probe: not tried (a reason, nothing else), or
 * the failed call and its error exactly when not exported; an import
 * answer exactly when exported. */
static void check_fabric_path(jval *p) {
  ASSERT_EQ(p->t, J_OBJ);
  bool exported = JREQ(p, "exported", J_BOOL)->b;
  jval *imported = JREQ_OR_NULL(p, "imported", J_BOOL);
  jval *skipped = JREQ_OR_NULL(p, "skipped", J_STR);
  if (skipped->t == J_STR) {
    ASSERT(!exported);
    ASSERT_EQ(strncmp(skipped->str, "not tried: ", 11), 0);
    ASSERT_EQ(JREQ(p, "failed_call", J_NULL)->t, J_NULL);
    ASSERT_EQ(JREQ(p, "error", J_NULL)->t, J_NULL);
    ASSERT_EQ(imported->t, J_NULL);
    ASSERT_EQ(JREQ(p, "import_failed_call", J_NULL)->t, J_NULL);
    return;
  }
  if (exported) {
    ASSERT_EQ(JREQ(p, "failed_call", J_NULL)->t, J_NULL);
    ASSERT_EQ(JREQ(p, "error", J_NULL)->t, J_NULL);
    ASSERT_EQ(imported->t, J_BOOL);
    if (imported->b) {
      ASSERT_EQ(JREQ(p, "import_failed_call", J_NULL)->t, J_NULL);
      JREQ(p, "import_same", J_BOOL);
    } else {
      ASSERT_EQ(strncmp(JREQ(p, "import_failed_call", J_STR)->str, "cu", 2), 0);
      ASSERT_EQ(strncmp(JREQ(p, "import_error", J_STR)->str, "CUDA_ERROR_", 11), 0);
    }
  } else {
    ASSERT_EQ(strncmp(JREQ(p, "failed_call", J_STR)->str, "cu", 2), 0);
    ASSERT_EQ(strncmp(JREQ(p, "error", J_STR)->str, "CUDA_ERROR_", 11), 0);
    ASSERT_EQ(imported->t, J_NULL);
    ASSERT_EQ(JREQ(p, "import_failed_call", J_NULL)->t, J_NULL);
    ASSERT_EQ(JREQ(p, "import_same", J_NULL)->t, J_NULL);
  }
}

/* The fabric export probe (docs/doctor.md): a probe per device examined,
 * and the IMEX channels in every case. */
static void check_fabric_shape(jval *j, int n) {
  jval *fx = JREQ(j, "fabric_export", J_OBJ);
  bool probed = JREQ(fx, "probed", J_BOOL)->b;
  bool usable = JREQ(fx, "usable", J_BOOL)->b;
  if (usable)
    ASSERT_EQ(JREQ(fx, "reason", J_NULL)->t, J_NULL);
  else
    ASSERT_GT(strlen(JREQ(fx, "reason", J_STR)->str), 0);
  jval *devs = JREQ(fx, "devices", J_ARR);
  ASSERT_EQ(devs->n > 0, usable);
  for (size_t k = 0; k < devs->n; k++) {
    ASSERT_EQ(devs->items[k]->t, J_NUM);
    ASSERT(devs->items[k]->num >= 0 && devs->items[k]->num < n);
  }
  jval *probes = JREQ(fx, "probes", J_ARR);
  if (!probed)
    ASSERT_EQ(probes->n, 0);
  ASSERT_LE(probes->n, n);
  for (size_t k = 0; k < probes->n; k++) {
    jval *pr = probes->items[k];
    ASSERT_EQ(pr->t, J_OBJ);
    double ord = JREQ(pr, "ordinal", J_NUM)->num;
    ASSERT(ord >= 0 && ord < n);
    JREQ_OR_NULL(pr, "attribute", J_BOOL);
    check_fabric_path(JREQ(pr, "vmm", J_OBJ));
    check_fabric_path(JREQ(pr, "pool", J_OBJ));
    JREQ_OR_NULL(pr, "cleanup_errors", J_STR);
  }
  jval *x = JREQ(fx, "imex_channels", J_OBJ);
  ASSERT_STR_EQ(JREQ(x, "path", J_STR)->str, GPUIPC__IMEX_DIR);
  const char *state = JREQ(x, "state", J_STR)->str;
  ASSERT(strcmp(state, "missing") == 0 || strcmp(state, "unreadable") == 0 ||
         strcmp(state, "empty") == 0 || strcmp(state, "present") == 0);
  JREQ_OR_NULL(x, "errno_name", J_STR);
  JREQ_OR_NULL(x, "device_major", J_NUM);
  int count = (int)JREQ(x, "count", J_NUM)->num;
  ASSERT_EQ(count > 0, strcmp(state, "present") == 0);
  jval *chans = JREQ(x, "channels", J_ARR);
  ASSERT_EQ(chans->n, count < GPUIPC__IMEX_MAX ? count : GPUIPC__IMEX_MAX);
  for (size_t k = 0; k < chans->n; k++) {
    jval *c = chans->items[k];
    ASSERT_GT(strlen(JREQ(c, "name", J_STR)->str), 0);
    bool opens = JREQ(c, "opens", J_BOOL)->b;
    ASSERT_EQ(JREQ_OR_NULL(c, "errno_name", J_STR)->t, opens ? J_NULL : J_STR);
  }
  ASSERT_STR_CONTAINS(JREQ(x, "detail", J_STR)->str, GPUIPC__IMEX_DIR);
}

/* Checks everything the JSON promises regardless of the driver: keys, types,
 * matrix dimensions, verdict consistency. Returns the device count. */
static int check_shape(jval *j, int exit_status) {
  JREQ(j, "gpuipc_version", J_STR);
  ASSERT_STR_EQ(jget(j, "gpuipc_version")->str, gpuipc_version_string());

  JREQ(j, "system", J_OBJ);
  JREQ(j, "system.os", J_STR);
  JREQ_OR_NULL(j, "system.machine", J_STR);
  JREQ(j, "system.linux", J_BOOL);
  ASSERT(JREQ(j, "system.process_64bit", J_BOOL)->b == (sizeof(void *) == 8));
  JREQ_OR_NULL(j, "system.kernel", J_STR);
  JREQ(j, "system.kernel_ok", J_BOOL);

  JREQ(j, "driver", J_OBJ);
  bool loaded = JREQ(j, "driver.loaded", J_BOOL)->b;
  JREQ(j, "driver.initialized", J_BOOL);
  JREQ_OR_NULL(j, "driver.error", J_STR);
  JREQ(j, "driver.library", J_STR);
  JREQ_OR_NULL(j, "driver.path", J_STR);
  JREQ_OR_NULL(j, "driver.version", J_NUM);
  JREQ_OR_NULL(j, "driver.cuda_version", J_STR);
  JREQ_OR_NULL(j, "driver.kernel_module_version", J_STR);
  JREQ_OR_NULL(j, "driver.cuda_visible_devices", J_STR);
  JREQ_OR_NULL(j, "driver.devices_error", J_STR);
  int n = (int)JREQ(j, "driver.device_count", J_NUM)->num;
  if (loaded) {
    ASSERT_GT(JREQ(j, "driver.version", J_NUM)->num, 0);
    JREQ(j, "driver.cuda_version", J_STR);
  } else {
    JREQ(j, "driver.error", J_STR);
    ASSERT_EQ(n, 0);
  }

  jval *devs = JREQ(j, "devices", J_ARR);
  ASSERT_EQ(devs->n, n);
  for (int i = 0; i < n; i++) {
    jval *d = devs->items[i];
    ASSERT_EQ(d->t, J_OBJ);
    ASSERT_EQ(JREQ(d, "ordinal", J_NUM)->num, i);
    JREQ(d, "name", J_STR);
    const char *uuid = JREQ(d, "uuid", J_STR)->str;
    ASSERT_EQ(strncmp(uuid, "GPU-", 4), 0);
    ASSERT_EQ(strlen(uuid), GPUIPC_UUID_STRLEN - 1);
    JREQ(d, "pci_bus_id", J_STR);
    JREQ(d, "compute_capability", J_STR);
    ASSERT_GT(JREQ(d, "total_memory", J_NUM)->num, 0);
    JREQ(d, "cc_major", J_NUM);
    JREQ(d, "cc_minor", J_NUM);
    static const char *const bools[] = {
        "device_overlap", "unified_addressing", "memory_pools", "posix_fd_handles",
        "vmm", "ipc_events", "fabric_handles", "stream_memops_32bit",
        "stream_memops_64bit", "stream_wait_value_nor"};
    for (size_t k = 0; k < sizeof bools / sizeof bools[0]; k++)
      JREQ_OR_NULL(d, bools[k], J_BOOL);
    JREQ_OR_NULL(d, "async_engine_count", J_NUM);
    JREQ_OR_NULL(d, "mempool_handle_types_mask", J_NUM);
    jval *types = JREQ_OR_NULL(d, "mempool_handle_types", J_ARR);
    for (size_t k = 0; types->t == J_ARR && k < types->n; k++) {
      ASSERT_EQ(types->items[k]->t, J_STR);
      const char *t = types->items[k]->str;
      ASSERT(strcmp(t, "posix_fd") == 0 || strcmp(t, "win32") == 0 ||
             strcmp(t, "win32_kmt") == 0 || strcmp(t, "fabric") == 0);
    }
    JREQ_OR_NULL(d, "errors", J_STR);
  }

  static const char *const matrices[] = {"peers.can_access_peer", "peers.access_supported",
                                         "peers.performance_rank", "peers.native_atomic"};
  for (size_t k = 0; k < 4; k++) {
    jval *m = JREQ(j, matrices[k], J_ARR);
    ASSERT_EQ(m->n, n);
    for (int a = 0; a < n; a++) {
      jval *row = m->items[a];
      ASSERT_EQ(row->t, J_ARR);
      ASSERT_EQ(row->n, n);
      for (int b = 0; b < n; b++) {
        jtype want = k == 2 ? J_NUM : J_BOOL;
        jtype t = row->items[b]->t;
        if (a == b)
          ASSERT_EQ(t, J_NULL);
        else
          ASSERT(t == want || t == J_NULL);
      }
    }
  }

  JREQ(j, "process.uid", J_NUM);
  JREQ(j, "process.pidfd_getfd.available", J_BOOL);
  JREQ(j, "process.pidfd_getfd.errno", J_NUM);
  JREQ(j, "process.ptrace.yama", J_BOOL);
  JREQ_OR_NULL(j, "process.ptrace.scope", J_NUM);
  JREQ(j, "process.ptrace.meaning", J_STR);
  JREQ(j, "process.runtime_dir.path", J_STR);
  JREQ(j, "process.runtime_dir.source", J_STR);
  JREQ(j, "process.runtime_dir.exists", J_BOOL);
  JREQ(j, "process.runtime_dir.safe", J_BOOL);
  JREQ(j, "process.runtime_dir.detail", J_STR);
  JREQ_OR_NULL(j, "process.runtime_dir.mode", J_STR);
  JREQ_OR_NULL(j, "process.runtime_dir.owner_uid", J_NUM);
  JREQ_OR_NULL(j, "process.nofile.soft", J_NUM);
  JREQ_OR_NULL(j, "process.nofile.hard", J_NUM);

  JREQ(j, "container.in_container", J_BOOL);
  JREQ(j, "container.why", J_STR);
  JREQ_OR_NULL(j, "container.runtime", J_STR);
  JREQ_OR_NULL(j, "container.cgroup", J_STR);
  JREQ(j, "container.peer_pidfd", J_BOOL);
  static const char *const nss[] = {"pid", "ipc", "mnt", "net", "uts", "user", "cgroup"};
  for (size_t k = 0; k < sizeof nss / sizeof nss[0]; k++) {
    char path[96];
    snprintf(path, sizeof path, "container.namespaces.%s", nss[k]);
    jval *nv = JREQ(j, path, J_OBJ);
    JREQ_OR_NULL(nv, "inode", J_NUM);
    JREQ_OR_NULL(nv, "pid1_inode", J_NUM);
    JREQ_OR_NULL(nv, "initial", J_BOOL);
    JREQ(nv, "own", J_BOOL);
  }
  static const char *const xcs[] = {"pool_fds",     "vmm_fds",        "pinned_host",
                                    "stream_memops", "stale_checks",  "peer_death",
                                    "legacy_handles", "ipc_events",   "pidfd_getfd"};
  for (size_t k = 0; k < sizeof xcs / sizeof xcs[0]; k++) {
    char path[128];
    snprintf(path, sizeof path, "container.with_peer_in_another_container.%s", xcs[k]);
    jval *xv = JREQ(j, path, J_OBJ);
    JREQ(xv, "works", J_BOOL);
    ASSERT_GT(strlen(JREQ(xv, "why", J_STR)->str), 0);
  }

  /* The environment parameters (docs/environment.md), sorted by name. */
  jval *env = JREQ(j, "environment", J_ARR);
  ASSERT_GT(env->n, 0);
  for (size_t k = 0; k < env->n; k++) {
    jval *ev = env->items[k];
    ASSERT_EQ(ev->t, J_OBJ);
    const char *name = JREQ(ev, "name", J_STR)->str;
    if (k > 0)
      ASSERT_GT(strcmp(name, JREQ(env->items[k - 1], "name", J_STR)->str), 0);
    JREQ_OR_NULL(ev, "value", J_STR);
    JREQ_OR_NULL(ev, "default", J_STR);
    const char *read = JREQ(ev, "read", J_STR)->str;
    ASSERT(strcmp(read, "once") == 0 || strcmp(read, "each use") == 0 ||
           strcmp(read, "for the child") == 0);
    ASSERT_GT(strlen(JREQ(ev, "what", J_STR)->str), 0);
  }

  int usable = 0;
  for (size_t m = 0; m < sizeof mechanisms / sizeof mechanisms[0]; m++) {
    char path[96];
    snprintf(path, sizeof path, "mechanisms.%s", mechanisms[m]);
    jval *mv = JREQ(j, path, J_OBJ);
    bool u = JREQ(mv, "usable", J_BOOL)->b;
    usable += u;
    if (u)
      ASSERT_EQ(JREQ(mv, "reason", J_NULL)->t, J_NULL);
    else
      ASSERT_GT(strlen(JREQ(mv, "reason", J_STR)->str), 0);
    jval *where = JREQ(mv, strcmp(mechanisms[m], "peer_access") == 0 ? "pairs" : "devices",
                       J_ARR);
    if (!u)
      ASSERT_EQ(where->n, 0);
    for (size_t k = 0; k < where->n; k++) {
      jval *e = where->items[k];
      if (e->t == J_NUM) {
        ASSERT(e->num >= 0 && e->num < n);
      } else {
        ASSERT_EQ(e->t, J_ARR);
        ASSERT_EQ(e->n, 2);
      }
    }
  }
  ASSERT_EQ(JREQ(j, "usable_mechanisms", J_NUM)->num, usable);
  ASSERT_EQ(JREQ(j, "exit_status", J_NUM)->num, exit_status);
  check_fabric_shape(j, n);
  return n;
}

/* ---- tests ---------------------------------------------------------------- */

TEST_IMPL(doctor_json_validator) {
  /* The validator itself must be strict, or the tests below prove nothing. */
  static const char *const good[] = {
      "{}", " {\"a\": [1, -2.5e3, 0, true, false, null, \"x\\\"\\\\\\/\\n\\u00e9\\ud83d\\ude00\"]} ",
      "{\"a\":{\"b\":[[],{}]}}", "{\"\xc3\xa9\": \"\xe2\x82\xac\"}"};
  static const char *const bad[] = {
      "", "[]", "{", "{\"a\":1,}", "{\"a\":[1,]}", "{\"a\":01}", "{\"a\":1.}",
      "{\"a\":.5}", "{\"a\":+1}", "{\"a\":tru}", "{'a':1}", "{\"a\":\"\t\"}",
      "{\"a\":\"\\x\"}", "{\"a\":\"\\ud800\"}", "{\"a\":\"\xff\"}", "{\"a\":1}{}",
      "{\"a\":1 \"b\":2}", "{\"a\":1,\"a\":2}", "{\"a\":\"\\u0000\"}", "{\"a\":1e}",
      "{\"a\" 1}", "{\"a\":\"\xc0\xaf\"}", "{\"a\":NaN}"};
  char err[256];
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    jval *v = jparse_object(good[i], err, sizeof err);
    if (v == NULL)
      harness_fail(__FILE__, __LINE__, "valid JSON refused: %s: %s", good[i], err);
    jfree(v);
  }
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    jval *v = jparse_object(bad[i], err, sizeof err);
    if (v != NULL)
      harness_fail(__FILE__, __LINE__, "invalid JSON accepted: %s", bad[i]);
  }
  jval *v = jparse_object("{\"s\":\"a\\u00e9\\ud83d\\ude00\\n\"}", err, sizeof err);
  ASSERT_NOT_NULL(v);
  ASSERT_STR_EQ(jget(v, "s")->str, "a\xc3\xa9\xf0\x9f\x98\x80\n");
  jfree(v);
  return 0;
}

TEST_IMPL(doctor_json_shape) {
  int count = 0;
  ASSERT_OK(gpuipc_device_count(&count));
  doctor_run r = run_doctor(NULL, "--json", NULL);
  ASSERT_EQ(r.status, 0);
  int n = check_shape(r.json, 0);
  ASSERT_EQ(n, count);
  ASSERT_GE(n, 1);
  ASSERT(JREQ(r.json, "driver.loaded", J_BOOL)->b);
  ASSERT(JREQ(r.json, "driver.initialized", J_BOOL)->b);
  ASSERT_EQ(JREQ_OR_NULL(r.json, "driver.error", J_STR)->t, J_NULL);
  int version = 0;
  ASSERT_OK(gpuipc_driver_version(&version));
  ASSERT_EQ(JREQ(r.json, "driver.version", J_NUM)->num, version);
  ASSERT_STR_EQ(JREQ(r.json, "driver.library", J_STR)->str, gpuipc_driver_path());
  ASSERT_GE(JREQ(r.json, "usable_mechanisms", J_NUM)->num, 1);
  /* Each device is the one the library sees at that ordinal. */
  jval *devs = jget(r.json, "devices");
  for (int i = 0; i < n; i++) {
    gpuipc_uuid u;
    char text[GPUIPC_UUID_STRLEN];
    ASSERT_OK(gpuipc_device_uuid(i, &u));
    gpuipc_uuid_format(&u, text);
    ASSERT_STR_EQ(JREQ(devs->items[i], "uuid", J_STR)->str, text);
    for (int k = 0; k < i; k++)
      ASSERT(strcmp(jget(devs->items[k], "uuid")->str, text) != 0);
  }
  /* With one device, peer access is "not applicable". */
  if (n == 1)
    ASSERT_STR_CONTAINS(JREQ(r.json, "mechanisms.peer_access.reason", J_STR)->str,
                        "one device");
  /* The fabric probe examined every device, and says what each attribute
   * said beside the driver's answers. */
  ASSERT(JREQ(r.json, "fabric_export.probed", J_BOOL)->b);
  jval *probes = JREQ(r.json, "fabric_export.probes", J_ARR);
  ASSERT_EQ(probes->n, n);
  for (int i = 0; i < n; i++) {
    ASSERT_EQ(JREQ(probes->items[i], "ordinal", J_NUM)->num, i);
    jval *a = JREQ_OR_NULL(probes->items[i], "attribute", J_BOOL);
    jval *b = JREQ_OR_NULL(devs->items[i], "fabric_handles", J_BOOL);
    ASSERT_EQ(a->t, b->t);
    if (a->t == J_BOOL)
      ASSERT_EQ(a->b, b->b);
  }
  doctor_run_free(&r);
  return 0;
}

/* What the doctor must say of /dev/nvidia-caps-imex-channels, found here
 * independently of the library: "missing", "unreadable", "empty" or
 * "present". */
static const char *imex_state_here(void) {
  DIR *d = opendir(GPUIPC__IMEX_DIR);
  if (d == NULL)
    return errno == ENOENT ? "missing" : "unreadable";
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
      n++;
  closedir(d);
  return n ? "present" : "empty";
}

/* One path of a probe: refused by `call` with `error`, or (call NULL)
 * exported and imported again in the same process. */
static void check_fabric_path_is(jval *probe, const char *path, const char *call,
                                 const char *error) {
  char key[64];
  snprintf(key, sizeof key, "%s.exported", path);
  ASSERT_EQ(JREQ(probe, key, J_BOOL)->b, call == NULL);
  if (call) {
    snprintf(key, sizeof key, "%s.failed_call", path);
    ASSERT_STR_EQ(JREQ(probe, key, J_STR)->str, call);
    snprintf(key, sizeof key, "%s.error", path);
    ASSERT_STR_EQ(JREQ(probe, key, J_STR)->str, error);
  } else {
    snprintf(key, sizeof key, "%s.imported", path);
    ASSERT(JREQ(probe, key, J_BOOL)->b);
    snprintf(key, sizeof key, "%s.import_same", path);
    ASSERT(!JREQ(probe, key, J_BOOL)->b);
  }
}

static void check_line_widths(const char *out);

/* The doctor in one GPUIPC_EMU_FABRIC mode (empty: unset) on two devices:
 * JSON and text. */
static void run_fabric_mode(const char *mode, const char *fail, doctor_run *json,
                            doctor_run *text) {
  char envf[64], envx[128];
  snprintf(envf, sizeof envf, "GPUIPC_EMU_FABRIC=%s", mode);
  snprintf(envx, sizeof envx, "GPUIPC_EMU_FAIL=%s", fail ? fail : "");
  char *env[] = {envf, envx, "GPUIPC_EMU_DEVICES=2", "CUDA_VISIBLE_DEVICES=", NULL};
  *json = run_doctor(env, "--json", NULL);
  ASSERT_EQ(json->status, 0);
  ASSERT_EQ(check_shape(json->json, 0), 2);
  /* The probe counts in no result: the six mechanisms are usable as
   * without it. */
  ASSERT_EQ(JREQ(json->json, "usable_mechanisms", J_NUM)->num, 6);
  *text = run_doctor(env, NULL, NULL);
  ASSERT_EQ(text->status, 0);
  check_line_widths(text->out);
  ASSERT_STR_CONTAINS(text->out, "\nResult: 6 of 6 mechanisms usable (exit 0)\n");
}

/* The fabric export probe on the emulator's three fabric modes: by default
 * the device says no and the driver refuses with NOT_SUPPORTED; without an
 * IMEX channel it says yes and refuses with NOT_PERMITTED (what an H200
 * without one is expected to answer), the IMEX channels' state beside it;
 * with fabric handles that work, both paths export and import. */
/* Whether an IMEX channel here opens (as the doctor asks). */
static bool imex_channel_opens_here(const gpuipc__imex *x) {
  for (int k = 0; k < x->count && k < GPUIPC__IMEX_MAX; k++)
    if (x->channel[k].open_errno == 0)
      return true;
  return false;
}

TEST_IMPL(doctor_fabric_export_probe) {
  REQUIRE_EMULATOR("sets GPUIPC_EMU_FABRIC");
  const char *state = imex_state_here();
  gpuipc__imex x;
  gpuipc__imex_probe(&x);
  char detail[1024];
  gpuipc__imex_describe(&x, detail, sizeof detail);

  static const struct {
    const char *mode, *error;
    bool attribute;
  } refusing[] = {{"", "CUDA_ERROR_NOT_SUPPORTED", false},
                  {"no-channel", "CUDA_ERROR_NOT_PERMITTED", true}};
  for (size_t m = 0; m < GPUIPC__ARRAY_SIZE(refusing); m++) {
    doctor_run j, t;
    run_fabric_mode(refusing[m].mode, NULL, &j, &t);
    jval *fx = JREQ(j.json, "fabric_export", J_OBJ);
    ASSERT(JREQ(fx, "probed", J_BOOL)->b);
    ASSERT(!JREQ(fx, "usable", J_BOOL)->b);
    char reason[128];
    snprintf(reason, sizeof reason, "cuMemCreate returned %s (device 0)", refusing[m].error);
    ASSERT_STR_EQ(JREQ(fx, "reason", J_STR)->str, reason);
    jval *probes = JREQ(fx, "probes", J_ARR);
    ASSERT_EQ(probes->n, 2);
    for (int i = 0; i < 2; i++) {
      jval *pr = probes->items[i];
      jval *dev = JREQ(j.json, "devices", J_ARR)->items[i];
      ASSERT_EQ(JREQ(dev, "fabric_handles", J_BOOL)->b, refusing[m].attribute);
      ASSERT_EQ(JREQ(pr, "attribute", J_BOOL)->b, refusing[m].attribute);
      /* The pools' handle types name fabric exactly where the attribute does. */
      jval *types = JREQ(dev, "mempool_handle_types", J_ARR);
      ASSERT_EQ(types->n, refusing[m].attribute ? 2 : 1);
      check_fabric_path_is(pr, "vmm", "cuMemCreate", refusing[m].error);
      /* Refused for want of a channel, with none here: the pool path is
       * not tried (a real driver crashed in a refused fabric pool's
       * clean-up); else it is, and refused. */
      bool pool_skipped = strcmp(refusing[m].error, "CUDA_ERROR_NOT_PERMITTED") == 0 &&
                          !imex_channel_opens_here(&x);
      char want[320];
      if (pool_skipped) {
        ASSERT(!JREQ(pr, "pool.exported", J_BOOL)->b);
        ASSERT_EQ(JREQ(pr, "pool.failed_call", J_NULL)->t, J_NULL);
        const char *why = JREQ(pr, "pool.skipped", J_STR)->str;
        ASSERT_STR_CONTAINS(why, "not tried: the VMM export was refused");
        /* the text wraps the reason: its first words on the line */
        snprintf(want, sizeof want, "device %d pool: not tried: the VMM export was refused\n",
                 i);
      } else {
        check_fabric_path_is(pr, "pool", "cuMemPoolCreate", refusing[m].error);
        ASSERT_EQ(JREQ(pr, "pool.skipped", J_NULL)->t, J_NULL);
        snprintf(want, sizeof want, "device %d pool: no: cuMemPoolCreate returned %s\n", i,
                 refusing[m].error);
      }
      ASSERT_STR_CONTAINS(t.out, want);
      ASSERT_EQ(JREQ(pr, "cleanup_errors", J_NULL)->t, J_NULL);
      snprintf(want, sizeof want, "device %d VMM: no: cuMemCreate returned %s\n", i,
               refusing[m].error);
      ASSERT_STR_CONTAINS(t.out, want);
    }
    char first[160];
    snprintf(first, sizeof first,
             "\n  fabric export            device 0 VMM: no: cuMemCreate returned %s\n",
             refusing[m].error);
    ASSERT_STR_CONTAINS(t.out, first);
    ASSERT_STR_CONTAINS(t.out, refusing[m].attribute ? "pool handle types        posix_fd, fabric\n"
                                                     : "pool handle types        posix_fd\n");
    /* The IMEX channels: this machine's, in the JSON and (the text wraps
     * it) as the line's first words. */
    jval *xj = JREQ(fx, "imex_channels", J_OBJ);
    ASSERT_STR_EQ(JREQ(xj, "state", J_STR)->str, state);
    ASSERT_STR_EQ(JREQ(xj, "detail", J_STR)->str, detail);
    ASSERT_STR_CONTAINS(t.out, "IMEX channels: " GPUIPC__IMEX_DIR);
    if (strcmp(state, "missing") == 0)
      ASSERT_STR_CONTAINS(t.out, "IMEX channels: " GPUIPC__IMEX_DIR " is missing");
    doctor_run_free(&j);
    doctor_run_free(&t);
  }

  /* Fabric handles that work: yes on both paths, the import in the same
   * process too; no IMEX line in the text (nothing was refused). */
  doctor_run j, t;
  run_fabric_mode("yes", NULL, &j, &t);
  jval *fx = JREQ(j.json, "fabric_export", J_OBJ);
  ASSERT(JREQ(fx, "usable", J_BOOL)->b);
  ASSERT_EQ(JREQ(fx, "devices", J_ARR)->n, 2);
  for (int i = 0; i < 2; i++) {
    jval *pr = JREQ(fx, "probes", J_ARR)->items[i];
    check_fabric_path_is(pr, "vmm", NULL, NULL);
    check_fabric_path_is(pr, "pool", NULL, NULL);
  }
  ASSERT_STR_CONTAINS(t.out, "  fabric export            device 0 VMM: yes; imported in this "
                             "process\n");
  ASSERT_STR_CONTAINS(t.out, "device 1 pool: yes; imported in this process\n");
  ASSERT(strstr(t.out, "IMEX channels:") == NULL);
  doctor_run_free(&j);
  doctor_run_free(&t);

  /* A refused import in the same process and a failure while giving back
   * are reported, and everything else is still given back. */
  run_fabric_mode("yes", "cuMemPoolImportPointer:1:CUDA_ERROR_NOT_PERMITTED,cuMemRelease:1",
                  &j, &t);
  jval *pr = JREQ(j.json, "fabric_export.probes", J_ARR)->items[0];
  ASSERT(JREQ(pr, "pool.exported", J_BOOL)->b);
  ASSERT(!JREQ(pr, "pool.imported", J_BOOL)->b);
  ASSERT_STR_EQ(JREQ(pr, "pool.import_failed_call", J_STR)->str, "cuMemPoolImportPointer");
  ASSERT_STR_EQ(JREQ(pr, "pool.import_error", J_STR)->str, "CUDA_ERROR_NOT_PERMITTED");
  ASSERT_STR_EQ(JREQ(pr, "cleanup_errors", J_STR)->str, "cuMemRelease: CUDA_ERROR_UNKNOWN");
  /* (the text wraps the line before "returned") */
  ASSERT_STR_CONTAINS(t.out, "device 0 pool: yes; import in this process: "
                             "cuMemPoolImportPointer\n");
  ASSERT_STR_CONTAINS(t.out, " returned CUDA_ERROR_NOT_PERMITTED\n");
  ASSERT_STR_CONTAINS(t.out, "device 0, giving back: cuMemRelease: CUDA_ERROR_UNKNOWN\n");
  ASSERT_STR_CONTAINS(t.out, "IMEX channels: " GPUIPC__IMEX_DIR);
  doctor_run_free(&j);
  doctor_run_free(&t);
  return 0;
}

TEST_IMPL(doctor_json_two_devices) {
  REQUIRE_EMULATOR("sets GPUIPC_EMU_DEVICES");
  char *env[] = {"GPUIPC_EMU_DEVICES=2", "CUDA_VISIBLE_DEVICES=", NULL};
  doctor_run r = run_doctor(env, "--json", NULL);
  ASSERT_EQ(r.status, 0);
  ASSERT_EQ(check_shape(r.json, 0), 2);
  jval *m = JREQ(r.json, "peers.can_access_peer", J_ARR);
  ASSERT_EQ(m->items[0]->items[1]->t, J_BOOL);
  ASSERT(m->items[0]->items[1]->b);
  ASSERT_EQ(m->items[1]->items[0]->t, J_BOOL);
  ASSERT(m->items[1]->items[0]->b);
  ASSERT(JREQ(r.json, "mechanisms.peer_access.usable", J_BOOL)->b);
  ASSERT_EQ(JREQ(r.json, "mechanisms.peer_access.pairs", J_ARR)->n, 2);
  jval *devs = jget(r.json, "devices");
  ASSERT(strcmp(jget(devs->items[0], "uuid")->str, jget(devs->items[1], "uuid")->str) != 0);
  doctor_run_free(&r);
  return 0;
}

TEST_IMPL(doctor_json_vmm_disabled) {
  REQUIRE_EMULATOR("sets GPUIPC_EMU_DISABLE");
  char *env[] = {"GPUIPC_EMU_DISABLE=vmm", NULL};
  doctor_run r = run_doctor(env, "--json", NULL);
  ASSERT_EQ(r.status, 0); /* the other mechanisms remain */
  int n = check_shape(r.json, 0);
  jval *devs = jget(r.json, "devices");
  for (int i = 0; i < n; i++) {
    jval *vmm = JREQ(devs->items[i], "vmm", J_BOOL);
    ASSERT(!vmm->b);
  }
  ASSERT(!JREQ(r.json, "mechanisms.vmm_fds.usable", J_BOOL)->b);
  ASSERT_STR_CONTAINS(JREQ(r.json, "mechanisms.vmm_fds.reason", J_STR)->str, "VMM");
  ASSERT(JREQ(r.json, "mechanisms.legacy_handles.usable", J_BOOL)->b);
  doctor_run_free(&r);
  return 0;
}

TEST_IMPL(doctor_no_driver) {
  char *env[] = {"GPUIPC_CUDA_DRIVER=/nonexistent/libcuda-missing.so.1", NULL};
  doctor_run r = run_doctor(env, "--json", NULL);
  ASSERT_EQ(r.status, 2);
  ASSERT_EQ(check_shape(r.json, 2), 0);
  ASSERT(!JREQ(r.json, "driver.loaded", J_BOOL)->b);
  const char *err = JREQ(r.json, "driver.error", J_STR)->str;
  ASSERT_STR_CONTAINS(err, "/nonexistent/libcuda-missing.so.1");
  ASSERT_STR_CONTAINS(err, "no CUDA driver");
  ASSERT_STR_EQ(JREQ(r.json, "driver.library", J_STR)->str,
                "/nonexistent/libcuda-missing.so.1");
  ASSERT_EQ(JREQ(r.json, "usable_mechanisms", J_NUM)->num, 0);
  for (size_t m = 0; m < sizeof mechanisms / sizeof mechanisms[0]; m++) {
    char path[96];
    snprintf(path, sizeof path, "mechanisms.%s.reason", mechanisms[m]);
    ASSERT_STR_CONTAINS(JREQ(r.json, path, J_STR)->str, "no CUDA driver");
  }
  /* The sections that need no driver are still there. */
  JREQ(r.json, "system.kernel", J_STR);
  JREQ(r.json, "process.runtime_dir.path", J_STR);
  doctor_run_free(&r);
  return 0;
}

TEST_IMPL(doctor_no_driver_human) {
  char *env[] = {"GPUIPC_CUDA_DRIVER=/nonexistent/libcuda-missing.so.1", NULL};
  doctor_run r = run_doctor(env, NULL, NULL);
  ASSERT_EQ(r.status, 2);
  ASSERT_STR_CONTAINS(r.out, "no CUDA driver");
  ASSERT_STR_CONTAINS(r.out, "/nonexistent/libcuda-missing.so.1");
  ASSERT_STR_CONTAINS(r.out, "\nSystem\n");
  ASSERT_STR_CONTAINS(r.out, "\nDriver\n");
  ASSERT_STR_CONTAINS(r.out, "\nProcess\n");
  ASSERT_STR_CONTAINS(r.out, "\nMechanisms\n");
  ASSERT_STR_CONTAINS(r.out, "not usable: no CUDA driver");
  ASSERT_STR_CONTAINS(r.out, "exit 2");
  doctor_run_free(&r);
  return 0;
}

/* A path full of characters that JSON must escape: the error message that
 * names it must survive the round trip. */
TEST_IMPL(doctor_json_escaping) {
  char *env[] = {"GPUIPC_CUDA_DRIVER=/nonexistent/q\"uote\\back\nline\ttab\x01\xff.so",
                 NULL};
  doctor_run r = run_doctor(env, "--json", NULL);
  ASSERT_EQ(r.status, 2);
  const char *err = JREQ(r.json, "driver.error", J_STR)->str;
  ASSERT_STR_CONTAINS(err, "/nonexistent/q\"uote\\back\nline\ttab\x01");
  /* The byte that is not UTF-8 became U+FFFD. */
  ASSERT_STR_CONTAINS(err, "\x01\xef\xbf\xbd.so");
  doctor_run_free(&r);
  return 0;
}

/* Every line of the human report is at most 100 columns. */
static void check_line_widths(const char *out) {
  const char *line = out;
  while (*line) {
    const char *nl = strchr(line, '\n');
    size_t len = nl ? (size_t)(nl - line) : strlen(line);
    if (len > 100)
      harness_fail(__FILE__, __LINE__, "line of %zu columns: %.*s", len, (int)len, line);
    if (!nl)
      break;
    line = nl + 1;
  }
}

TEST_IMPL(doctor_human_sections) {
  int count = 0;
  ASSERT_OK(gpuipc_device_count(&count));
  doctor_run r = run_doctor(NULL, NULL, NULL);
  ASSERT_EQ(r.status, 0);
  static const char *const sections[] = {"\nSystem\n", "\nDriver\n", "\nDevice 0: ",
                                         "\nPeers", "\nProcess\n", "\nContainers\n",
                                         "\nEnvironment (docs/environment.md)\n",
                                         "\nMechanisms\n"};
  for (size_t i = 0; i < sizeof sections / sizeof sections[0]; i++)
    ASSERT_STR_CONTAINS(r.out, sections[i]);
  static const char *const labels[] = {
      "legacy handles", "pool fds", "VMM fds", "IPC events", "stream-memop ordering",
      "peer access", "deviceOverlap", "unified addressing", "memory pools",
      "pool handle types", "POSIX-fd handles", "VMM ", "IPC events", "fabric handles",
      "stream memops 32-bit", "stream memops 64-bit", "stream wait-value NOR",
      "compute capability", "UUID", "PCI bus id", "pidfd_getfd", "ptrace policy",
      "runtime directory", "open-file limit", "kernel", "64-bit process",
      "in a container", "pid namespace", "ipc namespace", "cgroup", "peer pidfd",
      "another container", "stale-descriptor checks", "peer-death cleanup",
      "pidfd_getfd route"};
  for (size_t i = 0; i < sizeof labels / sizeof labels[0]; i++)
    ASSERT_STR_CONTAINS(r.out, labels[i]);
  char want[32];
  snprintf(want, sizeof want, "\nDevice %d: ", count - 1);
  ASSERT_STR_CONTAINS(r.out, want);
  ASSERT_STR_CONTAINS(r.out, " usable");
  ASSERT_STR_CONTAINS(r.out, "(exit 0)");
  check_line_widths(r.out);
  doctor_run_free(&r);

  char *env[] = {"GPUIPC_CUDA_DRIVER=/nonexistent/" /* a long path, to be wrapped */
                 "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
                 "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa/libcuda.so",
                 NULL};
  r = run_doctor(env, NULL, NULL);
  ASSERT_EQ(r.status, 2);
  check_line_widths(r.out);
  doctor_run_free(&r);
  return 0;
}

TEST_IMPL(doctor_quiet) {
  doctor_run r = run_doctor(NULL, "--quiet", NULL);
  ASSERT_EQ(r.status, 0);
  ASSERT_STR_EQ(r.out, "");
  doctor_run_free(&r);
  r = run_doctor(NULL, "--json", "--quiet");
  ASSERT_EQ(r.status, 0);
  ASSERT_STR_EQ(r.out, "");
  doctor_run_free(&r);
  char *env[] = {"GPUIPC_CUDA_DRIVER=/nonexistent/libcuda-missing.so.1", NULL};
  r = run_doctor(env, "--quiet", NULL);
  ASSERT_EQ(r.status, 2);
  ASSERT_STR_EQ(r.out, "");
  doctor_run_free(&r);
  return 0;
}

TEST_IMPL(doctor_usage) {
  doctor_run r = run_doctor(NULL, "--no-such-option", NULL);
  ASSERT_EQ(r.status, 64);
  ASSERT_STR_EQ(r.out, "");
  doctor_run_free(&r);
  r = run_doctor(NULL, "--help", NULL);
  ASSERT_EQ(r.status, 0);
  ASSERT_STR_CONTAINS(r.out, "usage: gpuipc doctor");
  doctor_run_free(&r);
  return 0;
}

/* A driver that loads but sees no device: exit 1, not 2, and the reason.
 * CUDA_VISIBLE_DEVICES=-1 hides every device from the real driver. */
TEST_IMPL(doctor_no_device) {
  char *env[] = {"CUDA_VISIBLE_DEVICES=-1", "GPUIPC_EMU_DEVICES=", NULL};
  doctor_run r = run_doctor(env, "--json", NULL);
  ASSERT_EQ(r.status, 1);
  ASSERT_EQ(check_shape(r.json, 1), 0);
  ASSERT(JREQ(r.json, "driver.loaded", J_BOOL)->b);
  ASSERT_STR_EQ(JREQ(r.json, "driver.cuda_visible_devices", J_STR)->str, "-1");
  ASSERT_GT(strlen(JREQ(r.json, "driver.devices_error", J_STR)->str), 0);
  ASSERT_STR_CONTAINS(JREQ(r.json, "mechanisms.legacy_handles.reason", J_STR)->str,
                      "no device");
  doctor_run_free(&r);
  return 0;
}

/* The runtime directory: $XDG_RUNTIME_DIR/gpuipc when XDG_RUNTIME_DIR is
 * usable, /tmp/gpuipc-<uid> otherwise; safe only when ours and 0700. Needs no
 * driver, so it runs with none. */
TEST_IMPL(doctor_runtime_dir) {
  char xdg[512], expect[600], envx[600];
  snprintf(xdg, sizeof xdg, "%s/xdg", harness_tmpdir());
  ASSERT_EQ(mkdir(xdg, 0700), 0);
  snprintf(expect, sizeof expect, "%s/gpuipc", xdg);
  snprintf(envx, sizeof envx, "XDG_RUNTIME_DIR=%s", xdg);
  char *env[] = {"GPUIPC_CUDA_DRIVER=/nonexistent/libcuda-missing.so.1", envx, NULL};

  doctor_run r = run_doctor(env, "--json", NULL);
  ASSERT_STR_EQ(JREQ(r.json, "process.runtime_dir.path", J_STR)->str, expect);
  ASSERT_STR_EQ(JREQ(r.json, "process.runtime_dir.source", J_STR)->str, "XDG_RUNTIME_DIR");
  ASSERT(!JREQ(r.json, "process.runtime_dir.exists", J_BOOL)->b);
  ASSERT(JREQ(r.json, "process.runtime_dir.safe", J_BOOL)->b);
  doctor_run_free(&r);
  struct stat st;
  ASSERT_EQ(stat(expect, &st), -1); /* doctor does not create it */
  ASSERT_EQ(errno, ENOENT);

  ASSERT_EQ(mkdir(expect, 0700), 0);
  ASSERT_EQ(chmod(expect, 0755), 0);
  r = run_doctor(env, "--json", NULL);
  ASSERT(JREQ(r.json, "process.runtime_dir.exists", J_BOOL)->b);
  ASSERT(!JREQ(r.json, "process.runtime_dir.safe", J_BOOL)->b);
  ASSERT_STR_EQ(JREQ(r.json, "process.runtime_dir.mode", J_STR)->str, "0755");
  ASSERT_EQ(JREQ(r.json, "process.runtime_dir.owner_uid", J_NUM)->num, geteuid());
  ASSERT_STR_CONTAINS(JREQ(r.json, "process.runtime_dir.detail", J_STR)->str, "0700");
  doctor_run_free(&r);
  r = run_doctor(env, NULL, NULL);
  ASSERT_STR_CONTAINS(r.out, "unsafe");
  doctor_run_free(&r);

  ASSERT_EQ(chmod(expect, 0700), 0);
  r = run_doctor(env, "--json", NULL);
  ASSERT(JREQ(r.json, "process.runtime_dir.safe", J_BOOL)->b);
  ASSERT_STR_EQ(JREQ(r.json, "process.runtime_dir.mode", J_STR)->str, "0700");
  doctor_run_free(&r);
  ASSERT_EQ(rmdir(expect), 0);

  /* A symbolic link is never safe, even to a good directory. */
  char target[600];
  snprintf(target, sizeof target, "%s/target", xdg);
  ASSERT_EQ(mkdir(target, 0700), 0);
  ASSERT_EQ(symlink(target, expect), 0);
  r = run_doctor(env, "--json", NULL);
  ASSERT(!JREQ(r.json, "process.runtime_dir.safe", J_BOOL)->b);
  ASSERT_STR_CONTAINS(JREQ(r.json, "process.runtime_dir.detail", J_STR)->str, "symbolic link");
  doctor_run_free(&r);
  ASSERT_EQ(unlink(expect), 0);

  /* Without XDG_RUNTIME_DIR (or with a relative one): /tmp/gpuipc-<uid>. */
  char fallback[64];
  snprintf(fallback, sizeof fallback, "/tmp/gpuipc-%u", (unsigned)geteuid());
  char *env2[] = {"GPUIPC_CUDA_DRIVER=/nonexistent/libcuda-missing.so.1", "XDG_RUNTIME_DIR=",
                  NULL};
  r = run_doctor(env2, "--json", NULL);
  ASSERT_STR_EQ(JREQ(r.json, "process.runtime_dir.path", J_STR)->str, fallback);
  ASSERT_STR_EQ(JREQ(r.json, "process.runtime_dir.source", J_STR)->str, "fallback");
  JREQ(r.json, "process.runtime_dir.xdg_problem", J_STR);
  doctor_run_free(&r);
  char *env3[] = {"GPUIPC_CUDA_DRIVER=/nonexistent/libcuda-missing.so.1",
                  "XDG_RUNTIME_DIR=relative/dir", NULL};
  r = run_doctor(env3, "--json", NULL);
  ASSERT_STR_EQ(JREQ(r.json, "process.runtime_dir.path", J_STR)->str, fallback);
  ASSERT_STR_CONTAINS(JREQ(r.json, "process.runtime_dir.xdg_problem", J_STR)->str,
                      "absolute");
  doctor_run_free(&r);
  return 0;
}

/* The process-side probes agree with what this process can see. */
TEST_IMPL(doctor_process_side) {
  char *env[] = {"GPUIPC_CUDA_DRIVER=/nonexistent/libcuda-missing.so.1", NULL};
  doctor_run r = run_doctor(env, "--json", NULL);
  ASSERT_EQ(JREQ(r.json, "process.uid", J_NUM)->num, geteuid());
  struct stat st;
  bool yama = stat("/proc/sys/kernel/yama/ptrace_scope", &st) == 0;
  ASSERT_EQ(JREQ(r.json, "process.ptrace.yama", J_BOOL)->b, yama);
  if (yama)
    JREQ(r.json, "process.ptrace.scope", J_NUM);
  bool avail = JREQ(r.json, "process.pidfd_getfd.available", J_BOOL)->b;
  if (avail) {
    ASSERT_EQ(JREQ(r.json, "process.pidfd_getfd.errno", J_NUM)->num, 0);
  } else {
    ASSERT_GT(JREQ(r.json, "process.pidfd_getfd.errno", J_NUM)->num, 0);
    JREQ(r.json, "process.pidfd_getfd.failed_call", J_STR);
    JREQ(r.json, "process.pidfd_getfd.errno_name", J_STR);
  }
  double soft = JREQ(r.json, "process.nofile.soft", J_NUM)->num;
  ASSERT(soft > 0 || soft == -1); /* -1: unlimited */
  doctor_run_free(&r);
  return 0;
}

/* Each capability the emulator can turn off moves exactly the verdict that
 * rests on it, with a reason that names what is missing. */
static void check_disabled(const char *disable, const char *devices, const char *mech,
                           const char *reason_part) {
  char envd[128], envn[64];
  snprintf(envd, sizeof envd, "GPUIPC_EMU_DISABLE=%s", disable);
  snprintf(envn, sizeof envn, "GPUIPC_EMU_DEVICES=%s", devices);
  char *env[] = {envd, envn, "CUDA_VISIBLE_DEVICES=", NULL};
  doctor_run r = run_doctor(env, "--json", NULL);
  ASSERT_EQ(r.status, 0);
  check_shape(r.json, 0);
  char path[96];
  snprintf(path, sizeof path, "mechanisms.%s.usable", mech);
  if (JREQ(r.json, path, J_BOOL)->b)
    harness_fail(__FILE__, __LINE__, "GPUIPC_EMU_DISABLE=%s: %s still usable", disable, mech);
  snprintf(path, sizeof path, "mechanisms.%s.reason", mech);
  ASSERT_STR_CONTAINS(JREQ(r.json, path, J_STR)->str, reason_part);
  /* Legacy handles rest on nothing the emulator turns off here. */
  ASSERT(JREQ(r.json, "mechanisms.legacy_handles.usable", J_BOOL)->b);
  doctor_run_free(&r);
}

TEST_IMPL(doctor_json_disabled_capabilities) {
  REQUIRE_EMULATOR("sets GPUIPC_EMU_DISABLE");
  check_disabled("mempool", "1", "pool_fds", "memory pools");
  check_disabled("mempool_ipc", "1", "pool_fds", "POSIX fds");
  check_disabled("posix_fd", "1", "pool_fds", "POSIX fds");
  check_disabled("posix_fd", "1", "vmm_fds", "POSIX-fd");
  check_disabled("ipc_event", "1", "ipc_events", "IPC events");
  check_disabled("peer", "2", "peer_access", "no pair");

  /* Without peer access the matrix says so, off the diagonal. */
  char *env[] = {"GPUIPC_EMU_DISABLE=peer", "GPUIPC_EMU_DEVICES=2", "CUDA_VISIBLE_DEVICES=",
                 NULL};
  doctor_run r = run_doctor(env, "--json", NULL);
  jval *m = JREQ(r.json, "peers.can_access_peer", J_ARR);
  ASSERT_EQ(m->n, 2);
  ASSERT_EQ(m->items[0]->items[1]->t, J_BOOL);
  ASSERT(!m->items[0]->items[1]->b);
  ASSERT(!m->items[1]->items[0]->b);
  ASSERT_EQ(JREQ(r.json, "mechanisms.peer_access.pairs", J_ARR)->n, 0);
  doctor_run_free(&r);

  /* Pools without IPC: still pools, but no handle types. */
  char *env2[] = {"GPUIPC_EMU_DISABLE=mempool_ipc", NULL};
  r = run_doctor(env2, "--json", NULL);
  jval *d0 = JREQ(r.json, "devices", J_ARR)->items[0];
  ASSERT(JREQ(d0, "memory_pools", J_BOOL)->b);
  ASSERT_EQ(JREQ(d0, "mempool_handle_types", J_ARR)->n, 0);
  doctor_run_free(&r);
  return 0;
}

/* Run in new pid, IPC and mount namespaces (a fresh /proc), the doctor says
 * it is in a container, names the namespaces of its own, and says which
 * mechanisms work with a peer in another container: the fd-based kinds,
 * not legacy handles or IPC events (one pid namespace). Skips, saying why,
 * where the kernel refuses the namespaces. */
TEST_IMPL(doctor_container_namespaces) {
  int out[2], st[2];
  ASSERT_EQ(pipe2(out, O_CLOEXEC), 0);
  ASSERT_EQ(pipe2(st, O_CLOEXEC), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(out[0]);
    close(st[0]);
    int err = 0;
    if (unshare(CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC) != 0) {
      err = errno;
      ssize_t w = write(st[1], &err, sizeof err);
      (void)w;
      _exit(77);
    }
    pid_t inner = fork();
    if (inner == 0) {
      if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 ||
          mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0) {
        err = errno;
        ssize_t w = write(st[1], &err, sizeof err);
        (void)w;
        _exit(77);
      }
      dup2(out[1], 1);
      char *argv[] = {GPUIPC_CLI_PATH, "doctor", "--json", NULL};
      execv(GPUIPC_CLI_PATH, argv);
      _exit(127);
    }
    close(out[1]);
    close(st[1]);
    int ws = 0;
    while (waitpid(inner, &ws, 0) < 0 && errno == EINTR)
      ;
    _exit(WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws));
  }
  close(out[1]);
  close(st[1]);
  int err = 0;
  ssize_t n = read(st[0], &err, sizeof err);
  close(st[0]);
  char *buf = malloc(OUT_CAP);
  ASSERT_NOT_NULL(buf);
  size_t got = 0;
  for (;;) {
    ssize_t r = read(out[0], buf + got, OUT_CAP - 1 - got);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      break;
    got += (size_t)r;
  }
  buf[got] = '\0';
  close(out[0]);
  int ws = 0;
  waitpid(pid, &ws, 0);
  if (n == (ssize_t)sizeof err) {
    free(buf);
    SKIP("new namespaces refused here (%s); this test needs root or CAP_SYS_ADMIN",
         strerror(err));
  }
  ASSERT(WIFEXITED(ws));
  ASSERT_EQ(WEXITSTATUS(ws), 0);
  char perr[256];
  jval *j = jparse_object(buf, perr, sizeof perr);
  if (j == NULL)
    harness_fail(__FILE__, __LINE__, "not JSON: %s\n%s", perr, buf);
  check_shape(j, 0);
  ASSERT(JREQ(j, "container.in_container", J_BOOL)->b);
  ASSERT_STR_CONTAINS(JREQ(j, "container.why", J_STR)->str, "pid namespace");
  ASSERT(JREQ(j, "container.namespaces.pid.own", J_BOOL)->b);
  ASSERT(JREQ(j, "container.namespaces.ipc.own", J_BOOL)->b);
  ASSERT(!JREQ(j, "container.namespaces.pid.initial", J_BOOL)->b);
  const char *x = "container.with_peer_in_another_container";
  char path[160];
  static const char *const works[] = {"pool_fds", "vmm_fds", "pinned_host", "stale_checks"};
  for (size_t k = 0; k < sizeof works / sizeof works[0]; k++) {
    snprintf(path, sizeof path, "%s.%s.works", x, works[k]);
    if (!JREQ(j, path, J_BOOL)->b)
      harness_fail(__FILE__, __LINE__, "%s: false", path);
  }
  static const char *const needs_pidns[] = {"legacy_handles", "ipc_events", "pidfd_getfd"};
  for (size_t k = 0; k < sizeof needs_pidns / sizeof needs_pidns[0]; k++) {
    snprintf(path, sizeof path, "%s.%s.works", x, needs_pidns[k]);
    ASSERT(!JREQ(j, path, J_BOOL)->b);
    snprintf(path, sizeof path, "%s.%s.why", x, needs_pidns[k]);
    ASSERT_STR_CONTAINS(JREQ(j, path, J_STR)->str, "one pid namespace");
  }
  jfree(j);
  free(buf);
  return 0;
}

/* A device in exclusive-process compute mode is not probed for fabric
 * export (the probe's context could keep a job that starts meanwhile
 * out): the probe says so per device, and makes no context there. */
TEST_IMPL(doctor_fabric_probe_skips_exclusive_devices) {
  REQUIRE_EMULATOR("sets GPUIPC_EMU_COMPUTE_MODE");
  char *env[] = {"GPUIPC_EMU_COMPUTE_MODE=exclusive-process", "GPUIPC_EMU_FABRIC=yes",
                 "GPUIPC_EMU_DEVICES=2", "CUDA_VISIBLE_DEVICES=", NULL};
  doctor_run j = run_doctor(env, "--json", NULL);
  ASSERT_EQ(j.status, 0);
  jval *fx = JREQ(j.json, "fabric_export", J_OBJ);
  ASSERT(!JREQ(fx, "usable", J_BOOL)->b);
  ASSERT_STR_EQ(JREQ(fx, "reason", J_STR)->str,
                "not probed: device 0 is in exclusive-process compute mode");
  jval *probes = JREQ(fx, "probes", J_ARR);
  ASSERT_EQ(probes->n, 2);
  for (int i = 0; i < 2; i++) {
    ASSERT_STR_EQ(JREQ(probes->items[i], "skipped", J_STR)->str, "exclusive-process");
    ASSERT(jget(probes->items[i], "vmm") == NULL);
  }
  doctor_run t = run_doctor(env, NULL, NULL);
  ASSERT_EQ(t.status, 0);
  check_line_widths(t.out);
  ASSERT_STR_CONTAINS(t.out, "device 1: not probed: exclusive-process compute mode");
  doctor_run_free(&j);
  doctor_run_free(&t);
  return 0;
}
