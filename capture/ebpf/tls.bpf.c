/*
 * shadowtest TLS recorder: plaintext of OpenSSL (any libssl, or a binary exporting its API) and of Go's
 * crypto/tls (see the Go section at the end), from uprobes.
 *
 * A program of its own beside recorder.bpf.c (own ring buffer), loaded by capture/ebpf/tls.py in
 * the same process after the recorder's program, whose public maps it shares: `socks` (the sockets
 * the recorder records) and `tls_socks` (the recorded sockets whose ciphertext goes through an SSL
 * call traced here: the recorder then sends their bytes as a length only, NC_TLS).
 *
 *   SSL_read / SSL_read_ex / SSL_write / SSL_write_ex entry  --> calls[thread] = {SSL*, buf, ...}
 *   SSL_do_handshake / SSL_connect / SSL_accept entry         --> calls[thread] = {SSL*} (handshake)
 *   read/write/recvfrom/sendto/readv/writev/recvmsg/sendmsg entry, while the thread is inside one
 *       of those calls  --> that fd belongs to that SSL*: ssl_fd[SSL*] = fd; if the recorder records
 *       the socket, tls_socks[(tgid, fd)] = 1 (before the syscall's exit, where the recorder looks)
 *   SSL_read* / SSL_write* return, on a socket in `socks`  --> PLAIN records: the bytes the call
 *       returned, tagged with the socket and their position in its plaintext stream (positions[]:
 *       bytes read and written so far), so user space sees exactly which bytes a full ring lost;
 *       a call whose socket closed while it was in flight (another thread or goroutine closed it)
 *       comes F_LATE, with no position; every PLAIN record carries the birth of the stream it
 *       belongs to, so user space never gives a record to the fd's next connection
 *   SSL_free entry --> ssl_fd entry removed
 *   close entry on a socket with positions --> CLOSE record with the final positions (bytes lost
 *       at the end of a connection are a gap too), positions entry removed
 *
 * Why syscalls, not SSL_get_fd: a BPF program cannot call into the process. OpenSSL's socket BIO
 * (nginx, Python's ssl) and curl's own BIO both move the ciphertext with one of those syscalls
 * inside the SSL call, on the calling thread, so the first syscall of the handshake already names
 * the fd. Memory BIOs (Node's TLSWrap, asyncio's SSLObject) make no syscall inside the call: their
 * SSL* is joined to the socket the same thread writes the handshake's output to right after the call
 * (wait_for_write, bind_pending); plaintext of an SSL* never joined is only counted (`unjoined`).
 *
 * Which processes: FILTER_PID / FILTER_CGROUP as in recorder.bpf.c; which connections: those in the
 * recorder's `socks`, checked in the kernel, so the plaintext of every other TLS connection of every
 * process that maps libssl (a client downloading from the recorded server, on the same host) is
 * never copied.
 *
 * Overhead: per SSL call two uprobe hits (entry, return) and a map update or two; per syscall of the
 * traced processes one hash lookup (`calls`, keyed by thread); per SSL call on a recorded socket one
 * lookup each in `socks` and `positions`. Plaintext copies only for recorded sockets, at most
 * MAX_BYTES per call in CHUNK-sized records, written with a wake-up only every WAKE_BYTES per CPU
 * (user space drains the ring then, on a timer, and whenever the joiner needs it).
 *
 * Placeholders substituted by tls.py: FILTER_PID, FILTER_CGROUP, MAX_BYTES, CHUNK, RINGBUF_PAGES,
 * SCRATCH_CPUS, SOCK_INFO_SIZE, WAKE_BYTES; `socks` and `tls_socks` are renamed to the recorder's names.
 */
#include <uapi/linux/ptrace.h>

#define EV_PLAIN 1
#define EV_CLOSE 3

#define CALL_READ 1
#define CALL_WRITE 2
#define CALL_HANDSHAKE 3

#define C_LOST 0
#define C_TRUNCATED 1
#define C_UNJOINED 2      /* plaintext of an SSL* whose fd was never seen (memory BIO) */
#define C_GO_OTHER 3      /* a Go tls.Conn over something other than a *net.TCPConn (not joined) */

