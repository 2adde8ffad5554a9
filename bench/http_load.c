/* The C load generator of bench/tunnel.py (`--generator c`): CLIENTS keep-alive HTTP/1.1
 * connections to 127.0.0.1:PORT, each with one request at a time, in one thread on one epoll
 * loop; every answer checked (status 200, Content-Length equal to EXPECT, the body read
 * through).
 *
 * Why: the generator shares the host's two cores with what it measures. bench/tunnel.py's
 * Python generator (uvloop, one Protocol per connection) costs ~11-13 us per request on this
 * host, as much as the relay; this one costs a few, so the rates and the half-load latencies
 * say more about the routes and less about the generator. It does what the Python one does:
 *
 * - the same request bytes for every request (read from REQUEST_FILE: head and body, built by
 *   bench/tunnel.py), written whole (a large body as the socket takes it);
 * - closed loop (RATE 0: each connection sends its next request when its answer is in), or
 *   paced at RATE requests/s in all: ARRIVALS `poisson` (exponential gaps of mean
 *   CLIENTS/RATE per connection, exact times from a timerfd) or `even` (every CLIENTS/RATE,
 *   the connections' phases spread evenly); a connection whose answer comes after its next
 *   time sends at once, and the latency counts from the actual send;
 * - a warm-up of WARM seconds, then a window of SECONDS: it prints `warm` and `end` on stdout
 *   at the two marks (bench/tunnel.py samples the other processes' CPU then), and finally one
 *   JSON line: requests answered in the window, its length, the generator's CPU in it, and
 *   the latencies (seconds) of the requests answered after the warm-up are written to
 *   LATENCY_FILE as native doubles. It exits when its stdin closes, so that the caller can
 *   still read its /proc entry at the `end` mark.
 *
 * A bad answer (another status or length, a connection closed) ends the run with exit status
 * 3 and the reason on stderr.
 *
 *   http_load PORT CLIENTS WARM SECONDS RATE ARRIVALS REQUEST_FILE EXPECT LATENCY_FILE
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include "bench_clock.h"

#define MAX_HEAD (64 * 1024)
#define READ_SIZE (256 * 1024)
#define TIMER_TAG UINT64_MAX

struct client {
    int fd;
    int busy;          /* a request is out and its answer not yet all in */
    size_t sent;       /* bytes of the request written so far */
    long long left;    /* body bytes of the answer still to read (-1: reading its head) */
    char head[MAX_HEAD];
    size_t head_len;
    double sent_at, next_at;
};

static char *request;
static size_t request_len;
static long long expect;
static int ep, n_clients;
static struct client *clients;
static double *latencies;
static size_t n_latencies, max_latencies;
static double warm_until, until;
static int warmed;

static void fail(const char *why, const struct client *c) {
    fprintf(stderr, "http_load: %s", why);
    if (c && c->head_len) { /* the answer's status line */
        const char *eol = memchr(c->head, '\r', c->head_len);
        int n = eol ? (int)(eol - c->head) : (int)(c->head_len < 80 ? c->head_len : 80);
        fprintf(stderr, " (answer: %.*s)", n, c->head);
    }
    fprintf(stderr, "\n");
    exit(3);
}

static void watch(struct client *c, unsigned events) {
    struct epoll_event e = {.events = events, .data.u64 = (uint64_t)(c - clients)};
    epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &e);
}

/* write what is left of the request; wait for room (EPOLLOUT) when the socket is full */
static void push(struct client *c) {
    while (c->sent < request_len) {
        ssize_t w = write(c->fd, request + c->sent, request_len - c->sent);
        if (w < 0) {
            if (errno == EAGAIN) {
                watch(c, EPOLLIN | EPOLLOUT);
                return;
            }
            fail("write failed: the server closed the connection", c);
        }
        c->sent += w;
    }
}

