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
 * without waking user space (BPF_RB_NO_WAKEUP): the loader drains the ring on a timer.
 *
 *   accept4/connect --(port, pid, cgroup filter)--> socks[(tgid,fd)] --> OPEN event
 *   read/write/readv/writev/sendto/recvfrom/sendmsg/recvmsg on socks --> DATA events
 *   close on socks --> CLOSE event;  ring buffer full --> lost[cpu]++
 *
 * Placeholders substituted by the loader in one place (capture/ebpf/loader.py):
 *   FILTER_PORT (0 = any), FILTER_PID (0 = any), FILTER_CGROUP (0 = any, cgroup v2 id),
 *   FILTER_TGID_MAP (1 = only tgids in the `tgids` map, for cgroup v1), SIDE_SERVER (1|0),
 *   MAX_BYTES, CHUNK (a power of two, 4-64 KiB), MAX_IOV, BIG_IOV, RINGBUF_PAGES, SCRATCH_CPUS.
 */
#include <uapi/linux/ptrace.h>

#define EV_DATA 1
#define EV_OPEN 2
#define EV_CLOSE 3

#define K_READ 1
#define K_WRITE 2
#define K_READV 3
#define K_WRITEV 4
#define K_RECVMSG 5
#define K_SENDMSG 6

struct sock_info {            /* one traced socket */
    u8 family;
    u8 is_server;             /* 1: this process accepted it */
    u16 lport;
    u16 rport;
    u8 laddr[16];
    u8 raddr[16];
};

