/*
 * shadowtest recorder: TCP payload of chosen connections, from syscall tracepoints.
 *
 * Kernel requirements: Linux >= 5.8 (BPF ring buffer, bounded loops), tracepoints
 * syscalls:sys_{enter,exit}_* and sock:inet_sock_set_state, root (CAP_BPF + CAP_PERFMON).
 * No kprobes and no kernel struct reads: every field comes from a tracepoint's own format
 * or from user memory (sockaddr, msghdr, iovec), so the program does not depend on kernel
 * headers matching the running kernel.
 *
 * Overhead: one hash lookup on every read/write-family syscall of the traced processes
 * (early return for sockets that are not ours); payload copies only for matching
 * connections, at most MAX_BYTES per syscall in CHUNK-sized ring-buffer records (one record
 * for a syscall of at most CHUNK bytes, however many iovecs it used). Records are written
 * without waking user space (BPF_RB_NO_WAKEUP): the loader drains the ring on a timer, and when
 * WAKE_BYTES of payload have been written on a CPU since its last wake-up.
 *
 * Large syscalls (more than CHUNK bytes, up to MAX_BYTES, e.g. a 4 MiB gRPC message in one
 * sendmsg): one bounded loop whose step takes the next iovec when needed and copies the next
 * piece into the record being filled, sending it when it holds CHUNK bytes (copy_big). Its state
 * lives in a map, so the verifier walks each step once: linear in BIG_IOVS + MAX_BYTES / CHUNK.
 * (bpf_loop would be cheaper to verify, but bcc 0.26 cannot relocate its callback.) The last
 * record of such a syscall wakes the poller (BPF_RB_FORCE_WAKEUP): megabytes may arrive faster
 * than the timer drains them.
 *
 * Zero-copy sends (sendfile64, splice; tee/vmsplice work on pipes only and copy_file_range on
 * regular files only, so none of them moves socket bytes): the bytes never pass through a buffer
 * the program could read. A header-only DATA record with `discarded` = NC_SENDFILE or NC_SPLICE
 * and `total` = the bytes moved tells user space, which records them as not captured, with their
 * length and time, so a decoder steps over them (an HTTP/1 body sent by sendfile after its head).
 *
 *   accept4/connect --(port, pid, cgroup filter)--> socks[(tgid,fd)] --> OPEN event
 *   read/write/readv/writev/sendto/recvfrom/sendmsg/recvmsg on socks --> DATA events
 *   close on socks --> CLOSE event;  ring buffer full --> lost[cpu]++
 *   any of them on tls_socks (set by tls.bpf.c) --> a DATA header with the length only (NC_TLS)
 *
 * Positions: socks[] counts the bytes each direction has moved (every syscall that moved any, its
 * record sent or not), each DATA record says where its syscall's bytes start, and the CLOSE record
 * carries the final counts. A full ring therefore never loses bytes silently: user space sees the
 * jump and records a gap of exactly that size there (capture/ebpf/streams.py).
 *
 * Receive flags (recvfrom, recvmsg; read/readv have none; recvmmsg is not traced): a read is data
 * the application received only if it consumed bytes into its buffer. MSG_PEEK (with or without
 * MSG_TRUNC) consumes nothing: the same bytes come again in a later read, so a peek is not
 * recorded at all; nor is MSG_ERRQUEUE, which reads the socket's error queue, not the stream.
 * MSG_TRUNC without MSG_PEEK on a TCP stream (what the recorder traces) drops the returned number
 * of bytes without copying any (tcp(7)): the buffer holds whatever it held before, so it is never
 * read; a header-only DATA record with `discarded` set and `total` = the bytes dropped tells user
 * space, which records a gap of that length (loader.py, FlowSink.discarded). The check costs
 * nothing on other sockets: the flags are tested before the socket lookup.
 *
 * Accepts with no address (libuv: uvloop, Node.js call accept4(fd, NULL, NULL, flags)) carry no
 * peer to match against `pending`, so the listening socket decides instead: listeners[(tgid,fd)]
 * says whether it is on the port. It is learnt from listen() (the CLOSE->LISTEN state change runs
 * in the listening task and names the port), from an addressed accept that matched, and by the
 * loader (/proc at start; /proc at accept time for a listener reported unknown, LISTENER event).
 * Such a socket is traced at once with the peer unknown (peer_unknown, opened_ns as its
 * identity): the loader reads it from /proc when it handles the OPEN, and the close supplies it
 * too: close/shutdown make the ESTABLISHED->FIN_WAIT1 or CLOSE_WAIT->LAST_ACK change in the
 * closing task, with both ends in the tracepoint; that socket's CLOSE is sent at close's exit.
 *
 * Placeholders substituted by the loader in one place (capture/ebpf/loader.py):
 *   FILTER_PORT (0 = any), FILTER_PID (0 = any), FILTER_CGROUP (0 = any, else the cgroup v2 id: `cgroup_under` holds it),
 *   FILTER_TGID_MAP (1 = only tgids in the `tgids` map, for cgroup v1), SIDE_SERVER (1|0),
 *   MAX_BYTES, CHUNK (a power of two, 4-64 KiB), MAX_IOV, BIG_IOVS, RINGBUF_PAGES, SCRATCH_CPUS,
 *   WAKE_BYTES.
 */