#define F_LATE 1          /* PLAIN: the socket closed while the call was in flight (see emit_plain) */

struct tls_hdr {          /* every record starts with this */
    u64 ts_ns;
    u64 pos;              /* PLAIN: position of the call's first byte in its direction's stream;
                             CLOSE: plaintext bytes read in all */
    u64 pos2;             /* CLOSE: plaintext bytes written in all; PLAIN: the birth of its stream */
    u32 tgid;
    u32 fd;
    u32 len;              /* plaintext bytes in this record */
    u32 total;            /* bytes the call returned */
    u32 offset;           /* of this record within the call */
    u8 type;
    u8 is_write;
    u8 truncated;         /* the call returned more than MAX_BYTES */
    u8 flags;             /* F_LATE */
};

struct tls_buf {
    struct tls_hdr h;
    u8 data[CHUNK];
};

struct tls_call {         /* one thread inside one SSL call */
    u64 ssl;
    u64 buf;
    u64 outp;             /* _ex: where the byte count goes */
    u64 born;             /* the birth of the socket's stream when the call met it (0: not yet) */
    u32 fd;
    u8 kind;
    u8 ex;
    u8 has_fd;
    u8 marked;            /* tls_socks was seen to for this call's socket */
    u8 recorded;          /* the fd is a socket the recorder records (in socks) */
};

struct stream_pos {       /* plaintext bytes of one recorded socket so far */
    u64 rd;
    u64 wr;
    u64 born;             /* when the entry was made: this connection's identity (its fd is reused) */
};

struct rec_sock {         /* the recorder's struct sock_info: only looked up here, never read */
    u8 opaque[SOCK_INFO_SIZE];
};

BPF_RINGBUF_OUTPUT(tls_events, RINGBUF_PAGES);
BPF_HASH(calls, u64, struct tls_call, 16384);
BPF_TABLE("lru_hash", u64, u32, ssl_fd, 65536);      /* SSL* -> fd */
/* Memory BIOs (Node.js, asyncio): an SSL* whose handshake call just returned without a syscall inside,
 * waiting on its thread for the write that sends what the call produced (see bind_pending) */
struct pending_ssl {
    u64 ssl;
    u64 ts_ns;
};
BPF_HASH(pending, u64, struct pending_ssl, 16384);
BPF_TABLE("lru_hash", u64, u8, ssl_moved, 65536);    /* SSL*s that moved plaintext before any fd was known */
BPF_TABLE("lru_hash", u64, struct stream_pos, positions, 65536);   /* (tgid, fd) */
BPF_TABLE("extern", u64, struct rec_sock, socks, 65536);
BPF_TABLE("extern", u64, u8, tls_socks, 65536);
BPF_ARRAY(scratch, struct tls_buf, SCRATCH_CPUS);
BPF_PERCPU_ARRAY(counters, u64, 4);
BPF_PERCPU_ARRAY(unwoken, u64, 1);    /* bytes written on this CPU since its last wake-up */

static __always_inline void count(int which) {
    u64 *v = counters.lookup(&which);
    if (v)
        __sync_fetch_and_add(v, 1);
}

/* --cgroup on cgroup v2: the directory (set from user space); a task in it or in a cgroup under it */
BPF_CGROUP_ARRAY(cgroup_under, 1);

static __always_inline int wanted_task(u32 tgid) {
    if (FILTER_PID && tgid != FILTER_PID)
        return 0;
    if (FILTER_CGROUP && cgroup_under.check_current_task(0) != 1)   /* the cgroup or one under it */
        return 0;
    return 1;
}

static __always_inline u64 sock_key(u32 tgid, u32 fd) { return ((u64)tgid << 32) | fd; }

/* No wake-up per record (an irq_work each, on the traced thread), but one per WAKE_BYTES written on a
 * CPU: a download fills the ring in milliseconds, and its drain must not wait for a timer. */
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

/* Recorded socket `key`'s plaintext stream, made now (born now, at 0 and 0) if it has none. NULL
 * only if the map cannot take it. A socket the LRU evicted starts again at 0 (user space sees a
 * position behind its own and says so). */
