/*
 * report.c: the machine-readable record of a benchmark run (`gpuipc bench
 * ... --json FILE`): every figure a benchmark prints, as rows of named
 * tables, plus the machine, the driver, the GPUs and the command line.
 * bench/plot.py turns it into charts; the format is in docs/bench-json.md.
 * Without --json every call here does nothing.
 *
 * The benchmarks call gpuipc_bench_json_begin(name) once, then
 * row_begin/str/num/row_end for each printed row, and str/num outside a row
 * for the benchmark's own facts (iterations, sizes); tools/bench.c writes
 * the file once every benchmark of the run is done.
 */
#include "bench.h"
#include "tree.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

typedef struct sbuf {
  char *p;
  size_t len, cap;
} sbuf;

static void sb_vadd(sbuf *b, const char *fmt, va_list ap) {
  va_list aq;
  va_copy(aq, ap);
  int n = vsnprintf(NULL, 0, fmt, aq);
  va_end(aq);
  if (n < 0)
    return;
  if (b->len + (size_t)n + 1 > b->cap) {
    size_t cap = (b->cap ? b->cap * 2 : 4096) + (size_t)n;
    char *q = realloc(b->p, cap);
    if (q == NULL)
      return;
    b->p = q;
    b->cap = cap;
  }
  vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
  b->len += (size_t)n;
}

static void sb_add(sbuf *b, const char *fmt, ...) GPUIPC__PRINTF(2, 3);
static void sb_add(sbuf *b, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  sb_vadd(b, fmt, ap);
  va_end(ap);
}

static void sb_str(sbuf *b, const char *s) {
  sb_add(b, "\"");
  for (; s && *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\')
      sb_add(b, "\\%c", ch);
    else if (ch < 0x20)
      sb_add(b, "\\u%04x", ch);
    else
      sb_add(b, "%c", ch);
  }
  sb_add(b, "\"");
}

#define MAX_BENCH 8
#define MAX_TABLES 8

static struct {
  const char *path; /* NULL: no report */
  int emulated;
  int nbench;
  struct {
    char name[32];
    sbuf info;
    int ntables;
    struct {
      char name[32];
      sbuf rows;
    } t[MAX_TABLES];
  } b[MAX_BENCH];
  sbuf *row;     /* the row being filled, NULL outside a row */
  bool row_first;
} R;

int gpuipc_bench_json_take(int *argc, char **argv) {
  for (int i = 1; i < *argc; i++) {
    if (strcmp(argv[i], "--json") != 0)
      continue;
    if (i + 1 >= *argc || argv[i + 1][0] == '\0') {
      fprintf(stderr, "gpuipc bench: --json needs a file name\n");
      return -1;
    }
    R.path = argv[i + 1];
    for (int k = i; k + 2 <= *argc; k++)
      argv[k] = argv[k + 2];
    *argc -= 2;
    i--;
  }
  return 0;
}

void gpuipc_bench_json_emulated(int emulated) { R.emulated = emulated; }

static bool on(void) { return R.path != NULL && R.nbench > 0; }

void gpuipc_bench_json_begin(const char *name) {
  if (R.path == NULL || R.nbench >= MAX_BENCH)
    return;
  snprintf(R.b[R.nbench].name, sizeof R.b[R.nbench].name, "%s", name);
  R.nbench++;
  R.row = NULL;
}

static sbuf *table(const char *name) {
  __typeof__(R.b[0]) *b = &R.b[R.nbench - 1];
  for (int i = 0; i < b->ntables; i++)
    if (strcmp(b->t[i].name, name) == 0)
      return &b->t[i].rows;
  if (b->ntables >= MAX_TABLES)
    return NULL;
  snprintf(b->t[b->ntables].name, sizeof b->t[0].name, "%s", name);
  return &b->t[b->ntables++].rows;
}

void gpuipc_bench_json_row_begin(const char *tab) {
  if (!on())
    return;
  R.row = table(tab);
  if (R.row == NULL)
    return;
  sb_add(R.row, "%s\n        {", R.row->len ? "," : "");
  R.row_first = true;
}

void gpuipc_bench_json_row_end(void) {
  if (on() && R.row)
    sb_add(R.row, "}");
  R.row = NULL;
}

static sbuf *target(bool *first) {
  if (R.row) {
    *first = R.row_first;
    R.row_first = false;
    return R.row;
  }
  sbuf *b = &R.b[R.nbench - 1].info;
  *first = b->len == 0;
  return b;
}

void gpuipc_bench_json_str(const char *key, const char *val) {
  if (!on())
    return;
  bool first;
  sbuf *b = target(&first);
  sb_add(b, "%s\"%s\": ", first ? "" : ", ", key);
  sb_str(b, val);
}

void gpuipc_bench_json_num(const char *key, double val) {
  if (!on())
    return;
  bool first;
  sbuf *b = target(&first);
  /* JSON has no NaN or infinity: a figure that could not be measured is
   * null. */
  if (val != val || val > 1e300 || val < -1e300)
    sb_add(b, "%s\"%s\": null", first ? "" : ", ", key);
  else if (val == (double)(long long)val && val < 9e15 && val > -9e15)
    sb_add(b, "%s\"%s\": %lld", first ? "" : ", ", key, (long long)val);
  else
    sb_add(b, "%s\"%s\": %.6g", first ? "" : ", ", key, val);
}

static void read_line(const char *path, const char *key, char *out,
                      size_t cap) {
  out[0] = '\0';
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return;
  char line[512];
  size_t kl = strlen(key);
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, key, kl) != 0)
      continue;
    char *v = strchr(line, ':');
    if (v == NULL)
      continue;
    v++;
    while (*v == ' ' || *v == '\t')
      v++;
    v[strcspn(v, "\n")] = '\0';
    snprintf(out, cap, "%s", v);
    break;
  }
  fclose(f);
}

