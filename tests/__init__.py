"""The test suite: unit, integration (mock workers over the real protocol) and end-to-end tests."""
