/* What the benchmark's C programs (http_load.c, loopback_floor.c, tunnel_floor.c) share about
 * time: the monotonic clock, CPU time from getrusage, and Poisson pacing on a timerfd (link
 * with -lm for log). One copy, so every program measures and paces the same way. */
#ifndef BENCH_CLOCK_H
#define BENCH_CLOCK_H

#include <math.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/timerfd.h>
#include <time.h>

/* seconds on CLOCK_MONOTONIC (the clock Python's time.monotonic reads) */
static inline double monotonic(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

/* user + system CPU seconds of RUSAGE_SELF (the process) or RUSAGE_THREAD (this thread) */
static inline double cpu_seconds(int who) {
    struct rusage r;
    getrusage(who, &r);
    return r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6 + r.ru_stime.tv_sec +
           r.ru_stime.tv_usec / 1e6;
}

/* an exponential gap of mean `mean` seconds: Poisson arrivals (`seed`: the caller's own) */
static inline double exponential(double mean, unsigned *seed) {
    double u = (rand_r(seed) + 1.0) / ((double)RAND_MAX + 2.0);
    return -mean * log(u);
}

/* the timerfd fires at `at` (monotonic seconds); a zero time would disarm it: 1 ns instead */
static inline void arm(int timer, double at) {
    struct itimerspec spec = {{0, 0}, {(time_t)at, (long)((at - (time_t)at) * 1e9)}};
    if (spec.it_value.tv_sec == 0 && spec.it_value.tv_nsec == 0)
        spec.it_value.tv_nsec = 1;
    timerfd_settime(timer, TFD_TIMER_ABSTIME, &spec, NULL);
}

#endif