static __always_inline struct stream_pos *stream_of(u64 key) {
    struct stream_pos fresh = {.born = bpf_ktime_get_ns()};
    positions.insert(&key, &fresh);
    return positions.lookup(&key);
}

/* The birth of the stream: a call notes it when it starts, so that a socket closed (its entry
 * removed) or closed and reused (a new entry) while the call was in flight is told from its own at
 * the call's return. */
static __always_inline u64 stream_born(u64 key) {
    struct stream_pos *p = stream_of(key);
    return p ? p->born : 0;
}

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
        u64 key = sock_key(id >> 32, c.fd);
        c.recorded = socks.lookup(&key) ? 1 : 0;
        if (c.recorded)
            c.born = stream_born(key);
    }
    calls.update(&id, &c);
    return 0;
}

int ssl_read_enter(struct pt_regs *ctx) { return call_enter(ctx, CALL_READ, 0); }
int ssl_read_ex_enter(struct pt_regs *ctx) { return call_enter(ctx, CALL_READ, 1); }
int ssl_write_enter(struct pt_regs *ctx) { return call_enter(ctx, CALL_WRITE, 0); }
int ssl_write_ex_enter(struct pt_regs *ctx) { return call_enter(ctx, CALL_WRITE, 1); }
int ssl_handshake_enter(struct pt_regs *ctx) { return call_enter(ctx, CALL_HANDSHAKE, 0); }

/* A call that made no syscall and moved no plaintext, on an SSL* with no fd yet: with memory BIOs
 * (Node's TLSWrap, asyncio's SSLObject) the handshake output it produced is written to the socket by
 * the same thread right after it returns (Node: EncOut; asyncio: transport.write). The SSL* waits for
 * that write (bind_pending). An SSL* that moved plaintext first is never bound: its stream would
 * start in the middle. */
static __always_inline void wait_for_write(u64 id, struct tls_call *c) {
    if (c->has_fd && c->recorded)
        return;
    u64 ssl = c->ssl;
    if (ssl_moved.lookup(&ssl))
        return;
    struct pending_ssl p = {.ssl = ssl, .ts_ns = bpf_ktime_get_ns()};
    pending.update(&id, &p);
}

int ssl_handshake_exit(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    struct tls_call *c = calls.lookup(&id);
    if (c && c->kind == CALL_HANDSHAKE) {
        wait_for_write(id, c);
        calls.delete(&id);
    }
    return 0;
}

int ssl_free_enter(struct pt_regs *ctx) {
    u64 ssl = PT_REGS_PARM1(ctx);
    ssl_fd.delete(&ssl);
    ssl_moved.delete(&ssl);
    return 0;
}

/* The n plaintext bytes at user address `buf` that one call on recorded socket (tgid, fd) moved, in
 * records of at most CHUNK bytes. `born`: the socket's stream as the call met it when it started (0:
 * unknown). A call whose socket was closed meanwhile (Go closes a conn from one goroutine while
 * another's Write is returning; the close(2) may even run inside that Write, at its last unref) is
 * F_LATE: its bytes went out (or in) before the close, but no position was kept for them, and user
 * space puts them at the end of that connection. Every record carries its stream's birth (pos2): a
 * connection held open in user space after its close is never given the fd's next connection's bytes. */
