/* fake_cuda_stripped.c — a libcuda.so.1 the way vendors ship it: built with -s, so only its
 * exports (cuInit, cuLaunchKernel, sl_steady_step) have names and its internals have none.
 *
 * sl_steady_step(x, reps) runs six internal functions (integer loops: CPU samples land on many
 * of their instructions); two of them go through one more internal function; each ends in
 * cuLaunchKernel from its own call site. Built with frame pointers so stacks unwind through it.
 */
#include <stdint.h>

#define EXPORT __attribute__((visibility("default"), noinline))
#define INTERNAL static __attribute__((noinline))

static volatile uint64_t sink;

EXPORT int cuInit(unsigned flags) { sink += flags; return 0; }

EXPORT int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, unsigned shm, void *stream, void **params, void **extra)
{
    sink += (uintptr_t)f + gx + gy + gz + bx + by + bz + shm + (uintptr_t)stream + (uintptr_t)params +
            (uintptr_t)extra;
    return 0;
}

#define LAUNCH(h) cuLaunchKernel((void *)(uintptr_t)(h), 1, 1, 1, 128, 1, 1, 0, 0, 0, 0)

INTERNAL uint64_t deeper(uint64_t x, int reps)
{
    for (int r = 0; r < reps; r++) { x ^= x >> 7; x *= 0xff51afd7ed558ccdULL; x += (uint64_t)r; }
    LAUNCH(0x9000);
    return x;
}

#define WORKER(i, K)                                                                        \
    INTERNAL uint64_t worker_##i(uint64_t x, int reps)                                     \
    {                                                                                      \
        for (int r = 0; r < reps; r++) { x = x * (K) + (i); x ^= x >> ((i) + 3); x += x << 5; } \
        if ((i) % 3 == 0) x = deeper(x, reps / 4);                                         \
        LAUNCH(0x1000 + (i) * 0x10);                                                       \
        return x;                                                                          \
    }

WORKER(0, 6364136223846793005ULL)
WORKER(1, 2862933555777941757ULL)
WORKER(2, 3202034522624059733ULL)
WORKER(3, 3935559000370003845ULL)
WORKER(4, 2685821657736338717ULL)
WORKER(5, 1181783497276652981ULL)

EXPORT uint64_t sl_steady_step(uint64_t x, int reps)
{
    x = worker_0(x, reps);
    x = worker_1(x, reps);
    x = worker_2(x, reps);
    x = worker_3(x, reps);
    x = worker_4(x, reps);
    x = worker_5(x, reps);
    return x;
}
