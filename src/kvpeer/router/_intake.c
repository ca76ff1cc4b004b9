/* The router's KV event intake in C, past msgspec (docs/scale.md, sessions 19 and 21):
 *
 * - msgpack_tokens: a store's token ids, kept raw by the decoder, checked and packed;
 * - translate: a batch's wire events into the router's events (events.py's _translate);
 * - stores_of: a run of stores ordered parents first and joined into chains;
 * - chain / chain_keys: the index's chain keys (SHA-256 by OpenSSL's libcrypto);
 * - Holders: a medium's holder masks, in an open-addressing table of their own;
 * - Core: the index's state, owned, with the two loops every block goes through
 *   (stored, removed) as its methods.
 *
 * Each has a Python twin that stays as the reference and the fallback when this module
 * is not built (events.py, indexloops.py); tests/router/test_index_native.py compares them on
 * random inputs (every container, order included) and checks that nothing leaks.
 *
 * Nothing here trusts its arguments: every object is type-checked before use, Python
 * containers are touched only through the C API's checked calls, and every error is a
 * Python exception. msgpack_tokens is the one place that reads a peer's bytes: the array
 * header and every item are bounds-checked against the buffer before they are read, and
 * what msgspec would refuse is refused (compared with msgspec on random encodings).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <openssl/evp.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

/* --- Holders: invariant 7's masks of one medium, in a table of their own -------------------
 *
 * chain key (16 bytes) -> the bits of the engines holding it. An open-addressing table
 * (linear probing, backward-shift deletion, at most half full) whose slots hold the key
 * and its mask inline: a lookup costs the one or two cache lines of its slot, where a
 * dict of bytes to ints cost its index, its entry, the key object and the int object --
 * the largest part of the intake's CPU at 256 engines (docs/scale.md, session 21). An
 * empty slot is an all-zero mask: a held key has a bit set. A key's slot is taken from its
 * own bits: chain keys hash from a root drawn at random by each router process (index.py's
 * _ROOT) and are never shown outside it, so engines and clients that choose token contents
 * cannot know, let alone choose, where their keys land. A fixed mix of both words spreads
 * keys that are not chain keys (a test's counters) as well. The table holds no
 * Python object; it is the C loops' and the decision walk's (indexloops.py keeps a Python
 * class with the same methods as the reference). */

#define KEY_WORDS 2
#define KEY_BYTES (KEY_WORDS * 8)
#define MAX_ENGINE_INDEX (1 << 20)

typedef struct {
    PyObject_HEAD
    uint64_t *slots;     /* capacity slots of stride words: key, then mask */
    Py_ssize_t capacity; /* 0 or a power of two */
    Py_ssize_t used;
    Py_ssize_t words; /* mask words per slot */
} HoldersObject;

static PyTypeObject HoldersType;

static inline Py_ssize_t
holders_stride(const HoldersObject *h)
{
    return KEY_WORDS + h->words;
}

static inline uint64_t *
holders_slot(const HoldersObject *h, Py_ssize_t i)
{
    return h->slots + i * holders_stride(h);
}

static inline int
holders_empty(const HoldersObject *h, const uint64_t *slot)
{
    for (Py_ssize_t w = 0; w < h->words; w++) {
        if (slot[KEY_WORDS + w]) {
            return 0;
        }
    }
    return 1;
}

static inline Py_ssize_t
holders_home(const HoldersObject *h, const uint64_t *key)
{
    uint64_t x = key[0] ^ (key[1] * 0x9e3779b97f4a7c15ULL); /* splitmix64's finaliser */
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return (Py_ssize_t)(x & (uint64_t)(h->capacity - 1));
}

/* The slot of `key`, or -1 - (the empty slot where it would go). The table is not full. */
static Py_ssize_t
holders_find(const HoldersObject *h, const uint64_t *key)
{
    Py_ssize_t mask = h->capacity - 1;
    for (Py_ssize_t i = holders_home(h, key);; i = (i + 1) & mask) {
        const uint64_t *slot = holders_slot(h, i);
        if (holders_empty(h, slot)) {
            return -1 - i;
        }
        if (slot[0] == key[0] && slot[1] == key[1]) {
            return i;
        }
    }
}

#define HUGE_PAGE ((size_t)2 << 20)

/* Zeroed slots for a table of `bytes`. A table of a huge page or more is aligned to huge
 * pages and asks the kernel for them: a large fleet's table is 100 MiB probed at random,
 * and with 4 KiB pages most probes also missed the TLB (docs/scale.md, session 21). */
static uint64_t *
holders_alloc(size_t bytes)
{
    if (bytes < HUGE_PAGE) {
        return calloc(bytes, 1);
    }
    bytes = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    uint64_t *slots = aligned_alloc(HUGE_PAGE, bytes);
    if (slots != NULL) {
#ifdef MADV_HUGEPAGE
        (void)madvise(slots, bytes, MADV_HUGEPAGE); /* advice: without it, small pages */
#endif
        memset(slots, 0, bytes);
    }
    return slots;
}

/* Rebuilds the table with `capacity` slots of `words` mask words: 0, or -1 (MemoryError). */
static int
holders_resize(HoldersObject *h, Py_ssize_t capacity, Py_ssize_t words)
{
    Py_ssize_t stride = KEY_WORDS + words;
    if (capacity > PY_SSIZE_T_MAX / 8 / stride) {
        PyErr_NoMemory();
        return -1;
    }
    uint64_t *slots = holders_alloc((size_t)(capacity * stride) * sizeof(uint64_t));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    HoldersObject old = *h;
    h->slots = slots;
    h->capacity = capacity;
    h->words = words;
    for (Py_ssize_t i = 0; i < old.capacity; i++) {
        const uint64_t *from = holders_slot(&old, i);
        if (!holders_empty(&old, from)) {
            uint64_t *to = holders_slot(h, -1 - holders_find(h, from));
            memcpy(to, from, (size_t)holders_stride(&old) * sizeof(uint64_t));
        }
    }
    free(old.slots);
    return 0;
}

/* Sets bit `index` of `key`'s mask, the key added if new: 0, or -1 with an exception. */
static int
holders_set(HoldersObject *h, const uint64_t *key, Py_ssize_t index)
{
    Py_ssize_t words = index / 64 + 1 > h->words ? index / 64 + 1 : h->words;
    Py_ssize_t capacity = h->capacity ? h->capacity : 16;
    if ((h->used + 1) * 2 > capacity) {
        capacity *= 2;
    }
    if ((words != h->words || capacity != h->capacity) && holders_resize(h, capacity, words) < 0) {
        return -1;
    }
    Py_ssize_t at = holders_find(h, key);
    uint64_t *slot = holders_slot(h, at >= 0 ? at : -1 - at);
    if (at < 0) {
        slot[0] = key[0];
        slot[1] = key[1];
        h->used++;
    }
    slot[KEY_WORDS + index / 64] |= (uint64_t)1 << (index % 64);
    return 0;
}

/* Clears bit `index` of `key`'s mask, the key gone with its last bit: 0, or -1 with
 * KeyError when the key is not held or its bit not set (invariant 7 broken). */
static int
holders_clear(HoldersObject *h, const uint64_t *key, Py_ssize_t index)
{
    Py_ssize_t i = h->capacity ? holders_find(h, key) : -1;
    uint64_t bit = (uint64_t)1 << (index % 64);
    uint64_t *slot = i >= 0 ? holders_slot(h, i) : NULL;
    if (slot == NULL || index / 64 >= h->words || !(slot[KEY_WORDS + index / 64] & bit)) {
        PyObject *name = PyBytes_FromStringAndSize((const char *)key, KEY_BYTES);
        if (name != NULL) {
            PyErr_SetObject(PyExc_KeyError, name);
            Py_DECREF(name);
        }
        return -1;
    }
    slot[KEY_WORDS + index / 64] &= ~bit;
    if (!holders_empty(h, slot)) {
        return 0;
    }
    /* backward shift: every later slot of the probe run that may move up, moves up */
    Py_ssize_t mask = h->capacity - 1, stride = holders_stride(h);
    for (Py_ssize_t j = (i + 1) & mask;; j = (j + 1) & mask) {
        uint64_t *next = holders_slot(h, j);
        if (holders_empty(h, next)) {
            break;
        }
        Py_ssize_t home = holders_home(h, next);
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            memcpy(holders_slot(h, i), next, (size_t)stride * sizeof(uint64_t));
            i = j;
        }
    }
    memset(holders_slot(h, i), 0, (size_t)stride * sizeof(uint64_t));
    h->used--;
    if (h->capacity > 16 && h->used * 8 < h->capacity) {
        return holders_resize(h, h->capacity / 2, h->words);
    }
    return 0;
}

/* The 16 bytes of a chain key (a bytes object of that size), else NULL with TypeError. */
static const uint64_t *
holders_key(PyObject *key, uint64_t *buffer)
{
    if (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) != KEY_BYTES) {
        PyErr_Format(PyExc_TypeError, "holder keys are %d-byte chain keys, not %.50s", KEY_BYTES,
                     PyBytes_CheckExact(key) ? "bytes of another size" : Py_TYPE(key)->tp_name);
        return NULL;
    }
    memcpy(buffer, PyBytes_AS_STRING(key), KEY_BYTES);
    return buffer;
}

