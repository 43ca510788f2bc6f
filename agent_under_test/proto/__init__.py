"""Generated gRPC code for shadowtest.agent.v1 (regenerate with `make proto`)."""
