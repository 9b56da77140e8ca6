/*
 * test-handle-fuzz-corpus.c: replays the descriptor fuzz target's seed
 * corpus (tests/fuzz/corpus/descriptor) through the decoder, as an ordinary
 * test. Files named STATUS-what.bin must decode to that status; any other
 * file (inputs the fuzzer found) must decode to some status, and a
 * descriptor that decodes must re-encode to the same bytes.
 */
#include "harness.h"

#include "tree.h"

#include <dirent.h>

static size_t read_file(const char *path, uint8_t *buf, size_t cap) {
  FILE *f = fopen(path, "rb");
  ASSERT_NOT_NULL(f);
  size_t n = fread(buf, 1, cap, f);
  ASSERT(!ferror(f));
  fclose(f);
  return n;
}

/* The status named by a file's prefix, or -1 when it names none. */
static int expected_status(const char *name) {
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

TEST_IMPL(handle_fuzz_corpus_replay) {
  char dir[1024];
  snprintf(dir, sizeof dir, "%s/tests/fuzz/corpus/descriptor",
           GPUIPC_SOURCE_DIR);
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
    size_t n = read_file(path, buf, sizeof buf);
    /* An exact-size heap copy, so a sanitizer build catches overreads. */
    uint8_t *copy = malloc(n ? n : 1);
    ASSERT_NOT_NULL(copy);
    memcpy(copy, buf, n);
    gpuipc__desc desc;
    gpuipc_status s = gpuipc__desc_decode(copy, n, &desc);
    ASSERT(s >= 0 && s < GPUIPC__STATUS_END);
    if (s == GPUIPC_OK && n == GPUIPC__DESC_LEN) {
      uint8_t again[GPUIPC_DESC_MAX];
      size_t m = 0;
      ASSERT_OK(gpuipc__desc_encode(&desc, again, sizeof again, &m));
      ASSERT_EQ(m, n);
      ASSERT_MEM_EQ(again, copy, n);
    }
    gpuipc_desc_info info = GPUIPC_DESC_INFO_INIT;
    ASSERT_EQ(gpuipc_desc_get_info(copy, n, &info), s);
    int want = expected_status(e->d_name);
    if (want >= 0) {
      if ((int)s != want)
        harness_fail(__FILE__, __LINE__, "%s: decoded to %s, want %s (%s)",
                     e->d_name, gpuipc_status_name(s),
                     gpuipc_status_name((gpuipc_status)want),
                     gpuipc_last_error());
      checked++;
    }
    free(copy);
    files++;
  }
  closedir(d);
  printf("replayed %d corpus file(s), %d with an expected status\n", files,
         checked);
  ASSERT_GT(files, 20);
  ASSERT_GT(checked, 20);
  return 0;
}
