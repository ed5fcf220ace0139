/* fake_cuda.c — a stand-in libcuda.so.1 with the real CUDA driver API names and signatures.
 *
 * No GPU: every call records nothing and returns CUDA_SUCCESS; cuStreamSynchronize and friends
 * sleep FAKE_SYNC_US microseconds (default 20000) so tests can check measured wait times.
 * Versioned exports as libcuda has them: cuda.h #defines a call to its newest ABI (CUDA 13:
 * cuCtxSynchronize -> cuCtxSynchronize_v2; per-thread default stream: _ptsz / _ptds), the old
 * names stay exported for old binaries. Each export enters the "driver" once (a static
 * implementation), except cuCtxSynchronize: a thin wrapper calling cuCtxSynchronize_v2, the
 * shape that could count one call twice.
 * Built by tests/bpf/conftest.py with frame pointers (so user stacks unwind through it).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUfunc_st *CUfunction;
typedef struct CUkern_st *CUkernel;
typedef struct CUmod_st *CUmodule;
typedef struct CUlib_st *CUlibrary;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUctx_st *CUcontext;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUlaunchAttribute_st { int id; int pad; char value[64]; } CUlaunchAttribute;
typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

#define EXPORT __attribute__((visibility("default"), noinline))

static volatile unsigned long long fake_launches;

/* Every fake API calls this, so each starts with `push %rbp` like real driver entry points:
 * x86 uprobes emulate a push, while a first instruction that must be single-stepped out of
 * line costs a second trap (~18 µs instead of ~1 µs per hit on the Firecracker VM). */
__attribute__((noinline)) static void fake_count(void)
{
    fake_launches++;
    __asm__ volatile("" ::: "memory");
}
static unsigned long long next_ptr = 0x7f0000000000ULL;

#include "fake_sleep.h"

static void fake_sleep_us(long us)
{
    unsigned long long t0 = fake_now_ns();
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0) {}
    fake_record_sleep(t0);
}

static long sync_us(void)
{
    const char *s = getenv("FAKE_SYNC_US");
    return s ? atol(s) : 20000;
}

EXPORT CUresult cuInit(unsigned int flags) { (void)flags; return 0; }

EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                               unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                               unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                               void **kernelParams, void **extra)
{
    (void)f; (void)gridDimX; (void)gridDimY; (void)gridDimZ; (void)blockDimX; (void)blockDimY;
    (void)blockDimZ; (void)sharedMemBytes; (void)hStream; (void)kernelParams; (void)extra;
    fake_count();
    return 0;
}

EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                    unsigned int bx, unsigned int by, unsigned int bz, unsigned int sm,
                                    CUstream s, void **p, void **e)
{
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)sm; (void)s; (void)p; (void)e;
    fake_count();
    return 0;
}

EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    (void)config; (void)f; (void)kernelParams; (void)extra;
    fake_count();
    return 0;
}

EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                          unsigned int bx, unsigned int by, unsigned int bz,
                                          unsigned int sm, CUstream s, void **p)
{
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)sm; (void)s; (void)p;
    fake_count();
    return 0;
}

EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s) { (void)g; (void)s; fake_count(); return 0; }

/* stream capture: the calls a torch.cuda.graph capture makes around its launches */
EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, int mode) { (void)s; (void)mode; fake_count(); return 0; }
EXPORT CUresult cuStreamEndCapture(CUstream s, void **graph)
{
    (void)s;
    if (graph)
        *graph = (void *)0x6a6a;
    fake_count();
    return 0;
}

EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    (void)hmod;
    /* a stable fake handle per name */
    unsigned long long h = 0xf00000;
    for (const char *c = name; *c; c++)
        h = h * 31 + (unsigned char)*c;
    *hfunc = (CUfunction)(uintptr_t)(h & 0xffffffffffffULL);
    return 0;
}

EXPORT CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    return cuModuleGetFunction((CUfunction *)pKernel, (CUmodule)library, name);
}

EXPORT CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)
{
    *pFunc = (CUfunction)((uintptr_t)kernel + 1);
    return 0;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    *dptr = next_ptr;
    next_ptr += (bytesize + 0xfff) & ~0xfffULL;
    return 0;
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream s)
{
    (void)s;
    return cuMemAlloc_v2(dptr, bytesize);
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) { (void)dptr; return 0; }
EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s) { (void)dptr; (void)s; return 0; }

EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) { (void)dst; (void)src; (void)n; return 0; }
EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{ (void)dst; (void)src; (void)n; (void)s; return 0; }
EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) { (void)dst; (void)src; (void)n; return 0; }
EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { (void)dst; (void)src; (void)n; return 0; }
EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) { (void)dst; (void)src; (void)n; return 0; }
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{ (void)dst; (void)src; (void)n; (void)s; return 0; }
EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s)
{ (void)dst; (void)src; (void)n; (void)s; return 0; }
EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{ (void)dst; (void)src; (void)n; (void)s; return 0; }

/* the pre-3.2 ABI (32-bit device pointers and sizes): not probed (bpf/spec.py) */
EXPORT CUresult cuMemcpyHtoD(unsigned int dst, const void *src, unsigned int n) { (void)dst; (void)src; (void)n; return 0; }
EXPORT CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n) { (void)dst; (void)src; (void)n; return 0; }
EXPORT CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{ (void)dst; (void)src; (void)n; (void)s; return 0; }

EXPORT CUresult cuStreamSynchronize(CUstream s) { (void)s; fake_sleep_us(sync_us()); return 0; }
EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s) { (void)s; fake_sleep_us(sync_us()); return 0; }
EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx) { (void)ctx; fake_sleep_us(sync_us()); return 0; }
EXPORT CUresult cuCtxSynchronize(void) { return cuCtxSynchronize_v2(NULL); }
EXPORT CUresult cuEventSynchronize(CUevent e) { (void)e; fake_sleep_us(sync_us()); return 0; }

/* test helpers: C callers with frame pointers, and a tight loop for the benchmark */
EXPORT unsigned long long fake_cuda_launch_count(void) { return fake_launches; }

EXPORT void fake_cuda_launch_loop(CUfunction f, unsigned long long n)
{
    for (unsigned long long i = 0; i < n; i++)
        cuLaunchKernel(f, 1, 2, 3, 4, 5, 6, 0, 0, 0, 0);
}

/* the same loop paced to one launch every gap_ns (busy wait): a fixed event rate for the
 * loader-throughput benchmark */
EXPORT void fake_cuda_launch_paced(CUfunction f, unsigned long long n, unsigned long long gap_ns)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    unsigned long long next = ts.tv_sec * 1000000000ULL + ts.tv_nsec;
    for (unsigned long long i = 0; i < n; i++) {
        do {
            clock_gettime(CLOCK_MONOTONIC, &ts);
        } while (ts.tv_sec * 1000000000ULL + ts.tv_nsec < next);
        next += gap_ns;
        cuLaunchKernel(f, 1, 2, 3, 4, 5, 6, 0, 0, 0, 0);
    }
}
