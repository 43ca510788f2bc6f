'use strict';
// A scripted @grpc/grpc-js client for interop checks against a raw-bytes gRPC server (the lean server
// of agent_under_test/h2server.py, hosted by tests/test_interop_grpcjs.py). It runs every check once
// and prints ONE JSON object {check: result} on stdout; a check that throws records {error: "..."}.
//
//   node client.js --target 127.0.0.1:PORT [--aging-target 127.0.0.1:PORT2] [--service interop.Bytes]
//                  [--checks unary,metadata,...] [--watchdog-ms 60000]
//
// Methods it expects on the service (all bytes in, bytes out):
//   Echo (unary): the request back.            Meta (unary): metadata echoed (see the Python side).
//   InitialBin (unary): "initial-bin", with initial metadata x-initial: hi and init-bin: 01 02 ff.
//   Sleep (unary): sleeps float(after ':') s.  Big (unary): int(request) bytes of a 0..255 pattern.
//   Fail (unary): raises -> UNKNOWN.            Count (client stream): "<n> <total bytes>".
//   Spray (server stream): int(request) messages, message i = 4-byte big-endian i repeated 25,000 times.
//   Chat (bidi): each request message m answered at once with "re:" + m.

// Keepalive pings and GOAWAYs are observed through grpc-js's own tracers, captured in memory below;
// they are read at module load, so they are set before grpc-js is required.
process.env.GRPC_TRACE = process.env.GRPC_TRACE || 'keepalive,transport';
process.env.GRPC_VERBOSITY = process.env.GRPC_VERBOSITY || 'DEBUG';

const crypto = require('crypto');
const grpc = require('@grpc/grpc-js');
const { serviceDefinition, metadataJson } = require('./rawbytes');

const traces = [];
const capture = (...args) => {
  if (traces.length < 20000) traces.push(args.join(' '));
};
grpc.setLogger({ error: capture, info: capture, debug: capture });
grpc.setLogVerbosity(grpc.logVerbosity.DEBUG);

function parseArgs(argv) {
  const opts = { service: 'interop.Bytes', checks: null, watchdogMs: 60000, target: null, agingTarget: null };
  for (let i = 0; i < argv.length; i += 2) {
    const [key, value] = [argv[i], argv[i + 1]];
    if (key === '--target') opts.target = value;
    else if (key === '--aging-target') opts.agingTarget = value;
    else if (key === '--service') opts.service = value;
    else if (key === '--checks') opts.checks = value.split(',').filter(Boolean);
    else if (key === '--watchdog-ms') opts.watchdogMs = Number(value);
    else throw new Error(`unknown argument ${key}`);
  }
  if (!opts.target) throw new Error('--target HOST:PORT is required');
  return opts;
}

