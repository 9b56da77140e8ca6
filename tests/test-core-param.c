/*
 * The environment parameters (src/core/param.h): a ONCE parameter keeps the
 * value of its first read, an EACH_USE one follows the environment, and
 * every declaration is in the list gpuipc doctor prints.
 */
#include "harness.h"
#include "tree.h"

#include <pthread.h>

GPUIPC__PARAM(test_once, "GPUIPC_TEST_PARAM_ONCE", GPUIPC__PARAM_ONCE, "one",
              "a parameter of this test, read once")
GPUIPC__PARAM(test_unset, "GPUIPC_TEST_PARAM_UNSET", GPUIPC__PARAM_ONCE, NULL,
              "a parameter of this test, read once while unset")
GPUIPC__PARAM(test_each, "GPUIPC_TEST_PARAM_EACH", GPUIPC__PARAM_EACH_USE, NULL,
              "a parameter of this test, read at each use")

static const gpuipc__param *find(const char *name) {
  size_t n = 0;
  gpuipc__param *const *all = gpuipc__params(&n);
  for (size_t i = 0; i < n; i++)
    if (strcmp(all[i]->name, name) == 0)
      return all[i];
  return NULL;
}

TEST_IMPL(core_param_once_keeps_its_first_read) {
  ASSERT_EQ(setenv("GPUIPC_TEST_PARAM_ONCE", "first", 1), 0);
  ASSERT_STR_EQ(param_test_once(), "first");
  ASSERT_EQ(setenv("GPUIPC_TEST_PARAM_ONCE", "second", 1), 0);
  ASSERT_STR_EQ(param_test_once(), "first");
  /* Unset at the first read: unset for good. */
  ASSERT_EQ(unsetenv("GPUIPC_TEST_PARAM_UNSET"), 0);
  ASSERT(param_test_unset() == NULL);
  ASSERT_EQ(setenv("GPUIPC_TEST_PARAM_UNSET", "late", 1), 0);
  ASSERT(param_test_unset() == NULL);
  return 0;
}

TEST_IMPL(core_param_each_use_follows_the_environment) {
  ASSERT_EQ(unsetenv("GPUIPC_TEST_PARAM_EACH"), 0);
  ASSERT(param_test_each() == NULL);
  ASSERT_EQ(setenv("GPUIPC_TEST_PARAM_EACH", "a", 1), 0);
  ASSERT_STR_EQ(param_test_each(), "a");
  ASSERT_EQ(setenv("GPUIPC_TEST_PARAM_EACH", "b", 1), 0);
  ASSERT_STR_EQ(param_test_each(), "b");
  return 0;
}

TEST_IMPL(core_param_list_has_every_declaration) {
  const gpuipc__param *p = find("GPUIPC_TEST_PARAM_ONCE");
  ASSERT(p != NULL);
  ASSERT_STR_EQ(p->dflt, "one");
  ASSERT_EQ(p->when, GPUIPC__PARAM_ONCE);
  ASSERT(find("GPUIPC_TEST_PARAM_EACH") != NULL);
  /* The library's own, from several layers. */
  static const char *const lib[] = {"GPUIPC_LOG", "GPUIPC_CUDA_DRIVER",
                                    "XDG_RUNTIME_DIR", "GPUIPC_CARRIER",
                                    "GPUIPC_IMPORT_LINGER_MS"};
  for (size_t i = 0; i < sizeof lib / sizeof lib[0]; i++) {
    p = find(lib[i]);
    ASSERT(p != NULL);
    ASSERT(p->what != NULL && p->what[0] != '\0');
  }
  return 0;
}

/* Many threads reading a ONCE parameter for the first time at once all see
 * the one value. */
static const char *seen[8];
static void *read_once(void *arg) {
  seen[(intptr_t)arg] = param_test_once();
  return NULL;
}

TEST_IMPL(core_param_first_reads_race_to_one_value) {
  ASSERT_EQ(setenv("GPUIPC_TEST_PARAM_ONCE", "raced", 1), 0);
  pthread_t t[8];
  for (intptr_t i = 0; i < 8; i++)
    ASSERT_EQ(pthread_create(&t[i], NULL, read_once, (void *)i), 0);
  for (int i = 0; i < 8; i++)
    ASSERT_EQ(pthread_join(t[i], NULL), 0);
  for (int i = 0; i < 8; i++)
    ASSERT(seen[i] == seen[0] && seen[i] != NULL);
  ASSERT_STR_EQ(seen[0], "raced");
  return 0;
}
