/* The C echo target of bench/tunnel.py (`--target c`): an HTTP/1.1 server answering every
 * request with its own body (`200`, `application/octet-stream`, `Content-Length`), in one
 * thread on one epoll loop.
 *
 * Why: the tunnel benchmark measures the tunnel, and every route of it shares two cores with
 * its target. bench/echo_target.py (uvloop) costs ~11-13 us per small request on this host,
 * about what the relay itself costs; this server costs a few, so the rates say more about
 * the tunnel and the baseline and less about the echo. It speaks the same HTTP/1.1 as the
 * Python one:
 *
 * - keep-alive (HTTP/1.1 by default, `Connection: close` honoured, HTTP/1.0 closes unless it
 *   asks for keep-alive) and pipelining (requests answered in order, one at a time);
 * - request bodies framed by `Content-Length` (echoed as they arrive: the head goes out at
 *   once, each piece follows, and reading stops while an answer waits for room in the socket,
 *   so a 1 MiB body costs no buffering) or `Transfer-Encoding: chunked` (collected, answered
 *   with its length; chunk extensions and trailers skipped);
 * - a malformed request (a head over 64 KiB, a bad Content-Length or chunk size, another
 *   transfer coding) gets `400` and the connection closes.
 *
 * Built by bench/floor_build.py and run by bench/tunnel.py: `echo_target --port PORT` prints
 * `listening` when it accepts connections and serves until killed.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_HEAD (64 * 1024)
#define READ_SIZE (256 * 1024)
#define LISTENER_TAG ((void *)1)

static const char BAD[] = "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

enum state { HEAD, ECHO, CHUNK_SIZE, CHUNK_DATA, CHUNK_CRLF, TRAILER };

struct conn {
    int fd;
    enum state state;
    /* unparsed input (a head being read, or chunked framing) */
    char *in;
    size_t in_len, in_cap;
    /* output not yet taken by the socket: reading stops while there is any */
    char *out;
    size_t out_len, out_off, out_cap;
    long long remaining; /* ECHO: body bytes still to echo; CHUNK_DATA: chunk bytes left */
    char *body;          /* a chunked body being collected */
    size_t body_len, body_cap;
    int close_after, closing, reading;
    /* an answer's head not yet written: it goes out with the first piece of the body, so a
     * small answer is one write (one segment) as the Python target's is */
    char head[160];
    int head_len;
};

static int ep;

static void reserve(char **data, size_t *cap, size_t need) {
    if (need <= *cap)
        return;
    size_t cap2 = *cap ? *cap : 4096;
    while (cap2 < need)
        cap2 *= 2;
    char *grown = realloc(*data, cap2);
    if (!grown) {
        perror("realloc");
        exit(1);
    }
    *data = grown;
    *cap = cap2;
}

static void append(char **data, size_t *len, size_t *cap, const char *bytes, size_t n) {
    reserve(data, cap, *len + n);
    memcpy(*data + *len, bytes, n);
    *len += n;
}

static void set_events(struct conn *c, unsigned events) {
    struct epoll_event e = {.events = events, .data.ptr = c};
    epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &e);
}

static void drop(struct conn *c) {
    close(c->fd);
    free(c->in);
    free(c->out);
    free(c->body);
    free(c);
}

/* queue bytes for the client (after the pending head, if any), writing at once what the
 * socket takes */
static void send_bytes(struct conn *c, const char *bytes, size_t n) {
    if (c->out_len == c->out_off) {
        c->out_len = c->out_off = 0;
        struct iovec parts[2] = {{c->head, c->head_len}, {(void *)bytes, n}};
        size_t total = c->head_len + n;
        ssize_t w = writev(c->fd, parts, 2);
        if (w < 0) {
            if (errno != EAGAIN) {
                c->closing = 1; /* the client went away: nothing more to say to it */
                return;
            }
            w = 0;
        }
        if ((size_t)w == total) {
            c->head_len = 0;
            return;
        }
        if ((size_t)w < (size_t)c->head_len) { /* keep the rest of the head, then the bytes */
            append(&c->out, &c->out_len, &c->out_cap, c->head + w, c->head_len - w);
            w = 0;
        } else {
            w -= c->head_len;
        }
        bytes += w;
        n -= w;
    } else if (c->head_len) {
        append(&c->out, &c->out_len, &c->out_cap, c->head, c->head_len);
    }
    c->head_len = 0;
    append(&c->out, &c->out_len, &c->out_cap, bytes, n);
}

