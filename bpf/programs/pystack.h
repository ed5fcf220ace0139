/* pystack.h — read the current thread's CPython stack synchronously, inside a BPF probe.
 *
 * Records (code object address, byte offset of the current instruction, tag, flags) per frame,
 * innermost first; user space (pystacks/pysym.py) turns them into file:qualname:line.
 *
 * Every parameter is a -D flag (pystacks/python_process.py: PythonStackReader.cflags()):
 *   SL_PY_TGID            target process (tgid); other processes get SL_PY_NOT_TARGET
 *   SL_PY_INTERP          address of the main PyInterpreterState (validates the tstate)
 *   SL_PY_TLS_OFF         fsbase + this = glibc TSS slot holding the thread's PyThreadState
 *                         (0: no TLS lookup; pass the tstate yourself, e.g. from a tid map)
 *   SL_PY_TARGET_PARAMS   (stacklens.h) the three above are per process, read from the
 *                         current target (sl_cur(): one program serves several processes)
 *   SL_TASK_FSBASE_OFF    offsetof(struct task_struct, thread.fsbase) from the kernel's BTF
 *   SL_PY_MAX_DEPTH       frames kept (default 48); deeper stacks set `truncated`
 *   SL_PY_NO_TAG          do not read the per-frame code tag (one read less per frame)
 *   layout (pystacks/python_process.py bpf_defines()): SL_PY_FRAME_STYLE, SL_PY_TS_INTERP,
 *   SL_PY_TS_FRAME, SL_PY_CFRAME_CUR, SL_PY_F_PREV, SL_PY_F_CODE, SL_PY_F_INSTR, SL_PY_F_OWNER,
 *   SL_PY_F_IS_ENTRY, SL_PY_F_READ, SL_PY_OWNER_SHIM_MIN, SL_PY_CODE_ADAPTIVE,
 *   SL_PY_CODE_TAG_OFF, SL_PY_CODE_MASK.
 *
 * The core below uses no maps, so it works from a plain #include (BCC rewrites map calls only
 * in the main file): the caller supplies `out` (ring buffer record or per-CPU scratch; it is
 * too big for the BPF stack). With -DSL_PYSTACK_MAPS the file also defines maps and
 * SL_CAPTURE_PYSTACK(ctx, ev) for stacklens.h; that part must be compiled as main-file text.
 *
 * Cost: one kernel read (fsbase), one user read (TSS slot), two for tstate->interp and the
 * frame pointer, then per frame one read of SL_PY_F_READ bytes and one of the 16-byte tag.
 */
#ifndef STACKLENS_PYSTACK_H
#define STACKLENS_PYSTACK_H

#ifndef SL_PY_MAX_DEPTH
#define SL_PY_MAX_DEPTH 48
#endif
#ifndef SL_PY_TLS_OFF
#define SL_PY_TLS_OFF 0
#endif
#ifndef SL_TASK_FSBASE_OFF
#define SL_TASK_FSBASE_OFF 0
#endif
#if !defined(SL_PY_TGID) && !defined(SL_PY_TARGET_PARAMS)
#error "SL_PY_TGID must be set (PythonStackReader.cflags())"
#endif
#ifndef SL_PY_FRAME_STYLE
#error "Python layout -D flags missing (PythonStackReader.cflags())"
#endif

/* status of a read (struct sl_pystack.status) */
#define SL_PY_OK 0
#define SL_PY_NOT_TARGET 1   /* event from another process */
#define SL_PY_NO_TSTATE 2    /* thread has no PyThreadState: not a Python thread (no frames) */
#define SL_PY_BAD_TSTATE 3   /* tstate of another interpreter, or unreadable */
#define SL_PY_READ_ERR 4     /* a frame could not be read (stack kept up to there) */

/* struct sl_pyframe.flags */
#define SL_PYF_ENTRY 1       /* outermost frame of one _PyEval_EvalFrameDefault invocation */
#define SL_PYF_NOCODE 2      /* code pointer unreadable / NULL */

struct sl_pyframe {
    u64 code;      /* PyCodeObject * */
    u64 tag;       /* co_filename ^ co_name pointers at read time: detects code-object reuse */
    s32 offset;    /* byte offset of the current instruction in co_code; <0 = not started */
    u32 flags;     /* SL_PYF_* */
};

