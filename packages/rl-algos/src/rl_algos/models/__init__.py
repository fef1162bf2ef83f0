"""Model builders (tiny local models for tests and CPU runs)."""
