"""The reference service under test: a gRPC trading agent that protects itself."""
