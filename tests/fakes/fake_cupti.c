/* A fake libcupti with the activity-buffer calls the agent's raw path makes through ctypes
 * (tests/unit/test_cupti_raw_ctypes.py). cuptiActivityFlushAll requests a buffer, copies the staged
 * bytes into it, and hands it back from ANOTHER thread (as CUPTI's worker thread does) while the
 * caller waits in C. cuptiActivityGetNextRecord walks records by a size table, 8-byte aligned
 * (one size per kind: fake_cupti_stage sets one, fake_cupti_set_size the others). */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef void (*req_fn)(uint8_t **buffer, size_t *size, size_t *max_records);
typedef void (*done_fn)(void *ctx, uint32_t stream_id, uint8_t *buffer, size_t size, size_t valid);

static req_fn g_req;
static done_fn g_done;
static uint8_t g_stage[1 << 20];   /* a whole 1 MiB CUPTI buffer */
static size_t g_staged;
static size_t g_sizes[64];
static int g_registrations;

int cuptiActivityRegisterCallbacks(req_fn req, done_fn done) {
    g_req = req;
    g_done = done;
    g_registrations++;
    return 0;
}

int fake_cupti_registrations(void) { return g_registrations; }

void fake_cupti_stage(const uint8_t *data, size_t n, uint32_t kind, size_t record_size) {
    if (n > sizeof g_stage) n = sizeof g_stage;
    memcpy(g_stage, data, n);
    g_staged = n;
    if (kind < 64) g_sizes[kind] = record_size;
}

/* the record size of one more kind, so a staged buffer may mix kernels, copies and memsets */
void fake_cupti_set_size(uint32_t kind, size_t record_size) {
    if (kind < 64) g_sizes[kind] = record_size;
}

struct job { uint8_t *buf; size_t size; size_t valid; };

static void *worker(void *arg) {
    struct job *j = arg;
    g_done(NULL, 7, j->buf, j->size, j->valid);
    return NULL;
}

int cuptiActivityFlushAll(uint32_t flag) {
    (void)flag;
    if (!g_req || !g_done || !g_staged) return 0;
    uint8_t *buf = NULL;
    size_t size = 0, maxr = 0;
    g_req(&buf, &size, &maxr);
    if (!buf || size < g_staged) return 1;
    memcpy(buf, g_stage, g_staged);
    struct job j = {buf, size, g_staged};
    g_staged = 0;
    pthread_t t;
    if (pthread_create(&t, NULL, worker, &j)) return 2;
    pthread_join(t, NULL);
    return 0;
}

int cuptiActivityGetNextRecord(uint8_t *buffer, size_t valid, void **record) {
    size_t off = 0;
    if (*record) {
        uint8_t *r = *record;
        uint32_t kind;
        memcpy(&kind, r, 4);
        size_t sz = kind < 64 ? g_sizes[kind] : 0;
        if (!sz) return 12;
        off = (size_t)(r - buffer) + sz;
        off = (off + 7) & ~(size_t)7;
    }
    if (off + 4 > valid) return 12;  /* CUPTI_ERROR_MAX_LIMIT_REACHED */
    *record = buffer + off;
    return 0;
}
