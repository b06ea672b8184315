/* Large copies with non-temporal stores, for zerostall.memcopy.
 *
 * A checkpoint copy writes many MiB that nothing reads again soon: the staging buffer is read
 * by another process (the writer), a restored template by the next training step, long after
 * the copy has pushed it out of every cache. Ordinary stores first read each destination line
 * into the cache (read-for-ownership) and later write it back; streaming stores write it once.
 * glibc's memmove switches to them only above x86_non_temporal_threshold (192 MiB on the
 * machine this was measured on), and a checkpoint is copied a tensor at a time.
 *
 * copy(dst, src, n): addresses as Python ints, n bytes, ranges must not overlap. The GIL is
 * released for the copy. Where the target has no streaming store it is memcpy.
 *
 * On x86-64 also the CRC32C kernels (see below): copy_crc32c (the copy and the CRC of its bytes
 * in one pass), crc32c (the CRC of a buffer), crc32c_combine (the CRC of two joined pieces), and
 * set_fold (the carry-less-multiply kernels on or off, for tests and A/B runs).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define ZS_NONTEMPORAL 1

/* 64-byte blocks with streaming stores; dst 16-byte aligned */
static void stream_blocks(char *dst, const char *src, size_t blocks)
{
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
}

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
    stream_blocks(dst, src, blocks);
    /* streaming stores are weakly ordered: fence before another thread may read the bytes */
    _mm_sfence();
    memcpy(dst + blocks * 64, src + blocks * 64, n - blocks * 64);
}

/* copy_crc32c: the copy above and a CRC32C of the same bytes in one pass over the source, for a
 * load that verifies while it copies (restore.read's streaming pass). The checksum otherwise
 * reads every source byte once more, and two calls per chunk from Python cost more than the
 * copy of a small chunk. The CRC uses the SSE4.2 crc32 instruction on three lanes at once (one
 * lane waits on the instruction's 3-cycle latency), joined by a table that multiplies a CRC by
 * x^(8 * LANE) modulo the polynomial, as zlib's crc32_combine does; tests compare every result
 * with the crc32c package at every length and alignment. */
#include <nmmintrin.h>

#define ZS_POLY 0x82f63b78u /* CRC32C (Castagnoli), bit-reflected */
#define ZS_LANE 4096

static uint32_t x2n_table[32];
static uint32_t shift_lane[4][256]; /* crc -> crc * x^(8 * ZS_LANE) mod P, a byte at a time */
static int have_crc32c;

/* a * b modulo P, bit-reflected (x^0 is the top bit): zlib's multmodp; a must not be 0 */
static uint32_t multmodp(uint32_t a, uint32_t b)
{
    uint32_t m = (uint32_t)1 << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0)
                break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ ZS_POLY : b >> 1;
    }
    return p;
}

