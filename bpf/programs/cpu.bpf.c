/* cpu.bpf.c — CPU time samples of the target (perf cpu-clock, SL_SAMPLE_HZ per CPU).
 *
 * Attached on every CPU, filtered to the target's tgid in BPF. Each sample carries the user
 * native stack and the thread's operator path, so CPU time lands in the same CCT as GPU work.
 */
#include "stacklens.h"

/* A sample carries its user stack's addresses itself (bpf_get_stack), not a stack-map id:
 * nearly every sample is a new stack (its leaf differs), and a stack map fills up and then
 * refuses new stacks for good (measured on the CPU VM: 23% of a torch loop's samples lost their
 * native stack after 5 minutes at 99 Hz). ~1 KiB a sample at 99 Hz per busy thread. */
struct sl_sample {
    struct sl_event ev;
    u64 ips[SL_SAMPLE_DEPTH];
#if SL_STACK_COPY
    /* frame-pointer walks break in code built without them (libpython, libtorch_cpu, MKL):
     * the user registers (struct pt_regs) and the stack from sp up, for the decoder's
     * .eh_frame unwinder (bpf/unwind.py). Present when the record is longer than ev + ips. */
    u64 regs[21];
    u64 stack_len;
    u8 stack[SL_STACK_COPY];
#endif
};
BPF_PERCPU_ARRAY(sample_scratch, struct sl_sample, 1);

#if SL_STACK_COPY
/* Reads the user stack from `usp` into `dst` (`max` bytes, a multiple of 4096): to the end of
 * usp's page, then whole pages while they read (the stack's top ends it). Returns the bytes read. */
static __always_inline u64 sl_copy_stack(u8 *dst, u64 usp, const u64 max)
{
    u64 got = 4096 - (usp & 4095);
    if (bpf_probe_read_user(dst, got & 4095 ? got & 4095 : 4096, (void *)usp) != 0)
        return 0;
    for (int i = 0; i < max / 4096 - 1; i++) {
        u64 at = got;
        SL_OPAQUE(at);      /* the bound checked on the register the read uses */
        if (at > max - 4096)
            break;
        if (bpf_probe_read_user(dst + at, 4096, (void *)(usp + at)) != 0)
            break;
        got = at + 4096;
    }
    return got;
}
#endif

#if SL_STACK_COPY && SL_DEEP_COPY
/* a sample whose operator's frame is beyond SL_STACK_COPY: the same record, a longer copy */
struct sl_deep_sample {
    struct sl_event ev;
    u64 ips[SL_SAMPLE_DEPTH];
    u64 regs[21];
    u64 stack_len;
    u8 stack[SL_DEEP_COPY];
};

/* The entry sp of the innermost live operator, `depth` deep (sl_op_context; 0: none). */
static __always_inline u64 sl_op_sp(u32 depth)
{
    struct sl_shadow *s = depth ? sl_shadow_get(0) : 0;
    if (!s || depth > SL_OP_DEPTH)
        return 0;
    return s->e[sl_op_idx(depth - 1)].sp;
}

/* Sends `smp` (registers read) with SL_DEEP_COPY bytes of stack from usp, reserved in the ring
 * and read into it page by page. 0 when the ring had no room for it. */
static __always_inline int sl_emit_deep(struct sl_sample *smp, u64 usp)
{
    struct sl_deep_sample *d = events.ringbuf_reserve(sizeof(struct sl_deep_sample));
    if (!d)
        return 0;
    bpf_probe_read_kernel(d, offsetof(struct sl_sample, stack), smp);
    d->stack_len = sl_copy_stack(d->stack, usp, SL_DEEP_COPY);
    events.ringbuf_submit(d, sl_wake_flags());
    sl_count(SL_C_DEEP_COPIES);
    return 1;
}
#endif

int sl_cpu_sample(struct bpf_perf_event_data *ctx)
{
    if (!sl_enter())
        return 0;
    sl_count(SL_C_SAMPLES);
    u32 zero = 0;
    struct sl_sample *smp = sample_scratch.lookup(&zero);  /* not event_scratch: a sample can
                                                             * interrupt an API probe on this CPU */
    if (!smp)
        return 0;
    struct sl_event *ev = &smp->ev;
    u64 id = bpf_get_current_pid_tgid();
    __builtin_memset(ev, 0, sizeof(*ev));
    ev->kind = SL_EV_SAMPLE;
    ev->pid = id >> 32;
    ev->tid = (u32)id;
    ev->ktime_ns = bpf_ktime_get_ns();
    /* user registers even when the sample hit kernel code */
    struct pt_regs *uregs = (struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
    u64 usp = 0;
    if (uregs)
        bpf_probe_read_kernel(&usp, sizeof(usp), &uregs->sp);
    if (usp)
        sl_op_context(usp, &ev->op_depth, &ev->op_hash, &ev->bwd_node);
    else
        sl_count(SL_C_NO_USER_REGS);
    ev->stack_id = -1;
    u64 size = 0;
    if (SL_NATIVE_STACKS) {
        long n = bpf_get_stack(ctx, smp->ips, sizeof(smp->ips), BPF_F_USER_STACK);
        if (n > 0) {
            size = n;
            ev->stack_id = SL_STACK_INLINE;
            ev->out = n;
        } else {
            sl_count(SL_C_STACK_ERR);
            ev->stack_id = n < 0 ? (s32)n : -14;   /* nothing read: marked like a fault (-EFAULT) */
        }
    }
    SL_CAPTURE_PYSTACK(ctx, ev);
    if (size > sizeof(smp->ips))
        size = sizeof(smp->ips);
#if SL_STACK_COPY
    /* A copy is up to SL_STACK_COPY bytes of ring per sample: while three quarters of the ring
     * wait to be read (the reader behind: a loaded machine, many busy threads, the first
     * symbolization of libtorch), the sample goes without it (its frame-pointer walk only,
     * ~1 KiB; counted) instead of being lost with it: the last quarter holds thousands of those.
     * Asked of the ring itself at each sample: a reader stalled between its polls cannot let
     * the ring fill. */
    int room = sl_ring_waiting() < (u64)SL_RINGBUF_PAGES * 4096 / 4 * 3;
    if (SL_NATIVE_STACKS && usp && size > 0 && !room)
        sl_count(SL_C_COPY_SKIPPED);
    if (SL_NATIVE_STACKS && usp && size > 0 && room) {
        bpf_probe_read_kernel(smp->regs, sizeof(smp->regs), uregs);
#if SL_DEEP_COPY
        /* under an operator whose entry is past the copy's reach, the copy reaches it */
        u64 osp = sl_op_sp(ev->op_depth);
        if (osp > usp + SL_STACK_COPY - 1024 && osp < usp + SL_DEEP_COPY - 1024 && sl_emit_deep(smp, usp))
            return 0;
#endif
        u64 got = sl_copy_stack(smp->stack, usp, SL_STACK_COPY);
        smp->stack_len = got;
        u64 n = offsetof(struct sl_sample, stack) + got;
        if (n > sizeof(*smp))
            n = sizeof(*smp);
        if (sl_emit_n(ctx, smp, n) != 0)
            sl_count(SL_C_SAMPLE_DROPS);
        return 0;
    }
#endif
    if (sl_emit_n(ctx, smp, sizeof(struct sl_event) + size) != 0)
        sl_count(SL_C_SAMPLE_DROPS);
    return 0;
}
