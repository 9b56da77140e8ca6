/*
 * torchc.c: torch tensors made in C, for recv(as_torch=True) and
 * recv_batch(as_torch=True), and torch's current stream read from C.
 *
 * torch is imported on first use, never at the package's import (gpuipc
 * needs no torch). What is looked up then is kept for the process:
 *   - torch's DLPack C exchange API (DLPack 1.3: the PyCapsule
 *     "dlpack_exchange_api" at torch.Tensor.__dlpack_c_exchange_api__,
 *     or the older name __c_dlpack_exchange_api__, capsule or int): a
 *     tensor is then made by one C call from a DLManagedTensorVersioned
 *     (managed_tensor_to_py_object_no_sync), and the current stream read by
 *     another (current_work_stream), neither through Python;
 *   - else torch._C._from_dlpack, called from C with a "dltensor" capsule,
 *     and torch._C._cuda_getCurrentRawStream(device).
 * The environment variable GPUIPC_TORCH_EXCHANGE=0 makes it take the
 * second way even where the first exists (to compare them).
 *
 * Either way the tensor's deleter drops the reference the DLPack tensor
 * holds on its owner (a Received, or a batch's hold), which is what
 * releases the lease: exactly as torch.from_dlpack(received) does.
 */
#include "ext.h"

#include <stdlib.h>

static int g_ready;
static const DLXApi *g_api;
static PyTypeObject *g_tensor;
static PyObject *g_from_dlpack, *g_raw_stream, *g_get_device;

const DLXApi *dlx_api_of(PyObject *holder) {
  static const char *attrs[] = {"__dlpack_c_exchange_api__", "__c_dlpack_exchange_api__"};
  for (int k = 0; k < 2; k++) {
    PyObject *a = PyObject_GetAttrString(holder, attrs[k]);
    if (!a) {
      PyErr_Clear();
      continue;
    }
    const DLXApi *x = NULL;
    if (PyCapsule_IsValid(a, "dlpack_exchange_api")) x = PyCapsule_GetPointer(a, "dlpack_exchange_api");
    else if (PyLong_Check(a)) x = PyLong_AsVoidPtr(a);
    PyErr_Clear();
    Py_DECREF(a);
    /* this code speaks major version 1, and needs these two entries (a
     * reader checks dltensor_from_py_object_no_sync itself) */
    if (x && x->header.version.major == 1 && x->current_work_stream &&
        x->managed_tensor_to_py_object_no_sync)
      return x;
  }
  return NULL;
}

/* torch's exchange API, or NULL (no exception). The extension sees only
 * the public API, so it reads its one variable itself (the library's are
 * GPUIPC__PARAM declarations); docs/environment.md lists it with the
 * others, and tools/check-env keeps it there. */
static const DLXApi *find_api(PyObject *tensor_type) {
  const char *env = getenv("GPUIPC_TORCH_EXCHANGE");
  if (env && !strcmp(env, "0")) return NULL;
  return dlx_api_of(tensor_type);
}

int torch_lookup(int import) {
  if (g_ready) return 1;
  PyObject *torch;
  if (import) {
    torch = PyImport_ImportModule("torch");
    if (!torch) return -1; /* its ImportError says why */
  } else {
    PyObject *nm = PyUnicode_FromString("torch");
    torch = nm ? PyImport_GetModule(nm) : NULL;
    Py_XDECREF(nm);
    if (!torch) return PyErr_Occurred() ? -1 : 0;
  }
  PyObject *tt = PyObject_GetAttrString(torch, "Tensor");
  PyObject *C = tt ? PyObject_GetAttrString(torch, "_C") : NULL;
  Py_DECREF(torch);
  if (!tt || !C || !PyType_Check(tt)) {
    Py_XDECREF(tt);
    Py_XDECREF(C);
    PyErr_Clear();
    PyErr_SetString(PyExc_ImportError, "this torch has no Tensor type or torch._C");
    return -1;
  }
  const DLXApi *api = find_api(tt);
  PyObject *fd = PyObject_GetAttrString(C, "_from_dlpack");
  PyObject *rs = PyObject_GetAttrString(C, "_cuda_getCurrentRawStream");
  PyObject *gd = PyObject_GetAttrString(C, "_cuda_getDevice");
  Py_DECREF(C);
  PyErr_Clear();
  if (!api && (!fd || !rs)) {
    Py_XDECREF(fd);
    Py_XDECREF(rs);
    Py_XDECREF(gd);
    Py_DECREF(tt);
    PyErr_SetString(PyExc_ImportError, "this torch has neither the DLPack C exchange API "
                    "nor torch._C._from_dlpack and _cuda_getCurrentRawStream (a torch "
                    "built with CUDA is needed)");
    return -1;
  }
  g_api = api;
  g_tensor = (PyTypeObject *)tt; /* kept for the process */
  g_from_dlpack = fd;
  g_raw_stream = rs;
  g_get_device = gd;
  g_ready = 1;
  return 1;
}

