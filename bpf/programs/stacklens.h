/* stacklens.h — shared types, maps and helpers for the stacklens BPF programs.
 *
 * Compiled by BCC with -D parameters (see bpf/program.py):
 *   SL_MAX_TARGETS       processes one program serves (`targets`, bpf/shared.py): a program
 *                        is compiled once per daemon and program key, not once per attach
 *   SL_MAX_SPECS         size of the probe-spec array (entries of bpf/probes.toml)
 *   SL_RINGBUF_PAGES     ring buffer size in pages (power of two)
 *   SL_STACK_ENTRIES     entries of the native stack-trace map
 *   SL_STACK_ENTRIES_2   entries of the second stack map, for stacks whose bucket in the first
 *                        one another stack holds (sl_user_stackid)
 *   SL_NATIVE_MEMO_ENTRIES  entries of gpu.bpf.c's native-stack memo (SL_NO_NATIVE_REUSE: none)
 *   SL_TEST_STACK_RETRY  tests only: every stack also goes to the second map, as after a collision
 *   SL_NO_NATIVE_REUSE   gpu.bpf.c: unwind at every launch (no memo; benchmarks)
 *   SL_BENCH_FANOUT      gpu.bpf.c, benchmarks only: N copies of each event
 *   SL_BENCH_OP_EMPTY    ops.bpf.c, benchmarks only: an op program that does nothing
 *   SL_OP_DEPTH          depth of the per-thread operator shadow stack (a power of two:
 *                        indices are masked with SL_OP_DEPTH - 1 for the verifier)
 *   SL_OP_PATHS          entries of the op-path map and of the op-count overflow map
 *   SL_OP_SLOTS          entries of the direct-mapped op-count array (power of two)
 *   SL_WAKEUP_EVERY      wake the reader on every Nth event per CPU only (power of two; the
 *                        reader also polls on a short timer): a wakeup per event cost more
 *                        than the probe itself on the Firecracker VM
 *   SL_NATIVE_STACKS     1: capture user native stacks (default), 0: never
 *   SL_NO_COOKIE         fallback build: per-probe stubs pass the spec index instead of a cookie
 *   STACKLENS_PYSTACK    include pystack.h (in-BPF Python stack capture, written separately)
 *   SL_AG_NO_PYSTACK     autograd.bpf.c, benchmarks only: no Python stack at node creation
 *
 * Every C struct here that reaches user space is mirrored once in bpf/events_abi.py
 * (tests/bpf/test_events_abi.py checks sizes and offsets).
 */
#ifndef STACKLENS_H
#define STACKLENS_H

#ifdef SL_ABI_ONLY
/* plain C (tests/bpf/test_events_abi.py): only the structs, for sizeof/offsetof checks */
#include <stdint.h>
typedef uint8_t u8;
typedef int8_t s8;
typedef uint32_t u32;
typedef int32_t s32;
typedef uint64_t u64;
#else
#include <uapi/linux/ptrace.h>
#include <uapi/linux/bpf.h>
#include <uapi/linux/bpf_perf_event.h>
#include <linux/sched.h>
#endif

#ifndef SL_MAX_TARGETS
#define SL_MAX_TARGETS 64
#endif
#ifndef SL_MAX_SPECS
#define SL_MAX_SPECS 64
#endif
#ifndef SL_RINGBUF_PAGES
#define SL_RINGBUF_PAGES 4096
#endif
#ifndef SL_STACK_ENTRIES_2
#define SL_STACK_ENTRIES_2 4096
#endif
#define SL_STACK_IN_2 (1 << 30)   /* a stack id with this bit set is in stacks2 */
#define SL_STACK_INLINE (-4096)   /* the stack's addresses follow the event (CPU samples; `out`:
                                   * their size in bytes), not in a stack map */
#define SL_SAMPLE_DEPTH 127       /* addresses a CPU sample carries (perf_event_max_stack) */
_Static_assert(SL_STACK_ENTRIES_2 < SL_STACK_IN_2, "stacks2 ids must stay below the mark");
#define SL_EEXIST 17
#ifndef SL_STACK_ENTRIES
#define SL_STACK_ENTRIES 16384
#endif
_Static_assert(SL_STACK_ENTRIES < SL_STACK_IN_2, "stack ids must stay below the stacks2 mark");
#ifndef SL_OP_DEPTH
#define SL_OP_DEPTH 32
#endif
#ifndef SL_OP_PATHS
#define SL_OP_PATHS 65536
#endif
#ifndef SL_OP_SLOTS
#define SL_OP_SLOTS 32768
#endif
#define SL_OP_SLOT_SHIFT (64 - __builtin_ctz(SL_OP_SLOTS))

