/* The SHA-256 key chain of kvtier.keys, as one C loop (optional accelerator).
 *
 * chain_sha256(namespace: bytes[32], raw: buffer, step: int, end: int) -> list[bytes]
 *     key_0 = SHA256(namespace || raw[0:step]), key_i = SHA256(key_{i-1} || raw[i*step:(i+1)*step]),
 *     over raw[0:end] (the last piece may be shorter): exactly kvtier.keys.chunk_keys' sha256 schema.
 *
 * Why: the Python loop spends as long on per-chunk interpreter work as on hashing (512 chunks of a
 * 128k-token prompt). OpenSSL's SHA256 uses the CPU's SHA extensions where present, like hashlib.
 * The GIL is released while hashing. The module is optional: kvtier.keys falls back to hashlib
 * when it is not built, and a test checks both give the same keys (and the published vectors).
 */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED /* SHA256_Init & co: the low-level API, no provider lookups */
#include <Python.h>
#include <openssl/sha.h>

static PyObject *chain_sha256(PyObject *self, PyObject *args) {
    Py_buffer ns, raw;
    Py_ssize_t step, end;
    if (!PyArg_ParseTuple(args, "y*y*nn", &ns, &raw, &step, &end))
        return NULL;
    PyObject *result = NULL;
    unsigned char *keys = NULL;
    if (ns.len != SHA256_DIGEST_LENGTH) {
        PyErr_Format(PyExc_ValueError, "namespace must be 32 bytes, got %zd", ns.len);
        goto done;
    }
    if (step < 1 || end < 0 || end > raw.len) {
        PyErr_Format(PyExc_ValueError, "bad step %zd / end %zd for %zd bytes", step, end, raw.len);
        goto done;
    }
    Py_ssize_t n = end / step + (end % step ? 1 : 0);
    keys = PyMem_Malloc(n ? n * SHA256_DIGEST_LENGTH : 1);
    if (keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *prev = ns.buf;
    const unsigned char *data = raw.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t off = i * step, len = end - off < step ? end - off : step;
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, prev, SHA256_DIGEST_LENGTH);
        SHA256_Update(&ctx, data + off, (size_t)len);
        SHA256_Final(keys + i * SHA256_DIGEST_LENGTH, &ctx);
        prev = keys + i * SHA256_DIGEST_LENGTH;
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    if (result == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyBytes_FromStringAndSize((const char *)keys + i * SHA256_DIGEST_LENGTH,
                                                  SHA256_DIGEST_LENGTH);
        if (key == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, key);
    }
done:
    PyMem_Free(keys);
    PyBuffer_Release(&ns);
    PyBuffer_Release(&raw);
    return result;
}

static PyMethodDef methods[] = {
    {"chain_sha256", chain_sha256, METH_VARARGS,
     "chain_sha256(namespace, raw, step, end) -> list of 32-byte chained SHA-256 keys"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvtier._chain",
                                    "C loop for the SHA-256 key chain (optional).", -1, methods};

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module); }