int torch_ready(void) {
  int r = torch_lookup(1);
  if (r == 1 && !g_api && !g_get_device) {
    /* recv(as_torch=True) without the exchange API needs the current
     * device too (the sets' reading does not) */
    PyErr_SetString(PyExc_ImportError, "this torch has neither the DLPack C exchange API "
                    "nor torch._C._cuda_getDevice (a torch built with CUDA is needed)");
    r = -1;
  }
  if (r == 1) return 0;
  /* Says what needs torch, the lookup's error as the cause. */
#if PY_VERSION_HEX >= 0x030C0000
  PyObject *cause = PyErr_GetRaisedException();
#else
  PyObject *t, *cause, *tb;
  PyErr_Fetch(&t, &cause, &tb);
  PyErr_NormalizeException(&t, &cause, &tb);
  Py_XDECREF(t);
  Py_XDECREF(tb);
#endif
  PyErr_Format(PyExc_ImportError, "as_torch=True needs torch, which cannot be used "
               "here (%S); without it, take the Received and read it through DLPack or "
               "the CUDA Array Interface", cause ? cause : Py_None);
  if (cause) {
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
    PyException_SetCause(exc, cause); /* steals cause */
    PyErr_SetRaisedException(exc);
#else
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    PyErr_NormalizeException(&et, &ev, &etb);
    if (ev) PyException_SetCause(ev, cause);
    else Py_DECREF(cause);
    PyErr_Restore(et, ev, etb);
#endif
  }
  return -1;
}

const DLXApi *torch_api(void) { return g_api; }
PyTypeObject *torch_tensor_type(void) { return g_tensor; }
PyObject *torch_from_capsule(PyObject *cap) { return PyObject_CallOneArg(g_from_dlpack, cap); }

int torch_uses_exchange(void) { return g_api != NULL; }

int torch_current_device(int *dev) {
  *dev = 0;
  if (!g_get_device) return 0; /* exchange API (torch_ready checked): device 0 first */
  PyObject *r = PyObject_CallNoArgs(g_get_device);
  if (!r) return -1;
  long d = PyLong_AsLong(r);
  Py_DECREF(r);
  if (d == -1 && PyErr_Occurred()) return -1;
  *dev = d < 0 ? 0 : (int)d;
  return 0;
}

int dlx_current_stream(const DLXApi *api, int dev, uintptr_t *out) {
  *out = 0;
  if (api) {
    void *st = NULL;
    if (api->current_work_stream(kDLCUDA, dev, &st) != 0) {
      if (!PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "the framework's current_work_stream failed");
      return -1;
    }
    *out = (uintptr_t)st;
    return 0;
  }
  if (!g_raw_stream) {
    PyErr_SetString(PyExc_RuntimeError, "torch's current stream: torch was not looked up");
    return -1;
  }
  PyObject *d = PyLong_FromLong(dev);
  if (!d) return -1;
  PyObject *r = PyObject_CallOneArg(g_raw_stream, d);
  Py_DECREF(d);
  if (!r) return -1;
  unsigned long long u = PyLong_AsUnsignedLongLong(r);
  Py_DECREF(r);
  if (u == (unsigned long long)-1 && PyErr_Occurred()) return -1;
  *out = (u == 1) ? 0 : (uintptr_t)u; /* 1 names the legacy stream too */
  return 0;
}

int torch_current_stream(int dev, uintptr_t *out) { return dlx_current_stream(g_api, dev, out); }

PyObject *torch_tensor(PyObject *owner, const View *v, DLBox *box) {
  DLBox *b = dlbox_take(box);
  if (!b) return NULL;
  if (g_api) {
    dl_fill(b, owner, v, v->dev_type, 1);
    void *out = NULL;
    /* takes the managed tensor, also when it fails */
    if (g_api->managed_tensor_to_py_object_no_sync(&b->u.v, &out) != 0 || !out) {
      if (!PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "torch's managed_tensor_to_py_object_no_sync "
                        "failed");
      return NULL;
    }
    return (PyObject *)out;
  }
  dl_fill(b, owner, v, v->dev_type, 0);
  PyObject *cap = dl_capsule(b, 0);
  if (!cap) return NULL;
  PyObject *t = PyObject_CallOneArg(g_from_dlpack, cap);
  Py_DECREF(cap); /* consumed: torch's now; not consumed: deleted here */
  return t;
}