static void answer_head(struct conn *c, long long length) {
    c->head_len = snprintf(c->head, sizeof c->head,
                     "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                     "Content-Length: %lld\r\n%s\r\n",
                     length, c->close_after ? "Connection: close\r\n" : "");
}

static void bad_request(struct conn *c) {
    send_bytes(c, BAD, sizeof BAD - 1);
    c->closing = 1;
}

/* the request is answered: the next one may start (or the connection ends) */
static void finish_request(struct conn *c) {
    if (c->head_len) /* an empty body: the head alone */
        send_bytes(c, NULL, 0);
    c->state = HEAD;
    if (c->close_after)
        c->closing = 1;
}

static int header_is(const char *line, size_t n, const char *name) {
    size_t k = strlen(name);
    return n > k && line[k] == ':' && strncasecmp(line, name, k) == 0;
}

static const char *header_value(const char *line, size_t n, size_t *value_len) {
    const char *colon = memchr(line, ':', n), *end = line + n;
    const char *v = colon + 1;
    while (v < end && (*v == ' ' || *v == '\t'))
        v++;
    while (end > v && (end[-1] == ' ' || end[-1] == '\t'))
        end--;
    *value_len = end - v;
    return v;
}

static int value_has(const char *v, size_t n, const char *token) {
    size_t k = strlen(token);
    for (size_t i = 0; i + k <= n; i++)
        if (strncasecmp(v + i, token, k) == 0)
            return 1;
    return 0;
}

/* parse the head at c->in[0..end): the request's framing and keep-alive; -1 when malformed */
static int parse_head(struct conn *c, size_t end) {
    const char *head = c->in;
    const char *line_end = memmem(head, end, "\r\n", 2);
    size_t first = line_end ? (size_t)(line_end - head) : end;
    int http10 = first >= 8 && memcmp(head + first - 8, "HTTP/1.0", 8) == 0;
    int keep_alive = 0, chunked = 0;
    long long length = 0;
    c->close_after = http10;
    size_t at = first + 2;
    while (at < end) {
        const char *line = head + at;
        const char *next = memmem(line, end - at, "\r\n", 2);
        size_t n = next ? (size_t)(next - line) : end - at;
        size_t vn;
        if (header_is(line, n, "content-length")) {
            const char *v = header_value(line, n, &vn);
            char *stop;
            char digits[32];
            if (vn == 0 || vn >= sizeof digits)
                return -1;
            memcpy(digits, v, vn);
            digits[vn] = 0;
            length = strtoll(digits, &stop, 10);
            if (*stop || length < 0 || !isdigit((unsigned char)digits[0]))
                return -1;
        } else if (header_is(line, n, "transfer-encoding")) {
            const char *v = header_value(line, n, &vn);
            if (vn != 7 || strncasecmp(v, "chunked", 7) != 0)
                return -1;
            chunked = 1;
        } else if (header_is(line, n, "connection")) {
            const char *v = header_value(line, n, &vn);
            if (value_has(v, vn, "close"))
                c->close_after = 1;
            else if (value_has(v, vn, "keep-alive"))
                keep_alive = 1;
        }
        at += n + 2;
    }
    if (http10 && keep_alive)
        c->close_after = 0;
    if (chunked) {
        c->state = CHUNK_SIZE;
        c->body_len = 0;
        return 0;
    }
    answer_head(c, length);
    c->remaining = length;
    c->state = ECHO;
    if (length == 0)
        finish_request(c);
    return 0;
}

/* where `mark` (a head's or a line's end) starts in data[0..n), or NULL: more bytes are
 * needed, or there were too many without it (then the request is refused) */
static char *find_end(struct conn *c, char *data, size_t n, const char *mark) {
    char *end = n ? memmem(data, n, mark, strlen(mark)) : NULL;
    if (!end && n > MAX_HEAD)
        bad_request(c);
    return end;
}

