/* Strided copies of K/V pages with non-temporal stores (optional accelerator of
 * kvtier.strided's gather_into / scatter_from / stream_copy; numpy's copy is the reference).
 *
 *     bind_hash(path) -> bool            bind the xxhash package's XXH3 (see _xxh3.h)
 *     gather(dst, src, start, offsets, run, digest) -> int
 *         dst[i*run : (i+1)*run] = src[start+offsets[i] : start+offsets[i]+run] for every i;
 *         returns the xxh3_64 of dst's bytes when digest is true (bind_hash first), else 0.
 *     scatter(dst, start, offsets, src, run) -> None
 *         dst[start+offsets[i] : start+offsets[i]+run] = src[i*run : (i+1)*run].
 *
 * For a dst that is read again at once (a reused buffer a socket or file write takes next)
 * streaming stores are the wrong tool (measured slower there): callers use numpy/torch.
 *
 * Why: a page stored in a cache is not read again soon, and a page restored into an engine's
 * host pool is next read by a DMA engine or another thread. Ordinary stores to memory that is
 * not in cache first read each destination line (read-for-ownership) and write it back later:
 * three passes over DRAM per copy. Non-temporal (streaming) stores write whole lines without
 * reading them: two. On this project's 2-core VM a 4 MiB page gather into cold memory plus its
 * checksum ran 3.8-4.4 GB/s through torch's strided copy, 5.0-5.6 here (a scratch harness;
 * docs/sglang.md, fifteenth session).
 *
 * gather copies through a small per-thread bounce buffer that stays in the L2 cache: the runs
 * are gathered into it with memcpy, hashed there, then streamed to dst. What is hashed is
 * exactly what is stored, even when another process writes src meanwhile (a shared segment).
 *
 * Buffers: dst writable and C-contiguous, src C-contiguous, offsets a C-contiguous buffer of
 * int64 (numpy int64); every run must lie inside its buffer and dst must be len(offsets)*run
 * bytes: checked before anything is copied (ValueError naming the first that is not). The GIL
 * is released during the copy; the buffers stay exported (so not resized) meanwhile.
 * Streaming stores are x86-64 SSE2; elsewhere the copies are memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_xxh3.h"
#include "_streamcopy.h"

typedef struct {
    Py_buffer dst, src, off;
    Py_ssize_t start, run, n;
} job_t;

static void release(job_t *j) {
    if (j->dst.obj) PyBuffer_Release(&j->dst);
    if (j->src.obj) PyBuffer_Release(&j->src);
    if (j->off.obj) PyBuffer_Release(&j->off);
}

/* Take the buffers and check every run lies inside its buffer; -1 with ValueError if not.
 * `strided` is the buffer the offsets index (src for gather, dst for scatter). */