/* An engine's bit position, checked. -1 with an exception. */
static Py_ssize_t
holders_index(PyObject *obj)
{
    Py_ssize_t index = PyLong_AsSsize_t(obj);
    if (index == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (index < 0 || index >= MAX_ENGINE_INDEX) {
        PyErr_Format(PyExc_ValueError, "engine bit %zd outside [0, %d)", index, MAX_ENGINE_INDEX);
        return -1;
    }
    return index;
}

/* The mask in `slot` as a Python int, made at once from its words (a decision asks for
 * the masks of a prompt's every block; shifting word by word cost five times as much):
 * by PyLong_FromUnsignedNativeBytes where the API has it (3.13), else by int.from_bytes on
 * the words' little-endian bytes, both public. */
static PyObject *int_from_bytes; /* int.from_bytes, looked up once per process */
static PyObject *str_little;

static PyObject *
holders_mask(const HoldersObject *h, const uint64_t *slot)
{
    const uint64_t *mask = slot + KEY_WORDS;
    if (h->words == 1) {
        return PyLong_FromUnsignedLongLong(mask[0]);
    }
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(mask, (size_t)h->words * 8,
                                          Py_ASNATIVEBYTES_LITTLE_ENDIAN);
#else
    unsigned char little[8 * 8]; /* words <= 8: masks of up to 512 engines on the stack */
    unsigned char *bytes = h->words <= 8 ? little : PyMem_Malloc((size_t)h->words * 8);
    if (bytes == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t b = 0; b < h->words * 8; b++) {
        bytes[b] = (unsigned char)(mask[b / 8] >> (8 * (b % 8)));
    }
    PyObject *raw = PyBytes_FromStringAndSize((const char *)bytes, h->words * 8);
    if (bytes != little) {
        PyMem_Free(bytes);
    }
    if (raw == NULL) {
        return NULL;
    }
    PyObject *args[2] = {raw, str_little};
    PyObject *out = PyObject_Vectorcall(int_from_bytes, args, 2, NULL);
    Py_DECREF(raw);
    return out;
#endif
}

static PyObject *
Holders_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if (PyTuple_GET_SIZE(args) || (kwargs != NULL && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Holders() takes no arguments");
        return NULL;
    }
    HoldersObject *h = (HoldersObject *)type->tp_alloc(type, 0);
    if (h != NULL) {
        h->words = 1;
    }
    return (PyObject *)h;
}

static void
Holders_dealloc(HoldersObject *h)
{
    free(h->slots);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static Py_ssize_t
Holders_len(HoldersObject *h)
{
    return h->used;
}

static PyObject *
Holders_get(HoldersObject *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "get() takes 1 or 2 arguments (%zd given)", nargs);
        return NULL;
    }
    uint64_t buffer[KEY_WORDS];
    const uint64_t *key = holders_key(args[0], buffer);
    if (key == NULL) {
        return NULL;
    }
    Py_ssize_t at = h->capacity ? holders_find(h, key) : -1;
    if (at < 0) {
        return nargs == 2 ? Py_NewRef(args[1]) : PyLong_FromLong(0);
    }
    return holders_mask(h, holders_slot(h, at));
}

/* set_bit and clear_bit: `op` on the checked (key, index) of args. */
static PyObject *
holders_apply(HoldersObject *h, PyObject *const *args, Py_ssize_t nargs, const char *name,
              int (*op)(HoldersObject *, const uint64_t *, Py_ssize_t))
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes 2 arguments (%zd given)", name, nargs);
        return NULL;
    }
    uint64_t buffer[KEY_WORDS];
    const uint64_t *key = holders_key(args[0], buffer);
    Py_ssize_t index = key == NULL ? -1 : holders_index(args[1]);
    if (index < 0 || op(h, key, index) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
Holders_set_bit(HoldersObject *h, PyObject *const *args, Py_ssize_t nargs)
{
    return holders_apply(h, args, nargs, "set_bit", holders_set);
}

static PyObject *
Holders_clear_bit(HoldersObject *h, PyObject *const *args, Py_ssize_t nargs)
{
    return holders_apply(h, args, nargs, "clear_bit", holders_clear);
}

static PyObject *
Holders_items(HoldersObject *h, PyObject *unused)
{
    (void)unused;
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < h->capacity; i++) {
        const uint64_t *slot = holders_slot(h, i);
        if (holders_empty(h, slot)) {
            continue;
        }
        PyObject *key = PyBytes_FromStringAndSize((const char *)slot, KEY_BYTES);
        PyObject *mask = key == NULL ? NULL : holders_mask(h, slot);
        PyObject *pair = mask == NULL ? NULL : PyTuple_Pack(2, key, mask);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_CLEAR(out);
        }
        Py_XDECREF(pair);
        Py_XDECREF(mask);
        Py_XDECREF(key);
    }
    return out;
}

static PyObject *
Holders_sizeof(HoldersObject *h, PyObject *unused)
{
    (void)unused;
    return PyLong_FromSsize_t((Py_ssize_t)sizeof(HoldersObject)
                              + h->capacity * holders_stride(h) * (Py_ssize_t)sizeof(uint64_t));
}

static PyMethodDef Holders_methods[] = {
    {"get", (PyCFunction)(void (*)(void))Holders_get, METH_FASTCALL,
     "get(key, default=0): the mask of the engines holding key."},
    {"set_bit", (PyCFunction)(void (*)(void))Holders_set_bit, METH_FASTCALL,
     "set_bit(key, index): engine `index` holds key."},
    {"clear_bit", (PyCFunction)(void (*)(void))Holders_clear_bit, METH_FASTCALL,
     "clear_bit(key, index): engine `index` no longer holds key (KeyError if it did not)."},
    {"items", (PyCFunction)Holders_items, METH_NOARGS, "[(key, mask), ...] in no order."},
    {"__sizeof__", (PyCFunction)Holders_sizeof, METH_NOARGS, "Bytes held, table included."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Holders_as_sequence = {
    .sq_length = (lenfunc)Holders_len,
};

static PyTypeObject HoldersType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvpeer.router._intake.Holders",
    .tp_basicsize = sizeof(HoldersObject),
    .tp_dealloc = (destructor)Holders_dealloc,
    .tp_as_sequence = &Holders_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Chain key -> the bits of the engines holding it (index.py invariant 7).",
    .tp_methods = Holders_methods,
    .tp_new = Holders_new,
};

/* `obj` as the Holders it must be: NULL with TypeError otherwise. */
static HoldersObject *
expect_holders(PyObject *obj)
{
    if (!Py_IS_TYPE(obj, &HoldersType)) {
        PyErr_Format(PyExc_TypeError, "holders must be a Holders, not %.50s",
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return (HoldersObject *)obj;
}

/* --- Chain keys: SHA-256 by OpenSSL, truncated to 16 bytes ------------------------------
 *
 * index.py's _chain(parent, tokens) = sha256(parent || tokens).digest()[:16], hashed here by
 * the libcrypto the interpreter's own hashlib links (no primitive of ours), so the stored
 * loop and a prompt's keys hash with no Python call per block (the call cost four times the
 * hashing). One context is fetched at import and reused under the GIL (a fetch per key cost
 * three times the hashing). tests/router/test_index_native.py compares it with hashlib. */

#define CHAIN_BYTES 16

static EVP_MD *chain_md;      /* SHA-256, fetched once per process */
static EVP_MD_CTX *chain_ctx; /* reused: every call holds the GIL from init to final */

/* The chain key of `n` bytes of tokens after `parent`: a new bytes object, or NULL. */
static PyObject *
chain_key(const char *parent, Py_ssize_t parent_n, const char *tokens, Py_ssize_t n)
{
    unsigned char out[EVP_MAX_MD_SIZE];
    unsigned int out_n = 0;
    if (!EVP_DigestInit_ex2(chain_ctx, chain_md, NULL)
        || !EVP_DigestUpdate(chain_ctx, parent, (size_t)parent_n)
        || !EVP_DigestUpdate(chain_ctx, tokens, (size_t)n)
        || !EVP_DigestFinal_ex(chain_ctx, out, &out_n) || out_n < CHAIN_BYTES) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL's SHA-256 failed");
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)out, CHAIN_BYTES);
}

/* chain(parent, tokens) -> bytes: index.py's _chain. */
static PyObject *
intake_chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2 || !PyBytes_CheckExact(args[0]) || !PyBytes_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "chain() takes two bytes objects");
        return NULL;
    }
    return chain_key(PyBytes_AS_STRING(args[0]), PyBytes_GET_SIZE(args[0]),
                     PyBytes_AS_STRING(args[1]), PyBytes_GET_SIZE(args[1]));
}

/* chain_keys(parent, tokens, width) -> tuple: index.py's _chain_keys, a key per `width`
 * bytes of tokens (a shorter last piece too), each the next one's parent. */
static PyObject *
intake_chain_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    Py_ssize_t width = nargs == 3 ? PyLong_AsSsize_t(args[2]) : -1;
    if (width == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (nargs != 3 || !PyBytes_CheckExact(args[0]) || !PyBytes_CheckExact(args[1]) || width <= 0) {
        PyErr_SetString(PyExc_TypeError, "chain_keys() takes two bytes and a positive width");
        return NULL;
    }
    Py_ssize_t size = PyBytes_GET_SIZE(args[1]);
    Py_ssize_t count = size / width + (size % width != 0);
    PyObject *keys = PyTuple_New(count);
    PyObject *parent = args[0];
    for (Py_ssize_t i = 0; keys != NULL && i < count; i++) {
        Py_ssize_t start = i * width, n = size - start < width ? size - start : width;
        PyObject *key = chain_key(PyBytes_AS_STRING(parent), PyBytes_GET_SIZE(parent),
                                  PyBytes_AS_STRING(args[1]) + start, n);
        if (key == NULL) {
            Py_CLEAR(keys);
            break;
        }
        PyTuple_SET_ITEM(keys, i, key);
        parent = key;
    }
    return keys;
}

/* Is `obj` a bytes object that starts with `prefix`? -1 on a non-bytes object. */
static int
starts_with(PyObject *obj, PyObject *prefix)
{
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "chain keys are bytes, not %.50s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(prefix);
    return PyBytes_GET_SIZE(obj) >= n
           && memcmp(PyBytes_AS_STRING(obj), PyBytes_AS_STRING(prefix), (size_t)n) == 0;
}

/* Past `limit`, the oldest entries of `dict` out down to limit - limit / 8 (indexloops.py's
 * oldest_out): 0, or -1 with an exception. */
static int
oldest_out(PyObject *dict, Py_ssize_t limit)
{
    Py_ssize_t excess = PyDict_GET_SIZE(dict) - (limit - limit / 8);
    if (PyDict_GET_SIZE(dict) <= limit || excess <= 0) {
        return 0;
    }
    PyObject *gone = PyList_New(0);
    if (gone == NULL) {
        return -1;
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyList_GET_SIZE(gone) < excess && PyDict_Next(dict, &pos, &key, &value)) {
        if (PyList_Append(gone, key) < 0) {
            Py_DECREF(gone);
            return -1;
        }
    }
    int rc = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(gone) && rc == 0; i++) {
        rc = PyDict_DelItem(dict, PyList_GET_ITEM(gone, i));
    }
    Py_DECREF(gone);
    return rc;
}