/* x^(n * 2^k) modulo P */
static uint32_t x2nmodp(size_t n, unsigned k)
{
    uint32_t p = (uint32_t)1 << 31;
    while (n) {
        if (n & 1)
            p = multmodp(x2n_table[k & 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

static void crc_init(void)
{
    uint32_t p = (uint32_t)1 << 30; /* x^1 */
    x2n_table[0] = p;
    for (int i = 1; i < 32; i++)
        x2n_table[i] = p = multmodp(p, p);
    uint32_t op = x2nmodp(ZS_LANE, 3); /* x^(8 * ZS_LANE) */
    for (int k = 0; k < 4; k++)
        for (uint32_t v = 0; v < 256; v++)
            shift_lane[k][v] = multmodp(op, v << (8 * k));
    __builtin_cpu_init();
    have_crc32c = __builtin_cpu_supports("sse4.2") != 0;
}

static inline uint32_t shift(uint32_t c)
{
    return shift_lane[0][c & 0xff] ^ shift_lane[1][(c >> 8) & 0xff] ^ shift_lane[2][(c >> 16) & 0xff]
        ^ shift_lane[3][c >> 24];
}

/* A head or tail of n bytes, 8 at a time then singly: the CRC (raw) continued, and the bytes
 * copied to dst with ordinary stores unless dst is NULL */
__attribute__((target("sse4.2")))
static uint64_t crc_small(char *dst, const char *src, size_t n, uint64_t c)
{
    for (; n >= 8; n -= 8, src += 8) {
        uint64_t a;
        memcpy(&a, src, 8);
        c = _mm_crc32_u64(c, a);
        if (dst != NULL) {
            memcpy(dst, &a, 8);
            dst += 8;
        }
    }
    for (; n; n--, src++) {
        c = _mm_crc32_u8((uint32_t)c, (uint8_t)*src);
        if (dst != NULL)
            *dst++ = *src;
    }
    return c;
}

/* The bytes before dst's next align-byte boundary (at most n) through crc_small, c continued:
 * what a kernel whose stores need an aligned destination does first. Returns how many. */
__attribute__((target("sse4.2")))
static size_t crc_head(char *dst, const char *src, size_t n, uint64_t *c, size_t align)
{
    size_t head = (align - ((uintptr_t)dst & (align - 1))) & (align - 1);
    if (head > n)
        head = n;
    *c = crc_small(dst, src, head, *c);
    return head;
}

/* The CRC of 3 * ZS_LANE bytes continuing c0 (raw, not inverted): three lanes at once */
__attribute__((target("sse4.2")))
static uint32_t crc_lanes(const char *src, uint64_t c0)
{
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < ZS_LANE; i += 8) {
        uint64_t a, b, c;
        memcpy(&a, src + i, 8);
        memcpy(&b, src + ZS_LANE + i, 8);
        memcpy(&c, src + 2 * ZS_LANE + i, 8);
        c0 = _mm_crc32_u64(c0, a);
        c1 = _mm_crc32_u64(c1, b);
        c2 = _mm_crc32_u64(c2, c);
    }
    /* crc(A B C) = crc(A) * x^(16 LANE) + crc0(B) * x^(8 LANE) + crc0(C), crc0 from zero */
    return shift(shift((uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;
}

/* crc_lanes, while the previous block (psrc, still in L1) is copied to pdst with streaming
 * stores: 96 bytes for each 32 bytes of every lane, so the stores of one block spread over the
 * checksum of the next and the two overlap; the three lanes of the block after that are
 * prefetched as this one is summed. */
__attribute__((target("sse4.2")))
static uint32_t crc_lanes_store(const char *src, uint64_t c0, char *pdst, const char *psrc)
{
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < ZS_LANE; i += 32) {
        _mm_prefetch(src + 3 * ZS_LANE + i, _MM_HINT_T0);
        _mm_prefetch(src + 4 * ZS_LANE + i, _MM_HINT_T0);
        _mm_prefetch(src + 5 * ZS_LANE + i, _MM_HINT_T0);
        for (size_t j = 0; j < 32; j += 8) {
            uint64_t a, b, c;
            memcpy(&a, src + i + j, 8);
            memcpy(&b, src + ZS_LANE + i + j, 8);
            memcpy(&c, src + 2 * ZS_LANE + i + j, 8);
            c0 = _mm_crc32_u64(c0, a);
            c1 = _mm_crc32_u64(c1, b);
            c2 = _mm_crc32_u64(c2, c);
        }
        for (size_t j = 0; j < 96; j += 16)
            _mm_stream_si128((__m128i *)(pdst + j), _mm_loadu_si128((const __m128i *)(psrc + j)));
        psrc += 96;
        pdst += 96;
    }
    return shift(shift((uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;
}

/* Each 12 KiB block is checksummed (read from memory), and copied with streaming stores while
 * the next one is checksummed (it is then still in L1). Checksumming a block and then copying it
 * ran 0.066-0.074 s per GiB on two threads here, the overlapped form 0.049-0.057 s, a plain
 * streaming copy 0.047-0.050 s (a one-off C harness, 16 MiB pieces). Storing each word as it was
 * checksummed measured 1.7-2.5x slower (six interleaved write streams defeat the write-combining
 * buffers). benchmarks/probes/memcopy_probe.py times this kernel against the copy and the crc32c
 * package. */
__attribute__((target("sse4.2")))
static uint32_t copy_crc(char *dst, const char *src, size_t n, uint32_t crc)
{
    uint64_t c0 = (uint32_t)~crc;
    size_t head = crc_head(dst, src, n, &c0, 16);
    dst += head;
    src += head;
    n -= head;
    if (n >= 3 * ZS_LANE) {
        c0 = crc_lanes(src, c0);
        const char *psrc = src;
        char *pdst = dst;
        src += 3 * ZS_LANE;
        dst += 3 * ZS_LANE;
        n -= 3 * ZS_LANE;
        while (n >= 3 * ZS_LANE) {
            c0 = crc_lanes_store(src, c0, pdst, psrc);
            psrc = src;
            pdst = dst;
            src += 3 * ZS_LANE;
            dst += 3 * ZS_LANE;
            n -= 3 * ZS_LANE;
        }
        stream_blocks(pdst, psrc, 3 * ZS_LANE / 64);
    }
    _mm_sfence();
    return ~(uint32_t)crc_small(dst, src, n, c0);
}

/* The same CRC by carry-less multiplication (VPCLMULQDQ on AVX-512), where the CPU has it.
 *
 * The crc32 instruction does 8 bytes a cycle per core at best (0.062 s per GiB on one core here,
 * the three-lane loop above 0.067 with its copy); folding 256 bytes at a time with four 512-bit
 * multiplies runs at memory speed: 0.034 s per GiB on one core, 0.030 on two, the same as a pass
 * that only loads (a one-off probe on this 2-vCPU Zen 4, 1 GiB, best of 5). Each 128-bit lane
 * holds the next 128 message bits; moving it D bits forward is a multiply by x^D modulo P, which
 * the two halves of the lane take as x^(D+63) and x^(D-1) (the product of two bit-reflected
 * 64-bit values lands one bit low, hence the -1). The folded 128 bits are finished by the crc32
 * instruction, which computes exactly their remainder. Tests compare with the crc32c package. */
#define ZS_FOLD_TARGET "avx512f,avx512bw,avx512vl,vpclmulqdq,pclmul,sse4.2"
#include <immintrin.h>

static int have_fold;
static uint64_t k_fold[5][2]; /* fold forward by 2048, 512, 384, 256 and 128 bits */

static void fold_init(void)
{
    static const size_t dist[5] = {2048, 512, 384, 256, 128};
    for (int i = 0; i < 5; i++) {
        k_fold[i][0] = (uint64_t)x2nmodp(dist[i] + 63, 0) << 32;
        k_fold[i][1] = (uint64_t)x2nmodp(dist[i] - 1, 0) << 32;
    }
    have_fold = have_crc32c && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("vpclmulqdq")
        && __builtin_cpu_supports("pclmul");
}

__attribute__((target(ZS_FOLD_TARGET)))
static inline __m512i fold512(__m512i x, __m512i k, __m512i next)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                     _mm512_clmulepi64_epi128(x, k, 0x11), next, 0x96);
}

__attribute__((target(ZS_FOLD_TARGET)))
static inline __m128i fold128(__m128i x, int k, __m128i next)
{
    __m128i kk = _mm_loadu_si128((const __m128i *)k_fold[k]);
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, kk, 0x00), _mm_clmulepi64_si128(x, kk, 0x11)), next);
}

/* The four 512-bit lanes of the last 256 bytes, folded to one CRC (raw, not inverted) */
__attribute__((target(ZS_FOLD_TARGET)))
static uint32_t fold_finish(__m512i x0, __m512i x1, __m512i x2, __m512i x3)
{
    __m512i k = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)k_fold[1]));
    x1 = fold512(x0, k, x1);
    x2 = fold512(x1, k, x2);
    x3 = fold512(x2, k, x3);
    __m128i d = _mm512_extracti32x4_epi32(x3, 3);
    d = fold128(_mm512_extracti32x4_epi32(x3, 0), 2, d);
    d = fold128(_mm512_extracti32x4_epi32(x3, 1), 3, d);
    d = fold128(_mm512_extracti32x4_epi32(x3, 2), 4, d);
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(d));
    return (uint32_t)_mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(d, 1));
}