#include <uapi/linux/ptrace.h>

#define EV_DATA 1
#define EV_OPEN 2
#define EV_CLOSE 3
#define EV_LISTENER 4         /* an accept with no address on a listener not known yet (fd: it) */

#define K_READ 1
#define K_WRITE 2
#define K_READV 3
#define K_WRITEV 4
#define K_RECVMSG 5
#define K_SENDMSG 6
#define K_DISCARD 7           /* recv with MSG_TRUNC (not MSG_PEEK): ret bytes dropped, none copied */
#define K_SENDFILE 8          /* sendfile64 to the socket: ret bytes sent from a file, none readable */
#define K_SPLICE_OUT 9        /* splice from a pipe to the socket */
#define K_SPLICE_IN 10        /* splice from the socket to a pipe */

/* ev_hdr.discarded: why a DATA record carries no payload for `total` bytes */
#define NC_TRUNC 1            /* recv with MSG_TRUNC: dropped unread */
#define NC_SENDFILE 2         /* sent by sendfile */
#define NC_SPLICE 3           /* moved by splice */
#define NC_TLS 4              /* ciphertext of a socket whose plaintext the TLS program records */

/* recv flags, as in <linux/socket.h> (own names: that header may come in through bcc's) */
#define RECV_PEEK 0x2         /* MSG_PEEK */
#define RECV_TRUNC 0x20       /* MSG_TRUNC */
#define RECV_ERRQUEUE 0x2000  /* MSG_ERRQUEUE */

struct sock_info {            /* one traced socket */
    u8 family;
    u8 is_server;             /* 1: this process accepted it */
    u16 lport;
    u16 rport;                /* 0 while peer_unknown and not learnt */
    u8 peer_unknown;          /* 1: accepted with no address; the loader or the close finds the peer */
    u8 pad;
    u8 laddr[16];
    u8 raddr[16];
    u64 opened_ns;            /* peer_unknown sockets: identity of this accept (its fd may be reused) */
    u64 rd;                   /* bytes read so far (every syscall that moved any, copied or not) */
    u64 wr;                   /* bytes written so far */
};

struct ev_hdr {               /* every ring-buffer record starts with this */
    u64 ts_ns;
    u64 pos;                  /* DATA: position of the syscall's first byte in its direction's stream */
    u32 tgid;
    u32 fd;
    u32 len;                  /* payload bytes in this record */
    u32 total;                /* bytes the syscall moved (DATA) */
    u32 offset;               /* offset of this record within the syscall */
    u8 type;
    u8 is_write;              /* DATA: 1 write-family, 0 read-family */
    u8 truncated;             /* DATA: the syscall moved more than MAX_BYTES */
    u8 discarded;             /* DATA: no payload for `total` bytes: NC_TRUNC, NC_SENDFILE, NC_SPLICE */
    struct sock_info si;      /* OPEN; CLOSE: the final positions (and the peer, if learnt) */
    char comm[16];
};

struct ev_buf {
    struct ev_hdr h;
    /* Twice CHUNK: an append of up to CHUNK bytes at any fill below CHUNK is provably in bounds,
     * which the verifier cannot see from `fill + n <= CHUNK` (it does not track that relation). */
    u8 data[2 * CHUNK];
};

struct active_io {            /* syscall arguments kept from enter to exit */
    u64 ptr;                  /* buf, iovec array or msghdr */
    u64 cnt;                  /* iovcnt for readv/writev */
    u32 fd;
    u32 kind;
};

struct pending_conn {         /* an established server-side connection not yet accepted */
    u8 family;
    u16 lport;
    u8 laddr[16];
};

struct user_iovec { u64 base; u64 len; };
struct user_msghdr_s { u64 name; u32 namelen; u32 pad; u64 iov; u64 iovlen; };
struct sa_in { u16 family; u16 port; u32 addr; };
struct sa_in6 { u16 family; u16 port; u32 flow; u8 addr[16]; };
struct accept_args { u64 addr; u32 fd; };
struct listener { u16 lport; u8 family; u8 ours; };   /* ours: on FILTER_PORT (or any, when 0) */
struct closing_sock {         /* a peer_unknown socket in close/shutdown, by thread */
    struct sock_info si;
    u32 fd;
    u8 learnt;                /* si has the peer */
    u8 is_close;
};

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
/* Public: the TLS program (tls.bpf.c, loaded beside this one in the same process) copies plaintext
 * only of the sockets in `socks`, and puts into `tls_socks` the recorded sockets whose ciphertext
 * goes through an SSL call it traces: their bytes are sent here as a length only (NC_TLS), since the
 * plaintext is what gets stored. The loader gives both maps names unique to this recorder. */
