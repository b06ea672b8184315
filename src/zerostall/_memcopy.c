/* Large copies with non-temporal stores, for zerostall.memcopy.
 *
 * A checkpoint copy writes many MiB that nothing reads again soon: the staging buffer is read
 * by another process (the writer), a restored template by the next training step, long after
 * the copy has pushed it out of every cache. Ordinary stores first read each destination line
 * into the cache (read-for-ownership) and later write it back; streaming stores write it once.
 * glibc's memmove switches to them only above x86_non_temporal_threshold (192 MiB on the
 * machine this was measured on), and a checkpoint is copied a tensor at a time.
 *
 * One function, copy(dst, src, n): addresses as Python ints, n bytes, ranges must not overlap.
 * The GIL is released for the copy. Where the target has no streaming store it is memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define ZS_NONTEMPORAL 1

static void stream_copy(char *dst, const char *src, size_t n)
{
    /* streaming stores need a 16-byte aligned destination: the head goes through memcpy */
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t blocks = n / 64;
    for (size_t i = 0; i < blocks; i++) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
        src += 64;
        dst += 64;
    }
    /* streaming stores are weakly ordered: fence before another thread may read the bytes */
    _mm_sfence();
    memcpy(dst, src, n - blocks * 64);
}
#else
#define ZS_NONTEMPORAL 0

static void stream_copy(char *dst, const char *src, size_t n)
{
    memcpy(dst, src, n);
}
#endif

static PyObject *zs_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy(dst, src, n) takes 3 arguments");
        return NULL;
    }
    void *dst = PyLong_AsVoidPtr(args[0]);
    if (dst == NULL && PyErr_Occurred())
        return NULL;
    void *src = PyLong_AsVoidPtr(args[1]);
    if (src == NULL && PyErr_Occurred())
        return NULL;
    size_t n = PyLong_AsSize_t(args[2]);
    if (n == (size_t)-1 && PyErr_Occurred())
        return NULL;
    if (n == 0)
        Py_RETURN_NONE;
    if (dst == NULL || src == NULL) {
        PyErr_SetString(PyExc_ValueError, "copy: null address");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)dst, (const char *)src, n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef zs_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))zs_copy, METH_FASTCALL,
     "copy(dst, src, n): copy n bytes between non-overlapping addresses with streaming stores."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef zs_module = {
    PyModuleDef_HEAD_INIT, "zerostall._memcopy", NULL, -1, zs_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__memcopy(void)
{
    PyObject *m = PyModule_Create(&zs_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "NONTEMPORAL", ZS_NONTEMPORAL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
