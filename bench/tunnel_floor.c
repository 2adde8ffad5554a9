/* The kernel's floor for the tunnel's request pattern (issue 13): what four parties that do
 * nothing but the system calls cost per tunnelled request on this machine.
 *
 *   client (CLIENTS connections) -> relay -> one connection -> connector -> TARGETS
 *   connections -> target, and each answer back the same way.
 *
 * Each party is a thread with its own epoll loop, as each is its own process in
 * bench/tunnel.py (threads of one process share an address space, not cores: the scheduler
 * puts them on the two cores as it does processes). Every hop is a plain write of the byte
 * count the tunnel sends there and a read of it, with no parsing: a message is found by its
 * length, and a frame on the relay-connector connection carries the client's index in its
 * first four bytes so the answer finds its way back. Like the relay and the connector, the
 * relay and the connector gather the frames of one loop turn (one epoll_wait's events) and
 * write them to the shared connection in one write; `--no-batch` writes each frame at once.
 *
 * With RATE > 0 the client paces its connections instead of sending the next request as soon
 * as an answer is in: each connection starts its requests at Poisson times (mean gap
 * CLIENTS / RATE, the clients together a Poisson stream of RATE), from a timerfd, one request
 * at a time per connection (a connection whose answer comes after its next time sends at
 * once), as bench/tunnel.py's generator does; the latency of each request from its send to
 * its whole answer is recorded. DIRECT=1 connects the client straight to the target (no
 * relay, no connector): the latency the tunnel's two hops add is the difference.
 *
 * Output (JSON): requests answered per second over the measured window, each thread's user
 * and system CPU microseconds per request (RUSAGE_THREAD), and the latency's p50 and p99.
 *
 * Built and run by bench/tunnel_floor.py:
 *   tunnel_floor CLIENTS TARGETS SECONDS REQ RESP FRAME_REQ FRAME_RESP TARGET_REQ TARGET_RESP
 *                BATCH RATE DIRECT WORK_US
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include "bench_clock.h"
#include "floor_net.h"

#define MAX_CONNS 4096
#define BUF (1 << 20)

static int n_clients, n_targets, batch, direct;
static double seconds, rate;
/* seconds of CPU the relay and the connector each spend per message they pass (half a
 * request's WORK_US each way): the user-space work a real relay adds to the system calls */
static double work;
/* bytes on each hop: client request/response, relay<->connector frames, connector<->target */
static int req, resp, frame_req, frame_resp, target_req, target_resp;
static volatile int stop;
static volatile long answered;

/* per-thread CPU over the measured window: [user, system] at the start and end marks */
enum { CLIENT, RELAY, CONNECTOR, TARGET, PARTIES };
static const char *names[PARTIES] = {"client", "relay", "connector", "target"};
static double cpu_start[PARTIES][2], cpu_end[PARTIES][2];
static volatile int mark_start, mark_end;

static void thread_cpu(double out[2]) {
    struct rusage r;
    getrusage(RUSAGE_THREAD, &r);
    out[0] = r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6;
    out[1] = r.ru_stime.tv_sec + r.ru_stime.tv_usec / 1e6;
}

/* each thread samples its own CPU when the main thread raises a mark */
static void marks(int party, int *started, int *ended) {
    if (!*started && mark_start) {
        thread_cpu(cpu_start[party]);
        *started = 1;
    }
    if (!*ended && mark_end) {
        thread_cpu(cpu_end[party]);
        *ended = 1;
    }
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void nonblocking(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fcntl(fd, F_SETFL, O_NONBLOCK);
}

static void watch(int ep, int fd, uint64_t tag) {
    struct epoll_event e = {.events = EPOLLIN, .data.u64 = tag};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &e))
        die("epoll_ctl");
}

/* write all of it: the sockets' buffers are large beside what is in flight, so a short write
 * is rare; when it happens we wait for room (spinning: it is counted, not hidden) */
static long short_writes;
static void write_all(int fd, const char *data, long n) {
    while (n > 0) {
        ssize_t w = write(fd, data, n);
        if (w < 0) {
            if (errno != EAGAIN)
                die("write");
            short_writes++;
            continue;
        }
        data += w;
        n -= w;
    }
}

static char zeros[BUF];

/* spend `work` seconds of this thread's CPU (no system call: the clock is the vDSO's) */
static void do_work(void) {
    if (work <= 0)
        return;
    double until = monotonic() + work;
    while (monotonic() < until)
        ;
}