BPF_TABLE_PUBLIC("hash", u64, struct sock_info, socks, 65536);
BPF_TABLE_PUBLIC("hash", u64, u8, tls_socks, 65536);
BPF_HASH(active, u64, struct active_io, 16384);
BPF_HASH(accepting, u64, struct accept_args, 16384);
BPF_TABLE("lru_hash", u64, struct pending_conn, pending, 16384);
BPF_HASH(tgids, u32, u8, 4096);
/* --cgroup on cgroup v2: the directory (set from user space); a task in it or in a cgroup under it */
BPF_CGROUP_ARRAY(cgroup_under, 1);
BPF_TABLE("lru_hash", u64, struct listener, listeners, 16384);   /* (tgid, listening fd) */
BPF_HASH(listening, u64, u32, 1024);          /* thread inside listen() -> its fd */
BPF_HASH(closing, u64, struct closing_sock, 1024);
/* One record buffer per CPU. A plain array indexed by CPU, not a per-CPU array: per-CPU values
 * are limited to 32 KiB and CHUNK may be 64 KiB. */
BPF_ARRAY(scratch, struct ev_buf, SCRATCH_CPUS);
/* 0 until the loader has attached every probe. bcc attaches the tracepoints one by one, over
 * hundreds of milliseconds: a connection accepted half-way would have its reads recorded and its
 * writes not, and its requests paired with later answers. So a socket enters `socks` only once
 * armed; the loader joins the connections opened before that from /proc. */
BPF_ARRAY(armed, u32, 1);
BPF_PERCPU_ARRAY(lost, u64, 1);
BPF_PERCPU_ARRAY(truncated, u64, 1);
BPF_PERCPU_ARRAY(unwoken, u64, 1);    /* payload bytes written on this CPU since its last wake-up */

static __always_inline int is_armed(void) {
    int zero = 0;
    u32 *a = armed.lookup(&zero);
    return a && *a;
}

static __always_inline int wanted_task(u32 tgid) {
    if (FILTER_PID && tgid != FILTER_PID)
        return 0;
    if (FILTER_CGROUP && cgroup_under.check_current_task(0) != 1)   /* the cgroup or one under it */
        return 0;
    if (FILTER_TGID_MAP && !tgids.lookup(&tgid))
        return 0;
    return 1;
}

static __always_inline u64 sock_key(u32 tgid, u32 fd) { return ((u64)tgid << 32) | fd; }

/* A wake-up for the poller once per WAKE_BYTES of payload written on a CPU (an irq_work on the traced
 * thread each, so not one per record): a stream of writes just under CHUNK (nginx's 32 KiB body
 * writes) fills the ring faster than the poller's timer drains it. */
static __always_inline u64 wake_flag(u32 size) {
    int zero = 0;
    u64 *pending = unwoken.lookup(&zero);
    if (!pending)
        return BPF_RB_NO_WAKEUP;
    *pending += size;
    if (*pending < WAKE_BYTES)
        return BPF_RB_NO_WAKEUP;
    *pending = 0;
    return BPF_RB_FORCE_WAKEUP;
}

static __always_inline void count(void *table_lookup_result) {
    u64 *v = table_lookup_result;
    if (v)
        __sync_fetch_and_add(v, 1);
}

/* This CPU's scratch event with a fresh header (events are too large for the BPF stack); NULL when
 * the per-CPU map has no slot, which cannot happen once the map is created. */
static __always_inline struct ev_buf *new_event(u32 tgid, u32 fd, u32 type) {
    u32 cpu = bpf_get_smp_processor_id();
    struct ev_buf *b = scratch.lookup(&cpu);
    if (!b)
        return 0;
    __builtin_memset(&b->h, 0, sizeof(b->h));
    b->h.ts_ns = bpf_ktime_get_ns();
    b->h.tgid = tgid;
    b->h.fd = fd;
    b->h.type = type;
    return b;
}

static __always_inline void emit_open(u32 tgid, u32 fd, struct sock_info *si) {
    int zero = 0;
    struct ev_buf *b = new_event(tgid, fd, EV_OPEN);
    if (!b)
        return;
    __builtin_memcpy(&b->h.si, si, sizeof(*si));
    bpf_get_current_comm(&b->h.comm, sizeof(b->h.comm));
    if (events.ringbuf_output(&b->h, sizeof(b->h), BPF_RB_NO_WAKEUP))
        count(lost.lookup(&zero));
}

/* ---- server side: learn the local end from the state change, the fd from accept4 ---- */

/* listen() moves the socket CLOSE->LISTEN in the caller's task, with the bound port as sport
 * (0 only for a listen() without bind(): then the listener stays unknown). */
static __always_inline int learn_listener(u16 sport, u16 family) {
    u64 id = bpf_get_current_pid_tgid();
    u32 *fd = listening.lookup(&id);
    if (!fd || !sport)
        return 0;
    struct listener l = {.lport = sport, .family = family};
    l.ours = !FILTER_PORT || sport == FILTER_PORT;
    u64 key = sock_key(id >> 32, *fd);
    listeners.update(&key, &l);
    return 0;
}

