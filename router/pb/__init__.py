"""Generated gRPC stubs for proto/kvrelay.proto (`make proto` writes them; never edit)."""
