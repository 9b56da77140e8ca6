/*
 * proc.c: Child, the spawn helper's object (gpuipc_spawn): a started
 * process and its connection.
 */
#include "ext.h"

/* ------------------------------------------------------------------------ */
/* Child (gpuipc_spawn)                                                     */
/* ------------------------------------------------------------------------ */

typedef struct {
  PyObject_HEAD
  gpuipc_child *ch;
  ConnObject *conn;
  int pid;
  int ended;
  gpuipc_child_status status;
} ChildObject;

static PyObject *child_status_obj(const gpuipc_child_status *s) {
  char buf[96];
  gpuipc_child_status_str(s, buf, sizeof buf);
  int code = s->state == GPUIPC_CHILD_EXITED ? s->code
             : s->state == GPUIPC_CHILD_SIGNALED ? -s->signal : 0;
  return Py_BuildValue("(is)", code, buf);
}

static char **str_list(PyObject *seq_o, PyObject **keep) {
  *keep = PySequence_Fast(seq_o, "expected a sequence of str");
  if (!*keep) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(*keep);
  char **v = PyMem_Calloc((size_t)n + 1, sizeof *v);
  if (!v) { PyErr_NoMemory(); return NULL; }
  for (Py_ssize_t i = 0; i < n; i++) {
    v[i] = (char *)PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(*keep, i));
    if (!v[i]) { PyMem_Free(v); return NULL; }
  }
  return v;
}

PyObject *mod_spawn(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"path", "argv", "env_add", "timeout", "search_path", "carrier",
                        "spin_us", "polling", NULL};
  PyObject *path_o, *argv_o, *env_o = Py_None, *kt = NULL, *kc = NULL, *ks = NULL, *kp = NULL;
  int search = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O&O|$OOpOOO", kwl, PyUnicode_FSConverter,
                                   &path_o, &argv_o, &env_o, &kt, &search, &kc, &ks, &kp))
    return NULL;
  PyObject *keep_a = NULL, *keep_e = NULL, *ret = NULL;
  char **argv = NULL, **env = NULL;
  int tmo;
  if (parse_timeout(kt, 30000, &tmo) < 0) goto out;
  if (!(argv = str_list(argv_o, &keep_a))) goto out;
  if (env_o != Py_None && !(env = str_list(env_o, &keep_e))) goto out;
  gpuipc_conn_options co = GPUIPC_CONN_OPTIONS_INIT;
  co.timeout_ms = tmo;
  if (parse_carrier_opts(kc, ks, kp, &co) < 0) goto out; /* the parent's end */
  gpuipc_spawn_options so = GPUIPC_SPAWN_OPTIONS_INIT;
  so.env_add = env;
  so.search_path = search;
  so.conn = &co;
  gpuipc_child *ch = NULL;
  gpuipc_status st;
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_spawn(PyBytes_AS_STRING(path_o), argv, &so, &ch);
  Py_END_ALLOW_THREADS
  if (st) { raise_st(st, "spawn"); goto out; }
  ChildObject *c = PyObject_New(ChildObject, &ChildType);
  if (!c) { gpuipc_child_destroy(ch, 0, NULL); goto out; }
  c->ch = ch;
  c->pid = gpuipc_child_get_pid(ch);
  c->ended = 0;
  /* The Connection owns the connection, so that its close() is seen by
   * the child at once (as over connect), not only the Child's destroy. */
  c->conn = (ConnObject *)conn_new(gpuipc_child_take_conn(ch), tmo, co.max_outstanding, 0);
  if (!c->conn) { c->conn = NULL; Py_DECREF(c); goto out; }
  ret = (PyObject *)c;
out:
  Py_DECREF(path_o);
  Py_XDECREF(keep_a);
  Py_XDECREF(keep_e);
  PyMem_Free(argv);
  PyMem_Free(env);
  return ret;
}

/* Child.wait in the package's one loop (gpy_wait_loop): an attempt that
 * does not wait, then waits of a slice without the GIL. */
static gpuipc_status cw_try(void *v) {
  ChildObject *c = v;
  if (!c->ch) return c->ended ? GPUIPC_OK : GPUIPC_E_CLOSED; /* destroyed meanwhile */
  gpuipc_status st = gpuipc_child_wait(c->ch, 0, &c->status);
  return st == GPUIPC_E_TIMEOUT ? GPUIPC_E_WOULD_BLOCK : st;
}

