"""The test suite (a package so that tests share helpers via tests._mesa_cases)."""