/* FIN_WAIT1 and LAST_ACK are only entered by close()/shutdown() of the socket itself, in the
 * caller's task (softirq work run in that task never makes these two changes). */
static __always_inline int learn_peer(u16 family, u16 sport, u16 dport, const u8 *saddr, const u8 *daddr,
                                      u32 alen) {
    u64 id = bpf_get_current_pid_tgid();
    struct closing_sock *c = closing.lookup(&id);
    if (!c || c->learnt || (c->si.lport && c->si.lport != sport))
        return 0;
    c->si.family = family;
    c->si.lport = sport;
    c->si.rport = dport;
    if (alen == 4) {
        __builtin_memcpy(c->si.laddr, saddr, 4);
        __builtin_memcpy(c->si.raddr, daddr, 4);
    } else {
        __builtin_memcpy(c->si.laddr, saddr, 16);
        __builtin_memcpy(c->si.raddr, daddr, 16);
    }
    c->learnt = 1;
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_listen) {
    u64 id = bpf_get_current_pid_tgid();
    if (!SIDE_SERVER || !wanted_task(id >> 32))
        return 0;
    u32 fd = args->fd;
    listening.update(&id, &fd);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_listen) {
    u64 id = bpf_get_current_pid_tgid();
    listening.delete(&id);
    return 0;
}

TRACEPOINT_PROBE(sock, inet_sock_set_state) {
    /* Copy the record first: variable offsets into the tracepoint context are refused. */
    struct tracepoint__sock__inet_sock_set_state a = {};
    bpf_probe_read_kernel(&a, sizeof(a), args);
    if (!SIDE_SERVER || a.protocol != 6 /* IPPROTO_TCP */)
        return 0;
    if (a.newstate == 10 /* LISTEN */)
        return learn_listener(a.sport, a.family);
    if ((a.newstate == 4 /* FIN_WAIT1 */ && a.oldstate == 1) || (a.newstate == 9 /* LAST_ACK */ && a.oldstate == 8)) {
        if (a.family == 2)
            return learn_peer(a.family, a.sport, a.dport, a.saddr, a.daddr, 4);
        return learn_peer(a.family, a.sport, a.dport, a.saddr_v6, a.daddr_v6, 16);
    }
    if (a.newstate != 1 /* ESTABLISHED */ || a.oldstate != 3 /* SYN_RECV */)
        return 0;
    if (FILTER_PORT && a.sport != FILTER_PORT)
        return 0;
    struct pending_conn p = {};
    p.family = a.family;
    p.lport = a.sport;
    u32 raddr4 = 0;
    if (a.family == 2) {
        __builtin_memcpy(p.laddr, a.saddr, 4);
        __builtin_memcpy(&raddr4, a.daddr, 4);
    } else {
        __builtin_memcpy(p.laddr, a.saddr_v6, 16);
        __builtin_memcpy(&raddr4, &a.daddr_v6[12], 4);
    }
    u64 key = ((u64)a.dport << 32) | raddr4;
    pending.update(&key, &p);
    return 0;
}

static __always_inline int accept_enter(u64 addr, u32 fd) {
    u64 id = bpf_get_current_pid_tgid();
    if (!SIDE_SERVER || !wanted_task(id >> 32))
        return 0;
    struct accept_args a = {.addr = addr, .fd = fd};
    accepting.update(&id, &a);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_accept4) { return accept_enter((u64)args->upeer_sockaddr, args->fd); }
TRACEPOINT_PROBE(syscalls, sys_enter_accept) { return accept_enter((u64)args->upeer_sockaddr, args->fd); }

/* accept with no address: the listener says whether it is ours; the peer is found later. */
static __always_inline int accept_unaddressed(u32 tgid, u32 lfd, u32 fd) {
    if (!is_armed())
        return 0;
    u64 lkey = sock_key(tgid, lfd);
    struct listener *l = listeners.lookup(&lkey);
    if (!l) {
        /* unknown (inherited, passed in, or listening since before a failed /proc scan): the
         * loader looks it up in /proc, fills `listeners` and joins this connection if it is ours */
        int zero = 0;
        struct ev_buf *b = new_event(tgid, lfd, EV_LISTENER);
        if (!b)
            return 0;
        b->h.total = fd;
        if (events.ringbuf_output(&b->h, sizeof(b->h), BPF_RB_NO_WAKEUP))
            count(lost.lookup(&zero));
        return 0;
    }
    if (!l->ours)
        return 0;
    struct sock_info si = {};
    si.is_server = 1;
    si.peer_unknown = 1;
    si.family = l->family;
    si.lport = l->lport;
    si.opened_ns = bpf_ktime_get_ns();
    u64 sk = sock_key(tgid, fd);
    socks.update(&sk, &si);
    emit_open(tgid, fd, &si);
    return 0;
}

