/*
 * shadowtest TLS recorder: plaintext of the system OpenSSL (libssl.so.3), from uprobes.
 *
 * A program of its own beside recorder.bpf.c (own maps, own ring buffer); capture/ebpf/tls.py loads
 * it, attaches it to the libssl file (so every process that maps that file is covered) and joins
 * its records to the recorder's TCP flows.
 *
 *   SSL_read / SSL_read_ex / SSL_write / SSL_write_ex entry  --> calls[thread] = {SSL*, buf, ...}
 *   SSL_do_handshake / SSL_connect / SSL_accept entry         --> calls[thread] = {SSL*} (handshake)
 *   read/write/recvfrom/sendto/readv/writev/recvmsg/sendmsg entry, while the thread is inside one
 *       of those calls  --> that fd belongs to that SSL*: ssl_fd[SSL*] = fd, SEEN record (once)
 *   SSL_read* / SSL_write* return  --> PLAIN records: the bytes the call returned, tagged with the
 *       SSL*'s fd (the fd of this call's syscall, else the last one seen for that SSL*: a read
 *       served from OpenSSL's buffer makes no syscall)
 *   SSL_free entry --> ssl_fd entry removed;  close entry --> skip entry of that fd removed
 *
 * Why syscalls, not SSL_get_fd: a BPF program cannot call into the process. OpenSSL's socket BIO
 * (nginx, Python's ssl) and curl's own BIO both move the ciphertext with one of those syscalls
 * inside the SSL call, on the calling thread, so the first syscall of the handshake already names
 * the fd: the SEEN record reaches user space before the recorder's record of that syscall's bytes,
 * which is how user space knows, at a flow's first bytes, whether its plaintext will come.
 * Memory BIOs (asyncio's SSLObject, Node) make no syscall inside the call: their plaintext has no
 * fd and is only counted (`unjoined`).
 *
 * Which processes: FILTER_PID / FILTER_CGROUP as in recorder.bpf.c; which connections: user space
 * knows the recorded flows and puts the (tgid, fd) of TLS connections that are not recorded into
 * `skip`, after which their calls copy nothing.
 *
 * Overhead: per SSL call two uprobe hits (entry, return) and one or two map updates; per syscall of
 * the traced processes one hash lookup (`calls`, keyed by thread). Plaintext copies only for calls
 * that returned bytes, at most MAX_BYTES per call in CHUNK-sized records, written without wake-ups
 * (user space drains the ring on a timer and whenever the recorder needs it).
 *
 * Placeholders substituted by tls.py: FILTER_PID, FILTER_CGROUP, MAX_BYTES, CHUNK, RINGBUF_PAGES,
 * SCRATCH_CPUS.
 */
#include <uapi/linux/ptrace.h>

#define EV_PLAIN 1
#define EV_SEEN 2

#define CALL_READ 1
#define CALL_WRITE 2
#define CALL_HANDSHAKE 3

#define C_LOST 0
#define C_TRUNCATED 1
#define C_UNJOINED 2      /* plaintext of an SSL* whose fd was never seen (memory BIO) */

struct tls_hdr {          /* every record starts with this */
    u64 ts_ns;
    u32 tgid;
    u32 fd;
    u32 len;              /* plaintext bytes in this record */
    u32 total;            /* bytes the call returned */
    u32 offset;           /* of this record within the call */
    u8 type;
    u8 is_write;
    u8 truncated;         /* the call returned more than MAX_BYTES */
    u8 pad;
};

struct tls_buf {
    struct tls_hdr h;
    u8 data[CHUNK];
};

struct tls_call {         /* one thread inside one SSL call */
    u64 ssl;
    u64 buf;
    u64 outp;             /* _ex: where the byte count goes */
    u32 fd;
    u8 kind;
    u8 ex;
    u8 has_fd;
    u8 pad;
};

BPF_RINGBUF_OUTPUT(tls_events, RINGBUF_PAGES);
BPF_HASH(calls, u64, struct tls_call, 16384);
BPF_TABLE("lru_hash", u64, u32, ssl_fd, 65536);      /* SSL* -> fd */
BPF_TABLE("lru_hash", u64, u8, skip, 65536);         /* (tgid, fd) not recorded */
BPF_ARRAY(scratch, struct tls_buf, SCRATCH_CPUS);
BPF_PERCPU_ARRAY(counters, u64, 3);

static __always_inline void count(int which) {
    u64 *v = counters.lookup(&which);
    if (v)
        __sync_fetch_and_add(v, 1);
}

static __always_inline int wanted_task(u32 tgid) {
    if (FILTER_PID && tgid != FILTER_PID)
        return 0;
    if (FILTER_CGROUP && bpf_get_current_cgroup_id() != FILTER_CGROUP)
        return 0;
    return 1;
}

static __always_inline u64 sock_key(u32 tgid, u32 fd) { return ((u64)tgid << 32) | fd; }

static __always_inline int call_enter(struct pt_regs *ctx, u8 kind, u8 ex) {
    u64 id = bpf_get_current_pid_tgid();
    if (!wanted_task(id >> 32))
        return 0;
    if (kind == CALL_HANDSHAKE && calls.lookup(&id))
        return 0;             /* SSL_connect -> SSL_do_handshake: the outer call is tracked already */
    struct tls_call c = {};
    c.ssl = PT_REGS_PARM1(ctx);
    c.kind = kind;
    c.ex = ex;
    if (kind != CALL_HANDSHAKE) {
        c.buf = PT_REGS_PARM2(ctx);
        c.outp = ex ? PT_REGS_PARM4(ctx) : 0;
    }
    u32 *fd = ssl_fd.lookup(&c.ssl);
    if (fd) {
        c.fd = *fd;
        c.has_fd = 1;
    }
    calls.update(&id, &c);
    return 0;
}