/* consume what is in c->in; returns when it needs more bytes or the connection must close */
static void process(struct conn *c) {
    size_t at = 0;
    while (!c->closing && c->out_len == c->out_off) {
        char *data = c->in + at;
        size_t n = c->in_len - at;
        if (c->state == HEAD) {
            char *end = find_end(c, data, n, "\r\n\r\n");
            if (!end)
                break;
            /* parse in place: move the head to the start of the buffer first */
            size_t head_len = end - data;
            if (head_len > MAX_HEAD) {
                bad_request(c);
                break;
            }
            memmove(c->in, data, c->in_len - at);
            c->in_len -= at;
            at = 0;
            if (parse_head(c, head_len) < 0) {
                bad_request(c);
                break;
            }
            at = head_len + 4;
        } else if (c->state == ECHO) {
            if (!n)
                break;
            size_t take = (long long)n < c->remaining ? n : (size_t)c->remaining;
            send_bytes(c, data, take);
            at += take;
            c->remaining -= take;
            if (!c->remaining)
                finish_request(c);
        } else if (c->state == CHUNK_SIZE || c->state == TRAILER) {
            char *eol = find_end(c, data, n, "\r\n");
            if (!eol)
                break;
            size_t line = eol - data;
            at += line + 2;
            if (c->state == TRAILER) {
                if (line == 0) { /* the end of the trailers: answer with the whole body */
                    answer_head(c, (long long)c->body_len);
                    send_bytes(c, c->body, c->body_len);
                    c->body_len = 0;
                    finish_request(c);
                }
                continue;
            }
            char *stop;
            long long size = strtoll(data, &stop, 16);
            if (stop == data || size < 0 || (stop < eol && *stop != ';' && *stop != ' ')) {
                bad_request(c);
                break;
            }
            c->remaining = size;
            c->state = size ? CHUNK_DATA : TRAILER;
        } else if (c->state == CHUNK_DATA) {
            if (!n)
                break;
            size_t take = (long long)n < c->remaining ? n : (size_t)c->remaining;
            append(&c->body, &c->body_len, &c->body_cap, data, take);
            at += take;
            c->remaining -= take;
            if (!c->remaining)
                c->state = CHUNK_CRLF;
        } else { /* CHUNK_CRLF */
            if (n < 2)
                break;
            if (data[0] != '\r' || data[1] != '\n') {
                bad_request(c);
                break;
            }
            at += 2;
            c->state = CHUNK_SIZE;
        }
    }
    memmove(c->in, c->in + at, c->in_len - at);
    c->in_len -= at;
}

/* after a read or a drained write: watch for input only while nothing waits to be written */
static void settle(struct conn *c) {
    if (c->closing && c->out_len == c->out_off) {
        drop(c);
        return;
    }
    int reading = c->out_len == c->out_off && !c->closing;
    set_events(c, reading ? EPOLLIN : EPOLLOUT);
    c->reading = reading;
}

static void on_readable(struct conn *c) {
    reserve(&c->in, &c->in_cap, c->in_len + READ_SIZE);
    ssize_t r = read(c->fd, c->in + c->in_len, READ_SIZE);
    if (r <= 0) {
        if (r < 0 && errno == EAGAIN)
            return;
        drop(c);
        return;
    }
    c->in_len += r;
    process(c);
    if (c->out_len != c->out_off || c->closing)
        settle(c);
}

static void on_writable(struct conn *c) {
    while (c->out_off < c->out_len) {
        ssize_t w = write(c->fd, c->out + c->out_off, c->out_len - c->out_off);
        if (w < 0) {
            if (errno == EAGAIN)
                return;
            drop(c);
            return;
        }
        c->out_off += w;
    }
    c->out_len = c->out_off = 0;
    process(c); /* what arrived while the answer waited */
    settle(c);
}

int main(int argc, char **argv) {
    if (argc != 3 || strcmp(argv[1], "--port") != 0) {
        fprintf(stderr, "usage: echo_target --port PORT\n");
        return 2;
    }
    int listener = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[2]))};
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(listener, (void *)&address, sizeof address) || listen(listener, 4096)) {
        perror("listen");
        return 1;
    }
    fcntl(listener, F_SETFL, O_NONBLOCK);
    ep = epoll_create1(0);
    struct epoll_event e = {.events = EPOLLIN, .data.ptr = LISTENER_TAG};
    epoll_ctl(ep, EPOLL_CTL_ADD, listener, &e);
    printf("listening\n");
    fflush(stdout);
    struct epoll_event events[256];
    for (;;) {
        int n = epoll_wait(ep, events, 256, -1);
        for (int k = 0; k < n; k++) {
            if (events[k].data.ptr == LISTENER_TAG) {
                int fd;
                while ((fd = accept4(listener, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    struct conn *c = calloc(1, sizeof *c);
                    c->fd = fd;
                    c->reading = 1;
                    struct epoll_event ce = {.events = EPOLLIN, .data.ptr = c};
                    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ce);
                }
                continue;
            }
            struct conn *c = events[k].data.ptr;
            if (c->reading)
                on_readable(c);
            else
                on_writable(c);
        }
    }
}