static void send_request(struct client *c, double now) {
    c->busy = 1;
    c->sent = 0;
    c->left = -1;
    c->head_len = 0;
    c->sent_at = now;
    push(c);
    if (c->sent == request_len && request_len > READ_SIZE)
        watch(c, EPOLLIN); /* a large request went whole after all: stop asking for room */
}

/* the answer's head is complete at c->head[0..end): check it, return the body length */
static long long parse_head(struct client *c, size_t end) {
    if (end < 12 || memcmp(c->head + 9, "200", 3) != 0)
        fail("an answer other than 200", c);
    long long length = -1;
    const char *line = memmem(c->head, end, "\r\n", 2);
    while (line && (size_t)(line - c->head) < end) {
        line += 2;
        if ((size_t)(c->head + end - line) > 15 && strncasecmp(line, "content-length:", 15) == 0)
            length = strtoll(line + 15, NULL, 10);
        line = memmem(line, c->head + end - line, "\r\n", 2);
    }
    if (length != expect)
        fail("an answer of another length than the request's body", c);
    return length;
}

/* the answer is in: count it, and (closed loop) send the next request */
static void answered(struct client *c, double now, long *done, double rate) {
    c->busy = 0;
    (*done)++;
    if (warmed && n_latencies < max_latencies)
        latencies[n_latencies++] = now - c->sent_at;
    if (rate <= 0 && now < until)
        send_request(c, now);
}

static void on_readable(struct client *c, char *buffer, long *done, double rate) {
    ssize_t r = read(c->fd, buffer, READ_SIZE);
    if (r <= 0) {
        if (r < 0 && errno == EAGAIN)
            return;
        fail("the server closed the connection", c);
    }
    if (!c->busy)
        fail("bytes nobody asked for", c);
    char *data = buffer;
    size_t n = r;
    while (n > 0) {
        if (c->left < 0) { /* the head: gather it until its blank line */
            size_t room = MAX_HEAD - c->head_len, take = n < room ? n : room;
            memcpy(c->head + c->head_len, data, take);
            size_t from = c->head_len > 3 ? c->head_len - 3 : 0;
            c->head_len += take;
            char *end = memmem(c->head + from, c->head_len - from, "\r\n\r\n", 4);
            if (!end) {
                if (c->head_len == MAX_HEAD)
                    fail("an answer head over 64 KiB", c);
                return;
            }
            size_t head_end = end - c->head + 4;
            size_t extra = c->head_len - head_end; /* body bytes that came with the head */
            c->left = parse_head(c, head_end - 4);
            data += take - extra;
            n -= take - extra;
        }
        size_t body = (long long)n < c->left ? n : (size_t)c->left;
        c->left -= body;
        data += body;
        n -= body;
        if (c->left == 0) {
            if (n > 0)
                fail("bytes after the answer (one request at a time)", c);
            answered(c, monotonic(), done, rate);
            return;
        }
    }
}

/* the requests answered, the time and the CPU used at one end of the measured window */
struct mark {
    long done;
    double time, cpu;
};