/* ---- the four parties ------------------------------------------------------------------ */

static int *client_fds, *relay_client_fds, relay_link, connector_link, *connector_target_fds,
    *target_fds;

/* latencies (seconds) of the requests answered in the measured window, paced runs only */
static double *latencies;
static long n_latencies, max_latencies;

static int compare(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void *client(void *unused) {
    (void)unused;
    static char buffer[BUF];
    long *got = calloc(n_clients, sizeof(long));
    double *next_at = calloc(n_clients, sizeof(double)), *sent_at = calloc(n_clients, sizeof(double));
    char *busy = calloc(n_clients, 1);
    double mean = rate > 0 ? n_clients / rate : 0;
    unsigned seed = 13;
    int ep = epoll_create1(0), started = 0, ended = 0;
    int timer = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
    struct epoll_event events[1024];
    double now = monotonic();
    for (int i = 0; i < n_clients; i++) {
        watch(ep, client_fds[i], i);
        if (rate > 0) {
            next_at[i] = now + exponential(mean, &seed);
        } else {
            busy[i] = 1;
            write_all(client_fds[i], zeros, req);
        }
    }
    watch(ep, timer, (uint64_t)-1);
    while (!stop) {
        marks(CLIENT, &started, &ended);
        if (rate > 0) { /* send what is due, arm the timer for the next */
            double soonest = 0;
            now = monotonic();
            for (int i = 0; i < n_clients; i++) {
                if (busy[i])
                    continue;
                if (next_at[i] <= now) {
                    busy[i] = 1;
                    sent_at[i] = now;
                    next_at[i] += exponential(mean, &seed);
                    write_all(client_fds[i], zeros, req);
                } else if (!soonest || next_at[i] < soonest) {
                    soonest = next_at[i];
                }
            }
            if (soonest)
                arm(timer, soonest);
        }
        int n = epoll_wait(ep, events, 1024, 50);
        for (int k = 0; k < n; k++) {
            uint64_t tag = events[k].data.u64;
            if (tag == (uint64_t)-1) {
                uint64_t expirations;
                if (read(timer, &expirations, sizeof expirations) < 0 && errno != EAGAIN)
                    die("timerfd");
                continue;
            }
            int i = tag;
            ssize_t r = read(client_fds[i], buffer, sizeof buffer);
            if (r <= 0)
                continue;
            got[i] += r;
            while (got[i] >= resp) { /* one request at a time per connection: never more */
                got[i] -= resp;
                answered++;
                if (rate > 0) {
                    busy[i] = 0;
                    if (started && !ended && n_latencies < max_latencies)
                        latencies[n_latencies++] = monotonic() - sent_at[i];
                } else {
                    write_all(client_fds[i], zeros, req);
                }
            }
        }
    }
    marks(CLIENT, &started, &ended);
    return NULL;
}

/* the relay: whole client requests become frames to the connector (gathered per loop turn),
 * whole frames from the connector become responses to their clients */
static void *relay(void *unused) {
    (void)unused;
    static char buffer[BUF], out[BUF], from_link[2 * BUF];
    long *got = calloc(n_clients, sizeof(long)), pending = 0, link_got = 0;
    int ep = epoll_create1(0), started = 0, ended = 0;
    struct epoll_event events[1024];
    for (int i = 0; i < n_clients; i++)
        watch(ep, relay_client_fds[i], i);
    watch(ep, relay_link, (uint64_t)-1);
    while (!stop) {
        marks(RELAY, &started, &ended);
        int n = epoll_wait(ep, events, 1024, 50);
        for (int k = 0; k < n; k++) {
            uint64_t tag = events[k].data.u64;
            if (tag == (uint64_t)-1) {
                ssize_t r = read(relay_link, from_link + link_got, sizeof from_link - link_got);
                if (r <= 0)
                    continue;
                link_got += r;
                long at = 0;
                while (link_got - at >= frame_resp) {
                    uint32_t i;
                    memcpy(&i, from_link + at, 4);
                    do_work();
                    write_all(relay_client_fds[i], zeros, resp);
                    at += frame_resp;
                }
                memmove(from_link, from_link + at, link_got - at);
                link_got -= at;
                continue;
            }
            int i = tag;
            ssize_t r = read(relay_client_fds[i], buffer, sizeof buffer);
            if (r <= 0)
                continue;
            got[i] += r;
            while (got[i] >= req) {
                got[i] -= req;
                do_work();
                uint32_t index = i;
                memcpy(out + pending, &index, 4);
                pending += frame_req;
                if (!batch || pending + frame_req > (long)sizeof out) {
                    write_all(relay_link, out, pending);
                    pending = 0;
                }
            }
        }
        if (pending) { /* the loop turn's frames, in one write */
            write_all(relay_link, out, pending);
            pending = 0;
        }
    }
    marks(RELAY, &started, &ended);
    return NULL;
}

/* the connector: each frame goes to an idle target connection as a request; each whole
 * target response becomes a frame back to the relay (gathered per loop turn) */
static void *connector(void *unused) {
    (void)unused;
    static char buffer[BUF], out[BUF], from_link[2 * BUF];
    long *got = calloc(n_targets, sizeof(long)), pending = 0, link_got = 0;
    uint32_t *owner = calloc(n_targets, sizeof(uint32_t));
    int *idle = calloc(n_targets, sizeof(int)), n_idle = n_targets;
    int ep = epoll_create1(0), started = 0, ended = 0;
    struct epoll_event events[1024];
    for (int t = 0; t < n_targets; t++) {
        idle[t] = t;
        watch(ep, connector_target_fds[t], t);
    }
    watch(ep, connector_link, (uint64_t)-1);
    while (!stop) {
        marks(CONNECTOR, &started, &ended);
        int n = epoll_wait(ep, events, 1024, 50);
        for (int k = 0; k < n; k++) {
            uint64_t tag = events[k].data.u64;
            if (tag == (uint64_t)-1) {
                ssize_t r =
                    read(connector_link, from_link + link_got, sizeof from_link - link_got);
                if (r <= 0)
                    continue;
                link_got += r;
                long at = 0;
                while (link_got - at >= frame_req) {
                    if (!n_idle) {
                        fprintf(stderr, "no idle target connection: use --targets >= clients\n");
                        exit(1);
                    }
                    int t = idle[--n_idle];
                    memcpy(&owner[t], from_link + at, 4);
                    do_work();
                    write_all(connector_target_fds[t], zeros, target_req);
                    at += frame_req;
                }
                memmove(from_link, from_link + at, link_got - at);
                link_got -= at;
                continue;
            }
            int t = tag;
            ssize_t r = read(connector_target_fds[t], buffer, sizeof buffer);
            if (r <= 0)
                continue;
            got[t] += r;
            if (got[t] >= target_resp) {
                got[t] -= target_resp;
                do_work();
                memcpy(out + pending, &owner[t], 4);
                pending += frame_resp;
                idle[n_idle++] = t;
                if (!batch || pending + frame_resp > (long)sizeof out) {
                    write_all(connector_link, out, pending);
                    pending = 0;
                }
            }
        }
        if (pending) {
            write_all(connector_link, out, pending);
            pending = 0;
        }
    }
    marks(CONNECTOR, &started, &ended);
    return NULL;
}

static void *target(void *unused) {
    (void)unused;
    static char buffer[BUF];
    long *got = calloc(n_targets, sizeof(long));
    int ep = epoll_create1(0), started = 0, ended = 0;
    struct epoll_event events[1024];
    for (int t = 0; t < n_targets; t++)
        watch(ep, target_fds[t], t);
    while (!stop) {
        marks(TARGET, &started, &ended);
        int n = epoll_wait(ep, events, 1024, 50);
        for (int k = 0; k < n; k++) {
            int t = events[k].data.u64;
            ssize_t r = read(target_fds[t], buffer, sizeof buffer);
            if (r <= 0)
                continue;
            got[t] += r;
            while (got[t] >= target_req) {
                got[t] -= target_req;
                write_all(target_fds[t], zeros, target_resp);
            }
        }
    }
    marks(TARGET, &started, &ended);
    return NULL;
}

/* ---- set-up ------------------------------------------------------------------------------ */

static void pair(int listener, struct sockaddr_in *address, int *a, int *b) {
    *a = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(*a, (void *)address, sizeof *address))
        die("connect");
    *b = accept(listener, NULL, NULL);
    if (*b < 0)
        die("accept");
    nonblocking(*a);
    nonblocking(*b);
}

