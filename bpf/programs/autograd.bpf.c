/* autograd.bpf.c — the forward→backward link of PyTorch's autograd (bpf/autograd.py).
 *
 * Two libtorch_cpu entry points, one program (cookie: which):
 *   SL_AG_NEW   torch::autograd::impl::set_gradient_edge(const Tensor &, Edge): a forward op hands
 *               an output tensor its grad_fn. Runs on the forward thread, inside the op, so the
 *               event carries the thread's Python stack and operator path: the context that
 *               created the node. Edge is passed by invisible reference (rsi); its first member
 *               is the node pointer (c10::intrusive_ptr, std::shared_ptr before torch 2.13).
 *   SL_AG_EVAL  torch::autograd::Engine::evaluate_function(GraphTask &, Node *, ...): the
 *               engine runs a node (rdx). The thread's shadow storage keeps it (a stack of
 *               SL_BWD_DEPTH: reentrant backward nests evaluations) while this frame is live,
 *               and every launch and CPU sample under it carries the innermost live node
 *               (sl_event.bwd_node, set by sl_op_context).
 * Both events carry the node's first 64 bytes (vtable pointer, sequence number, forward thread
 * id): user space decodes them with the layout of the running torch. One uprobe hit per node
 * created (plus the Python stack walk) and per node evaluated; both entries start with `push`.
 */
#include "stacklens.h"

#define SL_AG_NEW 0
#define SL_AG_EVAL 1

BPF_PERCPU_ARRAY(node_scratch, struct sl_event, 1);

static __always_inline int sl_autograd(struct pt_regs *ctx, u32 which)
{
    if (!sl_enter())
        return 0;
    u64 node = 0;
    if (which == SL_AG_NEW) {
        if (bpf_probe_read_user(&node, sizeof(node), (void *)ctx->si) != 0)
            return 0;
    } else {
        node = ctx->dx;
    }
    if (!node)
        return 0;
    u32 zero = 0;
    struct sl_event *ev = node_scratch.lookup(&zero);
    if (!ev)
        return 0;
    __builtin_memset(ev, 0, sizeof(*ev));
    if (bpf_probe_read_user(ev->blob, SL_BLOB, (void *)node) != 0)
        return 0;
    struct sl_shadow *s = sl_shadow_get(BPF_LOCAL_STORAGE_GET_F_CREATE);
    u64 *tag = (u64 *)&ev->blob[16];
    if (which == SL_AG_NEW) {
        /* one event per node: set_gradient_edge runs once per output of the op */
        if (s && s->new_node == node && s->new_tag[0] == tag[0] && s->new_tag[1] == tag[1])
            return 0;
        if (s) {
            s->new_node = node;
            s->new_tag[0] = tag[0];
            s->new_tag[1] = tag[1];
        }
    } else if (s) {
        /* push the node over the evaluations still live here (a reentrant backward nests them);
         * deeper than SL_BWD_DEPTH, the innermost one replaces the top */
        u32 b = sl_bwd_live_depth(s, ctx->sp);
        if (b >= SL_BWD_DEPTH)
            b = SL_BWD_DEPTH - 1;
        struct sl_bwd_entry *e = &s->bwd[sl_bwd_idx(b)];
        u64 ret = 0;
        bpf_probe_read_user(&ret, sizeof(ret), (void *)ctx->sp);
        e->sp = ctx->sp;
        e->ret = ret;
        e->node = node;
        s->bwd_depth = b + 1;
    }
    u64 id = bpf_get_current_pid_tgid();
    ev->kind = which == SL_AG_NEW ? SL_EV_NODE_NEW : SL_EV_NODE_EVAL;
    ev->spec = which;
    ev->pid = id >> 32;
    ev->tid = (u32)id;
    ev->ktime_ns = bpf_ktime_get_ns();
    ev->stack_id = -1;
    ev->args[0] = node;
    if (which == SL_AG_NEW) {
        u64 bwd = 0;
        sl_op_context(ctx->sp, &ev->op_depth, &ev->op_hash, &bwd);
#ifndef SL_AG_NO_PYSTACK   /* benchmarks only: the link without the Python walk at creation */
        sl_capture_pystack_memo(ctx, ev);
#endif
    }
    sl_emit(ctx, ev);
    return 0;
}

#ifndef SL_NO_COOKIE
int sl_autograd_multi(struct pt_regs *ctx)
{
    return sl_autograd(ctx, (u32)bpf_get_attach_cookie(ctx));
}
#else
/* per-probe fallback: one program per entry point */
int sl_autograd_0(struct pt_regs *ctx) { return sl_autograd(ctx, SL_AG_NEW); }
int sl_autograd_1(struct pt_regs *ctx) { return sl_autograd(ctx, SL_AG_EVAL); }
#endif
