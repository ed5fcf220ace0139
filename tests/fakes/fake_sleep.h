/* fake_sleep.h — shared by the fake GPU libraries (fake_cuda.c, fake_hip.c). */
#pragma once
#include <time.h>

/* each sleep as the fake itself measured it (CLOCK_MONOTONIC around the nanosleep loop): the
 * truth a probe's duration is checked against; on a loaded machine a 30 ms sleep takes longer */
#define FAKE_SLEPT_MAX 256
__attribute__((visibility("default"))) volatile unsigned long long fake_slept_ns[FAKE_SLEPT_MAX];
__attribute__((visibility("default"))) volatile unsigned int fake_sleeps;

static unsigned long long fake_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000000ULL + (unsigned long long)t.tv_nsec;
}

static void fake_record_sleep(unsigned long long t0)
{
    unsigned long long d = fake_now_ns() - t0;
    if (fake_sleeps < FAKE_SLEPT_MAX)
        fake_slept_ns[fake_sleeps] = d;
    fake_sleeps++;
}
