"""kvrelay public API: kvrelay.proto and its generated stubs (`make proto`)."""
