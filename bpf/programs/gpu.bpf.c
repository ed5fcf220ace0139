/* gpu.bpf.c — generic GPU API probes (CUDA driver, HIP), driven by bpf/probes.toml.
 *
 * One entry program and one return program serve every probe target: the attach cookie
 * (or, in the SL_NO_COOKIE fallback, a stub's constant) indexes `specs`, which says where
 * each argument lives (x86-64 registers or stack slots at entry), what to dereference and
 * whether a return probe completes the event. Launch paths are entry-only: one ring-buffer
 * record per call, with the native stack id and the thread's operator path.
 */
#include "stacklens.h"

#ifndef SL_BENCH_FANOUT
#define SL_BENCH_FANOUT 1
#endif

BPF_ARRAY(specs, struct sl_spec, SL_MAX_SPECS);
BPF_HASH(pending, u64, struct sl_event, 4096);
BPF_PERCPU_ARRAY(event_scratch, struct sl_event, 1);

#define SL_STACK_SLOTS 8

/* Native-stack reuse: a launch loop calls the same API from the same place again and again, and
 * unwinding the (deep, C++) user stack is the costliest part of the probe on a CPU-launch-bound
 * job (measured on the H200: ViT 1.58x with, 1.06x without native stacks; ResNet-50 training
 * +6 ms of CPU per 737-launch step). A stack id is reused when the thread is at a point where it
 * was before: same stack pointer and frame pointer at the probe, same return address, same live
 * operator path and same Python stack as that earlier event. The memo is keyed by all of these, so a training step
 * that launches from hundreds of places (forward, backward on the autograd thread, optimizer)
 * unwinds each place once, not once per change of place. (Different native frames under all of
 * these equal would need two C++ call chains of exactly equal depth ending at the same call
 * instruction — not seen in practice; SL_NO_NATIVE_REUSE turns the reuse off.) Stack ids stay
 * valid: the stack maps are never cleared and get_stackid never replaces a bucket (no REUSE flag).
 * The memo's value is the stack id, or -EEXIST for a stack whose buckets in both maps other
 * stacks hold (sl_user_stackid). */
struct sl_native_key {
    u64 sp;
    u64 bp;            /* the caller's frame pointer: where the unwind starts */
    u64 caller;
    u64 op_hash;
    u64 py_stack_id;
    u32 tid;
    u32 op_depth;
};
/* hash keys compare every byte: no padding may hide uninitialized stack */
_Static_assert(sizeof(struct sl_native_key) == 48, "sl_native_key has padding");
#ifndef SL_NO_NATIVE_REUSE
#ifndef SL_NATIVE_MEMO_ENTRIES
#define SL_NATIVE_MEMO_ENTRIES 16384
#endif
BPF_TABLE("lru_hash", struct sl_native_key, s32, native_memo, SL_NATIVE_MEMO_ENTRIES);
#endif

static __always_inline void sl_fill_entry(struct pt_regs *ctx, struct sl_spec *sp, u32 idx,
                                          struct sl_event *ev)
{
    u64 id = bpf_get_current_pid_tgid();
    u64 slots[SL_STACK_SLOTS] = {};
    /* registers copied first: indexing the ctx pointer with a variable is not allowed */
    u64 regs[8] = {ctx->di, ctx->si, ctx->dx, ctx->cx, ctx->r8, ctx->r9, 0, 0};
    ev->kind = SL_EV_API;
    ev->spec = idx;
    ev->pid = id >> 32;
    ev->tid = (u32)id;
    ev->ktime_ns = bpf_ktime_get_ns();
    ev->duration_ns = 0;
    ev->ret = 0;
    ev->out = 0;
    /* stack arguments: [sp] is the return address, argument 7 is at [sp + 8] */
    ev->caller = 0;
    bpf_probe_read_user(&ev->caller, sizeof(ev->caller), (void *)ctx->sp);
    bpf_probe_read_user(slots, sizeof(slots), (void *)(ctx->sp + 8));
#pragma unroll
    for (int i = 0; i < SL_NARGS; i++) {
        u8 s = sp->src[i];
        u64 v = 0;
        if (s < 6)
            v = regs[s & 7];
        else if (s != 255 && s - 6 < SL_STACK_SLOTS)
            v = slots[(s - 6) & (SL_STACK_SLOTS - 1)];
        ev->args[i] = v;
    }
    if (sp->blob_arg >= 0 && sp->blob_arg < SL_NARGS) {
        u64 ptr = ev->args[sp->blob_arg & 15];
        if (bpf_probe_read_user(ev->blob, SL_BLOB, (void *)ptr) != 0)
            __builtin_memset(ev->blob, 0, SL_BLOB);
    } else {
        __builtin_memset(ev->blob, 0, SL_BLOB);
    }
    sl_op_context(ctx->sp, &ev->op_depth, &ev->op_hash, &ev->bwd_node);
    sl_capture_pystack_memo(ctx, ev);
    ev->stack_id = -1;
    if (SL_NATIVE_STACKS && (sp->flags & SL_F_STACK)) {
#ifndef SL_NO_NATIVE_REUSE
        struct sl_native_key nk = {ctx->sp, ctx->bp, ev->caller, ev->op_hash, ev->py_stack_id, (u32)id,
                                   ev->op_depth};
        s32 *known = native_memo.lookup(&nk);
        if (known) {
            ev->stack_id = *known;
            sl_count(*known >= 0 ? SL_C_NATIVE_REUSED : SL_C_STACK_ERR);
            return;
        }
#endif
        int sid = sl_user_stackid(ctx);
        if (sid < 0)
            sl_count(SL_C_STACK_ERR);
        ev->stack_id = sid;
#ifndef SL_NO_NATIVE_REUSE
        /* a collision in both maps (-EEXIST) repeats for this stack as long as the other stacks
         * hold the buckets, which is forever: remembered too, so the place is not unwound again */
        if (sid >= 0 || sid == -SL_EEXIST)
            native_memo.update(&nk, &sid);
#endif
    }
}