static gpuipc_status cw_sleep(void *v, short events, int timeout_ms, int spin_us) {
  ChildObject *c = v;
  gpuipc_child *ch = c->ch;
  if (!ch) return GPUIPC_OK; /* the attempt says why */
  gpuipc_status st;
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_child_wait(ch, timeout_ms, &c->status);
  Py_END_ALLOW_THREADS
  return st;
}

static PyObject *Child_wait(ChildObject *c, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"timeout", NULL};
  PyObject *kt = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwl, &kt)) return NULL;
  if (c->ended) return child_status_obj(&c->status);
  if (!c->ch) Py_RETURN_NONE;
  int tmo;
  if (parse_timeout(kt, -1, &tmo) < 0) return NULL;
  gpuipc_status st;
  if (gpy_wait_loop(tmo, 0, 0, cw_try, cw_sleep, c, &st) < 0) return NULL;
  if (st == GPUIPC_E_TIMEOUT) Py_RETURN_NONE;
  if (st != GPUIPC_OK) return raise_st(st, "wait");
  c->ended = 1;
  return child_status_obj(&c->status);
}

static PyObject *Child_kill(ChildObject *c, PyObject *args) {
  int sig = SIGKILL;
  if (!PyArg_ParseTuple(args, "|i", &sig)) return NULL;
  if (!c->ch) Py_RETURN_NONE;
  gpuipc_status st = gpuipc_child_kill(c->ch, sig);
  if (st) return raise_st(st, "kill");
  Py_RETURN_NONE;
}

static void child_detach_conn(ChildObject *c) {
  if (c->conn) {
    LOCK();
    conn_detach(c->conn); /* closed here, before the child is waited for */
    UNLOCK();
  }
}

static PyObject *Child_destroy(ChildObject *c, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"timeout", NULL};
  PyObject *kt = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwl, &kt)) return NULL;
  int tmo;
  if (parse_timeout(kt, 5000, &tmo) < 0) return NULL;
  if (!c->ch) {
    if (c->ended) return child_status_obj(&c->status);
    Py_RETURN_NONE;
  }
  child_detach_conn(c);
  gpuipc_child *ch = c->ch;
  c->ch = NULL;
  Py_BEGIN_ALLOW_THREADS
  LOCK();
  gpuipc_child_destroy(ch, tmo, &c->status);
  UNLOCK();
  Py_END_ALLOW_THREADS
  c->ended = 1;
  flush_decrefs();
  return child_status_obj(&c->status);
}

static void Child_dealloc(ChildObject *c) {
  if (c->ch) {
    child_detach_conn(c);
    LOCK();
    gpuipc_child_destroy(c->ch, 0, NULL);
    UNLOCK();
  }
  Py_XDECREF(c->conn);
  PyObject_Free(c);
}

static PyObject *Child_get(ChildObject *c, void *w) {
  if (w == NULL) return PyLong_FromLong(c->pid);
  if (!c->conn) Py_RETURN_NONE;
  Py_INCREF(c->conn);
  return (PyObject *)c->conn;
}

static PyMethodDef Child_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))Child_wait, METH_VARARGS | METH_KEYWORDS,
     "wait($self, /, timeout=None)\n--\n\n"
     "wait(timeout=None) -> (code, text) once ended (code < 0: killed by -code), None "
     "while running"},
    {"kill", (PyCFunction)Child_kill, METH_VARARGS, "kill($self, sig=9, /)\n--\n\nkill(sig=SIGKILL)"},
    {"destroy", (PyCFunction)(void (*)(void))Child_destroy, METH_VARARGS | METH_KEYWORDS,
     "destroy($self, /, timeout=5)\n--\n\n"
     "destroy(timeout=5): close the connection, wait, then kill; -> (code, text)"},
    {NULL}};
static PyGetSetDef Child_getset[] = {
    {"pid", (getter)Child_get, NULL, NULL, NULL},
    {"conn", (getter)Child_get, NULL, "the connection to the child", (void *)1},
    {NULL}};
PyTypeObject ChildType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Child",
    .tp_basicsize = sizeof(ChildObject),
    .tp_dealloc = (destructor)Child_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A child process started by gpuipc's spawn helper, with its connection.",
    .tp_methods = Child_methods,
    .tp_getset = Child_getset,
};

