/*
 * test-log.c: GPUIPC_LOG_SUBSYS selects the modules whose INFO, DEBUG and
 * TRACE lines are written (a list of names, "all", or '^' and the names
 * not to write; warnings and errors always pass). The variable is read
 * once per process, so each setting runs in a helper of its own, logging
 * to a file of its own.
 */
#include "harness.h"
#include "tree.h"

/* Logs one INFO line for each of conn, handle, arena and one WARN line
 * for handle. */
HELPER_IMPL(log_modules) {
  GPUIPC__INFO("conn", "line-conn-info");
  GPUIPC__INFO("handle", "line-handle-info");
  GPUIPC__DEBUG("arena", "line-arena-debug");
  GPUIPC__WARN("handle", "line-handle-warn");
  return 0;
}

/* Runs the helper with GPUIPC_LOG_SUBSYS=subsys (NULL: unset) and returns
 * which of the four lines it wrote, as a string of 0/1. */
static const char *run_with(const char *subsys, char result[5]) {
  static int n;
  char file[600], env_subsys[300], env_file[700];
  snprintf(file, sizeof file, "%s/log-%d", harness_tmpdir(), n++);
  snprintf(env_file, sizeof env_file, "GPUIPC_LOG_FILE=%s", file);
  snprintf(env_subsys, sizeof env_subsys, "GPUIPC_LOG_SUBSYS=%s",
           subsys ? subsys : "");
  char *env[] = {"GPUIPC_LOG=debug", env_file, env_subsys, NULL};
  pid_t pid = spawn_helper("log_modules", env, NULL, NULL);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  static char text[8192];
  text[0] = '\0';
  FILE *f = fopen(file, "r");
  if (f) {
    size_t got = fread(text, 1, sizeof text - 1, f);
    text[got] = '\0';
    fclose(f);
  }
  static const char *const lines[] = {
      "INFO [conn] line-conn-info", "INFO [handle] line-handle-info",
      "DEBUG [arena] line-arena-debug", "WARN [handle] line-handle-warn"};
  for (int i = 0; i < 4; i++)
    result[i] = strstr(text, lines[i]) ? '1' : '0';
  result[4] = '\0';
  return result;
}

TEST_IMPL(log_subsys_selects_modules) {
  char r[5];
  /* Unset, or set but empty: every module. */
  ASSERT_STR_EQ(run_with(NULL, r), "1111");
  ASSERT_STR_EQ(run_with("all", r), "1111");
  ASSERT_STR_EQ(run_with("ALL", r), "1111");
  /* Only the named ones (case and spaces do not matter). */
  ASSERT_STR_EQ(run_with("conn", r), "1001");
  ASSERT_STR_EQ(run_with("Conn, arena", r), "1011");
  ASSERT_STR_EQ(run_with("handle", r), "0101");
  /* A name matches whole: "han" is not "handle". */
  ASSERT_STR_EQ(run_with("han", r), "0001");
  /* '^': all but the named ones; warnings still pass. */
  ASSERT_STR_EQ(run_with("^handle", r), "1011");
  ASSERT_STR_EQ(run_with("^conn,arena", r), "0101");
  ASSERT_STR_EQ(run_with("^all", r), "0001");
  return 0;
}
