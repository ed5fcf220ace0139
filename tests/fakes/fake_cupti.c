/* A fake libcupti with the activity-buffer calls the agent's raw path makes through ctypes
 * (tests/unit/test_cupti_raw_ctypes.py). cuptiActivityFlushAll requests a buffer, copies the staged
 * bytes into it, and hands it back from ANOTHER thread (as CUPTI's worker thread does) while the
 * caller waits in C. cuptiActivityGetNextRecord walks records by a size table, 8-byte aligned
 * (one size per kind: fake_cupti_stage sets one, fake_cupti_set_size the others).
 *
 * The callback API of the agent's teardown (tests/unit/test_cupti_teardown.py), and the two
 * libcudart calls it makes (a test maps this file as libcudart too, through a symlink: one copy,
 * one state). One subscriber at a time, as in CUPTI up to 13.x. cudaRuntimeGetVersion calls the
 * subscriber's callback at entry and at exit on the calling thread when its cbid is enabled;
 * cuptiFinalize forgets the subscriber and the buffer callbacks, as CUPTI does, and counts where
 * it was called from. fake_cupti_set(name, value) sets a version, makes a call fail, or makes the
 * runtime call silent (no callback); fake_cupti_get(name) reads a counter. */
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

/* ---- callback API ---------------------------------------------------------------------------- */
enum { SUCCESS = 0, INVALID_PARAMETER = 1, MULTIPLE_SUBSCRIBERS = 39 };
enum { RUNTIME_API = 2, CBID_DRIVER_VERSION = 1, CBID_RUNTIME_VERSION = 2, API_ENTER = 0, API_EXIT = 1 };

typedef void (*callback_fn)(void *userdata, uint32_t domain, uint32_t cbid, const void *cbdata);
typedef struct { uint32_t callbackSite; const char *functionName; } callback_data;  /* CUPTI's head */

static callback_fn g_cb;
static void *g_userdata;
static int g_subscribed;
static int g_handle;                 /* its address is the subscriber handle */
static uint8_t g_enabled[4][64];     /* [domain][cbid] */
static __thread int t_site = -1;     /* the callback site this thread is in, -1 outside one */

static struct { const char *name; int value, initial; } g_vars[] = {
    {"version", 28, 28}, {"driver", 13000, 13000}, {"silent", 0, 0},
    {"fail_subscribe", 0, 0}, {"fail_enable", 0, 0}, {"fail_unsubscribe", 0, 0}, {"fail_finalize", 0, 0},
    {"fail_name", 0, 0}, {"fail_version", 0, 0},
    {"finalize_at_exit", 0, 0}, {"finalize_elsewhere", 0, 0}, {"entry_callbacks", 0, 0},
    {"exit_callbacks", 0, 0},
};

static int *var(const char *name) {
    for (size_t i = 0; i < sizeof g_vars / sizeof g_vars[0]; i++)
        if (!strcmp(g_vars[i].name, name)) return &g_vars[i].value;
    return NULL;
}

void fake_cupti_set(const char *name, int value) { int *v = var(name); if (v) *v = value; }
int fake_cupti_get(const char *name) { int *v = var(name); return v ? *v : -1; }
int fake_cupti_subscribed(void) { return g_subscribed; }

static void forget_subscriber(void) {
    g_cb = NULL;
    g_userdata = NULL;
    g_subscribed = 0;
    memset(g_enabled, 0, sizeof g_enabled);
}

/* every variable back to its initial value, no subscriber (between tests) */
void fake_cupti_reset(void) {
    for (size_t i = 0; i < sizeof g_vars / sizeof g_vars[0]; i++) g_vars[i].value = g_vars[i].initial;
    forget_subscriber();
}

int cuptiGetVersion(uint32_t *version) {
    if (*var("fail_version")) return *var("fail_version");
    *version = (uint32_t)*var("version");
    return SUCCESS;
}

int cuptiGetCallbackName(uint32_t domain, uint32_t cbid, const char **name) {
    if (*var("fail_name")) return *var("fail_name");
    if (domain != RUNTIME_API || cbid != CBID_RUNTIME_VERSION) return INVALID_PARAMETER;
    *name = "cudaRuntimeGetVersion_v3020";
    return SUCCESS;
}

int cuptiSubscribe(void **subscriber, callback_fn cb, void *userdata) {
    if (*var("fail_subscribe")) return *var("fail_subscribe");
    if (g_subscribed) return MULTIPLE_SUBSCRIBERS;
    g_cb = cb;
    g_userdata = userdata;
    g_subscribed = 1;
    *subscriber = &g_handle;
    return SUCCESS;
}

int cuptiEnableCallback(uint32_t enable, void *subscriber, uint32_t domain, uint32_t cbid) {
    if (*var("fail_enable")) return *var("fail_enable");
    if (!g_subscribed || subscriber != &g_handle || domain >= 4 || cbid >= 64) return INVALID_PARAMETER;
    g_enabled[domain][cbid] = enable != 0;
    return SUCCESS;
}

int cuptiUnsubscribe(void *subscriber) {
    if (*var("fail_unsubscribe")) return *var("fail_unsubscribe");
    if (!g_subscribed || subscriber != &g_handle) return INVALID_PARAMETER;
    forget_subscriber();
    return SUCCESS;
}

int cuptiFinalize(void) {
    (*var(t_site == API_EXIT ? "finalize_at_exit" : "finalize_elsewhere"))++;
    if (*var("fail_finalize")) return *var("fail_finalize");
    forget_subscriber();
    g_req = NULL;                    /* the next cuptiActivityRegisterCallbacks initialises again */
    g_done = NULL;
    return SUCCESS;
}

static void api_callback(uint32_t cbid, int site) {
    callback_fn cb = g_cb;
    if (!cb || !g_enabled[RUNTIME_API][cbid] || *var("silent")) return;
    callback_data d = {(uint32_t)site, "cudaRuntimeGetVersion"};
    (*var(site == API_EXIT ? "exit_callbacks" : "entry_callbacks"))++;
    t_site = site;
    cb(g_userdata, RUNTIME_API, cbid, &d);
    t_site = -1;
}

int cudaRuntimeGetVersion(int *version) {
    api_callback(CBID_RUNTIME_VERSION, API_ENTER);
    *version = 13000;
    api_callback(CBID_RUNTIME_VERSION, API_EXIT);
    return 0;
}

int cudaDriverGetVersion(int *version) {
    api_callback(CBID_DRIVER_VERSION, API_ENTER);
    *version = *var("driver");
    api_callback(CBID_DRIVER_VERSION, API_EXIT);
    return 0;
}
