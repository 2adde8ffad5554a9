/* The kernel's floor for a relay that delivers each message to a different loopback TCP
 * connection (issue 12's SEND to one of 10,000 clients): one thread writes SIZE-byte messages
 * round-robin over N connections, another reads them all through epoll. No user-space work
 * besides the system calls, so the CPU each thread spends per message is what the kernel
 * charges for moving one message from a relay to a receiver on this machine.
 *
 * Built and run by bench/loopback_floor.py:  loopback_floor N MESSAGES SIZE
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "bench_clock.h"
#include "floor_net.h"

static int n_conns;
static long n_messages;
static int size;
static int *write_fds, *read_fds;
static volatile long written = -1;
static long would_block;
static double writer_cpu, reader_cpu;

static void *writer(void *unused) {
    static char message[65536];
    double start = cpu_seconds(RUSAGE_THREAD);
    long i;
    (void)unused;
    memset(message, 'x', sizeof message);
    for (i = 0; i < n_messages; i++) {
        if (write(write_fds[i % n_conns], message, size) < 0) {
            if (errno != EAGAIN) {
                perror("write");
                break;
            }
            would_block++; /* the reader fell behind: counted, not retried */
        }
    }
    writer_cpu = cpu_seconds(RUSAGE_THREAD) - start;
    written = i;
    return NULL;
}

static void *reader(void *unused) {
    static char buffer[65536];
    struct epoll_event events[1024];
    int ep = epoll_create1(0);
    long got = 0;
    double start = cpu_seconds(RUSAGE_THREAD);
    (void)unused;
    for (int i = 0; i < n_conns; i++) {
        struct epoll_event e = {.events = EPOLLIN, .data.fd = read_fds[i]};
        epoll_ctl(ep, EPOLL_CTL_ADD, read_fds[i], &e);
    }
    for (;;) {
        long sent = written;
        if (sent >= 0 && got >= (sent - would_block) * (long)size)
            break;
        int n = epoll_wait(ep, events, 1024, 200);
        for (int k = 0; k < n; k++) {
            ssize_t r = read(events[k].data.fd, buffer, sizeof buffer);
            if (r > 0)
                got += r;
        }
    }
    reader_cpu = cpu_seconds(RUSAGE_THREAD) - start;
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s CONNECTIONS MESSAGES SIZE\n", argv[0]);
        return 2;
    }
    n_conns = atoi(argv[1]);
    n_messages = atol(argv[2]);
    size = atoi(argv[3]);
    struct rlimit limit;
    getrlimit(RLIMIT_NOFILE, &limit);
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);
    if ((rlim_t)(2 * n_conns + 16) > limit.rlim_cur) {
        fprintf(stderr, "%d connections need %d descriptors; the limit is %ld\n", n_conns,
                2 * n_conns + 16, (long)limit.rlim_cur);
        return 2;
    }
    struct sockaddr_in address;
    int listener = floor_listen(&address);
    if (listener < 0) {
        perror("listen");
        return 1;
    }
    write_fds = calloc(n_conns, sizeof(int));
    read_fds = calloc(n_conns, sizeof(int));
    int one = 1;
    for (int i = 0; i < n_conns; i++) {
        write_fds[i] = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(write_fds[i], (void *)&address, sizeof address)) {
            perror("connect");
            return 1;
        }
        read_fds[i] = accept(listener, NULL, NULL);
        setsockopt(write_fds[i], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        fcntl(write_fds[i], F_SETFL, O_NONBLOCK);
        fcntl(read_fds[i], F_SETFL, O_NONBLOCK);
    }
    pthread_t writer_thread, reader_thread;
    double start = monotonic();
    pthread_create(&reader_thread, NULL, reader, NULL);
    pthread_create(&writer_thread, NULL, writer, NULL);
    pthread_join(writer_thread, NULL);
    double writing = monotonic() - start;
    pthread_join(reader_thread, NULL);
    printf("{\"connections\": %d, \"messages\": %ld, \"size\": %d, \"would_block\": %ld, "
           "\"written_per_s\": %.0f, \"writer_us_per_msg\": %.3f, \"reader_us_per_msg\": %.3f}\n",
           n_conns, written, size, would_block, written / writing, writer_cpu / written * 1e6,
           reader_cpu / written * 1e6);
    return 0;
}