/* 256 bytes loaded into four registers and, unless dst is NULL, stored there with streaming stores */
__attribute__((target(ZS_FOLD_TARGET)))
static inline void block256(const char *src, char *dst, __m512i x[4])
{
    for (int j = 0; j < 4; j++) {
        x[j] = _mm512_loadu_si512(src + 64 * j);
        if (dst != NULL)
            _mm512_stream_si512((void *)(dst + 64 * j), x[j]);
    }
}

/* CRC32C of n bytes continuing crc; with dst, the bytes are also copied there, the 256-byte
 * blocks with streaming stores of the very registers the fold reads (one write stream, so the
 * write-combining buffers keep up, unlike the three-lane loop's). */
__attribute__((target(ZS_FOLD_TARGET)))
static uint32_t fold_crc(char *dst, const char *src, size_t n, uint32_t crc)
{
    uint64_t c = (uint32_t)~crc;
    if (dst != NULL) { /* streaming stores of 64 bytes need a 64-byte aligned destination */
        size_t head = crc_head(dst, src, n, &c, 64);
        dst += head;
        src += head;
        n -= head;
    }
    if (n >= 256) {
        __m512i k = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)k_fold[0]));
        __m512i x[4], y[4];
        block256(src, dst, x);
        /* the CRC so far enters as the first 32 message bits' complement, as the instruction takes it */
        x[0] = _mm512_xor_si512(x[0], _mm512_castsi128_si512(_mm_cvtsi32_si128((int)(uint32_t)c)));
        for (src += 256, n -= 256, dst = dst ? dst + 256 : NULL; n >= 256; src += 256, n -= 256) {
            block256(src, dst, y);
            if (dst != NULL)
                dst += 256;
            for (int j = 0; j < 4; j++)
                x[j] = fold512(x[j], k, y[j]);
        }
        c = fold_finish(x[0], x[1], x[2], x[3]);
        if (dst != NULL)
            _mm_sfence();
    }
    return ~(uint32_t)crc_small(dst, src, n, c);
}

