/* What the kernel-floor programs (loopback_floor.c, tunnel_floor.c) share: a listening socket
 * on an ephemeral loopback port, the one every connection of a run goes through. */
#ifndef FLOOR_NET_H
#define FLOOR_NET_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

/* Listen on 127.0.0.1 at a port the kernel picks; `address` gets it (for connect). Returns the
 * listening descriptor, or -1 with errno set (the caller says what failed). */
static int floor_listen(struct sockaddr_in *address) {
    int listener = socket(AF_INET, SOCK_STREAM, 0);
    if (listener < 0)
        return -1;
    *address = (struct sockaddr_in){.sin_family = AF_INET, .sin_port = 0};
    address->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof *address;
    if (bind(listener, (void *)address, sizeof *address) || listen(listener, 4096) ||
        getsockname(listener, (void *)address, &length))
        return -1;
    return listener;
}

#endif
