'use strict';
// A raw-bytes @grpc/grpc-js server on 127.0.0.1 port 0, for replaying recordings into (see
// tests/test_interop_grpcjs.py). Responses are deterministic functions of the requests and of the
// `x-replay-tag` request metadata, so a recording can hold exactly what this server answers:
//
//   /interop.Replay/Unary         "unary:<tag>:<request>"
//   /interop.Replay/ClientStream  "client:<tag>:<n>:<m1>|<m2>|..."
//   /interop.Replay/ServerStream  three messages "server:<i>:<tag>:<request>", i = 0, 1, 2
//   /interop.Replay/Bidi          each request m (i-th) answered at once with "bidi:<i>:<m>"
//   /interop.Replay/Fail          status NOT_FOUND (5), message "no such thing: <request>"
//
// Prints {"port": N} on stdout once bound. When stdin closes (or after --max-seconds) it prints one
// JSON summary {"calls": [{method, tag, user_agent, deadline_left_ms, keys, messages, bytes}, ...]} and exits.
//
//   node server.js [--max-seconds 120]

const grpc = require('@grpc/grpc-js');
const { serviceDefinition } = require('./rawbytes');

const SERVICE = 'interop.Replay';
let maxSeconds = 120;
for (let i = 2; i < process.argv.length; i += 2) {
  if (process.argv[i] === '--max-seconds') maxSeconds = Number(process.argv[i + 1]);
  else throw new Error(`unknown argument ${process.argv[i]}`);
}

const calls = [];
function seen(method, call) {
  const md = call.metadata;
  const first = (k) => { const v = md.get(k); return v.length ? String(v[0]) : null; };
  const deadline = call.getDeadline(); // a Date or a number (ms since the epoch); Infinity: none
  const deadlineMs = deadline instanceof Date ? deadline.getTime() : Number(deadline);
  const entry = { method, tag: first('x-replay-tag') || '-', user_agent: first('user-agent'),
    deadline_left_ms: Number.isFinite(deadlineMs) ? deadlineMs - Date.now() : null,
    keys: md.getMap ? Object.keys(md.getMap()).sort() : [], messages: 0, bytes: 0 };
  calls.push(entry);
  return entry;
}
const count = (entry, m) => { entry.messages += 1; entry.bytes += m.length; };

const impl = {
  Unary(call, callback) {
    const e = seen('Unary', call);
    count(e, call.request);
    callback(null, Buffer.concat([Buffer.from(`unary:${e.tag}:`), call.request]));
  },
  ClientStream(call, callback) {
    const e = seen('ClientStream', call);
    const got = [];
    call.on('data', (m) => { count(e, m); got.push(m); });
    call.on('end', () => {
      const joined = Buffer.concat(got.flatMap((m, i) => (i ? [Buffer.from('|'), m] : [m])));
      callback(null, Buffer.concat([Buffer.from(`client:${e.tag}:${got.length}:`), joined]));
    });
  },
  ServerStream(call) {
    const e = seen('ServerStream', call);
    count(e, call.request);
    for (let i = 0; i < 3; i++) call.write(Buffer.concat([Buffer.from(`server:${i}:${e.tag}:`), call.request]));
    call.end();
  },
  Bidi(call) {
    const e = seen('Bidi', call);
    let i = 0;
    call.on('data', (m) => {
      count(e, m);
      call.write(Buffer.concat([Buffer.from(`bidi:${i++}:`), m]));
    });
    call.on('end', () => call.end());
  },
  Fail(call, callback) {
    const e = seen('Fail', call);
    count(e, call.request);
    callback({ code: grpc.status.NOT_FOUND, details: `no such thing: ${call.request.toString()}` });
  },
};

const server = new grpc.Server({
  'grpc.max_receive_message_length': 16 << 20,
  'grpc.max_send_message_length': 16 << 20,
});
server.addService(serviceDefinition(SERVICE, {
  Unary: 'unary', ClientStream: 'client_stream', ServerStream: 'server_stream', Bidi: 'bidi', Fail: 'unary',
}), impl);

let finished = false;
function finish() {
  if (finished) return;
  finished = true;
  server.forceShutdown();
  process.stdout.write(`${JSON.stringify({ calls })}\n`, () => process.exit(0));
}

server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (err, port) => {
  if (err) {
    process.stdout.write(`${JSON.stringify({ fatal: String(err) })}\n`, () => process.exit(1));
    return;
  }
  process.stdout.write(`${JSON.stringify({ port, grpc_js_version: require('@grpc/grpc-js/package.json').version })}\n`);
});
process.stdin.on('data', () => {});
process.stdin.on('end', finish);
process.stdin.on('error', finish);
process.on('SIGTERM', finish);
setTimeout(finish, maxSeconds * 1000).unref();
