/* ops.bpf.c — framework operator entries (libtorch `at::_ops::<op>::call`).
 *
 * One program attached to every op symbol through a single uprobe_multi link; the cookie is
 * the op index. No uretprobes: the per-thread shadow stack pops returned ops lazily (see
 * sl_shadow_live_depth). Op calls are counted in-kernel per op path: op_slots[top bits of the
 * path hash] (an inlined array lookup), op_counts[path hash] for paths whose slot another path
 * holds; op_paths[path hash] holds the path so user space can name it. ~1 uprobe hit per op call.
 */
#include "stacklens.h"

static __always_inline u64 sl_mix(u64 h, u64 op)
{
    /* FNV-1a style step over the op index, never 0 */
    h ^= op + 0x9e3779b97f4a7c15ULL;
    h *= 0x100000001b3ULL;
    return h ? h : 1;
}

/* first call of path h (or h collides with another path's slot): name it in op_paths, then
 * claim its slot or count it in the op_counts hash map */
static __always_inline int sl_op_count_slow(struct sl_shadow *s, u32 d, u64 h,
                                                    struct sl_op_slot *slot)
{
    u32 zero = 0;
    struct sl_op_path *p = path_scratch.lookup(&zero);
    if (!p)
        return 0;
    if (!op_paths.lookup(&h)) {
        p->depth = d + 1;
        p->tgid = bpf_get_current_pid_tgid() >> 32;
#pragma unroll
        for (int i = 0; i < SL_OP_DEPTH; i++)
            p->ops[i] = i <= d ? s->e[i].op : 0;
        if (op_paths.update(&h, p) != 0) {
            sl_count(SL_C_OPPATH_FULL);
            return 0;
        }
    }
    if (slot->hash == 0) {
        u64 prev = __sync_val_compare_and_swap(&slot->hash, 0, h);
        if (prev == 0 || prev == h) {
            __sync_fetch_and_add(&slot->count, 1);
            return 0;
        }
    }
    u64 *cnt = op_counts.lookup(&h);
    if (cnt) {
        __sync_fetch_and_add(cnt, 1);
        return 0;
    }
    u64 one = 1;
    if (op_counts.insert(&h, &one) != 0) {
        cnt = op_counts.lookup(&h);
        if (cnt)
            __sync_fetch_and_add(cnt, 1);
        else
            sl_count(SL_C_OPPATH_FULL);
    }
    return 0;
}

static __always_inline int sl_op_entry(struct pt_regs *ctx, u32 op)
{
#ifdef SL_BENCH_OP_EMPTY
    return 0;  /* benchmarks only: the uprobe's own cost on libtorch's op entries */
#endif
    if (!sl_enter())
        return 0;
    /* no per-hit counter: op calls are the sum of the op counts (user space, stats()) */
    struct sl_shadow *s = sl_shadow_get(BPF_LOCAL_STORAGE_GET_F_CREATE);
    if (!s)
        return 0;
    u64 sp = ctx->sp;
    u32 d = sl_shadow_live_depth(s, sp);
    if (d >= SL_OP_DEPTH) {
        s->depth = d;
        sl_count(SL_C_OP_OVERFLOW);
        return 0;
    }
    /* seeded with the process: one program serves several, and a path is one process's */
    u64 parent = 0xcbf29ce484222325ULL ^ (bpf_get_current_pid_tgid() >> 32);
    if (d > 0)
        parent = s->e[sl_op_idx(d - 1)].hash;
    else
        s->py_memo_sp = 0;   /* a new call from Python: its stack is read again */
    u64 h = sl_mix(parent, op);
    u64 ret = 0;
    bpf_probe_read_user(&ret, sizeof(ret), (void *)sp);
    struct sl_op_entry *e = &s->e[sl_op_idx(d)];
    e->sp = sp;
    e->ret = ret;
    e->hash = h;
    e->op = op;
    s->depth = d + 1;

    /* the path's slot: top bits of the hash (the low bits of this FNV-style hash mix poorly) */
    u32 i = (u32)(h >> SL_OP_SLOT_SHIFT);
    struct sl_op_slot *slot = op_slots.lookup(&i);
    if (!slot)
        return 0;
    if (slot->hash == h) {
        __sync_fetch_and_add(&slot->count, 1);
        return 0;
    }
    return sl_op_count_slow(s, d, h, slot);
}

#ifndef SL_NO_COOKIE
int sl_op_entry_multi(struct pt_regs *ctx)
{
    return sl_op_entry(ctx, (u32)bpf_get_attach_cookie(ctx));
}
#endif

/* SL_NO_COOKIE fallback (short op list): one stub per op, appended by bpf/program.py. */
#define SL_OP_STUBS(N) \
    int sl_op_entry_##N(struct pt_regs *ctx) { return sl_op_entry(ctx, N); }
