/* fake_hip.c — a stand-in libamdhip64.so with the real HIP names and signatures (no GPU).
 * hipStreamSynchronize/hipDeviceSynchronize sleep FAKE_SYNC_US microseconds (default 20000). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

typedef int hipError_t;
typedef struct ihipStream_t *hipStream_t;
typedef struct ihipEvent_t *hipEvent_t;
typedef struct ihipModuleSymbol_t *hipFunction_t;
typedef struct ihipModule_t *hipModule_t;
typedef void *hipDeviceptr_t;
typedef struct dim3 { uint32_t x, y, z; } dim3;
typedef enum hipMemcpyKind { hipMemcpyHostToHost = 0, hipMemcpyHostToDevice = 1, hipMemcpyDeviceToHost = 2,
                             hipMemcpyDeviceToDevice = 3, hipMemcpyDefault = 4 } hipMemcpyKind;

#define EXPORT __attribute__((visibility("default"), noinline))

static volatile unsigned long long fake_launches;
static uintptr_t next_ptr = 0x7e0000000000ULL;

#include "fake_sleep.h"

static void fake_sleep(void)
{
    unsigned long long t0 = fake_now_ns();
    const char *s = getenv("FAKE_SYNC_US");
    long us = s ? atol(s) : 20000;
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0) {}
    fake_record_sleep(t0);
}

/* a "kernel host stub": hipLaunchKernel gets its address */
EXPORT void fake_hip_vector_add_stub(void) {}

EXPORT hipError_t hipLaunchKernel(const void *function_address, dim3 numBlocks, dim3 dimBlocks, void **args,
                                  size_t sharedMemBytes, hipStream_t stream)
{
    (void)function_address; (void)numBlocks; (void)dimBlocks; (void)args; (void)sharedMemBytes; (void)stream;
    fake_launches++;
    return 0;
}

EXPORT hipError_t hipExtLaunchKernel(const void *function_address, dim3 numBlocks, dim3 dimBlocks, void **args,
                                     size_t sharedMemBytes, hipStream_t stream, hipEvent_t startEvent,
                                     hipEvent_t stopEvent, int flags)
{
    (void)startEvent; (void)stopEvent; (void)flags;
    return hipLaunchKernel(function_address, numBlocks, dimBlocks, args, sharedMemBytes, stream);
}

EXPORT hipError_t hipModuleLaunchKernel(hipFunction_t f, unsigned int gridDimX, unsigned int gridDimY,
                                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                        unsigned int blockDimZ, unsigned int sharedMemBytes, hipStream_t stream,
                                        void **kernelParams, void **extra)
{
    (void)f; (void)gridDimX; (void)gridDimY; (void)gridDimZ; (void)blockDimX; (void)blockDimY; (void)blockDimZ;
    (void)sharedMemBytes; (void)stream; (void)kernelParams; (void)extra;
    fake_launches++;
    return 0;
}

EXPORT hipError_t hipModuleGetFunction(hipFunction_t *function, hipModule_t module, const char *kname)
{
    (void)module;
    uintptr_t h = 0xe00000;
    for (const char *c = kname; *c; c++)
        h = h * 31 + (unsigned char)*c;
    *function = (hipFunction_t)(h & 0xffffffffffffULL);
    return 0;
}

EXPORT hipError_t hipMalloc(void **ptr, size_t size)
{
    *ptr = (void *)next_ptr;
    next_ptr += (size + 0xfff) & ~(uintptr_t)0xfff;
    return 0;
}

EXPORT hipError_t hipFree(void *ptr) { (void)ptr; return 0; }
EXPORT hipError_t hipMemcpy(void *dst, const void *src, size_t sizeBytes, hipMemcpyKind kind)
{ (void)dst; (void)src; (void)sizeBytes; (void)kind; return 0; }
EXPORT hipError_t hipMemcpyAsync(void *dst, const void *src, size_t sizeBytes, hipMemcpyKind kind, hipStream_t s)
{ (void)dst; (void)src; (void)sizeBytes; (void)kind; (void)s; return 0; }
EXPORT hipError_t hipMemcpyHtoD(hipDeviceptr_t dst, void *src, size_t n) { (void)dst; (void)src; (void)n; return 0; }
EXPORT hipError_t hipMemcpyDtoH(void *dst, hipDeviceptr_t src, size_t n) { (void)dst; (void)src; (void)n; return 0; }
EXPORT hipError_t hipMemcpyDtoD(hipDeviceptr_t dst, hipDeviceptr_t src, size_t n) { (void)dst; (void)src; (void)n; return 0; }
EXPORT hipError_t hipStreamSynchronize(hipStream_t s) { (void)s; fake_sleep(); return 0; }
EXPORT hipError_t hipDeviceSynchronize(void) { fake_sleep(); return 0; }
