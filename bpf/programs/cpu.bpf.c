/* cpu.bpf.c — CPU time samples of the target (perf cpu-clock, SL_SAMPLE_HZ per CPU).
 *
 * Attached on every CPU, filtered to the target's tgid in BPF. Each sample carries the user
 * native stack and the thread's operator path, so CPU time lands in the same CCT as GPU work.
 */
#include "stacklens.h"

BPF_PERCPU_ARRAY(sample_scratch, struct sl_event, 1);

int sl_cpu_sample(struct bpf_perf_event_data *ctx)
{
    if (!sl_is_target())
        return 0;
    sl_count(SL_C_SAMPLES);
    u32 zero = 0;
    struct sl_event *ev = sample_scratch.lookup(&zero);  /* not event_scratch: a sample can
                                                           * interrupt an API probe on this CPU */
    if (!ev)
        return 0;
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
        sl_op_context(usp, &ev->op_depth, &ev->op_hash);
    else
        sl_count(SL_C_NO_USER_REGS);
    ev->stack_id = -1;
    if (SL_NATIVE_STACKS) {
        /* the first map only: samples are nearly all new stacks (their leaf differs) and
         * would use up the second map, which keeps launch sites' stacks (sl_user_stackid) */
        int sid = stacks.get_stackid(ctx, BPF_F_USER_STACK);
        if (sid < 0)
            sl_count(SL_C_STACK_ERR);
        ev->stack_id = sid;
    }
    SL_CAPTURE_PYSTACK(ctx, ev);
    if (sl_emit(ctx, ev) != 0)
        sl_count(SL_C_SAMPLE_DROPS);
    return 0;
}