#ifndef SL_WAKEUP_EVERY
#define SL_WAKEUP_EVERY 512
#endif
#ifndef SL_NATIVE_STACKS
#define SL_NATIVE_STACKS 1
#endif
/* bytes of the user stack a CPU sample copies (from its sp up), with the user registers, for
 * the decoder's .eh_frame unwinder (bpf/unwind.py); 0: frame pointers only. A multiple of 4096;
 * the per-CPU scratch value holds at most 32 KiB. */
#ifndef SL_STACK_COPY
#define SL_STACK_COPY 16384
#endif
/* bytes a sample under an operator copies when the operator's frame lies beyond SL_STACK_COPY
 * (MKL's AVX-512 sgemm kernels align a packing buffer of tens of KiB on the stack below their
 * return address): written straight into the ring, no scratch */
#ifndef SL_DEEP_COPY
#define SL_DEEP_COPY 65536
#endif

#define SL_OP_MASK (SL_OP_DEPTH - 1)
/* keeps clang from dropping an index mask it can prove redundant (the verifier cannot) */
#define SL_OPAQUE(x) asm volatile("" : "+r"(x))
static __always_inline u32 sl_op_idx(u32 i)
{
    SL_OPAQUE(i);
    return i & SL_OP_MASK;
}

#define SL_NARGS 12
#define SL_BLOB 64
#define SL_NAME 128

/* event kinds (struct sl_event.kind) */
#define SL_EV_API 1      /* GPU API call: entry-only, or entry+return with duration */
#define SL_EV_SAMPLE 2   /* perf cpu-clock sample */
#define SL_EV_NAME 3     /* struct sl_name_event: handle -> kernel name */
#define SL_EV_NODE_NEW 4  /* autograd.bpf.c: a forward op gave a tensor its autograd node */
#define SL_EV_NODE_EVAL 5 /* autograd.bpf.c: the autograd engine starts evaluating a node */

/* spec flags (struct sl_spec.flags) */
#define SL_F_RETURN 1    /* a return probe completes the event (duration, return value) */
#define SL_F_STACK 2     /* capture the native user stack */
#define SL_F_NAME 4      /* emit an sl_name_event at return: *out_arg -> str_arg (or ref_arg) */

/* counters (index into the `counters` per-CPU array) */
#define SL_C_EVENTS 0          /* events submitted to the ring buffer */
#define SL_C_DROPS 1           /* ring buffer full: event lost */
#define SL_C_STACK_ERR 2       /* events without their native stack: bpf_get_stackid failed
                                * (collision in both maps, fault), or the memo remembers it did;
                                * a CPU sample's bpf_get_stack failed or read nothing */
#define SL_C_OP_OVERFLOW 3     /* op shadow stack deeper than SL_OP_DEPTH */
#define SL_C_OP_CALLS 4        /* unused: op calls = sum of op_counts (stats()) */
#define SL_C_OPPATH_FULL 5     /* op-path map full */
#define SL_C_PENDING_MISS 6    /* return probe without its entry (attached mid-call) */
#define SL_C_SAMPLES 7         /* cpu samples of the target */
#define SL_C_NO_USER_REGS 8    /* sample without user registers (kernel thread context) */
#define SL_C_PY_ERR 9          /* Python stack capture failed (pystack.h) */
#define SL_C_SAMPLE_DROPS 10   /* cpu samples lost to a full ring buffer */
#define SL_C_RESERVE_RETRY_OK 11 /* a ring write failed, and its immediate retry worked */
#define SL_C_RING_FALLBACK 12  /* events the ring refused twice, sent through events_fb instead */
#define SL_C_NATIVE_REUSED 13  /* launch events that reused a native stack id of the same thread, place and context */
#define SL_C_STACK_MAP2 14      /* stacks kept in the second map after a collision in the first */
#define SL_C_COPY_SKIPPED 15    /* cpu samples sent without their stack copy: 3/4 of the ring waited */
#define SL_C_DEEP_COPIES 16     /* cpu samples sent with SL_DEEP_COPY bytes of stack (cpu.bpf.c) */
#define SL_NCOUNTERS 17