struct ev_hdr {               /* every ring-buffer record starts with this */
    u64 ts_ns;
    u32 tgid;
    u32 fd;
    u32 len;                  /* payload bytes in this record */
    u32 total;                /* bytes the syscall moved (DATA) */
    u32 offset;               /* offset of this record within the syscall */
    u8 type;
    u8 is_write;              /* DATA: 1 write-family, 0 read-family */
    u8 truncated;             /* DATA: the syscall moved more than MAX_BYTES */
    u8 pad;
    struct sock_info si;      /* OPEN */
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

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_HASH(socks, u64, struct sock_info, 65536);
BPF_HASH(active, u64, struct active_io, 16384);
BPF_HASH(accepting, u64, struct accept_args, 16384);
BPF_TABLE("lru_hash", u64, struct pending_conn, pending, 16384);
BPF_HASH(tgids, u32, u8, 4096);
/* One record buffer per CPU. A plain array indexed by CPU, not a per-CPU array: per-CPU values
 * are limited to 32 KiB and CHUNK may be 64 KiB. */
BPF_ARRAY(scratch, struct ev_buf, SCRATCH_CPUS);
BPF_PERCPU_ARRAY(lost, u64, 1);
BPF_PERCPU_ARRAY(truncated, u64, 1);

static __always_inline int wanted_task(u32 tgid) {
    if (FILTER_PID && tgid != FILTER_PID)
        return 0;
    if (FILTER_CGROUP && bpf_get_current_cgroup_id() != FILTER_CGROUP)
        return 0;
    if (FILTER_TGID_MAP && !tgids.lookup(&tgid))
        return 0;
    return 1;
}

static __always_inline u64 sock_key(u32 tgid, u32 fd) { return ((u64)tgid << 32) | fd; }

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

TRACEPOINT_PROBE(sock, inet_sock_set_state) {
    /* Copy the record first: variable offsets into the tracepoint context are refused. */
    struct tracepoint__sock__inet_sock_set_state a = {};
    bpf_probe_read_kernel(&a, sizeof(a), args);
    if (!SIDE_SERVER || a.protocol != 6 /* IPPROTO_TCP */)
        return 0;
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

static __always_inline int accept_enter(u64 addr) {
    u64 id = bpf_get_current_pid_tgid();
    if (!SIDE_SERVER || !wanted_task(id >> 32))
        return 0;
    struct accept_args a = {.addr = addr};
    accepting.update(&id, &a);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_accept4) { return accept_enter((u64)args->upeer_sockaddr); }
TRACEPOINT_PROBE(syscalls, sys_enter_accept) { return accept_enter((u64)args->upeer_sockaddr); }

static __always_inline int accept_exit(long ret) {
    u64 id = bpf_get_current_pid_tgid();
    struct accept_args *a = accepting.lookup(&id);
    if (!a)
        return 0;
    u64 addr = a->addr;
    accepting.delete(&id);
    if (ret < 0 || !addr)
        return 0;
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
    pending.delete(&key);
    u32 tgid = id >> 32;
    u64 sk = sock_key(tgid, (u32)ret);
    socks.update(&sk, &si);
    emit_open(tgid, (u32)ret, &si);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_accept4) { return accept_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_accept) { return accept_exit(args->ret); }

/* ---- client side: the destination is in connect's own arguments ---- */

TRACEPOINT_PROBE(syscalls, sys_enter_connect) {
    if (SIDE_SERVER)
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

TRACEPOINT_PROBE(syscalls, sys_enter_close) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u64 sk = sock_key(tgid, (u32)args->fd);
    if (!socks.lookup(&sk))
        return 0;
    socks.delete(&sk);
    int zero = 0;
    struct ev_buf *b = new_event(tgid, (u32)args->fd, EV_CLOSE);
    if (!b)
        return 0;
    if (events.ringbuf_output(&b->h, sizeof(b->h), BPF_RB_NO_WAKEUP))
        count(lost.lookup(&zero));
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
    if (events.ringbuf_output(b, size, BPF_RB_NO_WAKEUP))
        count(lost.lookup(&zero));
    return offset + fill;
}

/* Copy `n` bytes at user address `base` into records of at most CHUNK bytes each. */
static __always_inline u32 copy_buf(struct ev_buf *b, u64 base, u32 n, u32 offset) {
    for (int j = 0; j < MAX_BYTES / CHUNK; j++) {
        if (n == 0)
            break;
        u32 take = n > CHUNK ? CHUNK : n;
        /* take is already <= CHUNK; this form lets the verifier see 1 <= size <= CHUNK too */
        u32 size = ((take - 1) & (CHUNK - 1)) + 1;
        bpf_probe_read_user(b->data, size, (void *)base);
        offset = flush(b, size, offset);
        base += size;
        n -= size;
    }
    return offset;
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

/* Copy `remaining` bytes from up to MAX_IOV iovecs (or one buffer). Every branch either goes on
 * or leaves the loop, so the verifier's work grows linearly with MAX_IOV, not exponentially.
 * Returns the bytes that could not be copied (more iovecs than MAX_IOV). */
static __always_inline u32 copy_out(struct ev_buf *b, struct active_io *a, u64 iov, u64 iovcnt,
                                    u32 remaining) {
    if (!iov) {
        copy_buf(b, a->ptr, remaining, 0);
        return 0;
    }
    u32 offset = 0;
    /* The first BIG_IOV iovecs may each fill several records (large reads land in the first
     * one or two); later ones, typically many small write slices, get one record each. This
     * keeps the verifier's work at about BIG_IOV * MAX_BYTES / CHUNK + MAX_IOV steps. */
    for (int i = 0; i < BIG_IOV; i++) {
        if (remaining == 0 || i >= iovcnt)
            return remaining;
        struct user_iovec v = {};
        bpf_probe_read_user(&v, sizeof(v), (void *)(iov + i * sizeof(v)));
        u32 n = v.len > remaining ? remaining : v.len;
        offset = copy_buf(b, v.base, n, offset);
        remaining -= n;
    }
    for (int i = BIG_IOV; i < MAX_IOV; i++) {
        if (remaining == 0 || i >= iovcnt)
            break;
        struct user_iovec v = {};
        bpf_probe_read_user(&v, sizeof(v), (void *)(iov + i * sizeof(v)));
        u32 n = v.len > remaining ? remaining : v.len;
        if (n == 0 || n > CHUNK)
            break;           /* stop here so any hole is at the end, where user space sees it */
        u32 size = ((n - 1) & (CHUNK - 1)) + 1;
        bpf_probe_read_user(b->data, size, (void *)v.base);
        offset = flush(b, size, offset);
        remaining -= n;
    }
    return remaining;
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
    struct ev_buf *b = new_event(id >> 32, io.fd, EV_DATA);
    if (!b)
        return 0;
    b->h.total = ret;
    b->h.is_write = (io.kind == K_WRITE || io.kind == K_WRITEV || io.kind == K_SENDMSG);
    u32 want = ret;
    if (want > MAX_BYTES) {
        want = MAX_BYTES;
        b->h.truncated = 1;
        count(truncated.lookup(&zero));
    }
    u64 iov = 0, iovcnt = 0;
    if (!vec) {
        copy_buf(b, io.ptr, want, 0);
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
    u32 left = want <= CHUNK ? copy_small(b, iov, iovcnt, want) : copy_out(b, &io, iov, iovcnt, want);
    if (left && !b->h.truncated)
        count(truncated.lookup(&zero));   /* more iovecs than MAX_IOV: counted, never silent */
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
TRACEPOINT_PROBE(syscalls, sys_enter_recvfrom) { return io_enter(args->fd, (u64)args->ubuf, 0, K_READ); }
TRACEPOINT_PROBE(syscalls, sys_exit_recvfrom) { return io_exit(args->ret, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_sendmsg) { return io_enter(args->fd, (u64)args->msg, 0, K_SENDMSG); }
TRACEPOINT_PROBE(syscalls, sys_exit_sendmsg) { return io_exit(args->ret, 1); }
TRACEPOINT_PROBE(syscalls, sys_enter_recvmsg) { return io_enter(args->fd, (u64)args->msg, 0, K_RECVMSG); }
TRACEPOINT_PROBE(syscalls, sys_exit_recvmsg) { return io_exit(args->ret, 1); }
