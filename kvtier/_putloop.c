/* kvtier-server's receive loop for runs of plain PUT frames (optional accelerator of
 * kvtier.server.put_run; the data plane's Python frame loop is the reference).
 *
 *     bind_hash(path) -> bool
 *     recv_puts(fd, head, have, keys, slots, put_type, hash_from, piece, seg) -> (items, have)
 *     copy_hash(dst, src, hash_from, piece) -> int   (the shared-memory PUT's copy; below)
 *
 * bind_hash: look up the streaming XXH3_64bits functions (the CPU-dispatched update where
 * there is one) in the already-loaded shared object at `path` (the xxhash package's
 * extension, whose symbols are not global). The rest refuse to run before it succeeded; the
 * caller holds `copy_hash` (below) to xxhash.xxh3_64_intdigest before it relies on the loop.
 *
 * recv_puts reads PUT frames from blocking socket fd, the first one's header being head[:have]
 * plus what is still to come, while each is a PUT with no flags but MORE/PARENT whose chunk
 * fits the next slot: its keys go to keys[64*j:], its chunk to slots[j] in pieces of `piece`
 * bytes, each hashed (xxh3 of chunk[hash_from:], 0 for a shorter chunk) as soon as it is in,
 * and, in the call that takes the last piece, the next frame's header to head when MORE is
 * set. A PUT with flag SHM too, where `seg` (the connection's mapped shared segment; empty:
 * none) is given: its body is keys || offset u64 || length u64, and its chunk is seg[offset:
 * offset+length], copied into slots[j] piece by piece, each piece hashed right after it is
 * copied (what is verified is the copy stored, whatever the client does to its segment
 * meanwhile). The GIL is released for the whole run. It stops after a frame without MORE
 * (have = 0: the batch ended), when the slots are used up, or at a frame it does not take:
 * have = HEADER_SIZE with that header in head, or, for a reference outside the segment, empty
 * or larger than the slot, have = HEADER_SIZE + its body, the whole frame in head (head must
 * hold HEADER_SIZE + 2*KEY_BYTES + REF_SIZE bytes): the caller's reader deals with it, so its
 * checks and error messages stay the only ones. items: one (flags, count, length, hash) per
 * frame received, `length` the whole body as if the chunk had been inline (flags keep SHM).
 * Nothing here validates a chunk: the caller verifies each against its hash. Errors: EOF ->
 * ConnectionError; a socket error (SO_RCVTIMEO expiry included) -> OSError. After an
 * exception the items received are lost and the connection is not usable.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>

#include "_xxh3.h"
#include "_streamcopy.h"

#define HEADER_SIZE 16
#define KEY_BYTES 32
#define FLAG_MORE 1
#define FLAG_PARENT 2
#define FLAG_SHM 4
#define REF_SIZE 16 /* offset u64 || length u64, little-endian */

static uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int k = 7; k >= 0; k--)
        v = v << 8 | p[k];
    return v;
}

/* Fill iov[0..cnt) with MSG_WAITALL recvmsg calls (no GIL; EINTR retried: these are never the
 * main thread, where Python runs signal handlers). 0; -1 at EOF; else the errno. */