/* One probe target of bpf/probes.toml, as the generic API programs need it.
 * src[i]: where value i comes from at function entry: 0..5 = argument registers
 * (rdi rsi rdx rcx r8 r9), 6+k = stack slot k ([sp + 8 + 8k]); 255 = unused. */
struct sl_spec {
    u8 nargs;
    u8 flags;
    s8 blob_arg;   /* copy SL_BLOB bytes from *(args[blob_arg]) (e.g. CUlaunchConfig), -1 none */
    s8 out_arg;    /* at return, read u64 *(args[out_arg]) into .out (e.g. CUdeviceptr *), -1 none */
    s8 str_arg;    /* SL_F_NAME: C string args[str_arg] is the kernel name, -1 none */
    s8 ref_arg;    /* SL_F_NAME without a string: args[ref_arg] is the handle that names it */
    u8 pad[2];
    u8 src[SL_NARGS];
};

struct sl_event {
    u32 kind;          /* SL_EV_* */
    u32 spec;          /* index of the probe spec (cookie); 0 for samples */
    u32 pid;
    u32 tid;
    u64 ktime_ns;      /* CLOCK_MONOTONIC at entry / sample */
    u64 duration_ns;   /* return probes: time inside the call; 0 otherwise */
    u64 op_hash;       /* hash of the thread's live operator path; 0 = none */
    u32 op_depth;      /* number of live operators (path in the op_paths map) */
    s32 stack_id;      /* native user stack in `stacks` (in `stacks2` with bit SL_STACK_IN_2 set);
                        * SL_STACK_INLINE: after the event (CPU samples); -1 = not captured,
                        * other negatives = -errno */
    u64 py_stack_id;   /* Python stack (pystack.h); 0 = not captured */
    u64 ret;           /* return value (return probes) */
    u64 out;           /* value behind the out-pointer argument (return probes); CPU samples with
                        * SL_STACK_INLINE: bytes of addresses after the event */
    u64 caller;        /* API probes: return address at [sp] on entry. The frame-pointer walk
                        * from a function's first instruction skips its direct caller (rbp is
                        * still the caller's), so user space inserts this frame. */
    u64 bwd_node;      /* the autograd node (torch::autograd::Node *) the thread is evaluating
                        * at the event (autograd.bpf.c), 0 = none */
    u64 args[SL_NARGS];
    u8 blob[SL_BLOB];
};

struct sl_name_event {
    u32 kind;          /* SL_EV_NAME */
    u32 spec;
    u32 pid;           /* at the offset of sl_event.pid: user space routes records by it */
    u32 tid;
    u64 handle;        /* CUfunction / CUkernel written by the call */
    u64 ref;           /* handle it was derived from (cuKernelGetFunction), 0 if a name is given */
    char name[SL_NAME];
};

struct sl_op_entry {
    u64 sp;            /* stack pointer at the op's entry (points at its return address) */
    u64 ret;           /* return address stored at sp: still there iff the op has not returned */
    u64 hash;          /* hash of the path up to and including this op */
    u32 op;            /* op index (attach cookie) */
    u32 pad;
};

#define SL_BWD_DEPTH 4   /* nested node evaluations kept per thread (reentrant backward) */

/* autograd.bpf.c: a node the engine evaluates on this thread, live while its frame of
 * Engine::evaluate_function is (its sp above the event's, its return address still there) */
struct sl_bwd_entry {
    u64 sp;
    u64 ret;
    u64 node;
};

struct sl_shadow {
    u32 depth;
    u32 bwd_depth;     /* entries of bwd[], innermost last; dead ones popped lazily */
    struct sl_bwd_entry bwd[SL_BWD_DEPTH];
    /* the last node created here and its bytes 16..31, so a node with several outputs is sent once */
    u64 new_node;
    u64 new_tag[2];
    /* the Python stack id read at an event inside the outermost live op whose entry sp this is
     * (0: none); reset at every outermost op entry (ops.bpf.c), see sl_capture_pystack_memo */
    u64 py_memo_sp;
    u64 py_memo_id;
    struct sl_op_entry e[SL_OP_DEPTH];
};