/* dict[key] = value as the newest entry (deleted first if there): 0, or -1. */
static int
set_newest(PyObject *dict, PyObject *key, PyObject *value, int present)
{
    if (present && PyDict_DelItem(dict, key) < 0) {
        return -1;
    }
    return PyDict_SetItem(dict, key, value);
}

/* Every container is an exact dict: a subclass could run code inside the loops. */
static int
expect_dict(PyObject *obj, const char *name)
{
    if (!PyDict_CheckExact(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a dict, not %.50s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

/* removed_loop(hashes, retired, present, holders, others, index, refcounted, max_retired,
 *              block_hashes, unkeyed_prefix) -> blocks unknown
 *
 * Core._removed's loop (indexloops.removed in Python), on one engine's containers: each block leaves `present` (a refcounted medium's count
 * goes down first), engine `index` leaves its mask in `holders` (chain keys only: an
 * unkeyed key is in no mask), and a block left in none of `others` has its hash mapping
 * retired (invariant 2). */
static PyObject *
removed_loop(PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_Format(PyExc_TypeError, "removed() takes 10 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *hashes = args[0], *retired = args[1], *present = args[2];
    PyObject *others = args[4];
    HoldersObject *holders = expect_holders(args[3]);
    Py_ssize_t index = holders == NULL ? -1 : holders_index(args[5]);
    int refcounted = index < 0 ? -1 : PyObject_IsTrue(args[6]);
    Py_ssize_t max_retired = PyLong_AsSsize_t(args[7]);
    PyObject *block_hashes = args[8], *prefix = args[9];
    if (refcounted < 0 || (max_retired == -1 && PyErr_Occurred())) {
        return NULL;
    }
    if (expect_dict(hashes, "hashes") || expect_dict(retired, "retired")
        || expect_dict(present, "present")) {
        return NULL;
    }
    if (!PyList_CheckExact(others) || !PyTuple_CheckExact(block_hashes)
        || !PyBytes_CheckExact(prefix)) {
        PyErr_SetString(PyExc_TypeError,
                        "others is a list, block_hashes a tuple, unkeyed_prefix bytes");
        return NULL;
    }
    Py_ssize_t n_others = PyList_GET_SIZE(others);
    for (Py_ssize_t j = 0; j < n_others; j++) {
        if (!PyDict_Check(PyList_GET_ITEM(others, j))) {
            PyErr_SetString(PyExc_TypeError, "others holds dicts");
            return NULL;
        }
    }
    Py_ssize_t unknown = 0;
    Py_ssize_t n = PyTuple_GET_SIZE(block_hashes);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *block_hash = PyTuple_GET_ITEM(block_hashes, i);
        PyObject *key = PyDict_GetItemWithError(hashes, block_hash);
        if (key == NULL) {
            if (PyErr_Occurred()) {
                return NULL;
            }
            unknown++;
            continue;
        }
        Py_INCREF(key); /* hashes' own reference goes when the mapping is retired */
        PyObject *count = PyDict_GetItemWithError(present, key);
        if (count == NULL) {
            Py_DECREF(key);
            if (PyErr_Occurred()) {
                return NULL;
            }
            unknown++;
            continue;
        }
        if (refcounted) {
            long c = PyLong_AsLong(count);
            if (c == -1 && PyErr_Occurred()) {
                Py_DECREF(key);
                return NULL;
            }
            if (c > 1) {
                PyObject *less = PyLong_FromLong(c - 1);
                int rc = less == NULL ? -1 : PyDict_SetItem(present, key, less);
                Py_XDECREF(less);
                Py_DECREF(key);
                if (rc < 0) {
                    return NULL;
                }
                continue;
            }
        }
        if (PyDict_DelItem(present, key) < 0) {
            Py_DECREF(key);
            return NULL;
        }
        int rc = starts_with(key, prefix);
        if (rc == 0) { /* a chain key: out of the engine's mask (KeyError: invariant 7) */
            uint64_t buffer[KEY_WORDS];
            const uint64_t *chained = holders_key(key, buffer);
            rc = chained == NULL ? -1 : holders_clear(holders, chained, index);
        }
        if (rc < 0) {
            Py_DECREF(key);
            return NULL;
        }
        int elsewhere = 0;
        for (Py_ssize_t j = 0; j < n_others && !elsewhere; j++) {
            elsewhere = PyDict_Contains(PyList_GET_ITEM(others, j), key);
            if (elsewhere < 0) {
                Py_DECREF(key);
                return NULL;
            }
        }
        if (!elsewhere) { /* the block left every medium: retire its mapping */
            Py_INCREF(block_hash);
            rc = PyDict_DelItem(hashes, block_hash);
            if (rc == 0) {
                rc = PyDict_SetItem(retired, block_hash, key);
            }
            if (rc == 0) {
                rc = oldest_out(retired, max_retired);
            }
            Py_DECREF(block_hash);
            if (rc < 0) {
                Py_DECREF(key);
                return NULL;
            }
        }
        Py_DECREF(key);
    }
    return PyLong_FromSsize_t(unknown);
}

/* A big-endian unsigned integer of `n` bytes at `p`. */
static inline uint64_t
big_endian(const unsigned char *p, int n)
{
    uint64_t value = 0;
    for (int i = 0; i < n; i++) {
        value = value << 8 | p[i];
    }
    return value;
}

/* msgpack_tokens(raw, max_count) -> bytes
 *
 * A store's token ids as the decoder kept them (the msgpack of one array, any buffer) packed
 * as array("I") packs them (uint32, native order). Every byte is the peer's: the array
 * header and each item are bounds-checked against the buffer, each item must be an integer
 * in [0, 2**32) in any of msgpack's integer encodings, at most max_count of them, and
 * nothing may follow the array; anything else is a ValueError that names it. */
static PyObject *
pack_msgpack_tokens(PyObject *raw, Py_ssize_t max_count)
{
    Py_buffer view;
    if (PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const unsigned char *p = view.buf, *end = p + view.len;
    PyObject *packed = NULL;
    Py_ssize_t count = -1;
    if (p < end) {
        unsigned char head = *p++;
        if ((head & 0xf0) == 0x90) {
            count = head & 0x0f;
        } else if (head == 0xdc && end - p >= 2) {
            count = (Py_ssize_t)big_endian(p, 2);
            p += 2;
        } else if (head == 0xdd && end - p >= 4) {
            count = (Py_ssize_t)big_endian(p, 4);
            p += 4;
        }
    }
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "expected an array of token ids");
        goto done;
    }
    if (count > max_count || count > end - p) { /* each item takes a byte at least */
        PyErr_Format(PyExc_ValueError, "%zd token ids: more than %s", count,
                     count > max_count ? "allowed" : "the payload holds");
        goto done;
    }
    packed = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(uint32_t));
    if (packed == NULL) {
        goto done;
    }
    char *out = PyBytes_AS_STRING(packed);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (p == end) { /* the items before took more than a byte each */
            PyErr_Format(PyExc_ValueError, "token id %zd is cut short", i);
            Py_CLEAR(packed);
            goto done;
        }
        unsigned char tag = *p++;
        uint64_t value = tag;
        int width = 0, is_signed = 0;
        if (tag <= 0x7f) {
            /* a positive fixint: the tag is the value */
        } else if (tag >= 0xe0) {
            PyErr_Format(PyExc_ValueError, "token id %zd is negative", i);
            Py_CLEAR(packed);
            goto done;
        } else if (tag >= 0xcc && tag <= 0xcf) {
            width = 1 << (tag - 0xcc);
        } else if (tag >= 0xd0 && tag <= 0xd3) {
            width = 1 << (tag - 0xd0);
            is_signed = 1;
        } else {
            PyErr_Format(PyExc_ValueError, "token id %zd is not an integer (msgpack 0x%02x)", i,
                         tag);
            Py_CLEAR(packed);
            goto done;
        }
        if (width) {
            if (end - p < width) {
                PyErr_Format(PyExc_ValueError, "token id %zd is cut short", i);
                Py_CLEAR(packed);
                goto done;
            }
            /* each width spelt out: a constant width is a load, not a loop */
            value = width == 4   ? big_endian(p, 4)
                    : width == 2 ? big_endian(p, 2)
                    : width == 1 ? big_endian(p, 1)
                                 : big_endian(p, 8);
            p += width;
            /* a signed encoding's sign bit set is a negative id */
            if (is_signed && value >> (8 * width - 1)) {
                PyErr_Format(PyExc_ValueError, "token id %zd is negative", i);
                Py_CLEAR(packed);
                goto done;
            }
        }
        if (value > UINT32_MAX) {
            PyErr_Format(PyExc_ValueError, "token id %zd is above 2**32 - 1", i);
            Py_CLEAR(packed);
            goto done;
        }
        uint32_t word = (uint32_t)value;
        memcpy(out + i * (Py_ssize_t)sizeof(word), &word, sizeof(word));
    }
    if (packed != NULL && p != end) {
        PyErr_SetString(PyExc_ValueError, "bytes after the token ids");
        Py_CLEAR(packed);
    }
done:
    PyBuffer_Release(&view);
    return packed;
}

static PyObject *
intake_msgpack_tokens(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "msgpack_tokens() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t max_count = PyLong_AsSsize_t(args[1]);
    if (max_count == -1 && PyErr_Occurred()) {
        return NULL;
    }
    return pack_msgpack_tokens(args[0], max_count);
}

/* indexloops.py's unkeyed_key: `prefix` and the engine's hash (bytes as they are, an int in
 * decimal), a key no chain key has (invariant 6). */
static PyObject *
unkeyed_key(PyObject *prefix, PyObject *block_hash)
{
    PyObject *raw;
    if (PyBytes_Check(block_hash)) {
        raw = Py_NewRef(block_hash);
    } else if (PyLong_Check(block_hash)) {
        PyObject *exact = PyNumber_Index(block_hash); /* an exact int: True is 1 */
        PyObject *text = exact == NULL ? NULL : PyObject_Str(exact);
        raw = text == NULL ? NULL : PyUnicode_AsASCIIString(text);
        Py_XDECREF(text);
        Py_XDECREF(exact);
    } else {
        PyErr_Format(PyExc_TypeError, "block hashes are bytes or int, not %.50s",
                     Py_TYPE(block_hash)->tp_name);
        return NULL;
    }
    if (raw == NULL) {
        return NULL;
    }
    PyObject *key = PyBytes_FromStringAndSize(NULL, PyBytes_GET_SIZE(prefix)
                                                        + PyBytes_GET_SIZE(raw));
    if (key != NULL) {
        memcpy(PyBytes_AS_STRING(key), PyBytes_AS_STRING(prefix),
               (size_t)PyBytes_GET_SIZE(prefix));
        memcpy(PyBytes_AS_STRING(key) + PyBytes_GET_SIZE(prefix), PyBytes_AS_STRING(raw),
               (size_t)PyBytes_GET_SIZE(raw));
    }
    Py_DECREF(raw);
    return key;
}