int ssl_read_enter(struct pt_regs *ctx) { return call_enter(ctx, CALL_READ, 0); }
int ssl_read_ex_enter(struct pt_regs *ctx) { return call_enter(ctx, CALL_READ, 1); }
int ssl_write_enter(struct pt_regs *ctx) { return call_enter(ctx, CALL_WRITE, 0); }
int ssl_write_ex_enter(struct pt_regs *ctx) { return call_enter(ctx, CALL_WRITE, 1); }
int ssl_handshake_enter(struct pt_regs *ctx) { return call_enter(ctx, CALL_HANDSHAKE, 0); }

int ssl_handshake_exit(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    struct tls_call *c = calls.lookup(&id);
    if (c && c->kind == CALL_HANDSHAKE)
        calls.delete(&id);
    return 0;
}

int ssl_free_enter(struct pt_regs *ctx) {
    u64 ssl = PT_REGS_PARM1(ctx);
    ssl_fd.delete(&ssl);
    return 0;
}

/* The bytes the call returned, in records of at most CHUNK bytes. */
int ssl_rw_exit(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    struct tls_call *cp = calls.lookup(&id);
    if (!cp || cp->kind == CALL_HANDSHAKE)
        return 0;
    struct tls_call c = *cp;
    calls.delete(&id);
    int ret = (int)PT_REGS_RC(ctx);
    u64 n = 0;
    if (c.ex) {
        if (ret != 1 || !c.outp)
            return 0;
        bpf_probe_read_user(&n, sizeof(n), (void *)c.outp);
    } else {
        if (ret <= 0)
            return 0;
        n = ret;
    }
    if (n == 0)
        return 0;
    if (!c.has_fd) {
        count(C_UNJOINED);
        return 0;
    }
    u32 tgid = id >> 32;
    u64 key = sock_key(tgid, c.fd);
    if (skip.lookup(&key))
        return 0;
    u32 cpu = bpf_get_smp_processor_id();
    struct tls_buf *b = scratch.lookup(&cpu);
    if (!b)
        return 0;
    __builtin_memset(&b->h, 0, sizeof(b->h));
    b->h.ts_ns = bpf_ktime_get_ns();
    b->h.tgid = tgid;
    b->h.fd = c.fd;
    b->h.type = EV_PLAIN;
    b->h.is_write = c.kind == CALL_WRITE;
    u32 want = n > 0xffffffffULL ? 0xffffffff : (u32)n;
    b->h.total = want;
    if (want > MAX_BYTES) {
        want = MAX_BYTES;
        b->h.truncated = 1;
        count(C_TRUNCATED);
    }
    u64 base = c.buf;
    u32 offset = 0;
    for (int j = 0; j < MAX_BYTES / CHUNK; j++) {
        if (want == 0)
            break;
        u32 take = want > CHUNK ? CHUNK : want;
        u32 size = ((take - 1) & (CHUNK - 1)) + 1;    /* == take; visibly 1..CHUNK for the verifier */
        bpf_probe_read_user(b->data, size, (void *)base);
        b->h.len = size;
        b->h.offset = offset;
        if (tls_events.ringbuf_output(b, sizeof(b->h) + size, BPF_RB_NO_WAKEUP))
            count(C_LOST);
        base += size;
        offset += size;
        want -= size;
    }
    return 0;
}

/* ---- which fd an SSL* uses: the syscalls made inside its calls ---- */

static __always_inline int io_enter(u32 fd) {
    u64 id = bpf_get_current_pid_tgid();
    struct tls_call *c = calls.lookup(&id);
    if (!c)
        return 0;             /* the common case: this thread is not inside an SSL call */
    if (c->has_fd && c->fd == fd)
        return 0;
    c->fd = fd;
    c->has_fd = 1;
    u64 ssl = c->ssl;
    ssl_fd.update(&ssl, &fd);
    u64 key = sock_key(id >> 32, fd);
    if (skip.lookup(&key))
        return 0;
    struct tls_hdr h = {};
    h.ts_ns = bpf_ktime_get_ns();
    h.tgid = id >> 32;
    h.fd = fd;
    h.type = EV_SEEN;
    if (tls_events.ringbuf_output(&h, sizeof(h), BPF_RB_NO_WAKEUP))
        count(C_LOST);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_read) { return io_enter(args->fd); }
TRACEPOINT_PROBE(syscalls, sys_enter_write) { return io_enter(args->fd); }
TRACEPOINT_PROBE(syscalls, sys_enter_readv) { return io_enter(args->fd); }
TRACEPOINT_PROBE(syscalls, sys_enter_writev) { return io_enter(args->fd); }
TRACEPOINT_PROBE(syscalls, sys_enter_recvfrom) { return io_enter(args->fd); }
TRACEPOINT_PROBE(syscalls, sys_enter_sendto) { return io_enter(args->fd); }
TRACEPOINT_PROBE(syscalls, sys_enter_recvmsg) { return io_enter(args->fd); }
TRACEPOINT_PROBE(syscalls, sys_enter_sendmsg) { return io_enter(args->fd); }

/* A closed fd may come back as a recorded connection: it must not stay skipped. */
TRACEPOINT_PROBE(syscalls, sys_enter_close) {
    u64 key = sock_key(bpf_get_current_pid_tgid() >> 32, (u32)args->fd);
    skip.delete(&key);
    return 0;
}