/* CRC32C only, the three lanes of crc_lanes where there is no fold */
__attribute__((target("sse4.2")))
static uint32_t crc_only(const char *src, size_t n, uint32_t crc)
{
    if (have_fold)
        return fold_crc(NULL, src, n, crc);
    uint64_t c0 = (uint32_t)~crc;
    for (; n >= 3 * ZS_LANE; n -= 3 * ZS_LANE, src += 3 * ZS_LANE)
        c0 = crc_lanes(src, c0);
    return ~(uint32_t)crc_small(NULL, src, n, c0);
}
#else
#define ZS_NONTEMPORAL 0

static void stream_copy(char *dst, const char *src, size_t n)
{
    memcpy(dst, src, n);
}
#endif

/* dst, src (addresses) and n from args[0..2]; 0 on success, -1 with an exception set */
static int copy_args(PyObject *const *args, void **dst, void **src, size_t *n)
{
    *dst = PyLong_AsVoidPtr(args[0]);
    if (*dst == NULL && PyErr_Occurred())
        return -1;
    *src = PyLong_AsVoidPtr(args[1]);
    if (*src == NULL && PyErr_Occurred())
        return -1;
    *n = PyLong_AsSize_t(args[2]);
    if (*n == (size_t)-1 && PyErr_Occurred())
        return -1;
    if (*n && (*dst == NULL || *src == NULL)) {
        PyErr_SetString(PyExc_ValueError, "copy: null address");
        return -1;
    }
    return 0;
}

static PyObject *zs_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy(dst, src, n) takes 3 arguments");
        return NULL;
    }
    void *dst, *src;
    size_t n;
    if (copy_args(args, &dst, &src, &n) < 0)
        return NULL;
    if (n == 0)
        Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)dst, (const char *)src, n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#if ZS_NONTEMPORAL
