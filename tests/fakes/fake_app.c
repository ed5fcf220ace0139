/* fake_app.c — libfakeapp.so: "application" C callers of the fake GPU libraries, built with
 * frame pointers so the native stack of every probe event must show which caller launched. */
#include <stddef.h>
#include <stdint.h>

typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;
int cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                   CUstream, void **, void **);
int cuLaunchKernelEx(const CUlaunchConfig *, CUfunction, void **, void **);

#define EXPORT __attribute__((visibility("default"), noinline))

EXPORT void app_forward_launches(CUfunction f, int n)
{
    for (int i = 0; i < n; i++)
        cuLaunchKernel(f, 64, 2, 1, 256, 1, 1, 1024, (CUstream)0x5151, NULL, NULL);
    __asm__ volatile("" ::: "memory");
}

EXPORT void app_backward_launches(CUfunction f, int n)
{
    for (int i = 0; i < n; i++)
        cuLaunchKernel(f, 32, 4, 2, 128, 2, 3, 2048, (CUstream)0x5252, NULL, NULL);
    __asm__ volatile("" ::: "memory");
}

EXPORT void app_ex_launches(CUfunction f, int n)
{
    CUlaunchConfig c = {7, 8, 9, 32, 4, 2, 4096, (CUstream)0x5353, NULL, 0};
    for (int i = 0; i < n; i++)
        cuLaunchKernelEx(&c, f, NULL, NULL);
    __asm__ volatile("" ::: "memory");
}
