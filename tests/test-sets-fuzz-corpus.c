/*
 * test-sets-fuzz-corpus.c: replays the tensor-set table fuzz target's seed
 * corpus (tests/fuzz/corpus/sets-table) through the decoder, as an ordinary
 * test. Files named STATUS-what.bin must decode to that status; any other
 * file (inputs the fuzzer found) must decode to some status; a table that
 * decodes must re-encode to the same bytes.
 */
#include "harness.h"

#include "tree.h"

#include <dirent.h>

/* The status named by a file's prefix, or -1 when it names none. */
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

TEST_IMPL(sets_fuzz_corpus_replay) {
  char dir[1024];
  snprintf(dir, sizeof dir, "%s/tests/fuzz/corpus/sets-table", GPUIPC_SOURCE_DIR);
  DIR *d = opendir(dir);
  if (d == NULL)
    SKIP("no corpus at %s", dir);
  int files = 0, checked = 0;
  struct dirent *e;
  static uint8_t buf[1 << 20];
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    char path[2048];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    FILE *f = fopen(path, "rb");
    ASSERT_NOT_NULL(f);
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    uint8_t *copy = malloc(n ? n : 1);
    ASSERT_NOT_NULL(copy);
    memcpy(copy, buf, n);
    gpuipc__tset_table t;
    gpuipc_status s = gpuipc__tset_table_decode(copy, n, &t);
    ASSERT(s >= 0 && s < GPUIPC__STATUS_END);
    if (s == GPUIPC_OK) {
      uint8_t *again = NULL;
      size_t m = 0;
      ASSERT_OK(gpuipc__tset_table_encode(&t, &again, &m));
      ASSERT_EQ(m, n);
      ASSERT_MEM_EQ(again, copy, n);
      free(again);
      gpuipc__tset_table_free(&t);
    } else {
      ASSERT_NULL(t.e);
    }
    int want = expected(e->d_name);
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
