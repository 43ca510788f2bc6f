'use strict';
// Raw-bytes gRPC service definitions for @grpc/grpc-js: every message is a Buffer, passed through
// untouched (identity serializers), so no .proto file and no proto-loader are needed.

const identity = (b) => b;

/**
 * A grpc-js ServiceDefinition for `service` with `methods` = {Name: kind}, kind one of
 * 'unary', 'client_stream', 'server_stream', 'bidi'.
 */
function serviceDefinition(service, methods) {
  const def = {};
  for (const [name, kind] of Object.entries(methods)) {
    def[name] = {
      path: `/${service}/${name}`,
      requestStream: kind === 'client_stream' || kind === 'bidi',
      responseStream: kind === 'server_stream' || kind === 'bidi',
      requestSerialize: identity,
      requestDeserialize: identity,
      responseSerialize: identity,
      responseDeserialize: identity,
      originalName: name,
    };
  }
  return def;
}

/** Metadata as JSON: {key: [value, ...]}, binary (-bin) values as "hex:...". */
function metadataJson(md) {
  const out = {};
  if (!md) return out;
  for (const [key, values] of Object.entries(md.toJSON())) {
    out[key] = values.map((v) => (Buffer.isBuffer(v) ? `hex:${v.toString('hex')}` : String(v)));
  }
  return out;
}

module.exports = { serviceDefinition, metadataJson };