/* a CRC argument: a Python int of at most 32 bits; 0 on success, -1 with an exception set */
static int crc_arg(PyObject *arg, uint32_t *out, const char *fn)
{
    unsigned long v = PyLong_AsUnsignedLong(arg);
    if (v == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (v > 0xffffffffUL) {
        PyErr_Format(PyExc_ValueError, "%s: crc is not a 32-bit value", fn);
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

/* A CRC function's call: want arguments, and a CPU with the crc32 instruction; 0 if so, else -1
 * with an exception set */
static int crc_call(Py_ssize_t nargs, Py_ssize_t want, const char *usage)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", usage, want);
        return -1;
    }
    if (!have_crc32c) {
        PyErr_Format(PyExc_RuntimeError, "%s: this CPU has no SSE4.2 crc32 instruction", usage);
        return -1;
    }
    return 0;
}

static PyObject *zs_copy_crc32c(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (crc_call(nargs, 4, "copy_crc32c(dst, src, n, crc)") < 0)
        return NULL;
    void *dst, *src;
    size_t n;
    if (copy_args(args, &dst, &src, &n) < 0)
        return NULL;
    uint32_t crc;
    if (crc_arg(args[3], &crc, "copy_crc32c") < 0)
        return NULL;
    uint32_t out;
    Py_BEGIN_ALLOW_THREADS
    out = have_fold ? fold_crc((char *)dst, (const char *)src, n, crc) : copy_crc((char *)dst, (const char *)src, n, crc);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(out);
}

static PyObject *zs_crc32c(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (crc_call(nargs, 2, "crc32c(buffer, crc)") < 0)
        return NULL;
    uint32_t crc;
    if (crc_arg(args[1], &crc, "crc32c") < 0)
        return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0)
        return NULL;
    uint32_t out;
    Py_BEGIN_ALLOW_THREADS
    out = crc_only((const char *)b.buf, (size_t)b.len, crc);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(out);
}

/* For tests and A/B runs: turn the fold kernels off (or back on, where the CPU has them) */
static PyObject *zs_set_fold(PyObject *self, PyObject *arg)
{
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    int was = have_fold;
    have_fold = 0;
    if (on)
        fold_init();
    return PyBool_FromLong(was);
}

static PyObject *zs_crc32c_combine(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "crc32c_combine(crc1, crc2, len2) takes 3 arguments");
        return NULL;
    }
    uint32_t c[2];
    for (int i = 0; i < 2; i++)
        if (crc_arg(args[i], &c[i], "crc32c_combine") < 0)
            return NULL;
    size_t len2 = PyLong_AsSize_t(args[2]);
    if (len2 == (size_t)-1 && PyErr_Occurred())
        return NULL;
    /* crc(A B) = crc(A) * x^(8 len(B)) + crc(B): zlib's crc32_combine (the inversions cancel) */
    uint32_t out = len2 ? multmodp(x2nmodp(len2, 3), c[0]) ^ c[1] : c[0];
    return PyLong_FromUnsignedLong(out);
}
#endif

static PyMethodDef zs_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))zs_copy, METH_FASTCALL,
     "copy(dst, src, n): copy n bytes between non-overlapping addresses with streaming stores."},
#if ZS_NONTEMPORAL
    {"copy_crc32c", (PyCFunction)(void (*)(void))zs_copy_crc32c, METH_FASTCALL,
     "copy_crc32c(dst, src, n, crc): copy n bytes as copy() does and return their CRC32C, continuing crc."},
    {"crc32c", (PyCFunction)(void (*)(void))zs_crc32c, METH_FASTCALL,
     "crc32c(buffer, crc): the CRC32C of a contiguous buffer's bytes, continuing crc (GIL released)."},
    {"set_fold", (PyCFunction)zs_set_fold, METH_O,
     "set_fold(on): use the carry-less-multiply kernels where the CPU has them (on) or not; returns whether they were in use."},
    {"crc32c_combine", (PyCFunction)(void (*)(void))zs_crc32c_combine, METH_FASTCALL,
     "crc32c_combine(crc1, crc2, len2): the CRC32C of A B from crc1 = CRC32C(A), crc2 = CRC32C(B), len2 = len(B)."},
#endif
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
#if ZS_NONTEMPORAL
    crc_init();
    fold_init();
    int crc_ok = have_crc32c;
#else
    int crc_ok = 0;
#endif
    if (PyModule_AddIntConstant(m, "CRC32C", crc_ok) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "NONTEMPORAL", ZS_NONTEMPORAL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
