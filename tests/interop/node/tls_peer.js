'use strict';
// Node.js TLS peers for tests/test_capture_node_tls.py: Node's OpenSSL (linked into the node binary)
// over its TLSWrap memory buffers, as an HTTPS server and client and as a @grpc/grpc-js TLS server and
// client. Every mode prints its own tally as JSON lines, the ground truth the recording is held to.
//
//   node tls_peer.js https-server CERT KEY    prints {"port": N}; per answered request
//                                             {"call": "METHOD PATH", "status": S, "bytes": N}; ends when
//                                             stdin closes
//   node tls_peer.js https-client CA URL...   waits for a line on stdin, then GETs each URL on one
//                                             keep-alive connection: {"status": S, "bytes": N} each
//   node tls_peer.js grpc-server CERT KEY     prints {"port": N}; per call {"call": "/interop.Tls/M",
//                                             "code": C}; ends when stdin closes
//   node tls_peer.js grpc-client CA PORT N    waits for a line on stdin, then N unary Echo calls and one
//                                             Fail call: {"call": ..., "code": C, "bytes": N} each
//
// A request to /size/N is answered with N bytes: many TLS records, one write.

const fs = require('fs');
const https = require('https');
const readline = require('readline');

const [mode, ...args] = process.argv.slice(2);
const say = (obj) => process.stdout.write(`${JSON.stringify(obj)}\n`);
const onStdinEnd = (fn) => { process.stdin.on('data', () => {}); process.stdin.on('end', fn); };
const afterFirstLine = (fn) => {
  const rl = readline.createInterface({ input: process.stdin });
  rl.once('line', () => { rl.close(); fn(); });
};
const SERVICE = 'interop.Tls';

function httpsServer(certFile, keyFile) {
  const server = https.createServer({ cert: fs.readFileSync(certFile), key: fs.readFileSync(keyFile) },
    (req, res) => {
      const chunks = [];
      req.on('data', (c) => chunks.push(c));
      req.on('end', () => {
        const body = Buffer.concat(chunks);
        let status = 200;
        let answer;
        const m = /^\/size\/(\d+)$/.exec(req.url);
        if (m) answer = Buffer.from('0123456789'.repeat(Number(m[1]) / 10 + 1).slice(0, Number(m[1])));
        else if (req.url === '/missing') { status = 404; answer = Buffer.from('no such thing'); }
        else answer = Buffer.from(`node saw ${req.method} ${req.url} with ${body.length} bytes`);
        res.writeHead(status, { 'content-type': 'text/plain', 'content-length': answer.length });
        res.end(answer);
        say({ call: `${req.method} ${req.url}`, status, bytes: answer.length });
      });
    });
  server.listen(0, '127.0.0.1', () => say({ port: server.address().port }));
  onStdinEnd(() => server.close(() => process.exit(0)));
  setTimeout(() => process.exit(0), 900000).unref();   // a safety net: stdin closing ends it
}

function httpsClient(caFile, urls) {
  const agent = new https.Agent({ keepAlive: true, maxSockets: 1, ca: fs.readFileSync(caFile) });
  afterFirstLine(async () => {
    for (const url of urls) {
      const got = await new Promise((resolve, reject) => {
        https.get(url, { agent, headers: { authorization: 'Bearer node-client-secret-8e2f' } }, (res) => {
          let n = 0;
          res.on('data', (c) => { n += c.length; });
          res.on('end', () => resolve({ status: res.statusCode, bytes: n }));
        }).on('error', reject);
      });
      say(got);
    }
    agent.destroy();
  });
}

function grpcDefinition() {
  const identity = (b) => b;
  const def = {};
  for (const name of ['Echo', 'Fail']) {
    def[name] = { path: `/${SERVICE}/${name}`, requestStream: false, responseStream: false,
      requestSerialize: identity, requestDeserialize: identity, responseSerialize: identity,
      responseDeserialize: identity, originalName: name };
  }
  return def;
}

function grpcServer(certFile, keyFile) {
  const grpc = require('@grpc/grpc-js');
  const server = new grpc.Server();
  server.addService(grpcDefinition(), {
    Echo(call, callback) {
      say({ call: `/${SERVICE}/Echo`, code: 0 });
      callback(null, Buffer.concat([Buffer.from('echo:'), call.request]));
    },
    Fail(call, callback) {
      say({ call: `/${SERVICE}/Fail`, code: grpc.status.NOT_FOUND });
      callback({ code: grpc.status.NOT_FOUND, details: 'no such thing' });
    },
  });
  const creds = grpc.ServerCredentials.createSsl(null,
    [{ cert_chain: fs.readFileSync(certFile), private_key: fs.readFileSync(keyFile) }], false);
  server.bindAsync('127.0.0.1:0', creds, (err, port) => {
    if (err) { say({ fatal: String(err) }); process.exit(1); }
    say({ port });
  });
  onStdinEnd(() => { server.forceShutdown(); process.exit(0); });
  setTimeout(() => process.exit(0), 900000).unref();   // a safety net: stdin closing ends it
}

function grpcClient(caFile, port, n) {
  const grpc = require('@grpc/grpc-js');
  const Client = grpc.makeGenericClientConstructor(grpcDefinition(), SERVICE);
  afterFirstLine(async () => {
    const client = new Client(`127.0.0.1:${port}`, grpc.credentials.createSsl(fs.readFileSync(caFile)));
    const call = (name, payload) => new Promise((resolve) => {
      const md = new grpc.Metadata();
      md.set('authorization', 'Bearer grpc-js-secret-3a7c');
      client[name](payload, md, (err, reply) => resolve(
        { call: `/${SERVICE}/${name}`, code: err ? err.code : 0, bytes: reply ? reply.length : 0 }));
    });
    for (let i = 0; i < n; i++) say(await call('Echo', Buffer.from(`hello ${i}`)));
    say(await call('Fail', Buffer.from('nothing')));
    client.close();
  });
}

if (mode === 'https-server') httpsServer(args[0], args[1]);
else if (mode === 'https-client') httpsClient(args[0], args.slice(1));
else if (mode === 'grpc-server') grpcServer(args[0], args[1]);
else if (mode === 'grpc-client') grpcClient(args[0], Number(args[1]), Number(args[2]));
else { process.stderr.write('usage: see the comment at the top\n'); process.exit(2); }
