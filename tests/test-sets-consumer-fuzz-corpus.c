/*
 * test-sets-consumer-fuzz-corpus.c: replays the seed corpus of the
 * tensor-set consumer's fuzz target (tests/fuzz/corpus/sets-consumer)
 * through the target's own harness, compiled in here under other names,
 * as an ordinary test: every input must run through without a crash, a
 * hang, a leaked descriptor (the harness aborts on one) or, under ASan,
 * leaked memory. Its own file: the harness's static names would collide
 * with those of the connection harnesses in test-fuzz-corpus.c.
 */
#include "harness.h"

#include <dirent.h>

int fuzz_sets_consumer_init(int *argc, char ***argv);
int fuzz_sets_consumer_one(const uint8_t *data, size_t size);

#define LLVMFuzzerInitialize fuzz_sets_consumer_init
#define LLVMFuzzerTestOneInput fuzz_sets_consumer_one
#include "fuzz/fuzz_sets_consumer.c"
#undef LLVMFuzzerInitialize
#undef LLVMFuzzerTestOneInput

TEST_IMPL(fuzz_corpus_sets_consumer) {
  REQUIRE_EMULATOR("the harness makes the emulator the driver");
  char dir[1024];
  snprintf(dir, sizeof dir, "%s/tests/fuzz/corpus/sets-consumer",
           GPUIPC_SOURCE_DIR);
  DIR *d = opendir(dir);
  if (d == NULL)
    SKIP("no corpus at %s", dir);
  fuzz_sets_consumer_init(NULL, NULL);
  fuzz_fd_baseline = -1;
  static uint8_t buf[8192];
  int files = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    char path[2048];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    FILE *f = fopen(path, "rb");
    ASSERT_NOT_NULL(f);
    size_t n = fread(buf, 1, sizeof buf, f);
    ASSERT(!ferror(f));
    fclose(f);
    printf("sets-consumer/%s (%zu bytes)\n", e->d_name, n);
    fflush(stdout);
    uint8_t *copy = malloc(n ? n : 1);
    ASSERT_NOT_NULL(copy);
    memcpy(copy, buf, n);
    ASSERT_EQ(fuzz_sets_consumer_one(copy, n), 0);
    free(copy);
    files++;
  }
  closedir(d);
  printf("replayed %d file(s) of corpus/sets-consumer\n", files);
  ASSERT_GT(files, 20);
  return 0;
}