static __always_inline int accept_exit(long ret) {
    u64 id = bpf_get_current_pid_tgid();
    struct accept_args *a = accepting.lookup(&id);
    if (!a)
        return 0;
    u64 addr = a->addr;
    u32 lfd = a->fd;
    accepting.delete(&id);
    if (ret < 0 || !is_armed())
        return 0;
    if (!addr)
        return accept_unaddressed(id >> 32, lfd, (u32)ret);
    struct sa_in6 sa = {};
    bpf_probe_read_user(&sa, sizeof(sa), (void *)addr);
    u32 raddr4 = 0;
    struct sock_info si = {};
    si.is_server = 1;
    si.family = sa.family;
    si.rport = bpf_ntohs(sa.port);
    if (sa.family == 2) {
        struct sa_in *s4 = (struct sa_in *)&sa;
        raddr4 = s4->addr;
        __builtin_memcpy(si.raddr, &raddr4, 4);
    } else if (sa.family == 10) {
        __builtin_memcpy(si.raddr, sa.addr, 16);
        __builtin_memcpy(&raddr4, &sa.addr[12], 4);
    } else {
        return 0;
    }
    u64 key = ((u64)si.rport << 32) | raddr4;
    struct pending_conn *p = pending.lookup(&key);
    if (!p)
        return 0;            /* not our port (or established before capture started) */
    si.lport = p->lport;
    __builtin_memcpy(si.laddr, p->laddr, 16);
    struct listener l = {.lport = p->lport, .family = p->family, .ours = 1};
    pending.delete(&key);
    u32 tgid = id >> 32;
    u64 lkey = sock_key(tgid, lfd);
    listeners.update(&lkey, &l);   /* its unaddressed accepts (if it mixes both) are ours too */
    u64 sk = sock_key(tgid, (u32)ret);
    socks.update(&sk, &si);
    emit_open(tgid, (u32)ret, &si);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_accept4) { return accept_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_accept) { return accept_exit(args->ret); }

/* ---- client side: the destination is in connect's own arguments ---- */

TRACEPOINT_PROBE(syscalls, sys_enter_connect) {
    if (SIDE_SERVER || !is_armed())
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!wanted_task(tgid))
        return 0;
    struct sa_in6 sa = {};
    bpf_probe_read_user(&sa, sizeof(sa), (void *)args->uservaddr);
    if (sa.family != 2 && sa.family != 10)
        return 0;
    u16 port = bpf_ntohs(sa.port);
    if (FILTER_PORT && port != FILTER_PORT)
        return 0;
    struct sock_info si = {};
    si.family = sa.family;
    si.rport = port;
    if (sa.family == 2)
        __builtin_memcpy(si.raddr, &((struct sa_in *)&sa)->addr, 4);
    else
        __builtin_memcpy(si.raddr, sa.addr, 16);
    u64 sk = sock_key(tgid, (u32)args->fd);
    socks.update(&sk, &si);   /* local end learnt in user space from /proc when needed */
    emit_open(tgid, (u32)args->fd, &si);
    return 0;
}

/* ---- close ---- */

/* A peer_unknown socket entering close/shutdown: kept by thread so that the state change the
 * call makes (learn_peer) can fill in its peer. */
static __always_inline void mark_closing(u64 id, u32 fd, struct sock_info *si, u8 is_close) {
    struct closing_sock c = {};
    __builtin_memcpy(&c.si, si, sizeof(c.si));
    c.fd = fd;
    c.learnt = si->rport != 0;
    c.is_close = is_close;
    closing.update(&id, &c);
}

TRACEPOINT_PROBE(syscalls, sys_enter_close) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u64 sk = sock_key(tgid, (u32)args->fd);
    struct sock_info *si = socks.lookup(&sk);
    if (!si)
        return 0;
    tls_socks.delete(&sk);
    if (si->peer_unknown) {
        mark_closing(id, (u32)args->fd, si, 1);   /* its CLOSE goes out at exit, with the peer */
        socks.delete(&sk);
        return 0;
    }
    int zero = 0;
    struct ev_buf *b = new_event(tgid, (u32)args->fd, EV_CLOSE);
    if (b)
        __builtin_memcpy(&b->h.si, si, sizeof(*si));   /* the final positions: bytes lost at the end */
    socks.delete(&sk);
    if (!b)
        return 0;
    if (events.ringbuf_output(&b->h, sizeof(b->h), BPF_RB_NO_WAKEUP))
        count(lost.lookup(&zero));
    return 0;
}

/* One lookup in an almost always empty map per close(); the CLOSE of a peer_unknown socket
 * carries its identity (opened_ns: the fd may already be reused) and the peer, if learnt. */
TRACEPOINT_PROBE(syscalls, sys_exit_close) {
    u64 id = bpf_get_current_pid_tgid();
    struct closing_sock *c = closing.lookup(&id);
    if (!c)
        return 0;
    int zero = 0;
    struct ev_buf *b = new_event(id >> 32, c->fd, EV_CLOSE);
    if (b) {
        __builtin_memcpy(&b->h.si, &c->si, sizeof(c->si));
        b->h.si.peer_unknown = !c->learnt;
        if (events.ringbuf_output(&b->h, sizeof(b->h), BPF_RB_NO_WAKEUP))
            count(lost.lookup(&zero));
    }
    closing.delete(&id);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_shutdown) {
    u64 id = bpf_get_current_pid_tgid();
    u64 sk = sock_key(id >> 32, (u32)args->fd);
    struct sock_info *si = socks.lookup(&sk);
    if (si && si->peer_unknown)
        mark_closing(id, (u32)args->fd, si, 0);
    return 0;
}