struct sl_op_path {
    u32 depth;
    u32 tgid;          /* the process whose path it is (op-path hashes are seeded with it) */
    u32 ops[SL_OP_DEPTH];
};

/* A process this program serves (targets[tgid], written by user space at attach): its counter
 * block and what pystack.h needs of it. */
struct sl_target {
    u32 slot;          /* counters[slot * SL_NCOUNTERS + i] */
    u32 tgid;
    u64 py_interp;     /* main PyInterpreterState (validates a tstate); 0: no Python stacks */
    u64 py_tls_off;    /* fsbase + this = the TSS slot of the thread's tstate; 0: tid map */
};

/* op_slots[top bits of the path hash]: calls of that path, claimed by the first path that lands
 * there (hash 0 = free); paths colliding with a claimed slot are counted in op_counts. */
struct sl_op_slot {
    u64 hash;
    u64 count;
};

#ifndef SL_ABI_ONLY
BPF_RINGBUF_OUTPUT(events, SL_RINGBUF_PAGES);
/* Bytes in `events` not yet read (bpf_ringbuf_query, BPF_RB_AVAIL_DATA). BCC 0.26 (Debian 12)
 * has no map.ringbuf_query(): its rewriter turns events.ringbuf_output(d, n, f) into
 * bpf_ringbuf_output(<the map>, d, n, f), which this macro makes the query for that map. */
#define bpf_ringbuf_output(map, data, size, flags) bpf_ringbuf_query(map, flags)
static __always_inline u64 sl_ring_waiting(void)
{
    u64 unused = 0;
    return events.ringbuf_output(&unused, sizeof(unused), 0 /* BPF_RB_AVAIL_DATA */);
}
#undef bpf_ringbuf_output
/* per-CPU perf buffers: only for events the ring refused (see sl_emit); user space drains both */
BPF_PERF_OUTPUT(events_fb);
BPF_STACK_TRACE(stacks, SL_STACK_ENTRIES);
BPF_STACK_TRACE(stacks2, SL_STACK_ENTRIES_2);
BPF_PERCPU_ARRAY(counters, u64, SL_NCOUNTERS * SL_MAX_TARGETS);
BPF_HASH(targets, u32, struct sl_target, SL_MAX_TARGETS);
/* the target of the program running on this CPU (sl_enter), a copy so that sl_count and
 * pystack.h need no hash lookup. A uprobe_multi program can be preempted (it runs with migration,
 * not preemption, disabled) and another target's program run on this CPU meanwhile: sl_cur()
 * checks the copy's tgid against the current task's and looks the entry up again if it differs. */
BPF_PERCPU_ARRAY(cur_target, struct sl_target, 1);
/* the operator shadow stack lives in the thread's task storage: one pointer chase from the
 * task (no hash, no LRU list), created at the thread's first op, freed with the thread */
BPF_TASK_STORAGE(shadow, struct sl_shadow);
BPF_HASH(op_paths, u64, struct sl_op_path, SL_OP_PATHS);
BPF_HASH(op_counts, u64, u64, SL_OP_PATHS);
/* array lookups are inlined by the verifier (a hash lookup cost ~50 ns per op hit);
 * mmapable so user space sums it without a syscall per entry */
BPF_F_TABLE("array", u32, struct sl_op_slot, op_slots, SL_OP_SLOTS, BPF_F_MMAPABLE);
BPF_PERCPU_ARRAY(path_scratch, struct sl_op_path, 1);

static __always_inline struct sl_target *sl_cur(void)
{
    u32 zero = 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct sl_target *t = cur_target.lookup(&zero);
    if (t && t->tgid == tgid)
        return t;
    return targets.lookup(&tgid);
}

static __always_inline u32 sl_counter_idx(u32 idx)
{
    struct sl_target *t = sl_cur();
    return (t ? t->slot : 0) * SL_NCOUNTERS + idx;
}

static __always_inline void sl_count(u32 idx)
{
    u32 k = sl_counter_idx(idx);
    u64 *c = counters.lookup(&k);
    if (c)
        (*c)++;
}