struct sl_pystack {
    u32 depth;     /* frames[0..depth) valid, innermost first */
    u16 status;    /* SL_PY_* */
    u8 truncated;  /* more frames than SL_PY_MAX_DEPTH: outermost ones are missing */
    u8 pad;
    u64 tstate;
    struct sl_pyframe frames[SL_PY_MAX_DEPTH];
};

/* ---- per-process parameters: -D flags, or the current target's (SL_PY_TARGET_PARAMS) ---- */
#ifdef SL_PY_TARGET_PARAMS
static __always_inline u64 sl_py_interp(void)
{
    struct sl_target *t = sl_cur();
    return t ? t->py_interp : 0;
}

static __always_inline u64 sl_py_tls_off(void)
{
    struct sl_target *t = sl_cur();
    return t ? t->py_tls_off : 0;
}
#else
static __always_inline u64 sl_py_interp(void) { return SL_PY_INTERP; }
static __always_inline u64 sl_py_tls_off(void) { return SL_PY_TLS_OFF; }
#endif

/* The current thread's PyThreadState from glibc's TSS slot, or 0. */
static __always_inline u64 sl_py_tstate_tls(void)
{
    u64 off = sl_py_tls_off();
    if (!off || !SL_TASK_FSBASE_OFF)
        return 0;
    u64 fsbase = 0, ts = 0;
    struct task_struct *task = (struct task_struct *)bpf_get_current_task();
    if (bpf_probe_read_kernel(&fsbase, sizeof(fsbase), (char *)task + SL_TASK_FSBASE_OFF) || !fsbase)
        return 0;
    if (bpf_probe_read_user(&ts, sizeof(ts), (void *)(fsbase + off)))
        return 0;
    return ts;
}

/* Walk from `tstate` (0 = no Python on this thread). Always fills out->status/depth. */
static __always_inline int sl_walk_pystack(u64 tstate, struct sl_pystack *out)
{
    out->depth = 0;
    out->truncated = 0;
    out->tstate = tstate;
    if (!tstate) {
        out->status = SL_PY_NO_TSTATE;
        return 0;
    }
    u64 interp = 0, frame = 0;
    if (bpf_probe_read_user(&interp, sizeof(interp), (void *)(tstate + SL_PY_TS_INTERP)) ||
        interp != sl_py_interp()) {
        out->status = SL_PY_BAD_TSTATE;
        return -1;
    }
    if (bpf_probe_read_user(&frame, sizeof(frame), (void *)(tstate + SL_PY_TS_FRAME))) {
        out->status = SL_PY_READ_ERR;
        return -1;
    }
#if SL_PY_CFRAME_CUR >= 0
    if (frame && bpf_probe_read_user(&frame, sizeof(frame), (void *)(frame + SL_PY_CFRAME_CUR))) {
        out->status = SL_PY_READ_ERR;
        return -1;
    }
#endif
    out->status = SL_PY_OK;
    u32 n = 0;
    u8 buf[SL_PY_F_READ];
#pragma unroll
    for (int i = 0; i < SL_PY_MAX_DEPTH + 8; i++) {   /* +8: room for skipped shim frames */
        if (!frame)
            break;
        if (n >= SL_PY_MAX_DEPTH) {
            out->truncated = 1;
            break;
        }
        if (bpf_probe_read_user(buf, sizeof(buf), (void *)frame)) {
            out->status = SL_PY_READ_ERR;
            break;
        }
        u64 prev = *(u64 *)(buf + SL_PY_F_PREV);
#if SL_PY_F_OWNER >= 0 && SL_PY_OWNER_SHIM_MIN >= 0
        if ((u8)buf[SL_PY_F_OWNER] >= SL_PY_OWNER_SHIM_MIN) {
            /* C-stack / interpreter shim frame: the frame before it (outer side of the run
             * just recorded) was the first of one eval-loop invocation. */
            if (n > 0 && n <= SL_PY_MAX_DEPTH)
                out->frames[n - 1].flags |= SL_PYF_ENTRY;
            frame = prev;
            continue;
        }
#endif
        struct sl_pyframe *f = &out->frames[n];
        u64 code = *(u64 *)(buf + SL_PY_F_CODE) & (u64)SL_PY_CODE_MASK;
        f->code = code;
        f->flags = code ? 0 : SL_PYF_NOCODE;
#if SL_PY_FRAME_STYLE == 310
        s32 lasti = *(s32 *)(buf + SL_PY_F_INSTR);
        f->offset = lasti < 0 ? -1 : lasti * 2;
#else
        u64 instr = *(u64 *)(buf + SL_PY_F_INSTR);
        f->offset = (s32)(instr - (code + SL_PY_CODE_ADAPTIVE));
#endif
#if SL_PY_F_IS_ENTRY >= 0
        if (buf[SL_PY_F_IS_ENTRY])
            f->flags |= SL_PYF_ENTRY;
#endif
        f->tag = 0;
#ifndef SL_PY_NO_TAG
        if (code) {
            u64 tag[2] = {0, 0};
            if (bpf_probe_read_user(tag, sizeof(tag), (void *)(code + SL_PY_CODE_TAG_OFF)) == 0)
                f->tag = tag[0] ^ tag[1];
        }
#endif
        n++;
        frame = prev;
    }
    if (n < SL_PY_MAX_DEPTH + 1 && frame && !out->truncated && out->status == SL_PY_OK)
        out->truncated = 1;   /* loop bound hit (many shim frames) */
    out->depth = n;
    return 0;
}