/* shutdown(SHUT_WR) (libuv's uv_shutdown, Node's end()) makes the state change: keep the peer in
 * the socket's entry for its CLOSE. */
TRACEPOINT_PROBE(syscalls, sys_exit_shutdown) {
    u64 id = bpf_get_current_pid_tgid();
    struct closing_sock *c = closing.lookup(&id);
    if (!c)
        return 0;
    if (c->learnt) {
        u64 sk = sock_key(id >> 32, c->fd);
        struct sock_info *si = socks.lookup(&sk);
        if (si && si->opened_ns == c->si.opened_ns) {
            u64 rd = si->rd, wr = si->wr;            /* moved on meanwhile, maybe: keep them */
            __builtin_memcpy(si, &c->si, sizeof(*si));
            si->rd = rd;
            si->wr = wr;
        }
    }
    closing.delete(&id);
    return 0;
}

/* ---- data: remember the arguments at enter, copy what moved at exit ---- */

static __always_inline int io_enter(u32 fd, u64 ptr, u64 cnt, u32 kind) {
    u64 id = bpf_get_current_pid_tgid();
    u64 sk = sock_key(id >> 32, fd);
    if (!socks.lookup(&sk))
        return 0;            /* the common case: not a traced socket */
    struct active_io a = {.ptr = ptr, .cnt = cnt, .fd = fd, .kind = kind};
    active.update(&id, &a);
    return 0;
}

/* Send the payload gathered so far in b as one record; returns the next offset. No wake-up:
 * one per record would cost the traced service an irq_work per syscall. */
static __always_inline u32 flush(struct ev_buf *b, u32 fill, u32 offset) {
    int zero = 0;
    if (fill == 0)
        return offset;
    b->h.len = fill;
    b->h.offset = offset;
    u32 size = sizeof(b->h) + (((fill - 1) & (CHUNK - 1)) + 1);
    if (events.ringbuf_output(b, size, wake_flag(size)))
        count(lost.lookup(&zero));
    return offset + fill;
}

/* A syscall of at most CHUNK bytes from one buffer: one record. */
static __always_inline void copy_one(struct ev_buf *b, u64 base, u32 n) {
    u32 size = ((n - 1) & (CHUNK - 1)) + 1;     /* == n: 1 <= n <= CHUNK */
    bpf_probe_read_user(b->data, size, (void *)base);
    flush(b, size, 0);
}

/* A syscall that moved at most CHUNK bytes, from up to MAX_IOV iovecs, as ONE record: gRPC writes
 * a message as many small iovecs (frame headers, length prefixes, payload), and a record per iovec
 * cost user space a callback each. No flush inside the loop (everything fits, as `remaining` <=
 * CHUNK), so the verifier walks one path. Returns the bytes not copied (more than MAX_IOV
 * iovecs). */
static __always_inline u32 copy_small(struct ev_buf *b, u64 iov, u64 iovcnt, u32 remaining) {
    u32 fill = 0;
    for (int i = 0; i < MAX_IOV; i++) {
        if (remaining == 0 || i >= iovcnt)
            break;
        struct user_iovec v = {};
        bpf_probe_read_user(&v, sizeof(v), (void *)(iov + i * sizeof(v)));
        u32 n = v.len > remaining ? remaining : v.len;
        if (n == 0)
            continue;
        u32 at = fill & (CHUNK - 1);             /* == fill: fill + n <= CHUNK */
        u32 size = ((n - 1) & (CHUNK - 1)) + 1;  /* == n */
        bpf_probe_read_user(b->data + at, size, (void *)v.base);
        fill = (fill + size) & (2 * CHUNK - 1);  /* a no-op that keeps every iteration's range alike */
        remaining -= n;
    }
    flush(b, fill, 0);
    return remaining;
}

/* A large syscall (more than CHUNK bytes): the state of its copy loop, kept in a map (bigs), not
 * in registers. The verifier knows nothing of map contents, so every step of the loop looks the same
 * to it whatever the bytes and iovecs: it walks each step once (both sides of each branch meet again
 * in one state) and its work grows linearly with BIG_STEPS. */
struct big_copy {
    u64 iov;                  /* iovec array; 0: one buffer at `base` */
    u64 iovcnt;
    u64 base;                 /* where the next bytes are */
    u32 left_in;              /* bytes left in the current buffer or iovec */
    u32 idx;                  /* next iovec to read */
    u32 remaining;            /* bytes of the syscall still to copy */
    u32 fill;                 /* bytes in the record being filled */
    u32 offset;               /* offset of that record within the syscall */
    u32 pad;
};
BPF_ARRAY(bigs, struct big_copy, SCRATCH_CPUS);