/* The user stack's id. A stack map holds one stack per hash bucket and, without the REUSE flag,
 * refuses (-EEXIST) a stack whose bucket another one holds, for good: a hot launch site would
 * lose its stack for the session. Such a stack goes to a second, smaller map. Both maps hold
 * launch sites only: CPU samples, nearly all new stacks, carry their addresses (cpu.bpf.c) (its own buckets:
 * a second collision needs two refused stacks sharing one), its id marked SL_STACK_IN_2. Ids
 * are never reused: neither map is cleared, and nothing replaces a bucket. */
static __always_inline int sl_user_stackid(void *ctx)
{
    int sid = stacks.get_stackid(ctx, BPF_F_USER_STACK);
#ifdef SL_TEST_STACK_RETRY
    if (sid >= 0)
        sid = -SL_EEXIST;
#endif
    if (sid == -SL_EEXIST) {
        int s2 = stacks2.get_stackid(ctx, BPF_F_USER_STACK);
        if (s2 >= 0) {
            sl_count(SL_C_STACK_MAP2);
            return s2 | SL_STACK_IN_2;
        }
        sid = s2;
    }
    return sid;
}

/* Since Linux 6.16 the ring's producer lock is a resilient spinlock whose acquisition can fail
 * (deadlock check) with the ring far from full. Measured on this VM under load: a refused write
 * every ~50-100k events at a few thousand events/s, single producer, ring < 3% full, the failed
 * call returning within ~0.5 µs and an immediate retry usually failing too
 * (docs/benchmarks/soak.md). So: one retry, then the per-CPU perf buffer; a drop only when both
 * channels refuse. */
static __always_inline void *sl_reserve(u64 size)
{
    void *p = events.ringbuf_reserve(size);
    if (!p) {
        p = events.ringbuf_reserve(size);
        if (p)
            sl_count(SL_C_RESERVE_RETRY_OK);
    }
    return p;
}

static __always_inline u64 sl_wake_flags(void);

/* Write a finished record of `size` bytes (built in per-CPU scratch) to the ring, else to
 * events_fb. Returns 0 when it went out, -1 when it was dropped (counted in SL_C_DROPS). */
static __always_inline int sl_emit_n(void *ctx, void *rec, u64 size)
{
    u64 flags = sl_wake_flags();
    if (events.ringbuf_output(rec, size, flags) == 0)
        return 0;
    if (events.ringbuf_output(rec, size, flags) == 0) {
        sl_count(SL_C_RESERVE_RETRY_OK);
        return 0;
    }
    if (events_fb.perf_submit(ctx, rec, size) == 0) {
        sl_count(SL_C_RING_FALLBACK);
        return 0;
    }
    sl_count(SL_C_DROPS);
    return -1;
}

static __always_inline int sl_emit(void *ctx, struct sl_event *ev)
{
    return sl_emit_n(ctx, ev, sizeof(*ev));
}

static __always_inline u64 sl_wake_flags(void)
{
    /* counts the event (SL_C_EVENTS) and wakes on every SL_WAKEUP_EVERY-th one per CPU */
    u32 idx = sl_counter_idx(SL_C_EVENTS);
    u64 *c = counters.lookup(&idx);
    if (!c)
        return 0;
    u64 n = ++(*c);
    return (n & (SL_WAKEUP_EVERY - 1)) == 0 ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
}

/* Every program starts here: 1 when the current process is one of the targets, which then is
 * the CPU's current target (counters, Python parameters). Uprobe links are per process already;
 * the perf-event sampler runs for every process. */
static __always_inline int sl_enter(void)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct sl_target *t = targets.lookup(&tgid);
    if (!t)
        return 0;
    u32 zero = 0;
    struct sl_target *cur = cur_target.lookup(&zero);
    if (cur)
        *cur = *t;
    return 1;
}

/* ---- operator shadow stack (kept without uretprobes) ----------------------------------
 * An entry is live at a later event iff its saved SP is above the event's SP (the stack
 * grows down) and its return address is still stored there (an op that returned had its
 * slot reused by later frames). Dead entries are popped lazily, top first. */
static __always_inline int sl_frame_live(u64 esp, u64 eret, u64 sp)
{
    if (esp <= sp)
        return 0;
    u64 ret = 0;
    return bpf_probe_read_user(&ret, sizeof(ret), (void *)esp) != 0 || ret == eret;
}