static __always_inline int emit_plain(u32 tgid, u32 fd, u8 is_write, u64 buf, u64 n, u64 born) {
    u64 key = sock_key(tgid, fd);
    u64 start = 0;
    u8 late = 0;
    struct stream_pos *p = positions.lookup(&key);
    if (born && (!p || p->born != born)) {
        late = 1;             /* closed (and maybe reused) since the call started: no position */
    } else {
        if (!born && !socks.lookup(&key))
            return 0;         /* not a recorded connection: nothing to copy */
        if (!p)
            p = stream_of(key);
        if (p) {              /* where the call's bytes start; one thread moves a direction at a time */
            born = p->born;
            start = is_write ? p->wr : p->rd;
            if (is_write)
                p->wr = start + n;
            else
                p->rd = start + n;
        }
    }
    u32 cpu = bpf_get_smp_processor_id();
    struct tls_buf *b = scratch.lookup(&cpu);
    if (!b)
        return 0;
    __builtin_memset(&b->h, 0, sizeof(b->h));
    b->h.ts_ns = bpf_ktime_get_ns();
    b->h.pos = start;
    b->h.pos2 = born;
    if (late)
        b->h.flags = F_LATE;
    b->h.tgid = tgid;
    b->h.fd = fd;
    b->h.type = EV_PLAIN;
    b->h.is_write = is_write;
    u32 want = n > 0xffffffffULL ? 0xffffffff : (u32)n;
    b->h.total = want;
    if (want > MAX_BYTES) {
        want = MAX_BYTES;
        b->h.truncated = 1;
        count(C_TRUNCATED);
    }
    u64 base = buf;
    u32 offset = 0;
    for (int j = 0; j < MAX_BYTES / CHUNK; j++) {
        if (want == 0)
            break;
        u32 take = want > CHUNK ? CHUNK : want;
        u32 size = ((take - 1) & (CHUNK - 1)) + 1;    /* == take; visibly 1..CHUNK for the verifier */
        bpf_probe_read_user(b->data, size, (void *)base);
        b->h.len = size;
        b->h.offset = offset;
        if (tls_events.ringbuf_output(b, sizeof(b->h) + size, wake_flag(sizeof(b->h) + size)))
            count(C_LOST);
        base += size;
        offset += size;
        want -= size;
    }
    return 0;
}

/* The bytes the SSL call returned. */
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
        if (ret == 1 && c.outp)
            bpf_probe_read_user(&n, sizeof(n), (void *)c.outp);
    } else if (ret > 0) {
        n = ret;
    }
    if (n == 0) {
        wait_for_write(id, &c);   /* Node drives its handshake with SSL_read: -1, WANT_READ */
        return 0;
    }
    if (!c.has_fd || !c.recorded) {
        u64 ssl = c.ssl;
        if (!ssl_moved.lookup(&ssl)) {
            u8 one = 1;
            ssl_moved.update(&ssl, &one);
        }
        if (!c.has_fd)
            count(C_UNJOINED);
        return 0;             /* not a recorded connection (or one whose socket is unknown) */
    }
    return emit_plain(id >> 32, c.fd, c.kind == CALL_WRITE, c.buf, n, c.born);
}

/* ---- which fd an SSL* uses: the syscalls made inside its calls ---- */

#define PENDING_NS 20000000ULL   /* a handshake's output is written within microseconds of the call */

/* Outside any SSL call: a thread with a pending SSL* (wait_for_write) writes to a recorded socket:
 * that is where the handshake output went, so the SSL* is that socket's. A read of a recorded socket
 * first, or a write later than PENDING_NS, ends the wait unbound (the flow then stays ciphertext,
 * with its reason: never a guess). */
static __always_inline int bind_pending(u64 id, u32 fd, u8 is_write) {
    struct pending_ssl *p = pending.lookup(&id);
    if (!p)
        return 0;             /* the common case */
    u64 key = sock_key(id >> 32, fd);
    if (!socks.lookup(&key))
        return 0;             /* an eventfd, a pipe, a log file: keep waiting */
    u64 ssl = p->ssl;
    u8 fresh = bpf_ktime_get_ns() - p->ts_ns < PENDING_NS;
    pending.delete(&id);
    if (!is_write || !fresh)
        return 0;
    ssl_fd.update(&ssl, &fd);
    if (!tls_socks.lookup(&key)) {
        u8 one = 1;
        tls_socks.update(&key, &one);   /* before this syscall's exit, where the recorder looks */
    }
    return 0;
}