/* take a mark and say its name on stdout (the caller samples the other processes then) */
static int mark(const char *name, double now, long done, struct mark *out) {
    *out = (struct mark){done, now, cpu_seconds(RUSAGE_SELF)};
    printf("%s\n", name);
    fflush(stdout);
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 10) {
        fprintf(stderr, "usage: http_load PORT CLIENTS WARM SECONDS RATE ARRIVALS REQUEST_FILE "
                        "EXPECT LATENCY_FILE\n");
        return 2;
    }
    int port = atoi(argv[1]);
    n_clients = atoi(argv[2]);
    double warm = atof(argv[3]), seconds = atof(argv[4]), rate = atof(argv[5]);
    int poisson = strcmp(argv[6], "poisson") == 0;
    expect = atoll(argv[8]);
    FILE *f = fopen(argv[7], "rb");
    if (!f) {
        perror(argv[7]);
        return 2;
    }
    fseek(f, 0, SEEK_END);
    request_len = ftell(f);
    fseek(f, 0, SEEK_SET);
    request = malloc(request_len);
    if (fread(request, 1, request_len, f) != request_len) {
        perror("read request");
        return 2;
    }
    fclose(f);
    max_latencies = 4000000;
    latencies = malloc(max_latencies * sizeof *latencies);
    clients = calloc(n_clients, sizeof *clients);
    char *buffer = malloc(READ_SIZE);
    ep = epoll_create1(0);
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons(port)};
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (int i = 0; i < n_clients; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        if (connect(fd, (void *)&address, sizeof address)) {
            perror("connect");
            return 3;
        }
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        fcntl(fd, F_SETFL, O_NONBLOCK);
        clients[i].fd = fd;
        struct epoll_event e = {.events = EPOLLIN, .data.u64 = (uint64_t)i};
        epoll_ctl(ep, EPOLL_CTL_ADD, fd, &e);
    }
    int timer = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
    struct epoll_event te = {.events = EPOLLIN, .data.u64 = TIMER_TAG};
    epoll_ctl(ep, EPOLL_CTL_ADD, timer, &te);
    unsigned seed = 13;
    double mean = rate > 0 ? n_clients / rate : 0;
    double start = monotonic();
    warm_until = start + warm;
    until = warm_until + seconds;
    for (int i = 0; i < n_clients; i++) {
        if (rate > 0)
            clients[i].next_at = start + (poisson ? exponential(mean, &seed) : mean * i / n_clients);
        else
            send_request(&clients[i], start);
    }
    long done = 0;
    struct mark warm_at = {0}, end_at = {0};
    int ended = 0;
    struct epoll_event events[1024];
    for (;;) {
        double now = monotonic();
        if (!warmed && now >= warm_until)
            warmed = mark("warm", now, done, &warm_at);
        if (!ended && now >= until)
            ended = mark("end", now, done, &end_at);
        int in_flight = 0;
        double soonest = 0;
        for (int i = 0; i < n_clients; i++) {
            struct client *c = &clients[i];
            if (!c->busy && rate > 0 && !ended && c->next_at <= now) {
                c->next_at += poisson ? exponential(mean, &seed) : mean;
                send_request(c, now);
            }
            if (c->busy)
                in_flight++;
            else if (rate > 0 && !ended && (!soonest || c->next_at < soonest))
                soonest = c->next_at;
        }
        if (ended && !in_flight)
            break;
        if (soonest)
            arm(timer, soonest);
        double next_mark = !warmed ? warm_until : !ended ? until : now + 5;
        int timeout = (int)((next_mark - now) * 1000) + 1;
        int n = epoll_wait(ep, events, 1024, ended ? 5000 : timeout);
        if (n == 0 && ended)
            fail("no answer within 5 s of the end", NULL);
        for (int k = 0; k < n; k++) {
            uint64_t tag = events[k].data.u64;
            if (tag == TIMER_TAG) {
                uint64_t expirations;
                if (read(timer, &expirations, sizeof expirations) < 0 && errno != EAGAIN)
                    fail("timerfd", NULL);
                continue;
            }
            struct client *c = &clients[tag];
            if (events[k].events & EPOLLOUT) {
                push(c);
                if (c->sent == request_len)
                    watch(c, EPOLLIN);
            }
            if (events[k].events & (EPOLLIN | EPOLLHUP | EPOLLERR))
                on_readable(c, buffer, &done, rate);
        }
    }
    FILE *out = fopen(argv[9], "wb");
    if (!out || fwrite(latencies, sizeof *latencies, n_latencies, out) != n_latencies) {
        perror(argv[9]);
        return 2;
    }
    fclose(out);
    printf("{\"answered\": %ld, \"window\": %.6f, \"cpu\": %.6f, \"latencies\": %zu}\n",
           end_at.done - warm_at.done, end_at.time - warm_at.time, end_at.cpu - warm_at.cpu,
           n_latencies);
    fflush(stdout);
    /* stay until the caller closes stdin: it reads this process's /proc at the marks */
    while (getchar() != EOF)
        ;
    return 0;
}