static int prepare(job_t *j, PyObject *dst, PyObject *src, PyObject *offsets, int gather) {
    memset(&j->dst, 0, sizeof j->dst), memset(&j->src, 0, sizeof j->src), memset(&j->off, 0, sizeof j->off);
    if (PyObject_GetBuffer(dst, &j->dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(src, &j->src, PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(offsets, &j->off, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (j->off.itemsize != 8 || j->off.format == NULL || strchr("qlQL", j->off.format[0]) == NULL ||
        j->off.format[1] != '\0') {
        PyErr_Format(PyExc_ValueError, "offsets must be int64, not format %s", j->off.format ? j->off.format : "?");
        return -1;
    }
    j->n = j->off.len / 8;
    if (j->run <= 0 || j->start < 0) {
        PyErr_Format(PyExc_ValueError, "run %zd must be positive and start %zd not negative", j->run, j->start);
        return -1;
    }
    Py_buffer *flat = gather ? &j->dst : &j->src, *strided = gather ? &j->src : &j->dst;
    /* Checked before the product and the bounds below are formed: signed overflow there is
     * undefined, and a wrapped bound once let a far `start` pass and read out of the buffer. */
    if (j->n > 0 && j->run > PY_SSIZE_T_MAX / j->n) {
        PyErr_Format(PyExc_ValueError, "%zd runs of %zd bytes are more bytes than any buffer holds", j->n, j->run);
        return -1;
    }
    if (flat->len != j->n * j->run) {
        PyErr_Format(PyExc_ValueError, "%s is %zd bytes; %zd runs of %zd bytes are %zd",
                     gather ? "dst" : "src", flat->len, j->n, j->run, j->n * j->run);
        return -1;
    }
    const int64_t *off = j->off.buf;
    /* room: the largest offset a run may start at (-1: none fits); start > len is ruled out
     * first, so neither subtraction overflows. */
    Py_ssize_t room = j->start > strided->len || j->run > strided->len - j->start
                          ? -1 : strided->len - j->start - j->run;
    for (Py_ssize_t i = 0; i < j->n; i++) {
        if (off[i] < 0 || off[i] > room) {
            PyErr_Format(PyExc_ValueError, "run %zd at offset %lld (start %zd, %zd bytes) leaves the "
                         "%zd-byte %s buffer", i, (long long)off[i], j->start, j->run, strided->len,
                         gather ? "source" : "destination");
            return -1;
        }
    }
    return 0;
}

/* Gather the runs into dst through the bounce buffer: memcpy into it, hash it there, stream
 * it out (what is hashed is what is stored); with nothing to hash, streamed straight out. */
static uint64_t gather_streaming(job_t *j, scratch_t *s, int digest) {
    const char *base = (const char *)j->src.buf + j->start;
    const int64_t *off = j->off.buf;
    char *out = j->dst.buf;
    size_t fill = 0, run = (size_t)j->run;
    if (!digest) { /* nothing to hash: straight from each run to dst */
        for (Py_ssize_t i = 0; i < j->n; i++)
            stream_range(out + i * run, base + off[i], run);
        stream_fence();
        return 0;
    }
    xxh_reset(s->state);
    for (Py_ssize_t i = 0; i < j->n; i++) {
        const char *from = base + off[i];
        size_t left = run;
        while (left > 0) {
            size_t take = left < BOUNCE - fill ? left : BOUNCE - fill;
            memcpy(s->bounce + fill, from, take);
            fill += take, from += take, left -= take;
            if (fill == BOUNCE) {
                xxh_update(s->state, s->bounce, fill);
                stream_range(out, s->bounce, fill);
                out += fill, fill = 0;
            }
        }
    }
    xxh_update(s->state, s->bounce, fill);
    stream_range(out, s->bounce, fill);
    stream_fence();
    return xxh_digest(s->state);
}

static PyObject *gather(PyObject *self, PyObject *args) {
    PyObject *dst, *src, *offsets;
    int digest;
    job_t j;
    if (!PyArg_ParseTuple(args, "OOnOnp", &dst, &src, &j.start, &offsets, &j.run, &digest))
        return NULL;
    if (digest && xxh_create == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "gather: bind_hash first");
        return NULL;
    }
    if (prepare(&j, dst, src, offsets, 1) < 0) {
        release(&j);
        return NULL;
    }
    scratch_t *s = scratch();
    if (s != NULL && digest && s->state == NULL)
        s->state = xxh_create();
    if (s == NULL || (digest && s->state == NULL)) {
        release(&j);
        return PyErr_NoMemory();
    }
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS
    h = gather_streaming(&j, s, digest);
    Py_END_ALLOW_THREADS
    release(&j);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *scatter(PyObject *self, PyObject *args) {
    PyObject *dst, *src, *offsets;
    job_t j;
    if (!PyArg_ParseTuple(args, "OnOOn", &dst, &j.start, &offsets, &src, &j.run))
        return NULL;
    if (prepare(&j, dst, src, offsets, 0) < 0) {
        release(&j);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    char *base = (char *)j.dst.buf + j.start;
    const int64_t *off = j.off.buf;
    const char *in = j.src.buf;
    for (Py_ssize_t i = 0; i < j.n; i++)
        stream_range(base + off[i], in + i * j.run, (size_t)j.run);
    stream_fence();
    Py_END_ALLOW_THREADS
    release(&j);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind_hash", bind_hash, METH_VARARGS, "Bind the xxhash package's XXH3_64bits (its shared object's path)."},
    {"gather", gather, METH_VARARGS, "gather(dst, src, start, offsets, run, digest) -> xxh3_64 of dst or 0."},
    {"scatter", scatter, METH_VARARGS, "scatter(dst, start, offsets, src, run) -> None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stream", NULL, -1, methods};

PyMODINIT_FUNC PyInit__stream(void) {
    if (scratch_init() != 0)
        return PyErr_NoMemory();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