static void machine(sbuf *o) {
  struct utsname u;
  char host[256] = "?", cpu[256], mem[128];
  if (uname(&u) != 0)
    memset(&u, 0, sizeof u);
  gethostname(host, sizeof host - 1);
  read_line("/proc/cpuinfo", "model name", cpu, sizeof cpu);
  read_line("/proc/meminfo", "MemTotal", mem, sizeof mem);
  sb_add(o, "  \"machine\": {\"hostname\": ");
  sb_str(o, host);
  sb_add(o, ", \"kernel\": ");
  sb_str(o, u.release);
  sb_add(o, ", \"arch\": ");
  sb_str(o, u.machine);
  sb_add(o, ", \"cpu\": ");
  sb_str(o, cpu);
  sb_add(o, ", \"cpus\": %ld, \"memory_kib\": %lld},\n",
         sysconf(_SC_NPROCESSORS_ONLN), atoll(mem));
}

static void driver_and_gpus(sbuf *o) {
  int v = 0, n = 0;
  bool ok = gpuipc__driver() == GPUIPC_OK &&
            gpuipc__cu.cuDriverGetVersion(&v) == CUDA_SUCCESS;
  sb_add(o, "  \"driver\": {\"library\": ");
  sb_str(o, gpuipc_driver_path());
  sb_add(o, ", \"emulated\": %s, ", R.emulated ? "true" : "false");
  if (ok)
    sb_add(o, "\"cuda_version\": %d, \"cuda_version_text\": \"%d.%d\"},\n", v,
           v / 1000, (v % 1000) / 10);
  else
    sb_add(o, "\"cuda_version\": null, \"cuda_version_text\": null},\n");
  sb_add(o, "  \"gpus\": [");
  if (ok && gpuipc__cu.cuDeviceGetCount(&n) != CUDA_SUCCESS)
    n = 0;
  for (int i = 0; ok && i < n; i++) {
    CUdevice d;
    char name[256] = "?", bus[64] = "?";
    size_t mem = 0;
    int maj = 0, min = 0;
    if (gpuipc__cu.cuDeviceGet(&d, i) != CUDA_SUCCESS)
      continue;
    gpuipc__cu.cuDeviceGetName(name, (int)sizeof name, d);
    gpuipc__cu.cuDeviceGetPCIBusId(bus, (int)sizeof bus, d);
    gpuipc__cu.cuDeviceTotalMem(&mem, d);
    gpuipc__cu.cuDeviceGetAttribute(
        &maj, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, d);
    gpuipc__cu.cuDeviceGetAttribute(
        &min, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, d);
    gpuipc_uuid u;
    char ut[64] = "?";
    if (gpuipc_device_uuid(i, &u) == GPUIPC_OK)
      gpuipc_uuid_format(&u, ut);
    sb_add(o, "%s\n    {\"ordinal\": %d, \"name\": ", i ? "," : "", i);
    sb_str(o, name);
    sb_add(o, ", \"uuid\": \"%s\", \"pci_bus_id\": ", ut);
    sb_str(o, bus);
    sb_add(o, ", \"memory_bytes\": %zu, \"compute_capability\": \"%d.%d\"}",
           mem, maj, min);
  }
  sb_add(o, "],\n");
}

int gpuipc_bench_json_write(int argc, char **argv, int rc) {
  if (R.path == NULL)
    return 0;
  sbuf o = {0};
  sb_add(&o, "{\n  \"format\": \"gpuipc-bench\", \"format_version\": 1,\n");
  sb_add(&o, "  \"gpuipc_version\": ");
  sb_str(&o, gpuipc_version_string());
  char when[64];
  time_t t = time(NULL);
  strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", gmtime(&t));
  sb_add(&o, ", \"time\": \"%s\", \"exit_status\": %d,\n  \"command\": ", when,
         rc);
  sbuf cmd = {0};
  sb_add(&cmd, "gpuipc");
  for (int i = 0; i < argc; i++)
    sb_add(&cmd, " %s", argv[i]);
  sb_str(&o, cmd.p ? cmd.p : "");
  free(cmd.p);
  sb_add(&o, ",\n  \"argv\": [\"gpuipc\"");
  for (int i = 0; i < argc; i++) {
    sb_add(&o, ", ");
    sb_str(&o, argv[i]);
  }
  sb_add(&o, "],\n");
  machine(&o);
  driver_and_gpus(&o);
  sb_add(&o, "  \"benchmarks\": [");
  for (int i = 0; i < R.nbench; i++) {
    sb_add(&o, "%s\n    {\"name\": \"%s\", \"info\": {%s},\n     \"tables\": {",
           i ? "," : "", R.b[i].name, R.b[i].info.p ? R.b[i].info.p : "");
    for (int k = 0; k < R.b[i].ntables; k++)
      sb_add(&o, "%s\n      \"%s\": [%s]", k ? "," : "", R.b[i].t[k].name,
             R.b[i].t[k].rows.p ? R.b[i].t[k].rows.p : "");
    sb_add(&o, "}}");
  }
  sb_add(&o, "]\n}\n");
  FILE *f = fopen(R.path, "w");
  int ret = 0;
  if (f == NULL || o.p == NULL || fwrite(o.p, 1, o.len, f) != o.len) {
    fprintf(stderr, "gpuipc bench: cannot write %s\n", R.path);
    ret = 1;
  }
  if (f && fclose(f) != 0 && ret == 0) {
    fprintf(stderr, "gpuipc bench: cannot write %s\n", R.path);
    ret = 1;
  }
  free(o.p);
  return ret;
}