static __always_inline int io_enter(u32 fd, u8 is_write) {
    u64 id = bpf_get_current_pid_tgid();
    struct tls_call *c = calls.lookup(&id);
    if (!c)
        return bind_pending(id, fd, is_write);   /* the common case: not inside an SSL call */
    if (c->marked && c->fd == fd)
        return 0;             /* this call's socket is known and marked already */
    u64 key = sock_key(id >> 32, fd);
    u8 recorded = socks.lookup(&key) ? 1 : 0;
    if (c->has_fd && c->recorded && c->fd != fd && !recorded)
        return 0;             /* another fd inside the call (OpenSSL reading /dev/urandom, a log): the socket stays */
    if (!c->has_fd || c->fd != fd) {
        c->fd = fd;
        c->has_fd = 1;
        u64 ssl = c->ssl;
        ssl_fd.update(&ssl, &fd);
    }
    c->marked = 1;
    c->recorded = recorded;
    c->born = recorded ? stream_born(key) : 0;
    if (recorded && !tls_socks.lookup(&key)) {
        u8 one = 1;
        tls_socks.update(&key, &one);   /* the recorder's exit of this syscall sends a length only */
    }
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_read) { return io_enter(args->fd, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_write) { return io_enter(args->fd, 1); }
TRACEPOINT_PROBE(syscalls, sys_enter_readv) { return io_enter(args->fd, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_writev) { return io_enter(args->fd, 1); }
TRACEPOINT_PROBE(syscalls, sys_enter_recvfrom) { return io_enter(args->fd, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_sendto) { return io_enter(args->fd, 1); }
TRACEPOINT_PROBE(syscalls, sys_enter_recvmsg) { return io_enter(args->fd, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_sendmsg) { return io_enter(args->fd, 1); }

/* The connection's final positions: bytes whose records the ring lost at its end are a gap too. */
TRACEPOINT_PROBE(syscalls, sys_enter_close) {
    u64 id = bpf_get_current_pid_tgid();
    u64 key = sock_key(id >> 32, (u32)args->fd);
    struct stream_pos *p = positions.lookup(&key);
    if (!p)
        return 0;             /* every close of a socket with no recorded plaintext: one lookup */
    struct tls_hdr h = {};
    h.ts_ns = bpf_ktime_get_ns();
    h.pos = p->rd;
    h.pos2 = p->wr;
    h.tgid = id >> 32;
    h.fd = (u32)args->fd;
    h.type = EV_CLOSE;
    positions.delete(&key);
    if (tls_events.ringbuf_output(&h, sizeof(h), BPF_RB_NO_WAKEUP))
        count(C_LOST);
    return 0;
}


/* ---- Go crypto/tls (capture/ebpf/goelf.py finds the addresses and offsets) ----
 *
 *   (*Conn).handshakeContext entry --> the socket is marked in tls_socks before the handshake's first
 *       byte moves (the recorder then sends its ciphertext as a length only)
 *   (*Conn).Read / (*Conn).Write entry --> go_calls[(tgid, g)] = {fd, buffer}: keyed by the goroutine
 *       (its g, in R14 / X28 under the register ABI), not by thread: a goroutine blocked in Read
 *       resumes on another thread
 *   every return instruction of Read / Write --> PLAIN records of the n bytes moved (n is the first
 *       result register). Never uretprobes: they rewrite the return address on a goroutine stack that
 *       Go may move. An entry seen twice (the stack grew: morestack re-runs the prologue) only
 *       overwrites the same entry.
 *
 * The fd: c -> conn (a net.Conn interface: itab, data) -> *net.TCPConn -> fd *netFD -> pfd.Sysfd,
 * at offsets from the binary (go_conf). An interface whose itab is not *net.TCPConn's is another
 * net.Conn (a wrapper, a pipe): counted (C_GO_OTHER), never joined. Config per process (go_procs,
 * filled by user space as it finds Go processes, with the load bias of a PIE binary), else per entry
 * address (go_bins: a non-PIE binary's addresses are the same in every process that runs it, so a
 * process that starts while recording is read before user space has looked at it).
 */
#if defined(bpf_target_x86)
#define GO_G(ctx) ((ctx)->r14)
#define GO_R0(ctx) ((ctx)->ax)
#define GO_R1(ctx) ((ctx)->bx)
#elif defined(bpf_target_arm64)
#define GO_G(ctx) ((ctx)->regs[28])
#define GO_R0(ctx) ((ctx)->regs[0])
#define GO_R1(ctx) ((ctx)->regs[1])
#else
#define GO_G(ctx) 0
#define GO_R0(ctx) 0
#define GO_R1(ctx) 0
#endif

struct go_conf {
    u64 itab;             /* run-time address of go:itab.*net.TCPConn,net.Conn (0: not checked) */
    u32 conn;             /* tls.Conn.conn */
    u32 data;             /* the interface's data word */
    u32 fd;               /* TCPConn -> conn.fd */
    u32 sysfd;            /* netFD.pfd + poll.FD.Sysfd */
};

struct go_key {
    u64 g;
    u64 tgid;
};

struct go_call {
    u64 buf;
    u64 born;             /* the socket's stream when the call started (see emit_plain) */
    u32 fd;
    u8 is_write;
};

BPF_TABLE("lru_hash", u32, struct go_conf, go_procs, 4096);
BPF_HASH(go_bins, u64, struct go_conf, 1024);
BPF_TABLE("lru_hash", struct go_key, struct go_call, go_calls, 16384);

/* The recorded socket under *tls.Conn `c`, or -1. */
static __always_inline s64 go_conn_fd(struct pt_regs *ctx, u32 tgid, u64 c) {
    struct go_conf *cf = go_procs.lookup(&tgid);
    if (!cf) {
        u64 ip = PT_REGS_IP(ctx);
        cf = go_bins.lookup(&ip);
    }
    if (!cf || !c)
        return -1;
    u64 itab = 0, data = 0, nfd = 0;
    s64 sysfd = -1;
    if (bpf_probe_read_user(&itab, sizeof(itab), (void *)(c + cf->conn)))
        return -1;
    if (cf->itab && itab != cf->itab) {
        count(C_GO_OTHER);
        return -1;
    }
    if (bpf_probe_read_user(&data, sizeof(data), (void *)(c + cf->conn + cf->data)) || !data)
        return -1;
    if (bpf_probe_read_user(&nfd, sizeof(nfd), (void *)(data + cf->fd)) || !nfd)
        return -1;
    if (bpf_probe_read_user(&sysfd, sizeof(sysfd), (void *)(nfd + cf->sysfd)))
        return -1;
    if (sysfd < 0 || sysfd > 0x7fffffff)
        return -1;
    u64 key = sock_key(tgid, (u32)sysfd);
    if (!socks.lookup(&key))
        return -1;            /* not a recorded connection */
    if (!tls_socks.lookup(&key)) {
        u8 one = 1;
        tls_socks.update(&key, &one);
    }
    return sysfd;
}

static __always_inline int go_enter(struct pt_regs *ctx, u8 is_write) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!wanted_task(tgid))
        return 0;
    s64 fd = go_conn_fd(ctx, tgid, GO_R0(ctx));
    if (fd < 0)
        return 0;
    struct go_key k = {.g = GO_G(ctx), .tgid = tgid};
    struct go_call gc = {.buf = GO_R1(ctx), .fd = (u32)fd, .is_write = is_write,
                         .born = stream_born(sock_key(tgid, (u32)fd))};
    go_calls.update(&k, &gc);
    return 0;
}

int go_read_enter(struct pt_regs *ctx) { return go_enter(ctx, 0); }
int go_write_enter(struct pt_regs *ctx) { return go_enter(ctx, 1); }

int go_handshake_enter(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (wanted_task(tgid))
        go_conn_fd(ctx, tgid, GO_R0(ctx));
    return 0;
}

int go_rw_return(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    struct go_key k = {.g = GO_G(ctx), .tgid = id >> 32};
    struct go_call *p = go_calls.lookup(&k);
    if (!p)
        return 0;
    struct go_call gc = *p;
    go_calls.delete(&k);
    s64 n = (s64)GO_R0(ctx);
    if (n <= 0)
        return 0;
    return emit_plain(id >> 32, gc.fd, gc.is_write, gc.buf, (u64)n, gc.born);
}
