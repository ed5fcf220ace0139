/* pystack_test.bpf.c — test and benchmark harness for pystack.h (not used by the daemon).
 *
 * A uprobe (any function the target calls) records the calling thread's Python stack into a
 * ring buffer. -DPT_NO_WALK: same record without the walk (benchmark baseline);
 * -DPT_COUNT_ONLY: walk into per-CPU scratch and only count (no ring buffer traffic);
 * -DPT_THREAD_MAP: find the tstate in a tid map filled from user space instead of TLS.
 */
#include <uapi/linux/ptrace.h>
#include "pystack.h"

struct pt_event {
    u32 tid;
    u32 pad;
    u64 ktime_ns;
    struct sl_pystack st;
};

#ifndef PT_RING_PAGES
#define PT_RING_PAGES 256
#endif
BPF_RINGBUF_OUTPUT(pt_events, PT_RING_PAGES);
BPF_PERCPU_ARRAY(pt_counts, u64, 5);   /* 0 hits, 1 drops, 2 frames, 3 errors, 4 ns in pt_fill */
BPF_PERCPU_ARRAY(pt_scratch, struct sl_pystack, 1);
#ifdef PT_THREAD_MAP
BPF_HASH(sl_py_threads, u32, u64, 4096);
#endif

static __always_inline void pt_add(u32 i, u64 v)
{
    u64 *c = pt_counts.lookup(&i);
    if (c)
        *c += v;
}

static __always_inline int pt_fill(struct pt_regs *ctx, struct sl_pystack *st)
{
#if defined(PT_NO_WALK)
    st->depth = 0;
    st->status = SL_PY_NO_TSTATE;
    st->truncated = 0;
    return 0;
#elif defined(PT_THREAD_MAP)
    if ((bpf_get_current_pid_tgid() >> 32) != SL_PY_TGID)
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 *ts = sl_py_threads.lookup(&tid);
    return sl_walk_pystack(ts ? *ts : 0, st);
#else
    return sl_read_pystack(ctx, st);
#endif
}

int pt_probe(struct pt_regs *ctx)
{
    pt_add(0, 1);
#ifdef PT_COUNT_ONLY
    u32 zero = 0;
    struct sl_pystack *s = pt_scratch.lookup(&zero);
    if (!s)
        return 0;
    u64 t0 = bpf_ktime_get_ns();
    int rc = pt_fill(ctx, s);
    pt_add(4, bpf_ktime_get_ns() - t0);
    if (rc < 0)
        pt_add(3, 1);
    pt_add(2, s->depth);
#else
    struct pt_event *e = pt_events.ringbuf_reserve(sizeof(struct pt_event));
    if (!e) {
        pt_add(1, 1);
        return 0;
    }
    e->tid = (u32)bpf_get_current_pid_tgid();
    e->ktime_ns = bpf_ktime_get_ns();
    if (pt_fill(ctx, &e->st) < 0)
        pt_add(3, 1);
    pt_events.ringbuf_submit(e, 0);
#endif
    return 0;
}