/* One step: take the next iovec if the current one is used up, copy the next piece of it into the
 * record being filled, send the record when it is full or the syscall's bytes are all in.
 * Returns 1 when the copy is over (done, or out of iovecs: what is left is counted as truncated). */
static __always_inline int big_step(struct ev_buf *b, struct big_copy *c) {
    if (c->remaining == 0)
        return 1;
    if (c->left_in == 0) {
        u32 idx = c->idx;
        if (!c->iov || idx >= c->iovcnt || idx >= BIG_IOVS)
            return 1;
        struct user_iovec v = {};
        bpf_probe_read_user(&v, sizeof(v), (void *)(c->iov + (u64)idx * sizeof(v)));
        c->idx = idx + 1;
        c->base = v.base;
        c->left_in = v.len > c->remaining ? c->remaining : v.len;
        if (c->left_in == 0)
            return 0;
    }
    u32 at = c->fill & (CHUNK - 1);              /* == fill: a record is sent at CHUNK */
    u32 room = CHUNK - at;
    u32 n = c->left_in < room ? c->left_in : room;
    u32 size = ((n - 1) & (CHUNK - 1)) + 1;      /* == n: 1 <= n <= CHUNK */
    bpf_probe_read_user(b->data + at, size, (void *)c->base);
    u32 fill = at + size;
    c->base += size;
    c->left_in -= size;
    c->remaining -= size;
    if (fill < CHUNK && c->remaining) {
        c->fill = fill;
        return 0;
    }
    int zero = 0;
    b->h.len = fill;
    b->h.offset = c->offset;
    u32 rec = sizeof(b->h) + (((fill - 1) & (CHUNK - 1)) + 1);
    /* the syscall's last record wakes the poller: megabytes may come faster than its timer */
    if (events.ringbuf_output(b, rec, c->remaining ? BPF_RB_NO_WAKEUP : BPF_RB_FORCE_WAKEUP))
        count(lost.lookup(&zero));
    c->offset += fill;
    c->fill = 0;
    return 0;
}

/* Copy `want` bytes of a large syscall from one buffer (iov 0) or up to BIG_IOVS iovecs into records
 * of CHUNK bytes. A step uses up an iovec or fills a record, so `steps` = MAX_BYTES / CHUNK + 1, plus
 * BIG_IOVS with iovecs, always suffice (a constant per call site: the buffer-only syscalls verify
 * in a fraction of the time). Returns the bytes not copied (more iovecs than BIG_IOVS). */
static __always_inline u32 copy_big(struct ev_buf *b, u64 base, u64 iov, u64 iovcnt, u32 want, const int steps) {
    u32 cpu = bpf_get_smp_processor_id();
    struct big_copy *c = bigs.lookup(&cpu);
    if (!c)
        return want;
    c->iov = iov;
    c->iovcnt = iovcnt;
    c->base = base;
    c->left_in = iov ? 0 : want;
    c->idx = 0;
    c->remaining = want;
    c->fill = 0;
    c->offset = 0;
#pragma clang loop unroll(disable)
    for (int i = 0; i < steps; i++) {
        if (big_step(b, c))
            break;
    }
    return c->remaining;
}

/* recvfrom/recvmsg: a peek or an error-queue read is not stream data (not traced at all, not
 * even looked up); a read with MSG_TRUNC moved no bytes into the buffer (see the header). */
static __always_inline int recv_enter(u32 fd, u64 ptr, u32 flags, u32 kind) {
    if (flags & (RECV_PEEK | RECV_ERRQUEUE))
        return 0;
    return io_enter(fd, ptr, 0, (flags & RECV_TRUNC) ? K_DISCARD : kind);
}

/* vec is a compile-time constant at each call site, so the buffer-only syscalls (read, write,
 * sendto, recvfrom) are compiled without the iovec walk and verify in a fraction of the time. */