static __always_inline int sl_api_entry(struct pt_regs *ctx, u32 idx)
{
    if (!sl_enter())
        return 0;
    struct sl_spec *sp = specs.lookup(&idx);
    if (!sp)
        return 0;
    /* one call site of sl_fill_entry (it inlines the Python walk: one copy compiles faster),
     * always into per-CPU scratch: return-probed calls park it in `pending` for the return
     * probe, the others copy it out with sl_emit (ring, else the perf-buffer fallback) */
    u32 zero = 0;
    struct sl_event *ev = event_scratch.lookup(&zero);
    if (!ev)
        return 0;
    sl_fill_entry(ctx, sp, idx, ev);
    if (sp->flags & SL_F_RETURN) {
        u64 key = ((u64)idx << 32) | (u32)bpf_get_current_pid_tgid();
        pending.update(&key, ev);
        return 0;
    }
#if SL_BENCH_FANOUT > 1
    /* benchmarks/bench_probes.py only: SL_BENCH_FANOUT - 1 copies of each event, to measure
     * how many events/s the user-space loader sustains beyond what one uprobe hit rate gives */
    for (int i = 1; i < SL_BENCH_FANOUT; i++)
        sl_emit(ctx, ev);
#endif
    sl_emit(ctx, ev);
    return 0;
}

static __always_inline int sl_api_return(struct pt_regs *ctx, u32 idx)
{
    if (!sl_enter())
        return 0;
    struct sl_spec *sp = specs.lookup(&idx);
    if (!sp)
        return 0;
    u64 key = ((u64)idx << 32) | (u32)bpf_get_current_pid_tgid();
    struct sl_event *pe = pending.lookup(&key);
    if (!pe) {
        sl_count(SL_C_PENDING_MISS);
        return 0;
    }
    u64 out = 0;
    if (sp->out_arg >= 0 && sp->out_arg < SL_NARGS)
        bpf_probe_read_user(&out, sizeof(out), (void *)pe->args[sp->out_arg & 15]);

    if (sp->flags & SL_F_NAME) {
        struct sl_name_event *ne = sl_reserve(sizeof(struct sl_name_event));
        if (!ne) {
            sl_count(SL_C_DROPS);
        } else {
            u64 id = bpf_get_current_pid_tgid();
            ne->kind = SL_EV_NAME;
            ne->spec = idx;
            ne->pid = id >> 32;
            ne->tid = (u32)id;
            ne->handle = out;
            ne->ref = 0;
            ne->name[0] = 0;
            if (sp->str_arg >= 0 && sp->str_arg < SL_NARGS)
                bpf_probe_read_user_str(ne->name, SL_NAME, (void *)pe->args[sp->str_arg & 15]);
            else if (sp->ref_arg >= 0 && sp->ref_arg < SL_NARGS)
                ne->ref = pe->args[sp->ref_arg & 15];
            events.ringbuf_submit(ne, sl_wake_flags());
        }
        pending.delete(&key);
        return 0;  /* a name lookup is not a GPU call: no sl_event */
    }

    u32 zero = 0;
    struct sl_event *ev = event_scratch.lookup(&zero);
    if (!ev) {
        pending.delete(&key);
        return 0;
    }
    __builtin_memcpy(ev, pe, sizeof(struct sl_event));
    ev->duration_ns = bpf_ktime_get_ns() - ev->ktime_ns;
    ev->ret = PT_REGS_RC(ctx);
    ev->out = out;
    sl_emit(ctx, ev);
    pending.delete(&key);
    return 0;
}

#ifndef SL_NO_COOKIE
int sl_api_entry_multi(struct pt_regs *ctx)
{
    return sl_api_entry(ctx, (u32)bpf_get_attach_cookie(ctx));
}

int sl_api_return_multi(struct pt_regs *ctx)
{
    return sl_api_return(ctx, (u32)bpf_get_attach_cookie(ctx));
}
#endif

/* SL_NO_COOKIE fallback: bpf/program.py appends one
 *   SL_API_STUBS(N)
 * line per spec, giving each probe its own program with the spec index as a constant. */
#define SL_API_STUBS(N) \
    int sl_api_entry_##N(struct pt_regs *ctx) { return sl_api_entry(ctx, N); } \
    int sl_api_return_##N(struct pt_regs *ctx) { return sl_api_return(ctx, N); }