/* indexloops.py's drop_bit: clear `bit` in masks[entry] (KeyError if absent); no bit left, no
 * entry. 0, or -1 with an exception. */
static int
drop_bit(PyObject *masks, PyObject *entry, PyObject *bit)
{
    PyObject *bits = PyDict_GetItemWithError(masks, entry);
    if (bits == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetObject(PyExc_KeyError, entry);
        }
        return -1;
    }
    PyObject *left = PyNumber_Xor(bits, bit);
    if (left == NULL) {
        return -1;
    }
    int some = PyObject_IsTrue(left);
    int rc = some < 0 ? -1 : some ? PyDict_SetItem(masks, entry, left)
                                  : PyDict_DelItem(masks, entry);
    Py_DECREF(left);
    return rc;
}

/* stored_loop(hashes, retired, present, holders, speculative, speculating, medium, bit,
 *             index, refcounted, parent, block_hashes, tokens, width, unkeyed_prefix)
 *     -> (hash_remapped, unkeyed)
 *
 * Core._stored's loop (indexloops.stored in Python), on one engine's containers, from
 * the chain key of the event's parent: each block gets its chain key (a known keyed hash
 * keeps its own: invariant 8; a new one is chain(parent, its tokens); a salted block or
 * its child is the unkeyed key of its hash: invariant 6), is mapped, then counted in `present` (engine `index` into its mask in
 * `holders` when new, unless unkeyed), and confirms a speculative entry if there is one
 * (its bit cleared in `speculating`). It takes no callback: every step is a dict, bytes
 * or int operation on the objects given. */
