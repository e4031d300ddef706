"""Generated gRPC stubs for the recserve.v1 wire contract (`make protos`). Do not edit."""