static int recv_exact(int fd, struct iovec *iov, int cnt) {
    while (cnt > 0) {
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = cnt;
        ssize_t k = recvmsg(fd, &msg, MSG_WAITALL);
        if (k == 0)
            return -1;
        if (k < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        while (cnt > 0 && (size_t)k >= iov->iov_len) { /* drop what is full */
            k -= (ssize_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + k;
            iov->iov_len -= (size_t)k;
        }
    }
    return 0;
}

typedef struct {
    int flags;
    uint32_t count;
    uint64_t length;
    uint64_t digest;
} item_t;

typedef struct {
    int fd, put_type;
    unsigned char *head;
    Py_ssize_t have;
    char *keys;
    size_t hash_from, piece;
    void *state;
    const char *seg; /* the shared segment, NULL: SHM frames are not taken */
    size_t seg_len;
} run_t;

/* Copy src into dst (n bytes), hashing dst[hash_from:] into the reset state; the digest (0 for
 * n < hash_from). dst is a RAM slot the chunk is stored in: the copy goes through this thread's
 * bounce buffer (in L2): memcpy in, hash there, streaming stores out (_streamcopy.h), so dst's
 * lines are not read first and the hash is of exactly the stored bytes, whatever the client
 * does to its segment meanwhile. Without a bounce buffer (no memory for one): piece by piece,
 * each piece of dst hashed right after it is copied, while in cache. */
static uint64_t copy_hash_into(void *state, char *dst, const char *src, size_t n, size_t hash_from, size_t step) {
    xxh_reset(state);
    scratch_t *s = scratch();
    char *via = s != NULL ? s->bounce : NULL;
    if (via != NULL)
        step = BOUNCE;
    for (size_t done = 0; done < n; done += step) {
        size_t len = n - done < step ? n - done : step;
        char *piece = via != NULL ? via : dst + done;
        memcpy(piece, src + done, len);
        size_t from = done > hash_from ? done : hash_from;
        if (done + len > from)
            xxh_update(state, piece + (from - done), done + len - from);
        if (via != NULL)
            stream_range(dst + done, via, len);
    }
    if (via != NULL)
        stream_fence();
    return n >= hash_from ? xxh_digest(state) : 0;
}

/* A PUT whose chunk is a reference into the segment (the header in r->head): its body into
 * head after the header; then, when the reference lies in the segment and fits the slot, the
 * keys to keys_out and the chunk copied and hashed into buf. 1: taken (*chunk, *digest set);
 * 0: not taken (have = the whole frame, in head); -1: a socket error or EOF (*err). */
static int take_ref(run_t *r, size_t keylen, uint64_t length, char *keys_out, char *buf, Py_ssize_t cap,
                    uint64_t *chunk, uint64_t *digest, int *err) {
    if (r->seg == NULL || length != keylen + REF_SIZE)
        return 0; /* header only in head: the reader refuses it with its own message */
    struct iovec iov[1] = {{r->head + HEADER_SIZE, (size_t)length}};
    if ((*err = recv_exact(r->fd, iov, 1)) != 0)
        return -1;
    uint64_t off = le64(r->head + HEADER_SIZE + keylen), n = le64(r->head + HEADER_SIZE + keylen + 8);
    if (n == 0 || n > (uint64_t)cap || off > r->seg_len || n > r->seg_len - off) {
        r->have = (Py_ssize_t)(HEADER_SIZE + length);
        return 0;
    }
    memcpy(keys_out, r->head + HEADER_SIZE, keylen);
    *digest = copy_hash_into(r->state, buf, r->seg + off, (size_t)n, r->hash_from, r->piece);
    *chunk = n;
    return 1;
}

/* The loop itself, without the GIL: frames into slots bufs[0..n) (lens: their sizes), one
 * item each in items. Returns how many; *err: 0, -1 (EOF) or an errno. */
static Py_ssize_t run_frames(run_t *r, char **bufs, Py_ssize_t *lens, Py_ssize_t n, item_t *items, int *err) {
    unsigned char *h = r->head;
    *err = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        struct iovec iov[3];
        if (r->have < HEADER_SIZE) {
            iov[0].iov_base = h + r->have;
            iov[0].iov_len = (size_t)(HEADER_SIZE - r->have);
            if ((*err = recv_exact(r->fd, iov, 1)) != 0)
                return j;
            r->have = HEADER_SIZE;
        }
        int flags = h[3];
        uint64_t length = le64(h + 8);
        size_t keylen = flags & FLAG_PARENT ? 2 * KEY_BYTES : KEY_BYTES;
        if (h[0] != 'K' || h[1] != 'W' || h[2] != r->put_type || (flags & ~(FLAG_MORE | FLAG_PARENT | FLAG_SHM)))
            return j; /* not one this loop takes: the caller's reader gets the header */
        int more = flags & FLAG_MORE;
        items[j].flags = flags;
        items[j].count = (uint32_t)h[4] | (uint32_t)h[5] << 8 | (uint32_t)h[6] << 16 | (uint32_t)h[7] << 24;
        if (flags & FLAG_SHM) {
            uint64_t chunk_len = 0;
            int took = take_ref(r, keylen, length, r->keys + j * 2 * KEY_BYTES, bufs[j], lens[j], &chunk_len,
                                &items[j].digest, err);
            if (took <= 0)
                return j;
            items[j].length = keylen + chunk_len;
            if (more) { /* the next header: read only now, so the client fills its next chunk meanwhile */
                iov[0].iov_base = h;
                iov[0].iov_len = HEADER_SIZE;
                if ((*err = recv_exact(r->fd, iov, 1)) != 0)
                    return j;
            }
            r->have = more ? HEADER_SIZE : 0;
            if (!more)
                return j + 1;
            continue;
        }
        if (length <= keylen || length - keylen > (uint64_t)lens[j])
            return j;
        size_t chunk = (size_t)(length - keylen);
        items[j].length = length;
        xxh_reset(r->state);
        /* The chunk in pieces, each hashed as soon as it is in: while its bytes are still in
         * this core's cache (four connections on two cores evict a whole 1 MiB chunk). */
        for (size_t done = 0; done < chunk;) {
            size_t piece = chunk - done < r->piece ? chunk - done : r->piece;
            int cnt = 0;
            if (done == 0) {
                iov[cnt].iov_base = r->keys + j * 2 * KEY_BYTES;
                iov[cnt++].iov_len = keylen;
            }
            iov[cnt].iov_base = bufs[j] + done;
            iov[cnt++].iov_len = piece;
            if (done + piece == chunk && more) { /* the next frame's header, in the same call */
                iov[cnt].iov_base = h;
                iov[cnt++].iov_len = HEADER_SIZE;
            }
            if ((*err = recv_exact(r->fd, iov, cnt)) != 0)
                return j;
            size_t from = done > r->hash_from ? done : r->hash_from;
            if (done + piece > from)
                xxh_update(r->state, bufs[j] + from, done + piece - from);
            done += piece;
        }
        items[j].digest = chunk >= r->hash_from ? xxh_digest(r->state) : 0;
        r->have = more ? HEADER_SIZE : 0;
        if (!more)
            return j + 1;
    }
    return n;
}

/* copy_hash(dst, src, hash_from, piece) -> int: copy src into dst (same size), hashing
 * dst[hash_from:] (copy_hash_into: through the bounce buffer with streaming stores; piece
 * bytes at a time, each hashed right after it is copied, only where no bounce buffer could be
 * made); the GIL released. The hash is of the copy: what is stored is what was verified,
 * whatever the source (a client's shared segment) does meanwhile. */
static PyObject *copy_hash(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    Py_ssize_t hash_from, piece;
    if (!PyArg_ParseTuple(args, "w*y*nn", &dst, &src, &hash_from, &piece))
        return NULL;
    PyObject *out = NULL;
    void *st = NULL;
    if (xxh_create == NULL || dst.len != src.len || hash_from < 0 || piece <= 0) {
        PyErr_SetString(PyExc_ValueError, "copy_hash: bind_hash has not succeeded, or bad arguments");
        goto done;
    }
    st = xxh_create();
    if (st == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t digest;
    Py_BEGIN_ALLOW_THREADS
    digest = copy_hash_into(st, dst.buf, src.buf, (size_t)dst.len, (size_t)hash_from, (size_t)piece);
    Py_END_ALLOW_THREADS
    out = PyLong_FromUnsignedLongLong(digest);
done:
    if (st != NULL)
        xxh_free(st);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return out;
}

#define MAX_SLOTS 64

static PyObject *recv_puts(PyObject *self, PyObject *args) {
    run_t r;
    Py_buffer head, keys, seg;
    Py_ssize_t hash_from, piece;
    PyObject *slots;
    if (!PyArg_ParseTuple(args, "iw*nw*O!inny*", &r.fd, &head, &r.have, &keys, &PyList_Type, &slots,
                          &r.put_type, &hash_from, &piece, &seg))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = PyList_GET_SIZE(slots), held = 0;
    Py_buffer bufs[MAX_SLOTS];
    char *ptrs[MAX_SLOTS];
    Py_ssize_t lens[MAX_SLOTS];
    item_t items[MAX_SLOTS];
    r.state = NULL;
    if (xxh_create == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "recv_puts: bind_hash has not succeeded");
        goto done;
    }
    if (head.len != HEADER_SIZE + 2 * KEY_BYTES + REF_SIZE || r.have < 0 || r.have > HEADER_SIZE || hash_from < 0 || piece <= 0 ||
        n > MAX_SLOTS || keys.len < n * 2 * KEY_BYTES) {
        PyErr_SetString(PyExc_ValueError, "recv_puts: bad arguments");
        goto done;
    }
    for (; held < n; held++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(slots, held), &bufs[held], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        ptrs[held] = bufs[held].buf;
        lens[held] = bufs[held].len;
    }
    r.state = xxh_create();
    if (r.state == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    r.head = head.buf;
    r.keys = keys.buf;
    r.seg = seg.len > 0 ? seg.buf : NULL;
    r.seg_len = (size_t)seg.len;
    r.hash_from = (size_t)hash_from;
    r.piece = (size_t)piece;
    Py_ssize_t got;
    int err;
    Py_BEGIN_ALLOW_THREADS
    got = run_frames(&r, ptrs, lens, n, items, &err);
    Py_END_ALLOW_THREADS
    if (err == -1) {
        PyErr_SetString(PyExc_ConnectionError, "peer closed the connection");
        goto done;
    }
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    PyObject *list = PyList_New(got);
    if (list == NULL)
        goto done;
    for (Py_ssize_t j = 0; j < got; j++) {
        PyObject *item = Py_BuildValue("iIKK", items[j].flags, items[j].count,
                                       (unsigned long long)items[j].length, (unsigned long long)items[j].digest);
        if (item == NULL) {
            Py_DECREF(list);
            goto done;
        }
        PyList_SET_ITEM(list, j, item);
    }
    out = Py_BuildValue("Nn", list, r.have);
done:
    if (r.state != NULL)
        xxh_free(r.state);
    for (Py_ssize_t j = 0; j < held; j++)
        PyBuffer_Release(&bufs[j]);
    PyBuffer_Release(&head);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&seg);
    return out;
}

static PyMethodDef methods[] = {
    {"bind_hash", bind_hash, METH_VARARGS, "bind_hash(path) -> bool"},
    {"copy_hash", copy_hash, METH_VARARGS, "copy_hash(dst, src, hash_from, piece) -> int"},
    {"recv_puts", recv_puts, METH_VARARGS,
     "recv_puts(fd, head, have, keys, slots, put_type, hash_from, piece, seg) -> (items, have)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvtier._putloop",
                                    "C loop for runs of PUT frames on the server (optional).", -1,
                                    methods};

/* The wire constants it was built with, for the test that holds them to the Python ones. */
PyMODINIT_FUNC PyInit__putloop(void) {
    if (scratch_init() != 0)
        return PyErr_NoMemory();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "KEY_BYTES", KEY_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "MORE", FLAG_MORE) < 0 ||
        PyModule_AddIntConstant(m, "PARENT", FLAG_PARENT) < 0 ||
        PyModule_AddIntConstant(m, "SHM", FLAG_SHM) < 0 || PyModule_AddIntConstant(m, "REF_SIZE", REF_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "MAX_SLOTS", MAX_SLOTS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