static __always_inline int io_exit(long ret, const int vec) {
    u64 id = bpf_get_current_pid_tgid();
    struct active_io *a = active.lookup(&id);
    if (!a)
        return 0;
    struct active_io io = *a;
    active.delete(&id);
    if (ret <= 0)
        return 0;
    int zero = 0;
    u64 sk = sock_key(id >> 32, io.fd);
    struct sock_info *si = socks.lookup(&sk);
    if (!si)
        return 0;                        /* closed by another thread meanwhile */
    u8 is_write = (io.kind == K_WRITE || io.kind == K_WRITEV || io.kind == K_SENDMSG
                   || io.kind == K_SENDFILE || io.kind == K_SPLICE_OUT);
    /* Counted whether or not a record makes it into the ring: user space sees exactly which bytes
     * a full ring lost, and records them as a gap there (an atomic add: threads may share a socket). */
    u64 pos = __sync_fetch_and_add(is_write ? &si->wr : &si->rd, (u64)ret);
    struct ev_buf *b = new_event(id >> 32, io.fd, EV_DATA);
    if (!b)
        return 0;
    b->h.total = ret;
    b->h.pos = pos;
    b->h.is_write = is_write;
    if (tls_socks.lookup(&sk)) {         /* ciphertext whose plaintext the TLS program records */
        b->h.discarded = NC_TLS;
        if (events.ringbuf_output(&b->h, sizeof(b->h), BPF_RB_NO_WAKEUP))
            count(lost.lookup(&zero));
        return 0;
    }
    if (io.kind == K_DISCARD) {          /* the buffer was not written: say how much went, copy nothing */
        b->h.discarded = 1;
        if (events.ringbuf_output(&b->h, sizeof(b->h), BPF_RB_NO_WAKEUP))
            count(lost.lookup(&zero));
        return 0;
    }
    if (io.kind >= K_SENDFILE) {         /* zero-copy: no buffer to read, the length and time only */
        b->h.discarded = io.kind == K_SENDFILE ? NC_SENDFILE : NC_SPLICE;
        if (events.ringbuf_output(&b->h, sizeof(b->h), BPF_RB_NO_WAKEUP))
            count(lost.lookup(&zero));
        return 0;
    }
    u32 want = ret;
    if (want > MAX_BYTES) {
        want = MAX_BYTES;
        b->h.truncated = 1;
        count(truncated.lookup(&zero));
    }
    u64 iov = 0, iovcnt = 0;
    if (!vec) {
        if (want <= CHUNK)
            copy_one(b, io.ptr, want);
        else
            copy_big(b, io.ptr, 0, 0, want, MAX_BYTES / CHUNK + 1);
        return 0;
    }
    if (io.kind == K_READV || io.kind == K_WRITEV) {
        iov = io.ptr;
        iovcnt = io.cnt;
    } else if (io.kind == K_RECVMSG || io.kind == K_SENDMSG) {
        struct user_msghdr_s m = {};
        bpf_probe_read_user(&m, sizeof(m), (void *)io.ptr);
        iov = m.iov;
        iovcnt = m.iovlen;
    }
    u32 left = want <= CHUNK ? copy_small(b, iov, iovcnt, want) : copy_big(b, 0, iov, iovcnt, want, BIG_IOVS + MAX_BYTES / CHUNK + 1);
    if (left && !b->h.truncated)
        count(truncated.lookup(&zero));   /* more iovecs than walked: counted, never silent */
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_read) { return io_enter(args->fd, (u64)args->buf, 0, K_READ); }
TRACEPOINT_PROBE(syscalls, sys_exit_read) { return io_exit(args->ret, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_write) { return io_enter(args->fd, (u64)args->buf, 0, K_WRITE); }
TRACEPOINT_PROBE(syscalls, sys_exit_write) { return io_exit(args->ret, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_readv) { return io_enter(args->fd, (u64)args->vec, args->vlen, K_READV); }
TRACEPOINT_PROBE(syscalls, sys_exit_readv) { return io_exit(args->ret, 1); }
TRACEPOINT_PROBE(syscalls, sys_enter_writev) { return io_enter(args->fd, (u64)args->vec, args->vlen, K_WRITEV); }
TRACEPOINT_PROBE(syscalls, sys_exit_writev) { return io_exit(args->ret, 1); }
TRACEPOINT_PROBE(syscalls, sys_enter_sendto) { return io_enter(args->fd, (u64)args->buff, 0, K_WRITE); }
TRACEPOINT_PROBE(syscalls, sys_exit_sendto) { return io_exit(args->ret, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_recvfrom) {
    return recv_enter(args->fd, (u64)args->ubuf, args->flags, K_READ);
}
TRACEPOINT_PROBE(syscalls, sys_exit_recvfrom) { return io_exit(args->ret, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_sendmsg) { return io_enter(args->fd, (u64)args->msg, 0, K_SENDMSG); }
TRACEPOINT_PROBE(syscalls, sys_exit_sendmsg) { return io_exit(args->ret, 1); }
TRACEPOINT_PROBE(syscalls, sys_enter_recvmsg) {
    return recv_enter(args->fd, (u64)args->msg, args->flags, K_RECVMSG);
}
TRACEPOINT_PROBE(syscalls, sys_exit_recvmsg) { return io_exit(args->ret, 1); }

/* Zero-copy sends: the socket is out_fd (sendfile) or either end of a splice. */
TRACEPOINT_PROBE(syscalls, sys_enter_sendfile64) { return io_enter(args->out_fd, 0, 0, K_SENDFILE); }
TRACEPOINT_PROBE(syscalls, sys_exit_sendfile64) { return io_exit(args->ret, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_splice) {
    u64 id = bpf_get_current_pid_tgid();
    u64 sk = sock_key(id >> 32, (u32)args->fd_out);
    if (socks.lookup(&sk))
        return io_enter(args->fd_out, 0, 0, K_SPLICE_OUT);
    return io_enter(args->fd_in, 0, 0, K_SPLICE_IN);
}
TRACEPOINT_PROBE(syscalls, sys_exit_splice) { return io_exit(args->ret, 0); }