#ifdef SL_PY_TGID
/* Read the calling thread's Python stack (TLS lookup). 0 = read (maybe empty), <0 = failed. */
static __always_inline int sl_read_pystack(struct pt_regs *ctx, struct sl_pystack *out)
{
    if ((bpf_get_current_pid_tgid() >> 32) != SL_PY_TGID) {
        out->depth = 0;
        out->truncated = 0;
        out->tstate = 0;
        out->status = SL_PY_NOT_TARGET;
        return 0;
    }
    return sl_walk_pystack(sl_py_tstate_tls(), out);
}
#endif

/* ---- optional maps + the stacklens.h hook (main-file text only, see above) ------------- */
#ifdef SL_PYSTACK_MAPS
#ifndef SL_PY_STACKS
#define SL_PY_STACKS 16384
#endif
BPF_PERCPU_ARRAY(sl_py_scratch, struct sl_pystack, 1);
BPF_TABLE("lru_hash", u64, struct sl_pystack, sl_py_stacks, SL_PY_STACKS);
BPF_HASH(sl_py_threads, u32, u64, 4096);   /* tid -> tstate, when TLS is unavailable */

/* Returns a stack id (hash of the frames; 0 = no Python stack) and stores the stack under it. */
static __always_inline u64 sl_pystack_id(void *ctx, int *err)
{
    u32 zero = 0;
    struct sl_pystack *s = sl_py_scratch.lookup(&zero);
    *err = 0;
    if (!s)
        return 0;
    u64 ts = sl_py_tstate_tls();
    if (!ts) {
        u32 tid = (u32)bpf_get_current_pid_tgid();
        u64 *t = sl_py_threads.lookup(&tid);
        if (t)
            ts = *t;
    }
    if (sl_walk_pystack(ts, s) < 0)
        *err = 1;
    if (s->depth == 0)
        return 0;
    /* seeded with the process: one map holds the stacks of every process the program serves */
    u64 h = (1469598103934665603ULL ^ s->truncated) + ((bpf_get_current_pid_tgid() >> 32) << 8);
#pragma clang loop unroll(disable)
    for (int i = 0; i < SL_PY_MAX_DEPTH; i++) {
        if (i >= s->depth)
            break;
        h = (h ^ s->frames[i].code) * 1099511628211ULL;
        h = (h ^ (u32)s->frames[i].offset ^ ((u64)s->frames[i].flags << 32)) * 1099511628211ULL;
    }
    h |= 1;  /* never 0 */
    /* ids are content hashes: a stack already stored needs no 1.2 KB copy (the lookup also
     * refreshes its LRU position) */
    if (!sl_py_stacks.lookup(&h))
        sl_py_stacks.update(&h, s);
    return h;
}

#ifndef SL_CAPTURE_PYSTACK
#define SL_CAPTURE_PYSTACK(ctx, ev) do {                      \
        int __sl_py_err = 0;                                  \
        (ev)->py_stack_id = sl_pystack_id((ctx), &__sl_py_err); \
        if (__sl_py_err)                                      \
            sl_count(SL_C_PY_ERR);                            \
    } while (0)
#endif
#endif /* SL_PYSTACK_MAPS */

#endif /* STACKLENS_PYSTACK_H */