const opts = parseArgs(process.argv.slice(2));
const MiB4 = 4 << 20;
const BASE_OPTIONS = {
  'grpc.max_send_message_length': 16 << 20,
  'grpc.max_receive_message_length': 16 << 20,
  // one connection per client object: checks must not share subchannels behind our back
  'grpc.use_local_subchannel_pool': 1,
};
const Client = grpc.makeGenericClientConstructor(
  serviceDefinition(opts.service, {
    Echo: 'unary', Meta: 'unary', InitialBin: 'unary', Sleep: 'unary', Big: 'unary', Fail: 'unary', Nope: 'unary',
    Count: 'client_stream', Spray: 'server_stream', Chat: 'bidi',
  }),
  opts.service,
);
const clients = [];
function newClient(target, extra = {}) {
  const c = new Client(target, grpc.credentials.createInsecure(), { ...BASE_OPTIONS, ...extra });
  clients.push(c);
  return c;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const deadlineIn = (ms) => new Date(Date.now() + ms);
const sha = (b) => crypto.createHash('sha256').update(b).digest('hex');

function errJson(err) {
  if (!err) return null;
  return { code: err.code, details: err.details, metadata: metadataJson(err.metadata) };
}

/** A unary call as a promise of {response, error, headers, trailers, ms}; never rejects. */
function unary(client, method, request, { metadata, deadlineMs = 5000, onCall } = {}) {
  return new Promise((resolve) => {
    const started = Date.now();
    const out = { headers: null, trailers: null };
    const md = metadata || new grpc.Metadata();
    const call = client[method](request, md, { deadline: deadlineIn(deadlineMs) }, (err, response) => {
      out.error = errJson(err);
      out.response = response === undefined ? null : response;
      out.ms = Date.now() - started;
      // the status event follows the callback in the same tick or the next; give it one turn
      setImmediate(() => resolve(out));
    });
    call.on('metadata', (m) => { out.headers = metadataJson(m); });
    call.on('status', (s) => { out.trailers = metadataJson(s.metadata); out.code = s.code; });
    if (onCall) onCall(call);
  });
}

/** The pattern the Python Big handler sends: bytes(range(256)) * (n // 256). */
function pattern(n) {
  const b = Buffer.alloc(n);
  for (let i = 0; i < n; i++) b[i] = i & 0xff;
  return b;
}

const checks = {
  async unary() {
    const c = newClient(opts.target);
    const hello = await unary(c, 'Echo', Buffer.from('hello grpc-js'));
    const empty = await unary(c, 'Echo', Buffer.alloc(0));
    return {
      hello: hello.response && hello.response.toString(), hello_code: hello.code, hello_error: hello.error,
      empty_len: empty.response && empty.response.length, empty_code: empty.code, empty_error: empty.error,
    };
  },

  async metadata() {
    const c = newClient(opts.target);
    const md = new grpc.Metadata();
    md.set('x-team', 'sre');
    md.add('x-multi', 'one');
    md.add('x-multi', 'two');
    md.set('blob-bin', Buffer.from([0x00, 0x01, 0x02, 0xff, 0xfe]));
    const r = await unary(c, 'Meta', Buffer.from('meta'), { metadata: md });
    const ib = await unary(c, 'InitialBin', Buffer.from('x'));
    const after = await unary(c, 'Echo', Buffer.from('after'));
    return {
      response: r.response && r.response.toString(), code: r.code, error: r.error,
      headers: r.headers, trailers: r.trailers,
      initial_bin_response: ib.response && ib.response.toString(), initial_bin_code: ib.code,
      initial_bin_error: ib.error, initial_bin_headers: ib.headers,
      after: after.response && after.response.toString(), after_code: after.code,
    };
  },

  async client_stream() {
    const c = newClient(opts.target);
    const chunks = [Buffer.from('ab'), Buffer.from('c')];
    for (let i = 0; i < 40; i++) chunks.push(Buffer.alloc(65536, i)); // 2.5 MiB: beyond the 1 MiB stream window
    const total = chunks.reduce((n, b) => n + b.length, 0);
    return new Promise((resolve) => {
      const out = { sent_messages: chunks.length, sent_bytes: total };
      const call = c.Count(new grpc.Metadata(), { deadline: deadlineIn(15000) }, (err, response) => {
        out.error = errJson(err);
        out.response = response ? response.toString() : null;
        setImmediate(() => resolve(out));
      });
      call.on('status', (s) => { out.code = s.code; out.trailers = metadataJson(s.metadata); });
      (async () => {
        for (const chunk of chunks) {
          if (!call.write(chunk)) await new Promise((r) => call.once('drain', r));
        }
        call.end();
      })();
    });
  },

  async server_stream() {
    const c = newClient(opts.target);
    return new Promise((resolve) => {
      const out = { indices: [], lengths: [], intact: true };
      const call = c.Spray(Buffer.from('12'), new grpc.Metadata(), { deadline: deadlineIn(15000) });
      call.on('data', (m) => {
        const i = m.readUInt32BE(0);
        out.indices.push(i);
        out.lengths.push(m.length);
        for (let off = 0; off < m.length; off += 4) if (m.readUInt32BE(off) !== i) { out.intact = false; break; }
      });
      call.on('error', (err) => { out.error = errJson(err); });
      call.on('status', (s) => { out.code = s.code; setImmediate(() => resolve(out)); });
    });
  },

  async bidi() {
    // Ping-pong: each message is written only after the answer to the previous one arrived, so the
    // server must answer a message while the request stream is still open.
    const c = newClient(opts.target);
    return new Promise((resolve) => {
      const out = { replies: [] };
      const words = ['alpha', 'beta', 'gamma', 'delta', 'x'.repeat(100000)];
      let next = 0;
      const call = c.Chat(new grpc.Metadata(), { deadline: deadlineIn(10000) });
      const send = () => {
        if (next < words.length) call.write(Buffer.from(words[next++]));
        else call.end();
      };
      call.on('data', (m) => {
        const s = m.toString();
        out.replies.push(s.length > 64 ? `${s.slice(0, 8)}...(${s.length})` : s);
        send();
      });
      call.on('error', (err) => { out.error = errJson(err); });
      call.on('status', (s) => { out.code = s.code; setImmediate(() => resolve(out)); });
      send();
    });
  },

  async deadline() {
    const c = newClient(opts.target);
    const r = await unary(c, 'Sleep', Buffer.from('deadline:5'), { deadlineMs: 300 });
    return { code: r.code, error: r.error, ms: r.ms };
  },

  async cancel() {
    const c = newClient(opts.target);
    let call = null;
    const pending = unary(c, 'Sleep', Buffer.from('cancel:7'), { deadlineMs: 10000, onCall: (x) => { call = x; } });
    await sleep(400); // the handler is sleeping by now
    const cancelledAt = Date.now();
    call.cancel();
    const r = await pending;
    await sleep(200); // let RST_STREAM reach the server before the client goes away
    return { code: r.code, error: r.error, ms_after_cancel: Date.now() - cancelledAt };
  },

  async large() {
    const c = newClient(opts.target);
    const req = crypto.randomBytes(MiB4); // exactly 4 MiB: the server's default receive limit
    const echo = await unary(c, 'Echo', req, { deadlineMs: 20000 });
    const big = await unary(c, 'Big', Buffer.from(String(MiB4)), { deadlineMs: 20000 });
    const over = await unary(c, 'Echo', Buffer.alloc(MiB4 + 1, 7), { deadlineMs: 20000 });
    const after = await unary(c, 'Echo', Buffer.from('after'), { deadlineMs: 5000 });
    return {
      echo_sent: req.length, echo_len: echo.response && echo.response.length,
      echo_equal: !!echo.response && sha(echo.response) === sha(req), echo_code: echo.code, echo_error: echo.error,
      big_len: big.response && big.response.length,
      big_equal: !!big.response && big.response.equals(pattern(MiB4)), big_code: big.code, big_error: big.error,
      over_code: over.code, over_details: over.error && over.error.details,
      after: after.response && after.response.toString(), after_code: after.code,
    };
  },

  async errors() {
    const c = newClient(opts.target);
    const fail = await unary(c, 'Fail', Buffer.from('x'));
    const nope = await unary(c, 'Nope', Buffer.from('x'));
    const after = await unary(c, 'Echo', Buffer.from('still serving'));
    return {
      fail_code: fail.code, fail_details: fail.error && fail.error.details,
      nope_code: nope.code, nope_details: nope.error && nope.error.details,
      after: after.response && after.response.toString(),
    };
  },

  async keepalive() {
    // Pings every second, allowed without calls; the connection must stay READY while idle (no
    // GOAWAY, no ping timeout) and calls before and after must succeed on it.
    const c = newClient(opts.target, {
      'grpc.keepalive_time_ms': 1000,
      'grpc.keepalive_timeout_ms': 1000,
      'grpc.keepalive_permit_without_calls': 1,
    });
    const port = opts.target.split(':').pop();
    const states = [];
    const channel = c.getChannel();
    let watching = true;
    const watch = () => {
      const s = channel.getConnectivityState(false);
      channel.watchConnectivityState(s, deadlineIn(10000), (err) => {
        if (!watching || err) return;
        states.push(grpc.connectivityState[channel.getConnectivityState(false)]);
        watch();
      });
    };
    const tag = (v) => { const m = new grpc.Metadata(); m.set('x-check', v); return m; };
    const first = await unary(c, 'Echo', Buffer.from('ka-1'), { metadata: tag('keepalive-1') });
    watch();
    const mark = traces.length;
    await sleep(3500);
    const second = await unary(c, 'Echo', Buffer.from('ka-2'), { metadata: tag('keepalive-2') });
    watching = false;
    const mine = traces.slice(mark).filter((t) => t.includes(`:${port} `));
    return {
      first: first.response && first.response.toString(), first_code: first.code,
      second: second.response && second.response.toString(), second_code: second.code,
      pings_sent: mine.filter((t) => t.includes('Sending ping')).length,
      ping_acks: mine.filter((t) => t.includes('Received ping response')).length,
      ping_failures: mine.filter((t) => /Ping timeout|Ping failed|Ping send failed/.test(t)),
      goaways: mine.filter((t) => t.includes('GOAWAY')),
      states_while_idle: states,
      state_after_idle: grpc.connectivityState[channel.getConnectivityState(false)],
    };
  },

  async goaway() {
    // Against a server with a short max connection age: calls every 100 ms for 2.5 s must all
    // succeed while the server sends GOAWAY and grpc-js reconnects.
    if (!opts.agingTarget) return { skipped: 'no --aging-target' };
    const c = newClient(opts.agingTarget);
    const port = opts.agingTarget.split(':').pop();
    const mark = traces.length;
    const results = [];
    const started = Date.now();
    for (let i = 0; i < 60 && Date.now() - started < 2500; i++) {
      const m = new grpc.Metadata();
      m.set('x-check', `goaway-${i}`);
      const r = await unary(c, 'Echo', Buffer.from(`age-${i}`), { metadata: m });
      results.push({ ok: r.code === grpc.status.OK && !!r.response && r.response.toString() === `age-${i}`,
        code: r.code, details: r.error && r.error.details });
      await sleep(100);
    }
    const mine = traces.slice(mark).filter((t) => t.includes(`:${port} `));
    return {
      calls: results.length,
      ok: results.filter((r) => r.ok).length,
      failed: results.filter((r) => !r.ok),
      goaways: mine.filter((t) => t.includes('connection closed by GOAWAY')),
    };
  },
};

async function main() {
  const names = opts.checks || Object.keys(checks);
  for (const n of names) if (!(n in checks)) throw new Error(`unknown check ${n}`);
  const results = {};
  const run = async (n) => {
    try {
      results[n] = await checks[n]();
    } catch (e) {
      results[n] = { error: String(e && e.stack ? e.stack : e) };
    }
  };
  // the slow, time-based checks run side by side on their own connections; the rest one by one
  const slow = names.filter((n) => n === 'keepalive' || n === 'goaway');
  const background = Promise.all(slow.map(run));
  for (const n of names.filter((x) => !slow.includes(x))) await run(n);
  await background;
  for (const c of clients) c.close();
  return results;
}

const watchdog = setTimeout(() => {
  process.stdout.write(`${JSON.stringify({ fatal: `watchdog: not done after ${opts.watchdogMs} ms` })}\n`);
  process.exit(2);
}, opts.watchdogMs);

main().then((results) => {
  clearTimeout(watchdog);
  results.grpc_js_version = require('@grpc/grpc-js/package.json').version;
  process.stdout.write(`${JSON.stringify(results)}\n`, () => process.exit(0));
}, (e) => {
  clearTimeout(watchdog);
  process.stdout.write(`${JSON.stringify({ fatal: String(e && e.stack ? e.stack : e) })}\n`, () => process.exit(1));
});