static PyObject *
stored_loop(PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 15) {
        PyErr_Format(PyExc_TypeError, "stored() takes 15 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *hashes = args[0], *retired = args[1], *present = args[2];
    PyObject *speculative = args[4], *speculating = args[5], *medium = args[6];
    PyObject *bit = args[7];
    HoldersObject *holders = expect_holders(args[3]);
    Py_ssize_t index = holders == NULL ? -1 : holders_index(args[8]);
    int refcounted = index < 0 ? -1 : PyObject_IsTrue(args[9]);
    PyObject *parent = args[10], *block_hashes = args[11], *tokens = args[12];
    Py_ssize_t width = PyLong_AsSsize_t(args[13]);
    PyObject *prefix = args[14];
    if (refcounted < 0 || (width == -1 && PyErr_Occurred())) {
        return NULL;
    }
    if (expect_dict(hashes, "hashes") || expect_dict(retired, "retired")
        || expect_dict(present, "present") || expect_dict(speculative, "speculative")
        || expect_dict(speculating, "speculating")) {
        return NULL;
    }
    if (!PyTuple_CheckExact(block_hashes) || !PyBytes_CheckExact(tokens)
        || !PyBytes_CheckExact(prefix) || !PyLong_Check(bit) || width < 0) {
        PyErr_SetString(PyExc_TypeError,
                        "block_hashes is a tuple, tokens and unkeyed_prefix bytes, bit an "
                        "int, width not negative");
        return NULL;
    }
    int unkeyed = starts_with(parent, prefix);
    if (unkeyed < 0) {
        return NULL;
    }
    PyObject *one = PyLong_FromLong(1);
    PyObject *result = NULL;
    Py_ssize_t remapped = 0;
    Py_INCREF(parent); /* owned from here on: each block's key becomes the next parent */
    if (one == NULL) {
        goto done;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(block_hashes);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *block_hash = PyTuple_GET_ITEM(block_hashes, i);
        PyObject *previous = PyDict_GetItemWithError(hashes, block_hash);
        if (previous == NULL && PyErr_Occurred()) {
            goto done;
        }
        Py_XINCREF(previous);
        int keyed_known = 0;
        if (previous != NULL && !unkeyed) {
            int salted = starts_with(previous, prefix);
            if (salted < 0) {
                Py_DECREF(previous);
                goto done;
            }
            keyed_known = !salted;
        }
        PyObject *key; /* owned */
        if (keyed_known) { /* a known hash names known content (invariant 8) */
            key = previous;
            if (set_newest(hashes, block_hash, key, 1) < 0) {
                Py_DECREF(key);
                goto done;
            }
        } else {
            int live = previous != NULL;
            if (previous == NULL) { /* held again: live (invariant 2) */
                previous = PyDict_GetItemWithError(retired, block_hash);
                if (previous == NULL && PyErr_Occurred()) {
                    goto done;
                }
                if (previous != NULL) {
                    Py_INCREF(previous);
                    if (PyDict_DelItem(retired, block_hash) < 0) {
                        Py_DECREF(previous);
                        goto done;
                    }
                }
            }
            if (previous == NULL) {
                if (unkeyed) { /* a salted block's child (invariant 6) */
                    key = unkeyed_key(prefix, block_hash);
                } else { /* parent: bytes (checked by starts_with or at the start) */
                    Py_ssize_t size = PyBytes_GET_SIZE(tokens);
                    Py_ssize_t start = i * width < size ? i * width : size;
                    Py_ssize_t stop = (i + 1) * width < size ? (i + 1) * width : size;
                    key = chain_key(PyBytes_AS_STRING(parent), PyBytes_GET_SIZE(parent),
                                    PyBytes_AS_STRING(tokens) + start, stop - start);
                }
            } else {
                int salted = unkeyed ? 1 : starts_with(previous, prefix);
                if (salted < 0) {
                    Py_DECREF(previous);
                    goto done;
                }
                if (salted) { /* a salted block or its child (invariant 6) */
                    key = unkeyed_key(prefix, block_hash);
                    int differs = key == NULL ? -1
                                              : PyObject_RichCompareBool(previous, key, Py_NE);
                    if (differs < 0) {
                        Py_XDECREF(key);
                        Py_DECREF(previous);
                        goto done;
                    }
                    remapped += differs;
                    unkeyed = 1;
                    Py_DECREF(previous);
                } else {
                    key = previous;
                }
            }
            if (key == NULL) {
                goto done;
            }
            if (set_newest(hashes, block_hash, key, live) < 0) {
                Py_DECREF(key);
                goto done;
            }
        }
        Py_SETREF(parent, key);
        PyObject *count = PyDict_GetItemWithError(present, parent);
        if (count == NULL) {
            if (PyErr_Occurred() || PyDict_SetItem(present, parent, one) < 0) {
                goto done;
            }
            if (!unkeyed) { /* a chain key (an unkeyed one is in no mask) */
                uint64_t buffer[KEY_WORDS];
                const uint64_t *chained = holders_key(parent, buffer);
                if (chained == NULL || holders_set(holders, chained, index) < 0) {
                    goto done;
                }
            }
        } else {
            /* a set's count stays 1 */
            PyObject *now = refcounted ? PyNumber_Add(count, one) : Py_NewRef(count);
            int rc = now == NULL ? -1 : set_newest(present, parent, now, 1);
            Py_XDECREF(now);
            if (rc < 0) {
                goto done;
            }
        }
        if (PyDict_GET_SIZE(speculative)) {
            PyObject *entry = PyTuple_Pack(2, medium, parent);
            if (entry == NULL) {
                goto done;
            }
            PyObject *expiry = PyDict_GetItemWithError(speculative, entry);
            int rc = 0;
            if (expiry != NULL) {
                rc = PyDict_DelItem(speculative, entry);
                if (rc == 0) {
                    rc = drop_bit(speculating, entry, bit);
                }
            } else if (PyErr_Occurred()) {
                rc = -1;
            }
            Py_DECREF(entry);
            if (rc < 0) {
                goto done;
            }
        }
    }
    result = Py_BuildValue("(nO)", remapped, unkeyed ? Py_True : Py_False);
done:
    Py_DECREF(parent);
    Py_XDECREF(one);
    return result;
}

/* --- Core: the index's state, owned, and its two per-block loops as methods ----------------
 *
 * Core(refcounted, max_retired, unkeyed_prefix) owns what PrefixIndex's engines hold: per
 * engine (by its bit position) the hash mappings, the retired ones, the blocks present per
 * medium and the speculative entries; per medium the Holders table; the fleet's
 * speculation masks. kvpeer.router.indexcore adds the methods written once in Python
 * (applying an event, speculating, the prefix walks, forgetting an engine) on top of this
 * type or of its Python reference, indexloops.Core; the two loops every block goes
 * through are this type's _stored and _removed. The containers are readable (the Python
 * methods work on them) but never replaced: each call below fetches an engine's containers
 * from the object and checks them before the loop trusts them. */

typedef struct {
    PyObject_HEAD
    PyObject *hashes;      /* list by engine: dict engine hash -> chain key */
    PyObject *retired;     /* list by engine: dict engine hash -> chain key, removed */
    PyObject *present;     /* list by engine: dict medium -> dict chain key -> count */
    PyObject *speculative; /* list by engine: dict (medium, key) -> expiry */
    PyObject *holders;     /* dict medium -> Holders */
    PyObject *speculating; /* dict (medium, key) -> bits of the engines speculating it */
    PyObject *refcounted;  /* frozenset of the media that count announcements */
    PyObject *prefix;      /* bytes: what every unkeyed key starts with */
    PyObject *max_retired; /* int */
} CoreObject;

static PyObject *
Core_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *refcounted, *max_retired, *prefix;
    static char *names[] = {"refcounted", "max_retired", "unkeyed_prefix", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!O!:Core", names, &PyFrozenSet_Type,
                                     &refcounted, &PyLong_Type, &max_retired, &PyBytes_Type,
                                     &prefix)) {
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(max_retired);
    if (limit == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (limit < 1 || PyBytes_GET_SIZE(prefix) == 0) {
        PyErr_Format(PyExc_ValueError, "Core needs max_retired >= 1 (not %zd) and a non-empty "
                     "unkeyed_prefix", limit);
        return NULL;
    }
    CoreObject *self = (CoreObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->hashes = PyList_New(0);
    self->retired = PyList_New(0);
    self->present = PyList_New(0);
    self->speculative = PyList_New(0);
    self->holders = PyDict_New();
    self->speculating = PyDict_New();
    self->refcounted = Py_NewRef(refcounted);
    self->prefix = Py_NewRef(prefix);
    self->max_retired = Py_NewRef(max_retired);
    if (self->hashes == NULL || self->retired == NULL || self->present == NULL
        || self->speculative == NULL || self->holders == NULL || self->speculating == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int
Core_traverse(CoreObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->hashes);
    Py_VISIT(self->retired);
    Py_VISIT(self->present);
    Py_VISIT(self->speculative);
    Py_VISIT(self->holders);
    Py_VISIT(self->speculating);
    return 0;
}

static int
Core_clear(CoreObject *self)
{
    Py_CLEAR(self->hashes);
    Py_CLEAR(self->retired);
    Py_CLEAR(self->present);
    Py_CLEAR(self->speculative);
    Py_CLEAR(self->holders);
    Py_CLEAR(self->speculating);
    Py_CLEAR(self->refcounted);
    Py_CLEAR(self->prefix);
    Py_CLEAR(self->max_retired);
    return 0;
}

static void
Core_dealloc(CoreObject *self)
{
    /* a Python subclass's reference to its type is subtype_dealloc's to drop */
    PyObject_GC_UnTrack(self);
    Core_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* `list[engine]`, checked to be an exact dict: a new reference, or NULL. */
static PyObject *
engine_dict(PyObject *list, Py_ssize_t engine, const char *name)
{
    if (list == NULL || !PyList_CheckExact(list) || engine >= PyList_GET_SIZE(list)) {
        PyErr_Format(PyExc_IndexError, "no engine %zd in the core's %s", engine, name);
        return NULL;
    }
    PyObject *dict = PyList_GET_ITEM(list, engine);
    if (expect_dict(dict, name) < 0) {
        return NULL;
    }
    return Py_NewRef(dict);
}

/* An engine's bit position from `obj`: its index in the core's lists, or -1. */
static Py_ssize_t
core_engine(PyObject *obj)
{
    if (!PyLong_CheckExact(obj)) {
        PyErr_Format(PyExc_TypeError, "an engine is its bit position, an int, not %.50s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    return holders_index(obj);
}

/* What both loops take of one engine and medium: new references in `out` (hashes,
 * retired, present, holders, speculative, present-by-medium, and the engine's mask bit
 * `with_bit`, else None), 0; or -1 with every reference released. A medium the engine never stored in is a KeyError. */
enum { C_HASHES, C_RETIRED, C_PRESENT, C_HOLDERS, C_SPECULATIVE, C_MEDIA, C_BIT, C_COUNT };

static int
core_containers(CoreObject *self, PyObject *engine_obj, PyObject *medium, PyObject **out,
                int with_bit)
{
    memset(out, 0, C_COUNT * sizeof(PyObject *));
    Py_ssize_t engine = core_engine(engine_obj);
    if (engine < 0) {
        return -1;
    }
    if (!PyUnicode_CheckExact(medium)) {
        PyErr_Format(PyExc_TypeError, "a medium is a str, not %.50s", Py_TYPE(medium)->tp_name);
        return -1;
    }
    out[C_HASHES] = engine_dict(self->hashes, engine, "hashes");
    out[C_RETIRED] = out[C_HASHES] == NULL ? NULL : engine_dict(self->retired, engine, "retired");
    out[C_SPECULATIVE] = out[C_RETIRED] == NULL
                             ? NULL : engine_dict(self->speculative, engine, "speculative");
    out[C_MEDIA] = out[C_SPECULATIVE] == NULL
                       ? NULL : engine_dict(self->present, engine, "present");
    if (out[C_MEDIA] != NULL) {
        out[C_PRESENT] = PyDict_GetItemWithError(out[C_MEDIA], medium);
        if (out[C_PRESENT] == NULL && !PyErr_Occurred()) {
            PyErr_SetObject(PyExc_KeyError, medium);
        }
        Py_XINCREF(out[C_PRESENT]);
    }
    if (out[C_PRESENT] != NULL) {
        out[C_HOLDERS] = PyDict_GetItemWithError(self->holders, medium);
        if (out[C_HOLDERS] == NULL && !PyErr_Occurred()) {
            PyErr_SetObject(PyExc_KeyError, medium);
        }
        Py_XINCREF(out[C_HOLDERS]);
    }
    if (out[C_HOLDERS] != NULL && with_bit) {
        PyObject *one = PyLong_FromLong(1);
        out[C_BIT] = one == NULL ? NULL : PyNumber_Lshift(one, engine_obj);
        Py_XDECREF(one);
    } else if (out[C_HOLDERS] != NULL) {
        out[C_BIT] = Py_NewRef(Py_None); /* the removal's loop needs no mask bit */
    }
    if (out[C_BIT] == NULL) {
        for (int i = 0; i < C_COUNT; i++) {
            Py_CLEAR(out[i]);
        }
        return -1;
    }
    return 0;
}

/* _stored(engine, medium, parent, block_hashes, tokens, width) -> (hash_remapped, unkeyed)
 *
 * One store by `engine` in `medium` (its blocks present there made before: a KeyError
 * otherwise) from the chain key `parent`: stored_loop above on the engine's containers. */
static PyObject *
Core_stored(CoreObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "_stored() takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *c[C_COUNT];
    if (core_containers(self, args[0], args[1], c, 1) < 0) {
        return NULL;
    }
    int refcounted = PySet_Contains(self->refcounted, args[1]);
    PyObject *result = NULL;
    if (refcounted >= 0) {
        PyObject *loop[15] = {
            c[C_HASHES], c[C_RETIRED], c[C_PRESENT], c[C_HOLDERS], c[C_SPECULATIVE],
            self->speculating, args[1], c[C_BIT], args[0], refcounted ? Py_True : Py_False,
            args[2], args[3], args[4], args[5], self->prefix,
        };
        result = stored_loop(loop, 15);
    }
    for (int i = 0; i < C_COUNT; i++) {
        Py_DECREF(c[i]);
    }
    return result;
}

/* What an engine holds in its media other than `medium` (an exact str): a new list of
 * `media`'s other values, or NULL. Media are compared as exact strs: no Python code runs. */
static PyObject *
other_media(PyObject *media, PyObject *medium)
{
    PyObject *others = PyList_New(0);
    Py_ssize_t pos = 0;
    PyObject *name, *held;
    while (others != NULL && PyDict_Next(media, &pos, &name, &held)) {
        if (!PyUnicode_CheckExact(name)) {
            PyErr_SetString(PyExc_TypeError, "the core's media are str");
            Py_CLEAR(others);
        } else if (PyUnicode_Compare(name, medium) != 0 && PyList_Append(others, held) < 0) {
            Py_CLEAR(others);
        }
    }
    return others;
}

/* _removed(engine, medium, block_hashes) -> blocks unknown
 *
 * `engine` removed `block_hashes` from `medium` (stored in before: a KeyError otherwise):
 * removed_loop above, with what the engine holds in its other media. */
static PyObject *
Core_removed(CoreObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "_removed() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *c[C_COUNT];
    if (core_containers(self, args[0], args[1], c, 0) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    PyObject *others = other_media(c[C_MEDIA], args[1]);
    int refcounted = others == NULL ? -1 : PySet_Contains(self->refcounted, args[1]);
    if (refcounted >= 0) {
        PyObject *loop[10] = {
            c[C_HASHES], c[C_RETIRED], c[C_PRESENT], c[C_HOLDERS], others, args[0],
            refcounted ? Py_True : Py_False, self->max_retired, args[2], self->prefix,
        };
        result = removed_loop(loop, 10);
    }
    Py_XDECREF(others);
    for (int i = 0; i < C_COUNT; i++) {
        Py_DECREF(c[i]);
    }
    return result;
}

static PyMethodDef Core_methods[] = {
    {"_stored", (PyCFunction)(void (*)(void))Core_stored, METH_FASTCALL,
     "One store's per-block loop; returns (hash_remapped, unkeyed)."},
    {"_removed", (PyCFunction)(void (*)(void))Core_removed, METH_FASTCALL,
     "One removal's per-block loop; returns the blocks unknown."},
    {NULL, NULL, 0, NULL},
};

/* The containers, read-only: new references to the core's own objects. */
static PyObject *
Core_get(CoreObject *self, void *closure)
{
    PyObject *value = *(PyObject **)((char *)self + (Py_ssize_t)closure);
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "the core was cleared");
        return NULL;
    }
    return Py_NewRef(value);
}

#define CORE_FIELD(name, doc) \
    {"_" #name, (getter)Core_get, NULL, doc, (void *)offsetof(CoreObject, name)}

static PyGetSetDef Core_getset[] = {
    CORE_FIELD(hashes, "By engine: engine hash -> chain key."),
    CORE_FIELD(retired, "By engine: mappings of blocks removed from every medium."),
    CORE_FIELD(present, "By engine: medium -> chain key -> count."),
    CORE_FIELD(speculative, "By engine: (medium, chain key) -> expiry."),
    CORE_FIELD(holders, "Medium -> Holders."),
    CORE_FIELD(speculating, "(medium, chain key) -> bits of the engines speculating it."),
    CORE_FIELD(refcounted, "The media that count announcements."),
    CORE_FIELD(prefix, "What every unkeyed key starts with."),
    CORE_FIELD(max_retired, "Retired mappings kept per engine."),
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvpeer.router._intake.Core",
    .tp_doc = "The index's state and its per-block loops (see kvpeer.router.indexcore).",
    .tp_basicsize = sizeof(CoreObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = Core_new,
    .tp_traverse = (traverseproc)Core_traverse,
    .tp_clear = (inquiry)Core_clear,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
};

/* --- Fields of the decoder's wire events -------------------------------------------------
 *
 * msgspec keeps a Struct's fields in slots, read through member descriptors. attr() finds
 * a field's descriptor once per class (remembered per field for the last two classes asked,
 * each held, with its descriptor) and, for a class with the generic attribute lookup and a
 * data descriptor for the field, calls the descriptor's tp_descr_get itself: what
 * PyObject_GenericGetAttr would end up calling, without its lookup through the class's MRO
 * on every read, and through the public type slots only (no object layout read here).
 * Anything else goes through PyObject_GetAttr. At 432,000 wire events
 * a second, the getattr machinery was most of the translation's time. */

enum {
    F_BLOCK_HASHES, F_PARENT_BLOCK_HASH, F_TOKEN_IDS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM,
    F_LORA_NAME, F_EXTRA_KEYS, F_GROUP_IDX, F_OWNERSHIP, F_KIND, F_COUNT
};
static PyObject *field_names[F_COUNT]; /* interned at module exec */
static const char *const field_strings[F_COUNT] = {
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
    "medium", "lora_name", "extra_keys", "group_idx", "ownership", "kv_cache_spec_kind",
};

static struct {
    PyTypeObject *type; /* a strong reference, or NULL */
    PyObject *descr;    /* a strong reference to the field's data descriptor; NULL: getattr */
} field_cache[F_COUNT][2];

/* The data descriptor to read `field` of instances of `type` with (borrowed from the
 * cache), or NULL: ask PyObject_GetAttr. */
static PyObject *
field_descr(PyTypeObject *type, int field)
{
    for (int way = 0; way < 2; way++) {
        if (field_cache[field][way].type == type) {
            return field_cache[field][way].descr;
        }
    }
    PyObject *descr = NULL;
    if (type->tp_getattro == PyObject_GenericGetAttr) {
        /* on a class, a field's member descriptor is itself */
        PyObject *found = PyObject_GetAttr((PyObject *)type, field_names[field]);
        if (found == NULL) {
            PyErr_Clear();
        } else if (Py_TYPE(found)->tp_descr_get != NULL
                   && Py_TYPE(found)->tp_descr_set != NULL) {
            descr = found; /* a data descriptor: GenericGetAttr would call it first */
        } else {
            Py_DECREF(found);
        }
    } /* else: a class with its own attribute lookup is asked every time */
    /* the newer way first; the older one's class and descriptor let go */
    Py_XSETREF(field_cache[field][1].type, field_cache[field][0].type);
    Py_XSETREF(field_cache[field][1].descr, field_cache[field][0].descr);
    field_cache[field][0].type = (PyTypeObject *)Py_NewRef((PyObject *)type);
    field_cache[field][0].descr = descr;
    return descr;
}

/* item.<field>, a new reference, or NULL with an exception. */
static PyObject *
attr(PyObject *item, int field)
{
    PyObject *descr = field_descr(Py_TYPE(item), field);
    if (descr == NULL) {
        return PyObject_GetAttr(item, field_names[field]);
    }
    Py_INCREF(descr); /* held through the call, which could change the cache */
    PyObject *value = Py_TYPE(descr)->tp_descr_get(descr, item, (PyObject *)Py_TYPE(item));
    Py_DECREF(descr);
    return value;
}


/* run[i].name as a new reference, or NULL with an exception. */
static PyObject *
field(PyObject *run, Py_ssize_t i, int name)
{
    return attr(PyList_GET_ITEM(run, i), name);
}

/* list.extend(items): 0, or -1 with an exception. */
static int
append_all(PyObject *list, PyObject *items)
{
    return PyList_SetSlice(list, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, items);
}

/* Appends (head, tuple(hashes), tokens[at[0]] + ... + tokens[at[n-1]]) to out: 0, or -1
 * with an exception. */
static int
close_chain(PyObject *out, PyObject *head, PyObject *hashes, PyObject *tokens,
            const Py_ssize_t *at, Py_ssize_t n)
{
    Py_ssize_t size = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        size += PyBytes_GET_SIZE(PyList_GET_ITEM(tokens, at[k]));
    }
    PyObject *joined = PyBytes_FromStringAndSize(NULL, size);
    if (joined != NULL) {
        char *to = PyBytes_AS_STRING(joined);
        for (Py_ssize_t k = 0; k < n; k++) {
            PyObject *part = PyList_GET_ITEM(tokens, at[k]);
            memcpy(to, PyBytes_AS_STRING(part), (size_t)PyBytes_GET_SIZE(part));
            to += PyBytes_GET_SIZE(part);
        }
    }
    PyObject *h = joined == NULL ? NULL : PyList_AsTuple(hashes);
    PyObject *chain = h == NULL ? NULL : PyTuple_Pack(3, head, h, joined);
    int rc = chain == NULL ? -1 : PyList_Append(out, chain);
    Py_XDECREF(chain);
    Py_XDECREF(h);
    Py_XDECREF(joined);
    return rc;
}

/* The order of events.py's _topological: each store after the store of its parent
 * block (the last store naming a hash owns it), a hostile cycle cut where it closes.
 * Fills order[0..n): 0, or -1 with an exception. */
static int
parents_first(PyObject *run, Py_ssize_t n, Py_ssize_t *order)
{
    PyObject *owner = PyDict_New();
    char *placed = PyMem_Calloc((size_t)n, 1);
    Py_ssize_t *chain = PyMem_Malloc((size_t)n * sizeof(Py_ssize_t));
    int rc = owner == NULL || placed == NULL || chain == NULL ? -1 : 0;
    if (rc < 0 && !PyErr_Occurred()) {
        PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        PyObject *hashes = field(run, i, F_BLOCK_HASHES);
        PyObject *at = hashes == NULL ? NULL : PyLong_FromSsize_t(i);
        PyObject *seq = at == NULL ? NULL : PySequence_Fast(hashes, "block_hashes is a list");
        rc = seq == NULL ? -1 : 0;
        for (Py_ssize_t j = 0; rc == 0 && j < PySequence_Fast_GET_SIZE(seq); j++) {
            rc = PyDict_SetItem(owner, PySequence_Fast_GET_ITEM(seq, j), at);
        }
        Py_XDECREF(seq);
        Py_XDECREF(at);
        Py_XDECREF(hashes);
    }
    Py_ssize_t placed_n = 0;
    for (Py_ssize_t first = 0; first < n && rc == 0; first++) {
        Py_ssize_t length = 0, i = first;
        while (i >= 0 && !placed[i]) {
            placed[i] = 1; /* marked on the way up: a hostile cycle ends here */
            chain[length++] = i;
            PyObject *parent = field(run, i, F_PARENT_BLOCK_HASH);
            if (parent == NULL) {
                rc = -1;
                break;
            }
            PyObject *at = parent == Py_None ? NULL : PyDict_GetItemWithError(owner, parent);
            Py_DECREF(parent);
            if (at == NULL && PyErr_Occurred()) {
                rc = -1;
                break;
            }
            i = at == NULL ? -1 : PyLong_AsSsize_t(at);
            if (i == -1 && PyErr_Occurred()) {
                rc = -1;
            }
        }
        while (rc == 0 && length > 0) {
            order[placed_n++] = chain[--length];
        }
    }
    Py_XDECREF(owner);
    PyMem_Free(placed);
    PyMem_Free(chain);
    return rc;
}

/* stores_of(run, tokens) -> [(head, hashes, tokens), ...]
 *
 * events.py's _stores_of, up to building the router's events: a run of valid wire
 * stores (a list of at least one; tokens[i] the packed tokens of run[i], bytes) ordered
 * parents first, and each store that continues the one before it (same medium and block
 * size, its parent that store's last block) joined into it. Each chain is its first
 * store, the chain's hashes (a tuple) and its packed tokens (bytes). */
static PyObject *
intake_stores_of(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "stores_of() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *run = args[0], *tokens = args[1];
    if (!PyList_CheckExact(run) || PyList_GET_SIZE(run) == 0 || !PyList_CheckExact(tokens)
        || PyList_GET_SIZE(tokens) != PyList_GET_SIZE(run)) {
        PyErr_SetString(PyExc_TypeError,
                        "stores_of() takes a non-empty list and a list as long of bytes");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(run);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_CheckExact(PyList_GET_ITEM(tokens, i))) {
            PyErr_SetString(PyExc_TypeError, "each store's tokens are bytes");
            return NULL;
        }
    }
    /* order[0..n): the run parents first; chain[0..length): the positions joined so far */
    Py_ssize_t *order = PyMem_Malloc(2 * (size_t)n * sizeof(Py_ssize_t));
    if (order == NULL) {
        return PyErr_NoMemory();
    }
    Py_ssize_t *chain = order + n, length = 0;
    int rc = 0;
    if (n > 1) {
        rc = parents_first(run, n, order);
    } else {
        order[0] = 0;
    }
    PyObject *out = rc < 0 ? NULL : PyList_New(0);
    PyObject *head = NULL, *hashes = NULL;
    PyObject *medium = NULL, *size = NULL;
    for (Py_ssize_t k = 0; out != NULL && k < n; k++) {
        PyObject *item = PyList_GET_ITEM(run, order[k]);
        if (head != NULL) {
            PyObject *parent = attr(item, F_PARENT_BLOCK_HASH);
            PyObject *item_medium = NULL, *item_size = NULL;
            int joins = parent == NULL ? -1 : 0;
            if (joins == 0 && parent != Py_None && PyList_GET_SIZE(hashes) > 0) {
                joins = PyObject_RichCompareBool(
                    parent, PyList_GET_ITEM(hashes, PyList_GET_SIZE(hashes) - 1), Py_EQ);
            }
            if (joins > 0) {
                item_medium = attr(item, F_MEDIUM);
                joins = item_medium == NULL ? -1
                                            : PyObject_RichCompareBool(item_medium, medium, Py_EQ);
            }
            if (joins > 0) {
                item_size = attr(item, F_BLOCK_SIZE);
                joins = item_size == NULL ? -1
                                          : PyObject_RichCompareBool(item_size, size, Py_EQ);
            }
            Py_XDECREF(item_size);
            Py_XDECREF(item_medium);
            Py_XDECREF(parent);
            if (joins > 0) {
                PyObject *more = attr(item, F_BLOCK_HASHES);
                if (more == NULL || append_all(hashes, more) < 0) {
                    Py_CLEAR(out);
                }
                Py_XDECREF(more);
                chain[length++] = order[k];
                continue;
            }
            if (joins < 0 || close_chain(out, head, hashes, tokens, chain, length) < 0) {
                Py_CLEAR(out);
                continue;
            }
        }
        Py_XSETREF(head, Py_NewRef(item));
        chain[0] = order[k];
        length = 1;
        PyObject *h = attr(item, F_BLOCK_HASHES);
        Py_XSETREF(hashes, h == NULL ? NULL : PySequence_List(h));
        Py_XDECREF(h);
        Py_XSETREF(medium, attr(item, F_MEDIUM));
        Py_XSETREF(size, attr(item, F_BLOCK_SIZE));
        if (hashes == NULL || medium == NULL || size == NULL) {
            Py_CLEAR(out);
        }
    }
    if (out != NULL && close_chain(out, head, hashes, tokens, chain, length) < 0) {
        Py_CLEAR(out);
    }
    Py_XDECREF(head);
    Py_XDECREF(hashes);
    Py_XDECREF(medium);
    Py_XDECREF(size);
    PyMem_Free(order);
    return out;
}

/* --- A batch's wire events into the router's events (events.py's decode_batch loop) --- */

static PyObject *str_GPU, *str_other_group, *str_secondary_tier, *str_lora,
    *str_extra_keys_reason, *str_placeholder, *str_invalid_schema, *str_empty_store,
    *str_token_count_mismatch, *str_mamba, *str_state_checkpoint;

/* events.py's classes, as the caller passes them (checked to be types). */
typedef struct {
    PyObject *wire_stored, *wire_removed, *wire_cleared;
    PyObject *blocks_stored, *blocks_removed, *all_cleared, *blocks_unkeyable;
} Classes;

/* skipped[reason] += 1: 0, or -1. */
static int
bump(PyObject *skipped, PyObject *reason)
{
    PyObject *count = PyDict_GetItemWithError(skipped, reason);
    if (count == NULL && PyErr_Occurred()) {
        return -1;
    }
    PyObject *more = PyLong_FromSsize_t(count == NULL ? 1 : PyLong_AsSsize_t(count) + 1);
    int rc = more == NULL ? -1 : PyDict_SetItem(skipped, reason, more);
    Py_XDECREF(more);
    return rc;
}

/* out.append(cls(*args)): 0, or -1. */
static int
append_new(PyObject *out, PyObject *cls, PyObject *const *args, Py_ssize_t n)
{
    PyObject *event = PyObject_Vectorcall(cls, args, (size_t)n, NULL);
    int rc = event == NULL ? -1 : PyList_Append(out, event);
    Py_XDECREF(event);
    return rc;
}

/* `medium or "GPU"` of a wire event, a new reference. */
static PyObject *
medium_of(PyObject *item)
{
    PyObject *medium = attr(item, F_MEDIUM);
    if (medium != NULL && !PyObject_IsTrue(medium)) {
        Py_SETREF(medium, Py_NewRef(str_GPU));
    }
    return medium;
}

/* The removals gathered so far as one BlocksRemoved; the list emptied. 0, or -1. */
static int
flush_removed(PyObject *out, const Classes *c, PyObject *removed, PyObject *medium)
{
    if (PyList_GET_SIZE(removed) == 0) {
        return 0;
    }
    PyObject *hashes = PyList_AsTuple(removed);
    PyObject *args[2] = {medium, hashes};
    int rc = hashes == NULL ? -1 : append_new(out, c->blocks_removed, args, 2);
    Py_XDECREF(hashes);
    return rc == 0 ? PyList_SetSlice(removed, 0, PyList_GET_SIZE(removed), NULL) : -1;
}

static PyObject *intake_stores_of(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* The run of valid stores gathered so far as BlocksStored chains; the lists emptied. */
static int
flush_run(PyObject *out, const Classes *c, PyObject *run, PyObject *tokens)
{
    if (PyList_GET_SIZE(run) == 0) {
        return 0;
    }
    PyObject *lists[2] = {run, tokens};
    PyObject *chains = intake_stores_of(NULL, lists, 2);
    int rc = chains == NULL ? -1 : 0;
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(chains); i++) {
        PyObject *chain = PyList_GET_ITEM(chains, i); /* (head, hashes, tokens) */
        PyObject *head = PyTuple_GET_ITEM(chain, 0);
        PyObject *medium = medium_of(head);
        PyObject *parent = medium == NULL ? NULL : attr(head, F_PARENT_BLOCK_HASH);
        PyObject *size = parent == NULL ? NULL : attr(head, F_BLOCK_SIZE);
        PyObject *args[5] = {medium, PyTuple_GET_ITEM(chain, 1), parent,
                             PyTuple_GET_ITEM(chain, 2), size};
        rc = size == NULL ? -1 : append_new(out, c->blocks_stored, args, 5);
        Py_XDECREF(size);
        Py_XDECREF(parent);
        Py_XDECREF(medium);
    }
    Py_XDECREF(chains);
    if (rc == 0) {
        rc = PyList_SetSlice(run, 0, PyList_GET_SIZE(run), NULL);
    }
    return rc == 0 ? PyList_SetSlice(tokens, 0, PyList_GET_SIZE(tokens), NULL) : -1;
}

/* A C long attribute that msgspec checked to be an int or None (None: `none`). */
static int
small_int(PyObject *item, int name, long none, long *value)
{
    PyObject *obj = attr(item, name);
    if (obj == NULL) {
        return -1;
    }
    *value = obj == Py_None ? none : PyLong_AsLong(obj);
    Py_DECREF(obj);
    return *value == -1 && PyErr_Occurred() ? -1 : 0;
}

/* Whether attribute `name` is not None: 1, 0, or -1. */
static int
not_none(PyObject *item, int name)
{
    PyObject *obj = attr(item, name);
    if (obj == NULL) {
        return -1;
    }
    int rc = obj != Py_None;
    Py_DECREF(obj);
    return rc;
}

/* group_idx and ownership: the reason to skip the event, NULL (borrowed) when there is none. */
static int
skip_reason(PyObject *item, PyObject **reason)
{
    long group;
    int owned = small_int(item, F_GROUP_IDX, 0, &group) < 0 ? -1 : not_none(item, F_OWNERSHIP);
    if (owned < 0) {
        return -1;
    }
    *reason = group != 0 ? str_other_group : owned ? str_secondary_tier : NULL;
    return 0;
}

/* Whether the store is a recurrent (Mamba) group's (events.py's RECURRENT_KINDS): 1, 0, -1. */
static int
recurrent(PyObject *item)
{
    PyObject *kind = attr(item, F_KIND);
    if (kind == NULL) {
        return -1;
    }
    /* two str: the comparison cannot fail */
    int rc = PyUnicode_Check(kind) && PyUnicode_Compare(kind, str_mamba) == 0;
    Py_DECREF(kind);
    return rc;
}

enum { STORE_VALID, STORE_SKIP, STORE_REJECT };

/* events.py's _store_check: STORE_VALID with *packed (new), STORE_SKIP with *reason
 * (borrowed), STORE_REJECT with *reason (borrowed) and *detail (new), or -1. */
static int
store_check(PyObject *item, Py_ssize_t max_tokens, PyObject **packed, PyObject **reason,
            PyObject **detail)
{
    PyObject *raw = attr(item, F_TOKEN_IDS);
    PyObject *tokens = raw == NULL ? NULL : pack_msgpack_tokens(raw, max_tokens);
    Py_XDECREF(raw);
    if (tokens == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError)) {
            return -1;
        }
        PyObject *type, *value, *trace;
        PyErr_Fetch(&type, &value, &trace);
        *reason = str_invalid_schema;
        *detail = PyUnicode_FromFormat("token_ids: %.150S", value);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(trace);
        return *detail == NULL ? -1 : STORE_REJECT;
    }
    long size;
    PyObject *hashes = small_int(item, F_BLOCK_SIZE, 0, &size) < 0
                           ? NULL
                           : attr(item, F_BLOCK_HASHES);
    int rc = hashes == NULL ? -1 : STORE_VALID;
    Py_ssize_t blocks = hashes == NULL ? 0 : PyObject_Length(hashes);
    Py_XDECREF(hashes);
    Py_ssize_t count = PyBytes_GET_SIZE(tokens) / 4;
    int state = rc < 0 ? 0 : recurrent(item);
    if (rc < 0 || blocks < 0 || state < 0) {
        rc = -1;
    } else if (count == 0 && size == 0) {
        *reason = str_placeholder; /* checked first: placeholders are not malformed */
        rc = STORE_SKIP;
    } else if (blocks == 0) {
        *reason = str_empty_store;
        *detail = PyUnicode_FromString("no block hashes");
        rc = *detail == NULL ? -1 : STORE_REJECT;
    } else if (state) { /* by group: a state, whatever its tokens */
        *reason = str_state_checkpoint;
        rc = STORE_SKIP;
    } else if (size == 0 || count != blocks * size) {
        *reason = str_token_count_mismatch;
        *detail = PyUnicode_FromFormat("%zd tokens, %zd blocks of %ld", count, blocks, size);
        rc = *detail == NULL ? -1 : STORE_REJECT;
    } else if (skip_reason(item, reason) < 0) {
        rc = -1;
    } else if (*reason != NULL) {
        rc = STORE_SKIP;
    } else {
        int lora = not_none(item, F_LORA_NAME);
        if (lora == 0) {
            lora = not_none(item, F_LORA_ID);
        }
        PyObject *extra = lora == 0 ? attr(item, F_EXTRA_KEYS) : NULL;
        int salted = 0;
        if (lora < 0 || (lora == 0 && extra == NULL)) {
            rc = -1;
        } else if (lora) {
            *reason = str_lora;
            rc = STORE_SKIP;
        } else if (extra != Py_None) {
            PyObject *seq = PySequence_Fast(extra, "extra_keys is a list");
            for (Py_ssize_t i = 0; seq != NULL && i < PySequence_Fast_GET_SIZE(seq); i++) {
                salted |= PySequence_Fast_GET_ITEM(seq, i) != Py_None;
            }
            rc = seq == NULL ? -1 : salted ? STORE_SKIP : STORE_VALID;
            *reason = salted ? str_extra_keys_reason : NULL;
            Py_XDECREF(seq);
        }
        Py_XDECREF(extra);
    }
    if (rc == STORE_VALID) {
        *packed = tokens;
    } else {
        Py_DECREF(tokens);
    }
    return rc;
}

/* translate(events, classes, max_tokens) -> (events, skipped, rejected)
 *
 * events.py's decode_batch after msgspec: the wire events (events.py's wire classes,
 * exactly) into the router's -- consecutive removals of one medium joined, each run of
 * valid stores ordered and joined (stores_of), unkeyable blocks first -- with the
 * skipped events counted by reason, or rejected = (reason, detail) for the first
 * malformed event (then events and skipped are empty). classes = (wire stored, wire
 * removed, wire cleared, BlocksStored, BlocksRemoved, AllCleared, BlocksUnkeyable). */
static PyObject *
intake_translate(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3 || !PyList_CheckExact(args[0]) || !PyTuple_CheckExact(args[1])
        || PyTuple_GET_SIZE(args[1]) != 7) {
        PyErr_SetString(PyExc_TypeError, "translate() takes a list, 7 classes and a limit");
        return NULL;
    }
    Py_ssize_t max_tokens = PyLong_AsSsize_t(args[2]);
    if (max_tokens == -1 && PyErr_Occurred()) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < 7; i++) {
        if (!PyType_Check(PyTuple_GET_ITEM(args[1], i))) {
            PyErr_SetString(PyExc_TypeError, "translate() takes 7 classes");
            return NULL;
        }
    }
    PyObject *const *k = &PyTuple_GET_ITEM(args[1], 0);
    Classes c = {k[0], k[1], k[2], k[3], k[4], k[5], k[6]};
    PyObject *events = args[0];
    PyObject *out = PyList_New(0), *unkeyable = PyList_New(0), *skipped = PyDict_New();
    PyObject *removed = PyList_New(0), *run = PyList_New(0), *run_tokens = PyList_New(0);
    PyObject *removed_medium = Py_NewRef(str_GPU), *result = NULL, *rejected = NULL;
    if (out == NULL || unkeyable == NULL || skipped == NULL || removed == NULL || run == NULL
        || run_tokens == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
        PyObject *item = PyList_GET_ITEM(events, i);
        PyTypeObject *type = Py_TYPE(item);
        if ((PyObject *)type == c.wire_removed) {
            PyObject *reason;
            if (skip_reason(item, &reason) < 0) {
                goto done;
            }
            if (reason != NULL) {
                if (bump(skipped, reason) < 0) {
                    goto done;
                }
                continue;
            }
            PyObject *hashes = attr(item, F_BLOCK_HASHES);
            Py_ssize_t n = hashes == NULL ? -1 : PyObject_Length(hashes);
            int rc = n < 0 ? -1 : 0;
            if (n > 0) {
                PyObject *medium = medium_of(item);
                rc = medium == NULL ? -1 : flush_run(out, &c, run, run_tokens);
                if (rc == 0 && PyList_GET_SIZE(removed) > 0) {
                    int same = PyObject_RichCompareBool(medium, removed_medium, Py_EQ);
                    rc = same < 0 ? -1 : same ? 0 : flush_removed(out, &c, removed, removed_medium);
                }
                if (medium != NULL) {
                    Py_SETREF(removed_medium, medium);
                }
                if (rc == 0) {
                    rc = append_all(removed, hashes);
                }
            }
            Py_XDECREF(hashes);
            if (rc < 0) {
                goto done;
            }
            continue;
        }
        if (flush_removed(out, &c, removed, removed_medium) < 0) {
            goto done;
        }
        if ((PyObject *)type == c.wire_cleared) {
            if (flush_run(out, &c, run, run_tokens) < 0
                || append_new(out, c.all_cleared, NULL, 0) < 0) {
                goto done;
            }
            continue;
        }
        if ((PyObject *)type != c.wire_stored) {
            PyErr_Format(PyExc_TypeError, "event %zd is a %.50s", i, type->tp_name);
            goto done;
        }
        PyObject *packed = NULL, *reason = NULL, *detail = NULL;
        int outcome = store_check(item, max_tokens, &packed, &reason, &detail);
        if (outcome == STORE_VALID) {
            int rc = PyList_Append(run, item);
            rc = rc < 0 ? rc : PyList_Append(run_tokens, packed);
            Py_DECREF(packed);
            if (rc < 0) {
                goto done;
            }
        } else if (outcome == STORE_REJECT) {
            PyObject *said = PyUnicode_FromFormat("event %zd: %U", i, detail);
            Py_DECREF(detail);
            rejected = said == NULL ? NULL : PyTuple_Pack(2, reason, said);
            Py_XDECREF(said);
            if (rejected == NULL) {
                goto done;
            }
            PyObject *none_out = PyList_New(0), *none_skipped = PyDict_New();
            if (none_out != NULL && none_skipped != NULL) {
                result = PyTuple_Pack(3, none_out, none_skipped, rejected);
            }
            Py_XDECREF(none_out);
            Py_XDECREF(none_skipped);
            goto done;
        } else if (outcome == STORE_SKIP) {
            if (bump(skipped, reason) < 0) {
                goto done;
            }
            if (reason == str_lora || reason == str_extra_keys_reason) {
                PyObject *hashes = attr(item, F_BLOCK_HASHES);
                PyObject *tuple = hashes == NULL ? NULL : PySequence_Tuple(hashes);
                PyObject *medium = tuple == NULL ? NULL : medium_of(item);
                PyObject *named[2] = {tuple, medium};
                int rc = medium == NULL ? -1 : append_new(unkeyable, c.blocks_unkeyable, named, 2);
                Py_XDECREF(medium);
                Py_XDECREF(tuple);
                Py_XDECREF(hashes);
                if (rc < 0) {
                    goto done;
                }
            }
        } else {
            goto done;
        }
    }
    if (flush_removed(out, &c, removed, removed_medium) < 0
        || flush_run(out, &c, run, run_tokens) < 0) {
        goto done;
    }
    /* unkeyable blocks first: a step's CPU-tier store of one may come before the store
     * that says it is salted */
    if (PyList_SetSlice(unkeyable, PyList_GET_SIZE(unkeyable), PyList_GET_SIZE(unkeyable), out)
        == 0) {
        result = PyTuple_Pack(3, unkeyable, skipped, Py_None);
    }
done:
    Py_XDECREF(out);
    Py_XDECREF(unkeyable);
    Py_XDECREF(skipped);
    Py_XDECREF(removed);
    Py_XDECREF(run);
    Py_XDECREF(run_tokens);
    Py_XDECREF(removed_medium);
    Py_XDECREF(rejected);
    return result;
}

static PyMethodDef intake_methods[] = {
    {"stores_of", (PyCFunction)(void (*)(void))intake_stores_of, METH_FASTCALL,
     "events.py's _stores_of up to the events: [(head, hashes, tokens), ...]."},
    {"chain", (PyCFunction)(void (*)(void))intake_chain, METH_FASTCALL,
     "chain(parent, tokens): sha256(parent + tokens).digest()[:16]."},
    {"chain_keys", (PyCFunction)(void (*)(void))intake_chain_keys, METH_FASTCALL,
     "chain_keys(parent, tokens, width): the chain key of each width bytes of tokens."},
    {"translate", (PyCFunction)(void (*)(void))intake_translate, METH_FASTCALL,
     "events.py's decode_batch after msgspec: (events, skipped, rejected)."},
    {"msgpack_tokens", (PyCFunction)(void (*)(void))intake_msgpack_tokens, METH_FASTCALL,
     "A store's token ids (their msgpack) packed as array('I') packs them."},
    {NULL, NULL, 0, NULL},
};

static int
intake_exec(PyObject *module)
{
    if (int_from_bytes == NULL) { /* once per process, like the strings below */
        int_from_bytes = PyObject_GetAttrString((PyObject *)&PyLong_Type, "from_bytes");
        str_little = PyUnicode_InternFromString("little");
        if (int_from_bytes == NULL || str_little == NULL) {
            Py_CLEAR(int_from_bytes);
            return -1;
        }
    }
    if (chain_ctx == NULL) {
        chain_md = EVP_MD_fetch(NULL, "SHA256", NULL);
        chain_ctx = chain_md == NULL ? NULL : EVP_MD_CTX_new();
        if (chain_ctx == NULL) {
            EVP_MD_free(chain_md);
            chain_md = NULL;
            PyErr_SetString(PyExc_ImportError, "OpenSSL's libcrypto has no SHA-256");
            return -1;
        }
    }
    if (PyType_Ready(&HoldersType) < 0 || PyType_Ready(&CoreType) < 0
        || PyModule_AddObjectRef(module, "Holders", (PyObject *)&HoldersType) < 0
        || PyModule_AddObjectRef(module, "Core", (PyObject *)&CoreType) < 0) {
        return -1;
    }
    if (str_GPU != NULL) {
        return 0; /* interned once per process */
    }
    for (int f = 0; f < F_COUNT; f++) {
        if ((field_names[f] = PyUnicode_InternFromString(field_strings[f])) == NULL) {
            return -1;
        }
    }
    struct {
        PyObject **at;
        const char *text;
    } const reasons[] = {
        {&str_other_group, "other_group"}, {&str_secondary_tier, "secondary_tier"},
        {&str_lora, "lora"}, {&str_extra_keys_reason, "extra_keys"},
        {&str_placeholder, "placeholder"}, {&str_invalid_schema, "invalid_schema"},
        {&str_empty_store, "empty_store"}, {&str_token_count_mismatch, "token_count_mismatch"},
        {&str_mamba, "mamba"}, {&str_state_checkpoint, "state_checkpoint"},
    };
    for (size_t r = 0; r < sizeof(reasons) / sizeof(reasons[0]); r++) {
        if ((*reasons[r].at = PyUnicode_InternFromString(reasons[r].text)) == NULL) {
            return -1;
        }
    }
    str_GPU = PyUnicode_InternFromString("GPU"); /* last: the sign that all are there */
    return str_GPU == NULL ? -1 : 0;
}

static PyModuleDef_Slot intake_slots[] = {
    {Py_mod_exec, intake_exec},
    {0, NULL},
};

static struct PyModuleDef intake_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvpeer.router._intake",
    .m_doc = "The router's per-block event intake in C (see index.py).",
    .m_size = 0,
    .m_methods = intake_methods,
    .m_slots = intake_slots,
};

PyMODINIT_FUNC
PyInit__intake(void)
{
    return PyModuleDef_Init(&intake_module);
}
