"""Test support that ships with the package: in-memory fakes of the pools (`fakes`)."""