int main(int argc, char **argv) {
    if (argc != 14) {
        fprintf(stderr,
                "usage: %s CLIENTS TARGETS SECONDS REQ RESP FRAME_REQ FRAME_RESP TARGET_REQ "
                "TARGET_RESP BATCH RATE DIRECT WORK_US\n",
                argv[0]);
        return 2;
    }
    n_clients = atoi(argv[1]);
    n_targets = atoi(argv[2]);
    seconds = atof(argv[3]);
    req = atoi(argv[4]);
    resp = atoi(argv[5]);
    frame_req = atoi(argv[6]);
    frame_resp = atoi(argv[7]);
    target_req = atoi(argv[8]);
    target_resp = atoi(argv[9]);
    batch = atoi(argv[10]);
    rate = atof(argv[11]);
    direct = atoi(argv[12]);
    work = atof(argv[13]) / 2e6;
    if (direct) { /* the client's connections are the target's: it answers them itself */
        n_targets = n_clients;
        target_req = req;
        target_resp = resp;
    }
    max_latencies = rate > 0 ? (long)(rate * seconds * 2) + 1000 : 0;
    latencies = calloc(max_latencies + 1, sizeof(double));
    if (n_clients > MAX_CONNS || n_targets > MAX_CONNS || frame_req < 4 || frame_resp < 4) {
        fprintf(stderr, "at most %d connections; frames of at least 4 bytes\n", MAX_CONNS);
        return 2;
    }
    struct sockaddr_in address;
    int listener = floor_listen(&address);
    if (listener < 0)
        die("listen");
    client_fds = calloc(n_clients, sizeof(int));
    relay_client_fds = calloc(n_clients, sizeof(int));
    connector_target_fds = calloc(n_targets, sizeof(int));
    target_fds = calloc(n_targets, sizeof(int));
    if (direct) {
        for (int i = 0; i < n_clients; i++)
            pair(listener, &address, &client_fds[i], &target_fds[i]);
    } else {
        for (int i = 0; i < n_clients; i++)
            pair(listener, &address, &client_fds[i], &relay_client_fds[i]);
        pair(listener, &address, &connector_link, &relay_link);
        for (int t = 0; t < n_targets; t++)
            pair(listener, &address, &connector_target_fds[t], &target_fds[t]);
    }

    pthread_t threads[PARTIES];
    void *(*bodies[PARTIES])(void *) = {client, relay, connector, target};
    for (int p = PARTIES - 1; p >= 0; p--) { /* the client last: everyone listens first */
        if (direct && (p == RELAY || p == CONNECTOR))
            continue;
        pthread_create(&threads[p], NULL, bodies[p], NULL);
    }
    struct timespec warm = {0, 300 * 1000 * 1000};
    nanosleep(&warm, NULL);
    long answered0 = answered;
    double t0 = monotonic();
    mark_start = 1;
    struct timespec span = {(time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9)};
    nanosleep(&span, NULL);
    mark_end = 1;
    long answered1 = answered;
    double t1 = monotonic();
    /* every thread samples its end mark within one epoll_wait timeout (50 ms) */
    struct timespec settle = {0, 120 * 1000 * 1000};
    nanosleep(&settle, NULL);
    stop = 1;
    for (int p = 0; p < PARTIES; p++)
        if (!direct || (p != RELAY && p != CONNECTOR))
            pthread_join(threads[p], NULL);
    long count = answered1 - answered0;
    double p50 = 0, p99 = 0;
    if (n_latencies) {
        qsort(latencies, n_latencies, sizeof(double), compare);
        p50 = latencies[n_latencies / 2];
        p99 = latencies[(long)(n_latencies * 0.99)];
    }
    printf("{\"clients\": %d, \"targets\": %d, \"batch\": %d, \"rate\": %.0f, \"direct\": %d, "
           "\"requests\": %ld, \"rps\": %.0f, \"short_writes\": %ld, \"p50_ms\": %.3f, "
           "\"p99_ms\": %.3f",
           n_clients, n_targets, batch, rate, direct, count, count / (t1 - t0), short_writes,
           p50 * 1e3, p99 * 1e3);
    for (int p = 0; p < PARTIES; p++)
        printf(", \"%s_user_us\": %.3f, \"%s_sys_us\": %.3f", names[p],
               (cpu_end[p][0] - cpu_start[p][0]) / count * 1e6, names[p],
               (cpu_end[p][1] - cpu_start[p][1]) / count * 1e6);
    printf("}\n");
    return 0;
}