static __always_inline u32 sl_shadow_live_depth(struct sl_shadow *s, u64 sp)
{
    u32 d = s->depth;
#pragma unroll
    for (int i = 0; i < SL_OP_DEPTH; i++) {
        if (d == 0)
            break;
        if (d > SL_OP_DEPTH)
            d = SL_OP_DEPTH;
        struct sl_op_entry *e = &s->e[sl_op_idx(d - 1)];
        if (sl_frame_live(e->sp, e->ret, sp))
            break;
        d--;
    }
    return d;
}

static __always_inline struct sl_shadow *sl_shadow_get(u64 flags)
{
    return shadow.task_storage_get(bpf_get_current_task_btf(), 0, flags);
}

static __always_inline u32 sl_bwd_idx(u32 i)
{
    SL_OPAQUE(i);   /* the verifier needs the mask clang would prove redundant */
    return i & (SL_BWD_DEPTH - 1);
}

/* entries of s->bwd still live at stack pointer sp (the same test as the operator stack's) */
static __always_inline u32 sl_bwd_live_depth(struct sl_shadow *s, u64 sp)
{
    u32 d = s->bwd_depth;
#pragma unroll
    for (int i = 0; i < SL_BWD_DEPTH; i++) {
        if (d == 0)
            break;
        if (d > SL_BWD_DEPTH)
            d = SL_BWD_DEPTH;
        struct sl_bwd_entry *e = &s->bwd[sl_bwd_idx(d - 1)];
        if (sl_frame_live(e->sp, e->ret, sp))
            break;
        d--;
    }
    return d;
}

/* the thread's live operator path (depth, hash of its top) and autograd node at stack pointer sp */
static __always_inline void sl_op_context(u64 sp, u32 *depth, u64 *hash, u64 *bwd)
{
    struct sl_shadow *s = sl_shadow_get(0);
    *depth = 0;
    *hash = 0;
    *bwd = 0;
    if (!s)
        return;
    if (s->bwd_depth) {
        u32 b = sl_bwd_live_depth(s, sp);
        s->bwd_depth = b;
        if (b > 0 && b <= SL_BWD_DEPTH)
            *bwd = s->bwd[sl_bwd_idx(b - 1)].node;
    }
    u32 d = sl_shadow_live_depth(s, sp);
    s->depth = d;
    if (d == 0 || d > SL_OP_DEPTH)
        return;
    *depth = d;
    *hash = s->e[sl_op_idx(d - 1)].hash;
}

/* ---- Python stack hook -----------------------------------------------------------------
 * pystack.h (another engineer's file) defines
 *   SL_CAPTURE_PYSTACK(ctx, ev)  -> sets ev->py_stack_id, counts SL_C_PY_ERR on failure.
 * Without it events carry py_stack_id = 0 and user space reports an empty py_stack. */
#ifdef STACKLENS_PYSTACK
#define SL_PY_TARGET_PARAMS 1
#include "pystack.h"
#endif
#ifndef SL_CAPTURE_PYSTACK
#define SL_CAPTURE_PYSTACK(ctx, ev) do { (ev)->py_stack_id = 0; } while (0)
#endif

/* The Python stack of an API or autograd event, read at most once per outermost operator call:
 * while the op Python called is live, Python cannot move (its frames wait in that C call), so
 * the launches of one op and the node it creates share one walk. ev->op_depth must be set
 * (sl_op_context); the memo is reset at every outermost op entry. (Python code run from inside
 * an op — __torch_dispatch__, hooks — is charged to the line that called the op.) */
static __always_inline void sl_capture_pystack_memo(void *ctx, struct sl_event *ev)
{
    /* (an id served from the memo does not refresh its place in sl_py_stacks' LRU: the memo
     * lives one op call, so an eviction in between shows as "[python stack lost]", counted) */
    struct sl_shadow *s = ev->op_depth ? sl_shadow_get(0) : 0;
    if (s && s->py_memo_sp && s->py_memo_sp == s->e[0].sp) {
        ev->py_stack_id = s->py_memo_id;
        return;
    }
    SL_CAPTURE_PYSTACK(ctx, ev);
    if (s && ev->py_stack_id) {
        s->py_memo_sp = s->e[0].sp;
        s->py_memo_id = ev->py_stack_id;
    }
}
#endif /* !SL_ABI_ONLY */

#endif /* STACKLENS_H */
