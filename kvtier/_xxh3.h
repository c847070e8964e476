/* The xxhash package's streaming XXH3_64bits, for the C loops that hash what they copy
 * (kvtier/_putloop.c, kvtier/_stream.c). Nothing is linked: bind_xxh3(path) looks the
 * functions up in the xxhash package's already-imported shared object (dlopen RTLD_NOLOAD, so
 * nothing new is loaded), and each module's Python side checks the bound functions against
 * xxhash.xxh3_64_intdigest before it relies on them. The state is opaque here (made by
 * XXH3_createState). Each module including this has its own pointers; both name one library.
 * Include after Python.h: bind_hash is the modules' shared Python entry point.
 */
#ifndef KVTIER_XXH3_H
#define KVTIER_XXH3_H

#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>

typedef void *(*xxh_create_fn)(void);
typedef int (*xxh_free_fn)(void *);
typedef int (*xxh_reset_fn)(void *);
typedef int (*xxh_update_fn)(void *, const void *, size_t);
typedef uint64_t (*xxh_digest_fn)(const void *);
static xxh_create_fn xxh_create = NULL;
static xxh_free_fn xxh_free = NULL;
static xxh_reset_fn xxh_reset = NULL;
static xxh_update_fn xxh_update = NULL;
static xxh_digest_fn xxh_digest = NULL;

/* 1 when every function was found in the object at `path` (already loaded), else 0. */
static int bind_xxh3(const char *path) {
    /* The handle stays open: the module it belongs to is never unloaded. */
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        return 0;
    void *update = dlsym(lib, "XXH3_64bits_update_dispatch"); /* the CPU-dispatched build */
    if (update == NULL)
        update = dlsym(lib, "XXH3_64bits_update");
    void *create = dlsym(lib, "XXH3_createState"), *free_ = dlsym(lib, "XXH3_freeState");
    void *reset = dlsym(lib, "XXH3_64bits_reset"), *digest = dlsym(lib, "XXH3_64bits_digest");
    if (!update || !create || !free_ || !reset || !digest)
        return 0;
    xxh_create = (xxh_create_fn)create;
    xxh_free = (xxh_free_fn)free_;
    xxh_reset = (xxh_reset_fn)reset;
    xxh_update = (xxh_update_fn)update;
    xxh_digest = (xxh_digest_fn)digest;
    return 1;
}

/* bind_hash(path) -> bool: bind_xxh3 for Python (each module's load-time self-check calls it). */
static PyObject *bind_hash(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    return PyBool_FromLong(bind_xxh3(path));
}

#endif
